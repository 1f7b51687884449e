"""Active-active entries: two proxies in front of the same engines split every engine's slots, so together
they never put more requests on an engine than it runs; one gone, the other takes all the slots, and gives
them back when it returns (proxy/share.py)."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

from conftest import PYTHON, ROOT, free_ports, http_status, wait_until
from proxy.admission import TenantConfig, Tenants
from proxy.config import ShareConfig, ShareEntry, parse_config
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
    from proxy.balancer import Balancer
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
    pool = Balancer([])
    pool.policy = a        # the feed reads the policy through its pool (the balancer is its one caller)
    proxy = SimpleNamespace(config=SimpleNamespace(share=share), router=SimpleNamespace(pools={"": pool}))
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


def _proxy(procs, tmp_path, name, ports, sims, me, peer_port, split=True, seed=None, routing=None, tenants=None):
    conf = {"listen": {"host": "127.0.0.1", "port": ports[0]}, "admin": {"host": "127.0.0.1", "port": ports[1]},
            "backends": [f"127.0.0.1:{p}" for p in sims], "slots": 4,
            "health": {"interval_s": 0.3, "timeout_s": 1},
            "results_log": {"path": str(tmp_path / f"{name}-results.log")},
            "share": {"me": me, "split": split, "entries": [
                {"name": n, "weight": 1, "health": None if i == me else f"http://127.0.0.1:{peer_port}/health"}
                for i, n in enumerate(["a", "b"])]}}
    if routing:
        conf["routing"] = routing
    if tenants:
        conf["tenants"] = tenants
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


def _admits(admin):
    """This proxy's part of the default tenant's requests_per_minute (/admin/config)."""
    tenants = _get(f"http://127.0.0.1:{admin}/admin/config")["tenants"]
    return next(t for t in tenants if t["name"] == "default")["admits_per_minute"]["requests"]


def _burst(ports, n):
    """n short chats, sent in turn to each port; how many each port admitted (200) and the seconds it took."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    admitted, t0 = dict.fromkeys(ports, 0), time.monotonic()
    for i in range(n):
        port = ports[i % len(ports)]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
                admitted[port] += 1
        except urllib.error.HTTPError as e:
            assert e.code == 429 and e.headers["Retry-After"], (e.code, e.read())
    return admitted, time.monotonic() - t0


