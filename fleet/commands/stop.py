"""`inv stop`: the boot hook and the keeper first, then drain the front (or one instance), stop every process of the
deployment (each proven the deployment's by its record, session or tag: hostagent/processes.py), sweep
what carries the tag, and wait until the cards are given back (fleet.host.release; --force kills your
processes still holding the devices)."""
from __future__ import annotations

import json
import shlex

from hostagent.facts import HostFacts

from fleet.commands import entries
from fleet.errors import FleetError
from fleet.facts import state as facts
from fleet.host import boot, keeper as fleet_keeper, release, runlock, vrrp as fleet_vrrp
from fleet.render import stop_spec
from fleet.report import Emit, Report, Step
from fleet.settings.inventory import HostVars
from fleet.transport import agent
from fleet.transport.connection import Transport


def stop_processes(conn: Transport, hv: HostVars, args: list[str], emit: Emit):
    """Run hostagent/processes.py's stop on the host (`--instance I`, `--proxy`, `--keeper`, `--check`),
    sent on standard input: it works even where deploy never put the code."""
    return agent.run_module(conn, hv, "processes", f"stop {shlex.quote(json.dumps(stop_spec(hv)))} "
                            f"{shlex.join(args)}", emit)


def _drain_front(conn, hv, found, report, emit, check) -> None:
    """Stop's first step: the front stops taking requests and finishes those in flight, up to
    drain_timeout_s (hostagent drain); the instances are stopped only after."""
    fronts = [what for what, f in (("proxy", found.proxy), ("nginx", found.nginx))
              if f.alive]
    bound = hv.settings.drain_timeout_s
    if not fronts:
        report.add("drain", "ok", "no front runs: nothing to drain")
        return
    if check:
        step = report.add("drain", "changed", f"would stop the {' and '.join(fronts)} taking requests and wait "
                          f"up to {bound:g}s (drain_timeout_s) for those in flight")
        emit(f"drain: {step.message}")
        return
    try:
        r = agent.host_command(conn, hv, f"drain --timeout-s {bound:g}", emit,
                               config=agent.FRONT_CONFIG, timeout=bound + 60)
    except FleetError as e:
        emit(f"drain: {e}; stopping at once")
        report.add("drain", "skipped", f"the front could not be drained ({str(e).removeprefix(hv.name + ': ')}); "
                   "stopped at once")
        return
    drained = [r[what] for what in ("proxy", "nginx") if what in r]
    cut = sum(d["cut_count"] for d in drained)
    waited = max([d["waited_s"] for d in drained] or [0])
    report.add("drain", "changed", f"the {' and '.join(fronts)} stopped taking requests; those in flight "
               + (f"finished in {waited:g}s" if not cut else
                  f"had {bound:g}s (drain_timeout_s): {cut} cut, named above"))


def _drain_instance(conn, hv, found, instance, report, emit, check) -> bool:
    """`stop --instance I`'s first step: the proxy stops sending the instance requests and those in
    flight on it finish, up to drain_timeout_s (hostagent drain-instance). True when the backend must be
    enabled again once the instance is stopped (the drain was this stop's, not the operator's)."""
    name = f"instance {instance} drain"
    if (found.mode or "proxy") == "nginx":
        step = report.add(name, "skipped", "nginx is the front and has no drain of one backend: requests in "
                          "flight on the instance are cut")
        emit(f"instance {instance}: {step.message}")
        return False
    if not found.proxy.alive:
        report.add(name, "ok", "no proxy runs: nothing to drain")
        return False
    if check:
        step = report.add(name, "changed", f"would drain it in the proxy and wait up to "
                          f"{hv.settings.drain_timeout_s:g}s (drain_timeout_s) for its requests in flight")
        emit(f"instance {instance}: {step.message}")
        return False
    result = _agent_steps(conn, hv, f"drain-instance --instance {instance}", report, emit)
    return bool(result.get("enable_after"))


def _agent_steps(conn, hv, command: str, report: Report, emit: Emit) -> dict:
    """Run a host agent command that answers with steps (conf/hostagent.json) and add them to report; a
    host agent that cannot be run is one skipped step, and the stop goes on."""
    try:
        return agent.steps(conn, hv, command, report, emit, timeout=hv.settings.drain_timeout_s + 60)
    except FleetError as e:
        report.add(command.split()[0], "skipped", str(e).removeprefix(hv.name + ': '))
        return {}


