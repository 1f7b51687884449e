"""Pools per served model: which pool a request's `model` reaches, and what the backends serve.

In the plain form (no `models` in the config) there is one pool of every backend and the body's
`model` is never read. In the models form each inventory group is a pool with its own slots, its own
least-connections pick and its own queue (balancer.Balancer), so a saturated model never holds up
another's requests; a name reaches a pool when it is the pool's name, an alias, a static adapter, or
a name a backend of the pool lists in its /v1/models (an adapter loaded at runtime).
"""
from __future__ import annotations

from .balancer import Backend, Balancer, count_answer, take_out
from .body import NO_MODEL, parse
from .config import ProxyConfig
from .share import my_slots



def model_of(body: bytes) -> str | None:
    """The request body's top-level `model` (NO_MODEL when it has none; None when the body is not a
    JSON object), from the body's one parse (proxy/body.py; Refused past proxy.limits)."""
    if not body.strip():
        return NO_MODEL
    return parse(body).model


class Router:
    """The pools of a running proxy and the backends of them all, kept in step with its config."""

    def __init__(self, config: ProxyConfig):
        self.pools: dict[str, Balancer] = {}
        self.backends: dict[str, Backend] = {}
        self._pool_of: dict[str, str] = {}       # backend name -> pool name
        self._names: dict[str, str] = {}         # configured name, alias, adapter -> pool name
        self._learned: dict[str, str] | None = None  # names from the backends' /v1/models (None: stale)
        self._leaving: dict[str, Backend] = {}   # removed by a reload, their requests in flight finishing
        # Active-active (config.share): the entries whose /health answered at the last poll (None: not yet).
        self.alive: frozenset[int] | None = None
        self.peer_feeds: dict[str, tuple[str, int]] = {}   # peer entry -> its feed's id and last seq read
        self.peer_mismatch: set[str] = set()                # peers whose block hashes differ (logged once)
        self.peer_warned: set[tuple[str, str]] = set()     # (peer, kind) of trouble logged once (proxy/share.py)
        # Whether requests are routed by their body's `model` (the config has `models`); whether a request's
        # body is read before the pick: for its `model`, or for the routing policy (every pool has the
        # same). Both follow from the config: update() sets them, every request reads them.
        self.by_model = self.needs_body = False
        self.update(config)

    def update(self, config: ProxyConfig) -> tuple[list[str], list[str]]:
        """Make the pools those of config, keeping the state of backends that stay in their pool;
        returns the backends (added, removed)."""
        before = dict(self.backends)
        wanted = ({p.name: (p.backends, my_slots(p.slots, config.share, self.alive)) for p in config.models}
                  if config.models else {NO_MODEL: (config.backends, my_slots(config.slots, config.share, self.alive))})
        for name in [n for n in self.pools if n not in wanted]:
            self.pools.pop(name).update([])           # its backends leave the pick; in-flight ones finish
        for name, (members, slots) in wanted.items():
            if name in self.pools:
                self.pools[name].set_routing(config.routing)
                self.pools[name].update(members, slots, config.queue.max)
            else:
                self.pools[name] = Balancer(members, slots, config.queue.max, config.routing)
            self.pools[name].set_reserve(config.queue.tenant_reserve)
        self._pool_of = {b: name for name, pool in self.pools.items() for b in pool.backends}
        self.backends = {b.name: b for pool in self.pools.values() for b in pool.backends.values()}
        self._names = {n: p.name for p in config.models for n in p.names}
        self._learned = None
        self.by_model = NO_MODEL not in self.pools
        self.needs_body = self.by_model or next(iter(self.pools.values())).needs_body
        removed = sorted(set(before) - set(self.backends))
        for name in removed:
            self._leaving[name] = before[name]
        for name in list(self._leaving):
            if name in self.backends:           # back in the config: counted on its new entry from now on
                del self._leaving[name]
        return [b for b in config.backends if b not in before], removed

    def slot_summary(self) -> str:
        """Each pool's slots per backend, for a log line (`4`, or `chat 4, vision 2`)."""
        if not self.by_model:
            return str(self.pools[NO_MODEL].slots)
        return ", ".join(f"{name} {pool.slots}" for name, pool in self.pools.items())

    def leaving(self) -> list[Backend]:
        """The backends a reload removed that still have requests in flight (they take no new ones): a
        host leaving the fleet is drained once this is empty. Those that finished are forgotten."""
        for name in [n for n, b in self._leaving.items() if b.in_flight <= 0]:
            del self._leaving[name]
        return list(self._leaving.values())

    def pool(self, backend: Backend) -> Balancer:
        """The pool a backend is in."""
        return self.pools[self._pool_of[backend.name]]

    def only(self) -> Balancer | None:
        """The pool a request without `model` goes to: the only one, or None when there are several."""
        return next(iter(self.pools.values())) if len(self.pools) == 1 else None

    def resolve(self, name: str) -> str | None:
        """The pool a model name reaches, or None when no backend serves it."""
        pool = self._names.get(name)
        if pool is None:
            if self._learned is None:
                self._learned = {}
                for b in self.backends.values():
                    for entry in b.served:
                        self._learned.setdefault(entry["id"], self._pool_of[b.name])
            pool = self._learned.get(name)
        return pool

    def served_names(self) -> list[str]:
        """The pools' names, for a message that lists what is served."""
        return list(self.pools)

    def set_served(self, backend: Backend, entries: list[dict]) -> None:
        """What a backend's /v1/models listed (its entries with an `id`)."""
        if entries != backend.served:
            backend.served = entries
            self._learned = None

    def listing(self) -> list[dict]:
        """GET /v1/models: the union of the healthy backends' lists, each id once, pool by pool."""
        seen: dict[str, dict] = {}
        for pool in self.pools.values():
            for b in pool.backends.values():
                if b.available:
                    for entry in b.served:
                        seen.setdefault(entry["id"], entry)
        return list(seen.values())

    # What the health loop, the admin API and the metrics ask of every pool at once.

    @property
    def queued(self) -> int:
        """Requests waiting for a slot, in every pool."""
        return sum(p.queued for p in self.pools.values())

    def available_count(self) -> int:
        """Backends that take new requests, in every pool."""
        return sum(p.available_count() for p in self.pools.values())

    def _owner(self, backend: Backend) -> Balancer | None:
        """The pool backend is in; None when a reload removed it (its requests may still be running)."""
        pool = self.pools.get(self._pool_of.get(backend.name, ""))
        return pool if pool is not None and pool.backends.get(backend.name) is backend else None

    def mark(self, backend: Backend, healthy: bool, error: str | None = None) -> bool:
        """A health check's verdict on a backend (see Balancer.mark)."""
        pool = self._owner(backend)
        return pool.mark(backend, healthy, error) if pool is not None else False

    def eject(self, backend: Backend, error: str) -> bool:
        """Take a backend out until its next good /health (see Balancer.eject); True when it was in."""
        pool = self._owner(backend)
        return pool.eject(backend, error) if pool is not None else take_out(backend, error)

    def answered(self, backend: Backend, status: int, max_fails: int) -> bool:
        """Count an upstream answer toward max_fails; True when it ejected the backend."""
        error = count_answer(backend, status, max_fails)
        return error is not None and self.eject(backend, error)

    def set_drained(self, backend: Backend, drained: bool) -> None:
        """Drain a backend or enable it again (see Balancer.set_drained)."""
        self.pool(backend).set_drained(backend, drained)

    def model_label(self, backend: Backend) -> str:
        """The pool's name of a backend, for the admin API and the metrics ("" in the plain form)."""
        return self._pool_of.get(backend.name, NO_MODEL)


def entries_of(payload: object) -> list[dict]:
    """The model entries of a /v1/models answer (those with a string id), or [] when it has none."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return []
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]