@pytest.mark.process
def test_the_pair_admits_a_tenants_requests_per_minute_once_and_a_survivor_all_of_it(procs, tmp_path):
    """1. Proxies a and b in an active-active share; the tenant `default` has requests_per_minute N = 10.
    2. Once each sees the other serve, each admits N/2 a minute (its part, as it splits slots).
    3. 3N requests spread over both at once: the pair admits N (plus what refills while they run), not 2N.
    4. b stops: a's part becomes N. 5. A proxy whose peer is down from the start admits N of a burst of 2N."""
    n = 10
    tenants = {"default": {"requests_per_minute": n}}
    sims = start_sims(procs, tmp_path, 2, seqs=4, token_ms=1)
    pa, pb, pc = free_ports(2), free_ports(2), free_ports(2)
    _proxy(procs, tmp_path, "a", (pa, pa + 1), sims, 0, pb, tenants=tenants)
    b = _proxy(procs, tmp_path, "b", (pb, pb + 1), sims, 1, pa, tenants=tenants)
    wait_until(lambda: _admits(pa + 1) == n // 2 and _admits(pb + 1) == n // 2, what="each proxy at half the limit")
    admitted, took = _burst([pa, pb], 3 * n)
    refill = int(took * n / 60) + 1
    assert n <= sum(admitted.values()) <= n + refill and min(admitted.values()) >= n // 2, (admitted, took)
    procs.stop(b)
    wait_until(lambda: _admits(pa + 1) == n, what="a admits the whole limit once b is gone")
    _proxy(procs, tmp_path, "c", (pc, pc + 1), sims, 0, pb, tenants=tenants)     # b's port: nobody answers
    wait_until(lambda: _admits(pc + 1) == n, what="c, alone, admits the whole limit")
    admitted, took = _burst([pc], 2 * n)
    assert n <= admitted[pc] <= n + int(took * n / 60) + 1, (admitted, took)


@pytest.mark.unit
def test_a_tenants_limit_follows_this_entrys_share():
    """1. A peer serves: this proxy admits 5 of 10. 2. The peer gone: 10, the bucket keeping its fraction
    (emptied, it stays empty: the peer's admissions are not handed out again). 3. The peer back: 5 again.
    4. Without a share the whole limit, and no bucket without a limit."""
    share = ShareConfig(0, (ShareEntry("a", 1, None), ShareEntry("b", 1, "http://b/health")))
    alive = [frozenset({0, 1})]
    tenants = Tenants({"t": TenantConfig(requests_per_minute=10)}, part=lambda n: my_slots(n, share, alive[0]))
    t = tenants["t"]
    assert t.admits_per_minute() == {"requests": 5, "tokens": None}
    for _ in range(5):
        t.admitted(0)
    alive[0] = frozenset({0})
    tenants.update({"t": TenantConfig(requests_per_minute=10)})
    assert t.admits_per_minute()["requests"] == 10 and t.requests.level < 1 and t.refusal() is not None
    alive[0] = frozenset({0, 1})
    tenants.update({"t": TenantConfig(requests_per_minute=10)})
    assert t.requests.capacity == 5
    assert Tenants({"t": TenantConfig(requests_per_minute=10)})["t"].admits_per_minute()["requests"] == 10


@pytest.mark.unit
async def test_the_poll_lives_through_a_peer_that_answers_garbage_and_learns_once_it_answers_well(tmp_path, caplog):
    """1. A fake peer entry: /health 200; its feed answers, round after round, text that is not JSON, then
    JSON of wrong shapes (a list, a seq that is no number, pools that are no mapping, a decision that is no
    [backend, blocks]), then a good feed. 2. This proxy polls it every 0.05 s: the poll task lives through
    it all, logs each kind once (not each round), and learns the good feed's decision."""
    from aiohttp import web
    import aiohttp
    from proxy import share
    from proxy.routing.prefix import HASH_PROBE
    from proxy.state import Proxy
    good = {"id": "feed1", "seq": 7, "probe": HASH_PROBE, "pools": {"": [["127.0.0.1:9", [11, 12, 13]]]}}
    answers = [b"<html>oops", b"<html>oops", b"[1]", json.dumps({**good, "seq": "x"}).encode(),
               json.dumps({**good, "pools": [1]}).encode(), json.dumps({**good, "pools": {"": [[1]]}}).encode(),
               json.dumps({**good, "pools": {"": [["127.0.0.1:9", ["a"]]]}}).encode(), json.dumps(good).encode()]
    served = []

    async def feed(request):
        served.append(request.query.get("since"))
        return web.Response(body=answers[min(len(served), len(answers)) - 1], content_type="application/json")
    async def health(request):
        return web.json_response({"status": "ok"})
    peer = web.Application()
    peer.router.add_get("/health", health)
    peer.router.add_get(share.FEED_PATH, feed)
    runner = web.AppRunner(peer)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    config = parse_config({"backends": ["127.0.0.1:9"], "routing": {"policy": "prefix"},
                           "health": {"interval_s": 0.05, "timeout_s": 1},
                           "results_log": {"path": str(tmp_path / "results.log")},
                           "share": {"me": 0, "entries": [{"name": "a", "weight": 1, "health": None}, {
                               "name": "b", "weight": 1, "health": f"http://127.0.0.1:{port}/health"}]}})
    proxy = Proxy(config)
    proxy.session = aiohttp.ClientSession()
    task = asyncio.create_task(share.poll(proxy))
    try:
        for _ in range(200):
            if proxy.router.peer_feeds.get("b") == ("feed1", 7) or task.done():
                break
            await asyncio.sleep(0.05)
        assert not task.done() and proxy.router.peer_feeds.get("b") == ("feed1", 7), served
        assert len(served) >= len(answers)
        pool = next(iter(proxy.router.pools.values()))
        assert pool.policy.index.match([11, 12, 13]) == {"127.0.0.1:9": 3}
        said = [r.getMessage() for r in caplog.records if "share: b's" in r.getMessage()]
        assert [m.split(" answer ")[1][:10] for m in said] == ["is not JSO", "is not a f"], said
    finally:
        task.cancel()
        await proxy.session.close()
        await runner.cleanup()
