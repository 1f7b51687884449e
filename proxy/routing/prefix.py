"""The prefix policy: a request goes where its prompt's prefix was sent before, unless that is too loaded.

vLLM caches a prompt's KV blocks (16 tokens each) per instance, keyed by a hash chained over the blocks
before them, and reuses them for any later prompt that starts the same way. The proxy cannot see the
engines' caches, but it sees every prompt it sends: it cuts each prompt's canonical text into blocks of
BLOCK_BYTES (about 16 tokens at 4 bytes a token), chains their hashes the same way, and remembers which
backend it sent each block to. A later prompt's longest run of known blocks on a backend is what that
backend most likely still holds.

Bounded: at most max_blocks block hashes, or as many as the backends' engines publish they keep in all
(their KV caches) where that is more, up to GROWTH times max_blocks, the least recently used dropped first; a backend's blocks are
dropped when the proxy takes it out (ejected, unhealthy, drained for a restart) or a reload removes it.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Collection, Sequence

from ..body import Limits, Parsed, Refused, parse
from .base import Backend, Hold, Policy, RoutingConfig, Waiter
from .homes import Homes
from .ttft import Predictor, Sent

BLOCK_BYTES = 64      # vLLM's 16-token block at about 4 bytes of text a token
TOKEN_BYTES = 4       # what the match length in tokens is reckoned with
BLOCK_TOKENS = BLOCK_BYTES // TOKEN_BYTES
# The routing decisions a peer entry may read (proxy/share.py): the newest, at most this many.
FEED_DECISIONS = 2048
# Equal on two proxies exactly when their block hashes are: the same Python and the same PYTHONHASHSEED
# (a process's bytes hash is salted; the entries of a group start their proxies with one seed).
HASH_PROBE = hash((0, b"vllm-fleet prefix block"))
_feed_seq = itertools.count(1)   # one order over every pool's decisions in this process
# An engine's cached tokens under the match by up to this many blocks is no miss: its tokenizer cuts the
# text otherwise, and it recomputes a prompt's last token.
MISS_SLACK_BLOCKS = 2
# A holder of a shared prefix takes routing.spread_after branches off it per this many tokens of it (at
# least spread_after): spreading a branch costs a cold prefill of the shared part elsewhere, so a longer
# one must have more branches behind it first (a group's 3,000-token context with its 6 questions stays
# on one backend; 8 conversations on a 560-token system prompt spread over 3).
SPREAD_TOKENS = 1000
# A conversation whose blocks its home's engine evicted (its working set overflows the cache) starts there
# this share of its own prefill late, so that the requests arriving with it that still find their blocks
# there start first (an LRU cache served in the order its conversations last came keeps none of them).
COLD_DEFER = 0.3
# Predicted times to first token this close to the soonest's tie, and load decides among them: within the
# prefill of TIE_TOKENS at the backends' measured rate (about one engine step's token budget, vLLM's
# max_num_batched_tokens default: a wait shorter than a step is noise) or TIE_SHARE of the soonest's time.
# Counted in tokens, not seconds, the tie scales with the engines' speed: tight where prefill is fast (0.12 s
# on the trace replay's sims), loose where one queued prompt is half a second of wait (bench_routing's), so
# equal engines are not told apart by the noise of their fits (a backend fitted faster must not draw every
# request; an absolute 0.1 s piled 4 times as many hot-spot requests on one backend as on another).
TIE_TOKENS = 2048
TIE_SHARE = 0.1
# A request waits for its full holder at most this many times the predicted wait for a slot there: a slot
# that takes longer than predicted says the prediction was wrong, and a hold that runs out costs its wait
# and the cold prefill elsewhere both (with 2, bench_routing's groups lost 0.15 s of TTFT p99 to it).
SLOT_WAITS = 1
# The weight of a new answer's length in the moving average of answers' tokens (Prefix.learned).
ANSWER_AVERAGE = 0.1


def prompt_blocks(body: bytes | Parsed, limits: Limits = Limits()) -> list[int]:
    """The chained block hashes of a chat/completions body's prompt ([] when it has none); Refused (a
    named 400) past limits' messages, content parts or prompt blocks.

    The canonical text is what the chat template would see, in order: each message's role and content
    (text as is; an image or other part by a digest of its content, so a base64 image costs one short
    token of its own). Only whole blocks count, as in vLLM's cache. body: the bytes, or their one parse
    (proxy/body.py) that the request path shares.
    """
    parsed = body if isinstance(body, Parsed) else parse(body, limits)
    limits, request = parsed.limits, parsed.request
    if request is None:
        return []
    text = _Text(parsed, limits.max_prompt_blocks * BLOCK_BYTES, limits)
    messages = request.get("messages")
    if isinstance(messages, list):
        if len(messages) > limits.max_messages:
            raise Refused(f"the request has {len(messages)} messages; at most {limits.max_messages} are "
                          "accepted (proxy.limits.max_messages)")
        for m in messages:
            if isinstance(m, dict):
                role = m.get("role")
                text.add("<|"), text.add(role if isinstance(role, str) else str(role)), text.add("|>")
                _content(m.get("content"), text)
    else:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            text.add(",".join(map(str, prompt)))      # token ids: their digits, not a part each
        else:
            _content(prompt, text)
    data = "".join(text.parts).encode("utf-8", "surrogatepass")
    if len(data) // BLOCK_BYTES > limits.max_prompt_blocks:
        text.too_long()
    blocks, h = [], 0
    for at in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES):
        h = hash((h, data[at:at + BLOCK_BYTES]))
        blocks.append(h)
    return blocks


class _Text:
    """A prompt's canonical text as it is put together, refused as soon as it is surely past its bound
    (before a long string is decoded: an escape is at most 6 bytes a character)."""

    def __init__(self, parsed: Parsed, most: int, limits: Limits):
        self.parsed, self.most, self.limits, self.size, self.parts = parsed, most, limits, 0, []

    def add(self, value: str) -> None:
        if self.size + self.parsed.raw_len(value) // 6 > self.most:
            self.too_long()
        value = self.parsed.text(value)
        self.size += len(value)
        if self.size > self.most:
            self.too_long()
        self.parts.append(value)

    def too_long(self) -> None:
        raise Refused(f"the prompt is over {self.limits.max_prompt_blocks} blocks of {BLOCK_BYTES} bytes; at most "
                      "that many are accepted (proxy.limits.max_prompt_blocks)")


def _content(content, text: _Text) -> None:
    """A message's content as canonical text: text parts as they are, anything else by its digest."""
    if isinstance(content, str):
        text.add(content)
        return
    if content is None:
        return
    if not isinstance(content, list):
        text.add("<|part:" + text.parsed.digest(content) + "|>")
        return
    if len(content) > text.limits.max_content_parts:
        raise Refused(f"a message has {len(content)} content parts; at most {text.limits.max_content_parts} "
                      "are accepted (proxy.limits.max_content_parts)")
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            text.add(part["text"])
        else:   # an image (base64 or URL) or another part: one digest of what it is
            text.add("<|part:" + text.parsed.digest(part) + "|>")


