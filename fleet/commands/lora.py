"""`inv lora add | remove | list`: runtime LoRA adapters of a host's model groups, through the deployed
host agent (`python -m hostagent lora ...`, hostagent/lora.py), which loads them on the group's running
instances with vLLM's own endpoints and keeps the record (run/lora_adapters.json) that makes them survive
a restart. add and remove hold the deployment's run lock, so no restart reads the record half-way.
"""
from __future__ import annotations

import shlex

from fleet.errors import AgentError, FleetError, RemoteError
from fleet.facts import state as facts
from fleet.host import runlock
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport import agent

# The host agent's per-instance answers, as report statuses.
STATUS = {"loaded": "changed", "unloaded": "changed", "already": "ok", "absent": "ok", "skipped": "skipped",
          "failed": "failed"}


def _refuse_plain(hv: HostVars) -> None:
    if hv.plain:
        raise FleetError(f"{hv.name} serves one model in the plain form, which takes no runtime adapters; set "
                         "`runtime_lora: true` on the host (or on a group of its `models:`) and deploy again.")


def _agent(conn, hv: HostVars, emit: Emit, command: str, raise_failed: bool = False) -> dict:
    """The host agent's answer to a lora command; an agent deployed before it had one says what to do."""
    try:
        return agent.host_command(conn, hv, command, lambda line: emit(line.split(": ", 1)[-1]),
                                  raise_failed=raise_failed)
    except RemoteError as e:
        if "invalid choice: 'lora'" in str(e):
            raise RemoteError(f"{hv.name}: the host agent deployed there has no lora command; run "
                              f"`inv deploy --host {hv.name}` to update it.") from None
        raise


def _run(conn, hv: HostVars, emit: Emit, command: str, what: str) -> Report:
    result = _agent(conn, hv, emit, command)
    if "instances" not in result:            # refused before anything was sent
        raise AgentError(f"{hv.name}: {result.get('error') or 'the host agent gave no answer'}")
    report = Report(hv.name)
    for r in result["instances"]:
        report.add(f"instance {r['index']}", STATUS.get(r["status"], "failed"), r["message"])
    if result.get("error"):
        report.add(what, "failed", result["error"])
    report.data["lora"] = result
    return report


def add(conn, hv: HostVars, emit: Emit, model: str, name: str, path: str, wait: bool = False) -> Report:
    """Load adapter name from path (on the host) on every running instance of group model, and record it."""
    _refuse_plain(hv)
    hv = facts.prepare(conn, hv)
    command = (f"lora add --locked --model {shlex.quote(model)} --name {shlex.quote(name)} "
               f"--path {shlex.quote(path)}")
    with runlock.held(conn, hv, "lora add", emit, wait):
        return _run(conn, hv, emit, command, f"lora add {name}")


def remove(conn, hv: HostVars, emit: Emit, model: str, name: str, wait: bool = False) -> Report:
    """Unload adapter name from every running instance of group model, and drop it from the record."""
    _refuse_plain(hv)
    hv = facts.prepare(conn, hv)
    command = f"lora remove --locked --model {shlex.quote(model)} --name {shlex.quote(name)}"
    with runlock.held(conn, hv, "lora remove", emit, wait):
        return _run(conn, hv, emit, command, f"lora remove {name}")


def listing(conn, hv: HostVars, emit: Emit) -> Report:
    """Each group's adapters, static and runtime, and on which instances each runtime one is loaded."""
    report = Report(hv.name)
    if hv.plain:
        emit("one model in the plain form: no adapters")
        report.add("lora list", "ok", "plain form")
        return report
    hv = facts.prepare(conn, hv)
    result = _agent(conn, hv, emit, "lora list", raise_failed=True)
    for g in result["models"]:
        missing = [f"{r['name']} on instance(s) {', '.join(map(str, r['missing_on']))}"
                   for r in g["runtime"] if r["missing_on"]]
        report.add(f"model {g['name']}", "ok", "; ".join(missing) and "not loaded: " + "; ".join(missing))
    report.data["lora"] = result
    return report
