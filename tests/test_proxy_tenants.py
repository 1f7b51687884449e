"""Tenants through the real proxy in front of real sim engines: a flood from one tenant does not starve
another, limits answer 429 in OpenAI's shape, and every request says whose it was (results log, metrics)."""
from __future__ import annotations

import asyncio
import statistics
import subprocess
import time

import aiohttp
import pytest
import yaml

from conftest import PYTHON, ROOT, wait_until
from proxy_helpers import start_proxy, start_sims
from test_proxy_queue import get_json, metrics, results

KEYS = "# tenants' keys\nsk-app-0123 app\nsk-batch-4567 batch\nsk-plain-89ab\n"


def chat(max_tokens: int, user: str) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "user": user,
            "messages": [{"role": "user", "content": f"hello from {user}"}]}


async def post(session, port: int, key: str, body: dict) -> tuple[int, float, dict, dict]:
    """(status, seconds, headers, JSON body) of one chat completion sent with key."""
    t0 = time.monotonic()
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:
        data = await r.json(content_type=None)
        return r.status, time.monotonic() - t0, dict(r.headers), data


@pytest.mark.process
@pytest.mark.xdist_group("tenants")
def test_a_flooding_tenant_leaves_the_other_its_share_of_the_slots(procs, tmp_path):
    """The check of fairness:
    1. two sims of two slots each, the proxy with slots 2, keys naming `app` and `batch` (equal weights);
    2. app alone sends 6 requests one after another: its median latency is the base;
    3. batch floods: 24 clients, each sending again as soon as its answer comes (10 to 30 tokens), the
       queue never empty;
    4. app sends 6 more one after another during the flood (the queue full of batch's each time):
       its median is within 2x of the base, where first come first served would have it wait behind
       about 20 of batch's requests;
    5. nobody got a 5xx; the proxy's /metrics carry both tenants; the results log names them."""
    (tmp_path / "keys").write_text(KEYS)
    ports = start_sims(procs, tmp_path, 2, seqs=2, token_ms=10)
    port, admin = start_proxy(procs, tmp_path, ports, slots=2, queue={"max": 256, "timeout_s": 60},
                              api_keys_file=str(tmp_path / "keys"),
                              tenants={"app": {"weight": 1}, "batch": {"weight": 1}})

    async def run():
        async with aiohttp.ClientSession() as s:
            alone = [await post(s, port, "sk-app-0123", chat(20, f"app-alone-{i}")) for i in range(6)]
            stop = asyncio.Event()
            batch: list = []

            async def client(c: int):
                n = 0
                while not stop.is_set():
                    # 10 to 30 tokens: the slots come free at scattered times, as with real prompts
                    batch.append(await post(s, port, "sk-batch-4567", chat(10 + (7 * c + 3 * n) % 21, f"batch-{c}-{n}")))
                    n += 1
            clients = [asyncio.create_task(client(c)) for c in range(24)]

            def flooded():
                return get_json(f"http://127.0.0.1:{admin}/admin/config")["queued"] >= 16
            await asyncio.to_thread(wait_until, flooded, what="batch's flood filling the queue")
            during = []
            for i in range(6):
                during.append(await post(s, port, "sk-app-0123", chat(20, f"app-flood-{i}")))
            stop.set()
            await asyncio.gather(*clients)
            return alone, during, batch
    alone, during, batch = asyncio.run(run())
    base = statistics.median(t for _, t, _, _ in alone)
    flood = statistics.median(t for _, t, _, _ in during)
    print(f"app median alone {base * 1000:.0f} ms, during batch's flood {flood * 1000:.0f} ms "
          f"({flood / base:.2f}x); batch served {len(batch)}")
    assert [s for s, _, _, _ in alone + during] == [200] * 12
    assert all(s < 500 for s, _, _, _ in batch) and len(batch) >= 24
    assert flood <= 2 * base, (base, flood)
    text = metrics(port)
    assert 'proxy_tenant_requests_total{status="200",tenant="app"} 12.0' in text
    assert 'tenant="batch"' in text and 'proxy_tenant_in_flight{tenant="batch"}' in text
    wait_until(lambda: {"app", "batch"} <= {x.get("tenant") for x in results(tmp_path)},
               what="both tenants in the results log")



