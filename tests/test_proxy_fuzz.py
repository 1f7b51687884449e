"""Malformed requests over raw sockets: the proxy answers 4xx (or closes a connection it cannot frame),
never a 5xx of its own, and stays up for the next polite request."""
from __future__ import annotations

import json
import random
import socket
import time

import pytest

from conftest import wait_until
from proxy_helpers import results_lines, start_proxy, start_sims

CASES = 300          # the budget: a few hundred cases, a few seconds
SEED = 37


def _send(port: int, data: bytes, timeout: float = 1.0) -> bytes:
    """data sent as is (never half-closed: aiohttp takes that for a client gone); what came back before the
    server closed (every request says Connection: close) or went quiet for timeout (a body it still
    waits for), b"" when nothing."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass        # the server may close on a bad head before it reads all of it
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except OSError:
            pass
    return out


def _request(method="POST", target="/v1/chat/completions", headers=None, body=b"", version="HTTP/1.1") -> bytes:
    lines = [f"{method} {target} {version}".encode("latin-1", "replace")]
    heads = {"Host": "127.0.0.1", "Connection": "close", "Content-Length": str(len(body)),
             **(headers or {})}
    lines += [f"{k}: {v}".encode("latin-1", "replace") for k, v in heads.items() if v is not None]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       **fields}).encode()


WRONG = [None, 0, -1, 1.5, 1e308, True, "", "x" * 5000, [], [1, "a"], {}, {"a": {"b": []}}]
KEYS = ["model", "messages", "user", "stream", "prompt", "max_tokens"]


def _cases(rng: random.Random) -> list[bytes]:
    """Fixed cases over the request surface, then random mixes of them."""
    fixed = [
        _request(target="http://x/v1/chat/completions", body=_chat()),       # absolute form
        _request(target="http://x:abc/v1/chat/completions", body=_chat()),
        _request(method="OPTIONS", target="*"),                                # asterisk form
        _request(method="CONNECT", target="127.0.0.1:80"),                     # authority form
        _request(target="/v1/%63hat/completions", body=_chat()),
        _request(target="/v1/chat/completions%00", body=_chat()),
        _request(target="/v1/%zz", body=_chat()),
        _request(target="/v1/" + "a" * 9000, body=_chat()),
        _request(target="/v1/chat/completions?" + "q=" * 3000, body=_chat()),
        _request(headers={"Content-Length": "5\r\nContent-Length: 7"}, body=b"{}"),   # duplicate lengths
        _request(headers={"Content-Length": "-1"}, body=b"{}"),
        _request(headers={"Content-Length": "abc"}, body=b"{}"),
        _request(headers={"Content-Length": None, "Transfer-Encoding": "chunked, gzip"}, body=b"2\r\n{}\r\n0\r\n\r\n"),
        _request(headers={"Content-Length": None, "Transfer-Encoding": "chunked"}, body=b"zz\r\n{}\r\n0\r\n\r\n"),
        _request(headers={"Content-Length": None, "Transfer-Encoding": "chunked"}, body=b"ffffffffff\r\n{}"),
        _request(headers={"Content-Length": "10", "Transfer-Encoding": "chunked"}, body=b"2\r\n{}\r\n0\r\n\r\n"),
        _request(headers={"Content-Length": "100"}, body=b'{"model": "m"}'),    # short body
        _request(headers={"X-Big": "v" * 20000}, body=_chat()),
        _request(headers={"Authorization": "Bearer \xff\xfe"}, body=_chat()),
        _request(headers={"Authorization": "Basic " + "A" * 8000}, body=_chat()),
        _request(headers={"traceparent": "00-zz-yy-01"}, body=_chat()),
        _request(body=b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        _request(body=b"[" * 100_000 + b"]" * 100_000),
        _request(body=b'{"model": "m", "x": ' + b"[{" * 500 + b"}]" * 500 + b"}"),
        _request(body=b'{"model": "m", "messages": "\xff\xfe\xfd"}'),
        _request(body=b'{"model": "\\ud800", "user": "\\udfff", "messages": []}'),
        _request(body=b'{"model": "m", "user": "\\u0000", "messages": [{"role": "user", "content": "\\"\\\\"}]}'),
        _request(body=b'{"model": "m", "user": 1e999999}'),
        _request(body=b'{"model": "m", "user": 1' + b"0" * 5000 + b"}"),
        _request(body=json.dumps({"model": "m", "messages": [{"role": "user", "content": [{}] * 60_000}]}).encode()),
        _request(body=json.dumps({"model": "m", "messages": [{"role": "user", "content": ["a"] * 5000}]}).encode()),
        _request(version="HTTP/9.9", body=_chat()),
        _request(method="P\x00ST", body=_chat()),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),   # a TLS hello on the plain port
        b"GET /health\r\n\r\n",
    ]
    for key in KEYS:
        for value in WRONG:
            fixed.append(_request(body=_chat(**{key: value})))
    randomized = []
    pieces = [b"{", b"}", b"[", b"]", b'"', b"\\", b":", b",", b"\xff", b"\\u", b"0", b"null", b'"model"',
              b'"messages"', b'"user"', b'"content"', b'"m"']
    while len(fixed) + len(randomized) < CASES:
        kind = rng.random()
        if kind < 0.5:
            body = b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 200)))
            randomized.append(_request(body=b'{"model": "m", ' + body))
        elif kind < 0.8:
            body = bytearray(_chat(user=rng.choice(WRONG[:6])))
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            randomized.append(_request(body=bytes(body)))
        else:
            raw = bytearray(_request(body=_chat()))
            for _ in range(rng.randint(1, 3)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            randomized.append(bytes(raw))
    return fixed + randomized


@pytest.mark.process
def test_malformed_requests_get_4xx_never_a_5xx_of_the_proxys_own(procs, tmp_path):
    """1. Two sim engines behind the proxy. 2. A few hundred malformed requests (a fixed list over the request
    line, the headers, the body's framing and its JSON, then random mixes from a fixed seed), each on its
    own connection. 3. Every answer that comes is below 500, or a 5xx that carries X-Backend (an engine's,
    relayed); a connection closed without an answer is accepted where the request cannot be framed (aiohttp
    closes after its 400 or without one). 4. The proxy is up and serves a polite chat after them; the
    chat/completions it refused itself have results-log lines."""
    ports = start_sims(procs, tmp_path, 2)
    port, _ = start_proxy(procs, tmp_path, ports, slots=4)
    cases = _cases(random.Random(SEED))
    started, own_5xx = time.monotonic(), []
    for i, data in enumerate(cases):
        answer = _send(port, data)
        head = answer.split(b"\r\n\r\n", 1)[0]
        status_line = head.split(b"\r\n", 1)[0].split(b" ")
        if len(status_line) > 1 and status_line[1].isdigit() and int(status_line[1]) >= 500:
            if b"\r\nx-backend:" not in head.lower():
                own_5xx.append((i, data[:200], answer[:400]))
    assert not own_5xx, own_5xx[:3]
    assert time.monotonic() - started < 120
    polite = _send(port, _request(body=_chat()))
    assert polite.startswith(b"HTTP/1.1 200"), polite[:300]
    # The writer thread logs a request after its answer: wait for both refusals' lines, whole.
    refused = wait_until(lambda: (lambda r: r if any("proxy.limits.max_json_depth" in (e.get("error") or "")
                                                      for e in r) else None)(
        [e for e in results_lines(tmp_path / "req_results.log") if e["status"] == 400 and e.get("backend") is None]),
        timeout=10, what="the refused nested body's results-log line")
    assert any("proxy.limits.max_content_parts" in (e.get("error") or "") for e in refused)
