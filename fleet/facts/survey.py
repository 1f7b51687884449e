"""What a deploy reads before it acts, in one round trip: the doctor's facts (fleet.facts.doctor) and the
deployment's state (fleet.facts.state), and for `--check`, which takes no lock, what the step needs
(fleet.host.preflight's check; a deploy's lock holder checks that first, before it creates anything), read
together on the host by one probe after env_setup (hostagent/probes/deploy.py). With the run lock's holder,
that is all a deploy that changes nothing sends the host: two round trips (docs/ARCHITECTURE.md, "What one
deploy costs").
"""
from __future__ import annotations

from dataclasses import dataclass

from hostagent.facts import DoctorFacts, HostFacts, parse, parse_doctor

from fleet.facts import doctor, state as facts
from fleet.host import boot, preflight
from fleet.settings.inventory import HostVars
from fleet.transport import agent
from fleet.transport.connection import Transport


@dataclass(frozen=True)
class Survey:
    """The first read's answer: the doctor's facts (None when not asked) and the state."""

    doctor: DoctorFacts | None
    found: HostFacts


def read(conn: Transport, hv: HostVars, files: list[str] = (), readonly: bool = False, with_doctor: bool = True,
         needs: bool = False, step: str = "deploy") -> Survey:
    """Read it all in one run (hv prepared). needs: check what the host needs for step too, and raise
    RemoteError naming what it lacks (one sentence) before anything is judged. files, readonly: as
    fleet.facts.state.probe's; the boot hook is read, and whether installing the wanted one would change it."""
    spec = {"needs": preflight.script(hv, step) if needs else None,
            "doctor": doctor.spec(hv) if with_doctor else None,
            "state": facts.spec(hv, files, readonly, boot=True, boot_wanted=_boot_wanted(hv))}
    out = agent.run_script(conn, hv, "deploy", spec, f"reading what {step} needs and the deployment's state",
                           timeout=300, env_setup=True)
    if needs:
        preflight.judge(hv, step, out["needs"])
    return Survey(parse_doctor(out["doctor"]) if out["doctor"] else None, parse(out["state"]))


def _boot_wanted(hv: HostVars) -> dict | None:
    """The boot hook deploy would install ({kind, watchdog}), or None with boot_hook off."""
    kind = boot.wanted(hv)
    return None if kind == "off" else {"kind": kind, "watchdog": hv.settings.keeper.enabled}
