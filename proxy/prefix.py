"""What the proxy sent where: an approximate index of prompt prefixes per backend, for prefix-aware routing.

vLLM caches a prompt's KV blocks (16 tokens each) per instance, keyed by a hash chained over the blocks
before them, and reuses them for any later prompt that starts the same way. The proxy cannot see the
engines' caches, but it sees every prompt it sends: it cuts each prompt's canonical text into blocks of
BLOCK_BYTES (about 16 tokens at 4 bytes a token), chains their hashes the same way, and remembers which
backend it sent each block to. A later prompt's longest run of known blocks on a backend is what that
backend most likely still holds.

Bounded: at most max_blocks block hashes, the least recently used dropped first; a backend's blocks are
dropped when the proxy takes it out (ejected, unhealthy, drained for a restart) or a reload removes it.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field

BLOCK_BYTES = 64      # vLLM's 16-token block at about 4 bytes of text a token
TOKEN_BYTES = 4       # what the match length in tokens is reckoned with


def prompt_blocks(body: bytes) -> list[int]:
    """The chained block hashes of a chat/completions body's prompt ([] when it has none).

    The canonical text is what the chat template would see, in order: each message's role and content
    (text as is; an image or other part by a hash of its content, so a base64 image costs one short
    token of its own). Only whole blocks count, as in vLLM's cache.
    """
    try:
        request = json.loads(body)
    except ValueError:
        return []
    if not isinstance(request, dict):
        return []
    parts: list[str] = []
    messages = request.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"<|{m.get('role')}|>")
                parts.append(_content(m.get("content")))
    else:
        prompt = request.get("prompt")
        parts.append(prompt if isinstance(prompt, str) else _content(prompt))
    data = "".join(parts).encode("utf-8", "surrogatepass")
    blocks, h = [], 0
    for at in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES):
        h = hash((h, data[at:at + BLOCK_BYTES]))
        blocks.append(h)
    return blocks


def _content(content) -> str:
    """A message's content as canonical text: text parts as they are, anything else by its hash."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else json.dumps(content, sort_keys=True)
    out = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:   # an image (base64 or URL) or another part: one digest of what it is
            raw = json.dumps(part, sort_keys=True).encode("utf-8", "surrogatepass")
            out.append("<|part:" + hashlib.blake2b(raw, digest_size=8).hexdigest() + "|>")
    return "".join(out)


@dataclass
class Route:
    """One request's routing: its prompt's blocks in, what was decided out (for the log and metrics)."""

    blocks: list[int] = field(default_factory=list)
    decision: str = "load"     # prefix: sent where its prefix is; load: least loaded; override: prefix
    matched_tokens: int = 0    # was there, but that backend was too loaded


class PrefixIndex:
    """Block hash -> the backends it was sent to, least recently used first, at most max_blocks."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self._lru: OrderedDict[int, set[str]] = OrderedDict()
        self._of: dict[str, set[int]] = {}   # backend -> its block hashes, to drop them in one go

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

    def insert(self, blocks: list[int], backend: str) -> None:
        """Remember that the prompt's blocks went to backend (they become the most recently used). Last
        block first, so the first is the most recent of all: eviction takes a prompt's tail before its
        head, as vLLM's does (a chain without its head matches nothing)."""
        lru, mine = self._lru, self._of.setdefault(backend, set())
        for h in reversed(blocks):
            holders = lru.get(h)
            if holders is None:
                lru[h] = {backend}
            else:
                holders.add(backend)
                lru.move_to_end(h)
            mine.add(h)
        while len(lru) > self.max_blocks:
            h, holders = lru.popitem(last=False)
            for name in holders:
                self._of[name].discard(h)

    def drop(self, backend: str) -> int:
        """Forget everything sent to backend (it is cold now); returns how many blocks it held."""
        hashes = self._of.pop(backend, set())
        for h in hashes:
            holders = self._lru.get(h)
            if holders is not None:
                holders.discard(backend)
                if not holders:
                    del self._lru[h]
        return len(hashes)

    def blocks_of(self, backend: str) -> int:
        """How many blocks the index holds for backend."""
        return len(self._of.get(backend, ()))
