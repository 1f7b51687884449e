"""The public listening socket, and the handover of its port to another listener without a reset.

With SO_REUSEPORT several listeners share a port and the kernel spreads new connections over them.
When one of them closes, the connections waiting in its accept queue are reset (unless root set
net.ipv4.tcp_migrate_req). So a proxy that leaves the port to another first steers new connections
away from itself, with a classic BPF program attached to the port's reuseport group (no privilege
needed), lets its queue empty, and only then closes. A listener that leaves stays index 0 of the group
(it was there first, or moved there when the one before it left), and the one taking over is index 1:
the program answers 1. Alone on the port, index 1 does not exist and the kernel falls back to its hash,
so the program changes nothing; a later listener removes it once it joins (see stop_steering).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import socket
import struct

from aiohttp import web

log = logging.getLogger("proxy")

SO_ATTACH_REUSEPORT_CBPF = 51   # <asm-generic/socket.h>, Linux 4.5
SO_DETACH_REUSEPORT_BPF = 68    # Linux 5.8
BPF_RET_K = 0x06                # BPF_RET | BPF_K: return the constant k
# Connections the kernel completes before the proxy accepts them (capped by net.core.somaxconn): a burst of
# thousands (a flood, or every client reconnecting at once) waits here instead of having its SYNs dropped
# and retried a second later. The event loop listens again with the site's backlog, so both use this.
BACKLOG = 4096
# Connections asyncio's loop accepts in one turn (it accepts up to its `backlog` per readiness of the
# listening socket, and each becomes a task run in the next turn: at 4,096 a flood is thousands of
# connections set up in one turn); at 64 the rest wait in the kernel's queue while /health and the streams
# in flight get their turn. uvloop (the default where installed) ignores this: libuv accepts every pending
# connection in one callback (docs/PERFORMANCE.md, "Hostile and careless callers").
ACCEPTS_PER_TURN = 64


def listen_socket(host: str, port: int, reuse_port: bool, backlog: int = BACKLOG,
                  listening: bool = True) -> socket.socket:
    """A listening TCP socket on host:port (OSError when it cannot be bound). listening False: bound only
    (several workers' supervisor): it joins the port's group, and gets connections, once a worker that is
    ready to accept listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host or "0.0.0.0", port))
        if listening:
            sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class ClientSite(web.SockSite):
    """aiohttp's site on a listening socket, whose connections are served through clients (proxy.clients:
    their deadlines and their bound)."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, clients) -> None:
        super().__init__(runner, sock, backlog=BACKLOG)
        self._clients = clients

    async def start(self) -> None:
        await web.BaseSite.start(self)   # registers the site with its runner, as SockSite.start does
        loop = asyncio.get_running_loop()
        # asyncio's one backlog is both the listen queue and the accepts per turn: a short one for the
        # loop, then the long queue again for the kernel.
        self._server = await loop.create_server(self._clients.factory(self._runner.server), sock=self._sock,
                                                backlog=ACCEPTS_PER_TURN)
        self._sock.listen(self._backlog)


def steer_away(sock: socket.socket) -> bool:
    """Send the port's new connections to the group's index 1 (the listener taking over); False when
    the kernel refused (no SO_REUSEPORT, no BPF): then closing may reset a few queued connections."""
    insn = (ctypes.c_uint8 * 8).from_buffer_copy(struct.pack("=HBBI", BPF_RET_K, 0, 0, 1))
    prog = struct.pack("HP", 1, ctypes.addressof(insn))   # struct sock_fprog {len; filter *}
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, prog)
        return True
    except OSError as e:
        log.info("cannot steer new connections to the next listener (%s)", e.strerror or e)
        return False


def queued(sock: socket.socket) -> int:
    """How many connections wait in the listening socket's accept queue (Linux: TCP_INFO's tcpi_unacked
    is the accept backlog of a listener); 0 when unknown."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
        return struct.unpack_from("=I", info, 24)[0]   # after 8 one-byte fields: rto, ato, snd_mss, rcv_mss
    except (OSError, struct.error):
        return 0


def stop_steering(sock: socket.socket) -> None:
    """Remove a steering program left on the port's group by a listener that has gone, so the kernel
    spreads connections again (a later joiner must not get them all before it is confirmed)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_REUSEPORT_BPF, 0)
    except OSError:
        pass      # none attached (ENOENT), or a kernel before 5.8: nothing to undo there
