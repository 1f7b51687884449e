"""Active-active entries: each proxy's share of every backend's slots, from which peers serve.

Two entry hosts that both send to the same engines each count only their own requests; together they
would put up to twice max_num_seqs on a card. With `share` in its config a proxy takes, of a backend's
slots, its weight's share among the entries whose /health answers 200 (itself always counts), the largest
remainders going to the earliest entries, so the shares of the entries that serve add up to the slots
exactly. A peer that stops answering leaves its share to the others at the next poll; a peer that answers
again takes it back. Polled every health interval (proxy.health_interval_s): the peer's proxy is what
serves, whatever holds the address.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp

from .config import ShareConfig

log = logging.getLogger("proxy")


def split(slots: int, weights: list[int]) -> list[int]:
    """slots split by weight, largest remainders first (ties: the earlier entry); they add up to slots."""
    total = sum(weights)
    exact = [slots * w / total for w in weights]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (shares[i] - exact[i], i))[:slots - sum(shares)]:
        shares[i] += 1
    return shares


def my_slots(slots: int, share: ShareConfig | None, alive: frozenset[int] | None) -> int:
    """This proxy's slots of a backend that has `slots` (0: no limit, kept), given which entries serve
    (None: not polled yet, so every entry counts: the smaller share until the peers are known)."""
    if share is None or slots == 0:
        return slots
    serving = [i for i, _ in enumerate(share.entries) if alive is None or i in alive or i == share.me]
    shares = split(slots, [share.entries[i].weight for i in serving])
    return max(1, shares[serving.index(share.me)])


async def poll(proxy) -> None:
    """Poll the peers' /health every health interval; when the set that serves changes, the router takes
    the new shares (requests in flight keep their slots; new ones see the new count)."""
    while True:
        share = proxy.config.share
        if share is not None:
            timeout = aiohttp.ClientTimeout(total=min(proxy.config.health.timeout_s, 2.0))
            found = await asyncio.gather(*(_answers(proxy.session, e.health, timeout)
                                           for e in share.entries if e.health))
            peers = [i for i, e in enumerate(share.entries) if e.health]
            alive = frozenset([share.me] + [i for i, ok in zip(peers, found) if ok])
            if alive != proxy.router.alive:
                was = proxy.router.alive
                proxy.router.alive = alive
                proxy.router.update(proxy.config)
                log.info("share: entries serving %s (were %s): this proxy's slots now %s", sorted(
                    share.entries[i].name for i in alive), "unknown" if was is None else sorted(
                    share.entries[i].name for i in was), proxy.router.slot_summary())
        await asyncio.sleep(proxy.config.health.interval_s)


async def _answers(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> bool:
    try:
        async with session.get(url, timeout=timeout) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
