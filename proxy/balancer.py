"""Backend state and the least-connections pick: pure data, no I/O, so it is unit-testable."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Iterable


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
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"http://{self.name}"

    @property
    def available(self) -> bool:
        """Whether new requests may go here."""
        return self.healthy and not self.drained and not self.removed

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
                "peak_in_flight": self.peak_in_flight, "last_error": self.last_error,
                "fails": self.fails, "ejections": self.ejections}


class Balancer:
    """Least connections over available backends, ties broken round robin."""

    def __init__(self, names: Iterable[str]):
        self.backends: dict[str, Backend] = {}
        self._order: list[Backend] = []
        self._cursor = 0  # where the next tie-break scan starts
        self.update(names)

    def update(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the backend list `names`, keeping the state of those that stay; returns (added, removed).

        A removed backend leaves the pick at once; requests already on it keep their Backend object
        and release it as usual, so nothing in flight is dropped.
        """
        names = list(names)
        added = [n for n in names if n not in self.backends]
        removed = [n for n in self.backends if n not in names]
        for n in removed:
            self.backends.pop(n).removed = True
        for n in added:
            self.backends[n] = Backend(n)
        self.backends = {n: self.backends[n] for n in names}
        self._order = list(self.backends.values())
        self._cursor = 0
        return added, removed

    def acquire(self, exclude: Collection[Backend] = ()) -> Backend | None:
        """Pick a backend (not one of exclude) and count the request on it at once, or None.

        Pick and count are one step with no await between them: counting later (the seed counted
        after reading the body) lets many requests see the same backend as idlest.
        """
        n = len(self._order)
        best: Backend | None = None
        best_at = 0
        for k in range(n):
            at = (self._cursor + k) % n
            b = self._order[at]
            if b.available and b not in exclude and (best is None or b.in_flight < best.in_flight):
                best, best_at = b, at
        if best is None:
            return None
        self._cursor = best_at + 1  # the next tie goes to the backend after this one
        best.in_flight += 1
        if best.in_flight > best.peak_in_flight:
            best.peak_in_flight = best.in_flight
        return best

    @staticmethod
    def release(backend: Backend) -> None:
        """Uncount one finished request."""
        backend.in_flight -= 1

    @staticmethod
    def mark(backend: Backend, healthy: bool, error: str | None = None) -> bool:
        """Record a health check's verdict; True when it changed the backend's health."""
        changed = backend.healthy != healthy
        backend.healthy = healthy
        if healthy:
            backend.fails = 0
        if error is not None:
            backend.last_error = error
        return changed

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
