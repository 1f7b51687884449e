"""Tenants at saturation: a flood from one tenant against an interactive one, shares by weight, and one
misbehaving tenant among four, on the sim fleet; every front side by side in one run.

    .venv/bin/python bench/bench_tenants.py [--seconds 6] [--fronts proxy,proxy-tenants,nginx] [--out FILE.json]

The fleet: 4 sims x max_num_seqs 4 (16 slots), 200 ms to the first token (bench_saturation.py's prefill)
and 20 ms a token; a request asks for 32 tokens (the interactive tenants) or 16 to 48 (the others), streamed, so it holds a slot about 0.84 s and the fleet's
capacity is about 19 requests/s. A request that finds every slot taken waits for the next one freed: about
0.84 s / 16 = 50 ms on average, a floor under any front's TTFT at saturation.
Each tenant sends its own API key (`Authorization: Bearer sk-NAME`); `proxy-tenants` (keys naming app and
batch, then others, `proxy.tenants` set) tells them apart, `proxy` is today's proxy (one FIFO queue, no
tenants), nginx has no queue of its own (the engines queue). vllm-router and smg have no tenants either
(no per-key share or limit; their users ask for them), and are left out when bench/setup_routers.sh did
not install them.

A flooding tenant's client runs in a process of its own (as it would on another machine), so the
measured tenants' client is not slowed by it; the flood's own cost to the proxy and the engines stays.

1. flood: app alone, open loop (Poisson) at 20% of capacity, for --seconds: its time to first token
   (TTFT) p50 and p99; then the same while batch floods at 5x capacity (open loop; the proxies answer
   429 past queue.max, which stands at 64 here so each run drains in seconds): app's TTFT against alone
   (targets with tenants: p50 at most 1.5x, p99 at most 2x), and the fleet's goodput (output tokens
   of 200 answers per second of the run) against `proxy`'s (FIFO) in the same flood (target: at least 0.97x).
2. shares: gold (weight 3) and lead (weight 1), both backlogged (32 clients each, closed loop): the
   output tokens each was served within the run (target: within 10% of 75/25). FIFO serves them by arrival.
3. four tenants, one misbehaving: a, b, c at 10% of capacity each and d flooding at 5x; a/b/c's TTFT p50
   and p99 against their own alone.
4. the fair queue's cost unit, decided by simulation (no processes): two tenants backlogged, equal
   weights, one asking for 256 tokens a request and one for 32: the slot-time each gets when the queue
   counts requests (deficit round robin) and when it counts tokens (virtual time, as proxy/admission.py).

Every process it starts is stopped by pid.
"""
from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import multiprocessing
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stack import TENANT_KEY, Stack  # noqa: E402

BACKENDS, MAX_NUM_SEQS, OVERHEAD_MS, TOKEN_MS, TOKENS = 4, 4, 200, 20, 32
SERVICE_S = (OVERHEAD_MS + TOKENS * TOKEN_MS) / 1000
CAPACITY = BACKENDS * MAX_NUM_SEQS / SERVICE_S        # requests/s the fleet serves at saturation
QUEUE_MAX = 64
TIMEOUT_S = 20.0
DEFAULT_FRONTS = "proxy,proxy-tenants,nginx,vllm-router,smg"
INTERACTIVE = ("app", "a", "b", "c")
TENANTS = {"app": {}, "batch": {}, "gold": {"weight": 3}, "lead": {}, "a": {}, "b": {}, "c": {}, "d": {}}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Load:
    """What one tenant's requests came to: TTFTs of the 200s, statuses, output tokens by completion time."""

    def __init__(self):
        self.ttft: list[float] = []
        self.status: dict[int, int] = {}
        self.done: list[tuple[float, int]] = []   # (answered at, output tokens) of each 200


async def one(session, url: str, tenant: str, tokens: int, load: Load, t0: float) -> None:
    import aiohttp
    body = {"model": "m", "max_tokens": tokens, "stream": True,
            "messages": [{"role": "user", "content": f"{tenant} {random.random()}: describe this picture"}]}
    sent = time.perf_counter()
    status, first, chunks = 0, None, 0
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {TENANT_KEY.format(tenant)}"}) as r:
            status = r.status
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    if first is None:
                        first = time.perf_counter() - sent
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError):
        status = status if status and status != 200 else -1
    load.status[status] = load.status.get(status, 0) + 1
    if status == 200 and first is not None:
        load.ttft.append(first)
        load.done.append((time.perf_counter() - t0, chunks))


def run(url: str, plan: dict[str, tuple[str, float]], seconds: float, apart: tuple[str, ...] = ()) -> tuple[dict, float]:
    """Run every tenant's load at once for `seconds` (see drive); the tenants in `apart` (the floods) from a
    client process of their own, so the measured tenants' client is not slowed by the flood's."""
    if not any(t in plan for t in apart):
        return asyncio.run(drive(url, plan, seconds))
    here = {t: p for t, p in plan.items() if t not in apart}
    there = {t: p for t, p in plan.items() if t in apart}
    start_at = time.time() + 2.0        # both clients start together, once the other process is up
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        other = pool.submit(_drive_in_process, url, there, seconds, start_at)
        loads, took = asyncio.run(drive(url, here, seconds, start_at=start_at))
        more, took_there = other.result()
    return {**loads, **more}, max(took, took_there)


