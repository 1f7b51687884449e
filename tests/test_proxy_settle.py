"""Every request the proxy answers settles once: one final results-log line carrying its status, one count
in proxy_requests_total, whatever ended it; labelled counters show their known series at 0 from the start."""
from __future__ import annotations

import asyncio
import json
import urllib.request
from collections import Counter
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from conftest import http_status, wait_until
from otlp_helpers import Servers
from proxy import forward, upstream
from proxy.forward import Outcome
from proxy.metrics import EJECTION_REASONS, UPSTREAM_ERROR_KINDS, Metrics
from proxy_helpers import start_proxy, start_sims

KEY = "sk-settle"


def chat(**extra) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}


async def ask(s: aiohttp.ClientSession, port: int, rid: str, body=None, data=None, key=KEY) -> int:
    """POST a chat completion with X-Request-Id rid (body, or raw data); its status."""
    headers = {"X-Request-Id": rid, **({"Authorization": f"Bearer {key}"} if key else {})}
    async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=headers,
                      json=chat() if body is None and data is None else body, data=data) as r:
        await r.read()
        return r.status


def results(tmp_path) -> list[dict]:
    path = tmp_path / "req_results.log"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def final_lines(tmp_path, rids) -> dict:
    """rid -> its final results-log lines, once every rid has at least one."""
    def ready():
        lines = [x for x in results(tmp_path) if x["final"]]
        by_rid = {rid: [x for x in lines if x["request_id"] == rid] for rid in rids}
        return all(by_rid.values()) and by_rid
    return wait_until(ready, what=f"a final line for each of {sorted(rids)}")


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def requests_by_status(text: str) -> Counter:
    """proxy_requests_total summed over backends, by status."""
    counts: Counter = Counter()
    for line in text.splitlines():
        if line.startswith("proxy_requests_total{"):
            status = line.split('status="')[1].split('"')[0]
            counts[int(status)] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


async def behind_a_held_slot(port: int, admin: int) -> dict:
    """A stream holds the only slot; a request queues and waits out queue.timeout_s (503) while another
    finds the queue full (429); then the stream's client leaves mid-answer (499). rid -> status."""
    async with aiohttp.ClientSession() as s:
        headers = {"X-Request-Id": "client-left", "Authorization": f"Bearer {KEY}"}
        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=headers,
                          json=chat(max_tokens=200, stream=True)) as held:
            await held.content.readany()     # mid-answer: its first chunk is here
            late = asyncio.create_task(ask(s, port, "queue-timeout"))
            config = f"http://127.0.0.1:{admin}/admin/config"
            await asyncio.to_thread(wait_until, lambda: get_json(config)["queued"] == 1, what="one queued")
            full = await ask(s, port, "queue-full")
            timed_out = await late
            held.close()                     # the client hangs up while its answer streams
        return {"queue-full": full, "queue-timeout": timed_out}


@pytest.mark.process
def test_every_answer_from_one_sim_has_one_final_line_and_one_count(procs, tmp_path):
    """1. One sim (about 0.1 s a token, one slot), the proxy with an API key, a 10 KiB body bound, a queue of
    one that waits 5 s (the stream below takes 20). 2. /metrics right after start shows the queue's
    refusals and the backend's retries and ejections at 0. 3. Sent: a good request (200), max_tokens 0 (the engine's 400), an unknown model (its
    404), a 20 KiB body (413), no key (401). 4. A stream holds the slot: a queued request waits out the
    queue (503), another finds it full (429), the stream's client leaves mid-answer (499). 5. The sim is
    killed; once the proxy sees it down, a request gets 503 (no healthy backend). 6. Each request has
    exactly one results-log line, final, with its status; proxy_requests_total counts each once."""
    [sim] = start_sims(procs, tmp_path, 1, seqs=1, token_ms=100)
    sim_process = procs.started[0]       # the only process started before the proxy
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    port, admin = start_proxy(procs, tmp_path, [sim], api_keys_file=str(keys), max_body_mb=0.01, slots=1,
                              queue={"max": 1, "timeout_s": 5})
    text = metrics_text(port)
    assert 'proxy_queue_rejected_total{reason="full"} 0.0' in text
    assert 'proxy_queue_rejected_total{reason="gone"} 0.0' in text
    assert f'proxy_retries_total{{backend="127.0.0.1:{sim}"}} 0.0' in text
    assert f'proxy_ejections_total{{backend="127.0.0.1:{sim}",reason="connect"}} 0.0' in text

    async def simple() -> dict:
        async with aiohttp.ClientSession() as s:
            return {"ok": await ask(s, port, "ok"),
                    "engine-400": await ask(s, port, "engine-400", chat(max_tokens=0)),
                    "engine-404": await ask(s, port, "engine-404", chat(model="nope")),
                    "too-large": await ask(s, port, "too-large", data=b'{"pad": "' + b"x" * 20000 + b'"}'),
                    "no-key": await ask(s, port, "no-key", key=None)}
    statuses = asyncio.run(simple())
    statuses.update(asyncio.run(behind_a_held_slot(port, admin)))
    statuses["client-left"] = 499
    procs.stop(sim_process)
    wait_until(lambda: http_status(f"http://127.0.0.1:{port}/health") == 503, what="the proxy sees its sim down")

    async def no_backend() -> int:
        async with aiohttp.ClientSession() as s:
            return await ask(s, port, "no-backend")
    statuses["no-backend"] = asyncio.run(no_backend())
    assert statuses == {"ok": 200, "engine-400": 400, "engine-404": 404, "too-large": 413, "no-key": 401,
                        "queue-full": 429, "queue-timeout": 503, "client-left": 499, "no-backend": 503}

    finals = final_lines(tmp_path, statuses)
    assert {rid: [x["status"] for x in lines] for rid, lines in finals.items()} == {
        rid: [status] for rid, status in statuses.items()}
    assert len(results(tmp_path)) == len(statuses)      # no other line: nothing was retried
    assert "no healthy backend" in finals["no-backend"][0]["error"]
    assert finals["no-key"][0]["trace_id"] is None and KEY not in (tmp_path / "req_results.log").read_text()
    assert requests_by_status(metrics_text(port)) == Counter(statuses.values())