def stop(conn: Transport, hv: HostVars, emit: Emit = lambda line: None, instance: int | None = None,
         check: bool = False, force: bool = False, wait: bool = False, now: bool = False) -> Report:
    """Drain the front (unless now), stop the proxy and the instances by process group, sweep what
    carries the tag, then wait until the cards are released (fleet.host.release: --force kills your
    processes still holding the devices)."""
    hv = facts.prepare(conn, hv)
    if instance is not None and not 0 <= instance < hv.settings.instances:
        raise FleetError(f"{hv.name}: there is no instance {instance}; instances are 0-{hv.settings.instances - 1}.")
    keeper = []
    if instance is None and not check:
        # The keeper first, before the lock: it may hold the lock for a restart of its own, which its
        # stop cancels (and its exit frees the lock); once it is gone nothing restarts what stop takes down.
        stop_processes(conn, hv, ["--keeper"], lambda line: (emit(line), keeper.append(line)))
    try:
        with runlock.held_unless(check, conn, hv, "stop", emit, wait):
            report = _stop(conn, hv, emit, instance, check, force, now)
    except runlock.LockedError:
        # Refused: nothing was stopped but the keeper, so it comes back (else dead instances stay dead).
        if hv.settings.keeper.enabled and any(line.startswith("keeper: stopped") for line in keeper):
            fleet_keeper.start_again(conn, hv, emit)
        raise
    if any(line.startswith("keeper: stopped") for line in keeper):
        report.steps.insert(0, Step("keeper", "changed", "stopped first: " + "; ".join(
            line for line in keeper if line.startswith("keeper: stopping"))[:200]))
    return report


def _stop(conn: Transport, hv: HostVars, emit: Emit, instance: int | None, check: bool, force: bool,
          now: bool) -> Report:
    report = Report(hv.name)
    if instance is None:
        # First, under the lock: a stopped fleet stays stopped after a reboot, and no watchdog starts
        # the keeper again while the stop runs.
        boot.remove(conn, hv, report, check, emit)
        # Then keepalived: the address moves to a peer before this entry's front drains.
        fleet_vrrp.stop_first(conn, hv, report, emit, check)
    before = facts.probe(conn, hv, readonly=True)
    # An entry host's proxy sends to these instances too: drained there first (fleet.commands.entries).
    alive = [f.index for f in before.instances if f.alive and instance in (None, f.index)]
    with entries.drained(hv, alive if not (now or check) else [], report, emit, stopped=True):
        return _stop_drained(conn, hv, before, instance, check, force, now, report, emit)


def _stop_drained(conn: Transport, hv: HostVars, before: HostFacts, instance: int | None, check: bool, force: bool,
                  now: bool, report: Report, emit: Emit) -> Report:
    """The stop once the entry hosts' proxies send these instances nothing more: drain, stop by identity,
    the cards' release."""
    enable_after = False
    front_up = before.proxy.alive or before.nginx.alive
    if now:
        if front_up and (instance is None or before.instances[instance].alive):
            report.add("drain", "skipped", "--now: no drain; requests in flight "
                       + ("" if instance is None else f"on instance {instance} ") + "are cut")
    elif instance is None:
        _drain_front(conn, hv, before, report, emit, check)
    elif before.instances[instance].alive:
        enable_after = _drain_instance(conn, hv, before, instance, report, emit, check)
    cards_before, cards_why = release.read_cards(conn, hv)
    args = (["--instance", str(instance)] if instance is not None else []) + (["--check"] if check else [])
    r = stop_processes(conn, hv, args, emit)
    if enable_after:
        _agent_steps(conn, hv, f"enable-instance --instance {instance}", report, emit)
    after = facts.probe(conn, hv, readonly=True, boot=instance is None)
    targets = [f for f in before.instances if instance is None or f.index == instance]
    for f in targets:
        name = f"instance {f.index}"
        if not f.alive:
            stale = f.stale
            report.add(name, "ok", f"its pid file named pid {f.recorded_pid}, {stale}: not touched" if stale
                       else "already stopped")
            if instance is not None and not stale and not facts.tagged(before, hv, instance):
                emit(f"{name}: not running: nothing to stop")
        elif check:
            report.add(name, "changed", f"would stop pid {f.pid} and its session")
        else:
            still = after.instances[f.index].alive
            report.add(name, "failed" if still else "changed",
                       f"pid {f.pid} still alive" if still else f"stopped pid {f.pid} and its session")
    if instance is None:
        kp = before.keeper.pid
        if kp and check:
            report.add("keeper", "changed", f"would stop pid {kp} (first)")
        p = before.proxy
        if not p.alive:
            report.add("proxy", "ok", "already stopped")
        else:
            report.add("proxy", "changed", ("would stop" if check else "stopped") + f" pid {p.pid}")
        n = before.nginx
        for what, pid in (("nginx", n.pid), ("watcher", n.watcher_pid)):
            if pid:
                report.add(what, "changed", ("would stop" if check else "stopped") + f" pid {pid}")
    left = after.tagged if instance is None else facts.tagged(after, hv, instance)
    if left and not check:
        pids = ", ".join(f"{t.pid} ({t.cmdline[:60]})" for t in left)
        report.add("tag sweep", "failed", f"processes with the deployment's tag are still alive: {pids}")
    elif not r.ok and not check:
        report.add("tag sweep", "failed", f"the stop exited {r.exited}: {r.stderr.strip()[-300:]}")
    else:
        report.add("tag sweep", "ok", "no process with the deployment's tag is left" if not check else
                   f"{len(before.tagged)} tagged process(es) found")
    cards = sorted({c for i in ([instance] if instance is not None else range(hv.settings.instances)) for c in hv.cards[i]})
    release.settle(conn, hv, report, emit, cards, cards_before, cards_why, instance, check, force)
    report.status = facts.status_of(hv, after)
    return report
