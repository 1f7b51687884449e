"""`inv deploy`: the doctor's checks, then put the changed files, start what is not running (staggered by
start_cluster.sh), wait for each /health, roll each running instance whose launch differs from the wanted
one (fleet/plan/launches.py) through the host agent's one restart, one at a time, start or update the front,
start the keeper, install the boot hook (fleet.host.boot). A second deploy on a running cluster starts nothing
and reports changed=0.
"""
from __future__ import annotations

import shlex

from hostagent import layout
from hostagent.facts import HostFacts, KeyDigests

from fleet import render
from fleet.commands import display, entries, front
from fleet.commands.stop import stop_processes
from fleet.errors import RemoteError
from fleet.facts import state as facts, survey
from fleet.facts.doctor import entry_port_check, judge as judge_doctor
from fleet.host import boot, keeper as fleet_keeper, release, runlock, sync, vrrp as fleet_vrrp
from fleet.plan import drift, steps as plan
from fleet.plan.launches import InstanceLaunch
from fleet.report import Emit, Report
from fleet.settings import serving
from fleet.settings.cluster import backend_name
from fleet.settings.inventory import HostVars
from fleet.transport import agent
from fleet.transport.connection import Transport


def deploy(conn: Transport, hv: HostVars, emit: Emit = lambda line: None,
           check: bool = False, diff: bool = False, doctor: bool = True, wait: bool = False,
           restart: bool = True, verbose: bool = False) -> Report:
    """Put changed files, start what is not running, wait for /health, roll what runs a stale launch,
    start the proxy.

    doctor: run fleet.facts.doctor's checks first; a failed check stops the deploy before it changes anything.
    wait: when another run holds the deployment's lock, wait for it instead of failing at once.
    restart: roll each healthy instance whose recorded launch differs from the wanted one (False: leave
    it running as it is, and say so).
    verbose: list each new file put (else one line counts them).
    """
    hv = facts.prepare(conn, hv)
    # The lock's holder checks first what deploy needs (one sentence naming what is missing, nothing created);
    # --check takes no lock: its first read checks it.
    with runlock.held_unless(check, conn, hv, "deploy", emit, wait, needs=True):
        return _deploy(conn, hv, emit, check, diff, doctor, restart, verbose)


def entry_slots_first(conn: Transport, hv: HostVars, emit: Emit = lambda line: None, check: bool = False,
                      wait: bool = False) -> Report:
    """Before the members of an entry host roll (a deploy of several hosts: fleet.commands.runner's entry_first),
    a fronted model whose max_num_seqs goes down takes its smaller slot count in the entry's running proxy,
    so that no member's engine is given more requests than it runs while its host rolls; the entry's own
    deploy, after its members', applies the rest. Nothing when no slot count goes down, the front is
    nginx (it counts no slots) or not running, or the backends or models change too (the new routing then
    waits for the entry's own deploy, as a roll's does)."""
    report = Report(hv.name)
    if not hv.settings.fronts:
        return report
    hv = facts.prepare(conn, hv)
    with runlock.held_unless(check, conn, hv, "deploy", emit, wait):
        found = facts.probe(conn, hv, readonly=check)
        running = found.proxy.config or {}
        if not found.proxy_healthy():
            return report
        caps = _running_caps(hv, running)
        if not caps:
            return report
        lower = ", ".join(f"{name} {was} -> {now}" for name, (was, now) in caps.items() if now < was)
        if check:
            emit(report.add("proxy slots", "changed", f"would take fewer slots before the members roll "
                                                      f"({lower})").line())
            return report
        headroom = hv.settings.proxy.queue.headroom
        conf = render.proxy_config(hv, slots={name: serving.seqs(min(was, now), headroom)
                                              for name, (was, now) in caps.items()})
        conn.put(layout.path(hv.settings.deploy_dir, layout.PROXY_CONF), conf.encode(), 0o644)
        if front._reload_proxy(conn, hv, found.proxy, Report(hv.name)):
            step = report.add("proxy slots", "changed", f"reloaded with fewer slots before the members roll "
                                                        f"({lower})")
        else:
            step = report.add("proxy slots", "failed", f"the proxy did not take fewer slots ({lower}); no host "
                              f"of this run was deployed: `inv logs --host {hv.name} --proxy` says why")
        emit(step.line())
    return report


