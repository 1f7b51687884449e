"""The front of a host: the aiohttp proxy or nginx on the entry port, and the swap between them.

The work that needs precise timing (the port handover) runs on the host itself, in `hostagent`
(shipped to deploy_dir like the proxy's code); this module settles what to do, puts the files, calls
it and turns what it prints into report steps.
"""
from __future__ import annotations

import shlex

from hostagent import layout
from hostagent.facts import HostFacts, Proxy, record

from fleet.commands.stop import stop_processes
from fleet.errors import FleetError
from fleet.facts import state as facts
from fleet.host import runlock, sync
from fleet.plan import steps as plan
from fleet.report import Emit, Report
from fleet.settings import schema
from fleet.settings.inventory import HostVars
from fleet.transport import agent
from fleet.transport.connection import Transport

NO_RESULTS_LOG = ("nginx has no results log: logs/req_results.log gets no new lines while nginx is the "
                  "front; logs/nginx_access.log has one JSON line per request (request_id, backend, status, "
                  "request and upstream times), but no trace id, finish_reason, tokens or error bodies.")

NO_BODY_ROUTING = ("nginx has no body-aware routing: proxy.routing.policy {policy} does not apply while nginx is "
                   f"the front ({schema.NGINX_POLICY} instead), so a conversation's rounds no longer go back to the "
                   "instance that holds its prefix; swap back with `inv swap-to-proxy`.")


def _prepare(conn: Transport, hv: HostVars, report: Report, emit: Emit) -> tuple[HostVars, HostFacts]:
    """Put the changed files (the nginx config included) and read the host's state."""
    hv = facts.prepare(conn, hv)
    files = sync.host_files(hv)
    found = facts.probe(conn, hv, [f.path for f in files])
    if not found.deploy_dir_exists:
        raise FleetError(f"{hv.name}: nothing is deployed in {hv.settings.deploy_dir}; run `inv deploy` first.")
    sync.put_files(conn, hv, files, found, report)
    return hv, found


def swap_to_nginx(conn: Transport, hv: HostVars, emit: Emit = lambda line: None, wait: bool = False) -> Report:
    """Preflight nginx, hand the entry port over from the proxy, start the /health watcher."""
    refusal = plan.nginx_refusal(hv)
    if refusal:
        raise FleetError(refusal)
    hv = facts.prepare(conn, hv)
    with runlock.held(conn, hv, "swap-to-nginx", emit, wait):
        return _swap_to_nginx(conn, hv, emit)


def _swap_to_nginx(conn: Transport, hv: HostVars, emit: Emit) -> Report:
    report = Report(hv.name)
    hv, found = _prepare(conn, hv, report, emit)
    # An entry host's backends are other hosts' instances: its proxy's view says whether one is healthy.
    if not any(f.alive and f.health == 200 for f in found.instances) and not any(
            b.get("healthy") for b in found.proxy.backends or []):
        raise FleetError(f"{hv.name}: no instance is healthy; run `inv deploy` (and check `inv status`) "
                         "before swapping the front.")
    pre = agent.host_command(conn, hv, "check", emit, config=agent.FRONT_CONFIG)
    report.add("nginx preflight", "ok", f"nginx {pre['version']} at {pre['nginx']}, nginx -t passes, "
               f"port {hv.settings.proxy.port} usable")
    r = agent.host_command(conn, hv, "to-nginx", emit, config=agent.FRONT_CONFIG)
    if "gap_ms" in r:
        report.add("front", "changed", f"nginx pid {r['pid']} took port {hv.settings.proxy.port} from the proxy: "
                   f"refused connections for at most {r['gap_ms']} ms, queued ones waited {r['ready_ms']} ms")
    elif r.get("changed") and "overlap" in r:
        report.add("front", "changed", f"nginx pid {r['pid']} started on port {hv.settings.proxy.port}")
    else:
        report.add("front", "ok", f"nginx already the front, pid {r['pid']}")
    if "watcher_pid" in r:
        report.add("watcher", "changed", f"started, pid {r['watcher_pid']}")
    report.data["swap"] = r
    emit(NO_RESULTS_LOG)
    policy = hv.settings.proxy.routing.policy
    if policy != schema.NGINX_POLICY:
        emit(NO_BODY_ROUTING.format(policy=policy))
    report.status = facts.status_of(hv, facts.probe(conn, hv))
    _confirm(report, "nginx")
    return report


