"""Hostile and careless callers beside a polite one, on the proxy and on nginx mode: what each costs the others.

    .venv/bin/python bench/bench_hostile.py [--quick] [--fronts proxy,nginx] [--cases alone,a,b,c,d,e]
        [--hold 20] [--set proxy.client.send_timeout_s=10 ...] [--out FILE.json]

The fleet: 2 sims x max_num_seqs 4 behind the front, API keys on, two tenants with a key each
(`app`, `batch`). The front's files are rendered from an inventory by fleet's own render (bench/stack.py),
with `--set` overrides passed to it as `inv deploy --set` would: settings added later (`proxy.client.*`,
`proxy.limits.*`) come in with their defaults, unchanged here; a key the schema does not know is refused
with its message. Each front is started with a soft open-file limit of 1,024 (`--front-nofile`), a login
shell's; this script raises its own to the hard limit.

Beside each case, in a process of its own: a polite client (tenant `app`) sending a short chat (not
streamed, max_tokens 8) every 0.5 s, each on a new connection, and a watcher asking `/health` every 50 ms
(on a new connection each, as a keepalived check does). A case runs for --lead seconds of polite load, then
the attack for --hold seconds (a and b: until their answers came, if later), then --tail seconds more; the
front is restarted before each case, so each starts from the same state.

    alone  the polite client and the watcher alone (the reference of the latency ratios)
    a      one 8 MB chat body (tenant batch) whose `content` is a list of 4,000,000 parts `0`
    b      MiniCPM-V-like requests (tenant batch), four 1.5 MB base64 images each, --b-requests in a row
    c      --c-conns connections (3,000 and 5,000) that send half a request head and hold it
    d      --d-streams streaming requests of the polite client's own tenant from sockets that never read
           (SO_RCVBUF 4 KiB, answers of --d-tokens tokens), held --hold-d (default: --hold, or the rendered
           proxy.client.send_timeout_s + 5 s when longer); then whether their slots come back
    e      a chat body of JSON nested 100,000 deep; a request line with an absolute URL

Figures, per case and front: polite requests sent / failed (not 200, or no answer within
--polite-timeout), their p50 and worst latency (a failed request at the time it failed) and the worst as a
ratio of `alone`'s; the watcher's worst gap (the longest time without any answer to /health: 50 ms and a
little more when all is well) and its non-200 answers (errors and timeouts counted), with how many of them
were asked once the attack had ended (does the front come back?); the same gap seen by a second watcher on
one kept-alive connection (no wait in the listen queue: what the event loop itself answers); the proxy's own
worst event-loop lag (proxy_event_loop_lag_worst_seconds, read at the case's end); the front's
RSS before / peak / after (VmRSS of the proxy, summed over nginx's workers; sampled every 100 ms); the
case's own statuses. Slots "come back" once the sims run or queue at most one request (the polite client's).
Every process it starts is stopped by pid at the end, Ctrl-C included. One pass of both fronts takes about
6 minutes (--quick: about 3.5); the polite client's timeout and a stalled front can add to that, within
bounds (--polite-timeout, --attack-timeout).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import errno
import json
import multiprocessing
import os
import re
import resource
import selectors
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostagent import nginx_front  # noqa: E402
from stack import TENANT_KEY, Stack, end_pid  # noqa: E402

BACKENDS, MAX_NUM_SEQS = 2, 4
POLITE, OTHER = "app", "batch"   # the polite client's tenant; the other caller's
CHAT = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello there"}]}
HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
QUICK = {"hold": 8.0, "alone": 5.0, "hold_e": 3.0, "polite_timeout": 30.0, "settle": 5.0, "tail": 2.0}


# --- the polite client and the watcher (in a process of their own) -----------------------------------------

def observe(conn, url: str, key: str, every: float, health_every: float, timeout: float, stop) -> None:
    """Run the polite client and the /health watcher until `stop` is set; send their records on conn."""
    conn.send(asyncio.run(_observe(conn, url, key, every, health_every, timeout, stop)))


async def _observe(conn, url, key, every, health_every, timeout, stop) -> dict:
    import aiohttp
    polite: list[tuple[float, float, object]] = []    # (sent at, seconds, status or error)
    health: list[tuple[float, float | None, object]] = []
    kept: list[tuple[float, float | None, object]] = []   # the same, on one kept-alive connection
    limit = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as one:
        async def ask(at: float) -> None:
            status: object = None
            try:
                async with s.post(url + "/v1/chat/completions", json=CHAT, timeout=limit,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.read()
                    status = r.status
            except asyncio.TimeoutError:
                status = "timeout"
            except (aiohttp.ClientError, OSError) as e:
                status = type(e).__name__
            polite.append((at, time.monotonic() - at, status))

        async def watch(session, records) -> None:
            while True:
                at = time.monotonic()
                try:
                    async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                        await r.read()
                        records.append((at, time.monotonic(), r.status))
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    records.append((at, None, type(e).__name__))
                await asyncio.sleep(max(0.0, at + health_every - time.monotonic()))

        start = time.monotonic()
        watchers = [asyncio.create_task(watch(s, health)), asyncio.create_task(watch(one, kept))]
        conn.send("ready")
        tasks, n = [], 0
        while not stop.is_set():
            if time.monotonic() >= start + n * every:
                tasks.append(asyncio.create_task(ask(time.monotonic())))
                n += 1
            await asyncio.sleep(0.01)
        end = time.monotonic()
        for w in watchers:
            w.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)   # each bounded by its own timeout
    return {"start": start, "end": end, "polite": polite, "health": health, "kept": kept}


class Observer:
    """The observe() process of one case: started, then finished with its records."""

    def __init__(self, url: str, key: str, args):
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=observe, daemon=True,
                                args=(child, url, key, args.polite_every, args.health_every, args.polite_timeout,
                                      self.stop))
        self.proc.start()
        self.timeout = args.polite_timeout + 15
        if not self.conn.poll(60) or self.conn.recv() != "ready":
            self.kill()
            raise SystemExit("bench: the polite client did not start within 60 s.")

    def finish(self) -> dict:
        self.stop.set()
        if not self.conn.poll(self.timeout):
            self.kill()
            raise SystemExit("bench: the polite client did not report in time.")
        out = self.conn.recv()
        self.proc.join(10)
        return out

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()   # by its pid
        self.proc.join(5)


# --- the front's memory ---------------------------------------------------------------------------------

def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def front_pids(stack: Stack, front: str) -> list[int]:
    """The proxy's pid; nginx's workers (the master's children)."""
    if front != "nginx":
        return [stack.pids[front]]
    return sorted(nginx_front.workers(stack.nginx_pid()))


class RssSampler(threading.Thread):
    """The front's RSS every 100 ms until stopped: the peak."""

    def __init__(self, pids: list[int]):
        super().__init__(daemon=True)
        self.pids, self.peak, self.done = pids, rss_mb(pids), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.peak = max(self.peak, rss_mb(self.pids))


# --- the callers ----------------------------------------------------------------------------------------

def request_bytes(port: int, body: bytes, key: str, target: str = "/v1/chat/completions") -> bytes:
    return (f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body


def exchange(port: int, data: bytes, timeout: float) -> object:
    """Send data on a new connection; the answer's status, or what went wrong instead."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            try:
                s.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass   # the front may answer (413) and close before the body is all sent: read its answer
            head = b""
            while b"\r\n" not in head and len(head) < 8192:
                chunk = s.recv(8192)
                if not chunk:
                    break
                head += chunk
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return errno.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__
    return _status(head)


def in_a_row(ctx, data: bytes, n: int) -> tuple[list, list[float]]:
    """Send data n times, each when the one before was answered, then wait for the hold's end: the statuses
    and the seconds each took."""
    statuses, took = [], []
    for _ in range(n):
        t = time.monotonic()
        statuses.append(exchange(ctx.port, data, ctx.args.attack_timeout))
        took.append(time.monotonic() - t)
    ctx.sleep_until_end()
    return statuses, took


def case_a(ctx) -> dict:
    """One (or --a-bodies) chat body of --a-parts content parts `0`: 8 MB at 4,000,000."""
    body = ('{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": ['
            + ",".join(["0"] * ctx.args.a_parts) + "]}]}").encode()
    data = request_bytes(ctx.port, body, TENANT_KEY.format(OTHER))
    statuses, took = in_a_row(ctx, data, ctx.args.a_bodies)
    return {"body_mb": len(body) / 1e6, "statuses": statuses, "answered_after_s": took,
            "text": f"{_counts(statuses)} after {max(took):.1f} s ({len(body) / 1e6:.1f} MB)"}


def image_chat(images: int, mb: float) -> bytes:
    raw = os.urandom(int(mb * 1e6 * 3 / 4))
    url = "data:image/jpeg;base64," + base64.b64encode(raw).decode()
    content = [{"type": "text", "text": "describe these pictures"}] + [
        {"type": "image_url", "image_url": {"url": url}} for _ in range(images)]
    return json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}).encode()


def case_b(ctx) -> dict:
    """--b-requests MiniCPM-V-like requests in a row, each of --b-images images of --b-image-mb MB."""
    data = request_bytes(ctx.port, image_chat(ctx.args.b_images, ctx.args.b_image_mb), TENANT_KEY.format(OTHER))
    statuses, took = in_a_row(ctx, data, ctx.args.b_requests)
    return {"statuses": statuses, "answered_after_s": took,
            "text": f"{_counts(statuses)}, each answered within {max(took) * 1000:.0f} ms"}


def half_open(port: int, n: int, until: float, reopen: bool = False) -> Counter:
    """n connections that send half a request head and hold it until `until` (monotonic); with reopen, those
    the front closed are opened again every second (as an attacker would). What became of them."""
    sel, seen = selectors.DefaultSelector(), Counter()
    try:
        _open_half(sel, port, n, seen)
        next_round = time.monotonic() + 1.0
        while (left := until - time.monotonic()) > 0:
            for key, _ in sel.select(min(left, 0.5)):
                _held_event(sel, key, seen)
            if reopen and time.monotonic() >= next_round:
                seen["reopened"] += n - len(sel.get_map())
                _open_half(sel, port, n - len(sel.get_map()), seen)
                next_round += 1.0
        seen["still connecting"] = sum(1 for k in sel.get_map().values() if k.data == "connecting")
        seen["held to the end"] = sum(1 for k in sel.get_map().values() if k.data == "held")
        return seen
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()


def _open_half(sel, port: int, n: int, seen: Counter) -> None:
    """Start n non-blocking connections; _held_event sends each its half head once connected."""
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            seen["connect failed"] += 1
            s.close()
            continue
        sel.register(s, selectors.EVENT_WRITE, "connecting")


def _held_event(sel, key, seen: Counter) -> None:
    s = key.fileobj
    if key.data == "connecting":
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            seen["connect failed"] += 1
            sel.unregister(s)
            s.close()
            return
        seen["connected"] += 1
        try:
            s.send(HALF_HEAD)
        except OSError:
            pass   # closed already: the read below says so
        sel.modify(s, selectors.EVENT_READ, "held")
        return
    try:
        data = s.recv(4096)
    except OSError:
        data = b""
    if data.startswith(b"HTTP/"):
        seen[f"answered {data.split(b' ', 2)[1].decode(errors='replace')}"] += 1
    if not data:
        seen["closed by the front"] += 1
        sel.unregister(s)
        s.close()


def case_c(ctx, n: int) -> dict:
    seen = half_open(ctx.port, n, ctx.hold_end, ctx.args.c_reopen)
    order = ("connected", "connect failed", "still connecting", "closed by the front", "reopened", "held to the end")
    text = ", ".join(f"{seen[k]} {k}" for k in order if seen[k]) + "".join(
        f", {v} {k}" for k, v in sorted(seen.items()) if k.startswith("answered"))
    return {"connections": n, "seen": dict(seen), "text": f"{n} half heads: {text}"}


def case_d(ctx) -> dict:
    """--d-streams streams of the polite tenant that never read; at the end of the hold, the slots they hold,
    then (sockets closed) how long until the slots come back."""
    body = json.dumps({"model": "m", "stream": True, "max_tokens": ctx.args.d_tokens,
                       "messages": [{"role": "user", "content": "tell me a long story"}]}).encode()
    data = request_bytes(ctx.port, body, TENANT_KEY.format(POLITE))
    socks, failed = [], Counter()
    try:
        for _ in range(ctx.args.d_streams):
            s = socket.socket()
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, ctx.args.d_rcvbuf)
            s.settimeout(5)
            try:
                s.connect(("127.0.0.1", ctx.port))
                s.sendall(data)
            except OSError as e:
                failed[type(e).__name__] += 1
        ctx.sleep_until_end()
        held = ctx.slots_in_use()
        statuses = [_drain(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    back = ctx.slots_back()
    cut = sum(1 for _, c in statuses if c)
    return {"statuses": [st for st, _ in statuses], "cut_by_front": cut, "connect_failed": dict(failed),
            "slots_at_end_of_hold": held, "slots_back_after_s": back,
            "text": (f"{_counts([st for st, _ in statuses])}, {cut} cut by the front; at the end of the hold "
                     f"the sims held {held['sims']} requests{_proxy_in_flight(held)}; after close "
                     + (f"slots back in {back:.1f} s" if back is not None
                        else f"not back within {ctx.args.settle:g} s"))}


def _proxy_in_flight(held: dict) -> str:
    return f" (proxy in_flight {held['proxy']})" if held.get("proxy") is not None else ""


def _drain(s: socket.socket) -> tuple[object, bool]:
    """A never-reading socket's answer status, and whether the front closed it (read what it holds, 2 MB at most)."""
    s.setblocking(False)
    head, got = b"", 0
    try:
        while got < 2 << 20:
            chunk = s.recv(65536)
            if not chunk:
                return _status(head), True
            head = head or chunk[:64]
            got += len(chunk)
    except BlockingIOError:
        pass
    except OSError:
        return _status(head), True
    return _status(head), False


def _status(head: bytes) -> object:
    """The status of an answer's first bytes; "no answer" when they are none or not HTTP."""
    parts = head.split(b" ", 2)
    return int(parts[1]) if head.startswith(b"HTTP/") and len(parts) > 1 and parts[1].isdigit() else "no answer"


def case_e(ctx) -> dict:
    depth = 100_000
    nested = ('{"model": "m", "max_tokens": 8, "messages": ' + "[" * depth + "]" * depth + "}").encode()
    key = TENANT_KEY.format(OTHER)
    got = {"nested_100000": exchange(ctx.port, request_bytes(ctx.port, nested, key), ctx.args.attack_timeout),
           "absolute_url": exchange(ctx.port, request_bytes(ctx.port, json.dumps(CHAT).encode(), key,
                                    target=f"http://127.0.0.1:{ctx.port}/v1/chat/completions"),
                                    ctx.args.attack_timeout)}
    ctx.sleep_until_end()
    return {"statuses": got, "text": f"nested {got['nested_100000']}, absolute URL {got['absolute_url']}"}


def _counts(statuses: list) -> str:
    return ", ".join(f"{n}x {s}" for s, n in Counter(map(str, statuses)).most_common())


# --- one case -------------------------------------------------------------------------------------------

class Case:
    """What a caller needs while its case runs: the front's port, the hold's end, the slots in use."""

    def __init__(self, stack: Stack, front: str, args, hold: float):
        self.stack, self.front, self.args = stack, front, args
        self.port = int(stack.url(front).rsplit(":", 1)[1])
        self.hold_end = time.monotonic() + hold

    def sleep_until_end(self) -> None:
        time.sleep(max(0.0, self.hold_end - time.monotonic()))

    def slots_in_use(self) -> dict:
        """Requests the sims run or queue; the proxy's in_flight (None for nginx)."""
        sims = sum(s["running"] + s["waiting"] for s in self.stack.sim_stats())
        proxy = None
        if self.front != "nginx":
            with urllib.request.urlopen(self.stack.admin_url(self.front) + "/admin/backends", timeout=5) as r:
                proxy = sum(b["in_flight"] for b in json.loads(r.read()))
        return {"sims": sims, "proxy": proxy}

    def slots_back(self) -> float | None:
        """Seconds until the sims hold at most one request (the polite client's), None past --settle."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.args.settle:
            if self.stack_quiet():
                return time.monotonic() - t0
            time.sleep(0.1)
        return None

    def stack_quiet(self) -> bool:
        use = self.slots_in_use()
        return use["sims"] <= 1 and (use["proxy"] is None or use["proxy"] <= 1)


def run_case(stack: Stack, front: str, name: str, args) -> dict:
    """Polite load for --lead s, the case for its hold, --tail s more; the figures of it all."""
    pids = front_pids(stack, front)
    rss = RssSampler(pids)
    rss.start()
    before = rss.peak
    obs = Observer(stack.url(front), TENANT_KEY.format(POLITE), args)
    try:
        time.sleep(args.lead)
        own = attack(name, Case(stack, front, args, hold_of(name, args)))
        ended = time.monotonic()
        time.sleep(args.tail)
        seen = obs.finish()
    finally:
        obs.kill()
        rss.done.set()
        rss.join()
    return {"front": front, "case": name, **polite_figures(seen), **health_figures(seen, ended),
            "loop_lag_worst_s": loop_lag(stack, front),
            "rss_mb": {"before": before, "peak": rss.peak, "after": rss_mb(pids)}, "own": own}


def _alone(ctx) -> dict:
    ctx.sleep_until_end()
    return {"text": "-"}


def attack(name: str, ctx) -> dict:
    """Run case `name` (alone, a, b, cN: N connections, d, e) against ctx's front."""
    if name[0] == "c":
        return case_c(ctx, int(name[1:]))
    return {"alone": _alone, "a": case_a, "b": case_b, "d": case_d, "e": case_e}[name](ctx)


def hold_of(name: str, args) -> float:
    return {"alone": args.alone, "d": args.hold_d, "e": args.hold_e}.get(name, args.hold)


def polite_figures(seen: dict) -> dict:
    lat = [t for _, t, _ in seen["polite"]]
    failed = Counter(str(s) for _, _, s in seen["polite"] if s != 200)
    return {"polite_sent": len(lat), "polite_failed": sum(failed.values()), "polite_failures": dict(failed),
            "polite_p50_s": statistics.median(lat) if lat else float("nan"),
            "polite_worst_s": max(lat) if lat else float("nan")}


def worst_gap(seen: dict, records: list) -> float:
    """The longest time a watcher went without an answer (of any status), from the start to the end."""
    answered = sorted(done for _, done, _ in records if done is not None)
    marks = [seen["start"], *answered, max(seen["end"], answered[-1] if answered else seen["end"])]
    return max(b - a for a, b in zip(marks, marks[1:]))


def health_figures(seen: dict, ended: float) -> dict:
    """The longest time the watcher went without an answer (of any status), on new connections and on one
    kept alive; its answers not 200, and those of them asked once the attack had ended (at `ended`,
    monotonic): does the front come back?"""
    return {"health_asked": len(seen["health"]), "health_worst_gap_s": worst_gap(seen, seen["health"]),
            "kept_worst_gap_s": worst_gap(seen, seen["kept"]),
            "kept_errors": sum(1 for _, done, _ in seen["kept"] if done is None),
            "health_non_200": sum(1 for _, _, s in seen["health"] if s != 200),
            "health_non_200_after": sum(1 for at, _, s in seen["health"] if s != 200 and at >= ended)}


def loop_lag(stack: Stack, front: str) -> float | None:
    """The proxy's own worst event-loop lag since it started (proxy_event_loop_lag_worst_seconds); None
    for nginx, or a proxy that does not say."""
    if front == "nginx":
        return None
    try:
        with urllib.request.urlopen(stack.url(front) + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    found = re.search(r"^proxy_event_loop_lag_worst_seconds (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


# --- the run --------------------------------------------------------------------------------------------

NORMAL = {"hold": 20.0, "alone": 10.0, "hold_e": 5.0, "polite_timeout": 60.0, "settle": 10.0, "tail": 3.0}


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter holds: " + ", ".join(
        f"--{k.replace('_', '-')} {v:g}" for k, v in QUICK.items()))
    ap.add_argument("--fronts", default="proxy,nginx")
    ap.add_argument("--cases", default="alone,a,b,c,d,e", help="alone is measured first whatever the order")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an inventory override, as `inv deploy --set` (repeatable)")
    for name, what in (("hold", f"seconds each attack lasts ({NORMAL['hold']:g})"),
                       ("hold-d", "case d's hold (default: --hold, or proxy.client.send_timeout_s + 5 when longer)"),
                       ("hold-e", f"case e's hold ({NORMAL['hold_e']:g})"),
                       ("alone", f"seconds of the polite client alone ({NORMAL['alone']:g})"),
                       ("tail", f"seconds of polite load after each attack ({NORMAL['tail']:g})"),
                       ("polite-timeout", f"a polite request's time limit ({NORMAL['polite_timeout']:g})"),
                       ("settle", f"how long case d waits for the slots to come back ({NORMAL['settle']:g})")):
        ap.add_argument("--" + name, type=float, help=what)
    ap.add_argument("--lead", type=float, default=2.0, help="seconds of polite load before each attack")
    ap.add_argument("--polite-every", type=float, default=0.5)
    ap.add_argument("--health-every", type=float, default=0.05)
    ap.add_argument("--a-parts", type=int, default=4_000_000)
    ap.add_argument("--a-bodies", type=int, default=1)
    ap.add_argument("--b-requests", type=int, default=5)
    ap.add_argument("--b-images", type=int, default=4)
    ap.add_argument("--b-image-mb", type=float, default=1.5, help="base64 size of each image")
    ap.add_argument("--c-conns", default="3000,5000", help="connections of case c, one run each")
    ap.add_argument("--c-reopen", action="store_true",
                    help="case c opens again, every second, the connections the front closed")
    ap.add_argument("--d-streams", type=int, default=8)
    ap.add_argument("--d-tokens", type=int, default=20_000, help="max_tokens of case d (2 ms a token)")
    ap.add_argument("--d-rcvbuf", type=int, default=4096, help="SO_RCVBUF of case d's sockets")
    ap.add_argument("--front-nofile", default="1024", metavar="SOFT[:HARD]",
                    help="the fronts' open-file limits (default: a soft 1024, the hard limit as it is)")
    ap.add_argument("--attack-timeout", type=float, default=120.0, help="the longest a or b waits for an answer")
    ap.add_argument("--out", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else NORMAL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def hold_d(args, stack: Stack) -> float:
    """Case d's hold: --hold-d; else --hold, or the rendered send timeout (proxy.client.send_timeout_s) and
    5 s more when longer, so a front that cuts stalled streams has the time to."""
    if args.hold_d is not None:
        return args.hold_d
    import yaml
    conf = yaml.safe_load((stack.deploy / "conf" / "proxy.yaml").read_text())
    send = (conf.get("client") or {}).get("send_timeout_s")
    return max(args.hold, send + 5) if isinstance(send, (int, float)) else args.hold


def case_names(args) -> list[str]:
    out = ["alone"]
    for c in args.cases.split(","):
        if c == "c":
            out += [f"c{int(n)}" for n in args.c_conns.split(",")]
        elif c in ("a", "b", "d", "e"):
            out.append(c)
        elif c != "alone":
            raise SystemExit(f"error: unknown case {c!r}; cases are alone, a, b, c, d, e.")
    return out


def front_names(args) -> list[str]:
    fronts = args.fronts.split(",")
    for f in fronts:
        if f != "nginx" and f not in Stack.PROXIES:
            raise SystemExit(f"error: unknown front {f!r}; fronts are nginx and the proxies of bench/stack.py "
                             f"({', '.join(Stack.PROXIES)}).")
    return fronts


def nofile(limits: str):
    """A preexec setting the open-file limits `SOFT[:HARD]` (HARD: this process's hard limit when not given)."""
    try:
        soft, _, hard = limits.partition(":")
        soft_n, hard_n = int(soft), int(hard) if hard else resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    except ValueError:
        raise SystemExit(f"error: --front-nofile {limits!r} is not SOFT or SOFT:HARD (numbers).") from None

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft_n, hard_n))
    return lower


def interrupted(signum, frame):
    raise KeyboardInterrupt   # SIGTERM ends the run as Ctrl-C does: through the finally that stops every process


def main(argv=None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, interrupted)
    names, fronts = case_names(args), front_names(args)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    most = max((int(n[1:]) for n in names if n[0] == "c"), default=0)
    if hard != resource.RLIM_INFINITY and hard < most + 256:
        print(f"error: case c needs {most + 256} open files and the hard limit is {hard}; lower --c-conns.",
              file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        stack = make_stack(Path(tmp), args)
        if stack is None:
            return 2
        args.hold_d = hold_d(args, stack)
        print(f"{BACKENDS} sims x max_num_seqs {MAX_NUM_SEQS}, keys and tenants {POLITE}/{OTHER}; fronts at an "
              f"open-file limit of {args.front_nofile}; holds {args.hold:g} s (d {args.hold_d:g} s, e {args.hold_e:g} s), "
              f"alone {args.alone:g} s; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
        try:
            fronts = stack.start(fronts)
            for front in fronts:
                for i, name in enumerate(names):
                    if i:
                        stack.restart(front)   # each case from a fresh front
                    results.append(run_case(stack, front, name, args))
                    print_line(results[-1], results)
        finally:
            if stack.nginx_pid_file and stack.nginx_pid_file.exists():
                end_pid(stack.nginx_pid())
            stack.stop()
    report(results)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "skipped": stack.skipped, "cases": results},
                                             indent=2, default=str))
    return 0


