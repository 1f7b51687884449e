"""Where each conversation lives: its home backend, remembered apart from the prefix index, and each
backend's working set (the blocks of the conversations that live there).

The prefix index (prefix.PrefixIndex) forgets a backend's blocks as its engine's LRU evicts them; when
the conversations sent to a backend overflow its KV cache, every one of them is forgotten before its
next round, and routed by load it would copy its history into another cache, evicting what lives there.
A conversation is known here by its latest prompt's last block: a later round's prompt repeats the
earlier one and goes on, so the earlier one's last block is among its own. Each entry is one request's,
so this stays small (a block hash, a name and a length per conversation), and bounded by the blocks its
conversations hold (the most recently sent kept): what is past that bound is no working set any more.
"""
from __future__ import annotations

from collections import OrderedDict


class Homes:
    """Conversation (its latest prompt's last block) -> (backend, the prompt's blocks), least recently
    sent first; and per backend the sum of its conversations' blocks, its working set."""

    def __init__(self, most_blocks: int):
        self.most_blocks = most_blocks     # the working sets' sum is kept at most this (oldest dropped)
        self._of: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._sum = 0
        self.working: dict[str, int] = {}  # backend -> blocks of the conversations living there

    def __len__(self) -> int:
        return len(self._of)

    def find(self, blocks: list[int]) -> tuple[str, int] | None:
        """The home of the conversation the prompt continues, and the length in blocks of the earlier
        prompt it repeats (None: it continues none). A prompt equal to an earlier one continues nothing
        (the same question asked again is no conversation: it goes by load). Looked for from the end: a
        conversation's next round adds a little to what it repeats."""
        of = self._of
        for i in range(len(blocks) - 2, -1, -1):
            entry = of.get(blocks[i])
            if entry is not None:
                return entry[0], i + 1
        return None

    def sent(self, blocks: list[int], backend: str, continues: int = 0) -> None:
        """The prompt went to backend: it is its conversation's latest, and backend its home from now on.
        continues: the length of the earlier prompt it repeats (find), whose entry it replaces."""
        if not blocks:
            return
        if continues:
            self._remove(blocks[continues - 1])
        self._remove(blocks[-1])
        self._of[blocks[-1]] = (backend, len(blocks))
        self.working[backend] = self.working.get(backend, 0) + len(blocks)
        self._sum += len(blocks)
        while self._sum > self.most_blocks and len(self._of) > 1:
            self._remove(next(iter(self._of)))

    def _remove(self, key: int) -> None:
        entry = self._of.pop(key, None)
        if entry is not None:
            self.working[entry[0]] -= entry[1]
            self._sum -= entry[1]

    def drop(self, backend: str) -> None:
        """Forget every conversation living on backend (it left, or lost its cache)."""
        for key in [k for k, (name, _) in self._of.items() if name == backend]:
            self._remove(key)
        self.working.pop(backend, None)
