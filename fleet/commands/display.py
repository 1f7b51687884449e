"""Text for people: the status table and the per-step lines. Data in, strings out."""
from __future__ import annotations

import time

from fleet.facts.state import Status
from fleet.report import Report, Step


def status_table(st: Status) -> str:
    """The status of one host as a small table."""
    p = st.proxy
    backends = p.backends or []
    healthy = sum(1 for b in backends if b.get("healthy"))      # the proxy's GET /admin/backends, as it answered
    lines = [f"{st.host}  front={st.front or '-'}  deploy_dir={st.deploy_dir}",
             f"  proxy   :{p.port}  pid {p.pid or '-'}  {p.state}"
             + (f"  ({healthy}/{len(backends)} backends healthy)" if backends else "")]
    n = st.nginx
    if n.pid:
        lines.append(f"  nginx   :{n.port}  pid {n.pid}  {n.state}  watcher pid {n.watcher_pid or '-'}")
    k = st.keeper
    if k:
        lines.append(f"  keeper  pid {k.pid or '-'}  {k.state}"
                     + ("  (NOT RUNNING: dead instances are not restarted)" if k.state == "dead" else ""))
    if st.boot_read:           # read by status, and at the end of deploy and stop
        b = st.boot
        lines.append(f"  boot    {b.kind}: {b.command}" if b else
                     "  boot    no hook: after a reboot nothing starts the deployment")
    v = st.vrrp
    if v:                      # an entry behind virtual addresses (keepalived): which it holds now
        role = (f"master of {', '.join(v.holds)}" if v.holds else "backup, holds none") + f" on {v.interface}"
        lines.append(f"  vrrp    {role}  " + (f"keepalived pid {v.keepalived_pid or '-'} (supervisor {v.pid})"
                                               if v.pid else "keepalived NOT RUNNING"
                                               + (f": {v.missing}" if v.missing else "")))
    groups = st.models
    for g in groups or []:
        names = ", ".join([f"alias {a}" for a in g.aliases] + [f"adapter {a}" for a in g.adapters]
                          + [f"runtime adapter {a.name}" for a in g.runtime_adapters])
        lines.append(f"  model {g.name}: instance(s) {', '.join(map(str, g.instances))}"
                     + (f" ({names})" if names else ""))
    model_col = max([len(i.model) for i in st.instances] + [5]) + 2 if groups else 0
    lines.append(f"  {'instance':<9}{'port':<7}" + (f"{'model':<{model_col}}" if groups else "")
                 + f"{'cards' if groups else 'accel':<7}{'pid':<9}{'pgid':<9}{'state':<12}restarts")
    for i in st.instances:
        last = ""
        if i.last_restart_reason:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.last_restart_at))
            last = f" (last: {i.last_restart_reason} at {when}: {i.last_restart_result or '...'})"
        state = i.state.upper() if i.state == "crashloop" else i.state
        if i.launch == "stale":
            last += f"  STALE: {', '.join(i.stale_settings)}"
        where = f"{i.model:<{model_col}}{','.join(map(str, i.cards)):<7}" if groups else f"{i.accelerator:<7}"
        lines.append(f"  {i.index:<9}{i.port:<7}{where}{i.pid or '-':<9}"
                     f"{i.pgid or '-':<9}{state:<12}{i.restarts}{last}")
    owned = {i.pid for i in st.instances} | {p.pid} | {n.watcher_pid} | {k.pid if k else None}
    others = [t for t in st.tagged if t.pid not in owned]
    # The proxy's span exporter (proxy.otlp: python -m proxy.otlp_export) is its child, with its tag.
    exporters = [t for t in others if p.pid and t.ppid == p.pid and t.part == "proxy"]
    others = [t for t in others if t not in exporters]
    # keepalived and its VRRP child, in the session of their supervisor (vrrp-run, tagged <id>/keepalived).
    vrrp_pid = v.pid if v else None
    others = [t for t in others if not (vrrp_pid and t.sid == vrrp_pid and t.pid != vrrp_pid) and t.pid != vrrp_pid]
    # The engine's own children (EngineCore, Worker) live in their instance's session: expected, not news.
    # A tagged process outside every running session is a leftover of a killed process.
    sessions = {pid for pid in owned if pid}
    children = [t for t in others if t.sid in sessions]
    # Each running instance's log writer (tag <id>/log-<i>, a session of its own) is expected too.
    running = {f"log-{i.index}" for i in st.instances if i.pid}
    writers = [t for t in others if t.sid not in sessions and t.part in running]
    strays = [t for t in others if t.sid not in sessions and t not in writers]
    if exporters:
        lines.append(f"  + {len(exporters)} span exporter(s) of the proxy (proxy.otlp), pid "
                     + ", ".join(str(t.pid) for t in exporters))
    if children:
        lines.append(f"  + {len(children)} engine process(es) in the running instances' sessions")
    if writers:
        lines.append(f"  + {len(writers)} log writer(s) of the running instances (logs/vllm_<i>.log, rotated)")
    if strays:
        lines.append(f"  {len(strays)} process(es) carry the deployment's tag outside any running instance "
                     "(orphans of a killed process; `inv stop --instance I` or a deploy stops them): "
                     + ", ".join(str(t.pid) for t in strays[:12]))
    return "\n".join(lines)


