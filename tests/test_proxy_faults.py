"""The proxy under the faults the best routers handle, with real sim engines and real load.

Every test drives a real proxy process over real sim processes on loopback; loads are bounded in time.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass

import aiohttp
import pytest
import yaml

from conftest import wait_until
from proxy_helpers import start_proxy, start_sims

pytestmark = pytest.mark.process


def chat(max_tokens=20, stream=False, **extra) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "describe the image"}], **extra}


@dataclass
class Result:
    start: float
    end: float
    status: int          # 0: the connection failed; -1: a 200 whose answer broke off
    backend: str | None
    retries: int
    error: str | None = None


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> Result:
    t = time.monotonic()
    backend, retries, status = None, 0, 0
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            backend, retries = r.headers.get("X-Backend"), int(r.headers.get("X-Retries", "0"))
            status = -1 if r.status == 200 else r.status   # a 200 counts once its answer is whole
            data = b""
            async for chunk in r.content.iter_any():
                data += chunk
            ok = r.status == 200 and (not body.get("stream") or data.rstrip().endswith(b"[DONE]"))
            return Result(t, time.monotonic(), 200 if ok else status, backend, retries,
                          None if ok else data[-300:].decode("utf-8", "replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        # The connection broke: before the headers (status 0) or mid-answer (-1, headers known).
        return Result(t, time.monotonic(), status, backend, retries, repr(e))


async def load(url: str, clients: int, seconds: float, body: dict, *events, results=None) -> list[Result]:
    """clients loops sending body until seconds have passed and the events are done; events run alongside
    (faults, drains, reloads). results: the list the answers go to as they end (an event may read it)."""
    deadline = time.monotonic() + seconds
    results = [] if results is None else results
    events_done = asyncio.Event()

    async def client(session):
        while time.monotonic() < deadline or not events_done.is_set():
            results.append(await one(session, url, body))

    async def run_events():
        try:
            await asyncio.gather(*events)
        finally:
            events_done.set()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(client(s) for _ in range(clients)), run_events())
    return results


async def until(predicate, what: str) -> None:
    """wait_until from inside the load's event loop (predicate runs in a thread and may block)."""
    await asyncio.to_thread(wait_until, predicate, what=what)


async def backends(admin: int) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{admin}/admin/backends") as r:
            return {b["name"]: b for b in await r.json()}


def name(port: int) -> str:
    return f"127.0.0.1:{port}"


def results_log(tmp_path) -> list[dict]:
    path = tmp_path / "req_results.log"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.xdist_group("load")
def test_sigkill_of_a_backend_under_load_fails_only_its_streams(procs, tmp_path):
    """1. 32 clients stream through 4 backends.  2. One backend's API server gets SIGKILL mid-load.
    3. Only the streams already running on it may fail; every request started after the kill
    succeeds elsewhere (queued ones that had no answer yet are retried)."""
    ports = start_sims(procs, tmp_path, 4, token_ms=10)
    port, admin = start_proxy(procs, tmp_path, ports)
    victim, at_kill, results = procs.started[0], {}, []

    def in_flight_on_0() -> int:
        return asyncio.run(backends(admin))[name(ports[0])]["in_flight"]

    async def kill():
        await until(lambda: in_flight_on_0() > 0, "streams running on backend 0")
        at_kill["in_flight"] = (await backends(admin))[name(ports[0])]["in_flight"]
        at_kill["t"] = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        await until(lambda: sum(r.start > at_kill["t"] + 0.05 for r in list(results)) >= 32,
                    "32 answers to requests sent after the kill")

    asyncio.run(load(f"http://127.0.0.1:{port}", 32, 0, chat(stream=True), kill(), results=results))
    failed = [r for r in results if r.status != 200]
    # The kill hit a backend with streams running (a count, not a throughput floor: a busy machine
    # serves fewer requests, which says nothing about this test).
    assert at_kill["in_flight"] > 0
    # the ones that failed were streams on backend 0 sent before the kill (the in-flight count read just
    # before the kill can be passed by streams it took in between, so it is no bound)
    assert all(r.backend == name(ports[0]) and r.start < at_kill["t"] for r in failed), failed
    late = [r for r in results if r.start > at_kill["t"] + 0.05]
    assert late and all(r.status == 200 and r.backend != name(ports[0]) for r in late)
    state = asyncio.run(backends(admin))[name(ports[0])]
    assert not state["healthy"] and state["in_flight"] == 0