def _running_caps(hv: HostVars, running: dict) -> dict[str, tuple[int, int]]:
    """Each model's slots in the running proxy and in the inventory (name -> (running, wanted)), when one
    goes down and the proxy routes the same backends and models as the inventory would ({} otherwise)."""
    if sorted(running.get("backends") or []) != sorted(hv.backends):
        return {}
    if hv.pools is None:
        if running.get("models"):
            return {}
        pairs = {hv.settings.served_model_name: (running.get("slots"), hv.proxy_slots)}
    else:
        was = {m["name"]: m for m in running.get("models") or []}
        if set(was) != {p.name for p in hv.pools} or any(
                sorted(was[p.name]["backends"]) != sorted(p.backends) for p in hv.pools):
            return {}
        pairs = {p.name: (was[p.name]["slots"], p.slots) for p in hv.pools}
    if not all(isinstance(w, int) for w, _ in pairs.values()) or all(now >= w for w, now in pairs.values()):
        return {}
    return pairs


def _deploy(conn: Transport, hv: HostVars, emit: Emit, check: bool, diff: bool, doctor: bool,
            restart: bool = True, verbose: bool = False) -> Report:
    report = Report(hv.name)
    entry = entry_port_check(hv)
    if entry.status != "ok":         # said beside the recap, doctor or not: it is the inventory's choice
        report.warn(f"{entry.name}: {entry.message}; {entry.fix}")
    files = sync.host_files(hv)
    # One round trip: the doctor's facts, the state (and with --check, what deploy needs).
    first = survey.read(conn, hv, [f.path for f in files], readonly=check, with_doctor=doctor, needs=check)
    if doctor:
        judge_doctor(conn, hv, first.doctor, emit, report)
        if report.failed:
            emit("doctor: a check failed; fix it, or deploy with --no-doctor to skip the checks")
            return report
    found = first.found
    strangers = facts.foreign_ports(hv, found)
    if strangers:
        # Nothing starts beside a stranger on our ports (the doctor says the same when it runs).
        for port, sentence in strangers:
            report.add(f"port {port}", "failed", sentence)
        report.status = facts.status_of(hv, found)
        return report
    if found.deploy_dir_exists:
        for sentence in drift.sentences(hv, found, drift.read_deployed(found)):
            emit(f"WARNING: {sentence}")        # before anything changes; beside the recap too
            report.warn(sentence)
    keys = found.api_keys or KeyDigests()
    if keys.error and found.mode != "nginx" and not found.proxy.alive:
        # The proxy would exit at start, after the engines loaded (with the doctor on, it said so first).
        report.add("api keys", "failed", f"{keys.error} The proxy cannot start with it: nothing was started.")
        report.status = facts.status_of(hv, found)
        return report
    # The plan (fleet.plan.steps): each file, instance, retired instance, the front, keepalived, the keeper and the
    # boot hook, with its reason, decided before anything acts. --check prints it (names a stale launch
    # whatever --no-restart says); a deploy applies it.
    the_plan = plan.make(hv, found, files, restart or check)
    if diff:
        for f in the_plan.files:
            if f.action == "put":
                for line in sync.diff(conn, hv, f.file, found):
                    emit(line)
    if check:
        for line in the_plan.lines():
            emit(f"plan: {line}")
        for s in the_plan.steps():
            report.add(s.name, *s.checked())
    else:
        _apply(conn, hv, found, the_plan, report, emit)
    for line in display.step_lines(report.steps, verbose):
        emit(line)
    # Nothing changed: the facts read first are the host's state still (one round trip less).
    quiet = check or not any(s.status in ("changed", "failed") for s in report.steps)
    report.status = facts.status_of(hv, found if quiet else facts.probe(conn, hv, readonly=check, boot=True))
    return report


