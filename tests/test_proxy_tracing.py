"""What the proxy tells about each request beyond the answer: its time to first byte and output tokens
(histograms by backend), its W3C trace (traceparent in, to the backends, X-Trace-Id out, the results
log) and, with otlp.endpoint, its spans received by a real OTLP/HTTP decoder."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import statistics
import time
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from conftest import wait_until
from otlp_helpers import Collector, Servers, attrs, environ_tag, exporters_of
from proxy_helpers import start_proxy, start_sims
from proxy import tracing
from proxy.config import ConfigError, parse_config

CHAT = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"id": "c", "object": "chat.completion", "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


# ---------------------------------------------------------------------------------------------- helpers

@pytest.fixture
def servers():
    s = Servers()
    yield s
    s.close()


class FakeEngines:
    """Backends that answer a chat completion (with usage) and record the headers of each request; with
    fail_first, the first attempt of every trace answers 503 whichever backend gets it (a retry)."""

    def __init__(self, servers: Servers, n: int, fail_first: bool = False):
        self.seen: list[tuple[int, dict]] = []    # (port, headers) per /v1 request
        self.raw: list[tuple[tuple[bytes, bytes], ...]] = []   # each /v1 request's header lines as sent
        self.fail_first = fail_first
        self.attempts: dict[str, int] = {}       # trace id -> attempts seen
        self.ports = [servers.serve(self._app(i)) for i in range(n)]

    def _app(self, i: int) -> web.Application:
        app = web.Application()

        async def health(request):
            return web.json_response({})

        async def chat(request):
            await request.read()
            port = request.transport.get_extra_info("sockname")[1]
            self.seen.append((port, dict(request.headers)))
            self.raw.append(request.raw_headers)
            trace = request.headers.get("traceparent", "").split("-")[1:2]
            n = self.attempts[trace[0] if trace else ""] = self.attempts.get(trace[0] if trace else "", 0) + 1
            if self.fail_first and n == 1:
                return web.json_response({"error": "busy"}, status=503)
            return web.json_response(COMPLETION)
        app.router.add_get("/health", health)
        app.router.add_post("/v1/chat/completions", chat)
        return app


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def results(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples of name whose labels include labels."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:]+)(\{[^}]*\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


# ---------------------------------------------------------------------------------------------- unit

@pytest.mark.unit
@pytest.mark.parametrize("value, expected", [
    (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", (CLIENT_TRACE, CLIENT_SPAN, "01")),
    (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00", (CLIENT_TRACE, CLIENT_SPAN, "00")),
    (f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-future", (CLIENT_TRACE, CLIENT_SPAN, "01")),   # a later version
    (f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01", (CLIENT_TRACE, CLIENT_SPAN, "01")),
    (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-x", None),          # version 00 has exactly four fields
    (f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01", None),            # version ff is invalid
    (f"00-{'0' * 32}-{CLIENT_SPAN}-01", None),                # all-zero trace id
    (f"00-{CLIENT_TRACE}-{'0' * 16}-01", None),               # all-zero parent id
    (f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01", None),    # uppercase hex
    (f"00-{CLIENT_TRACE[:-1]}-{CLIENT_SPAN}-01", None),       # short trace id
    (f"00_{CLIENT_TRACE}_{CLIENT_SPAN}_01", None),
    (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-0g", None),
    ("", None), (None, None), ("garbage", None),
])
def test_traceparent_is_read_as_the_w3c_spec_says(value, expected):
    assert tracing.parse_traceparent(value) == expected


@pytest.mark.unit
def test_new_ids_are_lowercase_hex_and_distinct():
    traces = {tracing.new_trace_id() for _ in range(1000)}
    spans = {tracing.new_span_id() for _ in range(1000)}
    assert len(traces) == 1000 and len(spans) == 1000
    assert all(re.fullmatch("[0-9a-f]{32}", t) and t != "0" * 32 for t in traces)
    assert all(re.fullmatch("[0-9a-f]{16}", s) and s != "0" * 16 for s in spans)


@pytest.mark.unit
@pytest.mark.parametrize("otlp, message", [
    ({"endpoint": "127.0.0.1:4318"}, "otlp.endpoint must be an http:// or https:// URL"),
    ({"endpoint": "ftp://x/v1/traces"}, "otlp.endpoint must be an http:// or https:// URL"),
    ({"endpoint": "http://host:port/v1/traces"}, "otlp.endpoint must be an http:// or https:// URL"),
    ({"endpoint": "http://c:4318/v1/traces", "timeout_s": 0}, "otlp.timeout_s must be a finite number"),
    ({"endpont": "http://c:4318/v1/traces"}, "unknown config key 'otlp.endpont'"),
    ({"endpoint": "http://c:4318/v1/traces", "sample_ratio": 1.5}, "otlp.sample_ratio must be a number from 0 to 1"),
])
def test_otlp_config_refuses_bad_values_in_one_sentence(otlp, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"backends": ["127.0.0.1:9"], "otlp": otlp})


@pytest.mark.unit
def test_otlp_config_empty_endpoint_is_off():
    assert parse_config({"backends": ["127.0.0.1:9"], "otlp": {"endpoint": ""}}).otlp.endpoint is None
    assert parse_config({"backends": ["127.0.0.1:9"]}).otlp.endpoint is None


@pytest.mark.unit
def test_proxy_without_the_sdk_refuses_the_endpoint_in_one_sentence(monkeypatch):
    """The SDK is an optional import: absent, a configured endpoint is refused naming the package."""
    import builtins
    from proxy import otlp
    real = builtins.__import__

    def no_otel(name, *args, **kw):
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_otel)
    message = otlp.missing()
    assert message and "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match="lacks the OpenTelemetry SDK"):
        otlp.SpanExport(parse_config({"backends": ["127.0.0.1:9"],
                                      "otlp": {"endpoint": "http://127.0.0.1:9/v1/traces"}}).otlp)


# ---------------------------------------------------------------------------------------------- process

@pytest.mark.process
def test_histograms_count_by_backend(procs, tmp_path):
    """1. two sim backends, least_conn (round robin on ties); 2. six chat completions, three streamed with
    usage asked for; 3. /metrics: proxy_time_to_first_byte_seconds and proxy_output_tokens count each
    backend's answers, the model label empty in the plain form (no label, to Prometheus), and the tokens
    sum is what the answers' usage said."""
    ports = start_sims(procs, tmp_path, 2, token_ms=1)
    port, _ = start_proxy(procs, tmp_path, ports, routing={"policy": "least_conn"})
    url = f"http://127.0.0.1:{port}"
    tokens = 0
    by_backend: dict[str, int] = {}
    for i in range(6):
        body = {**CHAT, "max_tokens": 3 + i}
        if i % 2:
            body.update(stream=True, stream_options={"include_usage": True})
        status, headers, data = post(url + "/v1/chat/completions", body)
        assert status == 200
        by_backend[headers["X-Backend"]] = by_backend.get(headers["X-Backend"], 0) + 1
        tokens += 3 + i     # the sim answers max_tokens tokens (its natural length is longer)
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    assert len(by_backend) == 2
    for backend, n in by_backend.items():
        assert metric(text, "proxy_time_to_first_byte_seconds_count", backend=backend) == n
        assert metric(text, "proxy_output_tokens_count", backend=backend) == n
    assert metric(text, "proxy_output_tokens_sum") == tokens
    # The plain form's model label is empty, which Prometheus stores as no label at all.
    assert metric(text, "proxy_output_tokens_count", model="") == 6
    assert metric(text, "proxy_time_to_first_byte_seconds_bucket", le="+Inf") == 6


