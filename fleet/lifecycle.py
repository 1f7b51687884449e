"""Lifecycle: deploy, status and stop of one host's deployment.

Facts first, then actions: each function reads the host's state (pid files, ports, /health) into plain
data through `fleet.probe`, compares it with what the inventory wants, and only then acts. An action with
nothing to do says why and counts as ok, not changed; that is what makes a second deploy report changed=0.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import keeper as fleet_keeper
from . import hostcode, preflight, release, runlock
from .errors import FleetError, RemoteError
from .inventory import HostVars
from .render import RenderedFile, render_host, stop_spec
from .transport import Transport

ROOT = Path(__file__).resolve().parent.parent
PROBE = hostcode.probe("state")
STOPPER = hostcode.script("processes")

Emit = Callable[[str], None]


@dataclass
class Step:
    """One thing a run did or found: status is ok, changed, skipped or failed."""

    name: str
    status: str
    message: str = ""


@dataclass
class Report:
    """What a run did on one host: its steps, and the host's status at the end when known."""

    host: str
    steps: list[Step] = field(default_factory=list)
    unreachable: str | None = None
    status: dict | None = None
    data: dict = field(default_factory=dict)

    def add(self, name: str, status: str, message: str = "") -> Step:
        step = Step(name, status, message)
        self.steps.append(step)
        return step

    def count(self, status: str) -> int:
        return sum(1 for s in self.steps if s.status == status)

    @property
    def failed(self) -> bool:
        return self.count("failed") > 0

    def recap(self) -> str:
        """The Ansible-style recap line."""
        return (f"{self.host} : ok={self.count('ok')} changed={self.count('changed')} "
                f"skipped={self.count('skipped')} failed={self.count('failed')} "
                f"unreachable={1 if self.unreachable else 0}")


# --- preparing host variables -------------------------------------------------------------------

def prepare(conn: Transport, hv: HostVars) -> HostVars:
    """Resolve what depends on the host itself: an absolute deploy_dir and the Python to run."""
    hv = copy.copy(hv)
    hv.vars = copy.deepcopy(hv.vars)
    d = hv.vars["deploy_dir"]
    if d == "~" or d.startswith("~/"):
        d = conn.home().rstrip("/") + d[1:]
    if not d.startswith("/"):
        d = conn.home().rstrip("/") + "/" + d
    hv.vars["deploy_dir"] = d.rstrip("/") or "/"
    m = hv.vars["model"]
    if m == "~" or m.startswith("~/"):      # the engine gets it as one quoted argument: no shell expands it
        hv.vars["model"] = conn.home().rstrip("/") + m[1:]
    if not hv.vars["python"]:
        # The control node's own interpreter has aiohttp; a remote host's python3 comes from env_setup.
        hv.vars["python"] = sys.executable if hv["connection"] == "local" else "python3"
    return hv


def code_files(hv: HostVars) -> list[RenderedFile]:
    """The code the host runs besides the engine: the proxy, and the sim engine when engine is sim."""
    files = [RenderedFile(f"{pkg}/{p.name}", p.read_text(), 0o644)
             for pkg in ("proxy", "hostagent") for p in sorted((ROOT / pkg).glob("*.py"))]
    if hv["engine"] == "sim":
        files.append(RenderedFile("lib/fleet/__init__.py", (ROOT / "fleet" / "__init__.py").read_text()))
        files += [RenderedFile(f"lib/fleet/sim/{p.name}", p.read_text(), 0o644)
                  for p in sorted((ROOT / "fleet" / "sim").glob("*.py"))]
    return files


def host_files(hv: HostVars) -> list[RenderedFile]:
    """Everything deploy puts under deploy_dir."""
    return render_host(hv) + code_files(hv)


# --- facts --------------------------------------------------------------------------------------

