"""The proxy's own HTTP/1.1 client (proxy/upstream.py) against scripted servers on 127.0.0.1: what it sends,
how it reads every framing of an answer, when it keeps a connection and when not, and how each failure is
named (proxy/forward.py names the results log's `upstream_error` kinds by these)."""
from __future__ import annotations

import asyncio

import pytest

from proxy.upstream import (
    BUFFERED_BYTES, Answer, Broken, BrokenBody, ConnectTimeout, Disconnected, Unreachable, Upstream, _Connection)

pytestmark = pytest.mark.unit


class Server:
    """A server on 127.0.0.1 that reads each request (head and Content-Length body) and answers it with
    what answer(request_head, body) returns (bytes; None: close without answering), counting connections."""

    def __init__(self, answer):
        self.answer, self.connections, self.requests = answer, 0, []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                out = self.answer(head, body)
                if out is None:
                    break
                for part in out if isinstance(out, list) else [out]:
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                        continue
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def call(upstream, base, method="POST", target="/v1/chat/completions", body=b'{"a": 1}', timeout_s=5.0,
               headers=None, read=True):
    async with upstream.request(method, base, target, headers or {"Content-Type": "application/json"}, body,
                                timeout_s, 2.0) as up:
        return up.status, up.headers, (await up.read() if read else None)


def test_the_request_goes_as_one_head_and_body_with_host_and_length():
    async def main():
        async with Server(lambda h, b: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") as server:
            upstream = Upstream()
            status, headers, body = await call(upstream, server.base, target="/v1/x?y=%20z",
                                               headers={"X-Request-Id": "r1", "X-Note": "caf\u00e9"})
            await upstream.close()
            head, sent = server.requests[0]
            lines = head.decode("utf-8").split("\r\n")
            assert lines[0] == "POST /v1/x?y=%20z HTTP/1.1"
            assert f"Host: {server.base[7:]}" in lines and "X-Request-Id: r1" in lines
            assert "X-Note: caf\u00e9" in lines and "Content-Length: 8" in lines
            assert sent == b'{"a": 1}' and (status, body) == (200, b"ok")
            assert headers["content-length"] == "2"
    run(main())


@pytest.mark.parametrize("answer, connections", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 1),                            # kept alive
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", 3),      # the backend says so
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 3),                            # HTTP/1.0
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", 3),                       # bytes past the answer
])
def test_a_connection_is_kept_only_when_it_can_serve_another(answer, connections):
    async def main():
        async with Server(lambda h, b: answer) as server:
            upstream = Upstream()
            for _ in range(3):
                assert (await call(upstream, server.base))[2] == b"ok"
            await upstream.close()
            assert server.connections == connections and len(server.requests) == 3
    run(main())