@pytest.mark.process
def test_trace_across_a_retry_reaches_the_collector(procs, tmp_path, servers):
    """1. two backends that answer the first attempt of each trace 503, the next 200; a collector
    (OTLP/HTTP, decoded by opentelemetry-proto); 2. a request with the client's traceparent: retried on the
    other backend, 200; 3. the collector gets one trace: the SERVER span's parent is the client's span,
    both CLIENT (attempt) spans' parent is the SERVER span, and the traceparent each backend received
    names its attempt's span; X-Trace-Id and the results log's otel_trace_id say the same trace id;
    tracestate passed through untouched."""
    engines = FakeEngines(servers, 2, fail_first=True)
    collector = Collector(servers)
    port, _ = start_proxy(procs, tmp_path, engines.ports, otlp={"endpoint": collector.url})
    status, headers, _ = post(f"http://127.0.0.1:{port}/v1/chat/completions", {**CHAT, "user": "u-1"},
                              {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "k=v"})
    assert status == 200 and headers["X-Retries"] == "1" and headers["X-Trace-Id"] == CLIENT_TRACE
    spans = wait_until(lambda: len(collector.of_trace(CLIENT_TRACE)) >= 3 and collector.of_trace(CLIENT_TRACE),
                       what="the request's spans at the collector")
    assert len(spans) == 3 and {s.trace_id.hex() for s in spans} == {CLIENT_TRACE}
    server = [s for s in spans if s.kind == s.SPAN_KIND_SERVER]
    attempts = sorted((s for s in spans if s.kind == s.SPAN_KIND_CLIENT), key=lambda s: s.start_time_unix_nano)
    assert len(server) == 1 and len(attempts) == 2
    server = server[0]
    assert server.parent_span_id.hex() == CLIENT_SPAN and server.name == "POST /v1/chat/completions"
    assert all(a.parent_span_id == server.span_id for a in attempts)
    # Each backend got its attempt's span as the parent, in the one trace; tracestate as the client sent it.
    sent = [h for _, h in engines.seen]
    assert [h["traceparent"] for h in sent] == [f"00-{CLIENT_TRACE}-{a.span_id.hex()}-01" for a in attempts]
    assert all(h["tracestate"] == "k=v" for h in sent)
    a = attrs(server)
    assert a["http.response.status_code"] == 200 and a["proxy.retries"] == 1
    assert a["gen_ai.usage.output_tokens"] == 7 and a["gen_ai.usage.input_tokens"] == 5
    assert a["proxy.backend"] == headers["X-Backend"] and a["proxy.request_id"] == headers["X-Request-Id"]
    assert "proxy.time_to_first_byte_ms" in a and "proxy.queue_wait_ms" in a
    assert [attrs(x)["http.response.status_code"] for x in attempts] == [503, 200]
    assert attempts[0].status.code == attempts[0].status.STATUS_CODE_ERROR
    assert server.start_time_unix_nano <= attempts[0].start_time_unix_nano < attempts[1].end_time_unix_nano \
        <= server.end_time_unix_nano
    # The results log: both attempts' lines carry the trace id, beside the user's trace_id.
    path = tmp_path / "req_results.log"
    lines = wait_until(lambda: len(results(path)) >= 2 and results(path), what="two results-log lines")
    assert [(x["status"], x["otel_trace_id"], x["trace_id"]) for x in lines] == [
        (503, CLIENT_TRACE, "u-1"), (200, CLIENT_TRACE, "u-1")]


