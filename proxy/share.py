"""Entries behind virtual addresses: each proxy's share of every backend's slots, from which peers serve,
and what the peers' prefix routing sent where.

Two entry hosts that both send to the same engines each count only their own requests; together they
would put up to twice max_num_seqs on a card. With `share` in its config a proxy takes, of a backend's
slots, its weight's share among the entries whose /health answers 200 (itself always counts), the largest
remainders going to the earliest entries, so the shares of the entries that serve add up to the slots
exactly. A peer that stops answering leaves its share to the others at the next poll; a peer that answers
again takes it back. Polled every health interval (proxy.health_interval_s): the peer's proxy is what
serves, whatever holds the address.

Prefix affinity across a move: the entry that takes the address over would start with a cold prefix
index, sending every conversation's next round where its history is not (measured: docs/PERFORMANCE.md).
So at each poll a proxy also reads each serving peer's latest routing decisions (FEED_PATH: the prompt's
block hashes and the backend, answered to the peers' addresses only) and remembers them as its own; block
hashes agree when both proxies run with the same PYTHONHASHSEED (the rendered start script sets the
group's), which the answer's probe checks. Active-passive (share.split false) keeps every slot and only
learns.
"""
from __future__ import annotations

import asyncio
import logging
import os
import urllib.parse

import aiohttp

from .config import ShareConfig
from .routing.prefix import HASH_PROBE

log = logging.getLogger("proxy")

FEED_PATH = "/peer/prefixes"
FEED_LIMIT = 1024                 # decisions in one answer, the newest
# Block hashes in one answer (~20 bytes each in JSON: ~160 KiB): what a peer parses and inserts into its
# index on its event loop per poll stays a few ms; the newest decisions first, at least one.
FEED_BLOCKS = 8192
FEED_ID = os.urandom(6).hex()     # this process's feed: a peer that sees another starts over from 0


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
    (None: not polled yet, so every entry counts: the smaller share until the peers are known). A tenant's
    per-minute limits are split the same way (proxy/state.py), so the entries together admit the limit."""
    if share is None or slots == 0 or not share.split:
        return slots
    serving = [i for i, _ in enumerate(share.entries) if alive is None or i in alive or i == share.me]
    shares = split(slots, [share.entries[i].weight for i in serving])
    return max(1, shares[serving.index(share.me)])


async def poll(proxy) -> None:
    """Poll the peers every health interval. A round that fails (a bug, a peer's answer nothing checked
    for) is logged, once for each kind, and the next round runs: the split must never freeze."""
    while True:
        share = proxy.config.share
        if share is not None:
            try:
                await _round(proxy, share)
            except Exception as e:
                _warn_once(proxy, "", f"round {type(e).__name__}", "share: a poll round failed (%s: %s); the "
                           "next one runs in proxy.health_interval_s", type(e).__name__, e)
        await asyncio.sleep(proxy.config.health.interval_s)


async def _round(proxy, share: ShareConfig) -> None:
    """One poll: the peers' /health; when the set that serves changes, the router takes the new shares of
    the slots and the tenants of the per-minute limits (requests in flight keep their slots; new ones see
    the new count); then what the serving peers' prefix routing decided since the last round."""
    timeout = aiohttp.ClientTimeout(total=min(proxy.config.health.timeout_s, 2.0))
    found = await asyncio.gather(*(_answers(proxy.session, e.health, timeout)
                                   for e in share.entries if e.health))
    peers = [i for i, e in enumerate(share.entries) if e.health]
    alive = frozenset([share.me] + [i for i, ok in zip(peers, found) if ok])
    if alive != proxy.router.alive:
        was = proxy.router.alive
        proxy.router.alive = alive
        proxy.router.update(proxy.config)
        proxy.tenants.update(proxy.config.tenants)
        log.info("share: entries serving %s (were %s): this proxy's slots now %s", sorted(
            share.entries[i].name for i in alive), "unknown" if was is None else sorted(
            share.entries[i].name for i in was), proxy.router.slot_summary())
    learners = [pool for pool in proxy.router.pools.values() if pool.shares_routing]
    for pool in learners:
        pool.keep_feed()    # a policy made anew by a reload starts its feed here
    if learners:
        for i in alive:
            if i != share.me:
                await _learn(proxy, share.entries[i].name, share.entries[i].health, timeout)


