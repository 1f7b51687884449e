"""Backend state, slots, membership and the admission queue, with the routing policy's pick: no I/O, so
it is unit-testable."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Iterable

from .routing import Route, RoutingConfig, make_policy


class QueueFull(Exception):
    """Every slot is taken and the queue holds proxy.queue.max requests already."""


class QueueTimeout(Exception):
    """A request waited proxy.queue.timeout_s in the queue without a slot coming free."""


@dataclass
class Backend:
    """One upstream engine, named host:port, and what the proxy knows about it."""

    name: str
    healthy: bool = False  # unhealthy until its first good health check: it may still be loading
    drained: bool = False
    in_flight: int = 0
    peak_in_flight: int = 0
    last_error: str | None = None
    fails: int = 0          # consecutive 5xx answers; reset by any other answer
    ejections: int = 0      # times the proxy took it out on its own (connect error, too many 5xx)
    removed: bool = False   # gone from the config: its in-flight requests finish, new ones go elsewhere
    slots: int = 0          # requests it runs at once (max_num_seqs + headroom); 0: no limit, no queue
    kv_tokens: int | None = None   # its engine's KV cache in tokens (vllm:cache_config_info); 0: not published
    served: list = field(default_factory=list)  # its /v1/models entries (read in the models form only)
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"http://{self.name}"

    @property
    def available(self) -> bool:
        """Whether new requests may go here."""
        return self.healthy and not self.drained and not self.removed

    @property
    def free(self) -> bool:
        """Whether it takes a new request now: available with a slot free."""
        return self.available and (not self.slots or self.in_flight < self.slots)

    @property
    def state(self) -> str:
        """healthy, unhealthy or drained, as the operator sees it."""
        if self.drained:
            return "drained"
        return "healthy" if self.healthy else "unhealthy"

    def as_dict(self) -> dict:
        """The admin API's view of this backend."""
        return {"name": self.name, "state": self.state, "healthy": self.healthy,
                "drained": self.drained, "in_flight": self.in_flight,
                "peak_in_flight": self.peak_in_flight, "slots": self.slots, "last_error": self.last_error,
                "fails": self.fails, "ejections": self.ejections}


@dataclass
class Waiter:
    """A request in the queue: its future (set to the backend it gets), its route, and how many
    requests behind it were handed a slot first (a policy's look-ahead, such as prefix's; bounded)."""

    future: asyncio.Future
    route: Route | None = None
    overtaken: int = 0
    home: str | None = None   # the backend it waits for until its hold is up (Policy.hold); None: any


