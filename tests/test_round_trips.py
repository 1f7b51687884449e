"""What one deploy costs per host, in SSH round trips (a command run or started, a file put or read),
counted by the transport itself (fleet.transport.connection.Transport.round_trips) against the real sshd.

A deploy that changes nothing and a deploy that rolls every instance are held to a budget each: the
roll's grows with its steps (the instances it rolls), never with how long something takes to answer.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from fleet_helpers import inv, stop_by_own_scripts
from sshd import keygen, sshd  # noqa: F401  (the module-scoped fixture)
from test_ssh import ssh_host

from fleet.commands import deploy as fleet_deploy
from fleet.settings import inventory as inv_mod
from fleet.transport import connection as transport

pytestmark = [pytest.mark.ssh, pytest.mark.cluster]

# The budgets, measured (docs/ARCHITECTURE.md, "What one deploy costs"): a deploy that changes nothing
# (the run lock; the first read: what deploy needs, the doctor's facts and the state, in one probe); a roll adds its fixed steps (the
# interim proxy config put and reloaded, the state read again, the final reload, the status read) and
# one host agent restart per instance, whatever each wait takes (the waits are the host's).
NO_CHANGE = 2
ROLL_FIXED = 8
PER_ROLLED_INSTANCE = 2
# How many instances the test deploys and rolls: 2 in the suite; the figures in docs/ARCHITECTURE.md are of
# `FLEET_ROUND_TRIPS_INSTANCES=8 pytest tests/test_round_trips.py -s`.
INSTANCES = int(os.environ.get("FLEET_ROUND_TRIPS_INSTANCES", "2"))


FLEET = Path(fleet_deploy.__file__).resolve().parent.parent


def _room(filename: str) -> str | None:
    """A fleet/ file's room (`commands`, `facts`, ..., or the module at fleet/'s top), None outside fleet/
    and for the sim."""
    try:
        parts = Path(filename).resolve().relative_to(FLEET).parts
    except ValueError:
        return None
    room = parts[0].removesuffix(".py")
    return None if room == "sim" else "render" if room == "templates" else room   # a template's code is render's


# fleet/'s rooms from the top layer down (pyproject.toml's rooms contract).
ROOMS = ["cli", "commands", "facts", "plan", "host", "render", "transport", "settings", "report", "errors"]


class Calls:
    """Calls from one fleet/ file into a function of another (files) and from one room into another
    (rooms, by `caller -> callee` room; up: into a room above the caller's, a function handed down such as
    a command's `emit`), counted with sys.setprofile while it is entered."""

    def __init__(self):
        self.files = self.up = 0
        self.rooms: Counter[str] = Counter()

    def _profile(self, frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        if callee == caller:
            return
        to, by = _room(callee), _room(caller)
        if to is None or by is None:
            return
        self.files += 1
        if to != by:
            self.rooms[f"{by} -> {to}"] += 1
            if ROOMS.index(to) < ROOMS.index(by):
                self.up += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def __str__(self):
        return (f"{self.files} calls across fleet/ files, {sum(self.rooms.values())} across rooms ({self.up} of "
                "them up, into a function handed down): " + ", ".join(f"{k} {v}" for k, v in self.rooms.most_common()))


def _deploy(path, name: str, check: bool = False) -> tuple[int, dict]:
    """One `inv deploy` (check: `--check`) of host name, in this process: its round trips and its recap
    counts; with -s, the calls between fleet/'s files and rooms it made are printed."""
    hv = inv_mod.load(path).host_vars(name)
    conn = transport.connect(hv)
    try:
        with Calls() as calls:
            report = fleet_deploy.deploy(conn, hv, check=check)
    finally:
        conn.close()
    print(f"deploy{' --check' if check else ''}: {calls}")
    counts = {s: report.count(s) for s in ("ok", "changed", "failed")}
    return conn.round_trips, counts


def test_a_no_change_deploy_and_a_roll_cost_round_trips_by_steps_not_by_polls(sshd, tmp_path):
    instances = INSTANCES
    hosts = {"r1": ssh_host(sshd, tmp_path, "r1", instances=instances, max_num_seqs=4)}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"hosts": hosts}))
    try:
        first = inv("deploy", "--host", "r1", inventory=path)
        assert first.returncode == 0, first.stdout + first.stderr
        trips, counts = _deploy(path, "r1")
        assert counts["changed"] == 0 and counts["failed"] == 0, counts
        print(f"no-change deploy: {trips} round trips")
        assert trips <= NO_CHANGE, trips
        # --check takes no lock: its plan comes from the first read alone.
        checked, counts = _deploy(path, "r1", check=True)
        assert counts["changed"] == 0 and counts["failed"] == 0 and checked == 1, (checked, counts)
        # A smaller max_num_seqs: every instance rolls (drain, stop, start, /health, enable), the proxy
        # takes fewer slots first.
        hosts["r1"]["max_num_seqs"] = 2
        path.write_text(yaml.safe_dump({"hosts": hosts}))
        rolled, counts = _deploy(path, "r1")
        assert counts["failed"] == 0 and counts["changed"] >= instances, counts
        print(f"roll of {instances} instances: {rolled} round trips")
        assert rolled <= NO_CHANGE + ROLL_FIXED + PER_ROLLED_INSTANCE * instances, rolled
    finally:
        stop_by_own_scripts(path, ["r1"])