def _apply(conn, hv: HostVars, found: HostFacts, the_plan: plan.Plan, report: Report, emit: Emit) -> None:
    """Apply the plan, in its order: the files, the instances started, then the roll, the front and the
    retired instances (_converge), keepalived once the front serves (its track script then finds /health
    200), the keeper, and last the boot hook (after a reboot, bin/boot.sh starts it all again); a failed
    front holds the keeper and the boot hook back."""
    for f in the_plan.files:
        if f.action == "put":
            sync.put(conn, hv, f.file)
            report.add(f.name, "changed", f"put ({f.reason})")
        else:
            report.add(f.name, "ok")
    steps = the_plan.instances
    for s in steps:
        if s.action in ("keep", "later"):
            report.add(s.name, "ok", s.kept)
    # Instances with processes left behind (an API server killed, its EngineCore children still holding
    # the card): those are stopped by group and tag, and their card released, before they start again.
    if any(s.action == "restart" for s in steps):
        report.data["restart"] = [s.index for s in steps if s.action == "restart"]
    to_start = [found.instances[s.index] for s in steps if s.action in ("start", "restart")]
    if to_start:
        _start_instances(conn, hv, to_start, report, emit)
    found = _converge(conn, hv, found, the_plan, report, emit)
    if the_plan.keepalived:
        fleet_vrrp.apply(conn, hv, the_plan.keepalived, report, emit)
    if any(s.status == "failed" and s.name in ("proxy", "front") for s in report.steps):
        _hold_back(conn, hv, found, report)
        return
    if the_plan.keeper:
        fleet_keeper.apply(conn, hv, the_plan.keeper, report, emit)
    boot.apply(conn, hv, the_plan.boot_hook, report, emit)


def _hold_back(conn, hv: HostVars, found: HostFacts, report: Report) -> None:
    """The front failed: this run starts no keeper and installs no boot hook, which would keep bringing
    back a deployment that does not serve; what an earlier deploy left of them is named."""
    why = "the front failed above"
    k = found.keeper
    report.add("keeper", "skipped", f"not changed: {why}; the keeper of an earlier deploy still runs (pid "
               f"{k.pid})" if k.alive else f"not started: {why}")
    boot.held_back(conn, hv, report, why)


def _sim_devices(hv: HostVars) -> str:
    """The sim accelerator's device files, made before an instance starts (a shell line ending in `&& `; empty
    for a real accelerator). Created once and never replaced: holders keep the inode they opened."""
    if hv.settings.accelerator != "sim":
        return ""
    d = hv.settings.deploy_dir
    devs = " ".join(shlex.quote(layout.path(d, f"{layout.SIM_DEV}/{n}")) for n in
                    ["kfd"] + [f"renderD{128 + i}" for i in range(hv.settings.accelerators)])
    return f"mkdir -p {shlex.quote(layout.path(d, layout.SIM_DEV))} && touch {devs} && "


def _start_instances(conn, hv, to_start, report, emit):
    d = hv.settings.deploy_dir
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
                              f"{hv.settings.release_timeout_s:g}s after their instance stopped; "
                              f"`inv stop --host {hv.name} --instance I --check` shows the holders.")
    # The inventory's values, whatever the environment holds (N, MAX_SEQS...: start_cluster.sh's overrides
    # by hand, which the proxy and the keeper would not know of).
    unset = " ".join(f"-u {name}" for name in layout.START_OVERRIDES)
    r = conn.run(f"{_sim_devices(hv)}env {unset} {bin_dir}/start_cluster.sh", on_line=lambda line: emit(line))
    if r.exited == 3:
        raise RemoteError(f"{hv.name}: {r.stderr.strip()}")
    if not r.ok:
        raise RemoteError(f"{hv.name}: start_cluster.sh failed (exit {r.exited}): {r.stderr.strip()[-300:]}")
    # The host agent's /health wait (the one the keeper's restarts use): a line per instance as it comes up.
    agent.steps(conn, hv, "wait-healthy --instances " + ",".join(str(f.index) for f in to_start), report, emit)


