"""At most max_num_seqs requests run at once, the rest wait in FIFO order, with the counts tests read."""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Callable


class Scheduler:
    """Running slots, a FIFO of waiters, peaks and counters."""

    def __init__(self, max_num_seqs: int, on_change: Callable[[], None] = lambda: None):
        self.max_num_seqs = max_num_seqs
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._on_change = on_change
        self.reset_stats()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def reset_stats(self) -> None:
        """Forget peaks and counters (the current load becomes the new peak)."""
        self.peak_running = self.running
        self.peak_in_flight = self.running + self.waiting
        self.requests_total = 0
        self.aborted_total = 0

    @contextlib.asynccontextmanager
    async def slot(self):
        """Hold a running slot for the body; waits in line first when all are taken."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self.running < self.max_num_seqs and not self._waiters:
            self.running += 1
            self._changed()
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._changed()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # the slot was handed over just as the client left: give it on
            else:
                self._waiters.remove(fut)
                self._changed()
            raise

    def _release(self) -> None:
        self.running -= 1
        while self._waiters and self.running < self.max_num_seqs:
            fut = self._waiters.popleft()
            if not fut.done():
                self.running += 1
                fut.set_result(None)
        self._changed()

    def _changed(self) -> None:
        self.peak_running = max(self.peak_running, self.running)
        self.peak_in_flight = max(self.peak_in_flight, self.running + self.waiting)
        self._on_change()
