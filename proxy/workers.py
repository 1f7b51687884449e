"""Several worker processes on the entry port (proxy.workers > 1): the supervisor that starts them, the
lending of idle slots between them, and the one admin port and /metrics they answer as.

The supervisor (`python -m proxy` itself) binds the entry port's socket once and starts N workers that
inherit it; the first worker ready (its first round of health checks done) listens on it, and each accepts
from the same queue, whoever is free first. The port's reuseport group holds one socket per proxy, as with
one process, so a zero-gap restart steers connections exactly as it does for one (proxy/listener.py). It passes SIGHUP, SIGTERM and SIGINT to every worker, and when one exits
on its own it stops the others and exits with its status (the host agent restarts the proxy).

Prefix routing is shared: at the event loop's turn after a decision each worker sends the others its new
routing decisions (LEARN: a prompt's block hashes and the backend it went to, proxy/share.py's feed between
processes, adopted and not passed on), so each worker's index knows where every worker sent a prompt and a conversation's next
round finds its home whichever worker accepts it; the supervisor gives the workers one PYTHONHASHSEED so
their block hashes agree.

Slots are owned, never shared. Worker w owns a part of every backend's slots (proxy/share.py's split,
equal weights; with entries behind virtual addresses, a part of this entry's share): it counts and queues
only its own requests against that part, on its own event loop, with no lock. A worker whose request must
wait tells the others over Unix datagram sockets (WANT: its queue's length and the pool's backends); a
worker with idle slots, or whose queue is shorter, lowers its own part first and then sends the slots
(GIVE); the receiver raises its part and serves its first waiter. Every part is written by its owner
alone and a slot in transit is in no part, so the parts never add up to more than the slots: never more
requests on an engine than its slots, across workers, at any moment. A GIVE that cannot be sent is taken
back at once.

One proxy to the operator: every worker serves its admin application on a Unix socket of the run
directory; worker 0 holds the admin port and answers it for all (reload, a backend's drain, drain-and-exit
reach every worker; /admin/backends and /admin/requests are merged), and any worker answers the public
/metrics with every worker's series summed (the state gauges: their largest), so dashboards, `inv top`
and the keeper read what one process would have published.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from .share import FEED_LIMIT, split

log = logging.getLogger("proxy")

WANT_EVERY_S = 0.001   # a pool's WANT goes out at most this often (each waiter queued asks otherwise)
WANT_FOR_S = 0.05      # a WANT not renewed in this long is forgotten (its worker's queue emptied)
SINCE_SENT = 32        # a WANT tells when its pool's first this many waiters began waiting
RENEW_S = 0.02         # while a pool has waiters, its WANT goes out again this often (its queue's length now)
ASK_TIMEOUT_S = 5.0    # one worker's admin answer to worker 0's fan-out
TEACH_S = 0.5          # and at least this often (a policy made anew by a reload starts its feed)
TEACH_BLOCKS = 1500    # block hashes of one prompt in a message (~20 bytes each in JSON)
TEACH_BYTES = 60000    # a message's length at most: a worker reads 65,536 bytes of a datagram
STATE_GAUGES = frozenset({"proxy_backend_healthy", "proxy_backend_drained", "proxy_backend_slots",
                          "proxy_backend_model", "proxy_tenant_weight", "proxy_event_loop_lag_worst_seconds"})


def lend_path(run_dir: str, w: int) -> str:
    return os.path.join(run_dir, f"lend-{w}.sock")


def admin_path(run_dir: str, w: int) -> str:
    return os.path.join(run_dir, f"admin-{w}.sock")


# --- the supervisor ------------------------------------------------------------------------------------

def supervise(config, argv: list[str], count: int, bind) -> int:
    """Bind the entry port (bind(): the listening socket; OSError when taken), start `count` workers of
    `python -m proxy` with argv and the socket, pass signals on, and wait; the exit status is the workers'."""
    sock = bind()
    run_dir = tempfile.mkdtemp(prefix="proxy-workers-")
    workers: list[subprocess.Popen] = []
    stopping = False

    def pass_on(signum, _frame):
        nonlocal stopping
        stopping = stopping or signum in (signal.SIGTERM, signal.SIGINT)
        for p in workers:
            if p.poll() is None:
                p.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, pass_on)
    # One string hash for all the workers: their prefix block hashes must agree for one to learn where
    # another sent a prompt (the rendered start script sets the deployment's; a manual start gets one here).
    env = dict(os.environ)
    if env.get("PYTHONHASHSEED", "random") == "random":
        env["PYTHONHASHSEED"] = str(int.from_bytes(os.urandom(4), "big") % 4294967295 + 1)
    try:
        for w in range(count):
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "proxy", *argv, "--worker", f"{w}/{count}", "--run-dir", run_dir,
                 "--listen-fd", str(sock.fileno()), "--supervisor", str(os.getpid())], pass_fds=(sock.fileno(),),
                env=env))
        sock.close()      # the workers hold it now: it closes when the last of them leaves the port
        log.info("%d workers (pids %s) on port %d", count, ", ".join(str(p.pid) for p in workers),
                 config.listen.port)
        status = 0
        while workers:
            for p in list(workers):
                code = p.poll()
                if code is None:
                    continue
                workers.remove(p)
                status = status or code
                if not stopping:
                    log.error("proxy: worker pid %d exited (status %s) unasked; stopping the others", p.pid, code)
                    stopping = True
                    status = status or 1
                    for q in workers:
                        q.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        return status
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