def _converge(conn, hv: HostVars, found: HostFacts, the_plan: plan.Plan, report: Report, emit: Emit) -> HostFacts:
    """Roll the stale instances, bring the front to the new config (the plan's front step), retire the
    instances the inventory no longer has; the proxy never routes a name to an engine that does not serve
    it, nor gives an engine more slots than it runs:

    1. the instances that keep their names roll (a smaller max_num_seqs reaches the proxy first), and
       those that lose a name and gain one roll too but stay drained;
    2. when some are held or retired: the proxy takes the new config with the retired instances still in
       their pools; the held ones are enabled;
    3. the retired instances are drained in the proxy (their requests finish);
    4. the front takes the new config (the front step), and the instances that only lose names roll;
    5. the retired instances are stopped by identity.

    The state as it is after them comes back (the front's step reads the proxy's).
    """
    retired = found.retired or []
    before, held, after = _phases([s.launch for s in the_plan.instances if s.action == "roll"])
    if before or held:
        _roll(conn, hv, found, before + held, report, emit, held={p.index for p in held}, slots_first=True)
        found = facts.probe(conn, hv)     # the proxy's reload count, for the next reload
    keep = _kept(hv, retired)
    proxy_up = found.proxy_healthy()
    reloaded = False
    if (held or keep) and proxy_up:
        conf = layout.path(hv.settings.deploy_dir, layout.PROXY_CONF)
        conn.put(conf, render.proxy_config(hv, keep=keep).encode(), 0o644)
        reloaded = front._reload_proxy(conn, hv, found.proxy, Report(hv.name),
                                       want=list(hv.backends) + [b for b in keep if b not in hv.backends])
        if reloaded:
            report.add("proxy", "changed", "reloaded with the new config, the removed instances still in it "
                       "until they are drained")
        found = facts.probe(conn, hv)
        conn.put(conf, render.proxy_config(hv).encode(), 0o644)

    def enable_held():
        for p in held:
            agent.steps(conn, hv, f"enable-instance --instance {p.index}", report, emit)
    if reloaded:
        enable_held()
    for f in retired:
        name = backend_name(hv.instance_host, f.port)
        agent.steps(conn, hv, f"drain-retired --instance {f.index} --port {f.port} --backend "
                    f"{shlex.quote(name)} --locked", report, emit)
    for step in the_plan.front:
        front.apply(conn, hv, found, step, report, emit)
    if not reloaded:
        enable_held()      # the proxy had no reload to take (restarted, or not running): after the front step
    if after and not report.failed:
        _roll(conn, hv, found, after, report, emit)
    elif after:
        report.add("rolling", "failed", f"instance(s) {', '.join(str(p.index) for p in after)} not "
                   "restarted after the failure above; they still run their previous settings")
    for f in retired:
        stop_processes(conn, hv, ["--instance", str(f.index)], emit)
        conn.run("rm -f " + " ".join(shlex.quote(layout.path(hv.settings.deploy_dir, rel)) for rel in
                                     (layout.instance_launch(f.index), layout.instance_ready(f.index))))
        report.add(f"instance {f.index}", "changed", "removed (the inventory no longer has it): drained, "
                   "out of the proxy, stopped by identity")
    return found


def _kept(hv: HostVars, retired: list[dict]) -> dict[str, str | None]:
    """The retired instances the proxy keeps until they are drained: backend name -> the pool that keeps
    it (the group it ran, when the new config still has that pool; None on a host without pools)."""
    pools = {p.name for p in hv.pools or []}
    keep = {}
    for f in retired:
        group = ((f.launch or {}).get("launch") or {}).get("group")
        if not hv.pools or group in pools:
            keep[backend_name(hv.instance_host, f.port)] = group if hv.pools else None
    return keep


