"""Backend state, the least-connections pick and the admission queue: no I/O, so it is unit-testable."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Iterable


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


class Balancer:
    """Least connections over backends with a free slot, ties broken round robin; one FIFO queue
    for the requests that find every slot taken, each handed the first slot freed anywhere.

    slots: a backend's slots (0: no limit). queue_max: how many may wait (0: none, refuse at once).
    """

    def __init__(self, names: Iterable[str], slots: int = 0, queue_max: int = 0):
        self.backends: dict[str, Backend] = {}
        self._order: list[Backend] = []
        self._cursor = 0  # where the next tie-break scan starts
        self._queue: deque[asyncio.Future] = deque()
        self.queue_max = queue_max
        self.slots = slots
        self.update(names)

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
        for n in added:
            self.backends[n] = Backend(n)
        self.backends = {n: self.backends[n] for n in names}
        for b in self.backends.values():
            b.slots = self.slots
        self._order = list(self.backends.values())
        self._cursor = 0
        self.dispatch()
        return added, removed

    def acquire(self, exclude: Collection[Backend] = (), over: bool = False) -> Backend | None:
        """Pick a backend with a free slot (not one of exclude) and count the request on it at once,
        or None. over: when no slot is free, the least loaded available backend all the same (a retry,
        which already held a slot elsewhere).

        Pick and count are one step with no await between them: counting later (the seed counted
        after reading the body) lets many requests see the same backend as idlest.
        """
        n = len(self._order)
        best: Backend | None = None
        best_at = 0
        for k in range(n):
            at = (self._cursor + k) % n
            b = self._order[at]
            if (b.free or (over and b.available)) and b not in exclude and (
                    best is None or b.in_flight < best.in_flight):
                best, best_at = b, at
        if best is None:
            return None
        self._cursor = best_at + 1  # the next tie goes to the backend after this one
        best.in_flight += 1
        if best.in_flight > best.peak_in_flight:
            best.peak_in_flight = best.in_flight
        return best

    async def wait_for_slot(self, timeout_s: float) -> Backend | None:
        """A backend with the request counted on it, once the requests queued before it have theirs
        (the caller tried `acquire` first when nobody waited). None when no backend is available at all.

        Raises QueueFull (nobody may wait, or queue_max wait already) or QueueTimeout (timeout_s
        waited). A caller cancelled while waiting (its client left) leaves the queue; a slot handed
        to it in that instant goes on to the next in line, so no count is ever lost.
        """
        if not self._queue:
            backend = self.acquire()   # a slot may have come free since the caller looked
            if backend is not None:
                return backend
        if not self.available_count():
            return None
        if len(self._queue) >= self.queue_max:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._queue.append(waiter)
        timer = loop.call_later(timeout_s, self._expire, waiter)
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

    def _expire(self, waiter: asyncio.Future) -> None:
        if not waiter.done():
            self._forget(waiter)
            waiter.set_exception(QueueTimeout())

    def _forget(self, waiter: asyncio.Future) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            pass

    def dispatch(self) -> None:
        """Hand free slots to the requests waiting, first come first served."""
        while self._queue:
            if self._queue[0].done():   # cancelled, its task not run yet (it would forget itself)
                self._queue.popleft()
                continue
            backend = self.acquire()
            if backend is None:
                return
            self._queue.popleft().set_result(backend)

    @property
    def queued(self) -> int:
        """How many requests wait for a slot."""
        return len(self._queue)

    def release(self, backend: Backend) -> None:
        """Uncount one finished request; its slot goes to the first request waiting, if any."""
        backend.in_flight -= 1
        if self._queue:
            self.dispatch()

    def mark(self, backend: Backend, healthy: bool, error: str | None = None) -> bool:
        """Record a health check's verdict; True when it changed the backend's health."""
        changed = backend.healthy != healthy
        backend.healthy = healthy
        if healthy:
            backend.fails = 0
        if error is not None:
            backend.last_error = error
        if changed and healthy:
            self.dispatch()   # its slots are free for whoever waits
        return changed

    def set_drained(self, backend: Backend, drained: bool) -> None:
        """Drain a backend (no new requests) or enable it again."""
        backend.drained = drained
        if not drained:
            self.dispatch()

    @staticmethod
    def eject(backend: Backend, error: str) -> bool:
        """Take a backend out until its next good /health; True when it was in."""
        backend.last_error = error
        if not backend.healthy:
            return False
        backend.healthy = False
        backend.ejections += 1
        return True

    @classmethod
    def answered(cls, backend: Backend, status: int, max_fails: int) -> bool:
        """Count an upstream answer: a 5xx toward max_fails, anything else resets; True when it ejected."""
        if status < 500:
            backend.fails = 0  # a 4xx is the client's fault, never the backend's
            return False
        backend.fails += 1
        if backend.fails >= max_fails:
            return cls.eject(backend, f"{backend.fails} answers of 5xx in a row (last {status})")
        return False

    def available_count(self) -> int:
        """How many backends would take a new request (healthy and not drained)."""
        return sum(b.available for b in self._order)
