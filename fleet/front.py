"""The front of a host: the aiohttp proxy or nginx on the entry port, and the swap between them.

The work that needs precise timing (the port handover) runs on the host itself, in `hostagent`
(shipped to deploy_dir like the proxy's code); this module settles what to do, puts the files, calls
it and turns what it prints into report steps.
"""
from __future__ import annotations

import json
import shlex

from . import lifecycle, runlock
from .errors import FleetError, RemoteError
from .inventory import HostVars
from .lifecycle import Emit, Report
from .transport import Transport

NGINX_FILES = ("conf/nginx.conf", "conf/nginx_front.json")
NO_RESULTS_LOG = ("nginx has no results log: logs/req_results.log gets no new lines while nginx is the "
                  "front; logs/nginx_access.log has one JSON line per request (request_id, backend, status, "
                  "request and upstream times), but no trace id, finish_reason, tokens or error bodies.")


class FrontError(FleetError):
    """The swap could not be done; the message says why and what to do."""


def host_command(conn: Transport, hv: HostVars, command: str, emit: Emit,
                 config: str = "conf/nginx_front.json", raise_failed: bool = True,
                 timeout: float | None = 300) -> dict:
    """Run `python -m hostagent COMMAND` in deploy_dir; its FLEET_RESULT line as a dict (a failure said
    there raises FrontError unless raise_failed is False)."""
    line = (f"cd {shlex.quote(hv['deploy_dir'])} && {shlex.quote(hv['python'])} -m hostagent {command} "
            f"--config {shlex.quote(config)}")
    results = []

    def on_line(text: str) -> None:
        if text.startswith("FLEET_RESULT "):
            results.append(text[len("FLEET_RESULT "):])
        else:
            emit(f"{hv.name}: {text}")
    r = conn.run(line, on_line=on_line, timeout=timeout)
    try:
        result = json.loads(results[-1])
    except (IndexError, ValueError):
        raise RemoteError(f"{hv.name}: hostagent {command} failed (exit {r.exited}): "
                          f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}") from None
    if not result["ok"] and raise_failed:
        raise FrontError(f"{hv.name}: {result['error']}")
    return result


def _prepare(conn: Transport, hv: HostVars, report: Report, emit: Emit) -> tuple[HostVars, dict]:
    """Put the changed files (the nginx config included) and read the host's state."""
    hv = lifecycle.prepare(conn, hv)
    files = lifecycle.host_files(hv)
    facts = lifecycle.probe(conn, hv, [f.path for f in files])
    if not facts["deploy_dir_exists"]:
        raise FrontError(f"{hv.name}: nothing is deployed in {hv['deploy_dir']}; run `inv deploy` first.")
    lifecycle._put_files(conn, hv, files, facts, report, emit, check=False, diff=False)
    return hv, facts


def swap_to_nginx(conn: Transport, hv: HostVars, emit: Emit = lambda line: None, wait: bool = False) -> Report:
    """Preflight nginx, hand the entry port over from the proxy, start the /health watcher."""
    hv = lifecycle.prepare(conn, hv)
    with runlock.held(conn, hv, "swap-to-nginx", emit, wait):
        return _swap_to_nginx(conn, hv, emit)


def _swap_to_nginx(conn: Transport, hv: HostVars, emit: Emit) -> Report:
    report = Report(hv.name)
    hv, facts = _prepare(conn, hv, report, emit)
    if not any(f["alive"] and f["health"] == 200 for f in facts["instances"]):
        raise FrontError(f"{hv.name}: no instance is healthy; run `inv deploy` (and check `inv status`) "
                         "before swapping the front.")
    pre = host_command(conn, hv, "check", emit)
    report.add("nginx preflight", "ok", f"nginx {pre['version']} at {pre['nginx']}, nginx -t passes, "
               f"port {hv['proxy']['port']} usable")
    r = host_command(conn, hv, "to-nginx", emit)
    if "gap_ms" in r:
        report.add("front", "changed", f"nginx pid {r['pid']} took port {hv['proxy']['port']} from the proxy: "
                   f"refused connections for at most {r['gap_ms']} ms, queued ones waited {r['ready_ms']} ms")
    elif r.get("changed") and "overlap" in r:
        report.add("front", "changed", f"nginx pid {r['pid']} started on port {hv['proxy']['port']}")
    else:
        report.add("front", "ok", f"nginx already the front, pid {r['pid']}")
    if "watcher_pid" in r:
        report.add("watcher", "changed", f"started, pid {r['watcher_pid']}")
    report.data["swap"] = r
    emit(NO_RESULTS_LOG)
    report.status = lifecycle.status_of(hv, lifecycle.probe(conn, hv))
    _confirm(report, "nginx")
    return report


def swap_to_proxy(conn: Transport, hv: HostVars, emit: Emit = lambda line: None, wait: bool = False) -> Report:
    """Stop the watcher, let nginx quit gracefully, start the aiohttp proxy on the entry port."""
    hv = lifecycle.prepare(conn, hv)
    with runlock.held(conn, hv, "swap-to-proxy", emit, wait):
        return _swap_to_proxy(conn, hv, emit)


def _swap_to_proxy(conn: Transport, hv: HostVars, emit: Emit) -> Report:
    report = Report(hv.name)
    hv, facts = _prepare(conn, hv, report, emit)
    r = host_command(conn, hv, "to-proxy", emit)
    if "gap_ms" in r:
        report.add("front", "changed", f"the proxy took port {hv['proxy']['port']} from nginx: refused "
                   f"connections for at most {r['gap_ms']} ms")
    else:
        report.add("front", "changed" if r["changed"] else "ok",
                   "proxy started" if r["changed"] else "the proxy is already the front")
    report.data["swap"] = r
    emit("the proxy writes its results log again: logs/req_results.log")
    report.status = lifecycle.status_of(hv, lifecycle.probe(conn, hv))
    _confirm(report, "proxy")
    return report


def _confirm(report: Report, want: str) -> None:
    front = report.status["front"]
    report.add("confirm", "ok" if front == want else "failed",
               f"the entry port answers from {front}" if front == want else
               f"the entry port answers from {front or 'nothing'}, not {want}; see `inv status`")


def deploy_nginx(conn: Transport, hv: HostVars, facts: dict, changed_files: set[str], report: Report,
                 emit: Emit, check: bool) -> None:
    """deploy in nginx mode: keep nginx the front, start it when it is down, reload it when its
    configuration changed; the proxy is not started."""
    n = facts.get("nginx") or {}
    stale = any(f in NGINX_FILES or f.startswith("hostagent/") for f in changed_files)
    # keeper.enabled: the keeper does the /health watching (one agent); else the watcher does.
    watching = (facts.get("keeper") or {}).get("alive") if hv["keeper"]["enabled"] else n.get("watcher_alive")
    if n.get("alive") and watching and not stale:
        report.add("front", "ok", f"nginx already running on :{hv['proxy']['port']}, pid {n['pid']}")
        return
    verb = "reload" if n.get("alive") else "start"
    if check:
        report.add("front", "changed", f"would {verb} nginx on :{hv['proxy']['port']}")
        return
    try:
        r = host_command(conn, hv, "reload" if stale else "to-nginx", emit)
    except FleetError as e:
        report.add("front", "failed", str(e))
        return
    report.add("front", "changed", f"nginx {verb}ed, pid {r['pid']}" + (", watcher restarted"
               if r.get("watcher_pid") else ""))
