"""The engine's prefix cache, as vLLM 0.32's automatic prefix caching keeps it (on by default).

A prompt is a list of tokens cut into blocks of BLOCK_SIZE; each full block is named by a hash chained
over its parent's hash, its tokens and its extra keys (an image's content hash and offset, a LoRA
adapter's name), as vllm/v1/core/kv_cache_utils.py does (hash_block_tokens, get_request_block_hasher,
_gen_mm_extra_hash_keys, _gen_lora_extra_hash_keys); only full blocks are hashed, so only they are ever
found again. A request's hit is the longest run of its leading blocks found in the cache, at most
prompt length - 1 tokens (vllm/v1/core/kv_cache_manager.py, get_computed_blocks: the last token is
always computed again for its logits). The cache holds `capacity` blocks; a block no running request
holds stays cached until a new block needs its place, least recently freed first, a request's tail
blocks before its head (single_type_kv_cache_manager.py, free: "Free blocks in reverse order").
Counters in tokens, as vLLM's PrefixCacheStats.record counts them: queries += prompt tokens,
hits += cached tokens, once per request when it is scheduled.

Generated tokens are cached too, as vLLM's do (kv_cache_manager.py, cache_blocks on every step: the
request's blocks that decoding filled are hashed over prompt and output alike): when a request ends the sim
hashes its whole sequence but the last token (whose KV was never computed) and keeps the full blocks past
the prompt's (`extend`), so the next round of a conversation, whose prompt repeats the answer, finds them.
The sim takes them at the end rather than block by block while decoding, and only as far as free or
evictable space allows (vLLM would preempt a request instead).
"""
from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

BLOCK_SIZE = 16   # vLLM's default block size (vllm/config/cache.py)
# The root of every chain: vLLM hashes a seed string into NONE_HASH (kv_cache_utils.py, init_none_hash).
NONE_HASH = hashlib.sha256(b"vllm-none-hash").digest()


@dataclass(frozen=True)
class Image:
    """An image in a prompt: its content hash and where its placeholder tokens sit."""

    identifier: str
    offset: int
    length: int


@dataclass
class Prompt:
    """What the engine caches a request by: its tokens, its images, its adapter."""

    tokens: Sequence[Any]
    images: Sequence[Image] = ()
    lora: str | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def block_hashes(prompt: Prompt, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chained hashes of the prompt's full blocks (sha256, vLLM's default prefix_caching_hash_algo)."""
    hashes: list[bytes] = []
    parent = NONE_HASH
    for start in range(0, len(prompt.tokens) - block_size + 1, block_size):
        end = start + block_size
        extra: list[tuple] = [("lora", prompt.lora)] if prompt.lora else []
        extra += [("mm", im.identifier, im.offset - start) for im in prompt.images
                  if im.offset < end and start < im.offset + im.length]
        parent = hashlib.sha256(pickle.dumps((parent, tuple(prompt.tokens[start:end]), tuple(extra) or None),
                                             protocol=4)).digest()
        hashes.append(parent)
    return hashes


@dataclass
class Allocation:
    """The blocks one running request holds."""

    tokens: int
    hit_tokens: int
    held: list[bytes] = field(default_factory=list)   # cached blocks, in prompt order
    private: int = 0                                   # blocks of its own: the partial tail


class PrefixCache:
    """Blocks cached by hash, the ones no request holds in LRU order, and vLLM's two counters."""

    def __init__(self, capacity: int, block_size: int = BLOCK_SIZE):
        self.capacity = capacity
        self.block_size = block_size
        self.refs: dict[bytes, int] = {}                  # every cached block -> requests holding it
        self.evictable: OrderedDict[bytes, None] = OrderedDict()  # cached, held by none; oldest first
        self.private = 0                                   # uncached blocks of running requests
        self.queries_total = 0
        self.hits_total = 0
        self.evicted_total = 0

    @property
    def used(self) -> int:
        """Blocks taken: cached ones (held or not) and running requests' own."""
        return len(self.refs) + self.private

    def _hit_blocks(self, hashes: list[bytes], n_tokens: int) -> int:
        limit = min(len(hashes), (n_tokens - 1) // self.block_size)
        n = 0
        while n < limit and hashes[n] in self.refs:
            n += 1
        return n

    def fits(self, hashes: list[bytes], n_tokens: int) -> bool:
        """Whether the request's blocks can be had now, evicting unheld blocks if need be."""
        new = sum(1 for h in hashes if h not in self.refs) + (1 if n_tokens % self.block_size else 0)
        reusable = sum(1 for h in hashes if h in self.evictable)   # touched, so not evictable for it
        return new <= self.capacity - self.used + len(self.evictable) - reusable

    def allocate(self, hashes: list[bytes], n_tokens: int) -> Allocation:
        """Take the request's blocks (call fits() first): cached ones are shared, the others are
        taken from free space or from the least recently freed blocks; counts the query and its hit."""
        hit = self._hit_blocks(hashes, n_tokens)
        alloc = Allocation(tokens=n_tokens, hit_tokens=hit * self.block_size)
        for h in hashes:
            if h in self.refs:
                self.evictable.pop(h, None)
                self.refs[h] += 1
            else:
                self._make_room()
                self.refs[h] = 1
            alloc.held.append(h)
        if n_tokens % self.block_size:
            self._make_room()
            self.private += 1
            alloc.private = 1
        self.queries_total += n_tokens
        self.hits_total += alloc.hit_tokens
        return alloc

    def extend(self, alloc: Allocation, hashes: list[bytes]) -> int:
        """Cache the blocks that decoding filled: hashes are the whole sequence's full blocks (prompt then
        output); the ones past those alloc holds join it, the partial prompt block among them. Stops
        where no space is left. Returns how many blocks were added."""
        if alloc.private and len(hashes) > len(alloc.held):
            self.private -= alloc.private     # the prompt's partial block is full now, and hashed below
            alloc.private = 0
        added = 0
        for h in hashes[len(alloc.held):]:
            if h in self.refs:
                self.evictable.pop(h, None)
                self.refs[h] += 1
            elif self.used < self.capacity or self.evictable:
                self._make_room()
                self.refs[h] = 1
            else:
                break
            alloc.held.append(h)
            added += 1
        return added

    def _make_room(self) -> None:
        if self.used >= self.capacity:
            victim, _ = self.evictable.popitem(last=False)
            del self.refs[victim]
            self.evicted_total += 1

    def free(self, alloc: Allocation) -> None:
        """Give the request's blocks back: cached ones stay, evictable once no one holds them, tail first."""
        self.private -= alloc.private
        for h in reversed(alloc.held):
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.evictable[h] = None
        alloc.held, alloc.private = [], 0

    def stats(self) -> dict:
        return {"capacity_blocks": self.capacity, "used_blocks": self.used,
                "evictable_blocks": len(self.evictable), "cached_blocks": len(self.refs),
                "queries_tokens": self.queries_total, "hits_tokens": self.hits_total,
                "evicted_blocks": self.evicted_total}