@dataclass
class PrefixRoute:
    """One request's routing: its prompt's blocks in, what was decided out (for the log and metrics)."""

    blocks: list[int] = field(default_factory=list)
    decision: str = "load"     # prefix: sent where its prefix is; load: least loaded; override: prefix
    matched_tokens: int = 0    # was there, but that backend was too loaded; shared: only a prefix other
                               # conversations share matched, so the least loaded took it
    ticks: list[int] = field(default_factory=list)   # when the matched blocks were sent there before
    seen: int = -1                                   # the index's changes when `matches` was computed
    matches: dict[str, int] = field(default_factory=dict)
    home: tuple[str, int] | None = None              # (backend, blocks): its conversation's home (Homes.find)
    home_seen: bool = False
    sent: Sent | None = None                         # what the prediction knew when it was sent (ttft.Sent)
    placing: str | None = None                       # the backend a new conversation is held for (_hold_room)
    overruled: str | None = None     # what the prediction overruled to keep it on its holder (the results
                                     # log's `overruled`): "balance" (the balance rule passed it over:
                                     # _elsewhere), "slot" (it waited for the full holder: _hold_holder;
                                     # "slot expired": then its hold was up and it went elsewhere)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's whole blocks in tokens."""
        return len(self.blocks) * BLOCK_TOKENS


GROWTH = 4   # the index grows to what the engines publish they hold, up to this many times max_blocks


