"""Backend state, slots, membership and the admission queue, with the routing policy's pick: no I/O, so
it is unit-testable."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Collection, Iterable

from .admission import FairQueue, Tenant
from .routing import Hold, Route, RoutingConfig, make_policy


class QueueFull(Exception):
    """Every slot is taken and the queue holds proxy.queue.max requests already."""


class QueueTimeout(Exception):
    """A request waited proxy.queue.timeout_s in the queue without a slot coming free."""


class TenantFull(Exception):
    """The request's tenant may not have one more waiting (its max_queued): args (limit, sentence)."""


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
    share: int | None = None  # proxy.workers > 1: this worker's part of its slots, < 0 when it owes; None: all
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
        return (self.available and (not self.slots or self.in_flight < self.slots)
                and (self.share is None or self.in_flight < self.share))

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


@dataclass(eq=False)
class Waiter:
    """A request in the queue: its future (set to the backend it gets), its route, its tenant (None:
    `default`), its prompt's tokens as admission reckoned them (0: the route's), and how many requests
    behind it in the fair order were handed a slot first (a policy's look-ahead, such as prefix's; bounded)."""

    future: asyncio.Future
    route: Route | None = None
    tenant: Tenant | None = None
    tokens: int = 0
    overtaken: int = 0
    seq: int = 0        # its place in arrival order (the fair queue's tie-break)
    home: str | None = None   # the backend it waits for until its hold is up (Policy.hold); None: any
    since: float = field(default_factory=time.monotonic)   # when it began waiting (workers compare theirs)
    not_before: float = 0.0   # time.monotonic() before which it takes no slot (a hold's defer_s)


