"""The proxy's web applications: the public port (proxying, /health, /metrics) and the loopback admin port."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import re

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .balancer import Backend, Balancer
from .config import ProxyConfig, keys_digest
from .forward import TRACE_ID, json_error, target, list_models, new_request_id, proxy_handler
from . import loop_lag, share
from .models import entries_of
from .routes import INFERENCE_ROUTES
from .state import PROXY, Proxy
from .upstream import KEEPALIVE_S, Upstream, upstream_socket

log = logging.getLogger("proxy")

# In /health and /admin/config: during a zero-gap restart two proxies share the port, and the host
# agent tells the new one from the old by this.
PID = os.getpid()


async def health(request: web.Request) -> web.Response:
    """200 while at least one backend takes requests."""
    router = request.app[PROXY].router
    ok = router.available_count()
    return web.json_response({"status": "ok" if ok else "no healthy backend", "healthy": ok,
                              "total": len(router.backends), "pid": PID}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    body = generate_latest(proxy.metrics.registry) if proxy.gather_metrics is None else await proxy.gather_metrics()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _check(proxy: Proxy, backend: Backend) -> None:
    config = proxy.config
    try:
        async with proxy.session.get(backend.url + config.health.path,
                                     timeout=aiohttp.ClientTimeout(total=config.health.timeout_s)) as r:
            ok = r.status == 200
            err = None if ok else f"/health answered {r.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        ok, err = False, f"/health: {type(e).__name__}: {e}"
    if ok and proxy.router.by_model:
        await read_models(proxy, backend)
    if ok and (backend.kv_tokens is None or not backend.healthy):
        await read_kv_capacity(proxy, backend)
    if proxy.router.mark(backend, ok, err):
        log.info("backend %s is now %s%s", backend.name, "healthy" if ok else "unhealthy",
                 "" if ok else f" ({err})")


async def read_models(proxy: Proxy, backend: Backend) -> None:
    """Learn what a backend serves from its /v1/models (its adapters loaded at runtime among them);
    on a failure what it listed last stays."""
    try:
        async with proxy.session.get(backend.url + "/v1/models",
                                     timeout=aiohttp.ClientTimeout(total=proxy.config.health.timeout_s)) as r:
            if r.status != 200:
                return
            payload = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return
    proxy.router.set_served(backend, entries_of(payload))


CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def kv_capacity(metrics_text: str) -> int:
    """An engine's KV cache in tokens from its /metrics: vllm:cache_config_info's num_gpu_blocks x
    block_size (vLLM publishes its CacheConfig so); 0 when it does not say."""
    found = CACHE_CONFIG.search(metrics_text)
    labels = dict(LABEL.findall(found.group(1))) if found else {}
    try:
        return max(0, int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
    except (KeyError, ValueError):
        return 0


async def read_kv_capacity(proxy: Proxy, backend: Backend) -> None:
    """Learn a backend's KV cache size once it is healthy (again: a restart may change it), for the
    prefix policy's index; on a failure it is read at the next check."""
    try:
        async with proxy.session.get(backend.url + "/metrics",
                                     timeout=aiohttp.ClientTimeout(total=proxy.config.health.timeout_s)) as r:
            if r.status != 200:
                backend.kv_tokens = 0     # no /metrics: nothing to learn, not asked again
                return
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
        return
    backend.kv_tokens = kv_capacity(text)


async def health_loop(proxy: Proxy) -> None:
    """Active checks on /health (never /v1/models: vLLM answers it after its engine died)."""
    while True:
        proxy.check_now.clear()   # before the round: a reload during it asks for another at once
        await asyncio.gather(*(_check(proxy, b) for b in list(proxy.router.backends.values())))
        proxy.checked.set()
        try:
            await asyncio.wait_for(proxy.check_now.wait(), proxy.config.health.interval_s)
        except asyncio.TimeoutError:
            pass


def upstream_connector() -> aiohttp.TCPConnector:
    """The connector of the health checks' session (the requests go by proxy/upstream.py): no limits, the
    upstream sockets' keepalive."""
    # socket_factory came with aiohttp 3.12; an older one (the host's vLLM environment) keeps the kernel's
    # keepalive defaults, and a request in flight to a host whose link went down waits for proxy.timeout_s.
    extra = ({"socket_factory": upstream_socket}
             if "socket_factory" in inspect.signature(aiohttp.TCPConnector).parameters else {})
    return aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S, **extra)


