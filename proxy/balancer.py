"""Backend state and the least-connections pick: pure data, no I/O, so it is unit-testable."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass
class Backend:
    """One upstream engine, named host:port, and what the proxy knows about it."""

    name: str
    healthy: bool = False  # unhealthy until its first good health check: it may still be loading
    drained: bool = False
    in_flight: int = 0
    peak_in_flight: int = 0
    last_error: str | None = None

    def __post_init__(self) -> None:
        self.url = f"http://{self.name}"

    @property
    def available(self) -> bool:
        """Whether new requests may go here."""
        return self.healthy and not self.drained

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
                "peak_in_flight": self.peak_in_flight, "last_error": self.last_error}


class Balancer:
    """Least connections over available backends, ties broken round robin."""

    def __init__(self, names: Iterable[str]):
        self.backends: dict[str, Backend] = {n: Backend(n) for n in names}
        self._order = list(self.backends.values())
        self._cursor = 0  # where the next tie-break scan starts

    def acquire(self) -> Backend | None:
        """Pick a backend and count the request on it at once, or None when none is available.

        Pick and count are one step with no await between them: counting later (the seed counted
        after reading the body) lets many requests see the same backend as idlest.
        """
        n = len(self._order)
        best: Backend | None = None
        best_at = 0
        for k in range(n):
            at = (self._cursor + k) % n
            b = self._order[at]
            if b.available and (best is None or b.in_flight < best.in_flight):
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
        """Record a health verdict; True when it changed the backend's health."""
        changed = backend.healthy != healthy
        backend.healthy = healthy
        if error is not None:
            backend.last_error = error
        return changed

    def available_count(self) -> int:
        """How many backends would take a new request (healthy and not drained)."""
        return sum(b.available for b in self._order)
