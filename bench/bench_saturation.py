"""Routing at saturation: an LLM-like load on 8 sims x max_num_seqs 4, every front against the ideal.

    .venv/bin/python bench/bench_saturation.py [--clients 32,48,64] [--rounds 1] [--fronts ...] [--out FILE.json]

The workload: one fixed sequence of 160 requests drawn from a seeded generator, 70% asking for 16-64
tokens and 30% for 256-384, each with a prompt of its own (so a cache-aware router cannot pile them on
one backend for a shared prefix), not streamed; 8 sim engines with max_num_seqs 4 (32 slots), prefill
200 ms and 30 ms a token, so a request takes 0.2 s + tokens x 30 ms once it has a slot. Closed loop:
C clients, each sending the next request of the sequence as soon as its previous one is answered.

The ideal is computed, not measured: the same sequence and clients fed by one central FIFO queue to the
first slot freed anywhere, with no cost of its own (`ideal()` below, an event simulation). Every front
is compared with it: p50, p99 and makespan (first request sent to last answered), as ratios from the
same run. Fronts run one after another in interleaved order, round after round (the machine is shared;
each figure is the median over rounds). The most requests one sim held at once shows pile-ups.

Fronts: proxy (the rendered config: slots = max_num_seqs, the queue on), proxy-lc (slots 0: least
connections alone, the proxy before the queue), nginx (rendered, least_conn), vllm-router and smg with
their default policy (bench/setup_routers.sh installs them); and, asked for, proxy-pair: two proxies of the
proxy's config as active-active entries (each the other's peer in `share`: 2 of every sim's 4 slots each),
the clients split between them, half each (as over two virtual addresses): what splitting the slots costs
against one proxy with all of them. Every process it starts is stopped by pid.
"""
from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import Stack  # noqa: E402

BACKENDS, MAX_NUM_SEQS, PREFILL_MS, TOKEN_MS = 8, 4, 200, 30
DEFAULT_FRONTS = "proxy,proxy-lc,nginx,vllm-router,smg"


def sequence(n: int = 160, seed: int = 14) -> list[int]:
    """The max_tokens of each request: 70% in 16-64, 30% in 256-384, from a seeded generator."""
    rng = random.Random(seed)
    return [rng.randint(16, 64) if rng.random() < 0.7 else rng.randint(256, 384) for _ in range(n)]


def service_s(tokens: int) -> float:
    """A request's time once it holds a slot, as the sim's timing model makes it."""
    return (PREFILL_MS + tokens * TOKEN_MS) / 1000


def ideal(tokens: list[int], clients: int, slots: int) -> list[tuple[float, float]]:
    """(sent, answered) of each request in a closed loop of `clients` over one central FIFO queue that
    feeds the first slot freed anywhere, at no cost of its own."""
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(tokens)
    events: list[tuple[float, int, int]] = []   # (time, 0 = a slot frees / 1 = a request arrives, index)
    waiting: deque[int] = deque()
    sent: dict[int, float] = {}
    free = slots
    nxt = 0
    for _ in range(min(clients, len(tokens))):
        heapq.heappush(events, (0.0, 1, nxt))
        nxt += 1
    while events:
        t, kind, i = heapq.heappop(events)
        if kind == 1:                     # a request arrives: a free slot, else the back of the queue
            sent[i] = t
            if free:
                free -= 1
                heapq.heappush(events, (t + service_s(tokens[i]), 0, i))
            else:
                waiting.append(i)
        else:                             # answered: its slot goes to the queue's head, its client sends again
            times[i] = (sent[i], t)
            if waiting:
                j = waiting.popleft()
                heapq.heappush(events, (t + service_s(tokens[j]), 0, j))
            else:
                free += 1
            if nxt < len(tokens):
                heapq.heappush(events, (t, 1, nxt))
                nxt += 1
    return times


