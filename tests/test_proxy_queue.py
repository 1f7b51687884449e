"""The proxy's admission queue: slots per backend, one FIFO for the rest, 429 / 503 over its bounds.

The Balancer is tested on its own first (no I/O: an event loop and futures), then the proxy as a
process in front of real sim engines.
"""
from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest

from conftest import wait_until
from proxy.balancer import Balancer, QueueFull, QueueTimeout
from proxy_helpers import start_proxy, start_sims


def balancer(n=2, slots=1, queue_max=8) -> Balancer:
    b = Balancer([f"b{i}:1" for i in range(n)], slots=slots, queue_max=queue_max)
    for backend in b.backends.values():
        b.mark(backend, True)
    return b


def in_flight(b: Balancer) -> list[int]:
    return [x.in_flight for x in b.backends.values()]


@pytest.mark.unit
def test_slots_then_fifo_each_waiter_gets_the_first_slot_freed_anywhere():
    """1. two backends of one slot each take the first two requests; 2. three more wait;
    3. a slot freed on b1, then on b0, then on b1 goes to the waiters in arrival order,
    each to the backend that freed it; 4. in-flight never passes the slots."""
    async def run():
        b = balancer()
        first = [b.acquire(), b.acquire()]
        assert sorted(x.name for x in first) == ["b0:1", "b1:1"] and b.acquire() is None
        got: list[tuple[int, str]] = []

        async def waiter(i):
            backend = await b.wait_for_slot(5)
            got.append((i, backend.name))
            return backend
        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        await asyncio.sleep(0)
        assert b.queued == 3 and in_flight(b) == [1, 1]
        b.release(b.backends["b1:1"])
        await asyncio.sleep(0)
        b.release(b.backends["b0:1"])
        await asyncio.sleep(0)
        b.release(b.backends["b1:1"])
        await asyncio.gather(*tasks)
        assert got == [(0, "b1:1"), (1, "b0:1"), (2, "b1:1")]
        assert b.queued == 0 and in_flight(b) == [1, 1]
    asyncio.run(run())


