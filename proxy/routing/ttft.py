"""A request's predicted time to first token on a backend, from what the proxy sent there and what the
engine's answers measured.

    ttft(b) = (backlog(b) + uncached(b)) x prefill_s(b)  +  running(b) x occupancy_s(b)  +  slot_wait(b)

- uncached(b): the prompt's tokens b does not hold (the prefix index's match there);
- backlog(b): the uncached prompt tokens sent to b before it and likely not prefilled yet: what was sent,
  less what b prefills in the time since at its rate (vLLM prefills in the order requests started: a
  new prompt waits behind those), none once b runs nothing;
- prefill_s(b), occupancy_s(b): measured, b's seconds a prefill token and per running request. Every
  streamed answer b sends is an observation: its time from the slot to its first token against the
  tokens ahead of it (its backlog at the send and its own uncached part) and the requests already
  running there (every running stream takes its share of each engine step: vLLM's token budget per step
  is shared by the decodes and the prefill chunks). A least-squares fit over b's recent answers (each
  older one weighing FORGET times less), drawn towards the prior (routing.prefill_ms per 1,000 tokens,
  0 s per running request) while it has seen few;
- slot_wait(b): when b has no free slot, the time until one of its streams ends: its measured seconds a
  token times half an answer's tokens (its mean), shared over the streams running there.
"""
from __future__ import annotations

from dataclasses import dataclass

# Each newer observation weighs this much more than the one before it (about the last 1/(1 - FORGET)
# answers count): engines' speed changes with what they run.
FORGET = 0.98
# The prior weighs as many observations as this (per feature): a few answers move it, many replace it.
PRIOR_WEIGHT = 1.0


@dataclass
class Sent:
    """What the prediction knew of a request when it was sent (to be matched with its answer's timing)."""

    ahead: float        # prompt tokens to prefill before its first token: the backlog there and its own
    running: int        # requests already running on the backend


class _Fit:
    """Weighted least squares of first-token time = base + ahead x prefill_s + running x occupancy_s."""

    def __init__(self, prefill_s: float):
        w = PRIOR_WEIGHT
        # normal equations over features (1, ahead / 1000, running), primed with the prior's pseudo-points
        self.xx = [[w, 0.0, 0.0], [0.0, w, 0.0], [0.0, 0.0, w]]
        self.xy = [0.0, w * prefill_s * 1000, 0.0]
        self.coef = (0.0, prefill_s, 0.0)
        self.prior = (prefill_s,)

    def add(self, ahead: float, running: int, seconds: float) -> None:
        x = (1.0, ahead / 1000, float(running))
        w = PRIOR_WEIGHT
        for i in range(3):
            for j in range(3):
                # forget the old observations, never the prior's weight on the slopes
                keep = w if i == j and i else 0.0
                self.xx[i][j] = keep + (self.xx[i][j] - keep) * FORGET + x[i] * x[j]
            keep = w * self.prior[0] * 1000 if i == 1 else 0.0
            self.xy[i] = keep + (self.xy[i] - keep) * FORGET + x[i] * seconds
        c = _solve(self.xx, self.xy)
        if c is not None:
            base, per_k, per_run = c
            self.coef = (base, max(0.0, per_k / 1000), max(0.0, per_run))


def _solve(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """a x = b for a 3 x 3 system (Gaussian elimination, partial pivoting); None when singular."""
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, 4):
                    m[r][k] -= f * m[col][k]
    return m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]


@dataclass
class _Backend:
    fit: _Fit
    backlog: float = 0.0       # tokens, as of `at`
    at: float = 0.0
    token_s: float | None = None   # measured seconds a decoded token (moving average)
    answer_tokens: float = 0.0     # an answer's tokens (moving average)


class Predictor:
    """Per backend: its prefill backlog and its measured speeds; ttft_s() is the formula above."""

    def __init__(self, prefill_ms: float):
        self.prefill_s = prefill_ms / 1e6
        self._of: dict[str, _Backend] = {}

    def _get(self, name: str) -> _Backend:
        b = self._of.get(name)
        if b is None:
            b = self._of[name] = _Backend(_Fit(self.prefill_s))
        return b

    def rates(self, name: str) -> tuple[float, float]:
        """(seconds a prefill token, seconds per running request) measured on the backend."""
        c = self._get(name).fit.coef
        return c[1], c[2]

    def backlog(self, name: str, now: float) -> float:
        """The prefill tokens sent to the backend that it likely has not run yet."""
        b = self._get(name)
        rate = b.fit.coef[1]
        if not rate:
            return 0.0
        return max(0.0, b.backlog - (now - b.at) / rate)

    def queued_s(self, name: str, now: float) -> float:
        """The prefill queued on the backend, in seconds at its rate: what a new prompt waits behind
        there before its own (0 when nothing is queued, whatever the backend's rates)."""
        return self.backlog(name, now) * self._get(name).fit.coef[1]

    def ttft_s(self, name: str, uncached: int, running: int, free: bool, now: float) -> float:
        """The predicted time to first token of a prompt with `uncached` tokens not cached there, on a
        backend running `running` requests (free: with a slot for it)."""
        b = self._get(name)
        _, prefill_s, occupancy_s = b.fit.coef
        t = (self.backlog(name, now) + uncached) * prefill_s + running * occupancy_s
        if not free and running and b.token_s:
            t += b.token_s * b.answer_tokens / 2 / running
        return t

    def sent(self, name: str, uncached: int, running: int, now: float) -> Sent:
        """A request with `uncached` tokens to prefill went to the backend: its backlog grows."""
        b = self._get(name)
        ahead = self.backlog(name, now)
        b.backlog, b.at = ahead + uncached, now
        return Sent(ahead + uncached, running)

    def ended(self, name: str, running: int) -> None:
        """A request on the backend ended; with none left running there, nothing waits for prefill."""
        if not running:
            b = self._get(name)
            b.backlog = 0.0

    def answered(self, name: str, sent: Sent, first_token_s: float, decode_s: float, tokens: int) -> None:
        """A streamed answer's timing on the backend: from its slot to its first token, and from there to
        its last of `tokens` tokens."""
        b = self._get(name)
        if first_token_s >= 0:
            b.fit.add(sent.ahead, sent.running, first_token_s)
        if tokens > 1 and decode_s > 0:
            per = decode_s / (tokens - 1)
            b.token_s = per if b.token_s is None else b.token_s + (per - b.token_s) * (1 - FORGET) * 5
        if tokens > 0:
            b.answer_tokens += (tokens - b.answer_tokens) * (1 - FORGET) * 5 if b.answer_tokens else tokens

    def forget(self, name: str) -> None:
        self._of.pop(name, None)
