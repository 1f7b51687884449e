"""The keeper seen from the control node: started by deploy beside the proxy, read back by status.

The keeper itself runs on the host (hostagent/keeper.py); this module starts it through the host agent
(`python -m hostagent keeper-start`) as deploy's plan says (fleet.plan.steps.keeper), and turns what it wrote in
run/keeper.json into status fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hostagent.facts import HostFacts

from fleet.errors import FleetError
from fleet.settings.inventory import HostVars
from fleet.transport import agent

# Files whose change means the running keeper is stale: its code and its configuration.
KEEPER_FILES = (agent.AGENT_CONFIG, agent.FRONT_CONFIG)


@dataclass
class KeeperStatus:
    """The `keeper` object of `inv status --json`."""

    pid: int | None = None
    state: str = "stopped"          # running, dead (its pid file names no live keeper), stopped, disabled
    enabled: bool = True            # keeper.enabled
    instances: dict[str, Any] = field(default_factory=dict)    # run/keeper.json's, as the keeper wrote it


def status(hv: HostVars, facts: HostFacts) -> KeeperStatus:
    """The keeper's part of `inv status`: pid, state, and per instance what it did."""
    k = facts.keeper
    st = k.state if isinstance(k.state, dict) else {}
    enabled = hv.settings.keeper.enabled
    if k.alive:
        state = "running"
    elif k.pidfile:
        state = "dead"
    else:
        state = "stopped" if enabled else "disabled"
    return KeeperStatus(k.pid, state, enabled, st.get("instances") or {})


def instance_fields(keeper: KeeperStatus, index: int) -> dict:
    """What an instance's status object gains from the keeper (fleet.facts.state.InstanceStatus's fields
    by name): restarts, last reason and when, its view; read from the keeper's own record."""
    w = keeper.instances.get(str(index)) or {}
    return {"restarts": w.get("restarts", 0), "restarts_by_reason": w.get("by_reason") or {},
            "last_restart_reason": w.get("last_reason"), "last_restart_at": w.get("last_at"),
            "last_restart_result": w.get("last_result"), "keeper_state": w.get("state"),
            "crashloop": bool(w.get("crashloop")), "crashloop_log": w.get("log_tail") or []}


def apply(conn, hv: HostVars, step, report, emit) -> None:
    """deploy's keeper step as planned (fleet.plan.steps.keeper): started, restarted (its code or configuration
    changed), stopped (keeper.enabled is false), or left as it is."""
    if step.action in ("keep", "skip"):
        report.add("keeper", "ok" if step.action == "keep" else "skipped", step.said)
        return
    if step.action == "stop":
        agent.host_command(conn, hv, "keeper-stop", emit)
        report.add("keeper", "changed", f"stopped ({step.reason})")
        return
    try:
        r = agent.host_command(conn, hv, "keeper-start", emit)
    except FleetError as e:
        report.add("keeper", "failed", str(e))
        return
    report.add("keeper", "changed", f"{step.action}ed, pid {r['pid']}, log logs/keeper.log")


def start_again(conn, hv: HostVars, emit) -> None:
    """Start the keeper a stop took down before that stop was refused (another run held the lock)."""
    try:
        r = agent.host_command(conn, hv, "keeper-start", emit)
        emit(f"keeper: started again, pid {r['pid']}: this stop did not run")
    except FleetError as e:
        emit(f"keeper: could not start it again ({e}); `inv deploy --host {hv.name}` starts it")
