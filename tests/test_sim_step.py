"""The simulator's engine step (fleet/sim/step.py): one token budget a step shared by the decodes and the
prefill chunks of what runs, as vLLM's scheduler shares max_num_batched_tokens; a long prefill slows the
streams beside it. Driven on a virtual clock: deterministic and fast."""
from __future__ import annotations

import asyncio

import pytest

from fleet.sim.cli import parse as parse_cli
from fleet.sim.config import SimConfig, settle
from fleet.sim.server import Engine
from fleet.sim.step import Running, StepLoop, apply, plan_step, step_seconds

TOKEN_MS, PREFILL_MS, BUDGET = 20.0, 60.0, 2048


class Clock:
    """A virtual clock: a sleep moves it on at once; the tasks woken by the last step run first."""

    def __init__(self):
        self.now = 0.0

    async def sleep(self, seconds: float) -> None:
        for _ in range(8):   # let the readers of the last step's tokens take them at its time
            await asyncio.sleep(0)
        self.now += seconds


def token_times(loop: StepLoop, clock: Clock, s: Running) -> list[float]:
    """A coroutine's result: when each of s's tokens came (virtual seconds)."""
    async def read():
        return [clock.now async for _ in loop.tokens(s)]
    return read()


@pytest.mark.unit
def test_a_step_gives_every_decode_one_token_then_prefill_chunks_in_start_order_within_the_budget():
    """1. Two requests decode, two wait in prefill (3,000 and 500 tokens), budget 2,048.
    2. The decodes take 2 tokens of it; the first prefill the remaining 2,046; the second nothing.
    3. The step costs token_ms plus prefill_ms per 1,000 of those 2,046 tokens."""
    a, b = Running(0, 10, produced=3), Running(0, 10, produced=1)
    long, short = Running(3000, 5), Running(500, 5)
    plan = plan_step([long, a, short, b], BUDGET)
    assert plan.decodes == [a, b]
    assert plan.chunks == [(long, 2046)]
    assert step_seconds(plan, TOKEN_MS, PREFILL_MS) == pytest.approx((20 + 60 * 2046 / 1000) / 1000)
    produced = apply(plan)
    assert produced == [a, b] and long.prefill_left == 954 and long.produced == 0
    plan = plan_step([long, a, short, b], BUDGET)
    assert plan.chunks == [(long, 954), (short, 500)]   # what is left goes on to the next in line
    assert apply(plan) == [long, short, a, b]           # a finished prefill yields the first token


@pytest.mark.unit
def test_a_request_alone_takes_its_chunks_steps_then_one_token_a_step():
    """A 5,000-token prefill alone with budget 2,048: three steps (2,048 + 2,048 + 904 tokens), the first
    token at their end (3 x token_ms + 5,000 x prefill_ms / 1,000), then token_ms a token."""
    clock = Clock()

    async def go():
        loop = StepLoop(BUDGET, TOKEN_MS, PREFILL_MS, sleep=clock.sleep, clock=lambda: clock.now)
        times = await token_times(loop, clock, loop.add(5000, 4))
        return times, loop.steps
    times, steps = asyncio.run(go())
    first = (3 * TOKEN_MS + 5000 * PREFILL_MS / 1000) / 1000
    assert times == pytest.approx([first, first + 0.02, first + 0.04, first + 0.06])
    assert steps == 6


@pytest.mark.unit
def test_a_long_prefill_beside_a_stream_slows_it_and_waits_for_the_budget_it_shares():
    """1. A stream decodes alone: a token every token_ms.
    2. A 6,000-token prefill joins: every step now carries a chunk of it (2,047 tokens beside the one
       decode), so the stream's next gaps are token_ms + 2,047 x prefill_ms / 1,000, 143 ms, until the
       prefill is done.
    3. Then the stream is back to token_ms; the prefill's first token came after its three steps."""
    clock = Clock()

    async def go():
        loop = StepLoop(BUDGET, TOKEN_MS, PREFILL_MS, sleep=clock.sleep, clock=lambda: clock.now)
        stream = asyncio.ensure_future(token_times(loop, clock, loop.add(1, 12)))
        while clock.now < 0.1:
            await asyncio.sleep(0)
        long = await token_times(loop, clock, loop.add(6000, 1))
        return await stream, long
    stream, long = asyncio.run(go())
    gaps = [round((b - a) * 1000, 3) for a, b in zip(stream, stream[1:])]
    chunk = TOKEN_MS + 2047 * PREFILL_MS / 1000
    assert gaps.count(TOKEN_MS) >= 6
    assert gaps.count(round(chunk, 3)) == 2          # two full chunks; the third is the rest (1,906 tokens)
    assert max(gaps) == pytest.approx(chunk)
    assert long[0] - stream[0] > 3 * TOKEN_MS / 1000 + 6000 * PREFILL_MS / 1e6


@pytest.mark.unit
def test_max_num_batched_tokens_is_vllms_flag_off_by_default_and_turns_the_engine_step_on():
    """The flag (or FLEET_SIM_MAX_NUM_BATCHED_TOKENS) sets the budget; without it the sim keeps the
    per-request model (no step loop); --sim-instant turns it off; a negative budget refuses to start."""
    args, _ = parse_cli(["serve", "m", "--max-num-batched-tokens", "2048"])
    assert settle(vars(args), {}).max_num_batched_tokens == 2048
    args, _ = parse_cli(["serve", "m"])
    assert settle(vars(args), {}).max_num_batched_tokens == 0
    assert settle(vars(args), {"FLEET_SIM_MAX_NUM_BATCHED_TOKENS": "512"}).max_num_batched_tokens == 512
    args, _ = parse_cli(["serve", "m", "--max-num-batched-tokens", "2048", "--sim-instant"])
    assert settle(vars(args), {}).max_num_batched_tokens == 0
    assert "max_num_batched_tokens" in SimConfig("m", ["m"], max_num_batched_tokens=-1).startup_error()

    async def engines():
        return Engine(SimConfig("m", ["m"])).steps, Engine(SimConfig("m", ["m"], max_num_batched_tokens=64)).steps
    off, on = asyncio.run(engines())
    assert off is None and on.budget == 64
