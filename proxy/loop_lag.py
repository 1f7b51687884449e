"""The event loop's own lag: how late a task that asks to wake every TICK_S actually wakes.

What a client sees of a stall (a `/health` answer late) also holds the time its connection waited in the
listen queue and the kernel's work; this is the loop alone: a callback that runs long, or a burst of them
in one turn, shows here as the ticker's lateness. `proxy_event_loop_lag_seconds` (a histogram of every
tick's lateness) and `proxy_event_loop_lag_worst_seconds` (the worst since the proxy started).
"""
from __future__ import annotations

import asyncio
import time

TICK_S = 0.01    # 100 wakeups a second: a stall of 10 ms or more never falls between two ticks


async def watch(histogram, worst, tick_s: float = TICK_S, clock=time.monotonic) -> None:
    """Sleep tick_s at a time for ever; observe each wakeup's lateness into histogram, the worst into worst."""
    most = 0.0
    while True:
        asked = clock()
        await asyncio.sleep(tick_s)
        late = max(0.0, clock() - asked - tick_s)
        histogram.observe(late)
        if late > most:
            most = late
            worst.set(late)
