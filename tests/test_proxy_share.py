"""Active-active entries: two proxies in front of the same engines split every engine's slots, so together
they never put more requests on an engine than it runs; one gone, the other takes all the slots, and gives
them back when it returns (proxy/share.py)."""
from __future__ import annotations

import json
import os
import threading
import urllib.request

import pytest
import yaml

from conftest import PYTHON, ROOT, free_ports, http_status, wait_until
from proxy.config import ShareConfig, ShareEntry
from proxy.share import my_slots, split
from proxy_helpers import start_sims


@pytest.mark.unit
@pytest.mark.parametrize("slots, weights, want", [
    (4, [1, 1], [2, 2]), (5, [1, 1], [3, 2]), (7, [1, 3], [2, 5]), (4, [1, 1, 1], [2, 1, 1]), (1, [5], [1])])
def test_split_adds_up_to_the_slots_by_weight(slots, weights, want):
    """Largest remainders go to the earliest entries; the shares add up to the slots exactly."""
    assert split(slots, weights) == want and sum(want) == slots


@pytest.mark.unit
def test_my_slots_counts_every_entry_until_polled_and_only_those_serving_after():
    """1. Not polled yet: the smaller share. 2. Peer serving: the share. 3. Peer gone: every slot.
    4. No share configured, or no limit: the slots as they are."""
    share = ShareConfig(1, (ShareEntry("a", 1, "http://a/health"), ShareEntry("b", 1, None)))
    assert my_slots(4, share, None) == 2
    assert my_slots(4, share, frozenset({0, 1})) == 2
    assert my_slots(4, share, frozenset({1})) == 4
    assert my_slots(4, None, None) == 4 and my_slots(0, share, None) == 0


@pytest.mark.unit
def test_my_slots_keeps_every_slot_when_not_split():
    """Active-passive (split false): the proxy learns its peers' routing but keeps every slot."""
    share = ShareConfig(0, (ShareEntry("a", 1, None), ShareEntry("b", 1, "http://b/health")), split=False)
    assert my_slots(4, share, None) == 4 and my_slots(4, share, frozenset({0, 1})) == 4


@pytest.mark.unit
def test_a_peer_learns_the_decisions_it_has_not_read_and_only_a_peer_may_read_them():
    """1. Proxy a's prefix policy, told to keep its feed (a proxy with peers), sends two prompts (to b0, then
    b1); before that it kept nothing. 2. Its feed after seq 0 has both, after
    the first only the second; a reader with another feed id gets everything. 3. Another policy that adopts
    them matches the prompts' blocks where a sent them, and feeds nothing on. 4. The feed answers the
    peers' address and loopback only."""
    from types import SimpleNamespace
    from proxy.routing import RoutingConfig
    from proxy.routing.prefix import Prefix, PrefixRoute
    from proxy.share import FEED_ID, feed
    a, b = Prefix(RoutingConfig()), Prefix(RoutingConfig())
    backends = [SimpleNamespace(name=f"b{i}", in_flight=0, kv_tokens=None) for i in range(2)]
    a.sent(PrefixRoute([1, 2]), backends[0])
    assert a.feed is None and a.decisions_since(0, 10) == []    # no peers: nothing kept
    a.keep_feed()
    a.sent(PrefixRoute([11, 12, 13]), backends[0])
    a.sent(PrefixRoute([21, 22]), backends[1])
    first = a.feed[0][0]
    assert [d[1:] for d in a.decisions_since(0, 10)] == [("b0", [11, 12, 13]), ("b1", [21, 22])]
    assert [d[1:] for d in a.decisions_since(first, 10)] == [("b1", [21, 22])]
    assert [d[1:] for d in a.decisions_since(0, 1)] == [("b1", [21, 22])]      # the newest when limited
    for _, backend, blocks in a.decisions_since(0, 10):
        b.adopt(backend, blocks)
    assert b.index.match([11, 12, 13]) == {"b0": 3} and b.index.match([21, 22, 99]) == {"b1": 2}
    assert b.feed is None
    share = ShareConfig(0, (ShareEntry("a", 1, None), ShareEntry("b", 1, "http://10.9.0.2:8000/health")))
    proxy = SimpleNamespace(config=SimpleNamespace(share=share),
                            router=SimpleNamespace(pools={"": SimpleNamespace(policy=a)}))
    got = feed(proxy, first, FEED_ID, "10.9.0.2")
    assert got["pools"] == {"": [["b1", [21, 22]]]} and got["seq"] == a.feed[-1][0]
    assert feed(proxy, first, "another", "127.0.0.1")["pools"][""][0] == ["b0", [11, 12, 13]]
    assert feed(proxy, 0, FEED_ID, "10.9.0.3") is None
    assert feed(SimpleNamespace(config=SimpleNamespace(share=None)), 0, FEED_ID, "127.0.0.1") is None


