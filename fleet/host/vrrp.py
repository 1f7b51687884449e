"""Entry hosts behind virtual addresses, seen from the control node (docs/entry-ha.md).

keepalived runs on the entry host under its supervisor (hostagent/vrrp.py); deploy starts it through the
host agent (`vrrp-start`, `--reload` when its config changed) as its plan says (fleet.plan.steps.keepalived),
stop takes it down first so the address moves to a peer before the front drains (`vrrp-stop`), status
reads which addresses this entry holds (the state probe's `vrrp`), the doctor says whether keepalived can
run here. A host where it cannot (no binary, no CAP_NET_ADMIN, no such interface) gets one sentence saying
what is missing, and the rest of the deploy goes on: like nginx mode, it sits ready for when root arrives.
"""
from __future__ import annotations

import threading

from hostagent import layout
from hostagent.facts import KeepalivedFit, VrrpState

from fleet.errors import FleetError
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport import agent

# Files whose change makes a running keepalived re-read its config.
FILES = (layout.KEEPALIVED_CONF, layout.CHECK_FRONT)
# One lock per group of entries (by their addresses): a deploy of several entries at once reloads their
# keepalived one at a time, each until it has settled, so an address never loses every holder at once.
_GROUP_LOCKS: dict[tuple[str, ...], threading.Lock] = {}
_LOCKS = threading.Lock()


def _group_lock(hv: HostVars) -> threading.Lock:
    with _LOCKS:
        return _GROUP_LOCKS.setdefault(tuple(hv.settings.vrrp.addresses), threading.Lock())


def spec(hv: HostVars) -> dict | None:
    """What the probes need to read keepalived's state: the vrrp section, or None when there is none."""
    if not hv.vrrp_group:
        return None
    v = hv.settings.vrrp
    return {"keepalived": v.keepalived, "interface": v.interface, "addresses": list(v.addresses)}


def apply(conn, hv: HostVars, step, report: Report, emit: Emit) -> None:
    """deploy's keepalived step as planned (fleet.plan.steps.keepalived): its supervisor started, or a running one
    told to re-read its config; kept when it runs and nothing changed."""
    if step.action == "keep":
        report.add("keepalived", "ok", step.said)
        return
    addresses = ", ".join(hv.settings.vrrp.addresses)
    try:
        with _group_lock(hv):
            r = agent.host_command(conn, hv, "vrrp-start" + (" --reload" if step.action == "reload" else ""), emit)
    except FleetError as e:
        report.add("keepalived", "failed", str(e).removeprefix(hv.name + ": "))
        return
    action = r["action"]
    if action in ("missing", "failed"):
        sentence = f"not started: {r['missing']}; the entry serves, but holds no virtual address ({addresses})"
        report.add("keepalived", "skipped", sentence)
        report.warn(f"keepalived: {sentence}")
    elif action == "running":
        report.add("keepalived", "ok", f"already running, supervisor pid {r['pid']}")
    elif action == "reloaded" and not r.get("settled", True):
        report.add("keepalived", "changed", f"reloaded (supervisor pid {r['pid']}), but this entry does not hold "
                   f"again all it held before within 3 advert intervals: `inv status` says who holds {addresses} "
                   f"(see {layout.KEEPALIVED_LOG})")
    else:
        report.add("keepalived", "changed", f"{action}, supervisor pid {r['pid']}, for {addresses} on "
                   f"{hv.settings.vrrp.interface}; log {layout.KEEPALIVED_LOG}")


def stop_first(conn, hv: HostVars, report: Report, emit: Emit, check: bool) -> None:
    """Stop's first step on an entry behind virtual addresses: keepalived goes (SIGTERM: it hands the
    address to a peer at once), so clients move before this entry's front drains."""
    if not hv.vrrp_group:
        return
    if check:
        report.add("keepalived", "changed", "would stop keepalived first (its addresses move to a peer)")
        return
    try:
        r = agent.host_command(conn, hv, "vrrp-stop", emit)
    except FleetError as e:
        report.add("keepalived", "skipped", f"{str(e).removeprefix(hv.name + ': ')}; the whole stop below takes "
                   "it down by identity")
        return
    if r["pid"]:
        report.add("keepalived", "changed", f"stopped first (supervisor pid {r['pid']}): its addresses moved to a peer")


def status_lines(host: str, v: VrrpState | None) -> list[tuple[str, str, str]]:
    """(step name, status, message) for `inv status` of host: which addresses this entry holds, or what is
    wrong; v: the state probe's `vrrp` (hostagent.vrrp.state), None on a host without virtual addresses."""
    if not v:
        return []
    holds = ", ".join(v.holds) or "none"
    if v.pid:
        role = "master of " + holds if v.holds else "backup (holds none of " + ", ".join(v.addresses) + ")"
        return [("keepalived", "ok", f"{role} on {v.interface}; supervisor pid {v.pid}, keepalived pid "
                 f"{v.keepalived_pid}")]
    if v.missing:
        return [("keepalived", "skipped", f"not running: {v.missing}")]
    if v.holds:
        return [("keepalived", "failed", f"not running, yet {v.interface} carries {holds}: `inv deploy --host "
                 f"{host}` starts keepalived, which takes the leftover off first")]
    return [("keepalived", "failed", f"not running: this entry cannot take {', '.join(v.addresses)} if its peer "
             f"fails; `inv deploy --host {host}` starts it (see {layout.KEEPALIVED_LOG})")]


def doctor_check(hv: HostVars, v: KeepalivedFit | None) -> tuple[str, str, str] | None:
    """The doctor's line for keepalived (v: whether it can run here): (status, message, fix); None when the
    host has no vrrp."""
    if not hv.vrrp_group or v is None:
        return None
    if v.missing:
        return ("fail", v.missing, "until then the entry serves without a virtual address; docs/entry-ha.md")
    return ("ok", f"{v.binary} can hold {', '.join(hv.settings.vrrp.addresses)} on {hv.settings.vrrp.interface}", "")
