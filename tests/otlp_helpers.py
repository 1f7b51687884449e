"""An OTLP/HTTP collector for the tests (decoded with opentelemetry-proto's classes), and aiohttp
applications served from a thread of their own."""
from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from hostagent import processes


class Servers:
    """aiohttp applications on free loopback ports, served by a thread of their own (the test's code
    blocks in wait_until and urllib while the proxy calls them)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def serve(self, app: web.Application) -> int:
        """Serve app on 127.0.0.1, a free port; its port."""
        async def start():
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            return runner.addresses[0][1]
        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        for runner in self.runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Collector:
    """An OTLP/HTTP receiver (POST /v1/traces, protobuf), decoded with opentelemetry-proto's classes."""

    def __init__(self, servers: Servers):
        pb = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
        self._pb = pb
        self.spans: list = []    # (resource attributes, span) pairs
        self.port = servers.serve(self._app())
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)

        async def traces(request):
            message = self._pb.ExportTraceServiceRequest()
            message.ParseFromString(await request.read())
            for rs in message.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((resource, s) for s in ss.spans)
            return web.Response(body=self._pb.ExportTraceServiceResponse().SerializeToString(),
                                content_type="application/x-protobuf")
        app.router.add_post("/v1/traces", traces)
        return app

    def of_trace(self, trace_id: str) -> list:
        return [s for _, s in self.spans if s.trace_id.hex() == trace_id]


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


def exporters_of(pid: int) -> list[int]:
    """The span exporter processes whose parent is pid (python -m proxy.otlp_export)."""
    return [p.pid for p in processes.snapshot().values()
            if p.alive and p.ppid == pid and "proxy.otlp_export" in p.cmdline.split()]


def environ_tag(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        for kv in f.read().split(b"\0"):
            if kv.startswith(b"FLEET_TAG="):
                return kv[len(b"FLEET_TAG="):].decode()
    return None