def _warn_once(proxy, peer: str, kind: str, message: str, *args) -> None:
    """Log a peer's trouble (peer "" : the poll's own) the first time it is of this kind; a good answer
    from the peer clears its kinds (proxy.router.peer_warned), so trouble that comes back is told again."""
    if (peer, kind) not in proxy.router.peer_warned:
        proxy.router.peer_warned.add((peer, kind))
        log.warning(message, *args)


def feed(proxy, since: int, feed_id: str | None, remote: str | None) -> dict | None:
    """What FEED_PATH answers a peer: this proxy's prefix decisions after `since` (all it keeps when
    feed_id is not this process's), per pool; None (not found) without a share or to another address."""
    share = proxy.config.share
    if share is None or remote is None:
        return None
    peers = {urllib.parse.urlsplit(e.health).hostname for e in share.entries if e.health}
    if remote not in peers and remote not in ("127.0.0.1", "::1"):
        return None
    if feed_id != FEED_ID:
        since = 0
    pools, last = {}, since
    for name, pool in proxy.router.pools.items():
        if pool.shares_routing:
            got = _within(pool.decisions_since(since, FEED_LIMIT), FEED_BLOCKS)
            pools[name] = [[backend, blocks] for _, backend, blocks in got]
            last = max([last] + [d[0] for d in got])
    return {"id": FEED_ID, "seq": last, "probe": HASH_PROBE, "pools": pools}


def _within(decisions: list, most_blocks: int) -> list:
    """The newest of decisions (oldest first) whose blocks add up to at most most_blocks (at least one)."""
    total, keep = 0, 0
    for _, _, blocks in reversed(decisions):
        total += len(blocks)
        if keep and total > most_blocks:
            break
        keep += 1
    return decisions[len(decisions) - keep:]


async def _learn(proxy, name: str, health: str, timeout: aiohttp.ClientTimeout) -> None:
    """Read a peer's new prefix decisions and remember them in the pools of the same name."""
    url = health.rsplit("/", 1)[0] + FEED_PATH
    seen = proxy.router.peer_feeds.get(name, ("", 0))
    try:
        async with proxy.session.get(url, params={"since": str(seen[1]), "id": seen[0]}, timeout=timeout) as r:
            if r.status != 200:
                return
            got = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return
    except ValueError:
        return _warn_once(proxy, name, "json", "share: %s's %s answer is not JSON; its routing is not learned "
                          "until it is (asked again every round)", name, FEED_PATH)
    if isinstance(got, dict) and got.get("probe") is not None and got.get("probe") != HASH_PROBE:
        if name not in proxy.router.peer_mismatch:
            proxy.router.peer_mismatch.add(name)
            log.warning("share: %s's prefix block hashes are not this proxy's (another PYTHONHASHSEED or "
                        "Python): its routing is not learned; start both with the rendered start script", name)
        return
    feed_answer = _feed_answer(got)
    if feed_answer is None:
        return _warn_once(proxy, name, "shape", "share: %s's %s answer is not a feed ({id, seq, probe, pools}); "
                          "its routing is not learned until it is (asked again every round)", name, FEED_PATH)
    proxy.router.peer_mismatch.discard(name)
    proxy.router.peer_warned -= {(name, kind) for kind in ("json", "shape")}
    feed_id, seq, pools = feed_answer
    proxy.router.peer_feeds[name] = (feed_id, seq)
    for pool_name, decisions in pools.items():
        pool = proxy.router.pools.get(pool_name)
        if pool is None or not pool.shares_routing:
            continue
        for backend, blocks in decisions:
            pool.adopt(backend, blocks)


def _feed_answer(got) -> tuple[str, int, dict] | None:
    """A peer's FEED_PATH answer as (feed id, seq, {pool: [[backend, blocks]]}), checked to the last block
    hash (what feed() answers); None when it is anything else."""
    if not isinstance(got, dict) or got.get("probe") != HASH_PROBE:
        return None
    feed_id, seq, pools = got.get("id"), got.get("seq"), got.get("pools")
    if not isinstance(feed_id, str) or type(seq) is not int or seq < 0 or not isinstance(pools, dict):
        return None
    for decisions in pools.values():
        if not isinstance(decisions, list) or len(decisions) > FEED_LIMIT or not all(
                isinstance(d, list) and len(d) == 2 and isinstance(d[0], str) and isinstance(d[1], list)
                and all(type(h) is int for h in d[1]) for d in decisions):
            return None
    return feed_id, seq, pools


async def _answers(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> bool:
    try:
        async with session.get(url, timeout=timeout) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
