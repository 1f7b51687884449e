"""At most max_num_seqs requests run at once, the rest wait in FIFO order, with the counts tests read.

With a prefix cache, a request also runs only when its prompt's blocks can be had; the head of the line
waits for them and nobody overtakes it, as vLLM's FCFS scheduler stops at the first waiting request it
cannot allocate (vllm/v1/core/sched/scheduler.py).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Callable

from fleet.sim.prefix_cache import Allocation, PrefixCache


class Scheduler:
    """Running slots, a FIFO of waiters, peaks and counters; the prefix cache's blocks when given one."""

    def __init__(self, max_num_seqs: int, on_change: Callable[[], None] = lambda: None,
                 cache: PrefixCache | None = None):
        self.max_num_seqs = max_num_seqs
        self.cache = cache
        self.running = 0
        self._waiters: deque[tuple[asyncio.Future, tuple]] = deque()
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
    async def slot(self, hashes: list[bytes] = (), n_tokens: int = 0):
        """Hold a running slot (and the prompt's cache blocks) for the body; waits in line first when all
        slots are taken or the blocks cannot be had. Yields the allocation (None without a cache)."""
        alloc = await self._acquire((list(hashes), n_tokens))
        try:
            yield alloc
        finally:
            self._release(alloc)

    def _fits(self, request: tuple) -> bool:
        return self.running < self.max_num_seqs and (self.cache is None or self.cache.fits(*request))

    def _start(self, request: tuple) -> Allocation | None:
        self.running += 1
        return self.cache.allocate(*request) if self.cache is not None else None

    async def _acquire(self, request: tuple) -> Allocation | None:
        if not self._waiters and self._fits(request):
            alloc = self._start(request)
            self._changed()
            return alloc
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, request))
        self._changed()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(fut.result())  # the slot was handed over just as the client left: give it on
            else:
                self._waiters = deque(w for w in self._waiters if w[0] is not fut)
                self._changed()
                self._hand_over()   # the head may have left: the next one may fit
            raise

    def _release(self, alloc: Allocation | None) -> None:
        self.running -= 1
        if alloc is not None:
            self.cache.free(alloc)
        self._hand_over()
        self._changed()

    def _hand_over(self) -> None:
        while self._waiters:
            fut, request = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(request):
                break
            self._waiters.popleft()
            fut.set_result(self._start(request))

    def _changed(self) -> None:
        self.peak_running = max(self.peak_running, self.running)
        self.peak_in_flight = max(self.peak_in_flight, self.running + self.waiting)
        self._on_change()