def test_an_answer_left_unread_closes_its_connection():
    async def main():
        async with Server(lambda h, b: b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234") as server:
            upstream = Upstream()
            for _ in range(2):
                async with upstream.request("POST", server.base, "/", {}, b"x", 5, 2) as up:
                    assert await up.content.readany() == b"01234"     # half of it: then left
            await upstream.close()
            assert server.connections == 2
    run(main())


def test_an_idle_connection_older_than_the_keepalive_is_not_reused():
    async def main():
        async with Server(lambda h, b: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") as server:
            upstream = Upstream(keepalive_s=0.2)
            await call(upstream, server.base)
            await asyncio.sleep(0.3)
            await call(upstream, server.base)
            await call(upstream, server.base)
            await upstream.close()
            assert server.connections == 2
    run(main())


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"6\r\ndata: \r\n18;ext=1\r\n{\"a\": 1}\n\ndata: [DONE]\n\n\r\n0\r\nX-Trailer: t\r\n\r\n")
DECODED = b"data: {\"a\": 1}\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(CHUNKED)])
def test_a_chunked_answer_is_decoded_however_its_bytes_are_cut(size):
    async def main():
        parts = []
        for i in range(0, len(CHUNKED), size):
            parts += [CHUNKED[i:i + size], 0.001]
        async with Server(lambda h, b: parts) as server:
            upstream = Upstream()
            async with upstream.request("POST", server.base, "/", {}, b"x", 5, 2) as up:
                got = [chunk async for chunk in up.content.iter_any()]
                assert up.reusable
            assert b"".join(got) == DECODED
            assert (await call(upstream, server.base, read=False))[0] == 200
            await upstream.close()
            assert server.connections == 1      # read whole, trailer and all: kept
    run(main())


def test_a_100_continue_before_the_answer_is_passed_over():
    async def main():
        async with Server(lambda h, b: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\n"
                                       b"Content-Length: 1\r\n\r\nx") as server:
            upstream = Upstream()
            assert (await call(upstream, server.base))[0::2] == (201, b"x")
            await upstream.close()
    run(main())


def test_an_answer_read_to_the_close():
    async def main():
        async with Server(lambda h, b: [b"HTTP/1.1 200 OK\r\n\r\nall of ", b"it", None]) as server:
            upstream = Upstream()
            assert (await call(upstream, server.base))[2] == b"all of it"
            await upstream.close()
    run(main())


def test_a_head_answer_and_a_204_have_no_body():
    async def main():
        async with Server(lambda h, b: b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n") as server:
            upstream = Upstream()
            assert (await call(upstream, server.base))[0::2] == (204, b"")
            assert (await call(upstream, server.base, method="HEAD", body=None))[0::2] == (204, b"")
            await upstream.close()
            assert server.connections == 1
    run(main())


@pytest.mark.parametrize("answer, kind", [
    ([None], Disconnected),                                                   # closed before answering
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234", None], BrokenBody),    # closed mid-body
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], BrokenBody),  # not a chunk size
    ([b"SSH-2.0-OpenSSH\r\n\r\n"], BrokenBody),                               # not HTTP
])
def test_each_failure_is_named(answer, kind):
    async def main():
        async with Server(lambda h, b: answer) as server:
            upstream = Upstream()
            with pytest.raises(kind):
                await call(upstream, server.base)
            await upstream.close()
    run(main())


