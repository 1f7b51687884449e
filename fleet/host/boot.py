"""The boot hook seen from the control node: installed by deploy, removed by stop and remove, read by
status and the doctor.

The hook itself is the host agent's (hostagent/boothook.py, sent on standard input so that a stop can
remove it where nothing is deployed): a crontab `@reboot` line with a keeper watchdog, or a systemd user
unit, each running `bin/boot.sh` (fleet/templates/boot.sh.j2).
"""
from __future__ import annotations

import json
import os
import shlex

from hostagent.facts import BootHookFit

from fleet.errors import RemoteError
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport import agent

ENV = "FLEET_BOOT_HOOK"      # overrides the inventory's boot_hook (auto, cron, systemd, off)
KINDS = ("auto", "cron", "systemd", "off")


def wanted(hv: HostVars) -> str:
    """The boot hook the deploy installs: FLEET_BOOT_HOOK when set, else the inventory's boot_hook."""
    value = os.environ.get(ENV, "").strip() or hv.settings.boot_hook
    if value not in KINDS:
        raise RemoteError(f"{ENV}={value!r} is not one of {', '.join(KINDS)}; set it to one of them or unset it.")
    return value


def _run(conn, hv: HostVars, args: list[str]) -> dict:
    r = agent.run_module(conn, hv, "boothook", shlex.join(args))
    try:
        out = json.loads((r.stdout.strip().splitlines() or [""])[-1])
    except ValueError:
        raise RemoteError(f"{hv.name}: the boot hook's {args[0]} failed (exit {r.exited}): "
                          f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}") from None
    if not out.get("ok"):
        raise RemoteError(f"{hv.name}: boot hook: {out['error']}.")
    return out


def held_back(conn, hv: HostVars, report: Report, why: str) -> None:
    """deploy's last step when the front failed: no hook installed (it would bring back a deployment that
    does not serve); one an earlier deploy installed stays, and is named."""
    shown = _run(conn, hv, ["show", hv.deployment_id])["boot"]
    report.add("boot hook", "skipped", f"not changed: {why}; the {shown['kind']} hook of an earlier deploy stays "
               f"(`inv stop --host {hv.name}` removes it)" if shown else f"not installed: {why}")


def apply(conn, hv: HostVars, step, report: Report, emit: Emit) -> None:
    """deploy's last step as planned (fleet.plan.steps.boot_hook): the hook installed, one left installed removed
    (boot_hook off), or kept as it is (no round trip)."""
    if step.action == "keep":
        report.add("boot hook", "ok", step.said)
        return
    if step.action == "remove":
        gone = _run(conn, hv, ["remove", hv.deployment_id])["removed"]
        report.add("boot hook", "changed" if gone else "ok",
                   f"boot_hook is off: removed the {' and '.join(gone)} hook" if gone else
                   "boot_hook is off: nothing brings the deployment back after a reboot")
        return
    try:
        r = _run(conn, hv, ["install", hv.settings.deploy_dir, hv.deployment_id, wanted(hv),
                            "1" if hv.settings.keeper.enabled else "0"])
    except RemoteError as e:
        report.add("boot hook", "failed", str(e).removeprefix(f"{hv.name}: boot hook: "))
        return
    if r["kind"] is None:
        # Not a failure: the deployment serves; only a reboot would need a person. The doctor says the same.
        report.add("boot hook", "skipped", f"none: {r['missing']}")
        emit(f"boot hook: none: {r['missing']}")
        return
    where = "the user's crontab (@reboot, and the keeper's watchdog every minute)" if r["kind"] == "cron" \
        else "a systemd user unit"
    report.add("boot hook", "changed" if r["changed"] else "ok",
               (f"installed in {where}: " if r["changed"] else f"{r['kind']}: ") + r["command"])
    if r["missing"]:
        emit(f"boot hook: {r['missing']}")


def remove(conn, hv: HostVars, report: Report, check: bool, emit: Emit = lambda line: None) -> None:
    """stop's and remove's step: no hook of the deployment is left (a stopped fleet stays stopped)."""
    if check:
        shown = _run(conn, hv, ["show", hv.deployment_id])["boot"]
        if shown:
            step = report.add("boot hook", "changed", f"would remove the {shown['kind']} hook ({shown['command']})")
            emit(f"boot hook: {step.message}")
        return
    try:
        gone = _run(conn, hv, ["remove", hv.deployment_id])["removed"]
    except RemoteError as e:      # the stop goes on; the failed step says what is left
        report.add("boot hook", "failed", f"{str(e).removeprefix(hv.name + ': ')} It may start the deployment "
                   "again at the next reboot: remove its line (`crontab -e`, the one ending with "
                   f"`# vllm-fleet boot {hv.deployment_id}`).")
        return
    if gone:
        step = report.add("boot hook", "changed", f"removed the {' and '.join(gone)} hook: the deployment stays "
                          "stopped after a reboot")
        emit(f"boot hook: {step.message}")


def doctor_check(b: BootHookFit, hv: HostVars) -> tuple[str, str, str]:
    """The doctor's line about the boot hook (b: the one this host can have): (status, message, fix), a
    warning at worst: without a hook the deployment serves all the same, only a reboot would need a person,
    so no deploy is stopped."""
    kind = wanted(hv)
    if kind == "off":
        return "ok", "boot_hook is off: nothing brings the deployment back after a reboot", ""
    if kind == "systemd" and b.kind != "systemd":
        return ("warn", "boot_hook is systemd, but this host has no systemd user manager with lingering",
                "set boot_hook to auto (cron), or ask the admin for `loginctl enable-linger`")
    if b.kind is None:
        return "warn", b.missing or "no boot hook can be had here", ""
    use = "systemd user unit (lingering is on)" if kind != "cron" and b.kind == "systemd" else \
        "cron: an @reboot line and a keeper watchdog in the crontab"
    if b.missing and kind != "systemd" and b.kind == "cron":
        return "warn", f"{use}, but {b.missing}", ""
    return "ok", f"{use}, for {b.user}", ""