def make_stack(work: Path, args) -> Stack | None:
    """The sims and fronts rendered from an inventory with keys, tenants and --set; None (said) when refused."""
    from fleet.errors import FleetError
    from hostagent import apikeys, layout
    keys = work / "api_keys"
    keys.write_text(f"{TENANT_KEY.format(POLITE)} {POLITE}\n{TENANT_KEY.format(OTHER)} {OTHER}\n")
    sets = (f"proxy.api_keys_file={keys}", f"proxy.tenants={{{POLITE}: {{}}, {OTHER}: {{}}}}", *args.set)
    sim_args = ["--sim-overhead-ms", "20", "--sim-prefill-ms", "0", "--sim-token-ms", "2",
                "--sim-output-tokens", str(args.d_tokens)]
    try:
        stack = Stack(work, BACKENDS, MAX_NUM_SEQS, sim_args, proxy_set=sets, front_preexec=nofile(args.front_nofile))
    except FleetError as e:
        print(f"error: the inventory refused the settings ({' '.join(args.set) or 'no --set'}): {e}", file=sys.stderr)
        return None
    # nginx mode's key map, as hostagent writes it on a host
    apikeys.write(layout.path(str(stack.deploy), layout.NGINX_KEYS), str(keys))
    return stack


def alone_worst(results: list[dict], front: str) -> float | None:
    return next((r["polite_worst_s"] for r in results if r["front"] == front and r["case"] == "alone"), None)