@pytest.mark.process
def test_the_clients_key_and_ids_reach_the_engine_once_however_spelled(procs, tmp_path, servers):
    """With API keys, the client's key stays with the proxy whatever the header's spelling
    (`authorization`), and the engine gets one X-Request-Id (the client's) and one traceparent (the
    attempt's), not the client's lowercase copies beside the proxy's."""
    import http.client
    engines = FakeEngines(servers, 1)
    (tmp_path / "keys").write_text("sk-spelled\n")
    port, _ = start_proxy(procs, tmp_path, engines.ports, api_keys_file=str(tmp_path / "keys"))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps(CHAT).encode()
    conn.putrequest("POST", "/v1/chat/completions")
    for name, value in (("content-type", "application/json"), ("authorization", "Bearer sk-spelled"),
                        ("x-request-id", "rid-spelled"), ("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),
                        ("content-length", str(len(body)))):
        conn.putheader(name, value)
    conn.endheaders(body)
    answer = conn.getresponse()
    assert answer.status == 200, answer.read()
    answer.read()
    conn.close()
    [lines] = engines.raw
    names = [n.decode().lower() for n, _ in lines]
    assert "authorization" not in names, lines
    assert names.count("x-request-id") == 1 and names.count("traceparent") == 1, lines
    assert dict((n.decode().lower(), v.decode()) for n, v in lines)["x-request-id"] == "rid-spelled"


@pytest.mark.process
def test_absent_or_invalid_traceparent_starts_a_trace(procs, tmp_path, servers):
    """1. one backend, no export; 2. no traceparent, then an invalid one (all-zero trace id): each
    answer's X-Trace-Id is a new trace, which the backend's traceparent carries with a span of the proxy's;
    3. a valid traceparent with flags 00 keeps its trace and flags; 4. the proxy's own answers (401
    without the API key) carry X-Trace-Id too."""
    engines = FakeEngines(servers, 1)
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    port, _ = start_proxy(procs, tmp_path, engines.ports, api_keys_file=str(keys))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    auth = {"Authorization": "Bearer k1"}
    seen = []
    for extra in ({}, {"traceparent": f"00-{'0' * 32}-{CLIENT_SPAN}-01"}, {"traceparent": "00-xyz"}):
        status, headers, _ = post(url, CHAT, {**auth, **extra})
        assert status == 200
        trace = headers["X-Trace-Id"]
        assert re.fullmatch("[0-9a-f]{32}", trace) and trace != "0" * 32
        version, sent_trace, parent, flags = engines.seen[-1][1]["traceparent"].split("-")
        assert (version, sent_trace, flags) == ("00", trace, "01") and parent != CLIENT_SPAN
        seen.append(trace)
    assert len(set(seen)) == 3
    status, headers, _ = post(url, CHAT, {**auth, "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"})
    assert status == 200 and headers["X-Trace-Id"] == CLIENT_TRACE
    assert engines.seen[-1][1]["traceparent"].startswith(f"00-{CLIENT_TRACE}-")
    assert engines.seen[-1][1]["traceparent"].endswith("-00")
    status, headers, _ = post(url, CHAT, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert status == 401 and headers["X-Trace-Id"] == CLIENT_TRACE


def lingering_engine(servers: Servers) -> int:
    """A backend that streams an answer: one chunk, 0.3 s, the rest and `data: [DONE]`, then holds the
    stream open 2 s before ending it."""
    app = web.Application()

    async def health(request):
        return web.json_response({})

    async def chat(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "one"}}]}\n\n')
        await asyncio.sleep(0.3)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": " two"}, "finish_reason": '
                         b'"stop"}]}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 9, '
                         b'"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
        await asyncio.sleep(2)
        try:
            await resp.write_eof()
        except ConnectionResetError:   # the proxy let it go when its client left
            pass
        return resp
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    return servers.serve(app)


