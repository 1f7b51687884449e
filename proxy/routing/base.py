"""The routing seam: the settings every policy reads, and the interface the balancer calls."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Collection, NamedTuple, Protocol, Sequence


def _bounded(default, lo, hi):
    """A routing key's default and the bounds a config value must keep (fleet/settings/schema.py has the same)."""
    return field(default=default, metadata={"bounds": (lo, hi)})


@dataclass(frozen=True)
class RoutingConfig:
    """The routing section of the proxy's config: the policy (a name in proxy.routing.POLICIES) and its
    keys, each with its default and its bounds (docs/proxy.md says what they do)."""

    policy: str = "prefix"   # measured better or equal on every workload (docs/PERFORMANCE.md)
    # prefix: a match wins when it saves this much prefill (tokens) over the least loaded backend's and
    # covers this share of the prompt (a new conversation that shares only a system prompt goes by load)
    min_match_tokens: int = _bounded(256, 0, 10_000_000)
    min_match_ratio: float = _bounded(0.5, 0, 1)
    # prefix: the match's backend is passed over when it has more than balance_abs requests more than the
    # least loaded one and more than balance_rel times as many
    balance_abs: int = _bounded(1, 0, 65536)
    balance_rel: float = _bounded(1.5, 1, 1000)
    # prefix: prompt blocks remembered (64 bytes each), least recently used dropped first; more where the
    # engines publish KV caches that hold more in all (PrefixIndex.bound)
    max_blocks: int = _bounded(262144, 1, 100_000_000)
    # prefix: queued requests a freed slot may look past for one whose prefix is there
    lookahead: int = _bounded(16, 0, 1024)
    # prefix: a prefix many prompts share and leave stays with a backend holding it until this many
    # branched off it there, per 1,000 tokens of it (prefix.SPREAD_TOKENS); then the least loaded takes
    # the next (0: always the least loaded)
    spread_after: int = _bounded(3, 0, 65536)
    # prefix: a request whose home (the backend with its prefix) is full while others have a free slot
    # may wait for a slot at home, at most home_wait_s and at most the prefill its cached prefix saves at
    # prefill_ms per 1,000 tokens (0: never waits). spread_after 3 and home_wait_s 1 measured
    # (bench/bench_routing.py, docs/PERFORMANCE.md): with 2 the groups workload's hit rate fell further.
    home_wait_s: float = _bounded(1.0, 0, 60)
    prefill_ms: float = _bounded(100.0, 0, 100_000)
    # balance_abs 1 and lookahead 16 measured (bench/bench_routing.py, docs/PERFORMANCE.md): with 2, one
    # hot system prompt left a backend idle; with 4, a saturated fleet scattered conversations.


class Route(Protocol):
    """What a policy made of one request, as the results log and the metrics report it."""

    decision: str          # the results log's `route`, the metrics' decision label
    matched_tokens: int    # prompt tokens the chosen backend likely holds already
    prompt_tokens: int     # the prompt's tokens, as the policy reckons them
    overruled: str | None  # what a prediction overruled to decide it (the results log's `overruled`), or None


class Backend(Protocol):
    """A backend as a policy sees it (proxy.balancer.Backend; the balancer alone changes it)."""

    name: str
    in_flight: int
    kv_tokens: int | None    # its engine's KV cache in tokens (vllm:cache_config_info); None: unknown

    @property
    def free(self) -> bool:
        """Whether it takes a new request now."""

    @property
    def available(self) -> bool:
        """Whether it takes new requests at all (healthy, not drained), a slot free or not."""


class Hold(NamedTuple):
    """A request a policy would have wait for one backend (Policy.hold): its slot only, until seconds
    passed (then any); and not before defer_s, though it has a free slot (0: at once), so that the
    requests arriving with it that find their prefix there start first."""

    backend: "Backend"
    seconds: float
    defer_s: float = 0.0


class Waiter(Protocol):
    """A queued request as a policy sees it (proxy.balancer.Waiter)."""

    future: asyncio.Future   # done: it left the queue already (cancelled, timed out), its turn is not taken
    route: Route | None
    overtaken: int           # requests behind it that were handed a slot first
    home: str | None         # the backend it waits for (Policy.hold), until its time is up; None: any


class Policy:
    """One pool's routing policy: what it needs of a request, how it picks, what it learns and forgets.

    The balancer owns the slots, the queue and the membership and calls these; between a pick and its
    count there is no await. Every policy picks; the other defaults read nothing and learn nothing.
    """

    needs_body = False   # True: the body is read before the pick; False keeps the count before the body
    shares_routing = False   # True: peer entries learn its decisions (keep_feed, decisions_since, adopt)

    def __init__(self, config: RoutingConfig):
        self.config = config

    def route_of(self, body: bytes) -> Route | None:
        """What a chat/completions request brings to the pick, from its body (read when needs_body)."""
        return None

    def pick(self, route: Route | None, least: Backend, candidates: Sequence[Backend]) -> Backend:
        """The backend for a request: one of candidates (every backend it may go to now, in round-robin
        order); least is the least loaded of them. The decision is written into route."""
        raise NotImplementedError

    def sent(self, route: Route | None, backend: Backend) -> None:
        """Learn that a request was counted on backend."""

    def ended(self, backend: Backend) -> None:
        """Learn that a request on backend finished."""

    def learned(self, route: Route | None, backend: Backend, cached_tokens: int | None,
                prompt_tokens: int | None, output_tokens: int = 0) -> None:
        """Learn what the engine said of a request it answered: the prompt's tokens it found in its
        prefix cache (usage.prompt_tokens_details.cached_tokens; None: it did not say) of prompt_tokens,
        and its answer's output_tokens (which its engine caches too)."""

    def timed(self, route: Route | None, backend: Backend, first_token_s: float, decode_s: float,
              output_tokens: int) -> None:
        """Learn how long a streamed answer took on backend: from its slot to its first token, and from
        there to its last of output_tokens."""

    def forget(self, backend: str) -> None:
        """Forget what was learned of a backend: it left, or lost its cache (ejected, down, drained)."""

    def hold(self, route: Route | None, candidates: Sequence[Backend],
             backends: Sequence[Backend]) -> Hold | None:
        """A backend worth waiting for, and how long at most (seconds), rather than one of candidates
        (the backends with a free slot; none when the request queues anyway) now; None: pick now. The
        balancer queues the request for that backend's next slot (not before defer_s) and, the time up,
        hands it any free slot."""
        return None

    def keep_feed(self) -> None:
        """Keep the latest routing decisions from now on, for a peer entry to read (shares_routing)."""

    def decisions_since(self, seq: int, limit: int) -> list[tuple[int, str, list[int]]]:
        """The decisions after seq, oldest first, at most the newest limit of them (shares_routing)."""
        return []

    def adopt(self, backend: str, blocks: list[int]) -> None:
        """A peer entry's proxy sent a prompt of these blocks to backend: remember it (shares_routing)."""

    def waiter(self, queue: Collection[Waiter], backends: Sequence[Backend]) -> Waiter | None:
        """The waiter a freed slot goes to instead of the queue's first (None: the first); queue iterates
        the waiters in the order the pool's fair queue would serve them (proxy/admission.py); the balancer
        takes the choice only when it is of the first's tenant, so a look-ahead never costs another tenant
        its turn; backends are the pool's."""
        return None
