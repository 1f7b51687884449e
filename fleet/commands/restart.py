"""`inv restart`: under the deployment's run lock, the files first, then the host agent's one restart
(hostagent/restart.py), run on the host through the transport as the swaps are: drain, wait for
in-flight, stop by identity, wait for the card, start, wait for /health, enable, wait until the proxy
routes to it. Rolling: every instance in turn, never more than one out. The keeper calls the same
function on the host.
"""
from __future__ import annotations

from hostagent import layout

from fleet.commands import entries
from fleet.errors import FleetError
from fleet.facts import state as facts
from fleet.host import runlock, sync
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport import agent


def restart(conn, hv: HostVars, emit: Emit = lambda line: None, instance: int | None = None,
            rolling: bool = False, wait: bool = False) -> Report:
    """Restart one instance, or every instance in turn (rolling); stops at the first that fails.
    wait: when another run (or the keeper's restart) holds the deployment's lock, wait for it instead of
    failing at once."""
    hv = facts.prepare(conn, hv)
    if (instance is None) == (not rolling):
        raise FleetError("restart needs either --instance I or --rolling.")
    if instance is not None and not 0 <= instance < hv.settings.instances:
        raise FleetError(f"{hv.name}: there is no instance {instance}; instances are 0-{hv.settings.instances - 1}.")
    with runlock.held(conn, hv, "restart", emit, wait):
        return _restart(conn, hv, emit, instance)


def _restart(conn, hv: HostVars, emit: Emit, instance: int | None) -> Report:
    report = Report(hv.name)
    files = sync.host_files(hv)
    found = facts.probe(conn, hv, [f.path for f in files], readonly=True)
    if not found.files.get(layout.START_CLUSTER):
        raise FleetError(f"{hv.name} is not deployed under {hv.settings.deploy_dir}; run "
                         f"`inv deploy --host {hv.name}` first.")
    # The instance starts with the current inventory: put what changed (the proxy keeps running as is).
    sync.put_files(conn, hv, files, found, report)
    if not hv.entry_hosts():
        what = "--rolling" if instance is None else f"--instance {int(instance)}"
        agent.steps(conn, hv, f"restart {what} --locked", report, emit)
    else:      # one at a time from here, each out of the entry hosts' proxies too (fleet.commands.entries)
        for i in range(hv.settings.instances) if instance is None else [int(instance)]:
            with entries.drained(hv, [i], report, emit):
                agent.steps(conn, hv, f"restart --instance {i} --locked", report, emit)
            if report.failed:
                left = list(range(i + 1, hv.settings.instances)) if instance is None else []
                if left:
                    report.add("rolling", "failed", f"stopped after instance {i}; instance(s) "
                               f"{', '.join(map(str, left))} were not restarted")
                break
    report.status = facts.status_of(hv, facts.probe(conn, hv))
    return report
