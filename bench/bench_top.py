"""What `inv top` costs the proxy it watches: a local sim fleet of 8 instances deployed with `inv deploy`,
the proxy's CPU time (utime + stime of its process) measured over alternating phases with and without
`inv top` polling every second, under the same light chat load; and, as a check, the CPU one scrape of
the proxy's /metrics costs (the one request `inv top` makes of the proxy per frame).

    .venv/bin/python bench/bench_top.py [--phase-s 20] [--rounds 3] [--clients 4]

Prints a Markdown table for docs/PERFORMANCE.md. Everything runs on 127.0.0.1; the fleet is stopped at the
end (inv stop), the load and `inv top` by their pids.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from stack import cpu_s, free_ports, pid_of, run_inv, sim_inventory  # noqa: E402
from hostagent import processes  # noqa: E402  (stack put the checkout on the path)


class Load:
    def __init__(self, port: int, clients: int):
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.body = json.dumps({"model": "Test-Model", "max_tokens": 16,
                                "messages": [{"role": "user", "content": "hello " * 40}]}).encode()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]
        for th in self.threads:
            th.start()

    def run(self):
        while not self.stop.is_set():
            req = urllib.request.Request(self.url, data=self.body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
            except OSError:
                time.sleep(0.1)

    def close(self):
        self.stop.set()
        for th in self.threads:
            th.join(timeout=35)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--scrapes", type=int, default=300)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-top-"))
    base = free_ports(10)
    inventory = sim_inventory(tmp / "hosts.yml", "t", tmp / "deploy", base, 8, max_num_seqs=4,
                              model="/models/Test-Model", sim={"load_s": 0.3, "prefill_ms": 20, "token_ms": 10},
                              proxy={"port": base + 8, "admin_port": base + 9})
    r = run_inv(inventory, "deploy", "--host", "t", timeout=300)
    if r.returncode != 0:
        print(r.stdout + r.stderr, file=sys.stderr)
        return 1
    load = top = None
    try:
        pid = pid_of(tmp / "deploy" / "run" / "proxy.pid")
        load = Load(base + 8, args.clients)
        time.sleep(3)
        rows, sampler_cpu = [], []
        for k in range(args.rounds):
            for with_top in (False, True):
                if with_top:
                    top = subprocess.Popen([sys.executable, "-m", "invoke", "top", "--host", "t", "--inventory",
                                            str(inventory)], cwd=ROOT, stdin=subprocess.PIPE,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                samplers = _wait_for_samplers(str(tmp / "deploy"), top) if with_top else []
                c0, s0, t0 = cpu_s(pid), sum(map(cpu_s, samplers)), time.monotonic()
                time.sleep(args.phase_s)
                dt = time.monotonic() - t0
                rows.append((with_top, (cpu_s(pid) - c0) / dt))
                if samplers:
                    sampler_cpu.append((sum(map(cpu_s, samplers)) - s0) / dt)
                if top is not None:
                    top.terminate()
                    top.wait(timeout=20)
                    top = None
        load.close()
        load = None
        time.sleep(1)
        c0 = cpu_s(pid)
        for _ in range(args.scrapes):
            with urllib.request.urlopen(f"http://127.0.0.1:{base + 8}/metrics", timeout=5) as resp:
                size = len(resp.read())
        per_scrape = (cpu_s(pid) - c0) / args.scrapes
    finally:
        if top is not None:
            top.terminate()
            top.wait(timeout=20)
        if load is not None:
            load.close()
        run_inv(inventory, "stop", "--host", "t", timeout=300)
    off = [x for w, x in rows if not w]
    on = [x for w, x in rows if w]
    print("| phase | proxy CPU, % of a core (each round) | mean |")
    print("|---|---|---|")
    print(f"| without inv top | {', '.join(f'{x:.1%}' for x in off)} | {sum(off) / len(off):.2%} |")
    print(f"| with inv top every 1 s | {', '.join(f'{x:.1%}' for x in on)} | {sum(on) / len(on):.2%} |")
    print(f"\nadded by inv top: {sum(on) / len(on) - sum(off) / len(off):+.2%} of a core (phase means); one "
          f"/metrics scrape ({size} bytes) costs the proxy {per_scrape * 1000:.2f} ms of CPU, so one a second is "
          f"{per_scrape:.2%} of a core ({args.scrapes} scrapes, idle). The sampler on the host (8 engines' "
          f"/metrics, /health, the smi every 2 s): {sum(sampler_cpu) / max(1, len(sampler_cpu)):.1%} of a core.")
    return 0


def _wait_for_samplers(deploy_dir: str, top: subprocess.Popen) -> list[int]:
    """inv top's sampler for deploy_dir, once it runs (up to 30 s; inv top ending first is the bench's end)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = _samplers(deploy_dir)
        if found:
            return found
        if top.poll() is not None:
            raise SystemExit(f"inv top exited with status {top.returncode} before its sampler ran")
        time.sleep(0.1)
    raise SystemExit("inv top's sampler did not start within 30 s")


def _samplers(deploy_dir: str) -> list[int]:
    """The pids of inv top's samplers for deploy_dir (their spec names it, with exit_at_eof)."""
    return [p.pid for p in processes.snapshot().values()
            if p.alive and "exit_at_eof" in p.cmdline and deploy_dir in p.cmdline]


if __name__ == "__main__":
    sys.exit(main())
