"""Facts about one deployment, read on the host itself: run there as `python3 - SPEC_JSON` with this
file on standard input, bundled with the host agent modules it imports (fleet.transport.hostcode.probe), it prints
one JSON object.
Standard library only, Python 3.7+, no side effects but one: an instance seen healthy gets a
`run/instance_<i>.ready` marker, so a later 503 reads as dead, not as loading. Each instance's `state`
(and `reason`) is hostagent.instances.classify's, the keeper's own classification.
What each part is read as lives in hostagent/observe.py, which the live view's sampler shares; the answer's
records are declared in hostagent/facts.py (the control plane parses them with it).
"""
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from hostagent import apikeys, boothook, facts, layout, lora, vrrp
from hostagent.observe import (
    HEALTH_TIMEOUT_S,
    file_mode,
    instance_facts,
    keeper_facts,
    nginx_facts,
    proxy_facts,
    read_launch,
    read_mode,
    sha256,
    tagged,
)


def _past(d, n):
    """The instance indexes at or past n that have a pid file under run/."""
    try:
        names = os.listdir(layout.path(d, layout.RUN))
    except OSError:
        return []
    return sorted(i for i in map(layout.pidfile_instance, names) if i is not None and i >= n)


def _first_line(path):
    try:
        with open(path) as f:
            return f.readline().rstrip("\n")
    except (OSError, ValueError):
        return ""


def read(spec):
    """The state of the deployment spec names, as hostagent.facts' wire form (a JSON-ready dict)."""
    d = spec["deploy_dir"]
    with ThreadPoolExecutor(max_workers=16) as pool:
        dep = spec["deployment_id"]
        host = spec.get("instance_host", "127.0.0.1")
        timeout_s = float(spec.get("health_timeout_s", HEALTH_TIMEOUT_S))
        inst = [pool.submit(instance_facts, d, dep, i, p, spec.get("readonly", False), host, timeout_s)
                for i, p in enumerate(spec["ports"])]
        prox = pool.submit(proxy_facts, d, dep, spec["proxy_port"], spec["admin_port"],
                           spec.get("proxy_address", "127.0.0.1"))
        files = {rel: pool.submit(sha256, os.path.join(d, rel)) for rel in spec.get("files", [])}
        # Instances past the inventory's that still run (their group removed, fewer instances): deploy
        # retires them once the proxy no longer routes to them.
        retired = [facts.Instance(**dict(f, launch=read_launch(d, f["index"]))) for f in (
            instance_facts(d, dep, i, spec["base_port"] + i, True, host, timeout_s)
            for i in _past(d, len(spec["ports"]))) if f["alive"]]
        out = facts.HostFacts(
            uid=os.getuid(), deploy_dir_exists=os.path.isdir(d), proxy=facts.Proxy(**prox.result()),
            instances=[facts.Instance(**f.result()) for f in inst],
            launches=[read_launch(d, i) for i in range(len(spec["ports"]))], retired=retired,
            nginx=facts.Nginx(**nginx_facts(d, dep)), keeper=facts.Keeper(**keeper_facts(d, dep)),
            files={rel: f.result() for rel, f in files.items()},
            file_modes={rel: file_mode(os.path.join(d, rel)) for rel in spec.get("files", [])},
            tagged=[facts.Tagged(**t) for t in tagged(layout.tag_prefix(dep))])
    out.lora_adapters, out.lora_record_error = lora.read_record_quiet(d)
    out.mode = read_mode(d)
    out.proxy_conf_head = _first_line(layout.path(d, layout.PROXY_CONF))
    try:
        out.keepalived_recorded = os.path.getsize(layout.path(d, layout.KEEPALIVED_PID)) > 0
    except OSError:
        pass
    if spec.get("api_keys_file"):
        # The key file's keys by their digest (never the keys), and the digest of nginx's map of them: a
        # deploy compares them with what the running front took. A relative path is the proxy's: deploy_dir.
        out.api_keys = facts.KeyDigests(**apikeys.file_digest(os.path.join(d, os.path.expanduser(spec["api_keys_file"]))),
                               nginx_digest=apikeys.conf_digest(layout.path(d, layout.NGINX_KEYS)))
    if spec.get("vrrp"):          # an entry behind virtual addresses: who holds them, keepalived's state
        out.vrrp = facts.record(facts.VrrpState, vrrp.state({"deploy_dir": d, "deployment_id": spec["deployment_id"],
                                                             "vrrp": spec["vrrp"]}))
    if spec.get("boot"):          # inv status: the installed boot hook (reads the crontab)
        hook = boothook.show(dep)
        out.boot, out.asked_boot = facts.record(facts.BootHook, hook) if hook else None, True
    wanted = spec.get("boot_wanted")
    if wanted:                    # deploy: would installing the hook change anything
        out.boot_as_wanted = boothook.as_wanted(d, dep, wanted["kind"], wanted["watchdog"])
    return facts.wire(out)


def main():
    json.dump(read(json.loads(sys.argv[1])), sys.stdout)


if __name__ == "__main__":
    main()
