"""Tenants and the fair admission queue: who a request belongs to, what it may take, and the order in
which a pool's waiting requests get the slots that come free. No I/O, so it is unit-testable.

A tenant is named by the API key's line (`KEY TENANT`; a key alone is `default`'s). Inside each pool the
queue keeps one FIFO per tenant; across tenants the next free slot goes to the backlogged tenant with
the least service counted so far, divided by its weight (a virtual time, counted in tokens: the prompt's
when the request gets its slot, the answer's when it ends, from `usage`). A tenant that comes back from
idle starts at the queue's current virtual time, so it neither banks credit while idle nor waits behind
the others' history; an idle tenant's share goes to the others (work-conserving).
bench/bench_fairness.py measures this against deficit round robin counted in requests.

The reserve (`proxy.queue.tenant_reserve`, k slots): a tenant holding more than its weighted share of a
pool's slots may not take the pool's last k free ones while another tenant has been active there within
RESERVE_ACTIVE_S, so a request of a tenant that is not flooding finds a slot free instead of waiting for
the next one freed. That is the one place the queue is not work-conserving: at most k slots stand idle.
With more than k free (a flood starting), a tenant above its share takes one of them per RAMP_S at most,
so a flood that fills the idle slots at once does not leave the others only the reserve until its first
answers end.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

DEFAULT = "default"      # the tenant of a key written without one, and of every request when keys are off
RESERVE_ACTIVE_S = 5.0   # a tenant counts as active this long after its last request queued or got a slot
RAMP_S = 0.05            # with a reserve, a tenant above its share takes one more idle slot at most this often


def _bounded(lo, hi):
    """A tenant setting, None (no limit) by default, and the bounds a value must keep (fleet/settings/schema.py
    has the same; tests/test_tenants.py holds them equal)."""
    return field(default=None, metadata={"bounds": (lo, hi)})


@dataclass(frozen=True)
class TenantConfig:
    """One tenant's settings from the proxy's `tenants` section; None: no such limit."""

    weight: int = field(default=1, metadata={"bounds": (1, 1000)})   # its share of the slots against others'
    max_in_flight: int | None = _bounded(1, 1_000_000)      # slots it holds at once across the proxy
    max_queued: int | None = _bounded(0, 1_000_000)         # its requests that may wait for a slot
    requests_per_minute: int | None = _bounded(1, 1_000_000_000)
    tokens_per_minute: int | None = _bounded(1, 1_000_000_000_000)


TENANT_KEYS = tuple(f.name for f in fields(TenantConfig))


class Bucket:
    """A token bucket of `per_minute`, full at start; a take may leave it below 0 (a request's tokens are
    known only roughly until it ends), and nothing is taken until it is back above 0."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._clock = clock
        self._at = clock()

    def _fill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now

    def wait_s(self, need: float = 1.0) -> float:
        """Seconds until `need` (at most the capacity) is in the bucket; 0 when it is now."""
        self._fill()
        need = min(need, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float) -> None:
        """Take amount (a correction may be negative: given back)."""
        self._fill()
        self.level = min(self.capacity, self.level - amount)

    def resize(self, per_minute: int) -> None:
        """Take a new rate (this entry's share of a limit changed): the level keeps its fraction of the
        capacity, so a share that grows does not hand out at once what the other entry already admitted."""
        self._fill()
        self.level *= per_minute / self.capacity
        self.capacity, self.rate = float(per_minute), per_minute / 60.0