def _chat(port, user, rounds):
    """One round of a user's conversation (a document of its own, then its questions); its X-Backend."""
    messages = [{"role": "system", "content": "You are brief. " * 40},
                {"role": "user", "content": f"User {user}'s document. " + "lorem ipsum dolor sit amet " * 80}]
    for r in range(rounds):
        messages += [{"role": "user", "content": f"question {r}"}, {"role": "assistant", "content": "answer"}]
    body = json.dumps({"model": "m", "messages": messages + [{"role": "user", "content": "next"}],
                       "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
        return r.headers["X-Backend"]


@pytest.mark.process
def test_the_backup_proxy_sends_a_conversation_where_the_master_sent_it(procs, tmp_path):
    """1. Four sim engines; proxies a (the master) and b (the backup) front them with the prefix policy,
    share split false (active-passive), one PYTHONHASHSEED. 2. Six users' first rounds go through a.
    3. b reads a's decisions (its /admin/config share learned reaches a's last). 4. Each user's next round
    goes through b, as after the address moved: every one lands where a sent its first round (a cold index
    would match each by chance one time in four), and b keeps every slot (4)."""
    sims = start_sims(procs, tmp_path, 4, seqs=4, token_ms=1)
    pa, pb = free_ports(2), free_ports(2)
    routing = {"policy": "prefix"}
    _proxy(procs, tmp_path, "a", (pa, pa + 1), sims, 0, pb, split=False, seed=4242, routing=routing)
    _proxy(procs, tmp_path, "b", (pb, pb + 1), sims, 1, pa, split=False, seed=4242, routing=routing)
    first = {u: _chat(pa, u, 0) for u in range(6)}
    assert len(set(first.values())) > 1, first          # spread by load: a match by chance is not the test
    last = _get(f"http://127.0.0.1:{pa}/peer/prefixes")["seq"]
    wait_until(lambda: _get(f"http://127.0.0.1:{pb + 1}/admin/config")["share"]["learned"].get("a", 0) >= last,
               what="b has read a's decisions")
    assert {u: _chat(pb, u, 1) for u in range(6)} == first
    assert _slots(pb + 1) == "4" and _get(f"http://127.0.0.1:{pb + 1}/admin/config")["share"]["hashes_differ"] == []


def _proxy(procs, tmp_path, name, ports, sims, me, peer_port, split=True, seed=None, routing=None):
    conf = {"listen": {"host": "127.0.0.1", "port": ports[0]}, "admin": {"host": "127.0.0.1", "port": ports[1]},
            "backends": [f"127.0.0.1:{p}" for p in sims], "slots": 4,
            "health": {"interval_s": 0.3, "timeout_s": 1},
            "results_log": {"path": str(tmp_path / f"{name}-results.log")},
            "share": {"me": me, "split": split, "entries": [
                {"name": n, "weight": 1, "health": None if i == me else f"http://127.0.0.1:{peer_port}/health"}
                for i, n in enumerate(["a", "b"])]}}
    if routing:
        conf["routing"] = routing
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(conf))
    env = {**os.environ, **({"PYTHONHASHSEED": str(seed)} if seed is not None else {})}
    with open(tmp_path / f"{name}.log", "ab") as log:
        p = procs.start([PYTHON, "-m", "proxy", "--config", str(path)], cwd=ROOT, stderr=log, env=env)
    wait_until(lambda: http_status(f"http://127.0.0.1:{ports[0]}/health") == 200, what=f"proxy {name} healthy")
    return p


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _slots(admin):
    return _get(f"http://127.0.0.1:{admin}/admin/config")["share"]["slots"]


def _load(port, n, failures):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
    for _ in range(n):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        except Exception as e:       # counted, not raised: the test asserts the count
            failures.append(repr(e))


@pytest.mark.process
def test_two_proxies_split_slots_and_the_survivor_takes_them_all(procs, tmp_path):
    """1. Two sim engines with max_num_seqs 4; proxies a and b front both, each with slots 4 and a share.
    2. Once each sees the other serve, each has 2 slots per engine.
    3. Load through both at once (12 clients, more than the 8 slots): no engine ever has more than 4
       requests in flight (its own peak_in_flight: running plus waiting), and nothing fails.
    4. b stops: a's slots grow to 4. 5. b starts again: a gives 2 back."""
    sims = start_sims(procs, tmp_path, 2, seqs=4, token_ms=20)
    pa, pb = free_ports(2), free_ports(2)
    a = _proxy(procs, tmp_path, "a", (pa, pa + 1), sims, 0, pb)
    b = _proxy(procs, tmp_path, "b", (pb, pb + 1), sims, 1, pa)
    wait_until(lambda: _slots(pa + 1) == "2" and _slots(pb + 1) == "2", what="both proxies at 2 slots")
    for s in sims:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{s}/sim/reset-stats", b"", method="POST"))
    failures: list[str] = []
    clients = [threading.Thread(target=_load, args=(port, 4, failures)) for port in [pa] * 6 + [pb] * 6]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    peaks = [_get(f"http://127.0.0.1:{s}/sim/stats")["peak_in_flight"] for s in sims]
    assert failures == [] and max(peaks) <= 4, (failures, peaks)
    assert max(peaks) >= 3, peaks          # the load did fill the slots
    procs.stop(b)
    wait_until(lambda: _slots(pa + 1) == "4", what="a takes every slot once b is gone")
    b = _proxy(procs, tmp_path, "b", (pb, pb + 1), sims, 1, pa)
    wait_until(lambda: _slots(pa + 1) == "2", what="a gives b's share back")