def failing_backend(servers: Servers, released: asyncio.Event) -> int:
    """A backend whose answer never comes (X-Request-Id "timeout", until released), or whose connection is
    cut before any byte ("cut")."""
    app = web.Application()

    async def health(request):
        return web.json_response({})

    async def chat_completion(request):
        await request.read()
        if request.headers["X-Request-Id"] == "cut":
            request.transport.abort()
        await released.wait()
        return web.json_response({})
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat_completion)
    return servers.serve(app)


@pytest.mark.process
def test_upstream_failures_have_one_final_line_and_one_count(procs, tmp_path):
    """1. One backend that never answers one request and cuts another's connection, the proxy with
    timeout_s 0.5. 2. The first is 504, the second 502. 3. Each has one final line with its status and
    one count in proxy_requests_total."""
    servers, released = Servers(), asyncio.Event()
    try:
        backend = failing_backend(servers, released)
        port, _ = start_proxy(procs, tmp_path, [backend], timeout_s=0.5, max_fails=10)

        async def run() -> dict:
            async with aiohttp.ClientSession() as s:
                return {"timeout": await ask(s, port, "timeout", key=None),
                        "cut": await ask(s, port, "cut", key=None)}
        statuses = asyncio.run(run())
        assert statuses == {"timeout": 504, "cut": 502}
        finals = final_lines(tmp_path, statuses)
        assert {rid: [x["status"] for x in lines] for rid, lines in finals.items()} == {"timeout": [504],
                                                                                      "cut": [502]}
        assert requests_by_status(metrics_text(port)) == Counter({504: 1, 502: 1})
    finally:
        servers.loop.call_soon_threadsafe(released.set)
        servers.close()


@pytest.mark.unit
def test_queue_refusals_show_zero_from_the_start():
    """A new Metrics exposes proxy_queue_rejected_total for full, timeout and gone at 0."""
    router = SimpleNamespace(backends={}, queued=0, by_model=False)
    text = generate_latest(Metrics(lambda: router).registry).decode()
    for reason in ("full", "timeout", "gone"):
        assert f'proxy_queue_rejected_total{{reason="{reason}"}} 0.0' in text


@pytest.mark.unit
def test_every_upstream_failure_kind_is_one_made_at_start():
    """Each failure the request path can name is counted under a kind (and an ejection under a reason)
    that Metrics makes for each backend at 0: none is missing from the lists."""
    router = SimpleNamespace(backends={}, queued=0, by_model=False, eject=lambda b, m: True,
                             answered=lambda b, s, n: True)
    proxy = SimpleNamespace(metrics=Metrics(lambda: router), router=router, log=SimpleNamespace(warning=print),
                            config=SimpleNamespace(connect_timeout_s=1, timeout_s=1, max_fails=1))
    backend = SimpleNamespace(name="b", last_error="")
    for error in (upstream.ConnectTimeout("slow"), upstream.Unreachable("refused", OSError(111, "refused")),
                  upstream.Disconnected("closed"), asyncio.TimeoutError(), upstream.BrokenBody("cut"),
                  upstream.Broken("reset"), ConnectionResetError(), upstream.UpstreamError("other"),
                  forward.Interrupted("stalled", "quiet"), forward.Interrupted("taken_out", "ejected")):
        forward._failed(proxy, backend, Outcome(), error)
    # A dead engine's 500 is an answer, not an exception: _take ejects for it (tests/test_proxy.py drives it).
    forward._ejected(proxy, backend, "engine_dead")
    text = generate_latest(proxy.metrics.registry).decode()
    kinds = {line.split('kind="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("proxy_upstream_errors_total{")}
    reasons = {line.split('reason="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("proxy_ejections_total{")}
    assert kinds == set(UPSTREAM_ERROR_KINDS) and reasons == set(EJECTION_REASONS), (kinds, reasons)


@pytest.mark.unit
@pytest.mark.parametrize("ns", [0, 1_764_000_000_000_000_000, 1_764_000_000_999_999_999, 1_764_000_001_000_999_000,
                                1_764_000_059_123_456_789, 1_798_761_599_999_000_000])
def test_a_lines_timestamp_is_the_one_datetime_writes(monkeypatch, ns):
    """The results log's `ts` (the time of day formatted once a second, the milliseconds added) reads as
    datetime.now(timezone.utc).isoformat(timespec="milliseconds") read at the same instant: the milliseconds
    cut, not rounded, across a second's and a year's end, and a second formatted before is not reused."""
    from datetime import datetime, timezone

    from proxy import results_log
    monkeypatch.setattr(results_log, "_SECOND", [None, ""])
    for at in (ns - 1_000_000_000, ns):      # the second before first: its text must not stay
        monkeypatch.setattr(results_log.time, "time_ns", lambda: at)
        expected = datetime.fromtimestamp(at // 10**9, timezone.utc).replace(microsecond=at % 10**9 // 1000)
        assert results_log.utc_now_ms() == expected.isoformat(timespec="milliseconds")
