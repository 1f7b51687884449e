"""A deploy's plan: from the wanted launches and the state probe's facts, one step per instance with its
reason, before anything acts (fleet/plan.py)."""
from __future__ import annotations

import copy

import pytest

from fleet import inventory, plan, render
from fleet_helpers import write_inventory
from hostagent.facts import parse

pytestmark = pytest.mark.unit


def _found(hv, states: list[tuple[str, bool]], launches: list) -> object:
    return parse({"proxy": {"port": hv.settings.proxy.port}, "launches": launches, "instances": [
        {"index": i, "port": p, "state": state, "alive": alive, "pid": 100 + i if alive else None}
        for i, (p, (state, alive)) in enumerate(zip(hv.ports, states))]})


def test_each_instance_gets_its_step_and_its_reason(tmp_path):
    hv = inventory.load(write_inventory(tmp_path, instances=5, max_num_seqs=2)).host_vars("t")
    wanted = render.wanted_launches(hv)
    was = copy.deepcopy(wanted[0])
    was["launch"]["max_num_seqs"], was["digest"] = 4, "an older one"
    found = _found(hv, [("healthy", True), ("stopped", False), ("dead", True), ("healthy", True),
                        ("loading", True)], [was, None, None, wanted[3], was])
    steps = plan.instances(hv, found)
    assert [(s.index, s.action) for s in steps] == [(0, "roll"), (1, "start"), (2, "restart"), (3, "keep"),
                                                   (4, "later")]
    assert steps[0].reason == "max_num_seqs 4 -> 2" and steps[0].would() == "would restart (max_num_seqs 4 -> 2)"
    assert steps[1].would() == f"would start on :{hv.ports[1]}" and steps[2].would().startswith("would restart (dead)")
    assert steps[3].kept == f"already healthy on :{hv.ports[3]}, pid 103" and not steps[3].changes
    assert "once it is healthy" in steps[4].kept and [s.changes for s in steps] == [True, True, True, False, False]
    # --no-restart: the stale healthy instance is kept, and the report says how to roll it.
    kept = plan.instances(hv, found, restart=False)[0]
    assert kept.action == "keep" and "left running stale settings (max_num_seqs 4 -> 2)" in kept.kept


def test_processes_left_behind_make_a_start_a_restart(tmp_path):
    hv = inventory.load(write_inventory(tmp_path, instances=2)).host_vars("t")
    found = _found(hv, [("stopped", False), ("stopped", False)], [None, None])
    found.tagged = parse({"tagged": [{"pid": 9, "tag": f"{hv.deployment_id}/1"}]}).tagged
    assert [s.action for s in plan.instances(hv, found)] == ["start", "restart"]
