"""The engine step: what runs shares one token budget per step, as vLLM's scheduler shares it.

vLLM (v1, chunked prefill on) runs in steps. Each step has a budget of `max_num_batched_tokens`; the
running requests are scheduled first, in the order they started: a decoding request takes one token of
the budget, a request still in prefill takes what is left of it, up to its remaining prompt
(vllm/v1/core/sched/scheduler.py, `schedule`: "token_budget" shared by running and then waiting requests;
a prefill longer than the budget is cut into chunks). A request's first token comes at the end of the step
that finishes its prefill, and every decoding request gets one token per step. So a long prefill placed
beside running streams makes their steps long: they slow while it runs.

The time of a step, the sim's cost model: `token_ms` (a decode step's cost: the weights read once, the
same for one stream or many) plus `prefill_ms` per 1,000 prefill tokens in it (compute that grows with
the tokens). A prompt of P uncached tokens alone thus takes ceil(P / budget) steps: about P x prefill_ms
/ 1,000 plus one token_ms a chunk, what the per-request model charged.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence


@dataclass(eq=False)
class Running:
    """One running request in the step loop: the prompt tokens it still has to prefill, the tokens it
    will produce and the ones produced so far."""

    prefill_left: int
    want: int
    produced: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = 0.0     # when its prefill began (the loop's clock)

    @property
    def decoding(self) -> bool:
        return self.prefill_left == 0 and self.produced < self.want

    @property
    def finished(self) -> bool:
        return self.produced >= self.want


@dataclass
class Plan:
    """One step: the prefill chunk each request gets (request, tokens) and the requests that decode."""

    chunks: list[tuple[Running, int]]
    decodes: list[Running]

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


def plan_step(running: Sequence[Running], budget: int) -> Plan:
    """What one step runs: every decoding request one token, then prefill chunks in the order the
    requests started, while the budget lasts (a request's chunk: its remaining prompt or what is left)."""
    decodes = [s for s in running if s.decoding]
    left = budget - len(decodes)
    chunks = []
    for s in running:
        if left <= 0:
            break
        if s.prefill_left > 0:
            n = min(s.prefill_left, left)
            chunks.append((s, n))
            left -= n
    return Plan(chunks, decodes)


def step_seconds(plan: Plan, token_ms: float, prefill_ms: float) -> float:
    """A step's time: token_ms, plus prefill_ms per 1,000 prefill tokens it runs."""
    return (token_ms + prefill_ms * plan.prefill_tokens / 1000) / 1000


def apply(plan: Plan) -> list[Running]:
    """The step ran: chunks are prefilled (a finished prefill yields the first token), every decode one
    token. Returns the requests that produced a token."""
    out = []
    for s, n in plan.chunks:
        s.prefill_left -= n
        if s.prefill_left == 0:
            s.produced += 1
            out.append(s)
    for s in plan.decodes:
        s.produced += 1
        out.append(s)
    return out


class StepLoop:
    """The engine's loop: while anything runs, plan a step, take its time, hand out its tokens.

    budget: max_num_batched_tokens. sleep: how a step's time passes (a test passes a virtual clock's).
    """

    def __init__(self, budget: int, token_ms: float, prefill_ms: float,
                 sleep: Callable[[float], Awaitable] = asyncio.sleep, clock: Callable[[], float] = time.monotonic):
        self.budget, self.token_ms, self.prefill_ms = budget, token_ms, prefill_ms
        self.sleep, self.clock = sleep, clock
        self.running: list[Running] = []
        self.steps = 0
        self._task: asyncio.Task | None = None

    def add(self, uncached_tokens: int, want: int) -> Running:
        """A request starts running: uncached_tokens to prefill (at least 1: vLLM computes the last prompt
        token again), then want tokens to produce, the first at the end of its prefill."""
        s = Running(max(1, uncached_tokens), max(1, want), started=self.clock())
        self.running.append(s)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return s

    def remove(self, s: Running) -> None:
        """A request left (finished, aborted): its share of the budget goes to the others from the next step."""
        if s in self.running:
            self.running.remove(s)

    async def tokens(self, s: Running):
        """Yield once per token s produces, as the steps produce them (a slow reader gets them in a burst)."""
        given = 0
        while given < s.want:
            while s.produced <= given:
                s.changed.clear()
                await s.changed.wait()
            given += 1
            yield given

    async def _run(self) -> None:
        while self.running:
            plan = plan_step(self.running, self.budget)
            await self.sleep(step_seconds(plan, self.token_ms, self.prefill_ms))
            self.steps += 1
            for s in apply(plan):
                s.changed.set()
            self.running = [s for s in self.running if not s.finished]