def probe(conn: Transport, hv: HostVars, files: list[str] = (), readonly: bool = False) -> dict:
    """Read the deployment's state on the host (see hostagent/probes/state.py)."""
    spec = {"deploy_dir": hv["deploy_dir"], "ports": hv.ports, "instance_host": hv.instance_host,
            "proxy_port": hv["proxy"]["port"],
            "admin_port": hv["proxy"]["admin_port"], "deployment_id": hv.deployment_id,
            "files": list(files), "readonly": readonly}
    r = conn.run(preflight.probe_python(hv, f"- {shlex.quote(json.dumps(spec))}"), stdin=PROBE, timeout=60)
    if not r.ok:
        if r.exited == 127:
            raise RemoteError(f"{hv.name}: no python3 on the host's PATH, nor {hv['python'] or 'python3'} "
                              "after env_setup; install Python 3 there or set python.")
        raise RemoteError(f"{hv.name}: reading the deployment's state failed: "
                          f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    try:
        return json.loads(r.stdout)
    except ValueError:
        raise RemoteError(f"{hv.name}: the state probe printed something that is not JSON; "
                          "check the host's shell startup files for output.") from None


def stop_processes(conn: Transport, hv: HostVars, args: list[str], emit: Emit):
    """Run hostagent/processes.py's stop on the host (`--instance I`, `--proxy`, `--check`), sent on
    standard input: it works even where deploy never put the code."""
    spec = shlex.quote(json.dumps(stop_spec(hv)))
    return conn.run(preflight.probe_python(hv, f"- stop {spec} {shlex.join(args)}"), stdin=STOPPER, on_line=emit)


def instance_state(f: dict, health_timeout_s: float) -> str:
    """loading, healthy, dead, stopped or port-taken, from one instance's facts."""
    if f["alive"]:
        if f["health"] == 200:
            return "healthy"
        if f["was_ready"] or (f["age_s"] or 0) > health_timeout_s:
            return "dead"          # it was healthy once (engine death) or never became healthy in time
        return "loading"
    if f["listening"]:
        return "port-taken"
    return "dead" if f["pidfile"] else "stopped"


def proxy_state(f: dict) -> str:
    """healthy, no-backend (up but no healthy backend), dead, stopped or port-taken."""
    if f["alive"]:
        if f["health"] == 200:
            return "healthy"
        return "no-backend" if f["health"] == 503 else "dead"
    if f["listening"]:
        return "port-taken"
    return "dead" if f["pidfile"] else "stopped"


def status_of(hv: HostVars, facts: dict) -> dict:
    """The `inv status --json` object of one host."""
    keeper = fleet_keeper.status(hv, facts)
    instances = [{"index": f["index"], "port": f["port"], "accelerator": f["index"], "pid": f["pid"],
                  "pgid": f["pgid"], "state": instance_state(f, hv["health_timeout_s"]),
                  **fleet_keeper.instance_fields(keeper, f["index"])}
                 for f in facts["instances"]]
    for inst in instances:
        if inst["crashloop"] and inst["state"] in ("dead", "stopped"):
            inst["state"] = "crashloop"
    p = facts["proxy"]
    proxy = {"pid": p["pid"], "port": p["port"], "state": proxy_state(p), "backends": p["backends"]}
    mode = facts.get("mode") or "proxy"
    n = facts.get("nginx") or {}
    nginx = {"pid": n.get("pid"), "port": p["port"], "state": "running" if n.get("alive") else "stopped",
             "watcher_pid": n.get("watcher_pid") or (keeper["pid"] if hv["keeper"]["enabled"] else None)}
    if n.get("alive") and not p["alive"]:
        proxy["state"] = "stopped"           # the port is nginx's, not taken by a stranger
    front = None
    if mode == "proxy" and proxy["state"] in ("healthy", "no-backend"):
        front = "proxy"
    elif mode == "nginx" and n.get("alive"):
        front = "nginx"
    return {"host": hv.name, "deployment_id": hv.deployment_id, "deploy_dir": hv["deploy_dir"],
            "front": front, "mode": mode, "proxy": proxy, "nginx": nginx, "keeper": keeper, "instances": instances,
            "tagged": facts["tagged"]}


def status(conn: Transport, hv: HostVars, emit: Emit = lambda line: None) -> Report:
    """Read the host's state; ok unless an instance or the proxy is not serving."""
    hv = prepare(conn, hv)
    report = Report(hv.name)
    facts = probe(conn, hv)
    report.status = st = status_of(hv, facts)
    loud = {name: (status, message) for name, status, message in fleet_keeper.report_lines(st)}
    for inst, f in zip(st["instances"], facts["instances"]):
        name = f"instance {inst['index']}"
        report.add(name, *loud.pop(name, ("ok" if inst["state"] in ("healthy", "loading", "stopped") else
                                          "failed", _state_and_remedy(hv, inst["state"], f, inst["index"]))))
    for name, (status, message) in loud.items():
        report.add(name, status, message)
    # The entry port is what clients use: a front that should run and does not is a failure.
    if st.get("mode", "proxy") != "nginx":
        p = st["proxy"]
        report.add("proxy", "failed" if p["state"] in ("dead", "port-taken") else "ok",
                   _state_and_remedy(hv, p["state"], facts["proxy"]))
    return report


def _state_and_remedy(hv: HostVars, state: str, f: dict, index: int | None = None) -> str:
    """A failed state in status, with where to look and what brings it back (the proxy: index None)."""
    h = hv.name
    if state == "port-taken" and f.get("stranger"):
        return f"port-taken: {f['stranger']}"
    if state != "dead":
        return state
    if index is None:
        return f"dead: `inv logs --host {h}` shows why; `inv deploy --host {h}` starts it again"
    return (f"dead: `inv logs --host {h} --instance {index}` shows why; `inv restart --host {h} --instance "
            f"{index}` starts it again")


# --- deploy -------------------------------------------------------------------------------------

def _sha(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def deploy(conn: Transport, hv: HostVars, emit: Emit = lambda line: None,
           check: bool = False, diff: bool = False, doctor: bool = True, wait: bool = False) -> Report:
    """Put changed files, start what is not running, wait for /health, start the proxy.

    doctor: run fleet.doctor's checks first; a failed check stops the deploy before it changes anything.
    wait: when another run holds the deployment's lock, wait for it instead of failing at once.
    """
    hv = prepare(conn, hv)
    preflight.check(conn, hv, "deploy")   # the tools every step needs: one sentence naming what is missing
    with runlock.held_unless(check, conn, hv, "deploy", emit, wait):
        return _deploy(conn, hv, emit, check, diff, doctor)


def _deploy(conn: Transport, hv: HostVars, emit: Emit, check: bool, diff: bool, doctor: bool) -> Report:
    report = Report(hv.name)
    if doctor:
        from .doctor import doctor as run_doctor
        run_doctor(conn, hv, emit, report)
        if report.failed:
            emit("doctor: a check failed; fix it, or deploy with --no-doctor to skip the checks")
            return report
    files = host_files(hv)
    facts = probe(conn, hv, [f.path for f in files], readonly=check)
    strangers = foreign_ports(hv, facts)
    if strangers:
        # Nothing starts beside a stranger on our ports (the doctor says the same when it runs).
        for port, sentence in strangers:
            report.add(f"port {port}", "failed", sentence)
        report.status = status_of(hv, facts)
        return report
    d = hv["deploy_dir"]

    changed_files = _put_files(conn, hv, files, facts, report, emit, check, diff)
    if hv["accelerator"] == "sim" and not check:
        # Device files are created once and never replaced: holders keep the inode they opened.
        devs = " ".join(shlex.quote(f"{d}/sim-dev/{n}") for n in
                        ["kfd"] + [f"renderD{128 + i}" for i in range(hv["accelerators"])])
        conn.run(f"mkdir -p {shlex.quote(d + '/sim-dev')} && touch {devs}")

    states = [instance_state(f, hv["health_timeout_s"]) for f in facts["instances"]]
    # Instances with processes left behind (an API server killed, its EngineCore children still holding
    # the card): those are stopped by group and tag, and their card released, before they start again.
    leftovers = {t["tag"].rpartition("/")[2] for t in facts.get("tagged", [])}
    to_start = []
    for f, state in zip(facts["instances"], states):
        name = f"instance {f['index']}"
        if state in ("healthy", "loading"):
            note = "" if "bin/start_cluster.sh" not in changed_files else \
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

    _deploy_front(conn, hv, facts, changed_files, report, emit, check)
    if hv["instances"]:
        fleet_keeper.deploy(conn, hv, facts, changed_files, report, emit, check)
    for step in report.steps:
        if step.message:
            emit(f"{step.status}: {step.name}: {step.message}")
    report.status = status_of(hv, probe(conn, hv, readonly=check))
    return report


def foreign_ports(hv: HostVars, facts: dict) -> list[tuple[int, str]]:
    """(port, sentence) for each instance or proxy port held by a process that is not the deployment's."""
    st = status_of(hv, facts)
    taken = [f for f, inst in zip(facts["instances"], st["instances"]) if inst["state"] == "port-taken"]
    if st["proxy"]["state"] == "port-taken":
        taken.append(facts["proxy"])
    return [(f["port"], f["stranger"]) for f in taken if f.get("stranger")]


def _put_files(conn, hv, files, facts, report, emit, check, diff) -> set[str]:
    """Put each file whose content or mode differs from the host's copy; with diff, show how."""
    changed = set()
    modes = facts.get("file_modes") or {}
    for f in files:
        have = facts["files"].get(f.path)
        have_mode = modes.get(f.path)
        same_content = have == _sha(f.content)
        if same_content and have_mode in (None, f.mode):
            report.add(f"file {f.path}", "ok")
            continue
        changed.add(f.path)
        path = f"{hv['deploy_dir']}/{f.path}"
        if diff:
            for line in _diff_lines(conn, hv, f, path, have, have_mode, same_content):
                emit(line)
        if not check:
            conn.put(path, f.content.encode(), f.mode)
        why = ("new" if have is None else "content changed" if not same_content
               else f"mode {have_mode:04o} -> {f.mode:04o}")
        report.add(f"file {f.path}", "changed", ("would put" if check else "put") + f" ({why})")
    return changed


def _diff_lines(conn, hv, f, path, have, have_mode, same_content) -> list[str]:
    """A unified diff of the host's copy (or /dev/null) against the rendered file, git style for modes."""
    lines = []
    if have is not None and have_mode not in (None, f.mode):
        lines += [f"old mode {have_mode:04o} {hv.name}:{f.path}", f"new mode {f.mode:04o} rendered:{f.path}"]
    if not same_content:
        old = conn.read(path) if have is not None else None
        old_text = old.decode("utf-8", "replace") if old is not None else ""
        lines += difflib.unified_diff(old_text.splitlines(), f.content.splitlines(),
                                      f"{hv.name}:{f.path}" if have is not None else "/dev/null",
                                      f"rendered:{f.path}", lineterm="")
    return lines


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
    r = conn.run(f"{bin_dir}/start_cluster.sh", on_line=lambda line: emit(line))
    if r.exited == 3:
        raise RemoteError(f"{hv.name}: {r.stderr.strip()}")
    if not r.ok:
        raise RemoteError(f"{hv.name}: start_cluster.sh failed (exit {r.exited}): {r.stderr.strip()[-300:]}")
    _wait_healthy(conn, hv, [f["index"] for f in to_start], report, emit)


def _wait_healthy(conn, hv, indexes, report, emit):
    """Poll /health until each started instance is ready, a line per instance as it comes up."""
    t0 = time.monotonic()
    waiting = set(indexes)
    while waiting:
        facts = probe(conn, hv)
        elapsed = time.monotonic() - t0
        for f in facts["instances"]:
            i = f["index"]
            if i not in waiting:
                continue
            if f["alive"] and f["health"] == 200:
                emit(f"instance {i}: healthy on :{f['port']} after {elapsed:.1f}s")
                report.add(f"instance {i}", "changed", f"started, pid {f['pid']}, healthy on :{f['port']}")
                waiting.discard(i)
            elif not f["alive"] or elapsed > hv["health_timeout_s"]:
                why = "exited" if not f["alive"] else f"not healthy after {hv['health_timeout_s']:g}s"
                tail = _log_tail(conn, hv, f"logs/vllm_{i}.log")
                report.add(f"instance {i}", "failed", f"{why} on :{f['port']}; last lines of "
                           f"logs/vllm_{i}.log:\n{tail}")
                waiting.discard(i)
        if waiting:
            time.sleep(0.3)


def _log_tail(conn, hv, rel, n=15) -> str:
    r = conn.run(f"tail -n {n} {shlex.quote(hv['deploy_dir'] + '/' + rel)} 2>/dev/null")
    return "\n".join("    " + line for line in r.stdout.splitlines()) or "    (empty)"


def _deploy_front(conn, hv, facts, changed_files, report, emit, check):
    """Start the proxy, or restart it when its code or config changed; in nginx mode, keep nginx."""
    if facts.get("mode") == "nginx":
        from . import front
        front.deploy_nginx(conn, hv, facts, changed_files, report, emit, check)
        return
    p = facts["proxy"]
    state = proxy_state(p)
    stale = any(f == "conf/proxy.yaml" or f.startswith("proxy/") for f in changed_files)
    if state == "port-taken":
        report.add("proxy", "failed", f"port {hv['proxy']['port']} is taken by a process that is not this "
                   "deployment's proxy; free it or change proxy.port")
        return
    if state in ("healthy", "no-backend") and not stale:
        report.add("proxy", "ok", f"already running on :{p['port']}, pid {p['pid']}")
        return
    # Only the config changed, and the running proxy answers on the ports it names: SIGHUP re-reads it
    # without dropping a request. New code, or a proxy that does not answer there, needs a restart.
    reloadable = (state in ("healthy", "no-backend") and p["backends"] is not None
                  and not any(f.startswith("proxy/") for f in changed_files))
    if reloadable:
        if check:
            report.add("proxy", "changed", f"would reload (SIGHUP) pid {p['pid']} with the new config")
            return
        if _reload_proxy(conn, hv, p, report):
            return
    verb = "restart" if state in ("healthy", "no-backend") else "start"
    if check:
        report.add("proxy", "changed", f"would {verb} on :{hv['proxy']['port']}")
        return
    if verb == "restart":
        _restart_proxy(conn, hv, state, report, emit)
        return
    bin_dir = shlex.quote(f"{hv['deploy_dir']}/bin")
    if p["alive"]:     # alive but not answering: nothing to hand the port over from
        stop_processes(conn, hv, ["--proxy"], emit)
    r = conn.run(f"{bin_dir}/start_proxy.sh", on_line=emit)
    if not r.ok:
        report.add("proxy", "failed", f"start_proxy.sh failed (exit {r.exited}): {r.stderr.strip()[-300:]}")
        return
    t0 = time.monotonic()
    while True:
        f = probe(conn, hv)["proxy"]
        if f["alive"] and f["health"] == 200:
            report.add("proxy", "changed", f"{verb}ed, pid {f['pid']}, healthy on :{f['port']}")
            return
        if not f["alive"] or time.monotonic() - t0 > 30:
            tail = _log_tail(conn, hv, "logs/proxy.log")
            why = "exited" if not f["alive"] else "not healthy after 30s (no backend healthy?)"
            report.add("proxy", "failed", f"{why}; last lines of logs/proxy.log:\n{tail}")
            return
        time.sleep(0.2)


def _restart_proxy(conn, hv, state, report, emit) -> None:
    """Replace the running proxy with one running the new code or settings, beside it on the same port
    (hostagent restart-proxy): confirmed first, then the old one drains; the port never refuses."""
    from .front import host_command
    try:
        r = host_command(conn, hv, "restart-proxy" + (" --healthy" if state == "healthy" else ""), emit,
                         timeout=hv["proxy"]["shutdown_timeout_s"] + 120)
    except FleetError as e:
        report.add("proxy", "failed", str(e).removeprefix(f"{hv.name}: "))
        return
    if r["overlap"]:
        cut = r.get("cut") or []
        report.add("proxy", "changed", f"restarted beside the old one on :{hv['proxy']['port']}, pid {r['old_pid']} "
                   f"-> {r['pid']}: the port refused no connection; the old one finished its requests"
                   + (f", but {len(cut)} cut after proxy.shutdown_timeout_s" if cut else ""))
    else:
        report.add("proxy", "changed", f"restarted, pid {r['old_pid']} -> {r['pid']}: the old one did not share "
                   f"its port, which refused connections for about {r['gap_ms']} ms")


def _reload_proxy(conn, hv, p, report) -> bool:
    """SIGHUP the running proxy and wait until its admin lists the new backends; False if it did not."""
    conn.run(f"kill -HUP {int(p['pid'])}")
    want = hv.backends
    px = hv["proxy"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        f = probe(conn, hv)["proxy"]
        running = f.get("config") or {}
        if f["alive"] and running.get("backends") == want:
            # What a running proxy keeps until a restart (its listeners, the body limit, the drain time,
            # its log's rotation).
            if (running.get("max_body_mb"), running.get("shutdown_timeout_s"), running.get("log")) != (
                    float(px["max_body_mb"]), float(px["shutdown_timeout_s"]),
                    [float(px["log"]["max_mb"]), px["log"]["backups"]]):
                return False
            report.add("proxy", "changed", f"reloaded (SIGHUP), pid {p['pid']}, {len(want)} backends")
            return True
        time.sleep(0.2)
    return False


# --- stop ---------------------------------------------------------------------------------------

def _drain_front(conn, hv, facts, report, emit, check) -> None:
    """Stop's first step: the front stops taking requests and finishes those in flight, up to
    drain_timeout_s (hostagent drain); the instances are stopped only after."""
    fronts = [what for what, f in (("proxy", facts["proxy"]), ("nginx", facts.get("nginx") or {}))
              if f.get("alive")]
    bound = hv["drain_timeout_s"]
    if not fronts:
        report.add("drain", "ok", "no front runs: nothing to drain")
        return
    if check:
        step = report.add("drain", "changed", f"would stop the {' and '.join(fronts)} taking requests and wait "
                          f"up to {bound:g}s (drain_timeout_s) for those in flight")
        emit(f"drain: {step.message}")
        return
    from .front import host_command
    try:
        r = host_command(conn, hv, f"drain --timeout-s {bound:g}", emit, timeout=bound + 60)
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


def _drain_instance(conn, hv, facts, instance, report, emit, check) -> bool:
    """`stop --instance I`'s first step: the proxy stops sending the instance requests and those in
    flight on it finish, up to drain_timeout_s (hostagent drain-instance). True when the backend must be
    enabled again once the instance is stopped (the drain was this stop's, not the operator's)."""
    name = f"instance {instance} drain"
    if (facts.get("mode") or "proxy") == "nginx":
        step = report.add(name, "skipped", "nginx is the front and has no drain of one backend: requests in "
                          "flight on the instance are cut")
        emit(f"instance {instance}: {step.message}")
        return False
    if not facts["proxy"]["alive"]:
        report.add(name, "ok", "no proxy runs: nothing to drain")
        return False
    if check:
        step = report.add(name, "changed", f"would drain it in the proxy and wait up to "
                          f"{hv['drain_timeout_s']:g}s (drain_timeout_s) for its requests in flight")
        emit(f"instance {instance}: {step.message}")
        return False
    result = _agent_steps(conn, hv, f"drain-instance --instance {instance}", report, emit)
    return bool(result.get("enable_after"))


def _agent_steps(conn, hv, command: str, report: Report, emit: Emit) -> dict:
    """Run a host agent command that answers with steps (conf/hostagent.json) and add them to report; a
    host agent that cannot be run is one skipped step, and the stop goes on."""
    from .front import host_command
    try:
        result = host_command(conn, hv, command, lambda line: emit(line.split(": ", 1)[-1]),
                              config=fleet_keeper.AGENT_CONFIG, raise_failed=False,
                              timeout=hv["drain_timeout_s"] + 60)
    except FleetError as e:
        report.add(command.split()[0], "skipped", str(e).removeprefix(hv.name + ': '))
        return {}
    for step in result.get("steps") or [{"name": command.split()[0], "status": "failed",
                                         "message": result.get("error", "no answer")}]:
        report.add(step["name"], step["status"], step["message"])
    return result


def stop(conn: Transport, hv: HostVars, emit: Emit = lambda line: None, instance: int | None = None,
         check: bool = False, force: bool = False, wait: bool = False, now: bool = False) -> Report:
    """Drain the front (unless now), stop the proxy and the instances by process group, sweep what
    carries the tag, then wait until the cards are released (fleet.release: --force kills your
    processes still holding the devices)."""
    hv = prepare(conn, hv)
    if instance is not None and not 0 <= instance < hv["instances"]:
        raise FleetError(f"{hv.name}: there is no instance {instance}; instances are 0-{hv['instances'] - 1}.")
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
        if hv["keeper"]["enabled"] and any(line.startswith("keeper: stopped") for line in keeper):
            fleet_keeper.start_again(conn, hv, emit)
        raise
    if any(line.startswith("keeper: stopped") for line in keeper):
        report.steps.insert(0, Step("keeper", "changed", "stopped first: " + "; ".join(
            line for line in keeper if line.startswith("keeper: stopping"))[:200]))
    return report


def left_of(facts: dict, hv: HostVars, instance: int) -> list[dict]:
    """The processes carrying instance's tag in a probe's facts."""
    return [t for t in facts["tagged"] if t["tag"] == f"{hv.deployment_id}/{instance}"]


def _stop(conn: Transport, hv: HostVars, emit: Emit, instance: int | None, check: bool, force: bool,
          now: bool) -> Report:
    report = Report(hv.name)
    before = probe(conn, hv, readonly=True)
    enable_after = False
    front_up = before["proxy"]["alive"] or (before.get("nginx") or {}).get("alive")
    if now:
        if front_up and (instance is None or before["instances"][instance]["alive"]):
            report.add("drain", "skipped", "--now: no drain; requests in flight "
                       + ("" if instance is None else f"on instance {instance} ") + "are cut")
    elif instance is None:
        _drain_front(conn, hv, before, report, emit, check)
    elif before["instances"][instance]["alive"]:
        enable_after = _drain_instance(conn, hv, before, instance, report, emit, check)
    cards_before, cards_why = release.read_cards(conn, hv)
    args = (["--instance", str(instance)] if instance is not None else []) + (["--check"] if check else [])
    r = stop_processes(conn, hv, args, emit)
    if enable_after:
        _agent_steps(conn, hv, f"enable-instance --instance {instance}", report, emit)
    after = probe(conn, hv, readonly=True)
    targets = [f for f in before["instances"] if instance is None or f["index"] == instance]
    for f in targets:
        name = f"instance {f['index']}"
        if not f["alive"]:
            stale = f.get("stale")
            report.add(name, "ok", f"its pid file named pid {f['recorded_pid']}, {stale}: not touched" if stale
                       else "already stopped")
            if instance is not None and not stale and not left_of(before, hv, instance):
                emit(f"{name}: not running: nothing to stop")
        elif check:
            report.add(name, "changed", f"would stop pid {f['pid']} and its session")
        else:
            still = after["instances"][f["index"]]["alive"]
            report.add(name, "failed" if still else "changed",
                       f"pid {f['pid']} still alive" if still else f"stopped pid {f['pid']} and its session")
    if instance is None:
        kp = (before.get("keeper") or {}).get("pid")
        if kp and check:
            report.add("keeper", "changed", f"would stop pid {kp} (first)")
        p = before["proxy"]
        if not p["alive"]:
            report.add("proxy", "ok", "already stopped")
        else:
            report.add("proxy", "changed", ("would stop" if check else "stopped") + f" pid {p['pid']}")
        n = before.get("nginx") or {}
        for what, pid in (("nginx", n.get("pid")), ("watcher", n.get("watcher_pid"))):
            if pid:
                report.add(what, "changed", ("would stop" if check else "stopped") + f" pid {pid}")
    left = after["tagged"] if instance is None else left_of(after, hv, instance)
    if left and not check:
        pids = ", ".join(f"{t['pid']} ({t['cmdline'][:60]})" for t in left)
        report.add("tag sweep", "failed", f"processes with the deployment's tag are still alive: {pids}")
    elif not r.ok and not check:
        report.add("tag sweep", "failed", f"the stop exited {r.exited}: {r.stderr.strip()[-300:]}")
    else:
        report.add("tag sweep", "ok", "no process with the deployment's tag is left" if not check else
                   f"{len(before['tagged'])} tagged process(es) found")
    cards = [instance] if instance is not None else list(range(hv["instances"]))
    release.settle(conn, hv, report, emit, cards, cards_before, cards_why, instance, check, force)
    report.status = status_of(hv, after)
    return report
