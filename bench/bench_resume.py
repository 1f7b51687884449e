"""Streams cut per SIGKILL of an instance, with the proxy's resume off and on, and the gap a client sees at a
resume (issue 38).

    .venv/bin/python bench/bench_resume.py [--rounds 3] [--streams 32] [--tokens 80] [--token-ms 25]
                                           [--out FILE.json]

Each round: 4 sims (max_num_seqs 16, --token-ms a token) behind a fresh proxy (least_conn, so the streams
spread evenly), --streams concurrent chat streams, each its own conversation (include_usage); once every
stream is in flight and has had 0.4 s of tokens, SIGKILL of the sim holding the most. Counted per mode:
the streams that ended without their `[DONE]` (cut), and of those that went through the killed sim, the
client's view of the hop: the longest gap between two chunks of the stream (the resume gap) against the
stream's median gap between chunks (its pace). Resumed texts are checked against the same request
answered uninterrupted (a sim's answer is a function of its conversation). Every process it starts is
stopped with its process group (by the ids it made).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from stack import free_ports, wait_http  # noqa: E402

SIMS = 4


def ask(i: int, tokens: int, stream: bool = True) -> dict:
    return {"model": "m", "max_tokens": tokens, "stream": stream, "seed": 1,
            **({"stream_options": {"include_usage": True}} if stream else {}),
            "messages": [{"role": "user", "content": f"conversation {i}: tell me about the weather"}]}


async def stream(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """A stream as its client sees it: the backend it began on, its text, the gaps between chunks, whether
    it ended with its [DONE]."""
    seen = {"backend": None, "text": "", "gaps": [], "done": False}
    last, buf = None, b""
    try:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            seen["backend"] = r.headers.get("X-Backend")
            async for chunk in r.content.iter_any():
                now = time.monotonic()
                if last is not None:
                    seen["gaps"].append(now - last)
                last = now
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for e in events:
                    payload = e.strip()[5:].strip()
                    if payload == b"[DONE]":
                        seen["done"] = True
                    elif payload:
                        for c in json.loads(payload).get("choices", []):
                            seen["text"] += c["delta"].get("content") or ""
    except aiohttp.ClientError:
        pass
    return seen


def start(cmd: list, log: Path, procs: list) -> subprocess.Popen:
    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                             env={**os.environ, "FLEET_SIM_DEV_DIR": str(log.parent / "sim-dev")})
    procs.append(p)
    return p


async def in_flight(admin: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(admin + "/admin/backends") as r:
            return {b["name"]: b["in_flight"] for b in await r.json()}


async def one_round(work: Path, resume: bool, args) -> dict:
    procs: list[subprocess.Popen] = []
    base = free_ports(SIMS + 2)
    ports, port, admin = [base + i for i in range(SIMS)], base + SIMS, base + SIMS + 1
    try:
        sims = [start([sys.executable, "-m", "fleet.sim", "serve", "m", "--host", "127.0.0.1", "--port", str(p),
                       "--max-num-seqs", "16", "--sim-load-s", "0", "--sim-prefill-ms", "20",
                       "--sim-token-ms", str(args.token_ms)], work / f"sim-{p}.log", procs) for p in ports]
        conf = {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"host": "127.0.0.1", "port": admin},
                "backends": [f"127.0.0.1:{p}" for p in ports], "health": {"interval_s": 1, "timeout_s": 1},
                "routing": {"policy": "least_conn"}, "resume": {"enabled": resume},
                "results_log": {"path": str(work / f"results-{resume}-{port}.log")}}
        (work / f"proxy-{port}.yaml").write_text(yaml.safe_dump(conf))
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health")
        start([sys.executable, "-m", "proxy", "--config", str(work / f"proxy-{port}.yaml")], work / f"proxy-{port}.log", procs)
        url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        wait_http(url + "/health")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            tasks = [asyncio.ensure_future(stream(s, url, ask(i, args.tokens))) for i in range(args.streams)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                held = await in_flight(admin_url)
                if sum(held.values()) == args.streams:
                    break
                await asyncio.sleep(0.02)
            victim = max(held, key=held.get)
            await asyncio.sleep(0.4)
            os.kill(sims[[f"127.0.0.1:{p}" for p in ports].index(victim)].pid, signal.SIGKILL)
            seen = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            expected = {}
            for i, x in enumerate(seen):
                if x["backend"] == victim and x["done"]:
                    async with s.post(url + "/v1/chat/completions", json=ask(i, args.tokens, stream=False)) as r:
                        expected[i] = (await r.json())["choices"][0]["message"]["content"]
        hit = [x for x in seen if x["backend"] == victim]
        return {"resume": resume, "on_victim": held[victim], "cut": sum(not x["done"] for x in seen),
                "continuous": sum(seen[i]["text"] == t for i, t in expected.items()), "checked": len(expected),
                "resume_gaps_ms": [round(max(x["gaps"]) * 1000, 1) for x in hit if x["done"] and x["gaps"]],
                "pace_ms": [round(statistics.median(x["gaps"]) * 1000, 1) for x in hit if x["done"] and x["gaps"]]}
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop each process started and its group (a sim killed on purpose leaves its EngineCore child there:
    it survives its parent, as vLLM's does), by the ids this bench made."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--token-ms", type=float, default=25)
    parser.add_argument("--out", help="write the rounds as JSON here")
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        for resume in (False, True):
            for _ in range(args.rounds):
                rounds.append(asyncio.run(one_round(Path(tmp), resume, args)))
    print(f"{args.streams} streams over {SIMS} sims, {args.tokens} tokens at {args.token_ms:g} ms, "
          f"SIGKILL of the busiest sim mid-answer, {args.rounds} rounds per mode")
    print(f"{'resume':>6} {'on killed':>9} {'cut':>4} {'continuous':>10} {'gap p50':>8} {'gap p99':>8} {'pace p50':>8}")
    for resume in (False, True):
        mine = [r for r in rounds if r["resume"] == resume]
        gaps = [g for r in mine for g in r["resume_gaps_ms"]] if resume else []
        pace = [g for r in mine for g in r["pace_ms"]]
        print(f"{'on' if resume else 'off':>6} {sum(r['on_victim'] for r in mine):>9} {sum(r['cut'] for r in mine):>4} "
              f"{sum(r['continuous'] for r in mine):>4}/{sum(r['checked'] for r in mine):<5} "
              f"{pct(gaps, 0.5) or '-':>8} {pct(gaps, 0.99) or '-':>8} {pct(pace, 0.5) or '-':>8}")
    if args.out:
        Path(args.out).write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