class PrefixIndex:
    """Block hash -> the backends it was sent to, least recently used first, at most bound(); and for
    each block, how many distinct blocks followed it on each backend (its fan-out: where prompts that
    share everything up to it went their own ways)."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self._lru: OrderedDict[int, set[str]] = OrderedDict()
        # backend -> its blocks, least recently sent first, each with the tick it was last sent at (what a
        # miss reported by the engine is dated by); at most the backend's capacity when it published one
        self._of: dict[str, OrderedDict[int, int]] = {}
        self._cap: dict[str, int] = {}
        self._tick = 0
        self._unnamed = itertools.count(-(1 << 80), -1)   # keys of the blocks held without a name (insert)
        self.changes = 0     # counts every change, so a match computed since none may be reused
        self._parent: dict[int, int] = {}    # block -> the block before it (a prompt's first has none)
        self._fan: dict[int, dict[str, int]] = {}   # block -> backend -> blocks after it sent there

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, blocks: list[int]) -> dict[str, int]:
        """How many leading blocks of the prompt each backend was sent (backends with none left out).

        One pass over the blocks: the set of backends holding block i shrinks as i grows (a chained
        hash is only ever sent after the ones before it), so a backend's run ends where the set next
        gets smaller without it; the work is the prompt's length plus the backends, not their product.
        """
        matched: dict[str, int] = {}
        holders: set[str] = set()
        for i, h in enumerate(blocks):
            now = self._lru.get(h)
            if not now:
                break
            if len(now) != len(holders):
                for name in holders - now:
                    matched[name] = i
            holders = now
        else:
            i = len(blocks)
        for name in holders:
            matched.setdefault(name, i)
        return matched

    def fan(self, block: int) -> dict[str, int]:
        """Per backend, how many distinct blocks were sent there right after block."""
        return self._fan.get(block, {})

    def branches(self, blocks: list[int], run: int) -> bool:
        """Whether the prompt's first run blocks are a shared prefix that it leaves: the index knows
        another block after them (another conversation went on from there) and not the prompt's own."""
        if not 0 < run < len(blocks):
            return False
        after = self._fan.get(blocks[run - 1])
        if not after:
            return False
        ours = self._lru.get(blocks[run], ())
        return any(n > (name in ours) for name, n in after.items())

    def bound(self) -> int:
        """The most block hashes kept: max_blocks, or the blocks the backends' engines keep in all (their
        published capacities) where that is more, up to GROWTH times max_blocks (the index's memory stays
        the operator's to bound: some 780 bytes a block). Each backend's own blocks are trimmed to its
        capacity, so the index then holds no more than the engines do; a bound below theirs would forget
        the oldest blocks an engine still holds (8 engines of 640,000 tokens keep 320,000 blocks: a
        replayed trace's later rounds found their history's holder forgotten and went cold elsewhere)."""
        return max(self.max_blocks, min(sum(self._cap.values()), GROWTH * self.max_blocks))

    def capacity(self, backend: str) -> int | None:
        """The most blocks kept for backend (None: only max_blocks bounds it)."""
        return self._cap.get(backend)

    def set_capacity(self, backend: str, blocks: int | None) -> None:
        """The most blocks backend's engine keeps (None: unknown, only max_blocks bounds it); the least
        recently sent beyond it are forgotten, as the engine's LRU evicts them."""
        self.changes += 1
        if blocks:
            self._cap[backend] = blocks
            self._trim(backend)
        else:
            self._cap.pop(backend, None)

    def insert(self, blocks: list[int], backend: str, known: int = 0, unnamed: int = 0) -> list[int]:
        """Remember that the prompt's blocks went to backend (they become the most recently used). Last
        block first, so the first is the most recent of all: eviction takes a prompt's tail before its
        head, as vLLM's does (a chain without its head matches nothing). Before them, `unnamed` blocks
        the index cannot name take their room in backend's share: the answer's, which its engine caches
        too and frees before the prompt's tail. Returns when each of the first `known` blocks had been
        sent there before (0: never), what a later miss is dated by."""
        self.changes += 1
        lru, parent, fans = self._lru, self._parent, self._fan
        mine = self._of.get(backend)
        if mine is None:
            mine = self._of[backend] = OrderedDict()
        before = [0] * known
        tick, bound, cap = self._tick, self.bound(), self._cap.get(backend)
        for _ in range(unnamed if cap else 0):     # (without a capacity nothing would trim them)
            tick += 1
            mine[next(self._unnamed)] = tick     # never a block's hash: matches nothing, only takes room
        for i in range(len(blocks) - 1, -1, -1):
            h = blocks[i]
            holders = lru.get(h)
            if holders is None:
                # Room first (the index never holds more than its bound): from backend's own oldest while
                # it is full (its trim would take them anyway: its engine evicts those), else the index's
                # oldest, which may be another backend's that its engine still holds.
                while len(lru) >= bound and cap and len(mine) >= cap:
                    self._leave(mine.popitem(last=False)[0], backend)
                if len(lru) >= bound:
                    self._evict_oldest()
                lru[h] = holders = set()
                if i:
                    parent[h] = blocks[i - 1]
            else:
                lru.move_to_end(h)
            tick += 1
            if backend in holders:
                old = mine.pop(h, 0)
                if i < known:
                    before[i] = old
            else:
                holders.add(backend)
                if i:
                    fan = fans.get(blocks[i - 1])
                    if fan is None:
                        fan = fans[blocks[i - 1]] = {}
                    fan[backend] = fan.get(backend, 0) + 1
            mine[h] = tick
        self._tick = tick
        self._trim(backend)
        return before

    def _evict_oldest(self) -> None:
        """Forget the least recently used block on every backend."""
        h, holders = self._lru.popitem(last=False)
        for name in holders:
            self._of[name].pop(h, None)
            self._unfan(h, name)
        self._parent.pop(h, None)
        self._fan.pop(h, None)

    def _trim(self, backend: str) -> None:
        """Forget backend's least recently sent blocks beyond its capacity."""
        mine, cap = self._of.get(backend), self._cap.get(backend)
        while cap and mine and len(mine) > cap:
            self._leave(mine.popitem(last=False)[0], backend)

    def evict_through(self, backend: str, tick: int) -> int:
        """Forget backend's blocks last sent at or before tick: the engine evicted a block of that age, so
        its LRU has evicted every older one too. Returns how many were forgotten."""
        self.changes += 1
        mine = self._of.get(backend)
        n = 0
        while mine:
            h, t = next(iter(mine.items()))
            if t > tick:
                break
            del mine[h]
            self._leave(h, backend)
            n += 1
        return n

    def _leave(self, h: int, backend: str) -> None:
        """Block h is no longer on backend (its own list already lost it)."""
        holders = self._lru.get(h)
        if holders is None or backend not in holders:
            return
        holders.discard(backend)
        self._unfan(h, backend)
        if not holders:
            del self._lru[h]
            self._parent.pop(h, None)
            self._fan.pop(h, None)

    def _unfan(self, h: int, backend: str) -> None:
        """Block h left backend: its parent has one follower fewer there."""
        fan = self._fan.get(self._parent.get(h))
        if fan and backend in fan:
            fan[backend] -= 1
            if not fan[backend]:
                del fan[backend]

    def forget(self, blocks: list[int], backend: str) -> int:
        """Forget that backend holds blocks (the engine evicted them); returns how many it held."""
        self.changes += 1
        mine = self._of.get(backend, {})
        n = 0
        for h in blocks:
            if mine.pop(h, None) is not None:
                self._leave(h, backend)
                n += 1
        return n

    def drop(self, backend: str) -> int:
        """Forget everything sent to backend (it is cold now); returns how many blocks it held."""
        self.changes += 1
        self._cap.pop(backend, None)      # published again with its next request (Prefix.sent)
        hashes = self._of.pop(backend, {})
        for h in hashes:
            holders = self._lru.get(h)
            if holders is not None:
                holders.discard(backend)
                fan = self._fan.get(h)
                if fan:
                    fan.pop(backend, None)
                if not holders:
                    del self._lru[h]
                    self._parent.pop(h, None)
                    self._fan.pop(h, None)
        return len(hashes)


