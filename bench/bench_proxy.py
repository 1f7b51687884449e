"""What the aiohttp proxy costs next to nginx and next to no front at all, measured side by side.

    .venv/bin/python bench/bench_proxy.py [--seconds 5] [--rounds 3] [--connections 64] [--out FILE.json]

Starts a sim engine in instant mode (no model time: every cost measured is the front's), the proxy and
nginx, both from the files `inv render` makes for a local sim host, then drives each with wrk at
--connections on loopback with short chat completions, in interleaved rounds (direct, proxy, nginx,
direct, ...) so a noisy machine hurts all three alike; the median round of each is reported with the
ratios. Then SSE: 1,000-chunk streams, direct against the proxy. Then the latency the proxy adds at a
fixed rate below capacity (open loop), which is what a client feels on a cluster that is not overloaded.
Needs wrk (Debian package `wrk`); nginx is optional (`nginx` package), its rows are skipped without it.
Every process it starts is stopped by pid at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleet import inventory, render  # noqa: E402

CHAT = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
SSE = {"model": "m", "max_tokens": 1000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        if all(_free(base + i) for i in range(n)):
            return base
    raise SystemExit("bench_proxy: no run of free loopback ports found.")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=1).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"bench_proxy: {url} did not answer 200 within {timeout:g}s.")


class Stack:
    """The sim, the proxy and nginx, from rendered files in a temp deploy_dir; stopped by pid."""

    def __init__(self, work: Path, backends: int):
        self.work = work
        base = free_ports(backends + 4)
        self.backend_ports = [base + i for i in range(backends)]
        self.proxy_port, self.admin_port, self.nginx_port = base + backends, base + backends + 1, base + backends + 2
        self.procs: list[subprocess.Popen] = []
        self.nginx_pid_file: Path | None = None
        inv_path = work / "hosts.yml"
        inv_path.write_text(textwrap.dedent(f"""\
            hosts:
              bench:
                connection: local
                engine: sim
                accelerator: sim
                accelerators: {backends}
                instances: {backends}
                base_port: {base}
                deploy_dir: {work / 'deploy'}
                proxy: {{port: {self.proxy_port}, admin_port: {self.admin_port}, bind: 127.0.0.1}}
            """))
        inv = inventory.load(inv_path)
        self.deploy = work / "deploy"
        for name, port in (("proxy", self.proxy_port), ("nginx", self.nginx_port)):
            hv = inv.host_vars("bench", [f"proxy.port={port}", f"proxy.admin_port={self.admin_port}"])
            hv.vars["python"] = sys.executable
            for f in render.render_host(hv):
                if (name == "proxy" and f.path == "conf/proxy.yaml") or (name == "nginx" and f.path == "conf/nginx.conf"):
                    path = self.deploy / f.path
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(f.content)
        for d in ("logs", "run/nginx", "sim-dev"):
            (self.deploy / d).mkdir(parents=True, exist_ok=True)
        # nginx.conf includes the upstream list the /health watcher keeps: every backend up here.
        from hostagent import upstream
        (self.deploy / "run" / "nginx_upstream.conf").write_text(
            upstream.render([f"127.0.0.1:{p}" for p in self.backend_ports], set(), 1, 5))

    def _start(self, argv, log: str, **kw) -> subprocess.Popen:
        out = open(self.deploy / "logs" / log, "ab")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def start(self, nginx: str | None) -> None:
        env = {**os.environ, "FLEET_SIM_DEV_DIR": str(self.deploy / "sim-dev")}
        env.pop("FLEET_TAG", None)
        for i, port in enumerate(self.backend_ports):
            self._start([sys.executable, "-m", "fleet.sim", "serve", "m", "--host", "127.0.0.1", "--port", str(port),
                         "--max-num-seqs", "1024", "--sim-load-s", "0", "--sim-instant"], f"sim_{i}.log",
                        cwd=ROOT, env={**env, "SIM_VISIBLE_DEVICES": str(i)})
        for port in self.backend_ports:
            wait_http(f"http://127.0.0.1:{port}/health")
        self._start([sys.executable, "-m", "proxy", "--config", str(self.deploy / "conf" / "proxy.yaml")], "proxy.log",
                    cwd=ROOT)
        wait_http(f"http://127.0.0.1:{self.proxy_port}/health")
        if nginx:
            conf = self.deploy / "conf" / "nginx.conf"
            check = subprocess.run([nginx, "-t", "-q", "-p", str(self.deploy), "-c", str(conf)],
                                   capture_output=True, text=True)
            if check.returncode != 0:
                raise SystemExit(f"bench_proxy: nginx -t refused the rendered config: {check.stderr.strip()}")
            subprocess.run([nginx, "-p", str(self.deploy), "-c", str(conf)], check=True)
            self.nginx_pid_file = self.deploy / "run" / "nginx.master.pid"   # nginx's own
            wait_http(f"http://127.0.0.1:{self.nginx_port}/v1/models")

    def stop(self) -> None:
        if self.nginx_pid_file and self.nginx_pid_file.exists():
            try:
                os.kill(int(self.nginx_pid_file.read_text().split()[0]), signal.SIGQUIT)
            except (ProcessLookupError, ValueError):
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def wrk(wrk_bin: str, url: str, body: dict, connections: int, seconds: float, work: Path) -> dict:
    """One wrk run: requests/s, p50 and p99 in ms, errors."""
    script = work / "post.lua"
    script.write_text("wrk.method = 'POST'\nwrk.headers['Content-Type'] = 'application/json'\n"
                      f"wrk.body = [[{json.dumps(body)}]]\n")
    out = subprocess.run([wrk_bin, "-t2", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script), url],
                         capture_output=True, text=True, timeout=seconds + 30).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = {m.group(1): _ms(m.group(2), m.group(3)) for m in re.finditer(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)$", out, re.M)}
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {"rps": rps, "p50_ms": lat.get("50"), "p99_ms": lat.get("99"),
            "non_2xx": int(bad.group(1)) if bad else 0, "socket_errors": sum(map(int, errs.groups())) if errs else 0}


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


async def open_loop(url: str, rate: float, seconds: float) -> list[float]:
    """Latencies (ms) of requests sent at a fixed rate, whatever the answers' pace (no coordinated omission)."""
    import aiohttp
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one():
            t = time.perf_counter()
            async with s.post(url, json=CHAT) as r:
                await r.read()
                if r.status == 200:
                    latencies.append((time.perf_counter() - t) * 1000)
        tasks, start, n = [], time.perf_counter(), int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each wrk run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--rate", type=float, default=300.0, help="requests/s of the open-loop latency run")
    ap.add_argument("--out", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    wrk_bin = shutil.which("wrk")
    if not wrk_bin:
        print("bench_proxy: wrk is not installed; `apt-get install wrk` (Debian) and run again.", file=sys.stderr)
        return 2
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    figures: dict = {"connections": args.connections, "seconds": args.seconds, "rounds": args.rounds,
                     "cpus": os.cpu_count(), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        stack = Stack(Path(tmp), backends=1)
        try:
            stack.start(nginx)
            fronts = {"direct": stack.backend_ports[0], "proxy": stack.proxy_port}
            if nginx:
                fronts["nginx"] = stack.nginx_port
            print(f"chat completions, max_tokens 16, {args.connections} connections, {args.seconds:g}s x "
                  f"{args.rounds} interleaved rounds; sim engine in instant mode; {os.cpu_count()} CPUs", flush=True)
            for r in range(args.rounds):
                for name, port in fronts.items():
                    run = wrk(wrk_bin, f"http://127.0.0.1:{port}/v1/chat/completions", CHAT, args.connections,
                              args.seconds, Path(tmp))
                    figures["runs"].setdefault(name, []).append(run)
                    print(f"  round {r + 1} {name:<7} {run['rps']:>8.0f} r/s  p50 {run['p50_ms']:.1f} ms  "
                          f"p99 {run['p99_ms']:.1f} ms", flush=True)
            sse = {}
            for r in range(args.rounds):
                for name in ("direct", "proxy"):
                    run = wrk(wrk_bin, f"http://127.0.0.1:{fronts[name]}/v1/chat/completions", SSE, 16,
                              args.seconds, Path(tmp))
                    sse.setdefault(name, []).append(run)
            figures["sse"] = sse
            lat = {}
            for name in ("direct", "proxy"):
                values = asyncio.run(open_loop(f"http://127.0.0.1:{fronts[name]}/v1/chat/completions",
                                               args.rate, args.seconds))
                lat[name] = {"n": len(values), "p50_ms": pct(values, 0.5), "p99_ms": pct(values, 0.99)}
            figures["open_loop"] = {"rate": args.rate, **lat}
        finally:
            stack.stop()
    report(figures)   # adds the per-round ratios to figures
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]


def report(f: dict) -> None:
    runs = {name: median_run(r) for name, r in f["runs"].items()}
    print(f"\nmedian of {f['rounds']} rounds, {f['connections']} connections:")
    print(f"  {'front':<8}{'r/s':>9}{'p50 ms':>9}{'p99 ms':>9}  errors")
    for name, r in runs.items():
        print(f"  {name:<8}{r['rps']:>9.0f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}  {r['non_2xx'] + r['socket_errors']}")
    if "nginx" in runs:
        per_round = [p["rps"] / n["rps"] for p, n in zip(f["runs"]["proxy"], f["runs"]["nginx"])]
        f["proxy_over_nginx_by_round"] = per_round
        print(f"  proxy / nginx requests/s: {runs['proxy']['rps'] / runs['nginx']['rps']:.0%} of the medians; "
              f"by round {', '.join(f'{r:.0%}' for r in per_round)}, median {statistics.median(per_round):.0%} "
              "(target 45%)")
    print(f"  proxy / direct requests/s: {runs['proxy']['rps'] / runs['direct']['rps']:.0%}")
    print(f"  p99 added by the proxy at {f['connections']} connections: "
          f"{runs['proxy']['p99_ms'] - runs['direct']['p99_ms']:.1f} ms (target 5 ms)")
    sse = {name: median_run(r) for name, r in f["sse"].items()}
    print(f"SSE, 1,000-chunk streams, 16 connections: direct {sse['direct']['rps'] * 1000:.0f} chunks/s, "
          f"proxy {sse['proxy']['rps'] * 1000:.0f} chunks/s: {sse['proxy']['rps'] / sse['direct']['rps']:.0%} "
          "of direct (target 80%)")
    ol = f["open_loop"]
    print(f"open loop at {ol['rate']:g} r/s: direct p50 {ol['direct']['p50_ms']:.1f} / p99 {ol['direct']['p99_ms']:.1f} ms, "
          f"proxy p50 {ol['proxy']['p50_ms']:.1f} / p99 {ol['proxy']['p99_ms']:.1f} ms: the proxy adds "
          f"{ol['proxy']['p50_ms'] - ol['direct']['p50_ms']:.1f} ms at p50, "
          f"{ol['proxy']['p99_ms'] - ol['direct']['p99_ms']:.1f} ms at p99")


if __name__ == "__main__":
    sys.exit(main())
