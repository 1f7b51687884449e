"""`python -m proxy --config FILE`: serve the public port and the loopback admin port until SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from aiohttp import web

from . import logfile, otlp
from .app import make_admin_app, make_app
from .clients import Clients, connection_bound, raise_nofile
from .listener import ClientSite, listen_socket, queued, steer_away, stop_steering
from .state import PROXY, tenant_names
from .config import ConfigError, load_api_keys, load_config

log = logging.getLogger("proxy")

CLOSE_LINGER_S = 1.0  # at a stop, how long kept-alive connections are answered (and told to close)
HANDSHAKE_S = 0.01    # once new connections go elsewhere, handshakes already under way still end in our queue
QUEUE_WAIT_S = 1.0    # at most this long for the accept queue to empty before the listener closes
CUT_GRACE_S = 0.5     # past the drain bound, how long the requests still in flight get before they are cut
ADMIN_RETRY_S = 0.05  # how often a new proxy tries the admin port its predecessor still holds


async def serve(config, config_path: str, admin_wait_s: float = 0.0) -> None:
    """Serve until SIGTERM or POST /admin/drain-and-exit, then drain and return.

    admin_wait_s: the admin port may be held by the proxy this one replaces (a zero-gap restart, which
    confirms this one on the public port first): bind it as soon as that one has gone, up to this long.
    """
    app = make_app(config, config_path)
    proxy = app[PROXY]
    admin = make_admin_app(proxy)
    # A proxy that replaces another (a zero-gap restart) keeps the operator's drains: the host agent hands
    # over the names the old one had drained, so a drained instance stays out of service.
    for name in filter(None, os.environ.get("FLEET_PROXY_DRAINED", "").split(",")):
        if name in proxy.router.backends:
            proxy.router.set_drained(proxy.router.backends[name], True)
            log.info("backend %s drained, as the proxy this one replaces had it", name)
    clients = _clients(config, proxy)
    # handler_cancellation: a client that goes away cancels its handler, which aborts the upstream request.
    # shutdown_timeout: what the requests still in flight get once the drain below has run its course.
    # keepalive_timeout: aiohttp's own idle deadline (its default is an hour); the others are clients'.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=CUT_GRACE_S,
                           keepalive_timeout=config.client.keepalive_timeout_s)
    admin_runner = web.AppRunner(admin, access_log=None)
    await runner.setup()
    await admin_runner.setup()
    # One round of health checks before listening: a proxy joining a port another one serves (a restart,
    # a swap) takes its first connection knowing which backends are up, instead of answering 503.
    try:
        await asyncio.wait_for(proxy.checked.wait(), config.health.timeout_s + 2)
    except asyncio.TimeoutError:
        pass
    admin_task = None
    try:
        sock = listen_socket(config.listen.host, config.listen.port, config.listen.reuse_port)
        stop_steering(sock)   # a program left by a proxy that handed the port over must not favour us
        public = ClientSite(runner, sock, clients)
        await public.start()
        clients.start()
        try:
            await web.TCPSite(admin_runner, config.admin.host, config.admin.port).start()
        except OSError:
            if admin_wait_s <= 0:
                raise
            log.info("admin port %d held by the proxy this one replaces; taken when it leaves", config.admin.port)
            admin_task = asyncio.create_task(_take_admin(admin_runner, config, sock, admin_wait_s))
    except OSError:   # a port taken: close the client session and the health loop before saying so
        await runner.cleanup()
        await admin_runner.cleanup()
        raise
    log.info("listening on %s:%d, admin on %s:%d, backends %s", config.listen.host, config.listen.port,
             config.admin.host, config.admin.port, ", ".join(config.backends))

    # Signal handlers only set a flag; the work happens here, in order.
    loop = asyncio.get_running_loop()
    reload = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, proxy.stop.set)   # stop, swap-to-nginx: drain then exit 0
    loop.add_signal_handler(signal.SIGINT, proxy.stop.set)    # Ctrl-C by hand: the same
    loop.add_signal_handler(signal.SIGHUP, reload.set)        # deploy after a config change: re-read it
    while not proxy.stop.is_set():
        waiters = [asyncio.ensure_future(proxy.stop.wait()), asyncio.ensure_future(reload.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        if reload.is_set() and not proxy.stop.is_set():
            reload.clear()
            proxy.reload()
    proxy.drained = loop.create_future()
    if admin_task is not None:
        admin_task.cancel()
    result = await drain(proxy, sock, public)
    proxy.drained.set_result(result)
    await runner.cleanup()        # closes idle connections; what is still in flight is cut after CUT_GRACE_S
    await admin_runner.cleanup()  # after the answer to /admin/drain-and-exit went out
    await clients.stop()
    log.info("stopped")


def _clients(config, proxy) -> Clients:
    """The public port's client connections: the open-file limit raised to its hard value, and the bound
    on open connections kept below it."""
    nofile = raise_nofile()
    slots = max([config.slots, *(p.slots for p in config.models)])
    bound = connection_bound(nofile, config.client.max_connections, len(config.backends), slots)
    if 0 < bound < config.client.max_connections:
        log.warning("client.max_connections %d is beyond what %d open files allow: %d", config.client.max_connections,
                    nofile, bound)
    log.info("open files: %d; client connections: at most %d", nofile, bound)
    return Clients(config.client, bound, proxy.metrics.client_cuts, proxy.metrics.client_connections)


async def drain(proxy, sock, public) -> dict:
    """Stop taking connections and wait for the requests in flight, up to the drain bound.

    1. Every answer from now on closes its connection, so kept-alive clients reconnect. 2. New connections
    go to the port's other listener when there is one (a restart, a swap; see proxy.listener), and what
    waits in the accept queue is accepted. 3. Stop listening: without another listener, connections are now refused.
    4. Wait until no request is in flight, or the bound has passed; name the ones cut."""
    bound = proxy.config.shutdown_timeout_s if proxy.drain_s is None else proxy.drain_s
    t0 = time.monotonic()
    in_flight = len(proxy.requests)
    log.info("stopping: no new connections; %d requests in flight get up to %g s", in_flight, bound)
    proxy.closing = True
    if steer_away(sock):
        # Accept what is queued before closing (a close resets it). Alone on the port, the kernel still
        # queues new connections here, but the loop accepts as they come: the queue is empty at once.
        await asyncio.sleep(HANDSHAKE_S)
        deadline = time.monotonic() + min(QUEUE_WAIT_S, bound)
        while queued(sock) and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
    await public.stop()
    await asyncio.sleep(min(CLOSE_LINGER_S, bound))
    while proxy.requests and time.monotonic() - t0 < bound:
        await asyncio.sleep(0.05)
    cut = []
    for ex in list(proxy.requests.values()):
        ex.cut = True
        cut.append(ex.describe())
    for c in cut:
        log.warning("drain: request %s (trace %s) on %s cut after %g s, still in flight at the bound",
                    c["request_id"], c["trace_id"], c["backend"], bound)
    waited = round(time.monotonic() - t0, 2)
    log.info("drained in %.2f s: %d cut", waited, len(cut))
    return {"pid": os.getpid(), "in_flight_at_start": in_flight, "waited_s": waited, "bound_s": bound,
            "cut": cut}


async def _take_admin(admin_runner, config, sock, wait_s: float) -> None:
    """Bind the admin port once the proxy this one replaces has released it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            await web.TCPSite(admin_runner, config.admin.host, config.admin.port).start()
            break
        except OSError:
            if time.monotonic() > deadline:
                log.error("admin port %d still taken after %g s; serving without the admin API",
                          config.admin.port, wait_s)
                return
            await asyncio.sleep(ADMIN_RETRY_S)
    stop_steering(sock)   # the one before has gone: the program it left is of no use now
    log.info("admin on %s:%d", config.admin.host, config.admin.port)