@pytest.mark.xdist_group("load")
def test_engine_death_under_load_is_taken_out(procs, tmp_path):
    """1. 16 clients over 2 backends.  2. Backend 0's engine dies: its /health turns 503 while
    /v1/models stays 200, and it answers 500.  3. max_fails 500s or the next health check take it
    out; from then on every request succeeds on backend 1."""
    ports = start_sims(procs, tmp_path, 2, token_ms=5)
    port, admin = start_proxy(procs, tmp_path, ports, max_fails=3)
    at, results = {}, []

    def backend_0() -> dict:
        return asyncio.run(backends(admin))[name(ports[0])]

    async def die():
        await until(lambda: backend_0()["in_flight"] > 0, "requests in flight on backend 0")
        async with aiohttp.ClientSession() as s:
            await s.post(f"http://127.0.0.1:{ports[0]}/sim/fault", json={"fault": "engine-death"})
        # max_fails 500s or the next health check (every 0.3 s) take it out
        await until(lambda: not backend_0()["healthy"], "backend 0 taken out")
        at["out"] = time.monotonic()
        await until(lambda: sum(r.start > at["out"] for r in list(results)) >= 16,
                    "16 answers to requests sent after backend 0 was taken out")

    asyncio.run(load(f"http://127.0.0.1:{port}", 16, 0, chat(), die(), results=results))
    failed = [r for r in results if r.status != 200]
    assert {r.status for r in failed} <= {500}
    # nothing sent after the proxy took the dead engine out fails, and all of it goes to backend 1
    assert all(r.start < at["out"] for r in failed), failed
    assert all(r.status == 200 and r.backend == name(ports[1]) for r in results if r.start > at["out"])
    state = backend_0()
    assert not state["healthy"] and ("5xx" in state["last_error"] or "503" in state["last_error"])


