"""Checks of an engine's shape that both engines must pass: the simulator (tests/test_sim_cache.py) and
vLLM's CPU build (tests/test_vllm_cpu.py), so the simulator cannot drift from vLLM unnoticed."""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp

PREFIX_CACHE_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
# The vllm: families the dashboard (dashboards/vllm-fleet.json) and `inv top` read, as the sim exports them.
REQUEST_FAMILIES = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                    "vllm:inter_token_latency_seconds", "vllm:request_generation_tokens",
                    "vllm:request_prompt_tokens", "vllm:request_success_total", "vllm:prompt_tokens_total",
                    "vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc", *PREFIX_CACHE_COUNTERS)


def family_shapes(text: str, names=REQUEST_FAMILIES) -> dict[str, dict]:
    """Each named family of a /metrics text: its TYPE, HELP, the label names of its samples and, for a
    histogram, its bucket bounds (and the finished_reason values of vllm:request_success_total)."""
    out: dict[str, dict] = {}
    for name in names:
        kind = re.search(rf"^# TYPE {re.escape(name)} (\S+)$", text, re.M)
        doc = re.search(rf"^# HELP {re.escape(name)} (.*)$", text, re.M)
        suffixes = ("_bucket", "_count", "_sum") if kind and kind.group(1) == "histogram" else ("",)
        labels, bounds, reasons = set(), [], []
        for suffix in suffixes:
            for m in re.finditer(rf"^{re.escape(name + suffix)}\{{([^}}]*)\}} \S+$", text, re.M):
                pairs = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1)))
                labels |= set(pairs) - {"le"}
                if "le" in pairs and pairs.get("le") not in bounds:
                    bounds.append(pairs["le"])
                if "finished_reason" in pairs:
                    reasons.append(pairs["finished_reason"])
        out[name] = {"type": kind and kind.group(1), "help": doc and doc.group(1), "labels": sorted(labels),
                     "buckets": bounds, "finished_reasons": reasons}
    return out


def gauge(text: str, name: str) -> float:
    """The one sample of a vllm: family in a /metrics text."""
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def prefix_cache_series(text: str) -> dict[str, list[str]]:
    """vllm:prefix_cache_* families of a /metrics text (prometheus_client's _created aside): name -> its
    HELP, TYPE and sample lines, the value cut off."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^(?:# (?:HELP|TYPE) )?(vllm:prefix_cache_\w+)", line)
        if m and not m.group(1).endswith("_created"):
            out.setdefault(m.group(1), []).append(line.rsplit(" ", 1)[0] if not line.startswith("#") else line)
    return out


async def first_chunk_waits_while_queued(port: int, model: str, slots: int, max_tokens: int = 400,
                                        waves: int = 2) -> list[dict]:
    """Fill an engine's `slots` with long streams, queue `waves` - 1 times as many more, then send one more,
    the extra:
    while /metrics says it waits, its stream (headers sent) has no data event; once it runs, its first
    event is the role delta and the next a content delta, as on every stream. Returns the extra stream's
    events.

    The check reads waiting, then the extra's events, then waiting again: the engine admits in arrival
    order, so when both readings say someone waits, the extra did throughout and no chunk of it can have
    been due; the test needs no timing.
    """
    base = f"http://127.0.0.1:{port}"
    body = {"model": model, "messages": [{"role": "user", "content": "count slowly"}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True}
    events: dict[int, list[dict]] = {i: [] for i in range(waves * slots + 1)}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def metrics() -> str:
            async with session.get(f"{base}/metrics") as r:
                return await r.text()

        async def until(predicate, what: str) -> str:
            for _ in range(6000):
                text = await metrics()
                if predicate(text):
                    return text
                await asyncio.sleep(0.02)
            raise AssertionError(f"timed out waiting for {what} (last seen: running "
                                 f"{gauge(text, 'vllm:num_requests_running')}, waiting "
                                 f"{gauge(text, 'vllm:num_requests_waiting')}; streams' events: "
                                 f"{[len(e) for e in events.values()]})")

        async def stream(i: int, started: asyncio.Event) -> None:
            async with session.post(f"{base}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                started.set()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        events[i].append(json.loads(line[6:]))

        blockers = [asyncio.create_task(stream(i, asyncio.Event())) for i in range(slots)]
        # Every slot taken: each stream has its first token (vLLM samples its running gauge too seldom to
        # catch four short streams at once on a loaded machine; their own events say it at once).
        for _ in range(6000):
            if all(len(events[i]) >= 2 for i in range(slots)):
                break
            ended = [t for t in blockers if t.done()]
            for t in ended:
                t.result()
            if ended:
                await asyncio.gather(*blockers)
                raise AssertionError(f"{len(ended)} stream(s) ended before {slots} running was seen")
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"timed out waiting for {slots} running (events: {[len(e) for e in events.values()]})")
        # waves - 1 more waves queued behind the first, then the extra last: it waits through `waves` streams'
        # time (one was too short to be seen waiting twice in a row on a loaded machine; the real engine's
        # tiny model, on a quiet one, writes a wave too fast for two: it takes three). The engine admits in
        # arrival order, so while anyone waits, the extra does.
        queued = []
        for i in range(slots, waves * slots + 1):
            headers = asyncio.Event()
            queued.append(asyncio.create_task(stream(i, headers)))
            await headers.wait()
        extra, last = queued[-1], waves * slots
        checked = False
        while not checked and not extra.done():
            before = gauge(await until(lambda t: True, "metrics"), "vllm:num_requests_waiting")
            seen = len(events[last])
            after = gauge(await metrics(), "vllm:num_requests_waiting")
            if before >= 1 and after >= 1:
                assert seen == 0, f"a queued request's stream already had {seen} data events: {events[last][:2]}"
                checked = True
        await asyncio.gather(*blockers, *queued)
    assert checked, "the extra request was never seen waiting"
    for i, got in events.items():
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, got[:2]
        # A token can decode to "" (a partial character held back by the detokenizer): a content delta still.
        assert "content" in got[1]["choices"][0]["delta"] and "role" not in got[1]["choices"][0]["delta"], got[:2]
    return events[last]