def failures(report: Report) -> list[str]:
    """One line per failed step."""
    lines = [f"{report.host}: UNREACHABLE: {report.unreachable}"] if report.unreachable else []
    lines += [f"{report.host}: FAILED: {s.name}: {s.message}" for s in report.steps if s.status == "failed"]
    return lines


def step_lines(steps: list[Step], verbose: bool = False) -> list[str]:
    """A run's step lines, each step with a message; the new files it put as one line where the first was
    (a first deploy puts about 80, which buried the lines that matter), each on its own with verbose."""
    new = [s for s in steps if s.name.startswith("file ") and s.message.endswith("(new)")]
    listed = {id(s) for s in new}
    lines = []
    for s in steps:
        if new and not verbose and s is new[0]:
            verb = s.message.removesuffix(" (new)")
            lines.append(f"{s.status}: files: {verb} {len(new)} new file(s); -v lists them")
        elif s.message and (verbose or id(s) not in listed):
            lines.append(s.line())
    return lines


def warnings(report: Report) -> list[str]:
    """One line per warning of the run (it failed nothing, but needs the operator's eye)."""
    return [f"{report.host}: WARNING: {w}" for w in report.warnings]


def skips(report: Report) -> list[str]:
    """One line per skipped step, with why: a skip is never silent."""
    return [f"{report.host}: skipped: {s.name}: {s.message or 'no reason given'}"
            for s in report.steps if s.status == "skipped"]


def request_block(e: dict) -> str:
    """One results-log line as a block a person can read at 3 a.m."""
    def v(key, unit=""):
        value = e.get(key)
        return "-" if value is None or value == [] else f"{value}{unit}"
    moved = "continued" if str(e.get("error") or "").startswith("stream interrupted") else "retried"
    attempt = f"attempt {v('attempt')}" + ("" if e.get("final", True) else f" ({moved} elsewhere)")
    lines = [f"{v('ts')}  trace {v('trace_id')}  request {v('request_id')}  {v('path')}  {attempt}",
             f"  backend {v('backend')}  status {v('status')}  finish_reason {v('finish_reason')}  "
             f"tokens {v('completion_tokens')}  latency {v('latency_ms', ' ms')}  retries {v('retries')}  "
             f"stream {v('stream')}" + (f"  tenant {e['tenant']}" if e.get("tenant") else "")
             + (f"  otel trace {e['otel_trace_id']}" if e.get("otel_trace_id") else ""),
             f"  fixups {', '.join(e.get('fixups') or []) or '-'}  think {v('think')}  snippet {e.get('snippet')!r}"
             if e.get("snippet") or e.get("fixups") else None]
    if e.get("error"):
        lines.append(f"  error: {e['error']}")
    if e.get("resumed"):     # a stream its instance broke off, finished on another (proxy/resume.py)
        lines.append(f"  resumed: {' -> '.join(e.get('backends') or [])} after {v('tokens_before')} tokens "
                     f"({v('resume_cause')}), {v('tokens_after')} more; the client's gap {v('resume_gap_ms', ' ms')}")
    if e.get("resume"):
        lines.append(f"  not resumed: {e['resume']}")
    return "\n".join(line for line in lines if line is not None)
