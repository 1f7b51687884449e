"""The proxy's lifecycle on one object (uvicorn's Config -> Server): start the applications and listen,
reload the config, drain the requests in flight, stop; serve() runs them in order until SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .app import make_admin_app, make_app
from .clients import Clients, connection_bound, raise_nofile
from .listener import ClientSite, listen_socket, queued, steer_away, stop_steering
from .state import PROXY
from .workers import Peers, admin_path, front_admin

log = logging.getLogger("proxy")

CLOSE_LINGER_S = 1.0  # at a stop, how long kept-alive connections are answered (and told to close)
HANDSHAKE_S = 0.01    # once new connections go elsewhere, handshakes already under way still end in our queue
QUEUE_WAIT_S = 1.0    # at most this long for the accept queue to empty before the listener closes
CUT_GRACE_S = 0.5     # past the drain bound, how long the requests still in flight get before they are cut
ADMIN_RETRY_S = 0.05  # how often a new proxy tries the admin port its predecessor still holds


@dataclass
class Worker:
    """This process as worker `me` of `count` (proxy.workers > 1; proxy/workers.py): the run directory of
    their sockets, the entry port's listening socket it inherited, its lending, the supervisor's pid."""

    me: int
    count: int
    run_dir: str
    listen_fd: int
    lending: object
    supervisor: int


class Server:
    """One running proxy: its applications, listeners and client connections, and their lifecycle.

    admin_wait_s: the admin port may be held by the proxy this one replaces (a zero-gap restart, which
    confirms this one on the public port first): bind it as soon as that one has gone, up to this long.
    """

    def __init__(self, config, config_path: str, admin_wait_s: float = 0.0, worker: Worker | None = None):
        self.config = config
        self.admin_wait_s = admin_wait_s
        self.worker = worker
        self.app = make_app(config, config_path)
        self.proxy = self.app[PROXY]
        self.admin = make_admin_app(self.proxy)
        self.peers: Peers | None = None
        self.front_runner: web.AppRunner | None = None   # worker 0's admin port: every worker's admin as one
        if worker is not None:
            registry = self.proxy.metrics.registry
            self.admin.router.add_get("/admin/worker-metrics", lambda request: web.Response(
                body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}))
            self.peers = Peers(worker.run_dir, worker.count)
            self.proxy.gather_metrics = self.peers.metrics
        self.clients: Clients | None = None
        self.runner: web.AppRunner | None = None
        self.admin_runner: web.AppRunner | None = None
        self.sock = None
        self.public: ClientSite | None = None
        self._admin_task: asyncio.Task | None = None
        self._reload = asyncio.Event()

    async def serve(self) -> None:
        """Start; reload on SIGHUP; on SIGTERM or POST /admin/drain-and-exit drain, then stop."""
        await self.start()
        # Signal handlers only set a flag; the work happens here, in order.
        loop = asyncio.get_running_loop()
        stop = self.proxy.stop
        loop.add_signal_handler(signal.SIGTERM, stop.set)   # stop, swap-to-nginx: drain then exit 0
        loop.add_signal_handler(signal.SIGINT, stop.set)    # Ctrl-C by hand: the same
        loop.add_signal_handler(signal.SIGHUP, self._reload.set)   # deploy after a config change: re-read it
        while not stop.is_set():
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._reload.wait())]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()
            if self._reload.is_set() and not stop.is_set():
                self._reload.clear()
                self.reload()
        self.proxy.drained = loop.create_future()
        self.proxy.drained.set_result(await self.drain())
        await self.stop()

    async def start(self) -> None:
        """Set the applications up (the client session, the health loop), wait for one round of health
        checks, then listen on the public port and the admin port; OSError when a port is taken."""
        config, proxy = self.config, self.proxy
        # A proxy that replaces another (a zero-gap restart) keeps the operator's drains: the host agent hands
        # over the names the old one had drained, so a drained instance stays out of service.
        for name in filter(None, os.environ.get("FLEET_PROXY_DRAINED", "").split(",")):
            if name in proxy.router.backends:
                proxy.router.set_drained(proxy.router.backends[name], True)
                log.info("backend %s drained, as the proxy this one replaces had it", name)
        self.clients = _clients(config, proxy)
        # handler_cancellation: a client that goes away cancels its handler, which aborts the upstream request.
        # shutdown_timeout: what the requests still in flight get once the drain has run its course.
        # keepalive_timeout: aiohttp's own idle deadline (its default is an hour); the others are clients'.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=CUT_GRACE_S, keepalive_timeout=config.client.keepalive_timeout_s)
        self.admin_runner = web.AppRunner(self.admin, access_log=None)
        await self.runner.setup()
        await self.admin_runner.setup()
        if self.worker is not None:
            self.worker.lending.start(proxy.router)
            if self.worker.me == 0:
                self.front_runner = web.AppRunner(front_admin(self.peers, self.worker.supervisor), access_log=None)
                await self.front_runner.setup()
        # One round of health checks before listening: a proxy joining a port another one serves (a restart,
        # a swap) takes its first connection knowing which backends are up, instead of answering 503.
        try:
            await asyncio.wait_for(proxy.checked.wait(), config.health.timeout_s + 2)
        except asyncio.TimeoutError:
            pass
        try:
            await self._listen()
        except OSError:   # a port taken: close the client session and the health loop before saying so
            await self.runner.cleanup()
            await self.admin_runner.cleanup()
            if self.front_runner is not None:
                await self.front_runner.cleanup()
            raise
        log.info("listening on %s:%d, admin on %s:%d, backends %s", config.listen.host, config.listen.port,
                 config.admin.host, config.admin.port, ", ".join(config.backends))

    async def _listen(self) -> None:
        config, worker = self.config, self.worker
        if worker is None:
            self.sock = listen_socket(config.listen.host, config.listen.port, config.listen.reuse_port)
        else:   # the supervisor's, shared by the workers (proxy/workers.py)
            self.sock = socket.socket(fileno=worker.listen_fd)
            self.sock.setblocking(False)
        stop_steering(self.sock)   # a program left by a proxy that handed the port over must not favour us
        self.public = ClientSite(self.runner, self.sock, self.clients)
        await self.public.start()
        self.clients.start()
        if worker is not None:
            stop_steering(self.sock)   # the socket joined the port's group only now, as it listened
            await web.UnixSite(self.admin_runner, admin_path(worker.run_dir, worker.me)).start()
            if worker.me != 0:
                return     # worker 0 holds the admin port
        try:
            await web.TCPSite(self._admin_port_runner, config.admin.host, config.admin.port).start()
        except OSError:
            if self.admin_wait_s <= 0:
                raise
            log.info("admin port %d held by the proxy this one replaces; taken when it leaves", config.admin.port)
            self._admin_task = asyncio.create_task(self._take_admin())

    @property
    def _admin_port_runner(self) -> web.AppRunner:
        """What answers the admin port: this proxy's admin application, or, on worker 0 of several, the
        front of every worker's."""
        return self.front_runner or self.admin_runner

    def reload(self) -> bool:
        """Re-read the config file and apply it (proxy.state.Proxy.reload); False: refused, the old one stays."""
        return self.proxy.reload()

    async def drain(self) -> dict:
        """Stop taking connections and wait for the requests in flight, up to the drain bound.

        1. Every answer from now on closes its connection, so kept-alive clients reconnect. 2. New connections
        go to the port's other listener when there is one (a restart, a swap; see proxy.listener), and what
        waits in the accept queue is accepted. 3. Stop listening: without another listener, connections are
        now refused. 4. Wait until no request is in flight, or the bound has passed; name the ones cut."""
        proxy, sock = self.proxy, self.sock
        if self._admin_task is not None:
            self._admin_task.cancel()
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
        await self.public.stop()
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

    async def stop(self) -> None:
        """Close what is left: idle connections, then (after CUT_GRACE_S) what is still in flight, the
        admin port (after the answer to /admin/drain-and-exit went out), the client connections."""
        await self.runner.cleanup()
        if self.front_runner is not None:     # its drain-and-exit answer waits for every worker's
            await self.front_runner.cleanup()
        await self.admin_runner.cleanup()
        if self.peers is not None:
            await self.peers.close()
        await self.clients.stop()
        log.info("stopped")

    async def _take_admin(self) -> None:
        """Bind the admin port once the proxy this one replaces has released it."""
        config = self.config
        deadline = time.monotonic() + self.admin_wait_s
        while True:
            try:
                await web.TCPSite(self._admin_port_runner, config.admin.host, config.admin.port).start()
                break
            except OSError:
                if time.monotonic() > deadline:
                    log.error("admin port %d still taken after %g s; serving without the admin API",
                              config.admin.port, self.admin_wait_s)
                    return
                await asyncio.sleep(ADMIN_RETRY_S)
        stop_steering(self.sock)   # the one before has gone: the program it left is of no use now
        log.info("admin on %s:%d", config.admin.host, config.admin.port)


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
