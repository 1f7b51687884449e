"""A deploy's plan: from the wanted launches and the state probe's facts, one step per instance with its
reason, before anything acts (fleet/plan/steps.py)."""
from __future__ import annotations

import copy

import pytest
from fleet_helpers import write_inventory

from hostagent.facts import parse

from fleet import render
from fleet.plan import steps as plan
from fleet.settings import inventory

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


def _proxy(hv, **fields) -> dict:
    """The state probe's answer for a running, healthy proxy that routes to the inventory's backends."""
    return {"port": hv.settings.proxy.port, "pid": 7, "alive": True, "health": 200, "backends": [],
            "config": {"backends": list(hv.backends), "reloads": {"count": 1}, "slots": hv.proxy_slots},
            **fields}


def test_the_files_the_front_and_the_keeper_get_their_steps_and_reasons(tmp_path):
    """From the rendered files and the probe's facts: each file kept or put (and why); the proxy kept,
    reloaded (with what the new config changes for it), restarted (new code) or started; the keeper kept,
    restarted when its configuration changed, or started; `--check`'s lines name only what changes."""
    from fleet.host import sync
    from fleet.render import RenderedFile
    hv = inventory.load(write_inventory(tmp_path, instances=2)).host_vars("t")
    files = [RenderedFile("conf/proxy.yaml", "new", 0o644), RenderedFile("bin/start_proxy.sh", "same", 0o755),
             RenderedFile("bin/stop_cluster.sh", "same", 0o755), RenderedFile("conf/hostagent.json", "x", 0o644)]
    found = parse({"proxy": _proxy(hv), "keeper": {"pid": 9, "alive": True},
                   "files": {"conf/proxy.yaml": "old", "bin/start_proxy.sh": sync._sha("same"),
                             "bin/stop_cluster.sh": sync._sha("same"), "conf/hostagent.json": sync._sha("x")},
                   "file_modes": {"bin/stop_cluster.sh": 0o644}})
    steps = plan.make(hv, found, files[:3])
    assert [(s.name, s.action, s.reason) for s in steps.files] == [
        ("file conf/proxy.yaml", "put", "content changed"), ("file bin/start_proxy.sh", "keep", ""),
        ("file bin/stop_cluster.sh", "put", "mode 0644 -> 0755")]
    assert steps.changed_files == {"conf/proxy.yaml", "bin/stop_cluster.sh"}
    # Only the proxy's config changed, and the proxy answers: a reload; the keeper's files are the same.
    assert [(s.name, s.action, s.reason) for s in steps.front] == [("proxy", "reload", "its config changed")]
    assert steps.front[0].checked() == ("changed", "would reload pid 7 with the new config (its config changed)")
    assert (steps.keeper.action, steps.keeper.checked()) == ("keep", ("ok", "already running, pid 9"))
    # One more backend in the inventory than the running proxy routes to, fewer slots: said so.
    fewer = parse({"proxy": _proxy(hv, config={"backends": hv.backends[:1], "reloads": {}, "slots": 99})})
    assert plan.front(hv, fewer, {"conf/proxy.yaml"})[0].reason == f"1 backend(s) added, slots 99 -> {hv.proxy_slots}"
    # New proxy code: a restart beside the old one; the keeper's configuration changed: it restarts too.
    changed = {"proxy/forward.py", "conf/hostagent.json"}
    assert plan.front(hv, found, changed)[0].line() == "restart proxy: its code or start script changed"
    assert plan.keeper(hv, found, changed).line() == "restart keeper: its code or configuration changed"
    # Nothing runs: both start; a stranger on the entry port: the plan says the front cannot be done.
    stopped = parse({"proxy": {"port": hv.settings.proxy.port}})
    assert plan.front(hv, stopped, set())[0].line() == "start proxy: stopped"
    assert plan.keeper(hv, stopped, set()).line() == "start keeper: not running"
    taken = parse({"proxy": {"port": hv.settings.proxy.port, "listening": True}})
    assert plan.front(hv, taken, set())[0].checked()[0] == "failed"
    # Nothing differs: the plan says so, and keeps everything.
    same = plan.make(hv, found, files[1:2])
    assert same.lines() == ["nothing to change"] and not any(s.changes for s in same.steps())
    assert steps.lines() == ["put file conf/proxy.yaml: content changed",
                             "put file bin/stop_cluster.sh: mode 0644 -> 0755", "reload proxy: its config changed"]


def test_the_boot_hook_is_installed_only_when_the_wanted_one_is_not_there(tmp_path, monkeypatch):
    """The state probe says whether installing the wanted hook would change anything (`boot_as_wanted`):
    kept when not, installed when it is missing or differs; with boot_hook off, one left installed is removed."""
    hv = inventory.load(write_inventory(tmp_path, instances=1)).host_vars("t")
    cron = {"kind": "cron", "command": "/d/bin/boot.sh"}
    monkeypatch.setenv("FLEET_BOOT_HOOK", "off")
    assert plan.boot_hook(hv, parse({})).action == "keep"
    assert plan.boot_hook(hv, parse({"boot": cron})).line() == "remove boot hook: boot_hook is off"
    monkeypatch.setenv("FLEET_BOOT_HOOK", "cron")
    assert plan.boot_hook(hv, parse({"boot": cron, "boot_as_wanted": True})).checked() == ("ok", "cron: /d/bin/boot.sh")
    assert plan.boot_hook(hv, parse({"boot": cron, "boot_as_wanted": False})).line() == \
        "install boot hook: it differs from the one deploy installs"
    assert plan.boot_hook(hv, parse({"boot": None})).checked() == ("changed", "would install the boot hook (cron; "
                                                                   "not installed)")
