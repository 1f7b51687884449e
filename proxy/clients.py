"""Client connections: a deadline on every socket of the public port, and a bound on how many are open.

aiohttp closes a kept-alive connection idle for its keepalive_timeout, and has no other deadline: a client
that sends half a request head, stalls its body, or never reads its stream holds a socket (and its slot)
for as long as it likes. Each connection of the public port is served by aiohttp's own handler, wrapped in
a `Connection` that notes when bytes arrive and when a request head began; one sweep, a few times a second,
cuts what ran past its deadline:

- a head (the first one counted from the accept) not complete within header_timeout_s;
- a request body from which no byte came for body_timeout_s while the proxy was ready to read it;
- an answer of which the client took nothing (no byte acknowledged by its kernel while bytes wait to go
  out) for send_timeout_s. The engine's silence never counts: with nothing to send, nothing is owed.

A cut aborts the socket (a close would wait for a non-reader to take what is buffered); the request's
handler is then cancelled as when a client hangs up, which aborts the upstream request and releases the
slot, and the request records why (CUT). At max_connections, a new connection is kept and the oldest
idle one (a kept-alive connection, or one whose head is not complete) is closed instead; only when none
is idle is the new one answered 503.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import socket
import struct
import time
from dataclasses import dataclass

log = logging.getLogger("proxy")

CUT = "client_cut"           # the request's key of (status, error) when the proxy cut its connection
CLIENT_STALLED = 498         # the results log's status of a stream cut because the client took nothing of it
BODY_TIMEOUT = 408           # nginx's status for a body that stopped coming (client_body_timeout)
CUT_REASONS = ("header_timeout", "body_timeout", "send_timeout", "shed", "refused")
FILES_RESERVE = 64           # descriptors kept for what is not a connection: logs, the listeners, pipes
MIN_CONNECTIONS = 16         # the bound never goes below this, however low the file limit
TICK_S = 0.1                 # the sweep's period: a deadline is kept to within this (a sweep of 1,000 connections: under 0.1 ms)
# Cuts per sweep: a flood accepted at once reaches its header deadline at once, and 5,000 resets (and their
# connection_lost callbacks, the next turn) in one sweep held the loop for over 100 ms. The rest wait for the
# next sweeps, oldest first: 2,560 a second, each connection's deadline kept to within a second or two.
CUTS_PER_SWEEP = 256
# A first request head longer than this without its end is handed to aiohttp anyway, which refuses it (431/400).
HEAD_HOLD = 16384
LINGER_RESET = struct.pack("ii", 1, 0)   # SO_LINGER on, 0 s: close() resets the connection
TCP_INFO_LEN = 152           # struct tcp_info up to tcpi_notsent_bytes (Linux 4.6)
_REFUSED_BODY = (b'{"error": {"message": "the entry holds its most connections, none of them idle; retry shortly.", '
                 b'"type": "overloaded", "code": 503}}\n')
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
           b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


@dataclass(frozen=True)
class ClientConfig:
    """The deadlines of a client connection, and the bound on open ones (0: derived from the file limit)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    send_timeout_s: float = 30.0
    max_connections: int = 0


def raise_nofile() -> int:
    """Raise the soft limit of open files to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d (%s)", soft, target, e)
    return soft


def connection_bound(nofile: int, wanted: int, backends: int, slots: int) -> int:
    """How many client connections may be open: wanted (0: as many as the file limit allows) kept below
    nofile less what upstream connections (a slot's each, one spare per backend for its health checks;
    without slots as many as the clients) and the proxy's files need."""
    spare = nofile - FILES_RESERVE
    upstream = backends * (slots + 1) if slots else spare // 2
    room = max(MIN_CONNECTIONS, spare - upstream)
    return room if wanted <= 0 else min(wanted, room)


def tcp_progress(sock) -> tuple[int, bool] | None:
    """(bytes the peer acknowledged, whether bytes still wait to be sent or acknowledged) from TCP_INFO;
    None where the kernel does not say."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
        unacked, = struct.unpack_from("=I", info, 24)
        acked, = struct.unpack_from("=Q", info, 120)
        notsent, = struct.unpack_from("=I", info, 144) if len(info) >= 148 else (0,)
    except (OSError, struct.error, AttributeError):
        return None
    return acked, bool(unacked or notsent)


def reset(transport) -> None:
    """Close a client's connection now, with a reset: a plain close of a socket whose answer the client does
    not read leaves the kernel holding the unsent bytes (an orphan socket) for minutes."""
    sock = transport.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    except OSError:
        pass
    transport.abort()


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's handler, with what the deadlines need to know of it.

    The handler is built once the first request head is whole (or HEAD_HOLD bytes came without one, or bytes
    that cannot start a request line, which aiohttp answers at once): until then the connection is a buffer. A flood of connections that send half a head, or nothing, then costs the
    loop an accept and a few attribute writes each, not aiohttp's handler and its task (a new client's
    /health waits in the accept queue behind every connection ahead of it: their setup is its wait)."""

    __slots__ = ("clients", "server", "handler", "transport", "held", "body", "last_in", "head_since", "acked",
                 "progress_at")

    def __init__(self, clients: Clients, server) -> None:
        self.clients, self.server = clients, server
        self.handler = None
        self.transport = None
        self.held = bytearray()              # the first head's bytes, before the handler exists
        self.body = None                     # the payload of the newest request aiohttp parsed
        self.last_in = self.head_since = time.monotonic()   # a new connection owes its first head
        self.acked, self.progress_at = -1, self.last_in

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.clients.opened(self)

    def data_received(self, data: bytes) -> None:
        now = self.last_in = time.monotonic()
        if self.handler is None:
            held = self.held
            held += data
            tail = held[-len(data) - 2:]     # only the new bytes can end the head (a head sent a byte at a time: linear)
            if held[:1].isalpha() and b"\n\r\n" not in tail and b"\n\n" not in tail and len(held) < HEAD_HOLD:
                return                       # a request line's start, its head not whole yet
            self.held = bytearray()
            self.handler = self.server()
            self.handler.connection_made(self.transport)
            data = bytes(held)
        elif self.head_since is None and self.waiting() and (self.body is None or self.body.is_eof()):
            # A new head begins; not when these are the last request's body bytes: on Python < 3.12 aiohttp
            # runs a request a loop turn after taking it from its queue, and in that turn it looks idle.
            self.head_since = now
            self.clients.touched(self)
        self.handler.data_received(data)
        messages = self.handler._messages
        if messages:
            self.body = messages[-1][1]      # the newest request's body, still coming or whole
            self.head_since = None           # a whole head parsed: aiohttp queued its request

    def eof_received(self):
        return self.handler.eof_received() if self.handler is not None else None

    def connection_lost(self, exc) -> None:
        self.clients.closed(self)
        if self.handler is not None:
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def waiting(self) -> bool:
        """Whether the connection waits for a request head: no request queued or being handled."""
        h = self.handler
        return h is None or (not h._messages and getattr(h, "_current_request", None) is None
                             and not getattr(h, "_request_in_progress", False))

    def request(self):
        """The request being handled, or None."""
        return getattr(self.handler, "_current_request", None)

    def refuse(self) -> None:
        """Answer 503 (the bound is reached, none idle) and close once it is written."""
        self.transport.write(REFUSED)
        if self.handler is not None:
            self.handler.force_close()
        else:
            self.transport.close()


