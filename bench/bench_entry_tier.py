"""The entry tier's capacity: one entry proxy against two active ones over the same engines.

Four sim engines in instant mode (no model time: every cost is the fronts') with max_num_seqs 256, and two
proxies from the same rendered conf/proxy.yaml (least_conn, results log on) on loopback. `one`: wrk with C
connections on the first proxy; `two`: wrk with C/2 connections on each proxy at once (the clients spread over
two virtual addresses, active-active); requests/s summed. Interleaved rounds, the median reported.

    .venv/bin/python bench/bench_entry_tier.py --seconds 5 --rounds 3 [--connections 64]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import CHAT, wrk  # noqa: E402
from stack import Stack  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=64)
    args = ap.parse_args(argv)
    wrk_bin = shutil.which("wrk")
    if not wrk_bin:
        print("bench_entry_tier: wrk is not installed; `apt-get install wrk` and run again.", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {"one": [], "two": []}
    with tempfile.TemporaryDirectory(prefix="bench-entry-") as tmp:
        stack = Stack(Path(tmp), 4, 256, ["--sim-instant"], proxy_set=("proxy.routing.policy=least_conn",))
        conf = stack.deploy / "conf"
        first = yaml.safe_load((conf / "proxy.yaml").read_text())
        second = yaml.safe_load((conf / "proxy-lc.yaml").read_text())   # its ports and results log, proxy's rest
        (conf / "proxy-lc.yaml").write_text(yaml.safe_dump({**first, "listen": second["listen"], "admin": second["admin"],
                                                            "results_log": second["results_log"]}))
        try:
            stack.start(["proxy", "proxy-lc"])
            path = "/v1/chat/completions"
            for r in range(args.rounds):
                for mode in (["one", "two"] if r % 2 == 0 else ["two", "one"]):
                    if mode == "one":
                        run = wrk(wrk_bin, stack.url("proxy") + path, CHAT, args.connections, args.seconds, Path(tmp))
                    else:
                        with ThreadPoolExecutor(2) as pool:
                            both = list(pool.map(lambda f: wrk(wrk_bin, stack.url(f) + path, CHAT,
                                                               args.connections // 2, args.seconds, Path(tmp)),
                                                 ["proxy", "proxy-lc"]))
                        run = {"rps": sum(b["rps"] for b in both), "p99_ms": max(b["p99_ms"] for b in both),
                               "non_2xx": sum(b["non_2xx"] for b in both)}
                    runs[mode].append(run)
                    print(f"round {r + 1} {mode}: {run['rps']:.0f} requests/s, p99 {run['p99_ms']:.1f} ms, "
                          f"{run['non_2xx']} non-2xx", flush=True)
        finally:
            stack.stop()
    one, two = (statistics.median(x["rps"] for x in runs[m]) for m in ("one", "two"))
    print(f"median: one entry {one:.0f} requests/s, two entries {two:.0f} requests/s, ratio {two / one:.2f} "
          f"({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