def pct(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank, the same for the ideal and the fronts."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(times: list[tuple[float, float]]) -> dict:
    latencies = [b - a for a, b in times]
    return {"p50_s": pct(latencies, 0.5), "p99_s": pct(latencies, 0.99),
            "makespan_s": max(b for _, b in times) - min(a for a, _ in times)}


async def closed_loop(url: str | list[str], tokens: list[int], clients: int, timeout_s: float) -> dict:
    """Send the sequence through url with `clients` clients (a list of urls: client k sends through the
    k-th modulo its length); (sent, answered) per request and failures."""
    import aiohttp
    times: list[tuple[float, float] | None] = [None] * len(tokens)
    failures: list[str] = []
    todo = iter(range(len(tokens)))
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def client(front: str):
            for i in todo:
                body = {"model": "m", "max_tokens": tokens[i], "stream": False,
                        "messages": [{"role": "user", "content": f"request {i}: describe picture number {i}"}]}
                sent = time.perf_counter() - t0
                try:
                    async with session.post(front + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        if r.status != 200:
                            failures.append(f"{i}: {r.status}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    failures.append(f"{i}: {type(e).__name__}")
                times[i] = (sent, time.perf_counter() - t0)
        urls = url if isinstance(url, list) else [url]
        await asyncio.gather(*(client(urls[k % len(urls)]) for k in range(clients)))
    return {"times": times, "failures": failures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="32,48,64", help="closed-loop client counts, comma separated")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds; each figure is their median")
    ap.add_argument("--fronts", default=DEFAULT_FRONTS, help=f"comma separated (default {DEFAULT_FRONTS})")
    ap.add_argument("--headroom", type=int, default=0, help="proxy.queue.headroom for the proxy")
    ap.add_argument("--out", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]
    tokens = sequence(args.requests, args.seed)
    slots = BACKENDS * MAX_NUM_SEQS
    work_s = sum(service_s(t) for t in tokens)
    print(f"{len(tokens)} requests (seed {args.seed}): {sum(t <= 64 for t in tokens)} short, "
          f"{sum(t > 64 for t in tokens)} long, {work_s:.0f} slot-seconds of work; {BACKENDS} sims x "
          f"max_num_seqs {MAX_NUM_SEQS}, prefill {PREFILL_MS} ms, {TOKEN_MS} ms a token; {os.cpu_count()} CPUs",
          flush=True)
    figures: dict = {"requests": len(tokens), "seed": args.seed, "rounds": args.rounds, "levels": levels,
                     "ideal": {}, "runs": {}}
    for c in levels:
        figures["ideal"][str(c)] = summary(ideal(tokens, c, slots))
    with tempfile.TemporaryDirectory(prefix="bench-saturation-") as tmp:
        stack = Stack(Path(tmp), BACKENDS, MAX_NUM_SEQS,
                      # PREFILL_MS for every request, whatever its prompt: the fixed overhead, no prefill.
                      ["--sim-overhead-ms", str(PREFILL_MS), "--sim-prefill-ms", "0", "--sim-token-ms", str(TOKEN_MS),
                       "--sim-output-tokens", "1000"], proxy_set=(f"proxy.queue.headroom={args.headroom}",))
        try:
            fronts = stack.start(args.fronts.split(","))
            figures["skipped"] = stack.skipped
            for r in range(args.rounds):
                order = fronts[r % len(fronts):] + fronts[:r % len(fronts)]   # a different front goes first
                for c in levels:
                    for front in order:
                        stack.reset_sim_stats()
                        url = ([stack.url("proxy-pair"), stack.url("proxy-pair-b")] if front == "proxy-pair"
                               else stack.url(front))
                        run = asyncio.run(closed_loop(url, tokens, c, timeout_s=600))
                        peak = max(s["peak_in_flight"] for s in stack.sim_stats())
                        done = [t for t in run["times"] if t is not None]
                        result = {**summary(done), "failures": run["failures"], "peak_at_one_sim": peak}
                        figures["runs"].setdefault(front, {}).setdefault(str(c), []).append(result)
                        print(f"  round {r + 1} clients {c:>2} {front:<12} p50 {result['p50_s']:6.2f} s  "
                              f"p99 {result['p99_s']:6.2f} s  makespan {result['makespan_s']:6.2f} s  "
                              f"peak at one sim {peak:>2}  failed {len(run['failures'])}", flush=True)
        finally:
            stack.stop()
    report(figures)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


def report(f: dict) -> None:
    print(f"\nmedian of {f['rounds']} round(s); ratios to the ideal (one central FIFO, computed):")
    print(f"  {'clients':<8}{'front':<13}{'p50 s':>7}{'p99 s':>8}{'makespan':>10}{'p50/id':>8}{'p99/id':>8}"
          f"{'mk/id':>7}{'peak':>6}{'failed':>8}")
    f["medians"] = {}
    for c in f["levels"]:
        ideal = f["ideal"][str(c)]
        print(f"  {c:<8}{'ideal':<13}{ideal['p50_s']:>7.2f}{ideal['p99_s']:>8.2f}{ideal['makespan_s']:>10.2f}")
        for front, by_level in f["runs"].items():
            runs = by_level[str(c)]
            m = {k: statistics.median(r[k] for r in runs) for k in ("p50_s", "p99_s", "makespan_s", "peak_at_one_sim")}
            m["failed"] = sum(len(r["failures"]) for r in runs)
            m.update({f"{k}_over_ideal": m[k] / ideal[k] for k in ("p50_s", "p99_s", "makespan_s")})
            f["medians"].setdefault(front, {})[str(c)] = m
            print(f"  {c:<8}{front:<13}{m['p50_s']:>7.2f}{m['p99_s']:>8.2f}{m['makespan_s']:>10.2f}"
                  f"{m['p50_s_over_ideal']:>8.2f}{m['p99_s_over_ideal']:>8.2f}{m['makespan_s_over_ideal']:>7.2f}"
                  f"{m['peak_at_one_sim']:>6.0f}{m['failed']:>8}")


if __name__ == "__main__":
    sys.exit(main())