def swap_to_proxy(conn: Transport, hv: HostVars, emit: Emit = lambda line: None, wait: bool = False) -> Report:
    """Stop the watcher, let nginx quit gracefully, start the aiohttp proxy on the entry port."""
    hv = facts.prepare(conn, hv)
    with runlock.held(conn, hv, "swap-to-proxy", emit, wait):
        return _swap_to_proxy(conn, hv, emit)


def _swap_to_proxy(conn: Transport, hv: HostVars, emit: Emit) -> Report:
    report = Report(hv.name)
    hv, found = _prepare(conn, hv, report, emit)
    r = agent.host_command(conn, hv, "to-proxy", emit, config=agent.FRONT_CONFIG)
    if "gap_ms" in r:
        report.add("front", "changed", f"the proxy took port {hv.settings.proxy.port} from nginx: refused "
                   f"connections for at most {r['gap_ms']} ms")
    else:
        report.add("front", "changed" if r["changed"] else "ok",
                   "proxy started" if r["changed"] else "the proxy is already the front")
    report.data["swap"] = r
    emit("the proxy writes its results log again: logs/req_results.log")
    report.status = facts.status_of(hv, facts.probe(conn, hv))
    _confirm(report, "proxy")
    return report


def _confirm(report: Report, want: str) -> None:
    front = report.status.front
    report.add("confirm", "ok" if front == want else "failed",
               f"the entry port answers from {front}" if front == want else
               f"the entry port answers from {front or 'nothing'}, not {want}; see `inv status`")


def apply(conn: Transport, hv: HostVars, found: HostFacts, step: plan.Step, report: Report, emit: Emit) -> None:
    """deploy's front step as planned (fleet.plan.steps.front): the proxy started, reloaded, or restarted beside
    the old one (a reload it refuses, or that leaves a setting only a restart changes, becomes a restart);
    in nginx mode, nginx started or reloaded; kept, or failed, as the plan says. found: the state as it is
    now (the roll before may have reloaded the proxy)."""
    if step.action in ("keep", "fail"):
        report.add(step.name, "ok" if step.action == "keep" else "failed", step.said)
    elif step.name == "front":
        _nginx(conn, hv, step, report, emit)
    elif step.action == "reload" and _reload_proxy(conn, hv, found.proxy, report, step.keys):
        pass
    elif found.proxy.state in ("healthy", "no-backend"):
        _restart_proxy(conn, hv, found.proxy.state, report, emit)
    else:
        _start_proxy(conn, hv, found.proxy, report, emit)


def _nginx(conn: Transport, hv: HostVars, step: plan.FrontStep, report: Report, emit: Emit) -> None:
    """nginx mode: nginx started, or reloaded (with its watcher), through the host agent."""
    try:
        r = agent.host_command(conn, hv, step.command, emit, config=agent.FRONT_CONFIG)
    except FleetError as e:
        report.add("front", "failed", str(e))
        return
    drained = ""
    if r.get("old_workers"):
        drained = (f"; its old workers finished their requests in {r['drain_ms']} ms" if not r.get("still_draining")
                   else f"; {r['still_draining']} old worker(s) still finish requests after drain_timeout_s")
    took = ""
    if step.keys is not None:
        took = (", API keys taken from the key file" if r.get("keys_digest") == step.keys
                else ", but its API keys are not the key file's yet (see logs/keeper.log)")
    report.add("front", "changed", f"nginx {step.action}ed, pid {r['pid']}" + took + drained
               + (", watcher restarted" if r.get("watcher_pid") else ""))


def _start_proxy(conn: Transport, hv: HostVars, p: Proxy, report: Report, emit: Emit) -> None:
    """Start the proxy (one that runs but does not answer is stopped first), and wait on the host for it."""
    bin_dir = shlex.quote(f"{hv.settings.deploy_dir}/bin")
    if p.alive:     # alive but not answering: nothing to hand the port over from
        stop_processes(conn, hv, ["--proxy"], emit)
    r = conn.run(f"{bin_dir}/start_proxy.sh", on_line=emit)
    if not r.ok:
        report.add("proxy", "failed", f"start_proxy.sh failed (exit {r.exited}): {r.stderr.strip()[-300:]}")
        return
    # The wait is the host's: one host agent command that answers once the proxy is healthy, or has exited.
    f = record(Proxy, agent.host_command(conn, hv, "wait-proxy --timeout-s 30", emit, config=agent.FRONT_CONFIG,
                                         timeout=90))
    if f.state == "healthy":
        report.add("proxy", "changed", f"started, pid {f.pid}, healthy on :{f.port}")
    else:
        report.add("proxy", "failed", _start_failure(conn, hv, f.alive))