class AbandoningClient:
    """A raw-socket client that goes away at a chosen point: mid-body, waiting, or mid-stream."""

    def __init__(self, port: int):
        self.port = port

    async def run(self, point: str, body: bytes) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        try:
            if point == "mid-body":
                writer.write(head + body[: len(body) // 2])
                await writer.drain()
                await asyncio.sleep(random.uniform(0, 0.05))
            else:
                writer.write(head + body)
                await writer.drain()
                if point == "waiting":
                    await asyncio.sleep(random.uniform(0, 0.08))
                else:  # mid-stream: after the headers and a few chunks
                    await reader.readuntil(b"\r\n\r\n")
                    await reader.read(random.randint(1, 600))
        finally:
            writer.transport.abort()   # a hard close, as a client that died


def test_abandoned_requests_leave_no_count_behind(procs, tmp_path):
    """1000 requests, 30% abandoned at random points (mid-body, waiting for an answer, mid-stream).
    Afterwards every backend's in-flight count is exactly 0 at the proxy, and the engines saw the
    aborts and have freed every slot."""
    ports = start_sims(procs, tmp_path, 4, token_ms=3)
    port, admin = start_proxy(procs, tmp_path, ports)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(7)
    plan = ["abandon" if rng.random() < 0.3 else "complete" for _ in range(1000)]
    body = json.dumps(chat(max_tokens=30, stream=True)).encode()
    raw = AbandoningClient(port)
    outcomes: list[int] = []

    async def run():
        sem = asyncio.Semaphore(48)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def go(kind):
                async with sem:
                    if kind == "abandon":
                        await raw.run(rng.choice(["mid-body", "waiting", "mid-stream"]), body)
                    else:
                        outcomes.append((await one(s, url, chat(max_tokens=30, stream=True))).status)
            await asyncio.gather(*(go(k) for k in plan))
    asyncio.run(run())
    assert outcomes.count(200) == plan.count("complete")

    def settled():
        state = asyncio.run(backends(admin))
        return all(b["in_flight"] == 0 for b in state.values()) and state
    state = wait_until(settled, timeout=10, what="every in-flight count back to 0")
    assert sum(b["peak_in_flight"] for b in state.values()) > 8

    def sims_idle():
        import urllib.request
        stats = [json.load(urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats")) for p in ports]
        return all(s["running"] == 0 and s["waiting"] == 0 for s in stats) and stats
    stats = wait_until(sims_idle, timeout=10, what="every sim slot free")
    assert sum(s["aborted_total"] for s in stats) > 0   # the engines saw the aborts


class FakeBackend:
    """A tiny HTTP backend on a thread, for faults a sim engine has no reason to make.

    mode "ok": /health 200. "503": POSTs answer 503. "break": POSTs start an SSE answer, send one
    chunk, and cut the connection. "linger": POSTs stream a whole SSE answer, `data: [DONE]` included,
    then hold the stream open LINGER_S before ending it (an engine slow to end its response).
    "blackhole": stop accepting, so a new connection times out.
    Every answer closes its connection, so the proxy never holds a kept-alive one.
    """

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.mode = "ok"
        self.posts = 0
        self.last_head = b""
        self._stop = False
        self._filler: socket.socket | None = None
        self._holed = threading.Event()   # set once the serving thread has stopped accepting
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return name(self.port)

    def blackhole(self) -> None:
        self.mode = "blackhole"
        assert self._holed.wait(5), "the fake backend did not stop accepting"
        self._filler = socket.create_connection(("127.0.0.1", self.port))  # fills the accept queue

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()
        if self._filler:
            self._filler.close()

    def _serve(self) -> None:
        while not self._stop:
            if self.mode == "blackhole":
                self._holed.set()
                time.sleep(0.05)
                continue
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self._answer(conn)
                except OSError:
                    pass

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            rest += conn.recv(65536)
        if head.startswith(b"GET /health"):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            return
        if head.startswith(b"GET "):       # /metrics (the proxy reads the KV cache's size): none here
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        self.posts += 1
        self.last_head = head
        if self.mode == "503":
            body = b'{"error": {"message": "fake overload", "code": 503}}'
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body[:16]))
            time.sleep(0.05)   # the body in two pieces: the proxy must keep all of it
            conn.sendall(body[16:])
        elif self.mode == "200":
            body = b'{"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        elif self.mode == "break":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            chunk = b'data: {"choices": [{"delta": {"content": "half"}}]}\n\n'
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.shutdown(socket.SHUT_RDWR)
        elif self.mode == "linger":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            events = [b'data: {"choices": [{"index": 0, "delta": {"content": "one"}}]}\n\n',
                      b'data: {"choices": [{"index": 0, "delta": {"content": " two"}, "finish_reason": "stop"}]}'
                      b'\n\ndata: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}\n\n'
                      b'data: [DONE]\n\n']
            for i, chunk in enumerate(events):
                if i:
                    time.sleep(0.3)   # the first chunk alone first: a client can leave between the two
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            time.sleep(LINGER_S)
            conn.sendall(b"0\r\n\r\n")


LINGER_S = 2


@pytest.fixture
def fakes():
    made: list[FakeBackend] = []

    def make():
        made.append(FakeBackend())
        return made[-1]
    yield make
    for f in made:
        f.close()


def test_retry_before_the_first_byte_and_never_after(procs, tmp_path, fakes):
    """1. A backend answering 503: the request goes on to the sim, X-Retries says 1, the results log
    holds both attempts.  2. A backend that cuts its stream after one chunk: the client sees the
    broken stream, and the request is NOT sent again (X-Retries 0, the sim gets nothing more)."""
    [sim] = start_sims(procs, tmp_path, 1)
    overloaded, breaking = fakes(), fakes()
    overloaded.mode, breaking.mode = "503", "ok"
    # resume off: the rule under test is the retry's (a cut stream's continuation: test_proxy_resume.py)
    port, admin = start_proxy(procs, tmp_path, [overloaded.name, name(sim), breaking.name], max_fails=100,
                              resume={"enabled": False})
    wait_until(lambda: all(b["healthy"] for b in asyncio.run(backends(admin)).values()), what="all healthy")
    url = f"http://127.0.0.1:{port}"
    breaking.mode = "break"

    async def run():
        async with aiohttp.ClientSession() as s:
            out = []
            for i in range(9):
                out.append(await one(s, url, chat(stream=True, user=f"r-{i}")))
            return out
    results = asyncio.run(run())
    broken = [r for r in results if r.backend == breaking.name]
    # The client sees a broken connection, not a cleanly ended (silently truncated) stream.
    assert broken and all(r.status == -1 and r.retries == 0 and "Payload" in r.error for r in broken), broken
    assert breaking.posts == len(broken)               # each broken stream was sent exactly once
    retried = [r for r in results if r.retries == 1]
    assert retried and all(r.status == 200 and r.backend == name(sim) for r in retried)
    assert overloaded.posts == len(retried)

    lines = wait_until(lambda: len(results_log(tmp_path)) >= len(results) + len(retried) and results_log(tmp_path),
                       what="every attempt logged")
    first = next(x for x in lines if x["backend"] == overloaded.name)
    assert first["status"] == 503 and not first["final"]
    assert first["error"] == '{"error": {"message": "fake overload", "code": 503}}'   # whole, not its first piece
    second = next(x for x in lines if x["request_id"] == first["request_id"] and x["final"])
    assert second["backend"] == name(sim) and second["status"] == 200 and second["retries"] == 1
    cut = next(x for x in lines if x["backend"] == breaking.name)
    assert cut["final"] and cut["retries"] == 0 and "interrupted" in cut["error"]


def test_a_client_that_leaves_after_done_was_served(procs, tmp_path, fakes):
    """Many SSE clients hang up once `data: [DONE]` reaches them, before the response's end (the bench
    did: the results log said 499 for answers it had whole). 1. A client that leaves after [DONE] while
    the engine holds the stream open: the results log says 200 with the answer's finish_reason and
    tokens, and no client abort is counted. 2. One that leaves after the first chunk: 499, "the client
    went away", one abort counted."""
    lingering = fakes()
    port, admin = start_proxy(procs, tmp_path, [lingering.name])
    wait_until(lambda: all(b["healthy"] for b in asyncio.run(backends(admin)).values()), what="healthy")
    lingering.mode = "linger"
    body = json.dumps(chat(stream=True)).encode()

    def leave_after(marker: bytes, rid: str) -> bytes:
        """Send a streamed request, read until marker, hang up; what was read."""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s" % (rid.encode(), len(body), body))
            got = b""
            while marker not in got:
                data = c.recv(65536)
                assert data, got
                got += data
            return got

    assert b"data: [DONE]" in leave_after(b"data: [DONE]", "whole")
    assert b"[DONE]" not in leave_after(b'"one"', "half")

    def logged():
        lines = {x["request_id"]: x for x in results_log(tmp_path) if x["final"]}
        return len(lines) == 2 and lines
    lines = wait_until(logged, timeout=LINGER_S * 4, what="both requests logged")
    assert lines["whole"]["status"] == 200 and lines["whole"]["stream"], lines["whole"]
    assert (lines["whole"]["finish_reason"], lines["whole"]["completion_tokens"]) == ("stop", 2), lines["whole"]
    assert lines["whole"]["error"] is None, lines["whole"]
    assert lines["half"]["status"] == 499 and lines["half"]["error"] == "the client went away", lines["half"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert f'proxy_client_aborts_total{{backend="{lingering.name}"}} 1.0' in text
    assert f'proxy_requests_total{{backend="{lingering.name}",status="200"}} 1.0' in text
    assert f'proxy_requests_total{{backend="{lingering.name}",status="499"}} 1.0' in text


def test_connect_timeout_is_504_and_refused_is_502(procs, tmp_path, fakes):
    """1. A healthy backend stops accepting: the next request waits connect_timeout_s, gets 504 with a
    JSON error, and the backend is out at once (the following request gets 503, no backend).
    2. A healthy backend whose port closes: 502 with a JSON error."""
    hole = fakes()
    port, admin = start_proxy(procs, tmp_path, [hole.name], connect_timeout_s=0.5,
                              health={"interval_s": 60, "timeout_s": 1})
    url = f"http://127.0.0.1:{port}"
    hole.blackhole()

    async def ask():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=chat()) as r:
                return r.status, await r.json(), None
    status, body, _ = asyncio.run(ask())
    # the backend's state below says it was the connect timeout (0.5 s) that ended the wait
    assert status == 504 and body["error"]["type"] == "upstream_timeout"
    state = asyncio.run(backends(admin))[hole.name]
    assert not state["healthy"] and state["ejections"] == 1 and "within 0.5s" in state["last_error"]
    assert asyncio.run(ask())[0] == 503

    gone, second = fakes(), tmp_path / "second"
    second.mkdir()
    port2, _ = start_proxy(procs, second, [gone.name], health={"interval_s": 60, "timeout_s": 1})
    gone.close()
    url = f"http://127.0.0.1:{port2}"
    status, body, _ = asyncio.run(ask())
    assert status == 502 and body["error"]["type"] == "upstream_error" and "cannot connect" in body["error"]["message"]


@pytest.mark.xdist_group("load")
def test_drain_under_load_fails_nothing(procs, tmp_path):
    """1. 16 clients over 2 backends; backend 0 has requests in flight.  2. Drain backend 0: its in-flight
    requests finish (it reaches 0 in flight), and the requests sent meanwhile all go to backend 1.
    3. Enable it: it takes requests again.  Zero failed requests throughout."""
    ports = start_sims(procs, tmp_path, 2, token_ms=5)
    port, admin = start_proxy(procs, tmp_path, ports)
    marks, results = {}, []

    def in_flight_on_0() -> int:
        return asyncio.run(backends(admin))[name(ports[0])]["in_flight"]

    def answered_after(mark: str, backend: int) -> bool:
        return any(r.start > marks[mark] and r.backend == name(ports[backend]) for r in list(results))

    async def drain_then_enable():
        async with aiohttp.ClientSession() as s:
            await until(lambda: in_flight_on_0() > 0, "requests in flight on backend 0")
            await s.post(f"http://127.0.0.1:{admin}/admin/backends/{name(ports[0])}/drain")
            marks["drained"] = time.monotonic()
            await until(lambda: in_flight_on_0() == 0, "backend 0 drained to 0 in flight")
            await until(lambda: answered_after("drained", 1), "an answer by backend 1 sent after the drain")
            await s.post(f"http://127.0.0.1:{admin}/admin/backends/{name(ports[0])}/enable")
            marks["enabled"] = time.monotonic()
            await until(lambda: answered_after("enabled", 0), "an answer by backend 0 after the enable")

    asyncio.run(load(f"http://127.0.0.1:{port}", 16, 0, chat(), drain_then_enable(), results=results))
    assert [r for r in results if r.status != 200] == []
    during = [r for r in results if marks["drained"] < r.start and r.end < marks["enabled"]]
    assert during and all(r.backend == name(ports[1]) for r in during)


@pytest.mark.xdist_group("load")
def test_sighup_adds_and_removes_backends_under_load(procs, tmp_path):
    """1. The proxy fronts backends 0 and 1 under 16 clients.  2. Its config is rewritten to 1 and 2
    and it gets SIGHUP: nothing fails, 2 takes requests, 0 gets none after.  3. A broken config and
    SIGHUP: refused with a logged reason, the proxy keeps serving with what it had."""
    ports = start_sims(procs, tmp_path, 3, token_ms=5)
    port, admin = start_proxy(procs, tmp_path, ports[:2])
    proxy = procs.started[-1]
    conf_path = tmp_path / "proxy.yaml"
    marks = {}

    def reloaded():
        state = asyncio.run(backends(admin))
        return list(state) == [name(p) for p in ports[1:]] and state[name(ports[2])]["healthy"]

    async def reload():
        await asyncio.sleep(0.6)
        conf = yaml.safe_load(conf_path.read_text())
        conf["backends"] = [name(p) for p in ports[1:]]
        conf_path.write_text(yaml.safe_dump(conf))
        proxy.send_signal(signal.SIGHUP)
        # the new backend's first /health runs right after the reload
        await asyncio.to_thread(wait_until, reloaded, what="the reload with backend 2 healthy")
        marks["settled"] = time.monotonic()

    results = asyncio.run(load(f"http://127.0.0.1:{port}", 16, 3.0, chat(), reload()))
    assert [r for r in results if r.status != 200] == []
    after = [r for r in results if r.start > marks["settled"]]
    assert after and name(ports[0]) not in {r.backend for r in after}
    assert name(ports[2]) in {r.backend for r in after}
    assert list(asyncio.run(backends(admin))) == [name(p) for p in ports[1:]]

    conf_path.write_text("backends: [not a backend\n")
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload refused" in (tmp_path / "proxy.log").read_text(), what="the refusal logged")
    assert list(asyncio.run(backends(admin))) == [name(p) for p in ports[1:]]
    assert asyncio.run(load(f"http://127.0.0.1:{port}", 2, 0.3, chat()))[0].status == 200


def test_sigterm_lets_requests_in_flight_finish(procs, tmp_path):
    """1. 8 requests of about 2 s each are in flight.  2. The proxy gets SIGTERM: it stops accepting
    at once, while all 8 still run.  3. All 8 complete with their full answer, and the proxy exits 0."""
    ports = start_sims(procs, tmp_path, 2, token_ms=20)
    port, admin = start_proxy(procs, tmp_path, ports, shutdown_timeout_s=10)
    proxy = procs.started[-1]
    url = f"http://127.0.0.1:{port}"

    def all_in_flight() -> bool:
        return sum(b["in_flight"] for b in asyncio.run(backends(admin)).values()) == 8

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return False
        except OSError:
            return True

    async def run():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(one(s, url, chat(max_tokens=100, stream=True))) for _ in range(8)]
            await asyncio.to_thread(wait_until, all_in_flight, what="8 requests in flight")
            proxy.send_signal(signal.SIGTERM)
            await asyncio.to_thread(wait_until, refused, what="the port to refuse connections")
            assert not any(t.done() for t in tasks), "a request ended before the port refused new connections"
            return await asyncio.gather(*tasks)
    results = asyncio.run(run())
    assert [r.status for r in results] == [200] * 8
    assert proxy.wait(15) == 0


def test_api_keys_user_fixup_request_id_and_metrics(procs, tmp_path):
    """API keys: none or a wrong one is 401, the right one passes, /health stays open. A numeric
    `user` reaches vLLM as a string and the log records the fixup. X-Request-Id is kept. /metrics
    has every family operators graph."""
    [sim] = start_sims(procs, tmp_path, 1)
    keys = tmp_path / "keys"
    keys.write_text("# one key per line\nsk-good\n")
    port, admin = start_proxy(procs, tmp_path, [sim], api_keys_file=str(keys))
    url = f"http://127.0.0.1:{port}"

    async def run():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=chat()) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "unauthorized"
            bad = {"Authorization": "Bearer sk-bad"}
            async with s.post(url + "/v1/chat/completions", json=chat(), headers=bad) as r:
                assert r.status == 401
            async with s.get(url + "/health") as r:
                assert r.status == 200
            good = {"Authorization": "Bearer sk-good", "X-Request-Id": "rid-77"}
            async with s.post(url + "/v1/chat/completions", json=chat(user=12345), headers=good) as r:
                assert r.status == 200 and r.headers["X-Request-Id"] == "rid-77", await r.text()
            async with s.get(url + "/metrics") as r:
                return await r.text()
    text = asyncio.run(run())
    for family in ("proxy_backend_in_flight", "proxy_backend_peak_in_flight", "proxy_backend_healthy",
                   "proxy_requests_total", "proxy_request_duration_seconds_bucket", "proxy_retries_total",
                   "proxy_ejections_total", "proxy_upstream_errors_total"):
        assert family in text, family
    assert f'proxy_requests_total{{backend="{name(sim)}",status="200"}} 1.0' in text
    line = wait_until(lambda: next((x for x in results_log(tmp_path) if x["request_id"] == "rid-77"), None),
                      what="the fixed request logged")
    assert line["status"] == 200 and line["fixups"] == ["user-to-string"] and line["trace_id"] == "12345"


