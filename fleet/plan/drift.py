"""What a deploy would undo of the running deployment without the inventory saying so in words: a run
from another inventory file than the one the host was deployed from (forgetting FLEET_INVENTORY in a new
shell), and settings it would switch off (API keys, tenants, virtual addresses). Deploy and `deploy
--check` say these first; the restarts they cause are listed as always.
"""
from __future__ import annotations

import os
import re

from hostagent.facts import HostFacts

from fleet.settings.inventory import HostVars

# The header every rendered conf/proxy.yaml begins with (fleet/templates/proxy.yaml.j2).
HEADER = re.compile(r"rendered by vllm-fleet from (.+)\.$")


def _same_file(a: str, b: str) -> bool:
    """Whether two inventory paths name one file. Deploys record the absolute path; a relative one (written
    by a version before that) was relative to a directory no longer known: it matches an absolute path
    that ends with it, for the one deploy after an upgrade (the next records the absolute path)."""
    if a == b or os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b)):
        return True
    relative = [p for p in (a, b) if not os.path.isabs(os.path.expanduser(p))]
    return len(relative) == 1 and (a if relative[0] == b else b).endswith("/" + os.path.normpath(relative[0]))


def read_deployed(found: HostFacts) -> dict:
    """The inventory path the deployed files name, and whether keepalived of an earlier deploy runs (both
    read by the state probe: conf/proxy.yaml's header, run/keepalived.pid)."""
    header = HEADER.search(found.proxy_conf_head)
    return {"inventory": header.group(1) if header else None, "keepalived": found.keepalived_recorded}


def _running(found: HostFacts) -> bool:
    """Whether any process of the deployment runs (a stopped one leaves its files, and nothing to undo)."""
    return (found.proxy.alive or found.keeper.alive or found.nginx.alive
            or any(i.alive for i in [*found.instances, *found.retired]))


def sentences(hv: HostVars, found: HostFacts, deployed: dict) -> list[str]:
    """One sentence per thing this run would undo (found: the state probe's; deployed: read_deployed's)."""
    out = []
    was = deployed.get("inventory")
    if was and hv.inventory_path and not _same_file(was, hv.inventory_path) and _running(found):
        out.append(f"{hv.name} was deployed from {was}; this run uses {hv.inventory_path} (set FLEET_INVENTORY "
                   "or -i to the first if that is the one you mean)")
    running = found.proxy.config or {}
    if running.get("api_keys") and not hv.settings.proxy.api_keys_file:
        out.append("the running proxy checks API keys and this inventory sets no proxy.api_keys_file: the "
                   "entry port would take requests without a key")
    tenants = sorted({t["name"] for t in running.get("tenants") or []} - {"default"} - set(hv.settings.proxy.tenants))
    if tenants:
        out.append(f"the running proxy shares its slots among the tenant(s) {', '.join(tenants)}, which this "
                   "inventory's proxy.tenants does not define: the deploy turns them off")
    if deployed.get("keepalived") and not hv.vrrp_group:
        out.append("keepalived of an earlier deploy runs here and this inventory sets no vrrp: the deploy "
                   "leaves it running its old config")
    return out
