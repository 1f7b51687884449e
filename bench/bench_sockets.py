"""Client sockets under careless and hostile callers (issue 37, part 2): half-open connections and streams
that are never read, each beside a polite client and a /health watcher, on the proxy and on nginx.

    .venv/bin/python bench/bench_sockets.py [--half-open 5000] [--non-readers 8] [--nofile 1024:1024]
                                            [--send-timeout-s 5] [--seconds 10] [--fronts proxy,nginx]
                                            [--set KEY=VALUE ...] [--out FILE.json]

The fleet: 2 sims x max_num_seqs 4 (8 slots), 20 ms a token. Each front runs under `prlimit --nofile=SOFT:HARD`
(a login shell's 1,024 open files by default, hard limit the same, so the bound on connections is what keeps
the front serving; with a higher hard limit the proxy raises its soft limit to it at start).

0. alone: the polite client and the watcher by themselves for 5 s, the figures the cases compare with.
1. half-open: --half-open connections that send half a request head and wait, kept open for --seconds (those
   the front closed are opened again every second, as an attacker would); meanwhile a polite client sends a short chat every
   0.5 s on a new connection and a watcher reads /health every 50 ms. Targets: >= 99% of the polite requests
   served, /health 200 throughout.
2. non-readers: --non-readers streaming chats with long answers from sockets that never read (SO_RCVBUF 1 KiB),
   enough to take every slot; the polite client as above. Targets: its worst latency <= send_timeout_s + 1 s,
   and the slots come back (the proxy's admin: nothing in flight once the non-readers are cut).

bench/bench_hostile.py runs the whole table of hostile and careless callers (these two among them) with clients of its own.
Every process it starts is stopped by pid.
"""
from __future__ import annotations

import argparse
import http.client
import json
import resource
import selectors
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from stack import Stack, find_program, wait_http  # noqa: E402

HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: fleet\r\nContent-Type: application/json\r\n"
POLITE_BODY = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})


def raise_own_nofile(need: int) -> None:
    """This process needs `need` sockets: its soft open-file limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def stream_request(body: dict, host: str = "fleet") -> bytes:
    """A whole POST /v1/chat/completions with body."""
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


class HalfOpen:
    """n connections that each send half a request head and wait; run(seconds) keeps n open (one the front
    closed is opened again) and counts how many the front closed."""

    REOPEN_S = 1.0

    def __init__(self, host: str, port: int, n: int):
        self.addr, self.n = (host, port), n
        self.sel = selectors.DefaultSelector()
        self.closed_by_front = 0
        self.failed_connects = 0

    def _open_one(self) -> None:
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(self.addr)
            s.sendall(HALF_HEAD)
        except OSError:
            self.failed_connects += 1
            s.close()
            return
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ)

    def run(self, seconds: float, stop: threading.Event | None = None) -> None:
        """Keep n open for seconds: every REOPEN_S, the ones the front closed are opened again."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (stop and stop.is_set()):
            while len(self.sel.get_map()) < self.n and time.monotonic() < end:
                self._open_one()
            round_end = min(end, time.monotonic() + self.REOPEN_S)
            while time.monotonic() < round_end:
                for key, _ in self.sel.select(timeout=max(0.0, round_end - time.monotonic())):
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self.closed_by_front += 1
        self.close()

    @property
    def open(self) -> int:
        return len(self.sel.get_map())

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
            key.fileobj.close()


class NonReaders:
    """n streaming chats with long answers from sockets that never read; cut_after() says, for each, how long
    after its request its connection was closed by the front (None: still open)."""

    def __init__(self, host: str, port: int, n: int, max_tokens: int = 20000, rcvbuf: int = 1024):
        self.socks, self.sent = [], []
        for _ in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            s.connect((host, port))
            s.sendall(stream_request({"model": "m", "stream": True, "max_tokens": max_tokens,
                                      "messages": [{"role": "user", "content": "tell me everything"}]}))
            self.socks.append(s)
            self.sent.append(time.monotonic())

    def cut(self) -> list[bool]:
        """Whether the front closed each connection (a reset, or an end after the unread bytes: peeked
        without taking them off the socket's buffer, which would let the stream go on)."""
        out = []
        for s in self.socks:
            try:
                s.setblocking(False)
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
                out.append(info[0] != 1)   # tcpi_state: 1 is ESTABLISHED
            except OSError:
                out.append(True)
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close()


