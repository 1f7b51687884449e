"""A deadline on every client socket, and a bound on open connections (proxy/clients.py; issue 37, part 2).

Real proxy processes over real sims on loopback; the hostile clients are raw sockets, bounded in number and time.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import PYTHON, ROOT, require_tool, wait_until
from fleet_helpers import inv, write_inventory
from proxy_helpers import results_lines, start_proxy, start_sims
from proxy.clients import CLIENT_STALLED, ClientConfig, connection_bound
from proxy.config import ConfigError, parse_config

HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: fleet\r\nContent-Type: application/json\r\n"


def request_bytes(body: dict, extra_headers: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: fleet\r\nContent-Type: application/json\r\n"
            + extra_headers + b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def chat(max_tokens=8, stream=False) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "hello"}]}


def post(port: int, body: dict, timeout: float = 30) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
        return r.status


def get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def closed_after(sock: socket.socket, limit_s: float, t0: float | None = None) -> float | None:
    """Seconds from t0 (default: now) until the peer closed sock (an end or a reset), reading what comes;
    None past limit_s."""
    t0 = time.monotonic() if t0 is None else t0
    sock.settimeout(limit_s)
    try:
        while sock.recv(65536):
            pass
    except socket.timeout:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def cut_count(port: int, reason: str) -> float:
    text = get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    found = re.search(r'^proxy_client_connections_cut_total\{reason="%s"\} (\S+)' % reason, text, re.M)
    return float(found.group(1)) if found else 0.0


def in_flight(admin: int) -> int:
    return sum(b["in_flight"] for b in json.loads(get(f"http://127.0.0.1:{admin}/admin/backends")[1]))


def sim_running(port: int) -> float:
    text = get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)", text, re.M))


def final_lines(path) -> list[dict]:
    return results_lines(path)


@pytest.mark.unit
def test_the_bound_leaves_room_for_upstream_connections_and_files():
    assert connection_bound(1024, 0, 2, 4) == 1024 - 64 - 2 * 5        # a slot's upstream each, one spare per backend
    assert connection_bound(1024, 300, 2, 4) == 300                     # asked below the room: as asked
    assert connection_bound(1024, 5000, 2, 4) == 950                    # asked beyond: the room
    assert connection_bound(1024, 0, 2, 0) == (1024 - 64) // 2          # no slots: as many upstream as clients
    assert connection_bound(64, 0, 8, 8) == 16                          # never below MIN_CONNECTIONS


@pytest.mark.unit
def test_client_settings_parse_with_auto_and_refuse_nonsense():
    base = {"backends": ["127.0.0.1:9"]}
    assert parse_config(base).client == ClientConfig()
    c = parse_config({**base, "client": {"header_timeout_s": 2, "max_connections": "auto"}}).client
    assert (c.header_timeout_s, c.max_connections, c.send_timeout_s) == (2.0, 0, 30.0)
    for bad, said in (({"send_timeout_s": 0}, "client.send_timeout_s"), ({"max_connections": -1}, "client.max"),
                      ({"max_connections": "lots"}, "client.max"), ({"idle": 3}, "client.idle")):
        with pytest.raises(ConfigError, match=said):
            parse_config({**base, "client": bad})


@pytest.mark.process
def test_half_heads_silent_and_idle_connections_are_closed_on_time(procs, tmp_path):
    """1. A proxy with header_timeout_s 1 and keepalive_timeout_s 1.5. 2. A connection that sends half a head,
    and one that sends nothing: each is closed between 1 s and 1 s + the sweep. 3. A kept-alive connection,
    after its answer, is closed after its idle 1.5 s, not before 1 s. 4. The metrics count the head timeouts."""
    ports = start_sims(procs, tmp_path, 1, seqs=2)
    port, _ = start_proxy(procs, tmp_path, ports, slots=2,
                          client={"header_timeout_s": 1, "keepalive_timeout_s": 1.5})
    t0 = time.monotonic()
    half, silent = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port))
    half.sendall(HALF_HEAD)
    for sock in (half, silent):
        took = closed_after(sock, 5, t0)
        assert took is not None and 0.8 <= took <= 2.0, took
        sock.close()
    kept = socket.create_connection(("127.0.0.1", port))
    kept.sendall(request_bytes(chat()))
    kept.settimeout(10)
    answer = kept.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    while b"[DONE]" not in answer and b'"finish_reason"' not in answer:
        answer += kept.recv(65536)
    took = closed_after(kept, 5)
    assert took is not None and 1.0 <= took <= 3.0, took
    kept.close()
    assert cut_count(port, "header_timeout") >= 2


@pytest.mark.process
def test_half_open_flood_at_a_low_file_limit_leaves_polite_requests_served(procs, tmp_path):
    """1. A proxy started with 256 open files (soft and hard): its bound is 256 - 64 - 2 x 5 = 182 connections.
    2. 400 connections each send half a head and wait (header_timeout_s 30: only the bound frees them).
    3. Meanwhile 10 polite requests on new connections, each answered 200, and /health 200 each time.
    4. The proxy shed idle connections (the oldest half heads) and never ran out of files."""
    ports = start_sims(procs, tmp_path, 2, seqs=4)
    port, _ = start_proxy(procs, tmp_path, ports, slots=4, nofile=(256, 256), client={"header_timeout_s": 30})
    assert "client connections: at most 182" in (tmp_path / "proxy.log").read_text()
    flood = []
    try:
        for _ in range(400):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(HALF_HEAD)
            flood.append(s)
        for _ in range(10):
            assert post(port, chat()) == 200
            assert get(f"http://127.0.0.1:{port}/health")[0] == 200
            s = socket.create_connection(("127.0.0.1", port), timeout=5)   # the flood goes on meanwhile
            s.sendall(HALF_HEAD)
            flood.append(s)
    finally:
        for s in flood:
            s.close()
    assert cut_count(port, "shed") >= 400 + 10 - 182
    assert "Too many open files" not in (tmp_path / "proxy.log").read_text()


@pytest.mark.process
def test_a_stream_nobody_reads_is_cut_and_its_slot_comes_back(procs, tmp_path):
    """1. One sim with one slot streaming a long answer fast; the proxy's send_timeout_s is 1.
    2. A client with a 1 KiB receive buffer asks for it and never reads.
    3. Within send_timeout_s + 1 s (its buffers fill in a fraction of a second) the proxy cuts the stream: the
       slot is free, the sim's request is aborted (its running count drops to 0), and the results log has
       status 498 with the error. 4. The next request is served at once."""
    ports = start_sims(procs, tmp_path, 1, seqs=1, token_ms=2, extra=("--sim-output-tokens", "30000"))
    port, admin = start_proxy(procs, tmp_path, ports, slots=1, client={"send_timeout_s": 1})
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    reader.connect(("127.0.0.1", port))
    reader.sendall(request_bytes(chat(max_tokens=30000, stream=True)))
    wait_until(lambda: sim_running(ports[0]) == 1, timeout=10, what="the sim streaming to the non-reader")
    t0 = time.monotonic()
    wait_until(lambda: in_flight(admin) == 0, timeout=5, interval=0.05, what="the slot back")
    assert time.monotonic() - t0 <= 1 + 1.5
    wait_until(lambda: sim_running(ports[0]) == 0, timeout=3, what="the sim's request aborted")
    assert post(port, chat(), timeout=5) == 200
    lines = wait_until(lambda: [e for e in final_lines(tmp_path / "req_results.log") if e["status"] == CLIENT_STALLED],
                       timeout=5, what="the results-log line")
    assert lines[0]["error"] == "the client took nothing of its stream for 1 s"
    assert cut_count(port, "send_timeout") == 1
    reader.close()


@pytest.mark.process
def test_the_engines_silence_is_not_the_clients(procs, tmp_path):
    """A reading client whose answer starts after 2.5 s of prefill, with send_timeout_s 1: served whole (200)."""
    ports = start_sims(procs, tmp_path, 1, seqs=1, extra=("--sim-prefill-ms", "2500"))
    port, _ = start_proxy(procs, tmp_path, ports, slots=1, client={"send_timeout_s": 1})
    assert post(port, chat(stream=True)) == 200
    assert cut_count(port, "send_timeout") == 0


@pytest.mark.process
def test_a_body_that_stops_coming_is_cut_with_408(procs, tmp_path):
    """1. body_timeout_s 1. 2. A request's head says 1000 bytes of body, 10 come, then nothing. 3. The
    connection is closed between 1 s and 2.5 s later, the slot is back and the results log says 408."""
    ports = start_sims(procs, tmp_path, 1, seqs=1)
    port, admin = start_proxy(procs, tmp_path, ports, slots=1, client={"body_timeout_s": 1})
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: fleet\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")
    took = closed_after(sock, 5)
    assert took is not None and 0.9 <= took <= 2.5, took
    wait_until(lambda: in_flight(admin) == 0, timeout=2, what="the slot back")
    lines = wait_until(lambda: [e for e in final_lines(tmp_path / "req_results.log") if e["status"] == 408],
                       timeout=5, what="the results-log line")
    assert lines[0]["error"] == "the client sent no body bytes for 1 s"
    assert post(port, chat(), timeout=5) == 200


@pytest.mark.nginx
def test_nginx_mode_renders_the_same_deadlines_and_bound(tmp_path):
    """proxy.client.* reach nginx.conf as its equivalents (client_header_timeout, client_body_timeout,
    keepalive_timeout, send_timeout, limit_conn with its zone, worker_connections, worker_rlimit_nofile), and
    the host agent's check (`nginx -t` with the flags nginx starts with) accepts them."""
    require_tool("nginx")
    inventory = write_inventory(tmp_path, instances=2)
    out = tmp_path / "deploy"
    sets = ["proxy.client.header_timeout_s=2.5", "proxy.client.body_timeout_s=20", "proxy.client.send_timeout_s=15",
            "proxy.client.keepalive_timeout_s=60", "proxy.client.max_connections=480"]
    r = inv("render", "--host", "t", "--out", str(out), *[a for s in sets for a in ("--set", s)], inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    conf = (out / "conf" / "nginx.conf").read_text()
    for directive in ("client_header_timeout 2500ms;", "client_body_timeout 20s;", "send_timeout 15s;",
                      "keepalive_timeout 60s;", "limit_conn_zone $server_port zone=fleet_clients:1m;",
                      "limit_conn fleet_clients 480;", "worker_connections 960;", "worker_rlimit_nofile 1024;"):
        assert directive in conf, directive
    # one send_timeout, the client's: the upstream timeout no longer stands in for it in location /v1/
    assert re.findall(r"^\s*send_timeout (\S+);", conf, re.M) == ["15s"]
    check = subprocess.run([PYTHON, "-m", "hostagent", "check", "--config", "conf/nginx_front.json"],
                           cwd=out, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.process
def test_at_the_bound_with_none_idle_a_new_connection_gets_503(procs, tmp_path):
    """1. client.max_connections 4; one slot, and the sim takes a minute before its first token (the running
    request must not end, leaving its connection idle, before the fifth comes, however slow the machine).
    2. Four connections each send a whole request (one runs, three queue): none is idle. 3. A fifth
    connection is answered 503 (`overloaded`, Retry-After) and closed, and counted `refused`; none of the
    four was shed."""
    ports = start_sims(procs, tmp_path, 1, seqs=1, extra=("--sim-prefill-ms", "60000"))
    port, admin = start_proxy(procs, tmp_path, ports, slots=1, client={"max_connections": 4})
    busy = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(request_bytes(chat()))
        busy.append(s)
    wait_until(lambda: json.loads(get(f"http://127.0.0.1:{admin}/admin/config")[1])["queued"] == 3,
               timeout=30, what="one request running, three queued")
    late = socket.create_connection(("127.0.0.1", port))
    late.settimeout(5)
    answer = b""
    while chunk := late.recv(65536):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 503") and b'"overloaded"' in answer and b"Retry-After: 1" in answer
    for s in busy:      # first: /metrics, on the public port, is a connection too
        s.close()
    wait_until(lambda: in_flight(admin) == 0, timeout=5, what="the four gone")
    assert cut_count(port, "refused") == 1 and cut_count(port, "shed") == 0


class FakeTransport:
    """A transport that only records being aborted (clients.reset finds no socket on it)."""

    def __init__(self) -> None:
        self.aborted = False

    def get_extra_info(self, name):
        return None

    def abort(self) -> None:
        self.aborted = True


class HalfHead:
    """A connection whose head began at `since` and never completed."""

    def __init__(self, since: float) -> None:
        self.head_since, self.transport = since, FakeTransport()

    def request(self):
        return None

    def waiting(self) -> bool:
        return True


@pytest.mark.unit
def test_a_sweep_cuts_a_bounded_number_the_oldest_first():
    """1. 600 heads, all past header_timeout_s at once (a flood accepted in one burst). 2. One sweep cuts
    CUTS_PER_SWEEP of them, the oldest first, so the loop is not held by hundreds of resets in one turn.
    3. The next sweeps cut the rest."""
    from proxy.clients import CUTS_PER_SWEEP, Clients
    clients = Clients(ClientConfig(header_timeout_s=10), bound=10_000)
    conns = [HalfHead(since=i * 0.001) for i in range(600)]
    for c in conns:
        clients.open[c] = None
    clients.sweep(now=100.0)
    cut = [c.transport.aborted for c in conns]
    assert cut == [True] * CUTS_PER_SWEEP + [False] * (600 - CUTS_PER_SWEEP)
    sweeps = 1
    while clients.open and sweeps < 10:
        for c in [c for c in clients.open if c.transport.aborted]:
            del clients.open[c]             # what connection_lost does once the reset is through
        clients.sweep(now=100.0)
        sweeps += 1
    assert all(c.transport.aborted for c in conns) and clients.cuts == 600
    assert sweeps == -(-600 // CUTS_PER_SWEEP) + 1     # the last one finds none left


@pytest.mark.unit
def test_the_public_port_accepts_a_bounded_number_per_loop_turn_and_keeps_its_long_queue():
    """1. A ClientSite starts on a listening socket. 2. While the loop is held, 300 connections complete in
    the kernel's queue. 3. Once the loop runs again, no turn of it makes more than ACCEPTS_PER_TURN new
    connections (a probe counts them at every turn), and all 300 are made. 4. The listen queue is still
    BACKLOG long (ss's Send-Q of a listener)."""
    import asyncio
    require_tool("ss")

    from aiohttp import web

    from proxy.clients import Clients
    from proxy.listener import ACCEPTS_PER_TURN, BACKLOG, ClientSite, listen_socket

    async def main() -> tuple[list[int], int]:
        runner = web.AppRunner(web.Application())
        await runner.setup()
        clients = Clients(ClientConfig(), bound=10_000)
        sock = listen_socket("127.0.0.1", 0, reuse_port=False)
        port = sock.getsockname()[1]
        await ClientSite(runner, sock, clients).start()
        peers = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]   # the loop is held here
        seen: list[int] = []
        while len(clients.open) < 300 and len(seen) < 1000:
            seen.append(len(clients.open))
            await asyncio.sleep(0)              # one turn of the loop
        seen.append(len(clients.open))
        queue = listen_queue(port)
        for p in peers:
            p.close()
        await runner.cleanup()
        return seen, queue

    seen, queue = asyncio.run(main())
    assert seen[-1] == 300
    assert max(b - a for a, b in zip(seen, seen[1:])) <= ACCEPTS_PER_TURN
    assert queue in (BACKLOG, min(BACKLOG, int(open("/proc/sys/net/core/somaxconn").read())))


def listen_queue(port: int) -> int:
    """The listen queue's length of the listener on port (ss -ltn: Send-Q)."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[2])


@pytest.mark.unit
def test_the_loop_lag_watch_sees_a_stall():
    """1. The loop-lag ticker runs. 2. A callback holds the loop 150 ms. 3. The worst lag says at least
    that much (less the tick), and the histogram counted the late tick in its over-100 ms buckets."""
    import asyncio

    from prometheus_client import CollectorRegistry, Gauge, Histogram

    from proxy import loop_lag
    from proxy.metrics import LAG_BUCKETS

    r = CollectorRegistry()
    hist = Histogram("lag", "lag", buckets=LAG_BUCKETS, registry=r)
    worst = Gauge("worst", "worst", registry=r)

    async def main() -> None:
        task = asyncio.create_task(loop_lag.watch(hist, worst))
        await asyncio.sleep(0.05)
        time.sleep(0.15)                          # the stall: nothing else runs
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(main())
    assert worst._value.get() >= 0.15 - 2 * loop_lag.TICK_S
    over = r.get_sample_value("lag_count") - r.get_sample_value("lag_bucket", {"le": "0.1"})
    assert over >= 1


@pytest.mark.nginx
def test_nginx_mode_cuts_a_stream_nobody_reads_at_its_send_timeout(tmp_path):
    """1. nginx mode as fleet renders it (bench/stack.py) over one sim with one slot streaming fast;
    send_timeout_s 1. 2. A client with a 1 KiB receive buffer asks for a long stream and never reads.
    3. nginx cuts it within send_timeout_s + 1.5 s: the sim's request is aborted (its running count back to
    0). nginx's send_timeout starts only once nothing more fits in the client socket's send buffer, which
    nginx.send_buffer_kb keeps small (with the kernel's autotuning, 4 MB, the cut came after about 40 s
    here). 4. The next request is served."""
    require_tool("nginx")
    sys.path.insert(0, str(ROOT / "bench"))
    from stack import Stack, end_pid
    sims = ["--sim-overhead-ms", "0", "--sim-token-ms", "2", "--sim-output-tokens", "30000"]
    stack = Stack(tmp_path, 1, 1, sims, proxy_set=("proxy.client.send_timeout_s=1",))
    try:
        stack.start(["nginx"])
        port, sim = int(stack.url("nginx").rsplit(":", 1)[1]), stack.backend_ports[0]
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        reader.connect(("127.0.0.1", port))
        reader.sendall(request_bytes(chat(max_tokens=30000, stream=True)))
        wait_until(lambda: sim_running(sim) == 1, timeout=10, what="the sim streaming to the non-reader")
        t0 = time.monotonic()
        wait_until(lambda: sim_running(sim) == 0, timeout=20, interval=0.05, what="the sim's request aborted")
        assert time.monotonic() - t0 <= 1 + 1.5
        assert post(port, chat(), timeout=5) == 200
        reader.close()
    finally:
        if stack.nginx_pid_file and stack.nginx_pid_file.exists():
            end_pid(stack.nginx_pid())
        stack.stop()


@pytest.mark.unit
@pytest.mark.parametrize("answer", ["held open", "at once"])
def test_body_bytes_that_arrive_as_aiohttp_takes_their_request_do_not_start_a_head_deadline(answer):
    """Found by the real-engine resume check: a stream of 12 s was cut as a header timeout (logged 499, the
    client saw its stream end). On Python 3.11 aiohttp's handler takes a request from its queue and runs it
    in a task one loop turn later; body bytes arriving in that turn found the connection `waiting` for a
    head, and a head deadline ran on under the request (held open: cut 10 s in), or after it (answered at
    once: its kept-alive connection cut 10 s later). 1. A POST's head, then (next turn, in that window) its
    body. 2. The request is handled (and held open, or answered). 3. No head deadline runs, and a sweep well
    past header_timeout_s cuts nothing."""
    import asyncio
    from aiohttp import web
    from proxy.clients import Clients

    async def main():
        loop = asyncio.get_running_loop()
        handled, release = asyncio.Event(), asyncio.Event()

        async def handler(request):
            await request.read()
            handled.set()
            if answer == "held open":
                await release.wait()
            return web.Response(text="ok")
        server = web.Server(handler)
        clients = Clients(ClientConfig(header_timeout_s=10), bound=100)
        ours, theirs = socket.socketpair()
        transport, conn = await loop.connect_accepted_socket(clients.factory(server), sock=ours)

        def feed():
            conn.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
            loop.call_soon(conn.data_received, b"{}")    # after the handler's wake-up: in its window
        loop.call_soon(feed)
        await asyncio.wait_for(handled.wait(), 5)
        await asyncio.sleep(0.05)          # an answer at once is written; the connection kept alive
        since = conn.head_since
        clients.sweep(time.monotonic() + 60)
        cut = transport.is_closing()
        release.set()
        transport.abort()
        theirs.close()
        await server.shutdown(0.1)
        return since, cut
    assert asyncio.run(main()) == (None, False)


@pytest.mark.unit
def test_what_a_client_makes_up_does_not_fill_the_proxys_caches():
    """The header spellings the proxy works out once are kept only for keys a client cannot multiply:
    2,000 long header names keep nothing, and each still gets its right answer; a short one is kept.
    (The upstream client keeps what it parsed of the backends' addresses alone: the config's.)"""
    from proxy import forward
    up = len(forward._UPSTREAM)
    for i in range(2000):
        assert forward._UPSTREAM["x-" + "h" * 80 + str(i)] is True
    assert len(forward._UPSTREAM) == up
    assert forward._UPSTREAM["Connection"] is False and "Connection" in forward._UPSTREAM
