"""Text for people: the status table and the per-step lines. Data in, strings out."""
from __future__ import annotations

from .lifecycle import Report


def status_table(st: dict) -> str:
    """The status of one host as a small table."""
    p = st["proxy"]
    backends = p.get("backends") or []
    healthy = sum(1 for b in backends if b.get("healthy"))
    lines = [f"{st['host']}  front={st['front'] or '-'}  deploy_dir={st['deploy_dir']}",
             f"  proxy   :{p['port']}  pid {p['pid'] or '-'}  {p['state']}"
             + (f"  ({healthy}/{len(backends)} backends healthy)" if backends else "")]
    n = st.get("nginx") or {}
    if n.get("pid"):
        lines.append(f"  nginx   :{n['port']}  pid {n['pid']}  {n['state']}  watcher pid {n['watcher_pid'] or '-'}")
    lines.append(f"  {'instance':<9}{'port':<7}{'accel':<7}{'pid':<9}{'pgid':<9}state")
    for i in st["instances"]:
        lines.append(f"  {i['index']:<9}{i['port']:<7}{i['accelerator']:<7}{i['pid'] or '-':<9}"
                     f"{i['pgid'] or '-':<9}{i['state']}")
    owned = {i["pid"] for i in st["instances"]} | {p["pid"]} | {(st.get("nginx") or {}).get("watcher_pid")}
    others = [t for t in st.get("tagged", []) if t["pid"] not in owned]
    if others:
        lines.append(f"  {len(others)} more process(es) carry the deployment's tag (engine children "
                     "or orphans): " + ", ".join(str(t["pid"]) for t in others[:12]))
    return "\n".join(lines)


def failures(report: Report) -> list[str]:
    """One line per failed step."""
    lines = [f"{report.host}: UNREACHABLE: {report.unreachable}"] if report.unreachable else []
    lines += [f"{report.host}: FAILED: {s.name}: {s.message}" for s in report.steps if s.status == "failed"]
    return lines