@dataclass
class Tenant:
    """One tenant's live state across the proxy's pools: its settings, its counts, its buckets."""

    name: str
    config: TenantConfig = TenantConfig()
    in_flight: int = 0      # slots it holds now, in every pool
    queued: int = 0         # its requests waiting for a slot, in every pool
    requests: Bucket | None = None
    tokens: Bucket | None = None

    def __post_init__(self) -> None:
        self.configure(self.config)

    def configure(self, config: TenantConfig, part: Callable[[int], int] = int) -> None:
        """Take new settings (a reload): a bucket whose limit changed starts full; part(limit) is what this
        entry admits of a limit (its share in an active-active pair), and a bucket whose part alone
        changed keeps its level's fraction (Bucket.resize)."""
        old, self.config = self.config, config
        self.requests = _bucket(self.requests, old.requests_per_minute, config.requests_per_minute, part)
        self.tokens = _bucket(self.tokens, old.tokens_per_minute, config.tokens_per_minute, part)

    @property
    def weight(self) -> int:
        return self.config.weight

    def admits_per_minute(self) -> dict:
        """What this proxy admits of each per-minute limit (its part in an active-active pair); None: no limit."""
        return {"requests": self.requests and int(self.requests.capacity),
                "tokens": self.tokens and int(self.tokens.capacity)}

    @property
    def may_run(self) -> bool:
        """Whether it may take one more slot now (below its max_in_flight)."""
        cap = self.config.max_in_flight
        return cap is None or self.in_flight < cap

    def queue_refusal(self) -> tuple[str, str] | None:
        """Why a request of this tenant that finds no slot for it may not wait: (the limit, a sentence), or
        None when it may (below its max_queued, or none set)."""
        c = self.config
        if c.max_queued is None or self.queued < c.max_queued:
            return None
        if not self.may_run:
            return ("max_in_flight", f"tenant {self.name} has {self.in_flight} requests in flight (its "
                    f"max_in_flight) and {self.queued} waiting (its max_queued); retry shortly.")
        return ("max_queued", f"tenant {self.name} has {self.queued} requests waiting already (its "
                f"max_queued); retry shortly.")

    def refusal(self) -> tuple[str, str, float] | None:
        """Why a new request is turned away by a rate limit now: (the limit, a sentence, seconds to wait),
        or None when its buckets let it in."""
        c = self.config
        if self.requests is not None:
            wait = self.requests.wait_s(1)
            if wait > 0:
                return ("requests_per_minute", f"tenant {self.name} sent its {c.requests_per_minute} requests "
                        f"per minute (requests_per_minute); retry in {math.ceil(wait)}s.", wait)
        if self.tokens is not None:
            wait = self.tokens.wait_s(1)
            if wait > 0:
                return ("tokens_per_minute", f"tenant {self.name} used its {c.tokens_per_minute} tokens per "
                        f"minute (tokens_per_minute); retry in {math.ceil(wait)}s.", wait)
        return None

    def admitted(self, tokens: int) -> None:
        """Count a request let in, of about `tokens` prompt tokens, against its buckets."""
        if self.requests is not None:
            self.requests.take(1)
        if self.tokens is not None:
            self.tokens.take(tokens)

    def refunded(self, tokens: int) -> None:
        """Give back what admitted took: the request was turned away before it got a slot."""
        if self.requests is not None:
            self.requests.take(-1)
        if self.tokens is not None:
            self.tokens.take(-tokens)

    def used(self, estimate: int, actual: int) -> None:
        """Correct the token bucket once the answer's `usage` told what the request really took."""
        if self.tokens is not None:
            self.tokens.take(actual - estimate)


@dataclass
class Account:
    """One request's side of its tenant's accounting, from admission to its settling: what it was let in
    for against the buckets (its prompt's tokens as reckoned before the answer), and, once it ends, the
    correction by its usage or the refund of a request that never got a slot."""

    tenant: Tenant
    tokens: int = 0          # its prompt's tokens as admission reckoned them (the token bucket's take)
    admitted: bool = False   # taken from the buckets (given back if it never gets a slot)

    def admit(self, tokens: int) -> tuple[str, str, float] | None:
        """Let the request in against its tenant's per-minute limits (taking from the buckets), or why not:
        (the limit, a sentence, seconds to wait), as Tenant.refusal."""
        self.tokens = tokens
        why = self.tenant.refusal()
        if why is None:
            self.tenant.admitted(tokens)
            self.admitted = True
        return why

    def settle(self, served: bool, prompt: int | None, output: int) -> None:
        """The request ended: served (it got a slot), its usage corrects the token bucket (prompt None: the
        engine did not say, the reckoning stands); never served, what admission took is given back."""
        if not self.admitted:
            return
        if served:
            self.tenant.used(self.tokens, (self.tokens if prompt is None else prompt) + output)
        else:
            self.tenant.refunded(self.tokens)


def _bucket(bucket: Bucket | None, was: int | None, limit: int | None, part: Callable[[int], int]) -> Bucket | None:
    """The bucket of a limit now `limit` (None: no limit) that was `was`, this entry admitting part(limit)."""
    if limit is None:
        return None
    if bucket is None or was != limit:
        return Bucket(part(limit))
    if bucket.capacity != part(limit):
        bucket.resize(part(limit))
    return bucket


class Tenants:
    """The proxy's tenants by name: those of the config's `tenants`, and `default`, always there.

    part(limit): what this proxy admits of a per-minute limit; behind a virtual address with active-active
    entries its share (proxy/share.py, as it splits slots), so the entries together admit the limit."""

    def __init__(self, configs: dict[str, TenantConfig] | None = None, part: Callable[[int], int] = int):
        self.by_name: dict[str, Tenant] = {}
        self.part = part
        self.update(configs or {})

    def update(self, configs: dict[str, TenantConfig]) -> None:
        """Take a reloaded `tenants` section (or a new split: the same section again): a kept tenant keeps
        its counts; a dropped one keeps them until its requests end (they hold its object), and is then
        forgotten."""
        wanted = {DEFAULT: TenantConfig(), **configs}
        for name, config in wanted.items():
            if name in self.by_name:
                self.by_name[name].configure(config, self.part)
            else:
                self.by_name[name] = tenant = Tenant(name)     # no limits yet: its buckets come from part
                tenant.configure(config, self.part)
        for name in [n for n in self.by_name if n not in wanted]:
            del self.by_name[name]

    def __getitem__(self, name: str) -> Tenant:
        return self.by_name[name]

    def names(self) -> list[str]:
        return list(self.by_name)