@pytest.mark.unit
def test_queue_full_and_no_queue_answer_at_once():
    """queue_max waiters wait; the next is refused at once; with queue_max 0 nobody waits."""
    async def run():
        b = balancer(n=1, queue_max=2)
        b.acquire()
        waiting = [asyncio.create_task(b.wait_for_slot(5)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await b.wait_for_slot(5)
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert b.queued == 0
        none = balancer(n=1, queue_max=0)
        none.acquire()
        with pytest.raises(QueueFull):
            await none.wait_for_slot(5)
    asyncio.run(run())


@pytest.mark.unit
def test_timeout_leaves_the_queue_and_the_next_in_line_moves_up():
    """A waiter queues until its timeout, then leaves the queue with QueueTimeout; the next one gets the
    slot once it is freed."""
    async def run():
        b = balancer(n=1)
        b.acquire()
        waiter = asyncio.create_task(b.wait_for_slot(0.2))
        await asyncio.sleep(0)
        assert b.queued == 1
        with pytest.raises(QueueTimeout):
            await waiter
        assert b.queued == 0
        later = asyncio.create_task(b.wait_for_slot(5))
        await asyncio.sleep(0)
        b.release(b.backends["b0:1"])
        assert (await later).name == "b0:1" and in_flight(b) == [1]
    asyncio.run(run())


@pytest.mark.unit
def test_cancelled_waiters_leave_the_queue_and_no_count_leaks():
    """1. 20 waiters on one busy slot; 2. every other one is cancelled (its client left), one of them
    in the very instant a slot was handed to it; 3. the slot goes on to the next in line; 4. when
    the rest finish, nothing is counted and nothing waits."""
    async def run():
        b = balancer(n=1, queue_max=32)
        first = b.acquire()
        tasks = [asyncio.create_task(b.wait_for_slot(5)) for _ in range(20)]
        await asyncio.sleep(0)
        b.release(first)          # hands the slot to tasks[0] ...
        tasks[0].cancel()         # ... whose client leaves before it runs
        for t in tasks[2::2]:
            t.cancel()
        served = 0
        for t in tasks:
            try:
                backend = await t
            except asyncio.CancelledError:
                continue
            served += 1
            b.release(backend)
        assert served == 10 and b.queued == 0 and in_flight(b) == [0]
    asyncio.run(run())


@pytest.mark.unit
def test_a_backend_coming_back_or_more_slots_serve_the_queue():
    async def run():
        b = balancer(n=2)
        b1 = b.backends["b1:1"]
        b.eject(b1, "test")
        b.acquire()
        waiter = asyncio.create_task(b.wait_for_slot(5))
        await asyncio.sleep(0)
        b.mark(b1, True)
        assert (await waiter) is b1
        more = asyncio.create_task(b.wait_for_slot(5))
        await asyncio.sleep(0)
        assert b.queued == 1
        b.update(list(b.backends), slots=2)
        assert (await more).in_flight == 2 and b.queued == 0
    asyncio.run(run())


@pytest.mark.unit
def test_no_available_backend_is_none_not_a_wait():
    async def run():
        b = Balancer(["b0:1"], slots=1, queue_max=8)
        assert await b.wait_for_slot(5) is None and b.queued == 0
    asyncio.run(run())


# --- the proxy as a process, in front of real sims -----------------------------------------------

def chat(max_tokens: int, user: str | None = None) -> dict:
    body = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    if user is not None:
        body["user"] = user
    return body


async def post(session, port, body, **kw):
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, **kw) as r:
        await r.read()
        return r.status, r.headers.get("Retry-After"), r.headers.get("X-Backend")


async def behind_a_busy_slot(port: int, admin: int, long_tokens: int, body: dict):
    """A request of long_tokens takes the slot; once the proxy counts it in flight, body is sent:
    (long's answer, body's answer, whether long was still unanswered when body's answer came)."""
    def taken():
        return sum(b["in_flight"] for b in get_json(f"http://127.0.0.1:{admin}/admin/backends")) == 1

    async with aiohttp.ClientSession() as s:
        long = asyncio.create_task(post(s, port, chat(long_tokens)))
        await asyncio.to_thread(wait_until, taken, what="the long request on the slot")
        second = await post(s, port, body)
        long_running = not long.done()
        return await long, second, long_running


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    """The value of metric name, summed over its labels."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if not line.startswith("#") and line.split(" ")[0].split("{")[0] == name]
    assert values, f"{name} not in /metrics"
    return sum(values)


def results(tmp_path) -> list[dict]:
    path = tmp_path / "req_results.log"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.process
def test_slots_cap_each_backend_the_rest_queue_then_429(procs, tmp_path):
    """1. 2 sims of max_num_seqs 2, the proxy with slots 2 and queue max 3; 2. 7 requests of about
    1 s: 4 run, 3 wait; 3. an 8th finds the queue full: 429 with Retry-After, counted and logged with
    its trace id; 4. the 7 all succeed, no sim ever ran more than 2 (nothing queued in an engine);
    5. /metrics shows the waits, the refusal and an empty queue; the log has each one's queued_ms."""
    ports = start_sims(procs, tmp_path, 2, seqs=2, token_ms=50)
    port, admin = start_proxy(procs, tmp_path, ports, slots=2, queue={"max": 3, "timeout_s": 30})

    async def run():
        async with aiohttp.ClientSession() as s:
            seven = [asyncio.create_task(post(s, port, chat(20, user=f"ok-{i}"))) for i in range(7)]
            config = f"http://127.0.0.1:{admin}/admin/config"
            await asyncio.to_thread(wait_until, lambda: get_json(config)["queued"] == 3, what="4 running, 3 queued")
            eighth = await post(s, port, chat(20, user="turned-away"))
            return await asyncio.gather(*seven), eighth
    seven, eighth = asyncio.run(run())
    assert [s for s, _, _ in seven] == [200] * 7
    assert eighth[0] == 429 and eighth[1] == "1"
    for p in ports:
        stats = get_json(f"http://127.0.0.1:{p}/sim/stats")
        assert stats["peak_in_flight"] <= 2, stats
    text = metrics(port)
    assert metric(text, "proxy_queue_length") == 0
    assert metric(text, "proxy_queue_wait_seconds_count") == 3
    assert metric(text, "proxy_queue_wait_seconds_sum") > 1.0     # each waited for a ~1 s request
    assert 'proxy_queue_rejected_total{reason="full"} 1.0' in text
    assert 'proxy_requests_total{backend="none",status="429"} 1.0' in text
    assert f'proxy_backend_slots{{backend="127.0.0.1:{ports[0]}"}} 2.0' in text
    wait_until(lambda: len(results(tmp_path)) == 8, what="8 results-log lines")
    lines = {x["trace_id"]: x for x in results(tmp_path)}
    assert lines["turned-away"]["status"] == 429 and lines["turned-away"]["backend"] is None
    assert "requests already wait" in lines["turned-away"]["error"]
    assert sorted(x["queued_ms"] > 500 for t, x in lines.items() if t != "turned-away") == [False] * 4 + [True] * 3
    assert all(b["in_flight"] == 0 for b in get_json(f"http://127.0.0.1:{admin}/admin/backends"))


@pytest.mark.process
def test_waiting_too_long_is_503_with_retry_after(procs, tmp_path):
    """One slot, busy for about 2 s; a second request waits queue.timeout_s (0.5 s) and gets 503 with
    Retry-After, counted and logged; the first still succeeds and nothing stays counted."""
    ports = start_sims(procs, tmp_path, 1, seqs=1, token_ms=100)
    port, admin = start_proxy(procs, tmp_path, ports, slots=1, queue={"max": 8, "timeout_s": 0.5})

    long, late, long_running = asyncio.run(behind_a_busy_slot(port, admin, 20, chat(2, user="late")))
    assert long[0] == 200
    # its wait ended by its timeout, not by the slot coming free (the log line below says after how long)
    assert late[0] == 503 and late[1] == "5" and long_running, late
    text = metrics(port)
    assert 'proxy_queue_rejected_total{reason="timeout"} 1.0' in text
    assert 'proxy_requests_total{backend="none",status="503"} 1.0' in text
    wait_until(lambda: any(x.get("trace_id") == "late" for x in results(tmp_path)), what="the 503 logged")
    late_line = next(x for x in results(tmp_path) if x["trace_id"] == "late")
    assert late_line["status"] == 503 and "within 0.5s" in late_line["error"]
    assert [b["in_flight"] for b in get_json(f"http://127.0.0.1:{admin}/admin/backends")] == [0]


@pytest.mark.process
def test_abandoned_requests_leave_the_queue_and_no_count_behind(procs, tmp_path):
    """1. 2 sims, slots 1 each, queue max 64; 2. 40 clients send a request and 30 of them hang up
    after 0.3 to 1.2 s, some while running, most while queued; 3. the other 10 all get 200;
    4. then nothing is counted in flight, nothing waits, and a new request is served at once."""
    ports = start_sims(procs, tmp_path, 2, seqs=1, token_ms=20)
    port, admin = start_proxy(procs, tmp_path, ports, slots=1, queue={"max": 64, "timeout_s": 60})

    async def run():
        async with aiohttp.ClientSession() as s:
            async def one(i):
                if i % 4 == 0:
                    return (await post(s, port, chat(5)))[0]
                try:
                    return (await post(s, port, chat(20), timeout=aiohttp.ClientTimeout(total=0.3 + (i % 10) / 10)))[0]
                except asyncio.TimeoutError:
                    return "gone"
            return await asyncio.gather(*(one(i) for i in range(40)))
    statuses = asyncio.run(run())
    assert statuses.count(200) >= 10 and set(statuses) <= {200, "gone"}
    assert all(s == 200 for i, s in enumerate(statuses) if i % 4 == 0)

    def settled():
        backends = get_json(f"http://127.0.0.1:{admin}/admin/backends")
        return all(b["in_flight"] == 0 for b in backends) and metric(metrics(port), "proxy_queue_length") == 0
    wait_until(settled, timeout=10, what="no count left behind")
    assert 'proxy_queue_rejected_total{reason="gone"}' in metrics(port)    # some left while queued

    async def fresh():
        async with aiohttp.ClientSession() as s:
            return (await post(s, port, chat(2)))[0]
    assert asyncio.run(fresh()) == 200


@pytest.mark.process
def test_no_queue_at_all_answers_429_at_once(procs, tmp_path):
    """queue.max 0: a request that finds every slot taken is refused at once, not held until the
    3 s request on the one slot ends."""
    ports = start_sims(procs, tmp_path, 1, seqs=1, token_ms=100)
    port, admin = start_proxy(procs, tmp_path, ports, slots=1, queue={"max": 0, "timeout_s": 60})

    long, refused, long_running = asyncio.run(behind_a_busy_slot(port, admin, 30, chat(2)))
    assert long[0] == 200 and refused[0] == 429 and long_running


@pytest.mark.process
def test_the_proxy_runs_on_uvloop_and_without_it(procs, tmp_path):
    """With uvloop installed the proxy says it runs on it; where `import uvloop` fails it runs on
    asyncio's loop and serves all the same."""
    ports = start_sims(procs, tmp_path, 1)
    port, _ = start_proxy(procs, tmp_path, ports)
    wait_until(lambda: "event loop: uvloop" in (tmp_path / "proxy.log").read_text(), what="uvloop in the log")
    shim = tmp_path / "no-uvloop" / "uvloop"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('no uvloop on this host')\n")
    other = tmp_path / "plain"
    other.mkdir()
    port2, _ = start_proxy(procs, other, ports, env_extra={"PYTHONPATH": str(shim.parent)})
    wait_until(lambda: "event loop: asyncio (uvloop is not installed)" in (other / "proxy.log").read_text(),
               what="asyncio in the log")

    async def run():
        async with aiohttp.ClientSession() as s:
            return [(await post(s, p, chat(2)))[0] for p in (port, port2)]
    assert asyncio.run(run()) == [200, 200]


@pytest.mark.parametrize("queue,message", [
    ({"max": -1}, "queue.max must be a whole number of at least 0, not -1."),
    ({"timeout_s": float("inf")}, "queue.timeout_s must be a finite number greater than 0, not inf."),
    ({"timeout_s": 0}, "queue.timeout_s must be a finite number greater than 0, not 0."),
    ({"size": 3}, "unknown config key 'queue.size' (known: max, timeout_s, tenant_reserve)."),
])
@pytest.mark.unit
def test_queue_config_errors_are_one_sentence(queue, message):
    from proxy.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as e:
        parse_config({"backends": ["127.0.0.1:9"], "slots": 4, "queue": queue})
    assert str(e.value) == message