def _phases(to_roll: list[InstanceLaunch]) -> tuple[list[InstanceLaunch], list[InstanceLaunch], list[InstanceLaunch]]:
    """The stale instances in three lots, by the names their engine serves (before the roll: the names the
    running proxy routes to it): those that keep every name roll before the proxy's reload; those that
    lose one but gain none roll after it (the old names still serve the new config); those that lose one
    and gain one roll before it and stay drained until the reload."""
    before, held, after = [], [], []
    for p in to_roll:
        old, new = set(p.names[0]), set(p.names[1])
        (before if old <= new else after if new <= old else held).append(p)
    return before, held, after


def _roll(conn, hv: HostVars, found: HostFacts, to_roll: list[InstanceLaunch], report: Report, emit: Emit,
          held: set[int] = frozenset(), slots_first: bool = False) -> None:
    """Restart each stale instance through the host agent's one restart (drain, stop by identity, wait for
    the card, start, /health, enable), one at a time, under the run lock this deploy holds; stops at the
    first that fails. held: instances left drained (deploy enables them after the proxy's reload).
    slots_first: while a smaller max_num_seqs rolls, the proxy runs with it already, so it never gives an
    engine more slots than it has; a larger one reaches the proxy after the roll (the front step)."""
    if _sim_devices(hv):      # a roll may move an instance to a card the host had no device file for
        conn.run(_sim_devices(hv) + "true")
    interim = _interim_proxy_conf(hv, to_roll) if slots_first else None
    if interim is not None and found.proxy_healthy():
        conn.put(layout.path(hv.settings.deploy_dir, layout.PROXY_CONF), interim.encode(), 0o644)
        if front._reload_proxy(conn, hv, found.proxy, Report(hv.name)):
            report.add("proxy slots", "changed", "reloaded with the smaller max_num_seqs before the roll")
        else:
            report.add("proxy slots", "failed", "the proxy did not take the smaller max_num_seqs; nothing was "
                       "restarted: `inv logs --host " + hv.name + " --proxy` says why")
            return
    for n, p in enumerate(to_roll):
        i = p.index
        emit(f"instance {i}: rolling ({', '.join(p.changes)})")
        failed = report.count("failed")
        with entries.drained(hv, [i], report, emit):
            agent.steps(conn, hv, f"restart --instance {i} --locked" + (" --no-enable" if i in held else ""),
                        report, emit)
        if report.count("failed") > failed:
            left = [q.index for q in to_roll[n + 1:]]
            if left:
                report.add("rolling", "failed", f"stopped after instance {i}; instance(s) "
                           f"{', '.join(map(str, left))} still run their previous settings")
            break
    if interim is not None:
        final = render.proxy_config(hv)
        if final != interim:
            conn.put(layout.path(hv.settings.deploy_dir, layout.PROXY_CONF), final.encode(), 0o644)


def _interim_proxy_conf(hv: HostVars, to_roll: list[InstanceLaunch]) -> str | None:
    """conf/proxy.yaml with each rolled group's slots at min(what its instances ran, what it wants), when
    some group's max_num_seqs goes down (None otherwise: the running config already gives every engine at
    most what it has until the front step applies the larger value). Not when names move too: that
    config would route the new names before their engines serve them."""
    caps: dict[str, int] = {}
    down = False
    if any(p.names_move for p in to_roll):
        return None      # names move: the new routing waits for the front step (see _phases)
    for p in to_roll:
        g = hv.group_of(p.index)
        was = p.was_seqs
        if isinstance(was, int):
            caps[g.name] = min(caps.get(g.name, g.max_num_seqs), was, g.max_num_seqs)
            down = down or was > g.max_num_seqs
    return render.proxy_config(hv, slots=caps) if down else None