_DEFAULT_TENANT = Tenant(DEFAULT)   # a waiter's tenant when the caller names none (unit tests, retries)


class FairQueue:
    """One pool's waiting requests: a FIFO per tenant, served by weighted virtual time.

    cost: "tokens" (a request is charged its prompt's tokens when it gets a slot and its answer's when
    it ends) or "requests" (charged 1 when it gets a slot: deficit round robin by request count).
    Iterating yields the waiters in the order the queue would serve them (tenants at their
    max_in_flight left out): the routing policy's look-ahead reads that order.
    """

    def __init__(self, cost: str = "tokens", free: Callable[[], tuple[int, int]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """free: the pool's (free slots, slots) now, for the reserve (None: no reserve)."""
        self.cost_unit = cost
        self.reserve = 0                    # slots kept back from a tenant above its share (tenant_reserve)
        self._free = free
        self._clock = clock
        self._running: dict[str, int] = {}  # tenant -> slots it holds in this pool
        self._seen: dict[str, float] = {}   # tenant -> when a request of it last queued or got a slot here
        self._ramp_at = -math.inf           # when a tenant above its share last took one of more than k free
        self._fifos: dict[str, deque] = {}
        self._tenant: dict[str, Tenant] = {}
        self._vt: dict[str, float] = {}     # tenant -> service counted so far / weight
        self._now = 0.0                     # the virtual time of the last waiter served
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def cost(self, tokens: int, route=None) -> float:
        """What getting a slot costs a request's tenant, before its weight: 1 counting requests; counting
        tokens, its prompt's (tokens as admission reckoned them, else its route's), at least 1."""
        if self.cost_unit == "requests":
            return 1.0
        return float(max(1, tokens or (route.prompt_tokens if route is not None else 0)))

    def charge_of(self, waiter) -> float:
        """What getting a slot costs a waiter's tenant, before its weight."""
        return self.cost(getattr(waiter, "tokens", 0), waiter.route)

    def append(self, waiter) -> None:
        """Queue a waiter behind its tenant's earlier ones."""
        tenant = waiter.tenant or _DEFAULT_TENANT
        name = tenant.name
        waiter.seq = next(self._seq)
        fifo = self._fifos.get(name)
        if not fifo:
            # Back from idle: from the queue's present, so it neither banks credit nor pays others' past.
            self._vt[name] = max(self._vt.get(name, 0.0), self._now)
            if fifo is None:
                fifo = self._fifos[name] = deque()
        self._tenant[name] = tenant
        self._seen[name] = self._clock()
        fifo.append(waiter)
        tenant.queued += 1
        self._len += 1

    def __iter__(self) -> Iterator:
        """The waiters in serving order: the tenant with the least virtual time first, its waiters in
        their order, each advancing its tenant's time by its cost over its weight."""
        kept = self._kept_back_now()
        heap = [(self._vt[name], fifo[0].seq, name, 0) for name, fifo in self._fifos.items()
                if fifo and self._tenant[name].may_run and not kept(self._tenant[name])]
        heapq.heapify(heap)
        while heap:
            vt, _, name, at = heapq.heappop(heap)
            fifo = self._fifos[name]
            w = fifo[at]
            yield w
            if at + 1 < len(fifo):
                step = self.charge_of(w) / self._tenant[name].weight
                heapq.heappush(heap, (vt + step, fifo[at + 1].seq, name, at + 1))

    def kept_back(self, tenant: Tenant | None) -> bool:
        """Whether the reserve keeps tenant from the pool's free slots now (see the module's docstring)."""
        return self._kept_back_now()(tenant or _DEFAULT_TENANT)

    def _kept_back_now(self) -> Callable[[Tenant], bool]:
        """The reserve's verdict for any tenant, the pool's slots read once: a tenant is kept back when at
        most `reserve` slots are free, it holds more than its weighted share of the slots among the
        active tenants (holding or waiting for a slot here, or seen within RESERVE_ACTIVE_S), and one of
        them is not itself."""
        if self.reserve <= 0 or self._free is None or len(self._tenant) < 2:
            return _never             # off, or one tenant only ever seen here: nobody to keep slots for
        free, total = self._free()
        now = self._clock()
        if total <= 0 or (free > self.reserve and self.ramp_wait(now) == 0):
            return _never
        return self._above_share(total, now)

    def ramp_wait(self, now: float | None = None) -> float:
        """Seconds until a tenant above its share may take one more of more than `reserve` free slots."""
        now = self._clock() if now is None else now
        return max(0.0, self._ramp_at + RAMP_S - now)

    def _above_share(self, total: int, now: float, more: int = 0) -> Callable[[Tenant], bool]:
        """Whether a tenant holding `more` slots besides its own holds more than its weighted share of
        total among the active tenants, one of them another (False when none is)."""
        active = [t for n, t in self._tenant.items()
                  if self._running.get(n) or self._fifos.get(n) or now - self._seen.get(n, -math.inf) <= RESERVE_ACTIVE_S]

        def above(tenant: Tenant) -> bool:
            weights = sum(t.weight for t in active if t.name != tenant.name)
            if not weights:
                return False          # nobody else to keep slots for
            return self._running.get(tenant.name, 0) + more > total * tenant.weight / (weights + tenant.weight)
        return above

    def crowding(self, tenant: Tenant | None):
        """When the queue is full and tenant's request arrives: the newest waiter of the tenant holding
        the most of the queue for its weight, if that is more than tenant would hold with this request;
        else None. Turning it away keeps a flood from one tenant from filling the queue against the others."""
        tenant = tenant or _DEFAULT_TENANT
        mine = len(self._fifos.get(tenant.name, ())) + 1
        name = max(self._fifos, key=lambda n: len(self._fifos[n]) / self._tenant[n].weight, default=None)
        if name is None or name == tenant.name:
            return None
        if len(self._fifos[name]) / self._tenant[name].weight <= mine / tenant.weight:
            return None
        return self._fifos[name][-1]

    def remove(self, waiter) -> None:
        """Take a waiter out without serving it (it timed out or left)."""
        name = (waiter.tenant or _DEFAULT_TENANT).name
        fifo = self._fifos.get(name)
        if fifo is None:
            return
        try:
            fifo.remove(waiter)
        except ValueError:
            return
        self._tenant[name].queued -= 1
        self._len -= 1
        if not fifo:
            del self._fifos[name]

    def served(self, waiter, charge: bool = False) -> None:
        """Take a waiter out as it gets a slot (the balancer's acquire charged its tenant already; charge:
        here, when nothing else does)."""
        tenant = waiter.tenant or _DEFAULT_TENANT
        start = self._vt.get(tenant.name, 0.0) - (0.0 if charge else self.charge_of(waiter) / tenant.weight)
        self._now = max(self._now, start)      # the queue's present: where its tenant's time stood
        self.remove(waiter)
        if charge:
            self.charge(waiter.tenant, self.charge_of(waiter))

    def started(self, tenant: Tenant | None, amount: float) -> None:
        """A request of tenant's got a slot, amount its cost: the queue's present moves up to where its
        tenant's time stood (a tenant that ran alone, never queueing, carries the present with it, so one
        that comes after it starts there too, not at 0, far ahead of it), then it is charged."""
        tenant = tenant or _DEFAULT_TENANT
        self._tenant[tenant.name] = tenant
        now = self._seen[tenant.name] = self._clock()
        if self.reserve > 0 and self._free is not None and len(self._tenant) > 1:
            free, total = self._free()       # its slot is counted already
            if free > self.reserve and total > 0 and self._above_share(total, now, more=1)(tenant):
                self._ramp_at = now          # it grew into idle slots above its share (not a replacement)
        self._running[tenant.name] = self._running.get(tenant.name, 0) + 1
        tenant.in_flight += 1
        self._vt[tenant.name] = max(self._vt.get(tenant.name, 0.0), self._now)   # back from idle, as append
        self._now = max(self._now, self._vt[tenant.name])
        self.charge(tenant, amount)

    def finished(self, tenant: Tenant | None) -> None:
        """A request of tenant's that `started` gave its slot back."""
        tenant = tenant or _DEFAULT_TENANT
        tenant.in_flight -= 1
        name = tenant.name
        self._running[name] = self._running.get(name, 0) - 1
        if self._running[name] <= 0:
            del self._running[name]

    def charge(self, tenant: Tenant | None, amount: float) -> None:
        """Count amount (tokens, or requests) of service to tenant in this pool."""
        tenant = tenant or _DEFAULT_TENANT
        self._vt[tenant.name] = self._vt.get(tenant.name, self._now) + amount / tenant.weight

    def ended(self, tenant: Tenant | None, output_tokens: int) -> None:
        """A request of tenant's ended with output_tokens (from usage): counted when the cost is tokens."""
        if self.cost_unit == "tokens" and output_tokens > 0:
            self.charge(tenant, output_tokens)


def _never(tenant: Tenant) -> bool:
    return False
