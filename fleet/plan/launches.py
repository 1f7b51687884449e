"""The launch of each instance: what deploy wants it to run, what it runs, and how the two differ.

One source of truth: fleet.render's `wanted_launches(hv)` describes each instance's launch (the engine's full command line, the
environment start_cluster.sh adds, the model, its names and slots, its cards) and its digest; the render
puts both into bin/start_cluster.sh, which copies instance i's into run/instance_<i>.launch when it starts
it, with the overrides set by hand (N, MAX_SEQS, ...) beside them. Deploy, `--check` and `inv status` read
that record back through the state probe and compare it here, so they can never disagree.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from hostagent.facts import HostFacts

from fleet.render import NAMED, wanted_launches
from fleet.settings.inventory import HostVars


def _show(value) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict)) else str(value)


def differences(recorded: dict | None, want: dict) -> list[str] | None:
    """What differs between an instance's recorded launch and the wanted one ("max_num_seqs 4 -> 6",
    "MAX_SEQS=1 set by hand"); [] when it runs the wanted launch; None when nothing was recorded (an
    instance started by an older version, or a record that cannot be read)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("launch"), dict):
        return None
    out = [f"{name}={value} set by hand" for name, value in sorted((recorded.get("overrides") or {}).items())]
    if recorded.get("digest") == want["digest"]:
        return out
    have, new = recorded["launch"], want["launch"]
    out += [f"{key} {_show(have.get(key))} -> {_show(new.get(key))}" for key in NAMED
            if have.get(key) != new.get(key)]
    if len(out) == len(recorded.get("overrides") or {}):
        out.append("engine command")
    return out


@dataclass(frozen=True)
class InstanceLaunch:
    """One instance's launch as the probe found it against the wanted one."""

    index: int
    state: str
    port: int
    running: bool                   # loading or healthy
    recorded: bool                  # its launch record was read
    changes: list[str] | None       # differences() for a running instance; None for one that does not run
    was_seqs: int | None            # the max_num_seqs it was started with (running only)
    # (the names its engine serves now, those it will serve): the proxy routes by them
    names: tuple[list[str], list[str]] = ([], [])

    @property
    def stale(self) -> bool:
        """A running instance that runs another launch than the wanted one."""
        return bool(self.changes)

    @property
    def unrecorded(self) -> bool:
        """A running instance with no launch record (started by an older version)."""
        return self.running and not self.recorded

    @property
    def names_move(self) -> bool:
        """Its engine will serve other names than it serves now."""
        return set(self.names[0]) != set(self.names[1])


def plan(hv: HostVars, found: HostFacts) -> list[InstanceLaunch]:
    """For each instance the probe saw, its launch against the wanted one."""
    want = wanted_launches(hv)
    records = found.launches or []
    out = []
    for f in found.instances:
        i = f.index
        running = f.state in ("healthy", "loading")
        rec = records[i] if i < len(records) else None
        out.append(InstanceLaunch(
            i, f.state, f.port, running, recorded=rec is not None,
            changes=differences(rec, want[i]) if running and i < len(want) else None,
            was_seqs=_seqs(rec) if running else None,
            names=(((rec or {}).get("launch") or {}).get("served_names") or [],
                   want[i]["launch"]["served_names"] if i < len(want) else [])))
    return out


def _seqs(record: dict | None) -> int | None:
    """The max_num_seqs an instance was started with: MAX_SEQS when set by hand, else its launch's."""
    if not isinstance(record, dict):
        return None
    by_hand = (record.get("overrides") or {}).get("MAX_SEQS")
    if by_hand is not None:
        return int(by_hand) if str(by_hand).isdigit() else None
    return (record.get("launch") or {}).get("max_num_seqs")