def row(r: dict, results: list[dict]) -> list[str]:
    base = alone_worst(results, r["front"])
    m = r["rss_mb"]
    return [r["front"], r["case"], f"{r['polite_sent']} / {r['polite_failed']}", f"{r['polite_p50_s'] * 1000:.0f}",
            f"{r['polite_worst_s'] * 1000:.0f}", f"{r['polite_worst_s'] / base:.1f}x" if base else "",
            f"{r['health_worst_gap_s'] * 1000:.0f}", _kept(r), _lag(r),
            f"{r['health_non_200']} ({r['health_non_200_after']} after)",
            f"{m['before']:.0f} / {m['peak']:.0f} / {m['after']:.0f}", r["own"]["text"]]


def _kept(r: dict) -> str:
    return f"{r['kept_worst_gap_s'] * 1000:.0f}" + (f" ({r['kept_errors']} errors)" if r["kept_errors"] else "")


def _lag(r: dict) -> str:
    return "-" if r["loop_lag_worst_s"] is None else f"{r['loop_lag_worst_s'] * 1000:.0f}"


HEAD = ["front", "case", "polite sent / failed", "p50 ms", "worst ms", "worst / alone", "/health worst gap ms",
        "kept-alive /health worst gap ms", "loop lag worst ms",
        "/health non-200 (asked after the attack)", "RSS MB before / peak / after", "the case's own"]


def print_line(r: dict, results: list[dict]) -> None:
    print("  " + " | ".join(row(r, results)) + (f"  (polite failures: {r['polite_failures']})"
                                               if r["polite_failures"] else ""), flush=True)


def report(results: list[dict]) -> None:
    print("\n| " + " | ".join(HEAD) + " |\n|" + "---|" * len(HEAD))
    for r in results:
        print("| " + " | ".join(row(r, results)) + " |")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench: interrupted; every process it started is stopped.", file=sys.stderr)
        sys.exit(130)