@pytest.mark.process
@pytest.mark.xdist_group("tenants")
def test_a_tenants_limits_answer_429_naming_the_limit_and_keys_never_reach_a_log(procs, tmp_path):
    """1. one sim of one slot; tenant `app` may hold 1 slot and queue none, `batch` sends 2 a minute;
    2. app's second request while its first runs: 429, Retry-After, an OpenAI error naming max_in_flight;
    3. batch's third request within the minute: 429 naming requests_per_minute, Retry-After about 30 s;
    4. a key without a tenant is `default`'s, served as before; 5. every request settled once: the results
    log has one final line each, with its tenant; 6. no key is in the proxy's log or the results log."""
    (tmp_path / "keys").write_text(KEYS)
    ports = start_sims(procs, tmp_path, 1, seqs=1, token_ms=20)
    port, admin = start_proxy(procs, tmp_path, ports, slots=1, api_keys_file=str(tmp_path / "keys"),
                              tenants={"app": {"max_in_flight": 1, "max_queued": 0},
                                       "batch": {"requests_per_minute": 2}})

    async def run():
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(post(s, port, "sk-app-0123", chat(30, "app-first")))
            await asyncio.to_thread(wait_until, lambda: get_json(f"http://127.0.0.1:{admin}/admin/config")[
                "tenants"][1]["in_flight"] == 1, what="app's first request on its slot")
            second = await post(s, port, "sk-app-0123", chat(5, "app-second"))
            batch = [await post(s, port, "sk-batch-4567", chat(2, f"batch-{i}")) for i in range(3)]
            plain = await post(s, port, "sk-plain-89ab", chat(2, "plain"))
            return await first, second, batch, plain
    first, second, batch, plain = asyncio.run(run())
    assert first[0] == 200 and plain[0] == 200
    status, _, headers, body = second
    assert status == 429 and headers["Retry-After"] == "1"
    assert body["error"]["type"] == "rate_limit_exceeded" and body["error"]["param"] == "max_in_flight"
    assert body["error"]["message"] == ("tenant app has 1 requests in flight (its max_in_flight) and 0 waiting "
                                        "(its max_queued); retry shortly.")
    assert [b[0] for b in batch] == [200, 200, 429]
    assert batch[2][3]["error"]["param"] == "requests_per_minute" and 25 <= int(batch[2][2]["Retry-After"]) <= 30
    wait_until(lambda: len([x for x in results(tmp_path) if x["final"]]) == 6, what="6 final results-log lines")
    lines = {x["trace_id"]: x for x in results(tmp_path) if x["final"]}
    assert {k: (v["tenant"], v["status"]) for k, v in lines.items()} == {
        "app-first": ("app", 200), "app-second": ("app", 429), "batch-0": ("batch", 200),
        "batch-1": ("batch", 200), "batch-2": ("batch", 429), "plain": ("default", 200)}
    text = metrics(port)
    assert 'proxy_tenant_limited_total{limit="max_in_flight",tenant="app"} 1.0' in text
    assert 'proxy_tenant_limited_total{limit="requests_per_minute",tenant="batch"} 1.0' in text
    logs = (tmp_path / "proxy.log").read_text() + (tmp_path / "req_results.log").read_text()
    assert "sk-" not in logs


@pytest.mark.process
def test_a_key_file_naming_an_undefined_tenant_stops_the_proxy_in_one_sentence(tmp_path):
    """The proxy refuses to start, exit 2, one sentence naming the line and the tenant, not the key."""
    (tmp_path / "keys").write_text(KEYS)
    conf = tmp_path / "proxy.yaml"
    conf.write_text(yaml.safe_dump({"backends": ["127.0.0.1:9"], "api_keys_file": str(tmp_path / "keys"),
                                    "tenants": {"app": {}}}))
    done = subprocess.run([PYTHON, "-m", "proxy", "--config", str(conf)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"proxy: api_keys_file {tmp_path / 'keys'} line 3 names the tenant 'batch', which "
                           "proxy.tenants does not define (it has app, default); add it there or fix the line.\n")