class Balancer:
    """One pool: its backends and their slots, and one fair queue (proxy/admission.py: a FIFO per
    tenant, weighted across tenants) for the requests that find every slot taken, each handed the first
    slot freed anywhere in the queue's fair order. Among the backends with a free slot the routing
    policy picks (proxy/routing/), given the least loaded (ties broken round robin); it may hand a freed
    slot to a waiter other than the fair order's first.

    slots: a backend's slots (0: no limit). queue_max: how many may wait (0: none, refuse at once).
    lending: with proxy.workers > 1, the worker's proxy.workers.Lending (set once per process): told of
    every pool's backends, of a request that must wait, and of every slot freed, so that workers lend
    each other their idle slots.
    """

    lending = None

    def __init__(self, names: Iterable[str], slots: int = 0, queue_max: int = 0,
                 routing: RoutingConfig | None = None):
        self.backends: dict[str, Backend] = {}
        self._order: list[Backend] = []
        self._cursor = 0  # where the next tie-break scan starts
        self._queue = FairQueue(free=self._free_slots)
        self._ramp_timer: asyncio.TimerHandle | None = None   # a dispatch when the reserve's ramp lets one more in
        self.queue_max = queue_max
        self.slots = slots
        self.policy = make_policy(routing or RoutingConfig())
        self.update(names)

    def set_routing(self, routing: RoutingConfig) -> None:
        """Take a reloaded routing config (a new policy or bound starts the policy afresh)."""
        if routing != self.policy.config:
            self.policy = make_policy(routing)

    def set_reserve(self, slots: int) -> None:
        """Keep the pool's last `slots` free slots from a tenant above its share while others are active
        (proxy.queue.tenant_reserve; proxy/admission.py); 0: off."""
        self._queue.reserve = slots
        self.dispatch()

    def _free_slots(self) -> tuple[int, int]:
        """The available backends' free slots and all their slots (the reserve's reading; 0, 0: no limit)."""
        up = [b for b in self._order if b.available] if self.slots else []
        return sum(max(0, self.slots - b.in_flight) for b in up), self.slots * len(up)

    @property
    def needs_body(self) -> bool:
        """Whether the policy reads a request's body before the pick (keeps the count before it when not)."""
        return self.policy.needs_body

    def route_of(self, parsed) -> Route | None:
        """What the policy makes of a chat/completions request's parsed body (proxy/body.py); safe in a
        worker thread (it touches no state of the pool's)."""
        return self.policy.route_of(parsed)

    @property
    def shares_routing(self) -> bool:
        """Whether peer entries learn its routing decisions (proxy/share.py)."""
        return self.policy.shares_routing

    def keep_feed(self) -> None:
        """Keep the policy's latest decisions from now on, for a peer entry to read."""
        self.policy.keep_feed()

    def decisions_since(self, seq: int, limit: int) -> list[tuple[int, str, list[int]]]:
        """The policy's decisions after seq, for a peer entry's feed."""
        return self.policy.decisions_since(seq, limit)

    def adopt(self, backend: str, blocks: list[int]) -> None:
        """A peer entry sent a prompt of these blocks to backend (one of this pool's): the policy remembers it."""
        if backend in self.backends:
            self.policy.adopt(backend, blocks)

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
        if self.lending is not None:
            self.lending.shares(self)
        self.dispatch()
        return added, removed

    def acquire(self, exclude: Collection[Backend] = (), over: bool = False,
                route: Route | None = None, tenant: Tenant | None = None, tokens: int = 0,
                only: str | None = None) -> Backend | None:
        """Pick a backend with a free slot (not one of exclude) and count the request on it at once,
        or None. over: when no slot is free, the least loaded available backend all the same (a retry,
        which already held a slot elsewhere). route: what the policy made of the request (its
        route_of); the policy writes its decision into it. tenant: counted too (a retry's is already), and
        charged the request's prompt (tokens, or the route's) in the fair queue's count of its service.
        only: that backend or none (a waiter held for its home).

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
        if self.lending is not None and self.shares_routing:
            self.lending.decided()      # the other workers learn where it went (proxy/workers.py)
        self._cursor = self._at[best.name] + 1  # the next tie goes to the backend after this one
        best.in_flight += 1
        if best.in_flight > best.peak_in_flight:
            best.peak_in_flight = best.in_flight
        if tenant is not None:
            self._queue.started(tenant, self._queue.cost(tokens, route))
        return best

    def may_take(self, tenant: Tenant | None = None) -> bool:
        """Whether a new request may try `acquire` at once: nobody the fair order would serve first
        waits (but those held for their home backend), and its tenant is below its max_in_flight and not
        kept back by the reserve."""
        if tenant is not None and (not tenant.may_run or self._queue.kept_back(tenant)):
            return False
        return not self.ahead()

    def hold(self, route: Route | None) -> Hold | None:
        """Whether the policy would have the request wait for a full backend (its home) while others have
        a free slot: (that backend, seconds at most), to pass to wait_for_slot; None: acquire now. Never
        when the queue is full or others wait already (they go first)."""
        if route is None or self.ahead() or len(self._queue) >= self.queue_max:
            return None
        return self.policy.hold(route, [b for b in self._order if b.free], self._order)

    async def wait_for_slot(self, timeout_s: float, route: Route | None = None, tenant: Tenant | None = None,
                            tokens: int = 0, hold: Hold | None = None) -> Backend | None:
        """A backend with the request (and its tenant) counted on it, once the requests the fair order
        serves before it have theirs (the caller tried `acquire` first when it could). None when no
        backend is available at all. hold: (home, seconds) from `hold`: the request takes only a slot of
        home until seconds passed, then any (the queue's order still applies: a held waiter is passed
        over while home is full).

        Raises QueueFull (nobody may wait, or queue_max wait already and its tenant holds no less of
        the queue than any other, by weight; else the newest waiter of the tenant that holds the most
        gets QueueFull in its place), TenantFull (its tenant's
        max_queued wait already) or QueueTimeout (timeout_s waited). A caller cancelled while waiting
        (its client left) leaves the queue; a slot handed to it in that instant goes on to the next in
        line, so no count is ever lost.
        """
        if hold is None and self.may_take(tenant):
            backend = self.acquire(route=route, tenant=tenant, tokens=tokens)   # a slot may have come free since
            if backend is not None:
                return backend
        if not self.available_count():
            return None
        if len(self._queue) >= self.queue_max:
            crowding = self._queue.crowding(tenant)   # the full queue's biggest share gives way, newest first
            if crowding is None:
                raise QueueFull()
            self._queue.remove(crowding)
            crowding.future.set_exception(QueueFull())
        if tenant is not None and (why := tenant.queue_refusal()) is not None:
            raise TenantFull(*why)
        if hold is None and route is not None:   # it waits anyway: for its home's slot, if the policy has one
            hold = self.policy.hold(route, [b for b in self._order if b.free], self._order)
        loop = asyncio.get_running_loop()
        waiter = Waiter(loop.create_future(), route, tenant, tokens)
        self._queue.append(waiter)
        if self.lending is not None:
            self.lending.waiting(self)
        self._after_ramp()       # kept back by the reserve's ramp: a dispatch when it lets one more in
        timer = loop.call_later(timeout_s, self._expire, waiter)
        unhold = defer = None
        if hold is not None:
            waiter.home = hold.backend.name
            unhold = loop.call_later(hold.seconds, self._unhold, waiter)
            if hold.defer_s > 0:
                waiter.not_before = time.monotonic() + hold.defer_s
                defer = loop.call_later(hold.defer_s, self.dispatch)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result(), tenant)   # handed a slot as the client left: pass it on
            else:
                self._queue.remove(waiter)
            raise
        finally:
            timer.cancel()
            if unhold is not None:
                unhold.cancel()
            if defer is not None:
                defer.cancel()

    def _unhold(self, waiter: Waiter) -> None:
        """A held waiter's time is up: any free slot will do now."""
        waiter.home = None
        if not waiter.future.done():
            self.dispatch()

    def _ready(self, w: Waiter) -> bool:
        """Whether a waiter may take a slot now: its hold's defer is over, and it waits for no backend, or
        for one that has a free slot (or that is out: then for none)."""
        if w.not_before and time.monotonic() < w.not_before:
            return False
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

    def _expire(self, waiter: Waiter) -> None:
        if not waiter.future.done():
            self._queue.remove(waiter)
            waiter.future.set_exception(QueueTimeout())

    def dispatch(self) -> None:
        """Hand free slots to the requests waiting, in the fair queue's order (its first: the tenant
        furthest behind its weighted share, that tenant's oldest request), unless the policy prefers
        another waiter of that order (prefix: one of the first routing.lookahead whose prefix lives on a
        free backend, no waiter passed over more than lookahead times).

        Held waiters (Policy.hold: waiting a little for their home backend) take only a slot of their
        home until their time is up (_unhold); while it is full they are passed over, and when it frees
        a slot they take it first (_next)."""
        while self._queue:
            head = next(iter(self._queue), None)
            if head is None:          # only tenants at their max_in_flight (or kept back by the reserve) wait
                self._after_ramp()
                return
            if head.future.done():   # cancelled, its task not run yet (it would forget itself)
                self._queue.remove(head)
                continue
            chosen = self.policy.waiter(self._queue, self._order)
            if chosen is not None and chosen.tenant is not head.tenant:
                chosen = None     # the look-ahead reorders a tenant's own requests, never takes another's turn
            if chosen is None or not self._ready(chosen):
                chosen = self._next()
            if chosen is None:
                return
            backend = self.acquire(route=chosen.route, tenant=chosen.tenant, tokens=chosen.tokens,
                                   only=self._home_of(chosen))
            if backend is None:
                return
            if chosen is not head:
                for w in self._queue:
                    if w is chosen:
                        break
                    w.overtaken += 1
            self._queue.served(chosen)
            chosen.future.set_result(backend)

    def _after_ramp(self) -> None:
        """Dispatch again when the reserve's ramp lets a tenant above its share take one more free slot."""
        wait = self._queue.ramp_wait()
        if not wait or self._ramp_timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:          # no loop (a unit test's plain call): the next release dispatches
            return
        self._ramp_timer = loop.call_later(wait, self._ramp_due)

    def _ramp_due(self) -> None:
        self._ramp_timer = None
        self.dispatch()

    def ahead(self) -> bool:
        """Whether a new request must queue behind others: one waits that is not held for its home (held
        ones wait for one backend only; a new request may take another's free slot)."""
        return any(w.home is None and not w.future.done() for w in self._queue)

    def waiting_since(self, most: int) -> list[float]:
        """When the first `most` waiters in the fair order began waiting (proxy/workers.py: which worker's
        waiter is oldest gets the next freed slot)."""
        out = []
        for w in self._queue:
            if not w.future.done():
                out.append(w.since)
                if len(out) >= most:
                    break
        return out

    @property
    def queued(self) -> int:
        """How many requests wait for a slot."""
        return len(self._queue)

    def finish(self, backend: Backend, tenant: Tenant | None = None, route: Route | None = None,
               cached_tokens: int | None = None, prompt_tokens: int | None = None, output_tokens: int = 0,
               timing: tuple[float, float] | None = None) -> None:
        """A request that held a slot on backend ended: the one call its end makes to its pool. What the
        engine said of its cached prompt tokens goes to the policy (cached_tokens None: nothing learned),
        and a streamed answer's timing (seconds from its slot to its first token, then to its last), its
        answer's tokens to the fair queue's count of its tenant's service, then its slot is released."""
        if cached_tokens is not None:
            self.policy.learned(route, backend, cached_tokens, prompt_tokens, output_tokens)
        if timing is not None:
            self.policy.timed(route, backend, timing[0], timing[1], output_tokens)
        self._queue.ended(tenant, output_tokens)
        self.release(backend, tenant)

    def release(self, backend: Backend, tenant: Tenant | None = None) -> None:
        """Uncount one finished request (and its tenant's, when given); its slot goes to the first request
        in the fair order, if any."""
        backend.in_flight -= 1
        if tenant is not None:
            self._queue.finished(tenant)
        self.policy.ended(backend)
        if self.lending is not None and self.lending.freed(self, backend):
            return           # the slot went to another worker that waits for one
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
