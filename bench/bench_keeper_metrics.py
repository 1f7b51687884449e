"""The keeper's cost of GET /metrics: its CPU (with its children, the smi) over 60 s idle, then over 60 s
scraped every second, and the scrapes' latency, on a local sim cluster of 2 instances (the sim's smi, a
Python process, sampled at most every 2 s). Prints one JSON line; stops the cluster at the end.

    .venv/bin/python bench/bench_keeper_metrics.py [--seconds 60]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from stack import cpu_s as proc_cpu_s, free_ports, pid_of, run_inv, sim_inventory  # noqa: E402


def cpu_s(pid: int) -> float:
    """The keeper's CPU seconds, the smi runs it waited for included."""
    return proc_cpu_s(pid, waited_children=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-keeper-metrics-"))
    base = free_ports(6)
    inventory = sim_inventory(work / "hosts.yml", "m", work / "deploy", base, 2, sim={"load_s": 0.3},
                              proxy={"port": base + 2, "admin_port": base + 3, "health_interval_s": 1},
                              keeper={"metrics_port": base + 4})

    r = run_inv(inventory, "deploy", "--host", "m")
    if r.returncode != 0:
        raise SystemExit(r.stdout + r.stderr)
    try:
        pid = pid_of(work / "deploy" / "run" / "keeper.pid")
        time.sleep(3)
        c0, t0 = cpu_s(pid), time.time()
        time.sleep(args.seconds)
        idle = (cpu_s(pid) - c0) / (time.time() - t0)
        latencies = []
        c0, t0 = cpu_s(pid), time.time()
        while time.time() - t0 < args.seconds:
            start = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{base + 4}/metrics", timeout=10) as resp:
                body = resp.read()
            latencies.append(time.perf_counter() - start)
            time.sleep(max(0.0, 1 - (time.perf_counter() - start)))
        scraped = (cpu_s(pid) - c0) / (time.time() - t0)
        latencies.sort()
        print(json.dumps({"idle_core_fraction": round(idle, 4), "scraped_1s_core_fraction": round(scraped, 4),
                          "scrapes": len(latencies), "p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
                          "max_ms": round(latencies[-1] * 1000, 1), "bytes": len(body),
                          "cards": body.count(b"fleet_card_memory_used_bytes{")}))
    finally:
        run_inv(inventory, "stop", "--host", "m")
    return 0


if __name__ == "__main__":
    sys.exit(main())
