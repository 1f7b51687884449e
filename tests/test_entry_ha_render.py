"""Entry hosts behind virtual addresses: the inventory's refusals, each one sentence, and the files rendered
for keepalived and the proxy's slot split (docs/entry-ha.md)."""
from __future__ import annotations

import subprocess
import textwrap

import pytest

from fleet import render
from fleet.errors import InventoryError
from fleet.settings import inventory

pytestmark = pytest.mark.unit

BASE = """
defaults:
  engine: sim
  instances: 2
  accelerators: 2
  max_num_seqs: 4
hosts:
  m1: {address: 10.9.0.10, deploy_dir: /srv/m1, ssh: {host: 10.9.0.10}}
  m2: {address: 10.9.0.11, deploy_dir: /srv/m2, ssh: {host: 10.9.0.11}}
  e1:
    address: 10.9.0.1
    ssh: {host: 10.9.0.1}
    deploy_dir: /srv/e1
    fronts: [m1]
    vrrp: {addresses: [10.9.0.100/24, 10.9.0.101/24], interface: eth1}
  e2:
    address: 10.9.0.2
    ssh: {host: 10.9.0.2}
    deploy_dir: /srv/e2
    fronts: [m1]
    vrrp: {addresses: [10.9.0.100/24, 10.9.0.101/24], interface: eth2, slot_weight: 3}
"""


def load(tmp_path, text=BASE, edit=None):
    import yaml
    data = yaml.safe_load(textwrap.dedent(text))
    if edit:
        edit(data)
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return inventory.load(path)


def files(inv, host):
    return {f.path: f for f in render.render_host(render.offline(inv.host_vars(host), "/root"))}


def test_each_entry_gets_a_keepalived_conf_with_unicast_peers_and_priorities_by_order(tmp_path):
    """1. Two entries share two addresses (active-active). 2. e1 masters the first (priority 150 there),
    e2 the second; each names the other as its unicast peer, tracks its front's /health, and does not
    preempt unless asked (active-active preempts by default: each address goes back to its own master).
    3. keepalived itself accepts the file (-t), but for the interface this machine lacks."""
    inv = load(tmp_path)
    one, two = files(inv, "e1"), files(inv, "e2")
    conf = one["conf/keepalived.conf"].content
    assert "virtual_router_id 51\n    priority 150" in conf and "virtual_router_id 52\n    priority 140" in conf
    assert "unicast_src_ip 10.9.0.1" in conf and "unicast_peer {\n        10.9.0.2\n" in conf
    assert "nopreempt" not in conf and "10.9.0.100/24 dev eth1" in conf
    assert "virtual_router_id 51\n    priority 140" in two["conf/keepalived.conf"].content
    check = one["bin/check_front.sh"]
    assert check.mode == 0o755 and "FRONT=127.0.0.1\n" in check.content
    assert 'exec 3<>"/dev/tcp/$FRONT/8000"' in check.content
    path = tmp_path / "k.conf"
    path.write_text(conf)
    r = subprocess.run(["keepalived", "-t", "-f", str(path), "-l"], capture_output=True, text=True)
    assert all("interface" in line for line in (r.stderr + r.stdout).splitlines()), r.stderr


def test_active_active_proxy_config_splits_slots_by_weight_and_names_the_peers_health(tmp_path):
    """1. e2 weighs 3, e1 1. 2. Each proxy.yaml carries the share: its own place and each peer's /health URL;
    the agent's config names the interface and the addresses; a host without vrrp renders neither."""
    inv = load(tmp_path)
    proxy = files(inv, "e1")["conf/proxy.yaml"].content
    assert "share:\n  me: 0\n  split: true\n" in proxy
    assert '{name: "e2", weight: 3, health: "http://10.9.0.2:8000/health"}' in proxy
    assert '"interface": "eth1"' in files(inv, "e1")["conf/hostagent.json"].content
    plain = files(inv, "m1")
    assert "conf/keepalived.conf" not in plain and "share:" not in plain["conf/proxy.yaml"].content


def test_active_passive_has_no_slot_split_but_learns_its_peers_routing(tmp_path):
    """One address: only its holder serves, so its proxy keeps every slot (split false) and only learns
    its peer's prefix routing; both start their proxies with the group's hash seed."""
    def edit(d):
        for e in ("e1", "e2"):
            d["hosts"][e]["vrrp"]["addresses"] = ["10.9.0.100/24"]
    inv = load(tmp_path, edit=edit)
    assert "  split: false\n" in files(inv, "e1")["conf/proxy.yaml"].content
    seeds = {e: [ln for ln in files(inv, e)["bin/start_proxy.sh"].content.splitlines() if "PYTHONHASHSEED=" in ln]
             for e in ("e1", "e2")}
    assert seeds["e1"] == seeds["e2"] and len(seeds["e1"]) == 1
    assert "PYTHONHASHSEED" not in files(inv, "m1")["bin/start_proxy.sh"].content
    assert "fleet_51" in files(inv, "e2")["conf/keepalived.conf"].content
    assert "nopreempt" in files(inv, "e2")["conf/keepalived.conf"].content