@pytest.mark.process
def test_a_client_that_leaves_mid_stream_is_a_499_span(procs, tmp_path, servers):
    """A client that hangs up after the first chunk: the server span and its attempt say 499, the
    client went away (the attempt's backend had answered 200); one that hangs up once `data: [DONE]`
    reached it was served: 200, its tokens counted."""
    collector = Collector(servers)
    port, _ = start_proxy(procs, tmp_path, [lingering_engine(servers)], otlp={"endpoint": collector.url})
    body = json.dumps({**CHAT, "stream": True}).encode()
    traces = {}
    for kind, marker in (("half", b'"one"'), ("whole", b"data: [DONE]")):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while marker not in got:
                data = c.recv(65536)
                assert data, got
                got += data
            traces[kind] = re.search(rb"X-Trace-Id: (\w+)", got).group(1).decode()

    def spans(trace):
        found = collector.of_trace(trace)
        return len(found) == 2 and found
    for kind, status in (("half", 499), ("whole", 200)):
        found = wait_until(lambda: spans(traces[kind]), timeout=15, what=f"the {kind} request's spans")
        server = next(s for s in found if s.kind == s.SPAN_KIND_SERVER)
        attempt = next(s for s in found if s.kind == s.SPAN_KIND_CLIENT)
        assert attrs(server)["http.response.status_code"] == status, (kind, attrs(server))
        assert attrs(attempt)["http.response.status_code"] == status, (kind, attrs(attempt))
        if status == 499:
            assert attempt.status.message == "the client went away", attempt.status
        else:
            assert attrs(server)["gen_ai.usage.output_tokens"] == 2
            assert attempt.status.code != attempt.status.STATUS_CODE_ERROR


