#!/usr/bin/env python3
"""What the proxy costs next to nginx: wrk against direct-to-backend, the proxy and nginx, in one run.

    .venv/bin/python bench/bench_proxy.py [--duration 10] [--connections 64] [--backends 1]

1. Starts sim backends in instant mode (no prefill, no token time: the backend costs as little as it
   can), the proxy (`python -m proxy`) in front of them, and nginx (when installed) from a minimal config
   written in a temporary directory, shaped like templates/nginx.conf.j2 (least_conn, keepalive,
   proxy_buffering off, a JSON access log, as the proxy keeps its results log).
2. Drives each with wrk at --connections connections on loopback: short chat completions (16 tokens,
   not streamed), POSTed through a Lua script. Prints requests/s, p50 and p99 for each, and the ratios
   taken in this same run (the machine is shared: only ratios mean anything).
3. SSE: 1,000-chunk streams, direct and through the proxy; streams/s and chunks/s, and the ratio.

Every process it starts runs in its own session and is stopped by process group at the end.
Exit 1 when a tool is missing (wrk) or a target answered anything but 2xx.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_for(url: str, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while http_status(url) != 200:
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not become healthy within {timeout:g}s ({url})")
        time.sleep(0.05)


class Started:
    """The processes this script started; each leads its own process group, stopped at exit."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, start_new_session=True, stdout=kw.pop("stdout", subprocess.DEVNULL),
                             stderr=kw.pop("stderr", subprocess.DEVNULL), **kw)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=2)


def start_sims(started: Started, tmp: Path, n: int, output_tokens: int) -> list[int]:
    env = {**os.environ, "FLEET_SIM_DEV_DIR": str(tmp / "sim-dev"), "PYTHONPATH": str(ROOT)}
    ports = [free_port() for _ in range(n)]
    for i, port in enumerate(ports):
        started.start([PYTHON, "-m", "fleet.sim", "serve", "m", "--host", "127.0.0.1", "--port", str(port),
                       "--max-num-seqs", "1024", "--sim-instant", "--sim-output-tokens", str(output_tokens)],
                      cwd=ROOT, env={**env, "SIM_VISIBLE_DEVICES": str(i)})
    for port in ports:
        wait_for(f"http://127.0.0.1:{port}/health", f"sim :{port}")
    return ports


def start_proxy(started: Started, tmp: Path, ports: list[int], name: str) -> int:
    import yaml
    port, admin = free_port(), free_port()
    conf = {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"host": "127.0.0.1", "port": admin},
            "backends": [f"127.0.0.1:{p}" for p in ports], "health": {"interval_s": 2, "timeout_s": 1},
            "results_log": {"path": str(tmp / f"{name}_results.log")}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(conf))
    started.start([PYTHON, "-m", "proxy", "--config", str(path)], cwd=ROOT,
                  stderr=open(tmp / f"{name}.log", "wb"))
    wait_for(f"http://127.0.0.1:{port}/health", "proxy")
    return port


NGINX_CONF = """\
worker_processes auto;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    log_format fleet_json escape=json '{{"ts":"$time_iso8601","status":$status,"backend":"$upstream_addr",'
                                      '"request_time":$request_time}}';
    access_log {prefix}/access.log fleet_json;
    upstream backends {{
        least_conn;
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 64m;
        location / {{
            proxy_pass http://backends;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            add_header X-Backend $upstream_addr always;
        }}
        location = /health {{ return 200 "ok"; }}
    }}
}}
"""


def start_nginx(started: Started, tmp: Path, ports: list[int], nginx: str) -> int:
    prefix = tmp / "nginx"
    prefix.mkdir()
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=prefix, port=port, servers="\n".join(
        f"        server 127.0.0.1:{p};" for p in ports)))
    started.start([nginx, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)])
    wait_for(f"http://127.0.0.1:{port}/health", "nginx")
    return port


LUA = """\
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
"""


