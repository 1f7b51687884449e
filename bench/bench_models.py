"""One model's saturation beside another's: does a saturated pool raise another pool's latency?

    .venv/bin/python bench/bench_models.py [--rounds 5] [--requests 300] [--b-load 0.5] [--a-load 2.0]
                                           [--out FILE.json]

One proxy in the models form (`models:` in proxy.yaml) before 4 sim engines with real timing: prefill
100 ms, 10 ms a token, every request asking for 10 tokens (0.2 s once it has a slot), max_num_seqs 4.
Two pools of two sims each: model `a` (A) and model `b` (B), each with its slots (4 a backend), its
least-connections pick and its own admission queue (`queue.max` 16, `queue.timeout_s` 2, for both).
A pool's capacity is 2 sims x 4 slots / 0.2 s = 40 requests/s.

B is sent --requests requests in an open loop at --b-load of its capacity (20 r/s by default: a fixed
rate whatever the answers' pace, no coordinated omission), once alone and once while A is driven, also
in an open loop, at --a-load of its capacity (80 r/s: A's queue fills and overflows into 429, and 503
for a request that waited longer than its timeout). A's driver is a process of its own (this script with
--drive), started 2 s before B's run so A is saturated when B starts, and sending until B is done.
Rounds interleave (alone, beside, alone, beside, ...) and the medians over rounds are reported: B's p50
and p99 alone and beside A, their ratio (the target: beside within 1.1x of alone), A's answers by
status and the most requests one of B's sims held at once (above 4, B's requests waited inside an
engine). Between runs the proxy is left to drain (no request in flight). Everything on 127.0.0.1; every
process it starts is stopped by pid.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import Stack  # noqa: E402

BACKENDS, MAX_NUM_SEQS, PREFILL_MS, TOKEN_MS, TOKENS = 4, 4, 100, 10, 10
QUEUE_MAX, QUEUE_TIMEOUT_S, WARMUP_S = 16, 2, 2.0
FRONT = "proxy-models"
POOLS = {FRONT: [{"name": "a", "backends": [0, 1]}, {"name": "b", "backends": [2, 3]}]}


def capacity_rps() -> float:
    """One pool's requests/s when all its slots are busy: 2 sims x max_num_seqs / one request's time."""
    return 2 * MAX_NUM_SEQS / ((PREFILL_MS + TOKENS * TOKEN_MS) / 1000)


def pct(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def open_loop(url: str, model: str, rate: float, count: int, timeout_s: float = 60) -> dict:
    """count requests for model sent at a fixed rate (url: comma separated, taken in turn): latencies (ms)
    of the 200s and answers by status; a request not answered within timeout_s is given up."""
    import aiohttp
    latencies: list[float] = []
    status: Counter = Counter()
    body = {"model": model, "max_tokens": TOKENS, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        urls = url.split(",")

        async def one(i: int):
            t = time.perf_counter()
            try:
                async with s.post(urls[i % len(urls)] + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    status[str(r.status)] += 1
                    if r.status == 200:
                        latencies.append((time.perf_counter() - t) * 1000)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status[type(e).__name__] += 1
        tasks, start = [], time.perf_counter()
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return {"n": len(latencies), "p50_ms": pct(latencies, 0.5), "p99_ms": pct(latencies, 0.99),
            "status": dict(status)}


def wait_idle(stack: Stack, timeout: float = 30) -> None:
    """Until the proxy holds no request (none in flight on any backend, none queued)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(stack.admin_url(FRONT) + "/admin/backends", timeout=5) as r:
            backends = json.loads(r.read())
        backends = backends.get("backends", backends) if isinstance(backends, dict) else backends
        if not sum(b["in_flight"] for b in backends):
            return
        time.sleep(0.2)
    print(f"bench_models: the proxy still held requests after {timeout:g}s", file=sys.stderr)


def b_peak(stack: Stack) -> int:
    """The most requests one of B's sims held at once since the last reset."""
    return max(s["peak_in_flight"] for s in stack.sim_stats()[2:])