def _start_failure(conn, hv: HostVars, alive: bool) -> str:
    """Why the proxy did not come up, in one sentence: the proxy's own (`proxy: cannot read api_keys_file
    ...`, the last line of its log when it exited at start), not its log's older lines."""
    last = facts.log_tail(conn, hv, layout.PROXY_LOG, n=1).strip()
    see = f"`inv logs --host {hv.name} --proxy` shows its log"
    if alive:
        return f"not healthy after 30s (no backend healthy?); {see}"
    if last.startswith("proxy: "):
        return f"exited at start: {last.removeprefix('proxy: ')}"
    return f"exited at start (the last line of logs/proxy.log: {last}); {see}"


def _restart_proxy(conn, hv, state, report, emit) -> None:
    """Replace the running proxy with one running the new code or settings, beside it on the same port
    (hostagent restart-proxy): confirmed first, then the old one drains; the port never refuses."""
    try:
        r = agent.host_command(conn, hv, "restart-proxy" + (" --healthy" if state == "healthy" else ""), emit,
                               config=agent.FRONT_CONFIG, timeout=hv.settings.proxy.shutdown_timeout_s + 120)
    except FleetError as e:
        report.add("proxy", "failed", str(e).removeprefix(f"{hv.name}: "))
        return
    if r["overlap"]:
        cut = r.get("cut") or []
        report.add("proxy", "changed", f"restarted beside the old one on :{hv.settings.proxy.port}, pid {r['old_pid']} "
                   f"-> {r['pid']}: the port refused no connection; the old one finished its requests"
                   + (f", but {len(cut)} cut after proxy.shutdown_timeout_s" if cut else ""))
    else:
        report.add("proxy", "changed", f"restarted, pid {r['old_pid']} -> {r['pid']}: the old one did not share "
                   f"its port, which refused connections for about {r['gap_ms']} ms")


def _reload_proxy(conn, hv, p, report, keys: str | None = None, want: list[str] | None = None) -> bool:
    """Have the running proxy re-read its config and say what came of it: one host agent command
    (`reload-proxy`: the proxy's synchronous `POST /admin/reload`, then on the host the wait for the backends
    it removed to finish their requests, up to drain_timeout_s). keys: the digest of the keys it must then
    run with; want: the backends it names, the inventory's unless given. False when it refused the config,
    kept a setting only a restart changes, or did not answer (then the caller restarts it)."""
    before = p.said("reloads")
    if before is None:        # a proxy that does not report its reloads: restart it
        return False
    want = hv.backends if want is None else want
    removed = [b for b in p.said("backends") or [] if b not in want]
    r = agent.host_command(conn, hv, "reload-proxy" + (" --drain" if removed else ""), lambda line: None,
                           timeout=hv.settings.drain_timeout_s + 120)
    running = r.get("config") or {}
    if r.get("answered") and not r.get("reloaded"):
        error = (running.get("reloads") or {}).get("last_error")
        report.add("proxy", "ok", f"pid {p.pid} refused the new config ({error}); restarting it")
        return False
    if not (r.get("reloaded") and running.get("backends") == want
            and (keys is None or running.get("api_keys_digest") == keys)):
        return False
    # The proxy names what the reload could not change (its listeners, the body limit, the drain time, its
    # log's rotation: proxy.state.RESTART_ONLY); those need a restart.
    if running.get("pending_restart"):
        return False
    added = [b for b in want if b not in p.said("backends", want)]
    report.add("proxy", "changed", f"reloaded, pid {p.pid}, {len(want)} backends"
               + (f" ({len(added)} added: each takes requests once its /health answers 200)" if added else "")
               + (", API keys taken from the key file" if keys is not None else "")
               + _drained(hv, removed, r))
    return True


def _drained(hv, removed: list[str], r: dict) -> str:
    """What came of the wait for the backends a reload removed (reload-proxy --drain), for the report."""
    if not removed:
        return ""
    if r.get("leaving"):
        held = sum(b["in_flight"] for b in r["leaving"])
        return (f"; {len(removed)} removed, {held} request(s) still in flight there after drain_timeout_s "
                f"({hv.settings.drain_timeout_s:g}s): they finish unless their host stops")
    return f"; {len(removed)} removed, drained in {r.get('waited_s', 0):g}s (their requests finished)"
