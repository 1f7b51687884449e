"""The proxy and the code before it driven at the same time: the CPU a request costs each, under one load.

    .venv/bin/python bench/bench_together.py --baseline DIR [--rounds 6] [--seconds 5] [--connections 32] [--stream]

bench_proxy.py drives one front at a time; on a machine shared with other work a round is good or bad by
what ran in its seconds, and the ratio of two fronts' rounds moves by 2x. Here `proxy` (this checkout) and
`proxy-base` (DIR's proxy, the same config: the rendered one, results log on, least_conn) run side by side
before the same four instant sims, each driven by its own wrk (one thread, --connections) in the same
seconds, so whatever else the machine runs weighs on both. Per round: each one's requests/s and CPU per
request (its process's, Linux /proc); the medians of the rounds' ratios, proxy over proxy-base. --stream:
bench_proxy.py's 1,000-chunk streams (16 connections each), the CPU per stream.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import CHAT, SSE, wrk  # noqa: E402
from stack import Stack  # noqa: E402

FRONTS = ("proxy", "proxy-base")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the checkout whose proxy runs as proxy-base")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--stream", action="store_true", help="1,000-chunk streams instead of chat completions")
    args = ap.parse_args(argv)
    wrk_bin = shutil.which("wrk")
    if not wrk_bin:
        print("bench_together: wrk is not installed; `apt-get install wrk` (Debian).", file=sys.stderr)
        return 2
    body, connections = (SSE, 16) if args.stream else (CHAT, args.connections)
    what = "stream" if args.stream else "request"
    with tempfile.TemporaryDirectory(prefix="bench-together-") as tmp:
        stack = Stack(Path(tmp), 4, 256, ["--sim-instant", "--sim-output-tokens", "1000"], proxy_set=("proxy.routing.policy=least_conn",),
                      baseline=Path(args.baseline).resolve())
        try:
            stack.start(list(FRONTS))
            ratios = []
            for r in range(args.rounds):
                runs: dict[str, dict] = {}
                cpu = {f: stack.cpu_s(f) for f in FRONTS}

                def drive(front: str) -> None:
                    runs[front] = wrk(wrk_bin, stack.url(front) + "/v1/chat/completions", body, connections,
                                      args.seconds, Path(tmp), threads=1)
                threads = [threading.Thread(target=drive, args=(f,)) for f in FRONTS]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                us = {f: (stack.cpu_s(f) - cpu[f]) / max(1, runs[f]["requests"]) * 1e6 for f in FRONTS}
                ratios.append((runs["proxy"]["rps"] / runs["proxy-base"]["rps"], us["proxy"] / us["proxy-base"]))
                print(f"  round {r + 1}: proxy {runs['proxy']['rps']:.0f}/s, {us['proxy']:.0f} us a {what}; "
                      f"proxy-base {runs['proxy-base']['rps']:.0f}/s, {us['proxy-base']:.0f} us a {what}", flush=True)
            rate, cost = [r for r, _ in ratios], [c for _, c in ratios]
            print(f"proxy / proxy-base ({what}s, the same seconds): {what}s/s {statistics.median(rate):.3f}x (rounds "
                  f"{', '.join(f'{x:.3f}' for x in rate)}); CPU per {what} {statistics.median(cost):.3f}x (rounds "
                  f"{', '.join(f'{x:.3f}' for x in cost)})")
        finally:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