def test_what_must_not_break_the_proxy(procs, tmp_path, fakes):
    """1. A `user` holding a lone surrogate is logged (as its JSON escape) and logging goes on.
    2. The results log deleted under the running proxy: the next line recreates it.
    3. An Authorization header that is not UTF-8 is a 401, not a 500; the key never goes upstream.
    4. SIGHUP with a results-log path that cannot be created: refused, the proxy serves on."""
    backend = fakes()
    backend.mode = "200"
    keys = tmp_path / "keys"
    keys.write_text("sk-good\n")
    port, admin = start_proxy(procs, tmp_path, [backend.name], api_keys_file=str(keys))
    wait_until(lambda: asyncio.run(backends(admin))[backend.name]["healthy"], what="fake backend healthy")
    proxy = procs.started[-1]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    log = tmp_path / "req_results.log"
    good = {"Authorization": "Bearer sk-good", "Content-Type": "application/json"}

    def post(raw_body: bytes, rid: str) -> int:
        import urllib.request
        req = urllib.request.Request(url, data=raw_body, headers={**good, "X-Request-Id": rid}, method="POST")
        with urllib.request.urlopen(req) as r:
            return r.status

    assert post(b'{"model": "m", "user": "\\ud800", "messages": []}', "rid-surrogate") == 200
    wait_until(lambda: log.exists() and "rid-surrogate" in log.read_text(), what="the surrogate line")
    assert b"Bearer" not in backend.last_head and b"sk-good" not in backend.last_head
    log.unlink()
    assert post(b'{"model": "m", "user": "after", "messages": []}', "rid-after") == 200
    wait_until(lambda: log.exists() and "rid-after" in log.read_text(), what="the log recreated")

    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                  b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert c.recv(100).startswith(b"HTTP/1.1 401")

    conf_path = tmp_path / "proxy.yaml"
    conf = yaml.safe_load(conf_path.read_text())
    conf["results_log"] = {"path": str(keys / "under-a-file" / "req_results.log")}
    conf_path.write_text(yaml.safe_dump(conf))
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload refused" in (tmp_path / "proxy.log").read_text(), what="the refusal logged")
    assert proxy.poll() is None
    assert post(b'{"model": "m", "user": "still", "messages": []}', "rid-still") == 200
    wait_until(lambda: "rid-still" in log.read_text(), what="the old results log still written")


