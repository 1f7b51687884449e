"""The routing seam: the settings every policy reads, and the interface the balancer calls."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Collection, Protocol, Sequence

if TYPE_CHECKING:
    from ..balancer import Backend, Waiter


def _bounded(default, lo, hi):
    """A routing key's default and the bounds a config value must keep (fleet/schema.py has the same)."""
    return field(default=default, metadata={"bounds": (lo, hi)})


@dataclass(frozen=True)
class RoutingConfig:
    """The routing section of the proxy's config: the policy (a name in proxy.routing.POLICIES) and its
    keys, each with its default and its bounds (docs/proxy.md says what they do)."""

    policy: str = "prefix"        # measured better or equal on every workload (docs/PERFORMANCE.md)
    min_match_tokens: int = _bounded(256, 0, 10_000_000)  # prefill a prefix must save over the least
                                                          # loaded backend to win
    min_match_ratio: float = _bounded(0.5, 0, 1)  # and the share of the prompt it must cover (a new
                                                  # conversation that shares only a system prompt goes by load)
    balance_abs: int = _bounded(1, 0, 65536)      # the prefix's backend is passed over when it has more than
    balance_rel: float = _bounded(1.5, 1, 1000)   # this many requests more than the least loaded, and more
                                                  # than this many times as many
    max_blocks: int = _bounded(262144, 1, 100_000_000)  # prompt blocks remembered (64 bytes each), least
                                                        # recently used dropped first
    lookahead: int = _bounded(16, 0, 1024)  # queued requests a freed slot may look past for one whose prefix
                                            # is there
    # balance_abs 1 and lookahead 16 measured (bench/bench_routing.py, docs/PERFORMANCE.md): with 2, one
    # hot system prompt left a backend idle; with 4, a saturated fleet scattered conversations.


class Route(Protocol):
    """What a policy made of one request, as the results log and the metrics report it."""

    decision: str          # the results log's `route`, the metrics' decision label
    matched_tokens: int    # prompt tokens the chosen backend likely holds already
    prompt_tokens: int     # the prompt's tokens, as the policy reckons them


class Policy:
    """One pool's routing policy: what it needs of a request, how it picks, what it learns and forgets.

    The balancer owns the slots, the queue and the membership and calls these; between a pick and its
    count there is no await. Every policy picks; the other defaults read nothing and learn nothing.
    """

    needs_body = False   # True: the body is read before the pick; False keeps the count before the body

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

    def forget(self, backend: str) -> None:
        """Forget what was learned of a backend: it left, or lost its cache (ejected, down, drained)."""

    def waiter(self, queue: Collection[Waiter], backends: Sequence[Backend]) -> Waiter | None:
        """The waiter a freed slot goes to instead of the queue's head (None: first come, first served);
        backends are the pool's."""
        return None