async def _context(app: web.Application):
    proxy = app[PROXY]
    proxy.session = aiohttp.ClientSession(
        auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies
        connector=upstream_connector())
    proxy.upstream = Upstream()
    proxy.results.start()
    if proxy.spans is not None:
        proxy.spans.start()
    task = asyncio.create_task(health_loop(proxy))
    peers = asyncio.create_task(share.poll(proxy))    # active-active: which entries serve (proxy/share.py)
    lag = asyncio.create_task(loop_lag.watch(proxy.metrics.loop_lag, proxy.metrics.loop_lag_worst))
    yield
    for t in (task, peers, lag):
        t.cancel()
        try:
            await t
        except asyncio.CancelledError:
            pass
    await proxy.session.close()
    await proxy.upstream.close()
    proxy.results.stop()
    if proxy.spans is not None:
        proxy.spans.stop()   # at most SpanExport.STOP_S


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer to a /v1/ request carries its trace id (X-Trace-Id), the proxy's own errors too; while
    the proxy shuts down, each answer ends its connection, so clients reconnect elsewhere."""
    trace = request.get(TRACE_ID)
    if trace is not None:
        response.headers["X-Trace-Id"] = trace
    if request.app[PROXY].closing:
        response.force_close()
        response.headers["Connection"] = "close"  # headers are already prepared when this hook runs


# nginx.conf.j2's @not_found says the same.
NOT_SERVED = ("not found: the entry port serves the inference API (docs/proxy.md, Routes that reach the engines), "
              "/health and /metrics")


async def engine_route(request: web.Request) -> web.StreamResponse:
    """Any other request: passed on to the engines when its route is on the list (proxy/routes.py), else
    404 here, whatever the API key (nginx mode answers the same)."""
    if request.app[PROXY].config.routes.allows(request.method, target(request)):   # the path it is sent to
        return await proxy_handler(request)
    return json_error(404, NOT_SERVED, "NotFoundError",
                      {"X-Request-Id": request.headers.get("X-Request-Id") or new_request_id()})


async def peer_prefixes(request: web.Request) -> web.Response:
    """A peer entry's proxy reads this proxy's latest prefix decisions (proxy/share.py)."""
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        since = 0
    got = share.feed(request.app[PROXY], since, request.query.get("id"), request.remote)
    if got is None:
        return json_error(404, "not found: only a peer entry's proxy reads this.", "not_found")
    return web.json_response(got)


def make_app(config: ProxyConfig, config_path: str | None = None) -> web.Application:
    """The public application: the engines' inference routes proxied, plus /health and /metrics."""
    app = web.Application(client_max_size=config.max_body_bytes)
    app[PROXY] = Proxy(config, config_path)
    app.cleanup_ctx.append(_context)
    app.on_response_prepare.append(_on_prepare)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(share.FEED_PATH, peer_prefixes)
    app.router.add_get("/v1/models", list_models)   # the models form answers it; the plain form forwards it
    # The inference routes by their paths too: aiohttp finds a plain path by one lookup, where the catch-all
    # takes a lookup per segment and its pattern. The same handler either way, any method (it checks it).
    for path in dict.fromkeys(path for _, path in INFERENCE_ROUTES if path != "/v1/models"):
        app.router.add_route("*", path, engine_route)
    app.router.add_route("*", "/{tail:.*}", engine_route)    # the allow-list: proxy/routes.py
    return app