@pytest.mark.unit
def test_upstream_sockets_give_a_silent_peer_up():
    """A backend whose host lost its link answers nothing, not even a RST: every upstream socket has TCP
    keepalive and a user timeout, so a request in flight to it ends within DEAD_PEER_S (the link
    cut under load in tests/test_netns_fleet.py), not at proxy.timeout_s: the requests' connections
    (proxy/upstream.py) and the health checks' (aiohttp's connector) alike."""
    from proxy.app import upstream_connector
    from proxy.upstream import DEAD_PEER_S, Upstream, upstream_socket

    def check(sock):
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        count = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        assert idle + interval * count <= DEAD_PEER_S <= 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == DEAD_PEER_S * 1000

    with upstream_socket((socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 9))) as sock:
        check(sock)

    async def requests_socket():
        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        upstream = Upstream()
        try:
            async with upstream.request("GET", f"http://127.0.0.1:{port}", "/", {}, None, 5, 5) as up:
                check(up.conn.transport.get_extra_info("socket"))
                assert await up.read() == b"ok"
        finally:
            await upstream.close()
            server.close()
            await server.wait_closed()
    asyncio.run(requests_socket())

    async def factory():
        connector = upstream_connector()
        try:
            return connector._socket_factory
        finally:
            await connector.close()
    assert asyncio.run(factory()) is upstream_socket