def test_a_reset_before_the_answer_is_broken():
    async def main():
        async def reset(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            sock = writer.get_extra_info("socket")
            import socket
            import struct
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        server = await asyncio.start_server(reset, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        upstream = Upstream()
        with pytest.raises(Broken):
            await call(upstream, f"http://127.0.0.1:{port}", body=None, method="GET")
        server.close()
        await upstream.close()
    run(main())


def test_no_listener_is_unreachable_and_a_silent_address_a_connect_timeout():
    async def main():
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        upstream = Upstream()
        with pytest.raises(Unreachable) as e:
            await call(upstream, f"http://127.0.0.1:{port}")
        assert isinstance(e.value.os_error, OSError)
        # A listener whose queue is full and never accepts: the SYN goes unanswered.
        blocked = socket.socket()
        blocked.bind(("127.0.0.1", 0))
        blocked.listen(0)
        fillers = []
        try:
            for _ in range(8):
                f = socket.socket()
                f.setblocking(False)
                f.connect_ex(blocked.getsockname())
                fillers.append(f)
            async with upstream.request("GET", f"http://127.0.0.1:{blocked.getsockname()[1]}", "/", {}, None,
                                        5, 0.3) as up:
                pytest.fail(f"connected: {up.status}")
        except ConnectTimeout:
            pass
        finally:
            for f in fillers:
                f.close()
            blocked.close()
            await upstream.close()
    run(main())


@pytest.mark.parametrize("ended_by", ["the call's deadline", "set_exception"])
def test_a_read_under_way_ends_at_the_deadline_or_set_exception(ended_by):
    """The whole call is bounded by its timeout, the body's read included (proxy.timeout_s); the stall watch
    (proxy/forward.py _Watch) ends a read with set_exception."""
    async def main():
        async with Server(lambda h, b: [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01", 5.0]) as server:
            upstream = Upstream()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            deadline = 0.3 if ended_by == "the call's deadline" else 5.0
            async with upstream.request("POST", server.base, "/", {}, b"x", deadline, 2) as up:
                assert await up.content.readany() == b"01"
                if ended_by == "set_exception":
                    loop.call_later(0.05, up.content.set_exception, RuntimeError("stalled"))
                with pytest.raises(asyncio.TimeoutError if deadline < 1 else RuntimeError):
                    await up.content.readany()
            assert loop.time() - t0 < 2 and not up.reusable
            await upstream.close()
    run(main())


def test_a_large_answer_pauses_reading_until_it_is_taken():
    async def main():
        body = bytes(range(256)) * 8192      # 2 MiB
        async with Server(lambda h, b: b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body) as server:
            upstream = Upstream()
            async with upstream.request("POST", server.base, "/", {}, b"x", 5, 2) as up:
                for _ in range(200):
                    if up._paused:
                        break
                    await asyncio.sleep(0.01)
                assert up._paused
                await asyncio.sleep(0.1)        # paused: what is buffered stays about the bound
                assert up._size <= BUFFERED_BYTES + 256 * 1024 < len(body)
                assert await up.read() == body
            await upstream.close()
    run(main())


def test_bytes_on_an_idle_connection_close_it():
    """A connection in the pool is answering nobody: whatever comes on it means it cannot be trusted."""
    class Transport:
        closed = False

        def close(self):
            self.closed = True
    conn = _Connection(Upstream(), "http://x")
    conn.transport = Transport()
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\n")
    assert conn.lost and conn.transport.closed


def test_an_answer_whole_but_unread_and_paused_leaves_a_connection_that_reads_again():
    """An answer past the buffer's bound arrives whole, its reading paused, and is left unread (a stream's
    engine error: forward.py stops reading): the connection is kept with its reading resumed, and reads
    the next answer."""
    big = b"x" * (BUFFERED_BYTES * 2)
    base = "http://127.0.0.1:1"

    class Backend(_Transport):
        """The connection's transport: each request written is answered at once with the next answer."""

        def __init__(self, conn, answers):
            super().__init__()
            self.conn, self.answers = conn, answers

        def write(self, data):
            self.conn.data_received(next(self.answers))

    async def main():
        upstream = Upstream()
        conn = _Connection(upstream, base)
        conn.transport = Backend(conn, iter([b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big,
                                             b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]))
        upstream._keep(base, conn, asyncio.get_running_loop().time())
        async with upstream.request("POST", base, "/", {}, b"x", 5, 2) as up:
            assert up.reusable and conn.transport.paused    # all of it here, none of it taken
        assert not conn.transport.paused and upstream._idle[base] == [conn]
        async with upstream.request("POST", base, "/", {}, b"x", 5, 2) as up:
            assert await up.read() == b"ok"
    run(main())


def test_leaving_an_answer_mid_body_closes_its_connection():
    """A client gone mid-stream leaves its answer unread: the upstream connection is closed (vLLM sees
    the disconnect and aborts the request), not kept."""
    async def main():
        seen_eof = asyncio.Event()

        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(1)      # the body
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()
            if await reader.read(1) == b"":
                seen_eof.set()
            writer.close()
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        upstream = Upstream()
        async with upstream.request("POST", base, "/", {}, b"x", 5, 2) as up:
            assert await up.content.readany() == b"first"
        await asyncio.wait_for(seen_eof.wait(), 5)
        assert not upstream._idle.get(base)
        await upstream.close()
        server.close()
    run(main())


class _Transport:
    def __init__(self):
        self.closed = self.paused = False

    def close(self):
        self.closed = True

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


LENGTH_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world"


@pytest.mark.parametrize("answer, body", [(LENGTH_ANSWER, b"hello world"), (CHUNKED, DECODED)])
def test_every_cut_of_an_answer_reads_the_same(answer, body):
    """The answer fed in two reads cut at every byte (and in single bytes): the same status, body, end and
    reuse, exactly (no socket between: the cut is the test's, not the kernel's)."""
    cuts = [[answer[:i], answer[i:]] for i in range(1, len(answer))] + [[answer[i:i + 1] for i in range(len(answer))]]
    for parts in cuts:
        conn = _Connection(Upstream(), "http://x")
        conn.transport = _Transport()
        answer_ = Answer(conn, False, None)
        for part in parts:
            answer_.feed(part)
        assert answer_.status == 200 and b"".join(answer_._chunks) == body and answer_.reusable, parts