class Balancer:
    """One pool: its backends and their slots, and one FIFO queue for the requests that find every
    slot taken, each handed the first slot freed anywhere. Among the backends with a free slot the
    routing policy picks (proxy/routing/), given the least loaded (ties broken round robin); it may
    hand a freed slot to a waiter other than the queue's head.

    slots: a backend's slots (0: no limit). queue_max: how many may wait (0: none, refuse at once).
    """

    def __init__(self, names: Iterable[str], slots: int = 0, queue_max: int = 0,
                 routing: RoutingConfig | None = None):
        self.backends: dict[str, Backend] = {}
        self._order: list[Backend] = []
        self._cursor = 0  # where the next tie-break scan starts
        self._queue: deque[Waiter] = deque()
        self.queue_max = queue_max
        self.slots = slots
        self.policy = make_policy(routing or RoutingConfig())
        self.update(names)

    def set_routing(self, routing: RoutingConfig) -> None:
        """Take a reloaded routing config (a new policy or bound starts the policy afresh)."""
        if routing != self.policy.config:
            self.policy = make_policy(routing)

    def cold(self, backend: Backend) -> None:
        """Have the policy forget backend: it lost its cache (ejected, restarted) or left."""
        self.policy.forget(backend.name)

    def update(self, names: Iterable[str], slots: int | None = None,
               queue_max: int | None = None) -> tuple[list[str], list[str]]:
        """Make the backend list `names`, keeping the state of those that stay; returns (added, removed).

        A removed backend leaves the pick at once; requests already on it keep their Backend object
        and release it as usual, so nothing in flight is dropped. slots and queue_max, when given,
        replace the running ones; waiting requests then take any slot the change freed.
        """
        if slots is not None:
            self.slots = slots
        if queue_max is not None:
            self.queue_max = queue_max
        names = list(names)
        added = [n for n in names if n not in self.backends]
        removed = [n for n in self.backends if n not in names]
        for n in removed:
            self.backends.pop(n).removed = True
            self.policy.forget(n)
        for n in added:
            self.backends[n] = Backend(n)
        self.backends = {n: self.backends[n] for n in names}
        for b in self.backends.values():
            b.slots = self.slots
        self._order = list(self.backends.values())
        self._at = {b.name: at for at, b in enumerate(self._order)}
        self._cursor = 0
        self.dispatch()
        return added, removed

    def acquire(self, exclude: Collection[Backend] = (), over: bool = False,
                route: Route | None = None, only: str | None = None) -> Backend | None:
        """Pick a backend with a free slot (not one of exclude) and count the request on it at once,
        or None. over: when no slot is free, the least loaded available backend all the same (a retry,
        which already held a slot elsewhere). route: what the policy made of the request (its
        route_of); the policy writes its decision into it. only: that backend or none (a waiter held
        for its home).

        Pick and count are one step with no await between them: counting later (the seed counted
        after reading the body) lets many requests see the same backend as idlest.
        """
        n = len(self._order)
        least: Backend | None = None
        candidates: list[Backend] = []   # in round-robin order, from the cursor on
        for k in range(n):
            b = self._order[(self._cursor + k) % n]
            if (b.free or (over and b.available)) and b not in exclude and (only is None or b.name == only):
                candidates.append(b)
                if least is None or b.in_flight < least.in_flight:
                    least = b
        if least is None:
            return None
        best = self.policy.pick(route, least, candidates)
        self.policy.sent(route, best)
        self._cursor = self._at[best.name] + 1  # the next tie goes to the backend after this one
        best.in_flight += 1
        if best.in_flight > best.peak_in_flight:
            best.peak_in_flight = best.in_flight
        return best

    def hold(self, route: Route | None) -> tuple[Backend, float] | None:
        """Whether the policy would have the request wait for a full backend (its home) while others have
        a free slot: (that backend, seconds at most), to pass to wait_for_slot; None: acquire now. Never
        when the queue is full or others wait already (they go first)."""
        if route is None or self.ahead() or len(self._queue) >= self.queue_max:
            return None
        return self.policy.hold(route, [b for b in self._order if b.free], self._order)

    async def wait_for_slot(self, timeout_s: float, route: Route | None = None,
                            hold: tuple[Backend, float] | None = None) -> Backend | None:
        """A backend with the request counted on it, once the requests queued before it have theirs
        (the caller tried `acquire` first when nobody waited). None when no backend is available at all.
        hold: (home, seconds) from `hold`: the request takes only a slot of home until seconds passed,
        then any (the queue's order still applies: a held waiter is passed over while home is full).

        Raises QueueFull (nobody may wait, or queue_max wait already) or QueueTimeout (timeout_s
        waited). A caller cancelled while waiting (its client left) leaves the queue; a slot handed
        to it in that instant goes on to the next in line, so no count is ever lost.
        """
        if hold is None and not self.ahead():
            backend = self.acquire(route=route)   # a slot may have come free since the caller looked
            if backend is not None:
                return backend
        if not self.available_count():
            return None
        if len(self._queue) >= self.queue_max:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        entry = Waiter(waiter, route)
        self._queue.append(entry)
        timer = loop.call_later(timeout_s, self._expire, waiter)
        unhold = None
        if hold is not None:
            entry.home = hold[0].name
            unhold = loop.call_later(hold[1], self._unhold, entry)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())   # handed a slot as the client left: pass it on
            else:
                self._forget(waiter)
            raise
        finally:
            timer.cancel()
            if unhold is not None:
                unhold.cancel()

    def _unhold(self, waiter: Waiter) -> None:
        """A held waiter's time is up: any free slot will do now."""
        waiter.home = None
        if not waiter.future.done():
            self.dispatch()

    def _ready(self, w: Waiter) -> bool:
        """Whether a waiter may take a slot now: it waits for no backend, or for one that has a free slot
        (or that is out: then for none)."""
        home = self.backends.get(w.home) if w.home is not None else None
        return home is None or home.free or not home.available

    def _home_of(self, w: Waiter) -> str | None:
        """The backend a ready waiter must take (its home, while that is in), else None: any."""
        home = self.backends.get(w.home) if w.home is not None else None
        return w.home if home is not None and home.available else None

    def _next(self) -> Waiter | None:
        """The waiter a free slot goes to without the policy's say: one held for a backend with a free
        slot first (its home came free), else the first in line that waits for no backend."""
        first = None
        for w in self._queue:
            if w.future.done():
                continue
            if w.home is not None and self._ready(w):
                return w
            if first is None and w.home is None:
                first = w
        return first

    def _expire(self, waiter: asyncio.Future) -> None:
        if not waiter.done():
            self._forget(waiter)
            waiter.set_exception(QueueTimeout())

    def _forget(self, waiter: asyncio.Future) -> None:
        for w in self._queue:
            if w.future is waiter:
                self._queue.remove(w)
                return

    def dispatch(self) -> None:
        """Hand free slots to the requests waiting, first come first served, unless the policy prefers
        another waiter (prefix: one of the first routing.lookahead whose prefix lives on a free backend,
        no waiter passed over more than lookahead times).

        Held waiters (Policy.hold: waiting a little for their home backend) take only a slot of their
        home until their time is up (_unhold); while it is full they are passed over, and when it frees
        a slot they take it first (_next). A queue of another shape keeps that by serving only waiters
        that are _ready and passing `only=_home_of(waiter)` to acquire."""
        while self._queue:
            head = self._queue[0]
            if head.future.done():   # cancelled, its task not run yet (it would forget itself)
                self._queue.popleft()
                continue
            chosen = self.policy.waiter(self._queue, self._order)
            if chosen is None or not self._ready(chosen):
                chosen = self._next()
            if chosen is None:
                return
            backend = self.acquire(route=chosen.route, only=self._home_of(chosen))
            if backend is None:
                return
            if chosen is head:
                self._queue.popleft()
            else:
                for w in self._queue:
                    if w is chosen:
                        break
                    w.overtaken += 1
                self._queue.remove(chosen)
            chosen.future.set_result(backend)

    def ahead(self) -> bool:
        """Whether a new request must queue behind others: one waits that is not held for its home (held
        ones wait for one backend only; a new request may take another's free slot)."""
        return any(w.home is None and not w.future.done() for w in self._queue)

    @property
    def queued(self) -> int:
        """How many requests wait for a slot."""
        return len(self._queue)

    def learn(self, route: Route | None, backend: Backend, cached_tokens: int | None,
              prompt_tokens: int | None) -> None:
        """Pass the engine's word on a request's cached prompt tokens to the policy."""
        self.policy.learned(route, backend, cached_tokens, prompt_tokens)

    def release(self, backend: Backend) -> None:
        """Uncount one finished request; its slot goes to the first request waiting, if any."""
        backend.in_flight -= 1
        self.policy.ended(backend)
        if self._queue:
            self.dispatch()

    def mark(self, backend: Backend, healthy: bool, error: str | None = None) -> bool:
        """Record a health check's verdict; True when it changed the backend's health."""
        changed = backend.healthy != healthy
        backend.healthy = healthy
        if changed and not healthy:
            self.cold(backend)   # down: when it comes back (a restart, say) its cache is empty
            backend.kv_tokens = None   # and its size is read again (the health check reads it)
        if healthy:
            backend.fails = 0
        if error is not None:
            backend.last_error = error
        if changed and healthy:
            self.dispatch()   # its slots are free for whoever waits
        return changed

    def set_drained(self, backend: Backend, drained: bool) -> None:
        """Drain a backend (no new requests) or enable it again. A drain is how the host agent takes an
        instance out for a restart: its prefixes are forgotten, so it comes back cold."""
        backend.drained = drained
        if drained:
            self.cold(backend)
        if not drained:
            self.dispatch()

    def eject(self, backend: Backend, error: str) -> bool:
        """Take a backend out until its next good /health; True when it was in."""
        if take_out(backend, error):
            self.cold(backend)
            return True
        return False

    def answered(self, backend: Backend, status: int, max_fails: int) -> bool:
        """Count an upstream answer: a 5xx toward max_fails, anything else resets; True when it ejected."""
        error = count_answer(backend, status, max_fails)
        return error is not None and self.eject(backend, error)

    def available_count(self) -> int:
        """How many backends would take a new request (healthy and not drained)."""
        return sum(b.available for b in self._order)


def take_out(backend: Backend, error: str) -> bool:
    """Mark a backend out until its next good /health; True when it was in."""
    backend.last_error = error
    if not backend.healthy:
        return False
    backend.healthy = False
    backend.ejections += 1
    return True


def count_answer(backend: Backend, status: int, max_fails: int) -> str | None:
    """Count an upstream answer: a 5xx toward max_fails, anything else resets; the reason to eject
    the backend when this answer reached max_fails, else None."""
    if status < 500:
        backend.fails = 0  # a 4xx is the client's fault, never the backend's
        return None
    backend.fails += 1
    if backend.fails >= max_fails:
        return f"{backend.fails} answers of 5xx in a row (last {status})"
    return None