@pytest.mark.process
def test_sample_ratio_zero_exports_only_what_the_client_sampled(procs, tmp_path, servers):
    """1. export on with otlp.sample_ratio 0; 2. a request without traceparent: its trace goes to the
    backend with flags 00 (not sampled) and is not exported; 3. then one whose client sampled it (flags 01):
    exported. Its spans arrive after the first request's would have: so the first's were never recorded."""
    engines = FakeEngines(servers, 1)
    collector = Collector(servers)
    port, _ = start_proxy(procs, tmp_path, engines.ports, otlp={"endpoint": collector.url, "sample_ratio": 0})
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    status, headers, _ = post(url, CHAT)
    unsampled = headers["X-Trace-Id"]
    assert status == 200 and engines.seen[-1][1]["traceparent"].endswith("-00")
    status, headers, _ = post(url, CHAT, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert status == 200 and engines.seen[-1][1]["traceparent"].endswith("-01")
    wait_until(lambda: len(collector.of_trace(CLIENT_TRACE)) >= 2, what="the sampled request's spans")
    assert collector.of_trace(unsampled) == []


@pytest.mark.process
@pytest.mark.xdist_group("load")
def test_collector_down_costs_the_requests_nothing(procs, tmp_path, servers):
    """1. two proxies over the same two sims: one exporting to a closed loopback port with a 300 s export
    timeout (its exporter thread stuck in retries the whole run), one without export; 2. 1,000 requests
    through each, 16 at a time, the two runs interleaved in halves; 3. every request answered 200, each
    results log has its 1,000 lines; the ratio of the runs' times is printed (not asserted: this machine is
    shared; bench/bench_proxy.py measures it, docs/PERFORMANCE.md has the figures); 4. the exporting proxy
    stops at SIGTERM within 15 s: nothing waits on the collector."""
    sims = start_sims(procs, tmp_path, 2, token_ms=0)
    with socket_closed_port() as closed:
        on_dir, off_dir = tmp_path / "on", tmp_path / "off"
        on_dir.mkdir()
        off_dir.mkdir()
        on, _ = start_proxy(procs, on_dir, sims, otlp={"endpoint": f"http://127.0.0.1:{closed}/v1/traces",
                                                        "timeout_s": 300})
        off, _ = start_proxy(procs, off_dir, sims)
        proxy_on = procs.started[-2]
        times = {"on": [], "off": []}

        async def run(port: int, n: int) -> tuple[float, list[int]]:
            body = json.dumps({**CHAT, "max_tokens": 1}).encode()
            statuses: list[int] = []
            queue = iter(range(n))

            async def client(s):
                for _ in queue:
                    async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        statuses.append(r.status)
            t = time.monotonic()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                await asyncio.gather(*(client(s) for _ in range(16)))
            return time.monotonic() - t, statuses
        for half in range(2):
            for name, port in (("on", on), ("off", off)) if half == 0 else (("off", off), ("on", on)):
                took, statuses = asyncio.run(run(port, 500))
                assert statuses == [200] * 500, f"{name}: {sorted(set(statuses))}"
                times[name].append(took)
        for d in (on_dir, off_dir):
            wait_until(lambda: len(results(d / "req_results.log")) == 1000, what=f"1,000 lines in {d.name}")
        ratio = sum(times["on"]) / sum(times["off"])
        print(f"\ncollector down: 1,000 requests in {sum(times['on']):.2f} s with export on, "
              f"{sum(times['off']):.2f} s off: ratio {ratio:.3f} (halves {statistics.mean(times['on']):.2f} / "
              f"{statistics.mean(times['off']):.2f} s)")
        text = urllib.request.urlopen(f"http://127.0.0.1:{on}/metrics").read().decode()
        assert metric(text, "proxy_requests_total", status="200") == 1000
        t = time.monotonic()
        proxy_on.send_signal(signal.SIGTERM)
        proxy_on.wait(15)
        assert time.monotonic() - t < 15 and proxy_on.returncode == 0


class socket_closed_port:
    """A loopback port nothing listens on (bound, then closed: connections to it are refused)."""

    def __enter__(self) -> int:
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc) -> None:
        pass


