"""Reading a host's logs: tail the right file (`inv logs`), find one request's lines (`inv trace`)."""
from __future__ import annotations

import json
import shlex

from .display import request_block
from .errors import FleetError
from .inventory import HostVars
from .lifecycle import Emit, Report, prepare
from .transport import Transport

RESULTS_LOG = "logs/req_results.log"


def log_path(hv: HostVars, instance: int | None = None, proxy: bool = False, results: bool = False) -> str:
    """The file `inv logs` shows: an instance's engine log, the proxy's log, or the results log."""
    if sum((instance is not None, proxy, results)) > 1:
        raise FleetError("choose one of --instance I, --proxy and --results.")
    if instance is not None:
        if not 0 <= instance < hv["instances"]:
            raise FleetError(f"{hv.name}: there is no instance {instance}; instances are 0-{hv['instances'] - 1}.")
        return f"{hv['deploy_dir']}/logs/vllm_{instance}.log"
    if results:
        return f"{hv['deploy_dir']}/{RESULTS_LOG}"
    return f"{hv['deploy_dir']}/logs/proxy.log"


def tail(conn: Transport, hv: HostVars, emit: Emit, lines: int = 50, follow: bool = False,
         instance: int | None = None, proxy: bool = False, results: bool = False) -> Report:
    """Print the last lines of one log file on the host, and with follow keep printing as it grows."""
    hv = prepare(conn, hv)
    path = log_path(hv, instance, proxy, results)
    report = Report(hv.name)
    if not conn.exists(path):
        report.add("logs", "failed", f"{path} does not exist yet; has `inv deploy --host {hv.name}` run?")
        return report
    emit(f"==> {hv.name}:{path} <==")
    flag = "-F " if follow else ""
    r = conn.run(f"tail -n {int(lines)} {flag}{shlex.quote(path)}", on_line=emit)
    report.add("logs", "ok" if r.ok else "failed", path if r.ok else r.stderr.strip())
    return report


def find_requests(conn: Transport, hv: HostVars, ident: str) -> list[dict]:
    """Every results-log line whose trace id (`user`) or request id is ident, oldest first.

    The host filters with grep (a rotated log is tens of MB); the exact match is made here.
    Rotated files are read oldest first: .N ... .1, then the live file.
    """
    base = f"{hv['deploy_dir']}/{RESULTS_LOG}"
    backups = hv["proxy"]["results_log"]["backups"]
    files = [f"{base}.{k}" for k in range(backups, 0, -1)] + [base]
    cmd = (f"for f in {' '.join(shlex.quote(f) for f in files)}; do "
           f"[ -f \"$f\" ] && grep -hF -e {shlex.quote(ident)} -- \"$f\"; done; true")
    r = conn.run(cmd)
    found = []
    for line in r.stdout.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and ident in (entry.get("trace_id"), entry.get("request_id")):
            found.append(entry)
    return found


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
        report.add("trace", "ok", f"no results-log line has trace id or request id {ident!r} "
                   f"(searched {RESULTS_LOG} and its {hv['proxy']['results_log']['backups']} rotated files)")
        emit(report.steps[-1].message)
    return report
