"""The proxy's own HTTP/1.1 client to its backends: kept-alive connections per backend, a request written in
one call, the answer's head parsed once and its body handed on as it comes (a Content-Length, chunked, or up
to the close). It does what a proxy to known backends needs and no more: aiohttp's client made per request
what a proxy needs once (a request object, its headers merged twice, a URL, a write task) and was a sixth of
a plain request's CPU (docs/PERFORMANCE.md). The health checks and the workers' messages keep aiohttp's.

Its failures are named as the request path names them (proxy/forward.py `_failed`): Unreachable,
ConnectTimeout, Disconnected (closed before the answer's head), Broken (the connection failed before it),
BrokenBody (after it); the whole call past its deadline: asyncio.TimeoutError.
"""
from __future__ import annotations

import asyncio
import socket
import urllib.parse

from multidict import CIMultiDict, CIMultiDictProxy

# vLLM's API server (uvicorn) closes idle kept-alive connections after 5 s; reusing one it is about
# to close fails the request, so the proxy lets its own idle connections go a little earlier.
KEEPALIVE_S = 4.0
# A backend whose host lost its link sends no RST and no FIN: its packets vanish, and a request in flight
# to it would wait for proxy.timeout_s (300 s). TCP keepalive on every upstream connection finds such a
# peer within this many seconds of its last packet (a live host's kernel answers the probes however busy
# its engine is), and TCP_USER_TIMEOUT bounds data left unacknowledged as long: the request then fails as
# a connection error, and is retried on another backend when no byte has reached the client yet.
DEAD_PEER_S = 10
HEAD_BYTES = 64 * 1024        # an answer's status line and headers, at most (aiohttp's client: 8 KB a line)
CHUNK_LINE_BYTES = 4096       # a chunk's size line, extensions included
BUFFERED_BYTES = 256 * 1024   # read from the backend and not yet taken: past this, reading pauses
_NO_BODY = frozenset({204, 304})
_HEADERS_DONE = b"\r\n\r\n"


class UpstreamError(Exception):
    """A call to a backend that failed: one of the kinds below."""


class Unreachable(UpstreamError):
    """No connection: refused, no route, a name that does not resolve."""

    def __init__(self, message: str, os_error: OSError):
        super().__init__(message)
        self.os_error = os_error


class ConnectTimeout(UpstreamError):
    """No connection within the connect timeout."""


class Disconnected(UpstreamError):
    """The backend closed the connection before its answer's head (an engine that died, or closed a kept-alive
    connection as the request went out)."""


class Broken(UpstreamError):
    """The connection failed (reset, timed out by TCP) before the answer's head."""


class BrokenBody(UpstreamError):
    """The answer broke off, or was not HTTP, after its head."""


def upstream_socket(addr_info) -> socket.socket:
    """A socket for an upstream connection: TCP keepalive that gives a silent peer up after DEAD_PEER_S,
    where the platform has the options, and no Nagle delay (a request head and body go in one write)."""
    family, type_, proto = addr_info[:3]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, count = 4, 3
    interval = (DEAD_PEER_S - idle) // count
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                        ("TCP_USER_TIMEOUT", DEAD_PEER_S * 1000), ("TCP_NODELAY", 1)):
        option = getattr(socket, name, None)
        if option is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:
                pass
    return sock


class _Origin:
    """A backend's address (`http://host:port`), parsed once: where to connect, its Host header, its path prefix."""

    __slots__ = ("host", "port", "host_header", "prefix")

    def __init__(self, base: str):
        url = urllib.parse.urlsplit(base)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"not an http:// backend address: {base!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.host_header = url.netloc.rpartition("@")[2]
        self.prefix = url.path.rstrip("/")