@pytest.mark.process
def test_span_exporter_child_lives_with_the_proxy_and_is_restarted(procs, tmp_path, servers):
    """1. a proxy exporting to a collector, FLEET_TAG in its environment: one span exporter child runs
    (python -m proxy.otlp_export), carrying the proxy's tag; a request's spans arrive; 2. the child is
    killed (SIGKILL): the proxy says so in one line and starts another within RESTART_S and a bit, and a
    request made after it has its spans at the collector; 3. the proxy's SIGTERM: it exits 0 and its
    child is gone with it (no process left behind)."""
    import os
    engines = FakeEngines(servers, 1)
    collector = Collector(servers)
    tag = "test-host-abc/proxy"
    port, _ = start_proxy(procs, tmp_path, engines.ports, env_extra={"FLEET_TAG": tag},
                          otlp={"endpoint": collector.url})
    proxy = procs.started[-1]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    first = wait_until(lambda: exporters_of(proxy.pid), what="the span exporter child")
    assert len(first) == 1 and environ_tag(first[0]) == tag
    status, headers, _ = post(url, CHAT)
    assert status == 200
    wait_until(lambda: len(collector.of_trace(headers["X-Trace-Id"])) == 2, what="the first request's spans")

    os.kill(first[0], signal.SIGKILL)
    t = time.monotonic()
    second = wait_until(lambda: [p for p in exporters_of(proxy.pid) if p != first[0]], timeout=15,
                        what="a new span exporter")
    assert len(second) == 1 and time.monotonic() - t < 10
    assert exporters_of(proxy.pid) == second
    log = (tmp_path / "proxy.log").read_text()
    assert f"the span exporter (pid {first[0]}) was killed by signal 9" in log
    status, headers, _ = post(url, CHAT, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert status == 200
    spans = wait_until(lambda: len(collector.of_trace(CLIENT_TRACE)) == 2 and collector.of_trace(CLIENT_TRACE),
                       what="the spans of a request after the restart")
    assert {s.kind for s in spans} == {spans[0].SPAN_KIND_SERVER, spans[0].SPAN_KIND_CLIENT}

    proxy.send_signal(signal.SIGTERM)
    assert proxy.wait(15) == 0
    wait_until(lambda: not os.path.exists(f"/proc/{second[0]}") or
               open(f"/proc/{second[0]}/stat").read().rsplit(")", 1)[-1].split()[0] in ("Z", "X"),
               timeout=5, what="the span exporter gone after the proxy's stop")


@pytest.mark.process
def test_a_reload_turns_export_on_and_off_and_a_refused_one_starts_nothing(procs, tmp_path, servers):
    """SIGHUP with otlp.endpoint: 1. set, together with a results log path that cannot be written: the
    reload is refused, no span exporter is started, the running results log goes on; 2. set alone: an
    exporter child starts and a request's spans arrive; 3. unset: the child is stopped, requests go on."""
    import yaml
    engines = FakeEngines(servers, 1)
    collector = Collector(servers)
    port, _ = start_proxy(procs, tmp_path, engines.ports)
    proxy = procs.started[-1]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    conf_path = tmp_path / "proxy.yaml"
    conf = yaml.safe_load(conf_path.read_text())
    log = tmp_path / "proxy.log"

    def reload(**changes) -> None:
        before = log.read_text().count("reload")
        conf_path.write_text(yaml.safe_dump({**conf, **changes}))
        proxy.send_signal(signal.SIGHUP)
        wait_until(lambda: log.read_text().count("reload") > before, what="the reload's line")

    (tmp_path / "a-dir").mkdir()
    reload(otlp={"endpoint": collector.url}, results_log={"path": str(tmp_path / "a-dir")})
    assert "reload refused, the running config stays" in log.read_text()
    assert exporters_of(proxy.pid) == []
    assert post(url, CHAT)[0] == 200
    wait_until(lambda: len(results(tmp_path / "req_results.log")) == 1, what="the running results log's line")

    reload(otlp={"endpoint": collector.url})
    wait_until(lambda: exporters_of(proxy.pid), what="the span exporter child")
    status, headers, _ = post(url, CHAT)
    assert status == 200
    wait_until(lambda: len(collector.of_trace(headers["X-Trace-Id"])) == 2, what="the request's spans")

    reload()
    wait_until(lambda: exporters_of(proxy.pid) == [], timeout=10, what="the span exporter stopped")
    status, headers, _ = post(url, CHAT)
    assert status == 200 and not collector.of_trace(headers["X-Trace-Id"])


@pytest.mark.unit
def test_a_reload_whose_span_exporter_cannot_start_changes_nothing(tmp_path, monkeypatch):
    """The exporter cannot start (its writer thread cannot be had; a process that cannot be had is
    retried by that thread): the reload is refused, the running config, results log and (absent) export
    stay, and the new results log made for it is let go."""
    from proxy import state as state_mod
    path = tmp_path / "proxy.yaml"
    path.write_text(f"backends: [127.0.0.1:9]\nresults_log: {{path: {tmp_path / 'a.log'}}}\n")
    proxy = state_mod.Proxy(state_mod.load_config(path), str(path))
    stopped = []
    monkeypatch.setattr(state_mod.SpanExport, "start", lambda self: (_ for _ in ()).throw(RuntimeError("can't start new thread")))
    monkeypatch.setattr(state_mod.ResultsLog, "stop", lambda self: stopped.append(self.config.path))
    path.write_text(f"backends: [127.0.0.1:9]\nresults_log: {{path: {tmp_path / 'b.log'}}}\n"
                    "otlp: {endpoint: 'http://127.0.0.1:9/v1/traces'}\n")
    running = proxy.results
    assert proxy.reload() is False
    assert proxy.spans is None and proxy.results is running and proxy.config.otlp.endpoint is None
    wait_until(lambda: stopped, what="the new results log let go")
    assert stopped == [str(tmp_path / "b.log")]