def follow_supervisor(pid: int) -> None:
    """Have the kernel send this worker SIGTERM when its supervisor dies, however it dies (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != pid:      # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def parse_worker(value: str) -> tuple[int, int]:
    """--worker W/N."""
    w, n = (int(x) for x in value.split("/"))
    return w, n


# --- lending slots -------------------------------------------------------------------------------------

class Lending:
    """This worker's part of every backend's slots, and the messages that move idle slots between workers.

    net[backend]: slots received less slots given; a backend's part is split(slots, N)[me] + net (None:
    a backend without a slot limit). A WANT from worker x is kept ([x's queue's length, its pool's backends,
    when it came, when x's first waiters began waiting]) until it is met or WANT_FOR_S passes."""

    def __init__(self, run_dir: str, me: int, count: int):
        self.run_dir, self.me, self.count = run_dir, me, count
        self.net: dict[str, int] = {}
        self.wants: dict[int, list] = {}          # worker -> [queue length, backend names, when, waiters' since]
        self._asked: dict[int, float] = {}        # id(pool) -> when its last WANT went out
        self._soon: dict[int, asyncio.TimerHandle] = {}   # id(pool) -> its next WANT, a new waiter's
        self._renew: dict[int, asyncio.TimerHandle] = {}  # id(pool) -> its WANT again, while it has waiters
        self.router = None                        # the worker's proxy.models.Router, once it is made
        self.taught: dict[str, int] = {}          # pool -> the last of its decisions sent (their numbers only grow)
        self.learned = 0                          # the other workers' prefix decisions adopted here
        self._teaching: asyncio.TimerHandle | None = None   # the next _teach by the clock
        self._teach_soon = False                  # a _teach is due at the loop's next turn
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(lend_path(run_dir, me))
        self.sock.setblocking(False)

    def start(self, router) -> None:
        self.router = router
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self._read)
        self._teach()       # the pools keep their feeds from the first request on

    def decided(self) -> None:
        """A pool that shares its routing sent a request: teach the others at the loop's next turn (the
        decisions of one turn in one message), not at the next TEACH_S, so that a prompt of the same
        conversation or group that another worker routes a moment later finds it."""
        if not self._teach_soon:
            self._teach_soon = True
            asyncio.get_running_loop().call_soon(self._teach)

    def _teach(self) -> None:
        """Send the other workers this worker's prefix routing decisions since the last time (LEARN: the
        prompt's block hashes and the backend), at the loop's turn after a decision and every TEACH_S: each
        worker's index then knows where every worker sent a prompt, so a conversation's next round finds its
        home whichever worker accepts it. A worker adopts what it learns and does not pass it on
        (proxy/share.py's feed, between processes)."""
        if self._teaching is not None:
            self._teaching.cancel()
        self._teach_soon = False
        try:
            for name, pool in self.router.pools.items():
                if not pool.shares_routing:
                    continue
                pool.keep_feed()      # a policy made anew by a reload starts its feed here
                got = pool.decisions_since(self.taught.get(name, 0), FEED_LIMIT)
                if not got:
                    continue
                self.taught[name] = got[-1][0]
                for message in lessons(name, [(backend, blocks) for _, backend, blocks in got]):
                    for w in range(self.count):
                        if w != self.me:
                            self._send(w, message)
        finally:
            self._teaching = asyncio.get_running_loop().call_later(TEACH_S, self._teach)

    # the balancer's calls (proxy/balancer.py)

    def shares(self, pool) -> None:
        """Set each of pool's backends' part (its slots changed, or it is new)."""
        for b in pool.backends.values():
            # Below 0 when a reload lowered the slots under what this worker had lent: it owes, and takes
            # no slot until the slots it lent come back (clamped at 0, the parts would add up to more).
            b.share = None if not b.slots else split(b.slots, [1] * self.count)[self.me] + self.net.get(b.name, 0)

    def waiting(self, pool) -> None:
        """A request of pool must wait: ask the others for slots, at once or, within WANT_EVERY_S of the
        last WANT, at its end; then again every RENEW_S while the pool has waiters."""
        if id(pool) in self._soon:
            return
        wait = self._asked.get(id(pool), 0.0) + WANT_EVERY_S - time.monotonic()
        if wait > 0:
            self._soon[id(pool)] = asyncio.get_running_loop().call_later(wait, self._ask, pool)
        else:
            self._ask(pool)

    def _ask(self, pool) -> None:
        for timers in (self._soon, self._renew):
            t = timers.pop(id(pool), None)
            if t is not None:
                t.cancel()
        if not pool.queued:
            return
        self._asked[id(pool)] = time.monotonic()
        self._renew[id(pool)] = asyncio.get_running_loop().call_later(RENEW_S, self._ask, pool)
        message = json.dumps({"t": "want", "from": self.me, "n": pool.queued, "since": pool.waiting_since(SINCE_SENT),
                              "b": [b.name for b in pool.backends.values() if b.available and b.share is not None]})
        for w in range(self.count):
            if w != self.me:
                self._send(w, message)

    def freed(self, pool, backend) -> bool:
        """A slot of backend came free here: True when it went to another worker, whose waiter has waited
        longer than this worker's first (any of its waiters, when none waits here): one queue, oldest first,
        as far as the workers know of each other."""
        if not self.wants or backend.share is None or not backend.available or backend.in_flight >= backend.share:
            return False
        now = time.monotonic()
        mine = pool.waiting_since(1)
        best, oldest = None, mine[0] if mine else math.inf
        for w, want in list(self.wants.items()):
            if now - want[2] > WANT_FOR_S or want[0] <= 0:
                del self.wants[w]
            elif backend.name in want[1]:
                theirs = want[3][0] if want[3] else (math.inf if mine else now)
                if theirs < oldest:
                    best, oldest = w, theirs
        return best is not None and self._give(best, backend, 1) == 1

    # messages

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                m = json.loads(data)
            except ValueError:
                continue
            if m.get("t") == "give":
                self._got(m["b"], int(m["k"]))
            elif m.get("t") == "learn":
                pool = self.router.pools.get(m.get("pool")) if self.router is not None else None
                if pool is not None and pool.shares_routing:
                    for backend, blocks in m.get("d", ()):
                        pool.adopt(backend, blocks)
                        self.learned += 1
            elif m.get("t") == "want":
                self.wants[int(m["from"])] = [int(m["n"]), set(m["b"]), time.monotonic(),
                                              collections.deque(m.get("since", ()))]
                self._lend_idle(int(m["from"]))

    def _got(self, name: str, k: int) -> None:
        """k slots of backend `name` came from another worker: its part grows, its first waiters are served."""
        self.net[name] = self.net.get(name, 0) + k
        b = self.router.backends.get(name) if self.router is not None else None
        if b is not None and b.share is not None:
            b.share += k
            self.router.pool(b).dispatch()

    def _lend_idle(self, w: int) -> None:
        """Worker w waits: give it this worker's idle slots of its pool (none of a pool with waiters of its
        own: those take its freed slots, oldest first), up to w's queue's length."""
        want = self.wants[w]
        for name in want[1]:
            if want[0] <= 0:
                break
            b = self.router.backends.get(name) if self.router is not None else None
            if b is None or b.share is None or not b.available:
                continue
            idle = b.share - b.in_flight
            if idle <= 0 or self.router.pool(b).queued:
                continue
            self._give(w, b, min(idle, want[0]))

    def _give(self, w: int, b, k: int) -> int:
        """Give k idle slots of b to worker w: the part lowered first, then the message; taken back when
        the message cannot go. The slots given."""
        b.share -= k
        self.net[b.name] = self.net.get(b.name, 0) - k
        if not self._send(w, json.dumps({"t": "give", "from": self.me, "b": b.name, "k": k})):
            b.share += k
            self.net[b.name] += k
            return 0
        want = self.wants.get(w)
        if want is not None:
            want[0] -= k
            for _ in range(min(k, len(want[3]))):
                want[3].popleft()
        return k

    def _send(self, w: int, message: str) -> bool:
        try:
            self.sock.sendto(message.encode(), lend_path(self.run_dir, w))
            return True
        except OSError:      # not up yet, gone, or its buffer full
            return False


def lessons(pool: str, decisions: list[tuple[str, list[int]]]) -> list[str]:
    """LEARN messages of a pool's decisions ([backend, blocks]), each at most TEACH_BYTES long (what a worker
    reads of a datagram at once) and TEACH_BLOCKS block hashes (a longer prompt's first ones: its prefix,
    what a next round would match)."""
    head = '{"t":"learn","pool":%s,"d":[' % json.dumps(pool)
    out, batch, size = [], [], len(head) + 2
    for backend, blocks in decisions:
        part = json.dumps([backend, blocks[:TEACH_BLOCKS]], separators=(",", ":"))
        if batch and size + len(part) + 1 > TEACH_BYTES:
            out.append(head + ",".join(batch) + "]}")
            batch, size = [], len(head) + 2
        batch.append(part)
        size += len(part) + 1
    if batch:
        out.append(head + ",".join(batch) + "]}")
    return out


# --- one proxy to the operator ---------------------------------------------------------------------------

class Peers:
    """Worker 0's (or any worker's, for /metrics) way to the workers' admin applications on their Unix sockets."""

    def __init__(self, run_dir: str, count: int):
        self.run_dir, self.count = run_dir, count
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def session(self, w: int) -> aiohttp.ClientSession:
        s = self._sessions.get(w)
        if s is None or s.closed:
            s = self._sessions[w] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=admin_path(self.run_dir, w)),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=ASK_TIMEOUT_S))
        return s

    async def ask(self, w: int, method: str, path: str, body: bytes = b"", timeout: float | None = ASK_TIMEOUT_S):
        """(status, body bytes) of worker w's admin answer; (None, reason) when it did not answer. A worker
        whose admin socket is not there yet (it is starting) is asked again until ASK_TIMEOUT_S."""
        deadline = time.monotonic() + ASK_TIMEOUT_S
        while True:
            try:
                async with self.session(w).request(method, "http://worker" + path, data=body or None,
                                                   headers={"Content-Type": "application/json"} if body else None,
                                                   timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    return r.status, await r.read()
            except aiohttp.ClientConnectorError as e:
                if time.monotonic() > deadline:
                    return None, f"worker {w}: {type(e).__name__}: {e}".encode()
                await asyncio.sleep(0.05)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                return None, f"worker {w}: {type(e).__name__}: {e}".encode()

    async def ask_all(self, method: str, path: str, body: bytes = b"", timeout: float | None = ASK_TIMEOUT_S):
        return await asyncio.gather(*(self.ask(w, method, path, body, timeout) for w in range(self.count)))

    async def metrics(self) -> bytes:
        """Every worker's /metrics, summed (proxy/workers.py's module docstring)."""
        answers = await self.ask_all("GET", "/admin/worker-metrics")
        return merged_metrics([a[1].decode() for a in answers if a[0] == 200])

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()


def merged_metrics(texts: list[str]) -> bytes:
    """Prometheus texts of the workers as one: each sample summed over the workers, a state gauge's their
    largest value; the counters' _created samples left out."""
    families: dict[str, list] = {}       # name -> [type, help, {(sample name, labels): value}]
    for text in texts:
        for fam in text_string_to_metric_families(text):
            f = families.setdefault(fam.name, [fam.type, fam.documentation, {}])
            keep_max = fam.name in STATE_GAUGES
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                old = f[2].get(key)
                f[2][key] = s.value if old is None else (max(old, s.value) if keep_max else old + s.value)
    out = []
    for name, (kind, doc, samples) in families.items():
        if not samples:
            continue
        out.append(f"# HELP {name} {_escape(doc, help_text=True)}\n# TYPE {name} {kind}\n")
        for (sample, labels), value in samples.items():
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            out.append(f"{sample}{{{inner}}} {floatToGoString(value)}\n" if inner
                       else f"{sample} {floatToGoString(value)}\n")
    return "".join(out).encode()


def _escape(text: str, help_text: bool = False) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text if help_text else text.replace('"', '\\"')


def front_admin(peers: Peers, supervisor_pid: int) -> web.Application:
    """Worker 0's admin port: every worker's admin application as one."""
    app = web.Application()

    async def every(request: web.Request) -> web.Response:
        body = await request.read()
        path = request.path_qs
        if request.method == "POST" and request.path == "/admin/drain-and-exit":
            answers = await peers.ask_all("POST", path, body, timeout=None)
            return _drained(answers, supervisor_pid)
        answers = await peers.ask_all(request.method, path, body)
        first = answers[0]
        if first[0] is None:
            return web.json_response({"error": first[1].decode()}, status=502)
        if request.method == "GET" and request.path == "/admin/backends" and first[0] == 200:
            return web.json_response(_backends([json.loads(a[1]) for a in answers if a[0] == 200]))
        if request.method == "GET" and request.path == "/admin/requests" and first[0] == 200:
            return web.json_response([r for a in answers if a[0] == 200 for r in json.loads(a[1])])
        if request.method == "GET" and request.path == "/admin/config" and first[0] == 200:
            config = json.loads(first[1])
            every = [json.loads(a[1]) for a in answers if a[0] == 200]
            config["queued"] = sum(c.get("queued", 0) for c in every)
            config["learned_from_workers"] = sum(c.get("learned_from_workers", 0) for c in every)
            for i, pool in enumerate(config.get("models") or ()):
                pool["queued"] = sum(c["models"][i]["queued"] for c in every if len(c.get("models") or ()) > i)
            config["workers"] = peers.count
            return web.json_response(config)
        if request.method == "POST":    # reload, a backend's drain or enable, refresh-models: all of them must
            bad = [a for a in answers if a[0] is None or a[0] >= 300]
            if bad:
                return web.Response(body=bad[0][1], status=bad[0][0] or 502, content_type="application/json")
        return web.Response(body=first[1], status=first[0], content_type="application/json")

    app.router.add_route("*", "/{tail:.*}", every)
    return app


def _backends(lists: list[list[dict]]) -> list[dict]:
    """/admin/backends of every worker as one: in flight and peaks summed, the rest worker 0's."""
    merged = {b["name"]: dict(b) for b in lists[0]}
    for other in lists[1:]:
        for b in other:
            m = merged.get(b["name"])
            if m is not None:
                m["in_flight"] += b["in_flight"]
                m["peak_in_flight"] += b["peak_in_flight"]
    return list(merged.values())


def _drained(answers: list, supervisor_pid: int) -> web.Response:
    """Every worker's drain-and-exit answer as one."""
    done = [json.loads(a[1]) for a in answers if a[0] == 200]
    if not done:
        status, body = answers[0]
        return web.Response(body=body, status=status or 502, content_type="application/json")
    return web.json_response({"pid": supervisor_pid, "in_flight_at_start": sum(d["in_flight_at_start"] for d in done),
                              "waited_s": max(d["waited_s"] for d in done), "bound_s": done[0]["bound_s"],
                              "cut": [c for d in done for c in d["cut"]], "workers": len(answers),
                              "workers_answered": len(done)})


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