def _drive_in_process(url: str, plan: dict, seconds: float, start_at: float) -> tuple[dict, float]:
    return asyncio.run(drive(url, plan, seconds, seed=31, start_at=start_at))


async def drive(url: str, plan: dict[str, tuple[str, float]], seconds: float, seed: int = 29,
                start_at: float | None = None) -> tuple[dict, float]:
    """Run every tenant's load at once for `seconds`: plan is tenant -> ("open", rate) or ("closed", clients);
    start_at: a time.time() to begin at. Returns (tenant -> Load, seconds until the last answer)."""
    import aiohttp
    loads = {t: Load() for t in plan}
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as s:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        tasks = []

        def tokens_of(tenant: str) -> int:
            """The interactive tenants ask for TOKENS; the others from TOKENS/2 to 3*TOKENS/2 (mean TOKENS),
            so the slots come free at scattered times (with one length for all, a saturated fleet's slots
            stay in lockstep and free in bursts)."""
            return TOKENS if tenant in INTERACTIVE else rng.randint(TOKENS // 2, 3 * TOKENS // 2)

        async def open_loop(tenant: str, rate: float):
            at = 0.0
            while True:
                at += rng.expovariate(rate)
                if at >= seconds:
                    return
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                tasks.append(asyncio.create_task(one(s, url, tenant, tokens_of(tenant), loads[tenant], t0)))

        async def closed_loop(tenant: str):
            while time.perf_counter() - t0 < seconds:
                await one(s, url, tenant, tokens_of(tenant), loads[tenant], t0)
                if loads[tenant].status.get(429):
                    await asyncio.sleep(0.2)
        senders = []
        for tenant, (kind, amount) in plan.items():
            if kind == "open":
                senders.append(open_loop(tenant, amount))
            else:
                senders += [closed_loop(tenant) for _ in range(int(amount))]
        await asyncio.gather(*senders)
        await asyncio.gather(*tasks)
        return loads, time.perf_counter() - t0


def ttft(load: Load) -> dict:
    return {"p50_s": pct(load.ttft, 0.5), "p99_s": pct(load.ttft, 0.99), "n": len(load.ttft), "status": load.status}


def flood(url: str, seconds: float) -> dict:
    alone, _ = run(url, {"app": ("open", 0.2 * CAPACITY)}, seconds)
    both, took = run(url, {"app": ("open", 0.2 * CAPACITY), "batch": ("open", 5 * CAPACITY)}, seconds, apart=("batch",))
    tokens = sum(n for load in both.values() for _, n in load.done)
    return {"alone": ttft(alone["app"]), "flood": ttft(both["app"]), "batch": ttft(both["batch"]),
            "goodput_tokens_s": tokens / took, "took_s": took}


def shares(url: str, seconds: float) -> dict:
    loads, _ = run(url, {"gold": ("closed", 32), "lead": ("closed", 32)}, seconds)
    # The served tokens of answers completed after the first second (the queues full) up to the end of sending.
    served = {t: sum(n for at, n in load.done if 1.0 <= at <= seconds) for t, load in loads.items()}
    total = sum(served.values()) or 1
    return {"served_tokens": served, "gold_share": served["gold"] / total,
            "status": {t: load.status for t, load in loads.items()}}


def misbehaving(url: str, seconds: float) -> dict:
    calm = {t: ("open", 0.1 * CAPACITY) for t in ("a", "b", "c")}
    alone, _ = run(url, calm, seconds)
    loud, _ = run(url, {**calm, "d": ("open", 5 * CAPACITY)}, seconds, apart=("d",))
    return {t: {"alone": ttft(alone[t]), "with_d": ttft(loud[t])} for t in calm} | {"d": ttft(loud["d"])}


def cost_unit(seconds: float = 600.0) -> dict:
    """Simulated slot-time shares of a long-answer and a short-answer tenant, both backlogged, equal
    weights, through proxy/admission.py's FairQueue counting requests or tokens; 16 slots."""
    from proxy.admission import FairQueue, Tenant

    class W:
        def __init__(self, tenant, out):
            self.tenant, self.tokens, self.route, self.overtaken, self.out = tenant, 16, None, 0, out
    out = {}
    for cost in ("requests", "tokens"):
        q = FairQueue(cost)
        long_, short = Tenant("long"), Tenant("short")
        for _ in range(20000):   # more than either is served in the run: both stay backlogged
            q.append(W(long_, 256))
            q.append(W(short, 32))
        running, now, busy = [], 0.0, {"long": 0.0, "short": 0.0}
        seq = 0

        def start(at):
            nonlocal seq
            w = next(iter(q))
            q.served(w, charge=True)
            took = (OVERHEAD_MS + w.out * TOKEN_MS) / 1000
            seq += 1
            heapq.heappush(running, (at + took, seq, w, took))
        for _ in range(BACKENDS * MAX_NUM_SEQS):
            start(0.0)
        while now < seconds:
            now, _, w, took = heapq.heappop(running)
            busy[w.tenant.name] += took
            q.ended(w.tenant, w.out)
            start(now)
        total = sum(busy.values())
        out[cost] = {k: v / total for k, v in busy.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each load")
    ap.add_argument("--fronts", default=DEFAULT_FRONTS)
    ap.add_argument("--out", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    figures: dict = {"capacity_rps": CAPACITY, "seconds": args.seconds, "cost_unit": cost_unit(), "fronts": {}}
    print(f"{BACKENDS} sims x max_num_seqs {MAX_NUM_SEQS}, {TOKENS} tokens a request ({SERVICE_S:.2f} s a slot): "
          f"capacity {CAPACITY:.1f} requests/s; each load {args.seconds:g} s", flush=True)
    u = figures["cost_unit"]
    print(f"cost unit (simulated): slot-time of long/short answers, counting requests "
          f"{u['requests']['long']:.2f}/{u['requests']['short']:.2f}, counting tokens "
          f"{u['tokens']['long']:.2f}/{u['tokens']['short']:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        stack = Stack(Path(tmp), BACKENDS, MAX_NUM_SEQS,
                      ["--sim-overhead-ms", str(OVERHEAD_MS), "--sim-prefill-ms", "0", "--sim-token-ms",
                       str(TOKEN_MS), "--sim-output-tokens", "1000"],
                      proxy_set=(f"proxy.queue.max={QUEUE_MAX}",), tenants=TENANTS)
        try:
            fronts = stack.start(args.fronts.split(","))
            figures["skipped"] = stack.skipped
            for front in fronts:
                url = stack.url(front)
                f = figures["fronts"][front] = {"flood": flood(url, args.seconds)}
                fl = f["flood"]
                print(f"  {front:<14} flood: app TTFT p50 {fl['alone']['p50_s']*1000:6.0f} -> {fl['flood']['p50_s']*1000:6.0f} ms, "
                      f"p99 {fl['alone']['p99_s']*1000:6.0f} -> {fl['flood']['p99_s']*1000:6.0f} ms; app {fl['flood']['status']}, "
                      f"batch {fl['batch']['status']}; goodput {fl['goodput_tokens_s']:.0f} tokens/s", flush=True)
                f["shares"] = shares(url, args.seconds)
                print(f"  {front:<14} shares 3:1: gold {f['shares']['gold_share']:.3f} of the tokens served "
                      f"{f['shares']['served_tokens']}", flush=True)
                f["four"] = misbehaving(url, args.seconds)
                print(f"  {front:<14} four, d floods: " + "; ".join(
                    f"{t} p50 {f['four'][t]['alone']['p50_s']*1000:.0f}->{f['four'][t]['with_d']['p50_s']*1000:.0f} ms "
                    f"p99 {f['four'][t]['alone']['p99_s']*1000:.0f}->{f['four'][t]['with_d']['p99_s']*1000:.0f} ms "
                    f"{f['four'][t]['with_d']['status']}" for t in ("a", "b", "c")) + f"; d {f['four']['d']['status']}",
                    flush=True)
        finally:
            stack.stop()
    report(figures)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


def report(f: dict) -> None:
    print("\nratios (same run):")
    base = f["fronts"].get("proxy", {}).get("flood", {}).get("goodput_tokens_s")
    print(f"  {'front':<14}{'app p50 x':>10}{'app p99 x':>10}{'goodput/FIFO':>13}{'gold share':>11}{'a-c p50 x':>10}{'a-c p99 x':>10}")
    for front, r in f["fronts"].items():
        fl = r["flood"]
        p50 = fl["flood"]["p50_s"] / fl["alone"]["p50_s"]
        p99 = fl["flood"]["p99_s"] / fl["alone"]["p99_s"]
        good = fl["goodput_tokens_s"] / base if base else float("nan")
        four = r["four"]
        w50 = max(four[t]["with_d"]["p50_s"] / four[t]["alone"]["p50_s"] for t in ("a", "b", "c"))
        w99 = max(four[t]["with_d"]["p99_s"] / four[t]["alone"]["p99_s"] for t in ("a", "b", "c"))
        r["ratios"] = {"app_p50": p50, "app_p99": p99, "goodput_over_fifo": good, "worst_calm_p50": w50,
                       "worst_calm_p99": w99}
        print(f"  {front:<14}{p50:>10.2f}{p99:>10.2f}{good:>13.3f}{r['shares']['gold_share']:>11.3f}{w50:>10.2f}{w99:>10.2f}")
    print("  targets with tenants: app p50 <= 1.5x and p99 <= 2x alone; goodput >= 0.97x FIFO; gold share 0.75 +- 0.075")


if __name__ == "__main__":
    sys.exit(main())
