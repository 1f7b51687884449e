#!/usr/bin/env python3
"""Swap the front to nginx and back while N clients keep sending; print failed requests and the gaps.

    .venv/bin/python scripts/swap_under_load.py --host local [--clients 32] [--keepalive] [--hold-s 2]

The host must be deployed (proxy front). Each client sends short chat completions back to back, on one
keep-alive connection (--keepalive, as SDK clients do) or a new connection per request. A failed request
is counted and never retried; the client waits FAIL_PAUSE_S (about one short request's time) before its
next one, so a refused port is not counted thousands of times a second.
"""
from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAIL_PAUSE_S = 0.05
sys.path.insert(0, str(ROOT))


class Load:
    """N client threads sending chat completions to 127.0.0.1:port until stopped; every outcome counted."""

    def __init__(self, port: int, model: str, clients: int = 32, keepalive: bool = False, max_tokens: int = 4,
                 stream: bool = False):
        self.port, self.clients, self.keepalive, self.stream = port, clients, keepalive, stream
        self.request = {"model": model, "max_tokens": max_tokens, "stream": stream,
                        "messages": [{"role": "user", "content": "hi"}]}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()     # "ok nginx", "ok proxy", "refused", "status 503", ...
        self.failures: list[tuple[float, str]] = []   # (monotonic time, outcome) of each failed request
        # (trace id, outcome, monotonic time) of every request: its trace id is its `user` and X-Request-Id
        self.records: list[tuple[str, str, float]] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _client(self) -> None:
        conn = None
        while not self.stop.is_set():
            trace = uuid.uuid4().hex
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                headers = {"Content-Type": "application/json", "X-Request-Id": trace}
                if not self.keepalive:
                    headers["Connection"] = "close"
                conn.request("POST", "/v1/chat/completions", json.dumps({**self.request, "user": trace}), headers)
                r = conn.getresponse()
                body = r.read()
                front = "nginx" if r.getheader("X-Front") == "nginx" else "proxy"
                outcome = f"ok {front}" if r.status == 200 else f"status {r.status} {front}"
                if r.status == 200 and self.stream and b"data: [DONE]" not in body:
                    outcome = "broken stream"
                if not self.keepalive or r.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except ConnectionRefusedError:
                outcome = "refused"
                conn = None
            except (OSError, http.client.HTTPException) as e:
                outcome = type(e).__name__
                if conn is not None:
                    conn.close()
                conn = None
            with self.lock:
                self.records.append((trace, outcome, time.monotonic()))
                self.outcomes[outcome] += 1
                if not outcome.startswith("ok "):
                    self.failures.append((time.monotonic(), outcome))
            if not outcome.startswith("ok "):
                time.sleep(FAIL_PAUSE_S)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=35)

    @property
    def failed(self) -> int:
        return sum(n for k, n in self.outcomes.items() if not k.startswith("ok "))

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())


def inv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="local")
    ap.add_argument("-i", "--inventory", default="")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--keepalive", action="store_true")
    ap.add_argument("--hold-s", type=float, default=2.0)
    args = ap.parse_args()
    from fleet.settings import inventory
    inv_args = ["--inventory", args.inventory] if args.inventory else []
    hv = inventory.load(args.inventory or None).host_vars(args.host)
    with Load(hv.settings.proxy.port, hv.served_model().name, args.clients, args.keepalive) as load:
        time.sleep(args.hold_s)
        t_a = time.monotonic()
        a = inv("swap-to-nginx", "--host", args.host, *inv_args)
        time.sleep(args.hold_s)
        t_b = time.monotonic()
        b = inv("swap-to-proxy", "--host", args.host, *inv_args)
        time.sleep(args.hold_s)
    for r, what in ((a, "swap-to-nginx"), (b, "swap-to-proxy")):
        line = next((x for x in r.stdout.splitlines() if "refused connections for at most" in x), r.stderr.strip())
        print(f"{what}: exit {r.returncode}: {line.strip()}")
    print(f"clients={args.clients} keepalive={args.keepalive} requests={load.total} failed={load.failed}")
    for what, t0, t1 in (("to nginx", t_a, t_b), ("to proxy", t_b, float("inf"))):
        during = Counter(o for t, o in load.failures if t0 <= t < t1)
        print(f"failed in the swap {what}: {sum(during.values())} " + str(dict(during)))
    print("outcomes: " + ", ".join(f"{k}={n}" for k, n in sorted(load.outcomes.items())))
    return 0 if a.returncode == b.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