class Clients:
    """The public port's client connections: their deadlines (the sweep) and their bound."""

    def __init__(self, config: ClientConfig, bound: int, cut_counter=None, gauge=None) -> None:
        self.config, self.bound = config, bound
        self.open: dict[Connection, None] = {}   # in order of their last head's start: oldest first
        self._cut, self._gauge = cut_counter, gauge
        self._sweeper: asyncio.Task | None = None
        self.cuts = 0     # connections cut since start, whatever the reason

    def factory(self, server):
        """A protocol factory for loop.create_server: aiohttp's handlers (server()), each wrapped."""
        return lambda: Connection(self, server)

    def start(self) -> None:
        self._sweeper = asyncio.ensure_future(self._sweep_forever())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        for conn in list(self.open):          # aiohttp's shutdown closes the connections it has a handler for
            if conn.handler is None and conn.transport is not None:
                conn.transport.abort()

    def opened(self, conn: Connection) -> None:
        """A new connection; past the bound, the oldest idle one goes (or, none idle, this one)."""
        self.open[conn] = None
        if self._gauge is not None:
            self._gauge.inc()
        if len(self.open) <= self.bound:
            return
        victim = next((c for c in self.open if c is not conn and c.waiting()), None)
        if victim is not None:
            self.cut(victim, "shed")
            return
        self._count("refused")
        conn.refuse()

    def touched(self, conn: Connection) -> None:
        """A head began on conn: it becomes the newest in the shedding order."""
        if conn in self.open:
            del self.open[conn]
            self.open[conn] = None

    def closed(self, conn: Connection) -> None:
        if self.open.pop(conn, False) is None and self._gauge is not None:
            self._gauge.dec()

    def cut(self, conn: Connection, reason: str, status: int = 0, error: str = "") -> None:
        """Close conn at once; the request it carries, if any, ends with status and error. None carried:
        its handler ended (settled, logged) and handed the connection its last bytes (a whole answer, or a
        stream's tail still in the write buffer): the cut is counted only (docs/proxy.md "Client connections")."""
        request = conn.request()
        if request is not None and status:
            request[CUT] = (status, error)
        self.cuts += 1
        self._count(reason)
        if conn.transport is not None:
            reset(conn.transport)

    def _count(self, reason: str) -> None:
        if self._cut is not None:
            self._cut.labels(reason).inc()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.sweep(time.monotonic())
            except Exception:   # a bug here must not end the deadlines for good
                log.exception("the client connections' sweep failed; it runs again in %g s", TICK_S)

    def sweep(self, now: float, most: int = CUTS_PER_SWEEP) -> None:
        """Cut the connections past one of their deadlines, at most `most` of them (the oldest first)."""
        c = self.config
        cuts = self.cuts
        for conn in list(self.open):
            if conn.head_since is not None:
                if now - conn.head_since > c.header_timeout_s:
                    self.cut(conn, "header_timeout")
            elif not conn.waiting():
                self._sweep_request(conn, now)
            if self.cuts - cuts >= most:
                return

    def _sweep_request(self, conn: Connection, now: float) -> None:
        """A connection carrying a request: its body still coming, its answer being taken."""
        c = self.config
        request = conn.request()
        payload = getattr(request, "content", None)
        if payload is not None and not payload.is_eof():
            if getattr(conn.handler, "_reading_paused", False):
                conn.last_in = now            # the proxy is not reading: the client owes nothing now
            elif now - conn.last_in > c.body_timeout_s:
                self.cut(conn, "body_timeout", BODY_TIMEOUT,
                         f"the client sent no body bytes for {c.body_timeout_s:g} s")
                return
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        progress = tcp_progress(sock) if sock is not None else None
        if progress is None:
            return
        acked, owed = progress
        owed = owed or conn.transport.get_write_buffer_size() > 0
        if not owed or acked != conn.acked:
            conn.acked, conn.progress_at = acked, now
        elif now - conn.progress_at > c.send_timeout_s:
            self.cut(conn, "send_timeout", CLIENT_STALLED,
                     f"the client took nothing of its stream for {c.send_timeout_s:g} s")
