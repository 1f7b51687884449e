"""The entry port (proxy.port) on the host: who answers on it, and whether a listener could bind it or join
it (SO_REUSEPORT), for the handover between the proxy and nginx."""
from __future__ import annotations

import socket

from . import httpcall, layout
from .errors import FrontError


def health(cfg: dict, timeout: float = 1.0, address: str | None = None) -> httpcall.Answer:
    """GET /health on the entry port, where this host reaches it (or at address), on a new connection."""
    where = address or layout.local_address(cfg["bind"])
    return httpcall.get(httpcall.base_url(where, cfg["port"]) + "/health", timeout)


def address_of_new(cfg: dict, old_host: str | None) -> str:
    """Where only a new listener on bind is reached while the old one still listens on old_host: for a
    wildcard bind replacing 127.0.0.1 that is another loopback address (the kernel hands 127.0.0.1's
    connections to the more specific old socket, 127.0.0.2's to the wildcard)."""
    address = layout.local_address(cfg["bind"])
    if cfg["bind"] in layout.WILDCARDS_V4 and old_host == address:
        return "127.0.0.2"
    return address


def front_answer(cfg: dict, timeout: float = 1.0) -> str | None:
    """Who answers on the entry port: "nginx" (its X-Front header), "proxy", or None when nothing does."""
    answer = health(cfg, timeout)
    if answer.status is None:
        return None
    return "nginx" if answer.headers.get("X-Front") == "nginx" else "proxy"


def proxy_answer(cfg: dict, timeout: float = 1.0, address: str | None = None) -> tuple[int | None, int | None]:
    """(status, pid) of the proxy answering GET /health on the entry port, on a new connection (with
    two proxies on the port, the kernel picks one per connection); (None, None) when none answers."""
    answer = health(cfg, timeout, address)
    body = answer.json()
    try:
        return answer.status, int(body["pid"])
    except (KeyError, TypeError, ValueError):
        return answer.status, None


def can_share_port(cfg: dict) -> bool:
    """Whether a listener with SO_REUSEPORT could join the entry port now (bind only, never listen: a
    probe that listened would be handed some of the clients' connections and reset them)."""
    return port_free(cfg, reuse_port=True)


def _socket(cfg: dict) -> socket.socket:
    family = socket.AF_INET6 if ":" in cfg["bind"] else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


def bind_listener(cfg: dict, backlog: int = 511) -> socket.socket | None:
    """A listening socket on the entry port for nginx to inherit, or None while the port is taken.

    SO_REUSEPORT is set so that a later listener which also sets it (a proxy with reuse_port) can join
    the port before nginx leaves it."""
    s = _socket(cfg)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((cfg["bind"] or "0.0.0.0", cfg["port"]))
        s.listen(backlog)
        # nginx takes an inherited socket as it is: a blocking one would leave a worker that lost the
        # race for a connection stuck in accept() (and every request of that worker with it).
        s.setblocking(False)
        return s
    except PermissionError:
        s.close()
        raise FrontError(f"binding port {cfg['port']} is not permitted for this user (ports below 1024 "
                         "need root); run as root or change proxy.port.") from None
    except OSError:
        s.close()
        return None


def port_free(cfg: dict, reuse_port: bool = False) -> bool:
    """Whether a listener could bind the entry port now: a plain one, or one setting SO_REUSEPORT."""
    with _socket(cfg) as s:
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((cfg["bind"] or "0.0.0.0", cfg["port"]))
            return True
        except OSError:
            return False