def run(main_coroutine, loop: str = "auto") -> None:
    """Run on uvloop when it is importable (every vLLM environment has it) unless loop is "asyncio"."""
    try:
        if loop == "asyncio":
            raise ImportError("asyncio asked for")
        import uvloop
    except ImportError as e:
        log.info("event loop: asyncio (%s)", e if loop == "asyncio" else "uvloop is not installed")
        asyncio.run(main_coroutine)
        return
    log.info("event loop: uvloop %s", uvloop.__version__)
    if hasattr(uvloop, "run"):
        uvloop.run(main_coroutine)
    else:                              # uvloop before 0.18 (an older vendor vLLM environment)
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(main_coroutine)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy", description=__doc__)
    parser.add_argument("--config", required=True, help="the proxy's YAML config (conf/proxy.yaml)")
    parser.add_argument("--admin-wait-s", type=float, default=0.0,
                        help="a zero-gap restart: the admin port is taken once the proxy replaced leaves it")
    parser.add_argument("--loop", choices=("auto", "asyncio"), default="auto",
                        help="auto: uvloop when installed (the default); asyncio: the standard loop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=logfile.FORMAT)
    try:
        config = load_config(args.config)
        load_api_keys(config.api_keys_file, tenant_names(config))
        if config.otlp.endpoint is not None and otlp.missing():   # the SDK is optional: checked when asked for
            raise ConfigError(otlp.missing())
    except ConfigError as e:
        print(f"proxy: {e}", file=sys.stderr)
        return 2
    try:
        logfile.setup(config.log)
    except OSError as e:
        print(f"proxy: cannot write its log {config.log.path} ({e.strerror or e}).", file=sys.stderr)
        return 2
    try:
        run(serve(config, args.config, args.admin_wait_s), args.loop)
    except OSError as e:
        print(f"proxy: cannot listen ({e.strerror or e}); is the port taken?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