def lua_script(tmp: Path, name: str, body: dict) -> Path:
    path = tmp / f"{name}.lua"
    path.write_text(LUA.format(body=json.dumps(json.dumps(body))))   # a JSON string is a Lua string
    return path


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(wrk_bin: str, url: str, script: Path, connections: int, duration: int, threads: int) -> dict:
    """One wrk run: requests/s, p50/p99 in ms, requests and non-2xx responses."""
    r = subprocess.run([wrk_bin, "-t", str(threads), "-c", str(connections), "-d", f"{duration}s", "--latency",
                        "--timeout", "60s",
                        "-s", str(script), url], capture_output=True, text=True, timeout=duration + 60)
    out = r.stdout
    if r.returncode != 0 or "Requests/sec" not in out:
        raise SystemExit(f"wrk against {url} failed (exit {r.returncode}): {r.stderr.strip() or out[-300:]}")
    pct = dict(re.findall(r"^\s+(\d+(?:\.\d+)?)%\s+(\S+)\s*$", out, re.M))
    if "50" not in pct or "99" not in pct:
        raise SystemExit(f"cannot read wrk's latency distribution against {url}:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)$", out, re.M)
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": _ms(pct["50"]), "p99_ms": _ms(pct["99"]),
            "requests": int(re.search(r"(\d+) requests in", out).group(1)),
            "non_2xx": int(bad.group(1)) if bad else 0, "socket_errors": errors.group(1) if errors else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=int, default=10, help="seconds per wrk run (default 10)")
    ap.add_argument("--connections", type=int, default=64, help="wrk connections (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="wrk threads (default 2)")
    ap.add_argument("--backends", type=int, default=1, help="sim backends behind proxy and nginx (default 1)")
    ap.add_argument("--sse-connections", type=int, default=16, help="connections for the SSE runs (default 16)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    wrk_bin = shutil.which("wrk")
    if not wrk_bin:
        print("wrk is not installed: apt-get install wrk", file=sys.stderr)
        return 1
    nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.path.exists(p)),
                                          None)
    started = Started()
    figures: dict = {"connections": args.connections, "duration_s": args.duration, "backends": args.backends,
                     "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as t:
        tmp = Path(t)
        try:
            ports = start_sims(started, tmp, args.backends, 16)
            proxy = start_proxy(started, tmp, ports, "proxy")
            targets = {"direct": ports[0], "proxy": proxy}
            if nginx:
                targets["nginx"] = start_nginx(started, tmp, ports, nginx)
            else:
                print("nginx is not installed: measuring direct and proxy only", file=sys.stderr)
            short = lua_script(tmp, "short", {"model": "m", "max_tokens": 16, "user": "bench",
                                              "messages": [{"role": "user", "content": "hello"}]})
            runs = {}
            for name, port in targets.items():
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                wrk(wrk_bin, url, short, args.connections, 2, args.threads)      # warm-up
                runs[name] = wrk(wrk_bin, url, short, args.connections, args.duration, args.threads)
                print(f"{name:<7} {runs[name]['rps']:>9.0f} req/s  p50 {runs[name]['p50_ms']:7.2f} ms  "
                      f"p99 {runs[name]['p99_ms']:7.2f} ms  ({runs[name]['requests']} requests)", flush=True)
            figures["short"] = runs

            # SSE: 1,000-chunk streams from a backend that streams as fast as it can.
            sse_ports = start_sims(started, tmp, 1, 1000)
            sse_proxy = start_proxy(started, tmp, sse_ports, "proxy_sse")
            stream = lua_script(tmp, "sse", {"model": "m", "max_tokens": 1000, "stream": True, "user": "bench",
                                             "messages": [{"role": "user", "content": "hello"}]})
            sse = {}
            for name, port in (("direct", sse_ports[0]), ("proxy", sse_proxy)):
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                wrk(wrk_bin, url, stream, args.sse_connections, 2, args.threads)
                sse[name] = wrk(wrk_bin, url, stream, args.sse_connections, args.duration, args.threads)
                print(f"sse {name:<7} {sse[name]['rps']:>7.1f} streams/s ({sse[name]['rps'] * 1000:,.0f} chunks/s)"
                      f"  p50 {sse[name]['p50_ms']:7.1f} ms  p99 {sse[name]['p99_ms']:7.1f} ms", flush=True)
            figures["sse"] = sse
        finally:
            started.stop()

    bad = [f"{part} {name}: {r['non_2xx']}" for part in ("short", "sse")
           for name, r in figures.get(part, {}).items() if r["non_2xx"]]
    print()
    s = figures["short"]
    ratios = {"proxy_vs_direct_rps": s["proxy"]["rps"] / s["direct"]["rps"],
              "proxy_p99_added_ms": s["proxy"]["p99_ms"] - s["direct"]["p99_ms"],
              "sse_proxy_vs_direct": figures["sse"]["proxy"]["rps"] / figures["sse"]["direct"]["rps"]}
    if "nginx" in s:
        ratios.update(proxy_vs_nginx_rps=s["proxy"]["rps"] / s["nginx"]["rps"],
                      nginx_vs_direct_rps=s["nginx"]["rps"] / s["direct"]["rps"],
                      nginx_p99_added_ms=s["nginx"]["p99_ms"] - s["direct"]["p99_ms"])
    figures["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    print(f"proxy / direct requests/s: {ratios['proxy_vs_direct_rps']:.2f}")
    if "nginx" in s:
        print(f"proxy / nginx  requests/s: {ratios['proxy_vs_nginx_rps']:.2f}   (target >= 0.45)")
        print(f"nginx / direct requests/s: {ratios['nginx_vs_direct_rps']:.2f}")
        print(f"p99 added by nginx: {ratios['nginx_p99_added_ms']:+.2f} ms")
    print(f"p99 added by the proxy: {ratios['proxy_p99_added_ms']:+.2f} ms   (target <= 5 ms at 64 connections)")
    print(f"SSE proxy / direct streams/s: {ratios['sse_proxy_vs_direct']:.2f}   (target >= 0.80)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    if bad:
        print(f"non-2xx responses: {', '.join(bad)}: the figures above are not to be trusted", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