class Upstream:
    """The connections to the backends, kept alive between requests (one request at a time each)."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S):
        self.keepalive_s = keepalive_s
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[str, list[_Connection]] = {}
        self.closed = False

    def request(self, method: str, base: str, target: str, headers: dict, body: bytes | None,
                timeout_s: float, connect_s: float) -> Call:
        """A call to the backend at base (`http://host:port`) for target (path and query as the client sent
        them): `async with upstream.request(...) as answer`. timeout_s bounds the whole call, the answer's
        body read included; connect_s a new connection."""
        return Call(self, method, base, target, headers, body, timeout_s, connect_s)

    def _origin(self, base: str) -> _Origin:
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = _Origin(base)   # the backends' addresses: the config's, a few
        return origin

    def _take(self, base: str, now: float) -> _Connection | None:
        """A kept-alive connection to base, idle for less than keepalive_s; older ones closed."""
        idle = self._idle.get(base)
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < self.keepalive_s and not conn.lost:
                return conn
            conn.close()
            for old in idle:        # the rest went idle before it
                old.close()
            idle.clear()
        return None

    def _keep(self, base: str, conn: _Connection, now: float) -> None:
        if self.closed:
            conn.close()
            return
        conn.idle_since = now
        self._idle.setdefault(base, []).append(conn)

    def _lost(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.base)
        if idle and conn in idle:
            idle.remove(conn)

    async def _connect(self, base: str, origin: _Origin, connect_s: float) -> _Connection:
        try:
            return await asyncio.wait_for(self._open(base, origin), connect_s)
        except asyncio.TimeoutError:      # (Python 3.10's is not the builtin TimeoutError)
            raise ConnectTimeout(f"no connection to {base} within {connect_s:g}s") from None
        except OSError as e:
            raise Unreachable(f"cannot connect to {base}: {e}", e) from e

    async def _open(self, base: str, origin: _Origin) -> _Connection:
        """A new connection to origin: each of its addresses in turn, the first that connects."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM)
        error: OSError | None = None
        for info in infos:
            sock = upstream_socket(info)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, info[4])
            except OSError as e:
                sock.close()
                error = e
                continue
            except BaseException:
                sock.close()
                raise
            _, conn = await loop.create_connection(lambda: _Connection(self, base), sock=sock)
            return conn
        raise error or OSError(f"no address for {origin.host}")

    async def close(self) -> None:
        """Close the idle connections; a connection in use closes when its call ends."""
        self.closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


class Call:
    """One request to a backend, as an async context manager whose value is the Answer; leaving it gives
    the connection back when the answer was read whole (and the backend keeps it open), else closes it."""

    __slots__ = ("upstream", "method", "base", "target", "headers", "body", "timeout_s", "connect_s",
                 "answer", "timer", "conn")

    def __init__(self, upstream: Upstream, method: str, base: str, target: str, headers: dict,
                 body: bytes | None, timeout_s: float, connect_s: float):
        self.upstream, self.method, self.base, self.target = upstream, method, base, target
        self.headers, self.body, self.timeout_s, self.connect_s = headers, body, timeout_s, connect_s
        self.answer: Answer | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.conn: _Connection | None = None

    async def __aenter__(self) -> Answer:
        upstream = self.upstream
        loop = asyncio.get_running_loop()
        start = loop.time()
        origin = upstream._origin(self.base)
        conn = upstream._take(self.base, start)
        if conn is None:
            conn = await upstream._connect(self.base, origin, min(self.connect_s, self.timeout_s))
        self.conn = conn
        answer = self.answer = conn.answer = Answer(conn, self.method == "HEAD", loop)
        self.timer = loop.call_at(start + self.timeout_s, answer.set_exception, asyncio.TimeoutError())
        try:
            conn.transport.write(_request_bytes(self.method, origin, self.target, self.headers, self.body))
            await answer.headed()
        except BaseException:     # no answer to leave: the connection goes, and the deadline with it
            self.timer.cancel()
            conn.answer = None
            conn.close()
            raise
        return answer

    async def __aexit__(self, *exc_info) -> None:
        if self.timer is not None:
            self.timer.cancel()
        conn, answer = self.conn, self.answer
        if conn is None:
            return
        conn.answer = None
        if answer is not None and answer.reusable and exc_info[0] is None and not conn.lost:
            if answer._paused:      # read whole but left unread: the next answer must be read
                conn.transport.resume_reading()
            self.upstream._keep(self.base, conn, asyncio.get_running_loop().time())
        else:
            conn.close()


