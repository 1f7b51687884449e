"""What a request body costs the proxy's event loop: figures for docs/PERFORMANCE.md and bench_hostile.py.

`python bench/profile_body.py` prints, for each body shape, the time its parse takes (proxy/body.py; where it
runs: the loop up to limits.inline_kb, a worker thread beyond), the longest the event loop went without
running meanwhile (the median over ROUNDS of the worst gap of a 1 ms ticker on the loop while the body is digested as forward._read_body does), and the
peak memory the digest allocated over the body's size (tracemalloc: the parse's own, slower under it). No server: the proxy's own functions on its own loop.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from proxy.body import Limits, Refused  # noqa: E402
from proxy.forward import digest  # noqa: E402
from proxy.routing import POLICIES, RoutingConfig  # noqa: E402
from proxy.state import SWITCH_S  # noqa: E402


def shapes() -> dict[str, bytes]:
    """The issue's bodies: a MiniCPM-V request with four 1.5 MB images, 4,000,000 tiny parts, deep nesting."""
    image = base64.b64encode(os.urandom(1_125_000)).decode()    # 1.5 MB of base64
    four = {"model": "m", "user": "trace-1", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe each picture."}] + [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + image}}] * 4}]}
    return {
        "chat, 20 messages": json.dumps({"model": "m", "messages": [
            {"role": "user", "content": "A question about the harbour. " * 20}] * 20}).encode(),
        "4 images x 1.5 MB": json.dumps(four).encode(),
        "4,000,000 {} parts": json.dumps({"model": "m", "messages": [{"role": "user", "content": [{}] * 4_000_000}]},
                                         separators=(",", ":")).encode(),
        "49,000 short strings": json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                            "stop": ["ab"] * 49_000}).encode(),
        "nested 100,000 deep": b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "nested 1,000 deep": b'{"model": "m", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    }


ROUNDS = 5   # each shape's figures: the median of this many rounds (the machine may be shared)


async def measure(body: bytes | None, limits: Limits, pool) -> tuple[str, float, float]:
    """(outcome, digest ms, worst loop gap ms) for one body handled as the request path handles it."""
    loop, worst, done = asyncio.get_running_loop(), 0.0, False
    policy = POLICIES["prefix"](RoutingConfig())

    async def ticker():
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last - 0.001), now
    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    try:
        if body is None:       # the baseline: the ticker alone, what the machine's own noise is
            await asyncio.sleep(0.05)
            raise Refused("-")
        if len(body) > limits.inline_kb * 1024:
            out = await loop.run_in_executor(pool, digest, body, limits, policy, True)
        else:
            out = digest(body, limits, policy, True)
        outcome = f"{len(out[1].blocks)} blocks"
    except Refused as e:
        outcome = "400: " + str(e).split(";")[0][:48]
    took = time.perf_counter() - t0
    done = True
    await tick
    return outcome, took * 1000, worst * 1000


def main() -> None:
    sys.setswitchinterval(SWITCH_S)       # as proxy/state.py sets it
    limits = Limits()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    print(f"{'body':24} {'size':>9} {'digest':>9} {'loop gap':>9} {'mem/body':>8}  outcome")
    for name, body in {"idle (no body)": None, **shapes()}.items():
        runs = sorted(asyncio.run(measure(body, limits, pool)) for _ in range(ROUNDS))
        outcome = runs[0][0]
        took = statistics.median(r[1] for r in runs)
        gap = statistics.median(r[2] for r in runs)
        tracemalloc.start()        # a second run for memory: tracing slows the first's figures tenfold
        asyncio.run(measure(body, limits, pool))
        grown = tracemalloc.get_traced_memory()[1]       # the peak of what the digest allocated
        tracemalloc.stop()
        size = len(body or b"")
        print(f"{name:24} {size / 1e6:>7.2f}MB {took:>7.1f}ms {gap:>7.1f}ms {grown / size if size else 0:>8.1f}  {outcome}")


if __name__ == "__main__":
    main()
