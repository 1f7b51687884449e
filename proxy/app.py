"""The proxy's web applications: the public port (proxying, /health, /metrics) and the loopback admin port."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from datetime import datetime, timezone

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from .balancer import Backend, Balancer
from .config import ProxyConfig
from .results_log import LOGGED_PATHS, ResponseObserver, ResultsLog, trace_id_of

log = logging.getLogger("proxy")

# Hop-by-hop headers (RFC 9110 7.6.1) never cross the proxy; length and encoding are the proxy's own.
HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Proxy-Connection"))


def upstream_headers(headers) -> dict:
    """The client's headers as sent to the backend."""
    return {k: v for k, v in headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() not in ("host", "content-length")}


def downstream_headers(headers) -> dict:
    """The backend's headers as sent to the client."""
    return {k: v for k, v in headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"}


CONFIG = web.AppKey("config", ProxyConfig)
BALANCER = web.AppKey("balancer", Balancer)
SESSION = web.AppKey("session", aiohttp.ClientSession)
RESULTS = web.AppKey("results", ResultsLog)
METRICS = web.AppKey("metrics", object)


class Metrics:
    """The proxy's Prometheus metrics, in a registry of its own."""

    def __init__(self, balancer: Balancer):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("proxy_requests", "Proxied requests by backend and status",
                                ["backend", "status"], registry=r)
        self.duration = Histogram("proxy_request_duration_seconds", "Time to the last byte", ["backend"],
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        in_flight = Gauge("proxy_backend_in_flight", "Requests in flight per backend", ["backend"], registry=r)
        peak = Gauge("proxy_backend_peak_in_flight", "Peak in-flight per backend since start", ["backend"],
                     registry=r)
        healthy = Gauge("proxy_backend_healthy", "1 when the backend's /health answered 200", ["backend"],
                        registry=r)
        for b in balancer.backends.values():
            in_flight.labels(b.name).set_function(lambda b=b: b.in_flight)
            peak.labels(b.name).set_function(lambda b=b: b.peak_in_flight)
            healthy.labels(b.name).set_function(lambda b=b: 1 if b.healthy else 0)


def json_error(status: int, message: str, kind: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


async def proxy_handler(request: web.Request) -> web.StreamResponse:
    """Pick a backend, count the request on it, then read the body and stream the answer through."""
    app = request.app
    balancer, config = app[BALANCER], app[CONFIG]
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    backend = balancer.acquire()       # counted here, before the body is read (the seed's pile-up fix)
    if backend is None:
        return json_error(503, "no healthy backend is available; check `inv status`.", "no_backend",
                          {"X-Request-Id": request_id})
    t0 = time.monotonic()
    status = 0
    try:
        status = await _forward(request, backend, request_id, t0)
        return request["response"]
    finally:
        balancer.release(backend)
        metrics = app[METRICS]
        metrics.requests.labels(backend.name, str(status)).inc()
        metrics.duration.labels(backend.name).observe(time.monotonic() - t0)


async def _forward(request: web.Request, backend: Backend, request_id: str, t0: float) -> int:
    app = request.app
    config = app[CONFIG]
    ids = {"X-Backend": backend.name, "X-Request-Id": request_id}
    if (request.content_length or 0) > config.max_body_bytes:
        request["response"] = json_error(413, f"request body over {config.max_body_mb:g} MiB", "too_large", ids)
        return 413
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        request["response"] = json_error(413, f"request body over {config.max_body_mb:g} MiB", "too_large", ids)
        return 413
    logged = request.method == "POST" and request.path in LOGGED_PATHS
    headers = upstream_headers(request.headers)
    headers["X-Request-Id"] = request_id
    timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=config.connect_timeout_s)
    observer = None
    status = 0
    error = None
    try:
        async with app[SESSION].request(request.method, backend.url + request.path_qs, headers=headers,
                                        data=body or None, allow_redirects=False, timeout=timeout) as up:
            status = up.status
            streamed = up.headers.get("Content-Type", "").startswith("text/event-stream")
            observer = ResponseObserver(status, streamed) if logged else None
            resp = web.StreamResponse(status=up.status, headers={**downstream_headers(up.headers), **ids})
            await resp.prepare(request)
            request["response"] = resp
            async for chunk in up.content.iter_any():
                if observer is not None:
                    observer.feed(chunk)
                await resp.write(chunk)
            await resp.write_eof()
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as e:
        app[BALANCER].mark(backend, False, f"connect: {e}")      # passive ejection until the next good /health
        status, error = 502, f"backend {backend.name} failed: {e}"
        if "response" not in request:
            request["response"] = json_error(502, error, "upstream_error", ids)
    except asyncio.TimeoutError:
        status, error = 504, f"backend {backend.name} did not answer within {config.timeout_s:g}s"
        if "response" not in request:
            request["response"] = json_error(504, error, "upstream_timeout", ids)
    except (ConnectionResetError, aiohttp.ClientPayloadError) as e:
        error = f"stream interrupted: {e}"
        if "response" not in request:
            status = 502
            request["response"] = json_error(502, error, "upstream_error", ids)
    finally:
        if logged:
            entry = {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                     "trace_id": trace_id_of(body), "request_id": request_id, "backend": backend.name,
                     "path": request.path, "status": status,
                     "latency_ms": round((time.monotonic() - t0) * 1000, 1),
                     "stream": bool(observer and observer.streamed)}
            summary = observer.summary() if observer else {"error": error}
            if error and not summary.get("error"):
                summary["error"] = error
            entry.update(summary)
            app[RESULTS].write(entry)
    return status


async def health(request: web.Request) -> web.Response:
    """200 while at least one backend takes requests."""
    balancer = request.app[BALANCER]
    ok = balancer.available_count()
    return web.json_response({"status": "ok" if ok else "no healthy backend", "healthy": ok,
                              "total": len(balancer.backends)}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _check(session, backend: Backend, config: ProxyConfig) -> None:
    try:
        async with session.get(backend.url + config.health.path,
                               timeout=aiohttp.ClientTimeout(total=config.health.timeout_s)) as r:
            ok = r.status == 200
            err = None if ok else f"/health answered {r.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        ok, err = False, f"/health: {type(e).__name__}: {e}"
    if Balancer.mark(backend, ok, err):
        log.info("backend %s is now %s%s", backend.name, "healthy" if ok else "unhealthy",
                 "" if ok else f" ({err})")


async def health_loop(app: web.Application) -> None:
    """Active checks on /health (never /v1/models: vLLM answers it after its engine died)."""
    config, session = app[CONFIG], app[SESSION]
    while True:
        await asyncio.gather(*(_check(session, b, config) for b in app[BALANCER].backends.values()))
        await asyncio.sleep(config.health.interval_s)


async def _context(app: web.Application):
    app[SESSION] = aiohttp.ClientSession(auto_decompress=False,
                                         connector=aiohttp.TCPConnector(limit=0, limit_per_host=0))
    app[RESULTS].start()
    task = asyncio.create_task(health_loop(app))
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await app[SESSION].close()
    app[RESULTS].stop()


def make_app(config: ProxyConfig, balancer: Balancer | None = None) -> web.Application:
    """The public application: everything under /v1/ proxied, plus /health and /metrics."""
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[BALANCER] = balancer or Balancer(config.backends)
    app[METRICS] = Metrics(app[BALANCER])
    app[RESULTS] = ResultsLog(config.results_log)
    app.cleanup_ctx.append(_context)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/v1/{tail:.*}", proxy_handler)
    return app


def make_admin_app(balancer: Balancer) -> web.Application:
    """The admin application, served on the loopback admin port only."""
    admin = web.Application()
    admin[BALANCER] = balancer

    async def list_backends(request):
        return web.json_response([b.as_dict() for b in balancer.backends.values()])

    async def set_drain(request):
        b = balancer.backends.get(request.match_info["name"])
        if b is None:
            return json_error(404, f"no backend named {request.match_info['name']}", "not_found")
        b.drained = request.match_info["action"] == "drain"
        log.info("backend %s %s", b.name, "drained" if b.drained else "enabled")
        return web.json_response(b.as_dict())

    admin.router.add_get("/admin/backends", list_backends)
    admin.router.add_post("/admin/backends/{name}/{action:drain|enable}", set_drain)
    return admin