class Prefix(Policy):
    """Where the prompt's longest known prefix was sent (see pick), and in the queue a bounded look-ahead
    for a waiter whose prefix is on the backend that freed a slot."""

    needs_body = True
    shares_routing = True

    def __init__(self, config: RoutingConfig):
        super().__init__(config)
        self.index = PrefixIndex(config.max_blocks)
        self.homes = Homes(config.max_blocks)
        self.predict = Predictor(config.prefill_ms)
        # id(route) -> (backend, prompt tokens, until when) of the new conversations held for a backend
        self._placing: dict[int, tuple[str, int, float]] = {}
        self._answer_tokens = 0.0            # an answer's tokens, a moving average (the engines cache them)
        self.clock = time.monotonic
        # (seq, backend, blocks) of the latest decisions, for a peer entry's proxy to learn from; kept only
        # once keep_feed() was called (a proxy with peers: proxy/share.py), so no other proxy pays for it
        self.feed: deque[tuple[int, str, list[int]]] | None = None

    def keep_feed(self) -> None:
        """Keep the latest decisions from now on (idempotent)."""
        if self.feed is None:
            self.feed = deque(maxlen=FEED_DECISIONS)

    def decisions_since(self, seq: int, limit: int) -> list[tuple[int, str, list[int]]]:
        """The decisions after seq, oldest first, at most the newest `limit` of them."""
        out: list[tuple[int, str, list[int]]] = []
        for d in reversed(self.feed or ()):
            if d[0] <= seq or len(out) >= limit:
                break
            out.append(d)
        return out[::-1]

    def adopt(self, backend: str, blocks: list[int]) -> None:
        """A peer entry's proxy sent these blocks to backend (the engines are shared): remember them as if
        this proxy had, so that the conversation finds its home here after the address moves. Not fed on
        (peers learn only each other's own decisions)."""
        if blocks:
            self.index.insert(blocks, backend)

    def _match(self, route: PrefixRoute) -> dict[str, int]:
        """index.match of the route's blocks, computed once while the index does not change (hold and
        then pick see the same index: no await between them)."""
        if route.seen != self.index.changes:
            route.matches, route.seen = self.index.match(route.blocks), self.index.changes
        return route.matches

    def route_of(self, body: bytes | Parsed) -> PrefixRoute:
        """The prompt's blocks (body: the request path's one parse, with its limits)."""
        return PrefixRoute(prompt_blocks(body))

    def pick(self, route: PrefixRoute | None, least: Backend, candidates: Sequence[Backend]) -> Backend:
        """The backend holding the longest run of the prompt's leading blocks (ties: the less loaded,
        then round robin), when that run covers routing.min_match_ratio of the prompt (a new
        conversation that shares only a system prompt goes by load) and saves at least min_match_tokens
        of prefill over the least loaded backend (a shared prefix that every backend holds pins
        nothing) or runs past a shared prefix into the conversation's own rounds (_own); a match that
        ends where prompts sharing it branch off goes by _spread; unless that backend has more than
        balance_abs requests more than the least loaded one and more than balance_rel times as many:
        then another (_elsewhere). Where the index holds too little of a conversation (its engine
        evicted it: the working set overflows the caches), it goes back to its home (_home_at); a new
        one goes where it fits (_roomiest). The balance rule gives way where the predicted time to first
        token disagrees (_elsewhere)."""
        if route is None or not route.blocks:
            return least
        if route.overruled == "balance":
            route.overruled = None       # a retry's pick decides afresh
        matched = self._match(route)
        top: Backend | None = None
        top_run = 0
        for b in candidates:
            run = matched.get(b.name, 0)
            if run and (run > top_run or (run == top_run and b.in_flight < top.in_flight)):
                top, top_run = b, run
        if top is not None and self.index.branches(route.blocks, top_run):
            return self._home_at(route, matched, top_run, least, candidates) or self._spread(
                route, matched, top_run, candidates)
        least_tokens = matched.get(least.name, 0) * BLOCK_TOKENS
        r = self.config
        if (top is None or top is least or top_run < r.min_match_ratio * len(route.blocks)
                or (top_run * BLOCK_TOKENS - least_tokens < r.min_match_tokens
                    and not self._own(route, matched, top, top_run))):
            home = self._home_at(route, matched, top_run, least, candidates)
            if home is not None:
                return home
            if least_tokens >= r.min_match_tokens:
                route.decision, route.matched_tokens = "prefix", least_tokens
                return least
            best = self._roomiest(route, least, candidates)
            route.decision, route.matched_tokens = "load", matched.get(best.name, 0) * BLOCK_TOKENS
            return best
        other = self._elsewhere(route, matched, top, least, candidates)
        if other is not None:
            route.decision, route.matched_tokens = "override", matched.get(other.name, 0) * BLOCK_TOKENS
            return other
        route.decision, route.matched_tokens = "prefix", top_run * BLOCK_TOKENS
        return top

    def _too_loaded(self, b: Backend, least: Backend) -> bool:
        """The balance rule: b has more than balance_abs requests more than the least loaded backend and
        more than balance_rel times as many."""
        r = self.config
        return b.in_flight - least.in_flight > r.balance_abs and b.in_flight > r.balance_rel * least.in_flight

    def ttft_s(self, route: PrefixRoute, b: Backend, matched: dict[str, int] | None,
               free: bool | None = None) -> float:
        """The request's predicted time to first token on b (proxy/routing/ttft.py has the formula): the
        prompt less what b holds of it (matched None: all of it), behind b's backlog and what runs there
        (free: whether it starts at once, without a slot's wait; None: as b is now)."""
        uncached = route.prompt_tokens - (matched.get(b.name, 0) * BLOCK_TOKENS if matched else 0)
        return self.predict.ttft_s(b.name, max(1, uncached), b.in_flight, b.free if free is None else free,
                                   self.clock())

    def cost_s(self, route: PrefixRoute, b: Backend, matched: dict[str, int], free: bool | None = None) -> float:
        """What sending the request to b costs in time: its predicted time to first token there (ttft_s)
        and the prefill it adds there before whatever is sent next (vLLM prefills in the order requests
        started: the requests after it wait behind its uncached part). A history prefilled cold on
        another backend delays what comes after it there, besides itself."""
        uncached = route.prompt_tokens - matched.get(b.name, 0) * BLOCK_TOKENS
        return self.ttft_s(route, b, matched, free) + max(1, uncached) * self.predict.rates(b.name)[0]

    def _elsewhere(self, route: PrefixRoute, matched: dict[str, int], keep: Backend, least: Backend,
                   candidates: Sequence[Backend]) -> Backend | None:
        """Where a request goes instead of keep (its match's holder, or its home) when the balance rule
        passes keep over: of the other backends the rule allows, the one predicted to start it soonest.
        None, keep it, when the rule holds, or when the prediction disagrees: keep is predicted no later,
        every backend's slots are bounded (the engine runs what the proxy sends, no more) and the prompt
        goes on past what keep holds (a conversation's next round, not the same prompt again: repeats of
        one prompt spread by the rule, so that every backend works while the others would idle)."""
        if not self._too_loaded(keep, least):
            return None
        others = [b for b in candidates if b is not keep and (b is least or not self._too_loaded(b, least))]
        fast = min(others, key=lambda b: (self.cost_s(route, b, matched), b.in_flight))
        if (getattr(keep, "slots", 0) and all(getattr(b, "slots", 0) for b in candidates)
                and matched.get(keep.name, 0) < len(route.blocks)
                and self.cost_s(route, keep, matched) <= self.cost_s(route, fast, matched)):
            route.overruled = "balance"
            return None
        return fast

    def _home(self, route: PrefixRoute) -> tuple[str, int] | None:
        """Its conversation's home and the earlier prompt's length in blocks (Homes.find), once a route."""
        if not route.home_seen:
            route.home_seen = True
            route.home = self.homes.find(route.blocks)
        return route.home

    def _home_at(self, route: PrefixRoute, matched: dict[str, int], run: int, least: Backend,
                 candidates: Sequence[Backend]) -> Backend | None:
        """The conversation's home, when the prompt continues an earlier one sent there that is longer
        than the index's match (run blocks: the index forgot the rest, as the engine's LRU evicted it, or
        the match ends at a prefix others share), at least min_match_tokens long, and home is one of
        candidates and not too loaded (the balance rule). Going back keeps each conversation's history in
        one cache, where what fits stays, rather than copying it by load into another and evicting
        what lives there. None: no such home."""
        home = self._home(route)
        if home is None or home[1] <= run or home[1] * BLOCK_TOKENS < self.config.min_match_tokens:
            return None
        b = next((c for c in candidates if c.name == home[0]), None)
        if b is None or self._elsewhere(route, matched, b, least, candidates) is not None:
            return None
        route.decision, route.matched_tokens = "home", matched.get(b.name, 0) * BLOCK_TOKENS
        return b

    def _share(self, b: Backend, more: int = 0) -> float:
        """b's working set (Homes), the new conversations held for it (_hold_room) and `more` tokens, as
        a share of its KV cache (0: its size unknown)."""
        cap = getattr(b, "kv_tokens", None)
        if not cap:
            return 0.0
        placing = sum(n for name, n, _ in self._placing.values() if name == b.name) if self._placing else 0
        return (self.homes.working.get(b.name, 0) * BLOCK_TOKENS + placing + more) / cap

    def _roomiest(self, route: PrefixRoute, least: Backend, candidates: Sequence[Backend]) -> Backend:
        """A new conversation's backend: of the backends the balance rule lets take it, one where the
        conversations living there (Homes' working set) and it fit the KV cache, if any does
        (capacity-aware placement: each engine's share fits its cache, as far as the fleet's caches hold
        them all); of those the least loaded, and of equally loaded ones one not _busy, then round robin.
        Load first: the prediction never puts a request beside another while a backend with fewer runs
        nothing new."""
        def key(b: Backend):
            return self._share(b, route.prompt_tokens) > 1, b.in_flight, self._busy(route, b)
        return min((b for b in candidates if b is least or not self._too_loaded(b, least)), key=key)

    def _own(self, route: PrefixRoute, matched: dict[str, int], top: Backend, top_run: int) -> bool:
        """Whether top holds the prompt past a prefix that others share and leave: the conversation's own
        earlier rounds are there, however short, so it is home (min_match_tokens guards against pinning
        on shared prefixes, not this)."""
        second = max((n for name, n in matched.items() if name != top.name), default=0)
        return 0 < second < top_run and self.index.branches(route.blocks, second)

    def _spread(self, route: PrefixRoute, matched: dict[str, int], run: int,
                candidates: Sequence[Backend]) -> Backend:
        """The prompt's longest match is a prefix other prompts share and leave (a system prompt, a tool
        list, a group's context): no conversation's home. A backend holding it takes the request while
        fewer than routing.spread_after prompts per SPREAD_TOKENS of the shared part (at least
        spread_after) branched off it there and it is not too loaded (the
        balance rule against the least loaded, unless it holds more of the prompt than any other backend
        and the prediction keeps it there: _beyond, _elsewhere); past that, any backend, holder or not;
        of either, only the backends predicted to start it soonest (_soonest), and of those the one
        _quickest picks (then the one where the fewest branched off, then round robin). New
        conversations spread even one at a time, each backend pays the shared part a few times at most,
        and their own later rounds go home."""
        fan = self.index.fan(route.blocks[run - 1])
        r = self.config
        after = r.spread_after * max(1.0, run * BLOCK_TOKENS / SPREAD_TOKENS)
        least = min(candidates, key=lambda b: b.in_flight)
        soon = self._soonest(route, candidates)
        roomy = [b for b in candidates if matched.get(b.name, 0) >= run and fan.get(b.name, 0) < after
                 and (b in soon or self._beyond(matched, b, run))]
        best = self._quickest(route, roomy, fan) if roomy else None
        if best is not None and self._too_loaded(best, least) and (
                not self._beyond(matched, best, run)
                or self._elsewhere(route, matched, best, least, candidates) is not None):
            best = None     # the balance rule passes the holder over, and no prediction keeps it there
        if best is None:     # the least loaded of those predicted to start it soonest (the holder may be one)
            best = self._quickest(route, soon, fan)
        route.matched_tokens = matched.get(best.name, 0) * BLOCK_TOKENS
        route.decision = "shared"
        return best

    def _soonest(self, route: PrefixRoute, candidates: Sequence[Backend]) -> list[Backend]:
        """The candidates where the request would wait least before its own prefill: its predicted time
        to first token there (ttft_s) as if none of its prompt were cached anywhere, within the prefill
        of TIE_TOKENS at their mean measured rate, or TIE_SHARE of the soonest's, of the soonest's. The others have a long prefill queued ahead (vLLM
        prefills in the order requests started) or more running. A shared prefix's holders are not
        preferred for holding it (that would pin a hot system prompt to one backend); a conversation's
        holder is (_beyond). Where some backend's slots are unbounded, all of them."""
        if not all(getattr(b, "slots", 0) for b in candidates):
            return list(candidates)
        t = [self.ttft_s(route, b, None) for b in candidates]
        first = min(t)
        prefill_s = sum(self.predict.rates(b.name)[0] for b in candidates) / len(candidates)
        late = first + max(TIE_TOKENS * prefill_s, TIE_SHARE * first)
        return [b for b, s in zip(candidates, t) if s <= late]

    def _beyond(self, matched: dict[str, int], holder: Backend, run: int) -> bool:
        """Whether holder holds run blocks of the prompt and every other backend less: the prompt goes on
        past where the others branched off (a conversation's next round whose history lives there), so
        the prediction, not the balance rule alone, decides whether it leaves (_elsewhere)."""
        return matched.get(holder.name, 0) >= run and all(
            n < run for name, n in matched.items() if name != holder.name)

    def _quickest(self, route: PrefixRoute, pool: Sequence[Backend], fan: dict[str, int]) -> Backend:
        """Of pool, the least loaded; of equally loaded ones, one not _busy (a backend busy with a long
        prefill is passed over for one only decoding), then the one where the fewest branched off the
        shared prefix (fan), then round robin."""
        return min(pool, key=lambda b: (b.in_flight, self._busy(route, b), fan.get(b.name, 0)))

    def _busy(self, route: PrefixRoute, b: Backend) -> bool:
        """Whether more prefill is queued on b (the prediction's backlog, in seconds at b's measured rate)
        than the prompt's own would take there: a new prompt there would wait longer behind others' than
        for itself. Short backlogs tie (equal engines are not told apart by the noise of their fits)."""
        prefill_s = self.predict.rates(b.name)[0]
        return self.predict.queued_s(b.name, self.clock()) > route.prompt_tokens * prefill_s

    def sent(self, route: PrefixRoute | None, backend: Backend) -> None:
        """Remember the prompt's blocks on backend, within what its engine keeps (its KV cache's size in
        tokens, when it publishes it: vllm:cache_config_info)."""
        if route is not None and route.blocks:
            if route.overruled == "slot":
                matched = self._match(route)
                if matched.get(backend.name, 0) < max(matched.values(), default=0):
                    route.overruled = "slot expired"     # it waited for its holder, then took another's slot
            cap = getattr(backend, "kv_tokens", None)
            cap = cap and max(1, cap // BLOCK_TOKENS)
            if cap != self.index.capacity(backend.name):
                self.index.set_capacity(backend.name, cap)
            route.ticks = self.index.insert(route.blocks, backend.name, route.matched_tokens // BLOCK_TOKENS,
                                            int(self._answer_tokens) // BLOCK_TOKENS)
            home = self._home(route)
            self.homes.sent(route.blocks, backend.name, home[1] if home else 0)
            if route.placing is not None:
                self._placing.pop(id(route), None)
                route.placing = None
            route.sent = self.predict.sent(backend.name, max(1, route.prompt_tokens - route.matched_tokens),
                                           backend.in_flight, self.clock())
            if self.feed is not None:
                self.feed.append((next(_feed_seq), backend.name, route.blocks))

    def learned(self, route: PrefixRoute | None, backend: Backend, cached_tokens: int | None,
                prompt_tokens: int | None, output_tokens: int = 0) -> None:
        """The engine said how many of the prompt's tokens it had cached. When that falls short of the
        match by more than MISS_SLACK_BLOCKS (tokenizers differ; the engine recomputes the last token),
        the first block it lacked had been evicted, and with it every block sent to that backend before
        that one was: the index forgets them (the prompt itself, sent again, stays). The answer's length
        goes into the average that sizes the room answers take in the index (insert's unnamed blocks)."""
        if output_tokens > 0:
            a = self._answer_tokens
            self._answer_tokens = output_tokens if not a else a + (output_tokens - a) * ANSWER_AVERAGE
        if route is None or not route.ticks or cached_tokens is None or not prompt_tokens:
            return
        keep = len(route.blocks) * min(cached_tokens, prompt_tokens) // prompt_tokens
        if keep + MISS_SLACK_BLOCKS < len(route.ticks):
            self.index.evict_through(backend.name, route.ticks[keep])

    def ended(self, backend: Backend) -> None:
        self.predict.ended(backend.name, backend.in_flight)

    def timed(self, route: PrefixRoute | None, backend: Backend, first_token_s: float, decode_s: float,
              output_tokens: int) -> None:
        """A streamed answer's timing: what the prediction measures the backend's speeds by (ttft.py)."""
        if route is not None and route.sent is not None:
            self.predict.answered(backend.name, route.sent, first_token_s, decode_s, output_tokens)

    def forget(self, backend: str) -> None:
        self.index.drop(backend)
        self.homes.drop(backend)
        self.predict.forget(backend)

    def hold(self, route: PrefixRoute | None, candidates: Sequence[Backend],
             backends: Sequence[Backend]) -> Hold | None:
        """Wait a little for home: when the backend with the prompt's longest match (its conversation's
        home, a match that would win a pick) has no free slot, while another has, the request waits for
        a slot there at most routing.home_wait_s, and at most the prefill the match saves over the best
        free backend's at the measured rate (ttft.py): waiting longer than going cold would cost is
        never worth it. A next round whose match ends at a branch waits for its holder while predicted
        sooner there (_hold_holder, also when it queues anyway); one the index forgot waits for its home
        (_hold_home). Any other request that queues anyway (no slot free: candidates empty) waits for
        home only where the caches overflow (_overflow): otherwise the first slot freed anywhere is its.
        Home with a slot free: _defer."""
        r = self.config
        if not r.home_wait_s or route is None or not route.blocks:
            return None
        matched = self._match(route)
        home, run = None, 0
        for b in backends:
            n = matched.get(b.name, 0)
            if n > run and b.available:
                home, run = b, n
        if home is None or run < r.min_match_ratio * len(route.blocks) or self.index.branches(route.blocks, run):
            return (self._hold_holder(route, matched, home, run, candidates, backends)
                    or self._hold_home(route, matched, candidates, backends) or self._hold_room(route, candidates, backends))
        if home.free:
            return self._defer(route, home, run)
        saved = (run - max((matched.get(b.name, 0) for b in candidates), default=0)) * BLOCK_TOKENS
        if saved < max(r.min_match_tokens, 1) or (not candidates and not self._overflow(route, home, backends)):
            return None
        return Hold(home, min(r.home_wait_s, saved * self.predict.rates(home.name)[0]))

    def _hold_holder(self, route: PrefixRoute, matched: dict[str, int], holder: Backend | None, run: int,
                     candidates: Sequence[Backend], backends: Sequence[Backend]) -> Hold | None:
        """A conversation's next round whose match ends where its own last prompt went on (a branch: the
        pick's _spread), on a holder that holds more of it than every other backend (_beyond) and has no
        slot free: it waits for the holder when its predicted time to first token there, a slot's wait
        and the cached prefix counted, is sooner than on every free backend, where it would prefill its
        history again (cost_s: its time to first token and the prefill it adds); where no backend has a
        slot free (it queues anyway), sooner than on every other backend, a slot's wait counted there too
        (else the first slot freed anywhere took it, and its history went cold to a backend no sooner). At
        most home_wait_s, at most the prediction's margin (the free backends' least cost less the
        holder's without the slot's wait: waiting longer costs more than going cold), and at most
        SLOT_WAITS times the predicted wait for the slot (none predicted, before any answer measured the
        holder's decode: no hold). Every backend's slots bounded (as _elsewhere), at least
        min_match_tokens and min_match_ratio of the prompt held, and one prompt at most gone on from
        where the match ends (its own last round: a system prompt several conversations opened with is
        no history, and spreads)."""
        r = self.config
        if (holder is None or holder.free or not self._beyond(matched, holder, run)
                or run * BLOCK_TOKENS < max(r.min_match_tokens, 1) or run < r.min_match_ratio * len(route.blocks)
                or self.index.fan(route.blocks[run - 1]).get(holder.name, 0) > 1
                or not all(getattr(b, "slots", 0) for b in backends if b.available)):
            return None
        others = candidates or [b for b in backends if b is not holder and b.available]
        if not others:
            return None
        elsewhere = min(self.cost_s(route, b, matched) for b in others)
        there, at_once = self.cost_s(route, holder, matched), self.cost_s(route, holder, matched, free=True)
        if there >= elsewhere or there <= at_once:
            return None
        route.overruled = "slot"
        return Hold(holder, min(r.home_wait_s, elsewhere - at_once, SLOT_WAITS * (there - at_once)))

    def _overflow(self, route: PrefixRoute, home: Backend, backends: Sequence[Backend]) -> bool:
        """Whether every backend but home would hold more conversations than its cache with this one."""
        others = [c for c in backends if c is not home and c.available]
        return bool(others) and all(self._share(c, route.prompt_tokens) > 1 for c in others)

    def _hold_home(self, route: PrefixRoute, matched: dict[str, int], candidates: Sequence[Backend],
                   backends: Sequence[Backend]) -> Hold | None:
        """Wait for the home of a conversation whose blocks there the index forgot (_home_at): when home
        is full, at most home_wait_s and at most what going elsewhere costs: its prompt's prefill at the
        measured rate (ttft.py), twice over where every other backend's cache would overflow with it
        (its history copied there evicts about as much of theirs, paid again at their next round), and
        as long as a hold may last when it queues anyway (no slot free anywhere) there. Where the caches
        have room, only while home still holds more of it than a free backend. Home with a slot free:
        _defer."""
        r = self.config
        home = self._home(route)
        best = max((matched.get(b.name, 0) for b in candidates), default=0)
        if home is None or home[1] <= best or home[1] * BLOCK_TOKENS < max(r.min_match_tokens, 1):
            return None
        b = next((x for x in backends if x.name == home[0]), None)
        if b is None or not b.available:
            return None
        if b.free:
            return self._defer(route, b, matched.get(b.name, 0))
        cost = route.prompt_tokens * self.predict.rates(b.name)[0]
        if self._overflow(route, b, backends):
            cost = cost * 2 if candidates else r.home_wait_s
        elif not candidates or matched.get(b.name, 0) <= best:
            return None      # the caches have room, and home holds no more of it: any slot will do
        return Hold(b, min(r.home_wait_s, cost))

    def _defer(self, route: PrefixRoute, home: Backend, run: int) -> Hold | None:
        """A request whose home has a slot free starts there at once, unless the conversations living
        there overflow its cache and home holds only run blocks of the prompt: then it starts COLD_DEFER
        of its uncached part's prefill late, at home, so that the requests arriving with it that find
        more of theirs there start first (served most recently used first, an LRU cache keeps what it
        can; in the order the conversations last came, it evicts each before its next round)."""
        if self._share(home) <= 1 or len(route.blocks) - run <= MISS_SLACK_BLOCKS:
            return None
        r = self.config
        defer = min(r.home_wait_s, COLD_DEFER * (len(route.blocks) - run) * BLOCK_TOKENS
                    * self.predict.rates(home.name)[0])
        return Hold(home, min(r.home_wait_s, 2 * defer), defer) if defer > 0 else None

    def _hold_room(self, route: PrefixRoute, candidates: Sequence[Backend],
                   backends: Sequence[Backend]) -> Hold | None:
        """A new conversation that queues anyway (no slot free) and whose prompt no backend holds
        min_match_tokens of waits for the backend with the most room for it (the least working set,
        counting the new conversations held for it already), when it would overflow another's cache: at
        most home_wait_s and its prompt's predicted prefill there."""
        if candidates or route.placing is not None or self._home(route) is not None:
            return None
        if max(self._match(route).values(), default=0) * BLOCK_TOKENS >= self.config.min_match_tokens:
            return None      # a prefix worth keeping is somewhere: the pick's rules decide
        up = [b for b in backends if b.available]
        if len(up) < 2:
            return None
        best = min(up, key=self._share)
        if all(self._share(b, route.prompt_tokens) <= 1 for b in up):
            return None
        wait = min(self.config.home_wait_s, route.prompt_tokens * self.predict.rates(best.name)[0])
        now = self.clock()
        for key in [k for k, (_, _, until) in self._placing.items() if until < now]:
            del self._placing[key]       # sent elsewhere once its hold was up, or it left the queue
        route.placing = best.name
        self._placing[id(route)] = (best.name, route.prompt_tokens, now + wait)
        return Hold(best, wait)

    def waiter(self, queue: Collection[Waiter], backends: Sequence[Backend]) -> Waiter | None:
        """Of the first lookahead + 1 waiters whose prompt has at least min_match_tokens and
        min_match_ratio of it on a backend with a free slot, the one with the least left to prefill there
        (ties: the earlier): the shortest first, and among a backend's conversations the one whose blocks
        the engine surely kept before the older ones it may be evicting (served the other way round, an
        LRU cache too small for every conversation loses each before its next round); failing that, the
        first whose conversation lives there (Homes: the index forgot its blocks, but its history's home
        is there). A waiter passed over lookahead times already is taken as it is."""
        r = self.config
        if not r.lookahead:
            return None
        free = [b.name for b in backends if b.free]
        if not free:
            return None      # nothing to hand out: the balancer's acquire finds no slot either
        best, least_left, homed = None, 0, None
        for w in itertools.islice(queue, r.lookahead + 1):
            if w.future.done():
                continue
            if w.overtaken >= r.lookahead:
                return w
            if w.route is not None and w.route.blocks:
                matched = self._match(w.route)
                run = max((matched.get(n, 0) for n in free), default=0)
                if run * BLOCK_TOKENS >= r.min_match_tokens and run >= r.min_match_ratio * len(w.route.blocks):
                    left = len(w.route.blocks) - run
                    if best is None or left < least_left:
                        best, least_left = w, left
                elif homed is None and (home := self._home(w.route)) is not None and home[0] in free and home[1] > run:
                    homed = w
        return best or homed