def run_b(stack: Stack, args, rate_b: float, rate_a: float | None, a_direct: bool = False) -> dict:
    """B's open loop, alone (rate_a None) or beside A's driver process; a_direct: A's requests go to A's
    sims themselves, not through the proxy (the control: the same machine load, the proxy not shared),
    each given up after the proxy's queue timeout plus one request's time, as the proxy's 503 would."""
    stack.reset_sim_stats()
    url = stack.url(FRONT)
    driver = None
    if rate_a:
        seconds = WARMUP_S + args.requests / rate_b + 1
        a_url = ",".join(f"http://127.0.0.1:{p}" for p in stack.backend_ports[:2]) if a_direct else url
        timeout = QUEUE_TIMEOUT_S + (PREFILL_MS + TOKENS * TOKEN_MS) / 1000 if a_direct else 60
        driver = subprocess.Popen([sys.executable, __file__, "--drive", a_url, "a", str(rate_a),
                                   str(int(rate_a * seconds)), str(timeout)],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        time.sleep(WARMUP_S)
    try:
        b = asyncio.run(open_loop(url, "b", rate_b, args.requests))
        a = None
        if driver:
            out, _ = driver.communicate(timeout=120)
            a = json.loads(out)
    finally:
        if driver and driver.poll() is None:
            driver.kill()     # by its pid
            driver.wait(5)
    result = {"b": b, "a": a, "b_peak_at_one_sim": b_peak(stack)}
    wait_idle(stack)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of (alone, beside); medians are reported")
    ap.add_argument("--requests", type=int, default=300, help="B's requests in each run")
    ap.add_argument("--b-load", type=float, default=0.5, help="B's rate, a fraction of its pool's capacity")
    ap.add_argument("--a-load", type=float, default=2.0, help="A's rate beside B, a multiple of its capacity")
    ap.add_argument("--out", help="also write every figure to this JSON file")
    ap.add_argument("--control", action="store_true",
                    help="a third run each round: A sent to its sims directly, not through the proxy")
    ap.add_argument("--drive", nargs=5, metavar=("URL", "MODEL", "RATE", "COUNT", "TIMEOUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.drive:   # A's driver, a process of its own: its figures on stdout
        url, model, rate, count, timeout = args.drive
        print(json.dumps(asyncio.run(open_loop(url, model, float(rate), int(count), float(timeout)))))
        return 0
    cap = capacity_rps()
    rate_b, rate_a = args.b_load * cap, args.a_load * cap
    print(f"{BACKENDS} sims x max_num_seqs {MAX_NUM_SEQS}, prefill {PREFILL_MS} ms + {TOKENS} tokens x {TOKEN_MS} ms; "
          f"pools a and b of 2 sims, {cap:g} r/s each; B {args.requests} requests at {rate_b:g} r/s, A at "
          f"{rate_a:g} r/s beside it; queue max {QUEUE_MAX}, timeout {QUEUE_TIMEOUT_S} s; {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    figures: dict = {"rounds": args.rounds, "requests": args.requests, "rate_b": rate_b, "rate_a": rate_a,
                     "capacity_rps": cap, "load_before": os.getloadavg(), "runs": {"alone": [], "beside": []},
                     "control": args.control}
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        stack = Stack(Path(tmp), BACKENDS, MAX_NUM_SEQS,
                      # PREFILL_MS for every request, whatever its prompt: the fixed overhead, no prefill.
                      ["--sim-overhead-ms", str(PREFILL_MS), "--sim-prefill-ms", "0", "--sim-token-ms", str(TOKEN_MS),
                       "--sim-output-tokens", "1000"], served=("a", "b"), pools=POOLS,
                      proxy_set=(f"proxy.queue.max={QUEUE_MAX}", f"proxy.queue.timeout_s={QUEUE_TIMEOUT_S}"))
        try:
            stack.start([FRONT])
            for r in range(args.rounds):
                for kind in ("alone", "beside", "beside-direct")[:3 if args.control else 2]:
                    run = run_b(stack, args, rate_b, None if kind == "alone" else rate_a, kind == "beside-direct")
                    figures["runs"].setdefault(kind, []).append(run)
                    a = f"  A: {run['a']['status']}" if run["a"] else ""
                    print(f"  round {r + 1} {kind:<13} B p50 {run['b']['p50_ms']:6.1f} ms  p99 {run['b']['p99_ms']:6.1f} ms"
                          f"  B answers {run['b']['status']}  B peak at one sim {run['b_peak_at_one_sim']}{a}",
                          flush=True)
        finally:
            stack.stop()
    figures["load_after"] = os.getloadavg()
    report(figures)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


def report(f: dict) -> None:
    alone, beside = f["runs"]["alone"], f["runs"]["beside"]
    m = {kind: {k: statistics.median(r["b"][k] for r in runs) for k in ("p50_ms", "p99_ms")}
         for kind, runs in (("alone", alone), ("beside", beside))}
    per_round = {k: [b["b"][k] / a["b"][k] for a, b in zip(alone, beside)] for k in ("p50_ms", "p99_ms")}
    a_status: Counter = Counter()
    for r in beside:
        a_status.update(r["a"]["status"])
    b_bad = sum(n for r in alone + beside for s, n in r["b"]["status"].items() if s != "200")
    f["medians"] = m
    f["ratios"] = {"p50": m["beside"]["p50_ms"] / m["alone"]["p50_ms"], "p99": m["beside"]["p99_ms"] / m["alone"]["p99_ms"],
                   "p50_by_round": per_round["p50_ms"], "p99_by_round": per_round["p99_ms"]}
    f["a_status"] = dict(a_status)
    print(f"\nmedian of {f['rounds']} rounds; B at {f['rate_b']:g} r/s, A at {f['rate_a']:g} r/s beside it:")
    print(f"  B alone:   p50 {m['alone']['p50_ms']:.1f} ms  p99 {m['alone']['p99_ms']:.1f} ms")
    print(f"  B beside A: p50 {m['beside']['p50_ms']:.1f} ms  p99 {m['beside']['p99_ms']:.1f} ms")
    print(f"  beside / alone: p50 {f['ratios']['p50']:.3f}x, p99 {f['ratios']['p99']:.3f}x (per round p99 "
          f"{', '.join(f'{x:.2f}' for x in per_round['p99_ms'])}); target p99 within 1.1x")
    print(f"  B's requests not answered 200: {b_bad}; B's peak at one sim (max): "
          f"{max(r['b_peak_at_one_sim'] for r in alone + beside)}")
    print(f"  A's answers over {len(beside)} runs: {dict(sorted(a_status.items()))}")
    if "beside-direct" in f["runs"]:
        control = f["runs"]["beside-direct"]
        c = {k: statistics.median(r["b"][k] for r in control) for k in ("p50_ms", "p99_ms")}
        f["medians"]["beside-direct"] = c
        f["ratios"]["control_p50"] = c["p50_ms"] / m["alone"]["p50_ms"]
        f["ratios"]["control_p99"] = c["p99_ms"] / m["alone"]["p99_ms"]
        print(f"  control, A sent to its sims directly (the proxy not shared): B p50 {c['p50_ms']:.1f} ms, p99 "
              f"{c['p99_ms']:.1f} ms; / alone: p50 {f['ratios']['control_p50']:.3f}x, p99 {f['ratios']['control_p99']:.3f}x")
    print(f"  load average before {f['load_before'][0]:.2f}, after {f['load_after'][0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
