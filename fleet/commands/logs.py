"""Reading a host's logs: tail the right file (`inv logs`), find one request's lines (`inv trace`)."""
from __future__ import annotations

import json
import shlex

from hostagent import layout

from fleet.commands.display import request_block
from fleet.errors import FleetError, InterruptedRun
from fleet.facts.state import prepare
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport.connection import Transport

RESULTS_LOG = layout.RESULTS_LOG
NGINX_ACCESS_LOG = "logs/nginx_access.log"   # nginx mode's only per-request record (no results log)


def front_mode(conn: Transport, hv: HostVars) -> str:
    """The front the host runs: "nginx" when run/mode says so, else "proxy"."""
    mode = conn.read(layout.path(hv.settings.deploy_dir, layout.MODE))
    return "nginx" if mode and mode.decode(errors="replace").strip() == "nginx" else "proxy"


def log_path(hv: HostVars, instance: int | None = None, proxy: bool = False, results: bool = False,
             keeper: bool = False) -> str:
    """The file `inv logs` shows: an instance's engine log, the proxy's, the results log or the keeper's."""
    if sum((instance is not None, proxy, results, keeper)) > 1:
        raise FleetError("choose one of --instance I, --proxy, --results and --keeper.")
    if keeper:
        return layout.path(hv.settings.deploy_dir, layout.KEEPER_LOG)
    if instance is not None:
        if not 0 <= instance < hv.settings.instances:
            raise FleetError(f"{hv.name}: there is no instance {instance}; instances are 0-{hv.settings.instances - 1}.")
        return layout.path(hv.settings.deploy_dir, layout.instance_log(instance))
    if results:
        return f"{hv.settings.deploy_dir}/{RESULTS_LOG}"
    return layout.path(hv.settings.deploy_dir, layout.PROXY_LOG)


def tail(conn: Transport, hv: HostVars, emit: Emit, lines: int = 50, follow: bool = False,
         instance: int | None = None, proxy: bool = False, results: bool = False, keeper: bool = False) -> Report:
    """Print the last lines of one log file on the host, and with follow keep printing as it grows."""
    hv = prepare(conn, hv)
    path = log_path(hv, instance, proxy, results, keeper)
    report = Report(hv.name)
    if instance is None and not keeper and front_mode(conn, hv) == "nginx":
        # nginx is the front: it writes no proxy log and no results log; its access log is the record.
        emit(f"{hv.name} runs nginx as its front (inv swap-to-proxy to go back): showing its access log")
        path = f"{hv.settings.deploy_dir}/{NGINX_ACCESS_LOG}"
    if not conn.exists(path):
        report.add("logs", "failed", f"{path} does not exist yet; has `inv deploy --host {hv.name}` run?")
        return report
    emit(f"==> {hv.name}:{path} <==")
    if instance is not None:
        # An engine log rotates while the engine runs: the last lines may start in vllm_<i>.log.1.
        cmd = _tail_across(path, hv.settings.engine_log.backups, int(lines), follow)
    else:
        cmd = f"tail -n {int(lines)} {'-F ' if follow else ''}{shlex.quote(path)}"
    try:
        r = conn.run(cmd, on_line=emit)
    except InterruptedRun:
        if not follow:
            raise
        report.add("logs", "ok", f"{path}: followed until Ctrl-C")   # how --follow ends: not a failure
        return report
    if follow and r.exited in (-2, 130):   # tail itself got the terminal's Ctrl-C first
        report.add("logs", "ok", f"{path}: followed until Ctrl-C")
        return report
    report.add("logs", "ok" if r.ok else "failed", path if r.ok else r.stderr.strip())
    return report


def _tail_across(path: str, backups: int, lines: int, follow: bool) -> str:
    """A shell line printing the last lines of path and its rotated files (.K ... .1, then path) as one
    stream, then with follow what is written to path from the byte it had read on (across rotations:
    tail -F)."""
    rotated = " ".join(shlex.quote(f"{path}.{k}") for k in range(backups, 0, -1))
    cmd = (f"f={shlex.quote(path)}; s=$(stat -c %s -- \"$f\" 2>/dev/null || echo 0); "
           f"{{ for r in {rotated}; do [ -f \"$r\" ] && cat -- \"$r\"; done; head -c \"$s\" -- \"$f\"; }} "
           f"| tail -n {lines}")
    if follow:
        cmd += '; exec tail -c +$((s + 1)) -F -- "$f"'
    return cmd


def _grep_oldest_first(conn: Transport, base: str, backups: int, ident: str) -> list[dict]:
    """The JSON lines of base and its rotated files (.N ... .1, then base) holding ident, oldest first.

    The host filters with grep (a rotated log is tens of MB); the exact match is made by the caller.
    """
    files = [f"{base}.{k}" for k in range(backups, 0, -1)] + [base]
    cmd = (f"for f in {' '.join(shlex.quote(f) for f in files)}; do "
           f"[ -f \"$f\" ] && grep -hF -e {shlex.quote(ident)} -- \"$f\"; done; true")
    found = []
    for line in conn.run(cmd).stdout.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            found.append(entry)
    return found


def find_requests(conn: Transport, hv: HostVars, ident: str) -> list[dict]:
    """Every results-log line whose trace id (`user`), W3C trace id (`otel_trace_id`, the X-Trace-Id
    header) or request id is ident, oldest first; then the nginx access-log lines of that request id
    (nginx mode records no trace id)."""
    d, backups = hv.settings.deploy_dir, hv.settings.proxy.results_log.backups
    found = [e for e in _grep_oldest_first(conn, f"{d}/{RESULTS_LOG}", backups, ident)
             if ident in (e.get("trace_id"), e.get("request_id"), e.get("otel_trace_id"))]
    for e in _grep_oldest_first(conn, f"{d}/{NGINX_ACCESS_LOG}", backups, ident):
        if e.get("request_id") == ident:
            found.append(_from_nginx(e))
    return found


def _from_nginx(e: dict) -> dict:
    """An nginx access-log line in the results log's terms, for the same readable block."""
    try:
        latency = round(float(e.get("request_time")) * 1000, 1)
    except (TypeError, ValueError):
        latency = None
    return {"ts": e.get("ts"), "trace_id": None, "request_id": e.get("request_id"), "path": e.get("uri"),
            "status": e.get("status"), "backend": e.get("backend"), "latency_ms": latency,
            "attempt": "nginx", "error": None if e.get("status") == 200 else
            f"nginx: upstream status {e.get('upstream_status')} (nginx records no error body)"}


def trace(conn: Transport, hv: HostVars, emit: Emit, ident: str) -> Report:
    """Show every results-log line of one trace id or request id as a readable block."""
    hv = prepare(conn, hv)
    report = Report(hv.name)
    found = find_requests(conn, hv, ident)
    for entry in found:
        emit(request_block(entry))
    if found:
        report.add("trace", "ok", f"{len(found)} lines for {ident}")
    else:
        # A failed step (exit 2, the sentence on standard error): a script must not take it for a find.
        report.add("trace", "failed", f"no results-log line has trace id, W3C trace id or request id {ident!r} "
                   f"(searched {RESULTS_LOG}, {NGINX_ACCESS_LOG} and their "
                   f"{hv.settings.proxy.results_log.backups} rotated files); check the id, and that --host is "
                   "the entry host that served it")
    return report