def _two_groups(d):
    d["hosts"]["e3"] = dict(d["hosts"]["e1"], address="10.9.0.3", ssh={"host": "10.9.0.3"}, deploy_dir="/srv/e3",
                            fronts=["m2"], vrrp={"addresses": ["10.9.0.100/24"], "interface": "eth3"})
    d["hosts"]["e4"] = dict(d["hosts"]["e3"], address="10.9.0.4", ssh={"host": "10.9.0.4"}, deploy_dir="/srv/e4")


@pytest.mark.parametrize("edit, words", [
    (_two_groups, "the virtual address 10.9.0.100 is claimed by two groups of entry hosts (e1, e2 and e3, e4)"),
    (lambda d: [d["hosts"][e].update(fronts=["m1", e]) for e in ("e1", "e2")],
     "e1 is both an entry behind 10.9.0.100/24, 10.9.0.101/24 and a member these entries front"),
    (lambda d: [d["hosts"][e]["vrrp"].update(addresses=["10.8.0.100/24"]) for e in ("e1", "e2")],
     "10.8.0.100/24 is outside the network of e1's address 10.9.0.1"),
    (lambda d: d["hosts"]["e2"].pop("vrrp"),
     "needs two or more entry hosts with the same vrrp.addresses"),
    (lambda d: d["hosts"]["e2"].update(fronts=["m2"]), "but front different hosts"),
    (lambda d: d["hosts"]["e2"]["vrrp"].update(router_id=60), "hosts.e2.vrrp.router_id: 60 differs from e1's 51"),
    (lambda d: d["hosts"]["e2"]["vrrp"].update(interface=""), "hosts.e2.vrrp.interface: the entry's network interface"),
    (lambda d: d["hosts"]["e1"].update(address="entry-1.lan"), "'entry-1.lan' is not an IPv4 address"),
    (lambda d: d["hosts"]["e2"]["vrrp"].update(slot_weight=9), "e1's share of an instance's 4 slot(s) (weight 1 of 10)"),
    (lambda d: d["hosts"]["e2"]["vrrp"].update(addresses=["10.9.0.300/24"]), "IPv4 addresses with their prefix"),
])
def test_refused_in_one_sentence(tmp_path, edit, words):
    """Each mistake is refused at load, one sentence naming the file and the key, saying what to do."""
    with pytest.raises(InventoryError) as e:
        load(tmp_path, edit=edit)
    message = str(e.value)
    assert words in message and "\n" not in message and str(tmp_path / "hosts.yml") in message


def test_a_deploy_of_both_entries_reloads_their_keepalived_one_at_a_time(tmp_path, monkeypatch):
    """1. Both entries' keepalived.conf changed (their plans reload keepalived); their deploys run at once, in
    two threads. 2. Each one's
    `vrrp-start --reload` (the host agent returns once keepalived settled) runs holding the group's one
    lock, the same for both entries and another for another group: the reloads never overlap.
    3. Each recap line says reloaded."""
    import threading

    from hostagent.facts import parse

    from fleet.host import vrrp
    from fleet.plan import steps as plan
    from fleet.report import Report
    inv = load(tmp_path)
    e1, e2 = inv.host_vars("e1"), inv.host_vars("e2")
    running = parse({"vrrp": {"pid": 5}})
    steps = {hv.name: plan.keepalived(hv, running, {"conf/keepalived.conf"}) for hv in (e1, e2)}
    assert steps["e1"].line() == "reload keepalived: its config changed"
    # Running, its config the same: kept, no host agent command; not running: started.
    assert plan.keepalived(e1, running, set()).action == "keep"
    assert plan.keepalived(e1, parse({}), set()).line() == "start keepalived: not running"
    assert plan.keepalived(inv.host_vars("m1"), running, {"conf/keepalived.conf"}) is None
    calls = []

    def host_command(conn, hv, command, emit):
        calls.append((hv.name, command, vrrp._group_lock(hv).locked()))
        return {"action": "reloaded", "pid": 7, "settled": True}
    monkeypatch.setattr(vrrp.agent, "host_command", host_command)
    reports = {e: Report(e) for e in ("e1", "e2")}
    threads = [threading.Thread(target=vrrp.apply, args=(None, hv, steps[hv.name], reports[hv.name],
                                                          lambda line: None)) for hv in (e1, e2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == [("e1", "vrrp-start --reload", True), ("e2", "vrrp-start --reload", True)]
    assert vrrp._group_lock(e1) is vrrp._group_lock(e2) and not vrrp._group_lock(e1).locked()

    def edit(d):
        for e in ("e1", "e2"):
            d["hosts"][e]["vrrp"]["addresses"] = ["10.9.0.100/24"]
    assert vrrp._group_lock(load(tmp_path, edit=edit).host_vars("e1")) is not vrrp._group_lock(e1)
    assert all("reloaded, supervisor pid 7" in r.steps[-1].message for r in reports.values())
