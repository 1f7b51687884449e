"""The proxy against real sim engines: the seed's pile-up, /health over /v1/models, limits and errors."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import yaml

from conftest import PYTHON, ROOT, free_ports, http_status, wait_until
from proxy_helpers import start_proxy, start_sims

pytestmark = pytest.mark.process


async def slow_body_request(session, url, body: bytes, pieces=5, pause=0.15):
    """A POST whose body arrives in pieces over about pieces x pause seconds."""
    async def gen():
        step = len(body) // pieces + 1
        for i in range(0, len(body), step):
            yield body[i:i + step]
            await asyncio.sleep(pause)
    async with session.post(url, data=gen(), headers={"Content-Type": "application/json"}) as r:
        await r.read()
        return r.status


@pytest.mark.xdist_group("load")
def test_pile_up_64_slow_bodies_over_8_backends(procs, tmp_path):
    """1. 8 sim backends, max_num_seqs 4; 2. 64 concurrent requests whose bodies arrive slowly;
    3. the peak concurrency any backend saw is at most 9 (the seed saw 22 with the late count)."""
    ports = start_sims(procs, tmp_path, 8)
    port, _ = start_proxy(procs, tmp_path, ports)
    body = json.dumps({"model": "m", "max_tokens": 16, "messages": [
        {"role": "user", "content": "x" * 20000}]}).encode()

    async def run():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(slow_body_request(s, f"http://127.0.0.1:{port}/v1/chat/completions",
                                                            body) for _ in range(64)))
    statuses = asyncio.run(run())
    assert statuses == [200] * 64
    peaks = []
    for p in ports:
        with __import__("urllib.request").request.urlopen(f"http://127.0.0.1:{p}/sim/stats") as r:
            peaks.append(json.loads(r.read())["peak_in_flight"])
    assert max(peaks) <= 9, peaks
    assert min(peaks) > 0, peaks          # every backend took part


def test_backend_with_dead_engine_gets_no_requests(procs, tmp_path):
    """1. engine death on one backend: /health 503 while /v1/models stays 200;
    2. after the next health check the proxy sends it nothing: every answer comes from the others."""
    ports = start_sims(procs, tmp_path, 2)
    port, admin = start_proxy(procs, tmp_path, ports)
    dead = f"127.0.0.1:{ports[0]}"
    import urllib.request
    req = urllib.request.Request(f"http://{dead}/sim/fault", data=b'{"fault": "engine-death"}', method="POST")
    urllib.request.urlopen(req).read()
    assert http_status(f"http://{dead}/health") == 503 and http_status(f"http://{dead}/v1/models") == 200
    wait_until(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200 and
               json.loads(urllib.request.urlopen(f"http://127.0.0.1:{admin}/admin/backends").read())[0]["healthy"]
               is False, what="the proxy marking the dead backend")
    backends = set()
    for _ in range(12):
        r = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
            data=json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"Content-Type": "application/json"}))
        assert r.status == 200
        backends.add(r.headers["X-Backend"])
    assert backends == {f"127.0.0.1:{ports[1]}"}


def test_limits_errors_and_results_log(procs, tmp_path):
    ports = start_sims(procs, tmp_path, 1)
    # The fixup off: the backend's 400 and its error body reach the client and the log, as in the seed.
    # least_conn: the pick comes before the body, so even a 413 names its backend; with prefix (the
    # default) the body is read before the pick, as in the models form, and a 413 names none.
    port, admin = start_proxy(procs, tmp_path, ports, max_body_mb=1, fix_numeric_user=False,
                              routing={"policy": "least_conn"})
    url = f"http://127.0.0.1:{port}"

    async def run():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", data=b"x" * (1024 * 1024 + 1)) as r:
                assert r.status == 413 and r.headers["X-Backend"]
            bad = {"model": "m", "user": 12345, "messages": [{"role": "user", "content": "hi"}]}
            async with s.post(url + "/v1/chat/completions", json=bad, headers={"X-Request-Id": "rid-1"}) as r:
                assert r.status == 400 and r.headers["X-Request-Id"] == "rid-1"
            async with s.get(url + "/v1/models") as r:
                assert r.status == 200 and len(r.headers["X-Request-Id"]) == 32
            # SSE: the first chunk arrives long before the last token is generated.
            t0 = time.monotonic()
            body = {"model": "m", "max_tokens": 100, "stream": True, "user": "sse-1",
                    "messages": [{"role": "user", "content": "hi"}]}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                first = None
                async for _ in r.content.iter_any():
                    first = first or time.monotonic() - t0
                total = time.monotonic() - t0
            assert first < total / 3, (first, total)
            async with s.get(f"http://127.0.0.1:{admin}/admin/backends") as r:
                assert (await r.json())[0]["in_flight"] == 0
            async with s.get(url + "/admin/backends") as r:
                assert r.status == 404          # admin is not on the public port
    asyncio.run(run())
    # The results log is written off the event loop: wait for the last line.
    path = tmp_path / "req_results.log"
    wait_until(lambda: path.exists() and "sse-1" in path.read_text(), what="the SSE request logged")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    bad = next(x for x in lines if x["request_id"] == "rid-1")
    assert bad["status"] == 400 and bad["trace_id"] == "12345" and "valid string" in bad["error"]
    sse = next(x for x in lines if x["trace_id"] == "sse-1")
    assert sse["status"] == 200 and sse["stream"] and sse["finish_reason"] == "length"


def test_no_healthy_backend_is_503_json(procs, tmp_path):
    base = free_ports(3)      # three distinct ports: three free_port() calls may return the same one
    port, admin, dead_port = base, base + 1, base + 2
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": port},
                                    "admin": {"host": "127.0.0.1", "port": admin},
                                    "backends": [f"127.0.0.1:{dead_port}"],
                                    "results_log": {"path": str(tmp_path / "r.log")}}))
    procs.start([PYTHON, "-m", "proxy", "--config", str(path)], cwd=ROOT)
    wait_until(lambda: http_status(f"http://127.0.0.1:{port}/health") == 503, what="proxy up")
    import urllib.error, urllib.request
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                                      data=b"{}", method="POST"))
    assert e.value.code == 503 and json.loads(e.value.read())["error"]["type"] == "no_backend"


def test_results_log_rotates_with_size_and_count(procs, tmp_path):
    """The seed's log reached 769 MB unrotated: with max_mb tiny and backups 2, old files stop at .2."""
    ports = start_sims(procs, tmp_path, 1, token_ms=0)
    port, _ = start_proxy(procs, tmp_path, ports, results_log={"path": str(tmp_path / "req_results.log"),
                                                               "max_mb": 0.001, "backups": 2})
    import urllib.request
    for i in range(30):
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
            data=json.dumps({"model": "m", "max_tokens": 2, "user": f"t{i}",
                             "messages": [{"role": "user", "content": "hi"}]}).encode())).read()
    wait_until(lambda: (tmp_path / "req_results.log.2").exists(), what="two rotated files")
    assert not (tmp_path / "req_results.log.3").exists()
    assert all(p.stat().st_size <= 2048 for p in tmp_path.glob("req_results.log*"))


def test_an_engine_that_died_answers_500_and_the_request_goes_elsewhere(procs, tmp_path):
    """1. Two sims; the engine of one dies and its API server stays up answering vLLM's 500 ("EngineCore
    encountered an issue"), as vLLM does until it exits. 2. Before any health check could see it (every
    30 s), 8 requests: each is answered 200 by the other, none gets the dead engine's 500. 3. The dead
    one is taken out at its first 500 (ejections by reason engine_dead)."""
    import urllib.request
    ports = start_sims(procs, tmp_path, 2, extra=("--sim-after-engine-death", "stay"))
    port, admin = start_proxy(procs, tmp_path, ports, health={"interval_s": 30, "timeout_s": 3})
    dead = f"127.0.0.1:{ports[0]}"
    req = urllib.request.Request(f"http://{dead}/sim/fault", data=b'{"fault": "engine-death"}', method="POST")
    urllib.request.urlopen(req).read()
    for _ in range(8):
        r = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()))
        assert r.status == 200 and r.headers["X-Backend"] == f"127.0.0.1:{ports[1]}"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert f'proxy_ejections_total{{backend="{dead}",reason="engine_dead"}} 1.0' in metrics
