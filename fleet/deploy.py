"""`inv deploy`: the doctor's checks, then put the changed files, start what is not running (staggered by
start_cluster.sh), wait for each /health, start or update the front, start the keeper, install the boot
hook (fleet.boot). A second deploy on a running cluster starts nothing and reports changed=0.
"""
from __future__ import annotations

import shlex

from hostagent import layout

from . import agent, boot, facts, front, preflight, release, runlock, sync
from . import keeper as fleet_keeper
from .doctor import doctor as run_doctor
from .doctor import entry_port_check
from .errors import RemoteError
from .inventory import HostVars
from .report import Emit, Report
from .stop import stop_processes
from .transport import Transport


def deploy(conn: Transport, hv: HostVars, emit: Emit = lambda line: None,
           check: bool = False, diff: bool = False, doctor: bool = True, wait: bool = False) -> Report:
    """Put changed files, start what is not running, wait for /health, start the proxy.

    doctor: run fleet.doctor's checks first; a failed check stops the deploy before it changes anything.
    wait: when another run holds the deployment's lock, wait for it instead of failing at once.
    """
    hv = facts.prepare(conn, hv)
    preflight.check(conn, hv, "deploy")   # the tools every step needs: one sentence naming what is missing
    with runlock.held_unless(check, conn, hv, "deploy", emit, wait):
        return _deploy(conn, hv, emit, check, diff, doctor)


def _deploy(conn: Transport, hv: HostVars, emit: Emit, check: bool, diff: bool, doctor: bool) -> Report:
    report = Report(hv.name)
    entry = entry_port_check(hv)
    if entry.status != "ok":         # said beside the recap, doctor or not: it is the inventory's choice
        report.warn(f"{entry.name}: {entry.message}; {entry.fix}")
    if doctor:
        run_doctor(conn, hv, emit, report)
        if report.failed:
            emit("doctor: a check failed; fix it, or deploy with --no-doctor to skip the checks")
            return report
    files = sync.host_files(hv)
    found = facts.probe(conn, hv, [f.path for f in files], readonly=check)
    strangers = facts.foreign_ports(hv, found)
    if strangers:
        # Nothing starts beside a stranger on our ports (the doctor says the same when it runs).
        for port, sentence in strangers:
            report.add(f"port {port}", "failed", sentence)
        report.status = facts.status_of(hv, found)
        return report
    d = hv["deploy_dir"]

    changed_files = sync.put_files(conn, hv, files, found, report, emit, check, diff)
    if hv["accelerator"] == "sim" and not check:
        # Device files are created once and never replaced: holders keep the inode they opened.
        devs = " ".join(shlex.quote(layout.path(d, f"{layout.SIM_DEV}/{n}")) for n in
                        ["kfd"] + [f"renderD{128 + i}" for i in range(hv["accelerators"])])
        conn.run(f"mkdir -p {shlex.quote(layout.path(d, layout.SIM_DEV))} && touch {devs}")

    # Instances with processes left behind (an API server killed, its EngineCore children still holding
    # the card): those are stopped by group and tag, and their card released, before they start again.
    leftovers = {t["tag"].rpartition("/")[2] for t in found.get("tagged", [])}
    to_start = []
    for f, state in ((f, f["state"]) for f in found["instances"]):
        name = f"instance {f['index']}"
        if state in ("healthy", "loading"):
            note = "" if layout.START_CLUSTER not in changed_files else \
                " (runs with the previous settings; `inv restart --rolling` applies the new ones)"
            report.add(name, "ok", f"already {state} on :{f['port']}, pid {f['pid']}{note}")
        elif state == "port-taken":
            # Strangers were refused above: this holder carries the instance's tag, but its pid file is
            # lost or stale. It is stopped (tag and session) and the instance started again.
            to_start.append(f)
            report.data.setdefault("restart", []).append(f["index"])
        else:
            to_start.append(f)
            if (state == "dead" and f["alive"]) or str(f["index"]) in leftovers:
                report.data.setdefault("restart", []).append(f["index"])

    if check:
        for f in to_start:
            verb = "restart (dead)" if f["index"] in report.data.get("restart", []) else "start"
            report.add(f"instance {f['index']}", "changed", f"would {verb} on :{f['port']}")
    elif to_start:
        _start_instances(conn, hv, to_start, report, emit)

    front.deploy_front(conn, hv, found, changed_files, report, emit, check)
    if hv["instances"]:
        fleet_keeper.deploy(conn, hv, found, changed_files, report, emit, check)
    # Last, once what it would start runs: after a reboot, bin/boot.sh starts it all again.
    boot.deploy(conn, hv, report, emit, check)
    for step in report.steps:
        if step.message:
            emit(f"{step.status}: {step.name}: {step.message}")
    report.status = facts.status_of(hv, facts.probe(conn, hv, readonly=check, boot=True))
    return report


def _start_instances(conn, hv, to_start, report, emit):
    d = hv["deploy_dir"]
    bin_dir = shlex.quote(f"{d}/bin")
    stopped = report.data.get("restart", [])
    for index in stopped:
        emit(f"instance {index}: dead, or its processes left behind; stopping them (group and tag) "
             "before the start")
        stop_processes(conn, hv, ["--instance", str(index)], emit)
    if stopped:
        _, pending, _ = release.wait_released(conn, hv, stopped, emit)
        if pending:
            raise RemoteError(f"{hv.name}: card(s) {', '.join(map(str, pending))} still hold memory "
                              f"{hv['release_timeout_s']:g}s after their instance stopped; "
                              f"`inv stop --host {hv.name} --instance I --check` shows the holders.")
    # The inventory's values, whatever the environment holds (N, MAX_SEQS...: start_cluster.sh's overrides
    # by hand, which the proxy and the keeper would not know of).
    unset = " ".join(f"-u {name}" for name in layout.START_OVERRIDES)
    r = conn.run(f"env {unset} {bin_dir}/start_cluster.sh", on_line=lambda line: emit(line))
    if r.exited == 3:
        raise RemoteError(f"{hv.name}: {r.stderr.strip()}")
    if not r.ok:
        raise RemoteError(f"{hv.name}: start_cluster.sh failed (exit {r.exited}): {r.stderr.strip()[-300:]}")
    # The host agent's /health wait (the one the keeper's restarts use): a line per instance as it comes up.
    agent.steps(conn, hv, "wait-healthy --instances " + ",".join(str(f["index"]) for f in to_start), report, emit)