class Polite:
    """A short chat every interval_s on a new connection; latencies (s) of each and failures."""

    def __init__(self, host: str, port: int, interval_s: float = 0.5, timeout_s: float = 120):
        self.addr, self.interval, self.timeout = (host, port), interval_s, timeout_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> None:
        t0 = time.monotonic()
        try:
            c = http.client.HTTPConnection(*self.addr, timeout=self.timeout)
            c.request("POST", "/v1/chat/completions", POLITE_BODY, {"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            c.close()
            if r.status != 200:
                self.failures.append(f"status {r.status}")
                return
        except (OSError, http.client.HTTPException) as e:
            self.failures.append(f"{type(e).__name__}: {e}")
            return
        self.latencies.append(time.monotonic() - t0)

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            self._one()
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def start(self) -> Polite:
        self.thread.start()
        return self

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        n = len(self.latencies) + len(self.failures)
        return {"sent": n, "served": len(self.latencies), "failed": len(self.failures),
                "served_ratio": round(len(self.latencies) / n, 4) if n else None,
                "worst_s": round(max(self.latencies), 3) if self.latencies else None,
                "failures": self.failures[:5]}


class HealthWatch:
    """GET /health every interval_s on a new connection: the worst answer time and every miss (not 200)."""

    def __init__(self, host: str, port: int, interval_s: float = 0.05, timeout_s: float = 5):
        self.poll = Polite(host, port, interval_s, timeout_s)
        self.poll._one = self._one
        self.worst, self.misses, self.checks = 0.0, [], 0

    def _one(self) -> None:
        t0 = time.monotonic()
        try:
            c = http.client.HTTPConnection(*self.poll.addr, timeout=self.poll.timeout)
            c.request("GET", "/health")
            status = c.getresponse().status
            c.close()
        except (OSError, http.client.HTTPException) as e:
            status = f"{type(e).__name__}"
        self.checks += 1
        self.worst = max(self.worst, time.monotonic() - t0)
        if status != 200:
            self.misses.append(status)

    def start(self) -> HealthWatch:
        self.poll.start()
        return self

    def finish(self) -> dict:
        self.poll.stop.set()
        self.poll.thread.join()
        return {"checks": self.checks, "not_200": len(self.misses), "worst_ms": round(self.worst * 1000, 1),
                "misses": [str(m) for m in self.misses[:5]]}


def in_flight(stack: Stack, front: str) -> int | None:
    """Requests the proxy front holds slots for (None for nginx)."""
    if front == "nginx":
        return None
    c = http.client.HTTPConnection("127.0.0.1", stack.admin_ports[front], timeout=5)
    c.request("GET", "/admin/backends")
    return sum(b["in_flight"] for b in json.loads(c.getresponse().read()))


def case_alone(port: int, seconds: float) -> dict:
    """The polite client and the watcher with no one else: what the cases compare with."""
    polite, health = Polite("127.0.0.1", port).start(), HealthWatch("127.0.0.1", port).start()
    time.sleep(seconds)
    return {"polite": polite.finish(), "health": health.finish()}


def case_half_open(port: int, n: int, seconds: float) -> dict:
    flood = HalfOpen("127.0.0.1", port, n)
    polite, health = Polite("127.0.0.1", port).start(), HealthWatch("127.0.0.1", port).start()
    flood.run(seconds)
    return {"half_open": n, "closed_by_front": flood.closed_by_front, "failed_connects": flood.failed_connects,
            "polite": polite.finish(), "health": health.finish()}


def case_non_readers(stack: Stack, front: str, port: int, n: int, send_timeout_s: float, seconds: float) -> dict:
    polite = Polite("127.0.0.1", port).start()
    readers = NonReaders("127.0.0.1", port, n)
    t0 = time.monotonic()
    deadline = t0 + max(seconds, 2 * send_timeout_s + 5)   # one queued behind a polite request comes later
    while not all(readers.cut()) and time.monotonic() < deadline:
        time.sleep(0.1)
    cut_s = round(time.monotonic() - t0, 2)
    time.sleep(max(0.0, seconds - cut_s))
    left = in_flight(stack, front)
    out = {"non_readers": n, "cut": sum(readers.cut()), "all_cut_within_s": cut_s, "in_flight_after": left,
           "polite": polite.finish(), "target_worst_s": send_timeout_s + 1}
    readers.close()
    return out


def start_front(stack: Stack, front: str, nofile: str) -> int:
    """Start front under prlimit; its port."""
    prlimit = shutil.which("prlimit")
    if front == "nginx":
        nginx = find_program("nginx")
        conf = stack.deploy / "conf" / "nginx.conf"
        import subprocess
        subprocess.run([prlimit, f"--nofile={nofile}", "--", nginx, "-p", str(stack.deploy), "-c", str(conf)],
                       check=True)
        stack.nginx_pid_file = stack.deploy / "run" / "nginx.master.pid"
    else:
        p = stack._start([prlimit, f"--nofile={nofile}", "--", sys.executable, "-m", "proxy", "--config",
                          str(stack.deploy / "conf" / f"{front}.yaml")], f"{front}.log", cwd=ROOT)
        stack.pids[front] = p.pid
    wait_http(stack.url(front) + "/health")
    return stack.ports[front]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--half-open", type=int, default=5000)
    ap.add_argument("--non-readers", type=int, default=8)
    ap.add_argument("--nofile", default="1024:1024", help="SOFT:HARD open-file limits the front starts with")
    ap.add_argument("--send-timeout-s", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--fronts", default="proxy,nginx")
    ap.add_argument("--set", action="append", default=[], help="an inventory override, KEY=VALUE (repeatable)")
    ap.add_argument("--out")
    args = ap.parse_args()
    raise_own_nofile(args.half_open)
    work = Path(tempfile.mkdtemp(prefix="bench_sockets."))
    stack = Stack(work, backends=2, max_num_seqs=4, sim_args=["--sim-prefill-ms", "20", "--sim-token-ms", "20",
                                                              "--sim-output-tokens", "20000"],
                  proxy_set=(f"proxy.client.send_timeout_s={args.send_timeout_s:g}", *args.set))
    results = {"nofile": args.nofile, "send_timeout_s": args.send_timeout_s, "set": args.set}
    try:
        stack.start([])
        for front in args.fronts.split(","):
            if front == "nginx" and not find_program("nginx"):
                print("bench: nginx left out: not installed", file=sys.stderr)
                continue
            port = start_front(stack, front, args.nofile)
            results[front] = {"alone": case_alone(port, min(args.seconds, 5)),
                              "half_open": case_half_open(port, args.half_open, args.seconds),
                              "non_readers": case_non_readers(stack, front, port, args.non_readers,
                                                              args.send_timeout_s, args.seconds)}
            print(json.dumps({front: results[front]}), flush=True)
    finally:
        stack.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