def _request_bytes(method: str, origin: _Origin, target: str, headers: dict, body: bytes | None) -> bytes:
    """The request's head (and body) as one bytes: the client's headers as they came (their values UTF-8, as
    aiohttp's server decoded them), the backend's Host, the body's length."""
    length = f"Content-Length: {len(body or b'')}\r\n" if body or method in ("POST", "PUT", "PATCH") else ""
    head = (f"{method} {origin.prefix}{target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
            + "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
            + length + "\r\n").encode("utf-8", "surrogateescape")
    return head + body if body else head


class _Connection(asyncio.Protocol):
    """One kept-alive connection to a backend; its bytes go to the answer being read on it."""

    __slots__ = ("upstream", "base", "transport", "answer", "idle_since", "lost")

    def __init__(self, upstream: Upstream, base: str):
        self.upstream, self.base = upstream, base
        self.transport: asyncio.Transport | None = None
        self.answer: Answer | None = None
        self.idle_since = 0.0
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.answer is None:     # bytes nobody asked for: the connection is not one to reuse
            self.close()
            return
        self.answer.feed(data)

    def eof_received(self) -> bool:
        if self.answer is not None:
            self.answer.feed_eof()
        else:
            self.lost = True        # an idle connection the backend closed: not to be taken
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.answer is not None:
            self.answer.lost(exc)
        self.upstream._lost(self)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


# How an answer's body ends.
_LENGTH, _CHUNKED, _TO_CLOSE, _NONE = range(4)
# Where a chunked body's reading is.
_SIZE, _DATA, _CRLF, _TRAILER, _END = range(5)