def make_admin_app(proxy: Proxy) -> web.Application:
    """The admin application, served on the loopback admin port only."""
    admin = web.Application()
    admin[PROXY] = proxy

    async def list_backends(request):
        router = proxy.router
        return web.json_response([{**b.as_dict(), "model": router.model_label(b)} if router.by_model
                                  else b.as_dict() for b in router.backends.values()])

    async def set_drain(request):
        name = request.match_info["name"]
        b = proxy.router.backends.get(name)
        if b is None:
            return json_error(404, f"no backend named {name}; GET /admin/backends lists them.", "not_found")
        proxy.router.set_drained(b, request.match_info["action"] == "drain")
        log.info("backend %s %s (%d in flight)", b.name, "drained" if b.drained else "enabled", b.in_flight)
        return web.json_response(b.as_dict())

    async def running_config(request):
        c = proxy.config
        return web.json_response({"pid": PID, "backends": list(c.backends), "listen": [c.listen.host, c.listen.port],
                                  "pending_restart": list(proxy.pending_restart), "reloads": proxy.reloads,
                                  "admin": [c.admin.host, c.admin.port], "timeout_s": c.timeout_s,
                                  "connect_timeout_s": c.connect_timeout_s, "max_body_mb": c.max_body_mb,
                                  "retries": c.retries, "max_fails": c.max_fails,
                                  "shutdown_timeout_s": c.shutdown_timeout_s,
                                  "fix_numeric_user": c.fix_numeric_user, "api_keys": c.api_keys_file is not None,
                                  "api_keys_digest": keys_digest(proxy.api_keys),
                                  "leaving": [{"name": b.name, "in_flight": b.in_flight}
                                              for b in proxy.router.leaving()],
                                  "health_interval_s": c.health.interval_s,
                                  "log": [c.log.max_mb, c.log.backups], "slots": c.slots,
                                  "queue": {"max": c.queue.max, "timeout_s": c.queue.timeout_s,
                                            "tenant_reserve": c.queue.tenant_reserve},
                                  "queued": proxy.router.queued,
                                  # with proxy.workers > 1: the other workers' prefix decisions adopted here
                                  "learned_from_workers": 0 if Balancer.lending is None else Balancer.lending.learned,
                                  "tenants": [{"name": t.name, "weight": t.weight, "in_flight": t.in_flight,
                                               "queued": t.queued, "admits_per_minute": t.admits_per_minute(),
                                               **{k: v for k, v in
                                                                      dataclasses.asdict(t.config).items()
                                                                      if k != "weight"}}
                                              for t in proxy.tenants.by_name.values()],
                                  "routing": dataclasses.asdict(c.routing), "open_routes": list(c.open_routes),
                                  "otlp": dataclasses.asdict(c.otlp),
                                  "share": None if c.share is None else {
                                      "me": c.share.entries[c.share.me].name,
                                      "serving": None if proxy.router.alive is None else sorted(
                                          c.share.entries[i].name for i in proxy.router.alive),
                                      "slots": proxy.router.slot_summary(), "split": c.share.split,
                                      # per peer: the last of its prefix decisions learned (proxy/share.py)
                                      "learned": {n: seq for n, (_, seq) in proxy.router.peer_feeds.items()},
                                      "hashes_differ": sorted(proxy.router.peer_mismatch)},
                                  "models": [{"name": p.name, "aliases": list(p.aliases),
                                              "adapters": list(p.adapters), "slots": p.slots,
                                              "backends": list(p.backends),
                                              "queued": proxy.router.pools[p.name].queued}
                                             for p in c.models]})

    async def reload(request):
        ok = proxy.reload()
        return web.json_response({"reloaded": ok, "backends": list(proxy.router.backends)},
                                 status=200 if ok else 422)

    async def refresh_models(request):
        """Read every healthy backend's /v1/models now (after `inv lora add`: the new name routes at once)."""
        if proxy.router.by_model:
            await asyncio.gather(*(read_models(proxy, b) for b in list(proxy.router.backends.values())
                                   if b.healthy))
        return web.json_response({"models": [e["id"] for e in proxy.router.listing()]})

    async def list_requests(request):
        return web.json_response([ex.describe() for ex in list(proxy.requests.values())])

    async def drain_and_exit(request):
        """Stop taking connections, wait for the requests in flight (up to timeout_s, default
        shutdown_timeout_s), cut what is left and exit; answers when the drain is over, with the pid,
        how many requests finished and the ones cut. With "pid", only that proxy obeys: the caller
        names the one it means (after an admin_port change the port may be the new proxy's)."""
        try:
            body = await request.json() if request.can_read_body else {}
            timeout_s = float(body.get("timeout_s", proxy.config.shutdown_timeout_s))
            if not 0 <= timeout_s < float("inf") or not isinstance(body.get("pid", PID), int):
                raise ValueError
        except (ValueError, TypeError, AttributeError):
            return json_error(400, 'the body is {"timeout_s": seconds, "pid": pid}, both optional; seconds '
                              'a finite number >= 0.', "bad_request")
        if body.get("pid", PID) != PID:
            return json_error(409, f"this proxy is pid {PID}, not {body['pid']}; nothing done.", "conflict")
        if not proxy.stop.is_set():
            proxy.drain_s = timeout_s
            proxy.stop.set()
        while proxy.drained is None:    # serve() creates it as it wakes up
            await asyncio.sleep(0.01)
        return web.json_response(await asyncio.shield(proxy.drained))

    admin.router.add_get("/admin/backends", list_backends)
    admin.router.add_get("/admin/requests", list_requests)
    admin.router.add_post("/admin/drain-and-exit", drain_and_exit)
    admin.router.add_post("/admin/backends/{name}/{action:drain|enable}", set_drain)
    admin.router.add_post("/admin/reload", reload)
    admin.router.add_post("/admin/refresh-models", refresh_models)
    admin.router.add_get("/admin/config", running_config)
    return admin
