"""`inv remove`: stop the deployment (as `inv stop` does), remove its boot hook, then delete its
deploy_dir, only once it is proven this deployment's (conf/hostagent.json records its deployment id),
holds nothing deploy did not put there, and nothing of the deployment runs any more."""
from __future__ import annotations

import json
import shlex

from hostagent import layout
from hostagent.facts import HostFacts

from fleet.commands.stop import stop
from fleet.errors import FleetError
from fleet.facts import state as facts
from fleet.host import boot
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport.connection import Transport

# What deploy puts directly under deploy_dir: anything else there is not ours to delete.
OURS = {layout.RUN, layout.LOGS, layout.CONF, layout.BIN, layout.LIB, layout.SIM_DEV, layout.HOSTAGENT_CODE,
        layout.PROXY_CODE}


def recorded_id(conn: Transport, hv: HostVars) -> str | None:
    """The deployment id deploy recorded in deploy_dir (conf/hostagent.json), None when there is none."""
    raw = conn.read(layout.path(hv.settings.deploy_dir, layout.HOSTAGENT_CONF))
    try:
        return json.loads(raw)["deployment_id"] if raw else None
    except (ValueError, KeyError, TypeError):
        return None


def running(found: HostFacts) -> list[str]:
    """What of the deployment still runs, by the state probe's facts (each part proven ours)."""
    parts = [f"instance {f.index}" for f in found.instances if f.alive]
    parts += [name for name, alive in (("the proxy", found.proxy.alive),
                                       ("nginx", found.nginx.alive),
                                       ("the keeper", found.keeper.alive)) if alive]
    named = {str(f.index) for f in found.instances if f.alive}
    tagged = sorted({t.pid for t in found.tagged if t.part not in named})
    if tagged:
        parts.append(f"{len(tagged)} process(es) with its tag (pid {', '.join(map(str, tagged[:5]))})")
    return parts


def _prove(conn: Transport, hv: HostVars) -> list[str]:
    """Refuse (one sentence) a deploy_dir that is not this deployment's; its top-level entries back."""
    d = hv.settings.deploy_dir
    if d.rstrip("/") in ("", conn.home().rstrip("/")):
        raise FleetError(f"{hv.name}: deploy_dir is {d}, the home directory or the root: inv remove deletes "
                         "no such directory; remove the deployment's files by hand.")
    got = recorded_id(conn, hv)
    if got is None:
        raise FleetError(f"{hv.name}: {d} records no deployment id ({layout.HOSTAGENT_CONF} is missing or "
                         "unreadable), so it is not proven this deployment's; nothing was deleted: check the "
                         "directory and remove it by hand if it is yours.")
    if got != hv.deployment_id:
        raise FleetError(f"{hv.name}: {d} is the deployment {got}'s, not this inventory's ({hv.deployment_id}); "
                         "nothing was deleted: check deploy_dir in the inventory.")
    r = conn.run(f"cd {shlex.quote(d)} && ls -A")
    entries = r.stdout.split()
    strangers = sorted(set(entries) - OURS)
    if strangers:
        raise FleetError(f"{hv.name}: {d} holds what deploy did not put there ({', '.join(strangers[:5])}); "
                         "nothing was deleted: move those elsewhere, then run inv remove again.")
    return entries


def remove(conn: Transport, hv: HostVars, emit: Emit = lambda line: None, check: bool = False,
           wait: bool = False) -> Report:
    """Stop, remove the boot hook, delete deploy_dir; check: say what would go, change nothing."""
    hv = facts.prepare(conn, hv)
    d = hv.settings.deploy_dir
    if not conn.exists(d):
        report = Report(hv.name)
        boot.remove(conn, hv, report, check, emit)
        emit(f"deploy_dir: {report.add('deploy_dir', 'ok', f'{d} does not exist: nothing to delete').message}")
        return report
    entries = _prove(conn, hv)
    report = stop(conn, hv, emit, check=check, wait=wait)   # the hook goes first, under stop's lock
    left = running(facts.probe(conn, hv, readonly=True))
    if left and not check:
        raise FleetError(f"{hv.name}: {', '.join(left)} of the deployment still run(s) after the stop, so "
                         f"{d} was not deleted; `inv stop --host {hv.name} --force`, then inv remove again.")
    size = conn.run(f"du -sk {shlex.quote(d)} 2>/dev/null").stdout.split()
    what = f"{d} ({', '.join(sorted(entries))}; {int(size[0]) / 1024:.1f} MiB)" if size else d
    if check:
        emit(f"deploy_dir: {report.add('deploy_dir', 'changed', f'would delete {what}').message}")
        return report
    r = conn.run(f"rm -rf -- {shlex.quote(d)}")
    if not r.ok or conn.exists(d):
        report.add("deploy_dir", "failed", f"could not delete {d}: {r.stderr.strip()[-300:] or 'it is still there'}")
        return report
    emit(f"deploy_dir: {report.add('deploy_dir', 'changed', f'deleted {what}').message}")
    report.status = None
    return report