class Answer:
    """A backend's answer: status, headers, content_length, and its body as it comes (`content.iter_any()`,
    `read()`); `content.set_exception` ends a read under way with that exception (the stall watch)."""

    __slots__ = ("conn", "status", "headers", "content_length", "_keep",
                 "_head_only", "_loop", "_head", "_headed", "_mode", "_left", "_chunk", "_raw",
                 "_chunks", "_size", "_eof", "_exc", "_waiter", "_paused")

    def __init__(self, conn: _Connection, head_only: bool, loop: asyncio.AbstractEventLoop):
        self.conn, self._head_only, self._loop = conn, head_only, loop
        self.status = 0
        self.headers: CIMultiDictProxy | None = None
        self.content_length: int | None = None
        self._keep = False            # the backend keeps the connection open after this answer
        self._head = b""
        self._headed: asyncio.Future | None = None
        self._mode = _NONE
        self._left = 0                # _LENGTH: bytes to come; _CHUNKED: of the chunk being read
        self._chunk = _SIZE
        self._raw = b""               # a chunked body's bytes not yet decoded (a line cut by a read)
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False

    @property
    def content(self) -> Answer:
        """The body's reader (aiohttp's `response.content`): the answer itself, without a reference to itself."""
        return self

    @property
    def reusable(self) -> bool:
        """Read whole, nothing after it, and the backend keeps the connection: it may serve another request."""
        return self._keep and self._eof and self._exc is None

    # The head.

    async def headed(self) -> None:
        """Wait for the answer's head (the status line and headers)."""
        if self.headers is None and self._exc is None:
            self._headed = self._loop.create_future()
            try:
                await self._headed
            finally:
                self._headed = None
        if self.headers is None:
            raise self._exc

    def _fail_head(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        if self._headed is not None and not self._headed.done():
            self._headed.set_result(None)
        self.conn.close()

    def _parse_head(self, data: bytes) -> bytes | None:
        """Take data toward the head; the bytes after it once it is whole (None: not yet)."""
        buf = self._head + data if self._head else data
        end = buf.find(_HEADERS_DONE)
        if end < 0:
            if len(buf) > HEAD_BYTES:
                self._fail_head(BrokenBody(f"an answer's head over {HEAD_BYTES} bytes"))
                return None
            self._head = buf
            return None
        self._head = b""
        lines = buf[:end].split(b"\r\n")
        status_line = lines[0]
        if not status_line.startswith(b"HTTP/1.") or len(status_line) < 12 or not status_line[9:12].isdigit():
            self._fail_head(BrokenBody(f"not an HTTP/1.1 answer: {status_line[:80]!r}"))
            return None
        status = int(status_line[9:12])
        rest = buf[end + 4:]
        if 100 <= status < 200 and status != 101:     # 100 Continue and its kind: the answer follows
            return self._parse_head(rest) if rest else None
        headers = CIMultiDict()
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                self._fail_head(BrokenBody(f"a malformed header line in an answer: {line[:80]!r}"))
                return None
            headers.add(name.decode("latin-1"), value.strip().decode("utf-8", "surrogateescape"))
        self.status = status
        self.headers = CIMultiDictProxy(headers)
        keep = status_line.startswith(b"HTTP/1.1") and "close" not in headers.get("Connection", "").lower()
        coding = headers.get("Transfer-Encoding")
        length = headers.get("Content-Length")
        if self._head_only or status in _NO_BODY:
            self._mode = _NONE
        elif coding is not None:
            if coding.lower().rsplit(",", 1)[-1].strip() != "chunked":
                self._mode, keep = _TO_CLOSE, False
            else:
                self._mode = _CHUNKED
        elif length is not None:
            try:
                self._left = self.content_length = int(length)
            except ValueError:
                self._fail_head(BrokenBody(f"an answer's Content-Length is not a number: {length[:40]!r}"))
                return None
            if self._left < 0:
                self._fail_head(BrokenBody("an answer's Content-Length is negative"))
                return None
            self._mode = _LENGTH
        else:
            self._mode, keep = _TO_CLOSE, False
        self._keep = keep
        if self._headed is not None and not self._headed.done():
            self._headed.set_result(None)
        if self._mode == _NONE or (self._mode == _LENGTH and self._left == 0):
            self._done()
        return rest

    # The body.

    def feed(self, data: bytes) -> None:
        if self._eof or self._exc is not None:
            self._keep = False       # bytes past the answer's end
            return
        if self.headers is None:
            data = self._parse_head(data)
            if not data:
                return
            if self._eof:                # an answer without a body, and bytes after it
                self._keep = False
                return
        mode = self._mode
        if mode == _CHUNKED:
            data = self._dechunk(data)
        elif mode == _LENGTH:
            if len(data) >= self._left:
                if len(data) > self._left:
                    data = data[:self._left]
                    self._keep = False
                self._left = 0
                self._push(data)
                self._done()
                return
            self._left -= len(data)
        if data:
            self._push(data)

    def _push(self, data: bytes) -> None:
        if not data:
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size > BUFFERED_BYTES and not self._paused and not self.conn.lost:
            self._paused = True
            self.conn.transport.pause_reading()
        self._wake()

    def _done(self) -> None:
        """The body is whole: the connection may serve another request (when reusable says so)."""
        self._eof = True
        self._wake()

    def _dechunk(self, data: bytes) -> bytes:
        """A chunked body's data in data (RFC 9112 7.1), decoded as far as it goes; the rest kept for the next
        read. Whole chunks (a size line of hex digits, the data, CRLF: an engine's event each) take one
        turn of one loop; a chunk cut by a read, extensions and trailers go the longer way."""
        if self._raw:
            data = self._raw + data
            self._raw = b""
        out = []
        pos, n = 0, len(data)
        if self._chunk == _DATA:        # the rest of a chunk begun in an earlier read
            if self._left > n:
                self._left -= n
                return data
            out.append(data[:self._left])
            pos, self._chunk = self._left, _CRLF
        if self._chunk == _CRLF:
            if n - pos < 2:
                self._raw = data[pos:]
                return _joined(out)
            if not data.startswith(b"\r\n", pos):
                return self._bad_chunk("a chunk not followed by CRLF")
            pos, self._chunk = pos + 2, _SIZE
        find = data.find
        while self._chunk == _SIZE:
            eol = find(b"\r\n", pos)
            if eol < 0:
                return self._partial_line(data[pos:], CHUNK_LINE_BYTES, "a chunk's size line", out)
            line = data[pos:eol]
            if not line.isalnum():      # extensions (`;name=value`) or spaces: the size is what comes first
                line = line.split(b";", 1)[0].strip()
                if not line.isalnum():
                    return self._bad_chunk(f"a chunk's size is not a number: {line[:20]!r}")
            try:
                size = int(line, 16)
            except ValueError:
                return self._bad_chunk(f"a chunk's size is not a number: {line[:20]!r}")
            start = eol + 2
            if size == 0:
                pos, self._chunk = start, _TRAILER
                break
            end = start + size
            if end + 2 <= n:
                if not data.startswith(b"\r\n", end):
                    return self._bad_chunk("a chunk not followed by CRLF")
                out.append(data[start:end])
                pos = end + 2
            elif end <= n:              # its data whole, its CRLF in the next read
                out.append(data[start:end])
                self._raw, self._chunk = data[end:], _CRLF
                return _joined(out)
            else:                       # its data goes on in the next read
                out.append(data[start:])
                self._chunk, self._left = _DATA, end - n
                return _joined(out)
        while self._chunk == _TRAILER:
            eol = find(b"\r\n", pos)
            if eol < 0:
                return self._partial_line(data[pos:], HEAD_BYTES, "a trailer", out)
            if eol == pos:              # the empty line: the body's end
                self._chunk = _END
                if eol + 2 < n:
                    self._keep = False
                self._push(_joined(out))
                self._done()
                return b""
            pos = eol + 2
        return _joined(out)

    def _partial_line(self, rest: bytes, most: int, what: str, out: list[bytes]) -> bytes:
        """A line that this read cut: kept for the next, unless longer than most already; out, decoded."""
        if len(rest) > most:
            return self._bad_chunk(f"{what} too long")
        self._raw = rest
        return _joined(out)

    def _bad_chunk(self, why: str) -> bytes:
        self.set_exception(BrokenBody(f"a broken chunked answer: {why}"))
        self.conn.close()
        return b""

    def feed_eof(self) -> None:
        """The backend closed its side: the end of a body read to the close, else a broken answer."""
        if self.headers is None:
            self._fail_head(Disconnected("the backend closed the connection before answering"))
        elif not self._eof:
            if self._mode == _TO_CLOSE:
                self._eof = True
                self._wake()
            else:
                self.set_exception(BrokenBody("the backend closed the connection before the answer's end"))
        self._keep = False

    def lost(self, exc: Exception | None) -> None:
        if self.headers is None:
            if exc is None:
                self._fail_head(Disconnected("the backend closed the connection before answering"))
            else:
                self._fail_head(Broken(f"{type(exc).__name__}: {exc}"))
        elif not self._eof:
            if exc is None and self._mode == _TO_CLOSE:
                self._eof = True
                self._wake()
            else:
                why = "the backend closed the connection" if exc is None else f"{type(exc).__name__}: {exc}"
                self.set_exception(BrokenBody(f"{why} before the answer's end"))
        self._keep = False

    def set_exception(self, exc: BaseException) -> None:
        """End the read under way (and any after it) with exc; the connection is not reused."""
        if self._eof and not self._chunks and self._exc is None and self.headers is not None:
            return          # read whole already: nothing is under way to end
        self._keep = False
        if self.headers is None:
            self._fail_head(exc)
            return
        if self._exc is None:     # the first says why (the stall watch's, not the close that followed it)
            self._exc = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def readany(self) -> bytes:
        """What has come of the body (at least a byte), b"" at its end."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                chunks = self._chunks
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._size = 0
                if self._paused:
                    self._paused = False
                    if not self.conn.lost:
                        self.conn.transport.resume_reading()
                return data
            if self._eof:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def iter_any(self) -> _Chunks:
        """`async for data in answer.content.iter_any()`: the body as it comes."""
        return _Chunks(self)

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)


def _joined(parts: list[bytes]) -> bytes:
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Chunks:
    __slots__ = ("answer",)

    def __init__(self, answer: Answer):
        self.answer = answer

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        data = await self.answer.readany()
        if not data:
            raise StopAsyncIteration
        return data
