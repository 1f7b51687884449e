"""What a deploy does to each instance, decided before anything acts: from the wanted launches (the
settings) and the state probe's facts, one step per instance with its reason. `deploy --check` reports the
steps as what it would do; deploy applies them (fleet/deploy.py). A pure function: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hostagent.facts import HostFacts

from . import launch
from .inventory import HostVars

# What a step does: nothing (keep), a start, a start after the leftovers are stopped (restart), the host
# agent's one restart of an instance that runs a stale launch (roll), or nothing yet because it still loads
# a stale launch (later: a deploy once it is healthy rolls it).
ACTIONS = ("keep", "start", "restart", "roll", "later")


@dataclass(frozen=True)
class Step:
    """One instance's step: what, and why (for the report and `--check`)."""

    index: int
    action: str
    reason: str
    port: int = 0
    launch: dict = field(default_factory=dict, compare=False)   # launch.plan's entry (a roll needs it)
    kept: str = ""      # what applying it reports when it leaves the instance as it is (keep, later)

    @property
    def name(self) -> str:
        return f"instance {self.index}"

    @property
    def changes(self) -> bool:
        """Whether applying it changes the host."""
        return self.action in ("start", "restart", "roll")

    def would(self) -> str:
        """The step as `--check` says it."""
        if self.action == "roll":
            return f"would restart ({self.reason})"
        if self.action == "later":
            return f"runs stale settings ({self.reason}); still loading: a deploy once it is healthy restarts it"
        verb = "restart (dead)" if self.action == "restart" else "start"
        return f"would {verb} on :{self.port}"


def instances(hv: HostVars, found: HostFacts, restart: bool = True) -> list[Step]:
    """Each instance's step, in instance order. restart: roll a healthy instance whose launch is stale (False:
    keep it, and say so)."""
    leftovers = {t.part for t in found.tagged}     # processes left behind: stopped before the start
    entries = {p["index"]: p for p in launch.plan(hv, found)}
    out = []
    for f in found.instances:
        p = entries[f.index]
        if f.state in ("healthy", "loading"):
            out.append(_running(hv, f, p, restart))
        elif f.state == "port-taken" or (f.state == "dead" and f.alive) or str(f.index) in leftovers:
            # port-taken: strangers were refused before; this holder carries the instance's tag, its pid
            # file lost or stale. It is stopped (tag and session) and the instance started again.
            out.append(Step(f.index, "restart", f.state, f.port, p))
        else:
            out.append(Step(f.index, "start", f.state, f.port, p))
    return out


def _running(hv: HostVars, f, p: dict, restart: bool) -> Step:
    here = f"already {f.state} on :{f.port}, pid {f.pid}"
    changes = ", ".join(p["changes"] or [])
    if launch.stale(p) and f.state == "healthy" and restart:
        return Step(f.index, "roll", changes, f.port, p)
    if launch.stale(p):
        left = f"{here}; left running stale settings ({changes}): `inv deploy --host {hv.name}` restarts it"
        if f.state == "loading":
            return Step(f.index, "later", changes, f.port, p, kept=left + " once it is healthy")
        return Step(f.index, "keep", changes, f.port, p, kept=left)
    if launch.unrecorded(p):
        return Step(f.index, "keep", "unrecorded", f.port, p, kept=(
            f"{here}; its launch is not recorded (started by an older version), so deploy cannot tell whether "
            f"it runs the current settings: `inv restart --host {hv.name} --instance {f.index}` restarts it "
            "with them, and records them"))
    return Step(f.index, "keep", "current", f.port, p, kept=here)
