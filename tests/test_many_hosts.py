"""Many hosts without SSH: host selection, bounded parallelism, failure isolation and exit codes,
the entry host's backends (`fronts`), and --check / --diff on a local host."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import yaml
from fleet_helpers import inv, write_inventory

from fleet.commands import runner
from fleet.errors import InventoryError, RemoteError, UnreachableError
from fleet.report import Report
from fleet.settings import cluster, inventory

pytestmark = pytest.mark.process


def write(tmp_path: Path, hosts: dict, groups: dict | None = None) -> Path:
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"hosts": hosts, **({"groups": groups} if groups else {})}))
    return path


def sim_host(base: int, **extra) -> dict:
    return {"connection": "local", "engine": "sim", "accelerator": "sim", "accelerators": 2, "instances": 2,
            "base_port": base, "proxy": {"port": base + 10, "admin_port": base + 11}, **extra}


def test_select_and_bounded_parallel_runs(tmp_path):
    """1. --host takes a comma list, a group and all; 2. at most `forks` hosts run at once; 3. a host
    that fails or is unreachable does not stop the others; exit codes 2 and 4; reports in inventory order."""
    hosts = {f"h{i}": sim_host(20000 + 100 * i) for i in range(4)}
    inv_ = inventory.load(write(tmp_path, hosts, groups={"odd": {"hosts": ["h1", "h3"]}}))
    assert inv_.select("h2,odd") == ["h2", "h1", "h3"]
    assert inv_.select("all") == ["h0", "h1", "h2", "h3"]
    with pytest.raises(InventoryError, match="no host or group named 'nope'"):
        inv_.select("h1,nope")

    for forks, most in ((1, 1), (2, 2), (5, 4)):
        lock, active, peak = threading.Lock(), [0], [0]
        # each action waits until `most` of them run at once: a runner that ran fewer breaks the barrier
        together = threading.Barrier(most, timeout=30)

        def action(conn, hv, emit):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            together.wait()
            with lock:
                active[0] -= 1
            return Report(hv.name)
        reports = runner.run_hosts(inv_, "all", action, forks=forks)
        assert [r.host for r in reports] == ["h0", "h1", "h2", "h3"] and peak[0] == most

    done = []

    def flaky(conn, hv, emit):
        if hv.name == "h1":
            raise RemoteError("h1: start_cluster.sh failed")
        if hv.name == "h2":
            raise UnreachableError("h2: cannot reach 10.0.0.2:22")
        if hv.name == "h3":
            raise KeyError("a bug")
        done.append(hv.name)
        return Report(hv.name)
    reports = runner.run_hosts(inv_, "all", flaky, forks=4)
    assert done == ["h0"]
    assert [r.failed for r in reports] == [False, True, False, True]
    assert reports[2].unreachable and reports[2].recap().endswith("failed=0 unreachable=1")
    assert "unexpected error (KeyError" in reports[3].steps[0].message
    assert runner.exit_code(reports) == 4
    assert runner.exit_code([reports[0], reports[1]]) == 2 and runner.exit_code([reports[0]]) == 0


def test_entry_host_backends_and_order(tmp_path):
    """An entry host's backends are its members' instances at their address; an entry not in its own
    list runs no instance; deploy takes members first, stop entries first; mistakes are one sentence."""
    hosts = {
        "gw": {**sim_host(30000), "fronts": ["k1", "k2"]},
        "k1": {**sim_host(31000), "address": "10.1.0.1"},
        "k2": {**sim_host(31000), "connection": "ssh", "ssh": {"host": "10.1.0.2"}},
        "self": {**sim_host(32000), "fronts": ["self", "k1"]},
    }
    inv_ = inventory.load(write(tmp_path, hosts))
    gw = inv_.host_vars("gw")
    assert gw.backends == ["10.1.0.1:31000", "10.1.0.1:31001", "10.1.0.2:31000", "10.1.0.2:31001"]
    assert gw.ports == [] and gw.settings.instances == 0
    me = inv_.host_vars("self")
    assert me.backends == ["127.0.0.1:32000", "127.0.0.1:32001", "10.1.0.1:31000", "10.1.0.1:31001"]
    # k1 is fronted: its instances listen on its address (not loopback), where its own proxy reaches them too.
    assert inv_.host_vars("k1").settings.bind == "10.1.0.1"
    assert inv_.host_vars("k1").backends == ["10.1.0.1:31000", "10.1.0.1:31001"]
    assert me.settings.bind == "127.0.0.1" and gw.settings.bind == "127.0.0.1"
    from fleet.render import render_host
    conf = yaml.safe_load(next(f for f in render_host(gw) if f.path == "conf/proxy.yaml").content)
    assert conf["backends"] == gw.backends
    hvs = [inv_.host_vars(n) for n in ["gw", "k1", "k2"]]
    assert [[h.name for h in b] for b in cluster.phases(hvs, "entry-last")] == [["k1", "k2"], ["gw"]]
    assert [[h.name for h in b] for b in cluster.phases(hvs, "entry-first")] == [["gw"], ["k1", "k2"]]
    assert [[h.name for h in b] for b in cluster.phases(hvs, None)] == [["gw", "k1", "k2"]]

    for bad, message in (
        ({"fronts": ["k1", "ghost"]}, "hosts.gw.fronts: 'ghost' is not defined under hosts"),
        ({"fronts": ["self"]}, "'self' is itself an entry host"),
        ({"fronts": ["k1", "k1"]}, "k1 and k1 both put an instance at 10.1.0.1:31000"),
    ):
        broken = {**hosts, "gw": {**hosts["gw"], **bad}}
        with pytest.raises(InventoryError, match=re.escape(message)):
            inventory.load(write(tmp_path, broken))


def test_an_entry_gives_each_backend_its_members_max_num_seqs_and_an_entry_first_step_leads_the_run(tmp_path):
    """1. An entry (max_num_seqs 4 by default) fronting members that run 2: its proxy gives each backend 2
    slots (plus its headroom), and status says 2; 2. members that disagree are refused in one sentence;
    3. with entry_first, the runner runs it on the entry before the members, its steps lead the entry's
    report; a failed one runs no host's action and says so."""
    hosts = {"gw": {**sim_host(30000), "fronts": ["k1", "k2"], "proxy": {"port": 30010, "admin_port": 30011,
                                                                          "queue": {"headroom": 1}}},
             "k1": sim_host(31000, address="10.1.0.1", max_num_seqs=2),
             "k2": sim_host(32000, address="10.1.0.2", max_num_seqs=2)}
    inv_ = inventory.load(write(tmp_path, hosts))
    gw = inv_.host_vars("gw")
    from fleet.render import proxy_config
    assert yaml.safe_load(proxy_config(gw))["slots"] == 3 and gw.served_model().max_num_seqs == 2
    assert yaml.safe_load(proxy_config(gw, slots={"any": 1}))["slots"] == 2
    assert [h.name for h in inv_.host_vars("k1").entry_hosts()] == ["gw"] and gw.entry_hosts() == []
    with pytest.raises(InventoryError, match=re.escape("k2 serves sim-model with max_num_seqs 4, another "
                                                       "fronted host with 2; give the model one max_num_seqs")):
        inventory.load(write(tmp_path, {**hosts, "k2": sim_host(32000, address="10.1.0.2")}))

    order: list[str] = []

    def first(conn, hv, emit, fail=False):
        order.append(f"first {hv.name}")
        r = Report(hv.name)
        r.add("proxy slots", "failed" if fail else "changed")
        return r

    def action(conn, hv, emit):
        order.append(hv.name)
        r = Report(hv.name)
        r.add("deploy", "ok")
        return r
    inv_ = inventory.load(write(tmp_path, hosts))
    reports = runner.run_hosts(inv_, "all", action, forks=1, order="entry-last", entry_first=first)
    assert order == ["first gw", "k1", "k2", "gw"]
    assert [s.name for s in reports[0].steps] == ["proxy slots", "deploy"]
    order.clear()
    reports = runner.run_hosts(inv_, "all", action, forks=1, order="entry-last",
                               entry_first=lambda c, h, e: first(c, h, e, fail=True))
    assert order == ["first gw"] and reports[0].failed
    assert [s.status for r in reports[1:] for s in r.steps] == ["skipped", "skipped"]


def test_check_and_diff_on_a_local_host(tmp_path):
    """deploy --check --diff on a local host never deployed: the diff of every file against /dev/null,
    what would start, and nothing written or started."""
    path = write_inventory(tmp_path, instances=2)
    r = inv("deploy", "--host", "t", "--check", "--diff", inventory=path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--- /dev/null" in r.stdout and "+++ rendered:bin/start_cluster.sh" in r.stdout
    assert "+++ rendered:proxy/app.py" in r.stdout
    assert re.search(r"^changed: instance 1: would start on :\d+$", r.stdout, re.M)
    assert "changed: proxy: would start" in r.stdout
    assert re.search(r"^t : ok=\d+ changed=\d+ skipped=0 failed=0 unreachable=0$", r.stdout, re.M)
    assert not (tmp_path / "deploy").exists()
