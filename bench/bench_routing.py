"""Routing quality: prefix-aware routing against least_conn, nginx, vllm-router and smg, on 8 sims x 4 slots.

    .venv/bin/python bench/bench_routing.py [--quick] [--fronts ...] [--workloads chat,groups,hotspot]
                                            [--bound-s 2.5] [--routing key=value ...] [--baseline DIR] [--out FILE.json]

8 sim engines with max_num_seqs 4 and a prefix cache each (time to first token = overhead + prefill_ms per
1,000 prompt tokens not in that engine's cache; then token_ms a token), behind every front in one run:
proxy (`proxy.routing.policy=least_conn`), proxy-prefix (`proxy.routing.policy=prefix`, plus --routing
overrides), proxy-prefix-base (the same config served by the
--baseline checkout: the code before a change, in the same run), nginx (rendered, least_conn), vllm-router with --policy cache_aware and power_of_two, smg with
--policy cache_aware (bench/setup_routers.sh installs both; a front not installed is left out, said so).

Three workloads, streamed chat completions, Poisson arrivals (a seeded generator: every front gets the same
arrival times), each level of rate run on every front in turn (the order turned at each level):

- chat (production-stack's multi-round QA, scaled down): N users, R rounds each; every prompt opens with
  a shared system prompt of S tokens, then the user's own document of H tokens, then the history (each
  earlier question of Q tokens and the answer the engine gave, A tokens); a user's next round is sent at
  its arrival time or when its previous answer came back, whichever is later; each round's users come
  in a shuffled order. N = rate x D / R, so each level lasts about D seconds and a user's rounds come
  about D / R apart at every rate. The rate is swept upward; a front leaves the sweep after the first
  level it did not hold (below).
- groups (llm-d's shared_prefix): G groups x P prompts, each a group prefix of L tokens and a question of
  Q tokens of its own, in a shuffled order.
- hotspot (production-stack #957): one shared system prompt of S tokens and unique user messages of U
  tokens.

Figures per front and level: TTFT (time to the first SSE chunk with content) p50/p99, end-to-end p50/p99,
pace (the arrival schedule's span over the span of the sends: below 1 when chat users had to wait for
late answers, so the front could not take the offered rate), throughput (answers / (last answer - first
send)), goodput (the rate of the highest level the front held: TTFT p99 under the bound, pace at least
0.9, nothing failed; the levels are a coarse grid, so also slo: the answers a second whose TTFT was under
the bound, the best level's), the engines' prefix-cache hit rate (`vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total`, deltas of the sims' /metrics), the oracle's hit rate (the share of
prompt tokens, in whole 16-token blocks, that an earlier request of the same conversation or group had
already sent, the shared system prompt counting as everyone's group: what a router with unbounded caches
could reach), the spread of requests over backends (max/min of the sims' request counts) and, where the
front names its backend (X-Backend), the share of a conversation's later rounds sent where its previous
round went (stick), and for the proxy its routing decisions (`proxy_route_decisions_total`: the share
overridden by load). Every run's prompts open with a nonce of their own, so no front finds another's
blocks in the engines' caches or its own index. Every process it starts is stopped by pid.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import ROOT, Stack  # noqa: E402

BACKENDS, MAX_NUM_SEQS = 8, 4
FRONT_NAMES = {"proxy": "proxy least_conn", "proxy-prefix": "proxy prefix", "proxy-prefix-base": "proxy prefix, baseline",
               "proxy-prefix-w2": "proxy prefix, 2 workers",
               "nginx": "nginx least_conn",
               "vllm-router-cache": "vllm-router cache_aware", "vllm-router-p2": "vllm-router power_of_two",
               "smg-cache": "smg cache_aware"}
DEFAULT_FRONTS = ",".join(f for f in FRONT_NAMES if f not in ("proxy-prefix-base", "proxy-prefix-w2"))
# The engine model (sim flags). prefill_ms is per 1,000 uncached prompt tokens: 2,000 tokens a second, a
# slow engine, so that prefill is a good share of a request's time as on a long multimodal prompt;
# kv_blocks: 2,048 blocks of 16 tokens (32k tokens) per engine, so a working set spread over every engine
# does not fit one engine's cache, while an eighth of it does.
SIM = {"overhead_ms": 20, "prefill_ms": 500, "token_ms": 20, "kv_blocks": 2048, "max_model_len": 16384}
CHARS_PER_TOKEN, BLOCK = 4, 16   # the sim's tokenizer (4 characters a token) and vLLM's block


@dataclass
class Workload:
    name: str
    params: dict
    levels: list[float]            # requests/s
    sweep: bool = False            # a front leaves after its first level over the bound


def workloads(quick: bool) -> dict[str, Workload]:
    if quick:
        # a smoke run: one level each, too few requests for steady p99s or spreads
        return {"chat": Workload("chat", {"R": 3, "S": 1000, "H": 2000, "Q": 32, "A": 32, "D": 6.0}, [12], True),
                "groups": Workload("groups", {"G": 16, "P": 3, "L": 3000, "Q": 32, "A": 32}, [16]),
                "hotspot": Workload("hotspot", {"n": 48, "S": 1000, "U": 64, "A": 32}, [24])}
    # chat: D / R = 2.5 s between a user's rounds, more than a cold round takes (2.2 s), so a front that
    # keeps up keeps the pace.
    return {"chat": Workload("chat", {"R": 4, "S": 1000, "H": 2000, "Q": 32, "A": 32, "D": 10.0},
                             [8, 12, 16, 20, 24, 28, 32], True),
            "groups": Workload("groups", {"G": 16, "P": 6, "L": 3000, "Q": 32, "A": 32}, [8, 16]),
            "hotspot": Workload("hotspot", {"n": 128, "S": 1000, "U": 64, "A": 32}, [16, 24])}


def describe(w: Workload) -> str:
    p = w.params
    if w.name == "chat":
        return (f"chat: N = rate x {p['D']:g} s / {p['R']} users, {p['R']} rounds each, shared system prompt "
                f"S={p['S']} tokens, each user's document H={p['H']}, questions Q={p['Q']}, answers A={p['A']} "
                f"tokens; rates {', '.join(f'{r:g}' for r in w.levels)} req/s, swept until saturation")
    if w.name == "groups":
        return (f"groups: G={p['G']} groups x P={p['P']} prompts, group prefix L={p['L']} tokens, question "
                f"Q={p['Q']}, answers A={p['A']}; rates {', '.join(f'{r:g}' for r in w.levels)} req/s")
    return (f"hotspot: {p['n']} requests, one system prompt S={p['S']} tokens, unique user messages "
            f"U={p['U']} tokens, answers A={p['A']}; rates {', '.join(f'{r:g}' for r in w.levels)} req/s")


# --- prompts -----------------------------------------------------------------------------------------

WORDS = ("the image shows a small red house near river under grey sky with trees and people walking "
         "along old stone bridge while children play in park beside market full of fruit and bread").split()


def text(tokens: int, rng: random.Random, head: str = "") -> str:
    """About `tokens` tokens of text (4 characters each) from rng, opening with head."""
    out, n = [head], len(head)
    while n < tokens * CHARS_PER_TOKEN:
        w = rng.choice(WORDS) + " "
        out.append(w)
        n += len(w)
    return "".join(out)[:tokens * CHARS_PER_TOKEN]


@dataclass
class Request:
    """One request of a workload: who sends it, what its prompt shares, and what it needs before it."""

    conv: str                       # conversation or group: the oracle's key, the stick's key
    shared_chars: int               # the leading characters of the system prompt everyone shares
    messages: list[dict]            # for chat: the fixed part; the history is added when it is sent
    max_tokens: int
    after: int | None = None        # chat: the index of the previous round (its answer goes in first)
    question: str = ""
    sent_messages: list[dict] = field(default_factory=list)


def build(w: Workload, rate: float, nonce: str, seed: int) -> list[Request]:
    """The requests of one level, in arrival order; every prompt opens with the run's nonce."""
    rng = random.Random(seed)
    p = w.params
    if w.name == "chat":
        users = max(1, round(rate * p["D"] / p["R"]))
        system = text(p["S"], rng, f"[{nonce}] You are a careful assistant. ")
        docs = [text(p["H"], rng, f"User {u} document: ") for u in range(users)]
        reqs, last = [], {}
        turns = []   # round r's users in an order of their own (a fixed rotation would let round robin
        for r in range(p["R"]):   # send each user to the same backend every round by chance)
            order = list(range(users))
            rng.shuffle(order)
            turns += [(u, r) for u in order]
        for i, (u, r) in enumerate(turns):
            reqs.append(Request(f"user{u}", len(system), [{"role": "system", "content": system},
                                                          {"role": "user", "content": docs[u]}],
                                p["A"], after=last.get(u), question=text(p["Q"], rng, f"Round {r + 1}: ")))
            last[u] = i
        return reqs
    if w.name == "groups":
        prefixes = [text(p["L"], rng, f"[{nonce}] Group {g} context: ") for g in range(p["G"])]
        order = [g for g in range(p["G"]) for _ in range(p["P"])]
        rng.shuffle(order)
        return [Request(f"group{g}", 0, [{"role": "system", "content": prefixes[g]},
                                          {"role": "user", "content": text(p["Q"], rng, f"Q{i}: ")}], p["A"])
                for i, g in enumerate(order)]
    system = text(p["S"], rng, f"[{nonce}] You are a careful assistant. ")
    return [Request(f"req{i}", len(system), [{"role": "system", "content": system},
                                             {"role": "user", "content": text(p["U"], rng, f"Message {i}: ")}],
                    p["A"]) for i in range(p["n"])]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --- the oracle ------------------------------------------------------------------------------------

def sim_tokens(messages: list[dict]) -> list[str]:
    """The prompt as the sim tokenizes it: ChatML, each message `<|im_start|>`, role, newline, its text
    in 4-character tokens, `<|im_end|>`; then the generation prompt."""
    out: list[str] = []
    for m in messages:
        c = m["content"]
        out += ["<|im_start|>", m["role"], "\n", *(c[i:i + CHARS_PER_TOKEN] for i in range(0, len(c), CHARS_PER_TOKEN)),
                "<|im_end|>"]
    return out + ["<|im_start|>", "assistant", "\n"]


def block_hashes(tokens: list[str]) -> list[int]:
    out, h = [], 0
    for at in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[at:at + BLOCK])))
        out.append(h)
    return out


def oracle(reqs: list[Request], order: list[int]) -> tuple[int, int]:
    """(cacheable tokens, prompt tokens): per request, the leading whole blocks an earlier-sent request of
    its conversation or group had sent, or the shared system prompt's blocks once anyone sent them (at
    least one token is always computed, as in vLLM)."""
    seen: dict[str, set[int]] = {}
    shared: set[int] = set()
    hit = total = 0
    for i in order:
        r = reqs[i]
        toks = sim_tokens(r.sent_messages)
        blocks = block_hashes(toks)
        mine = seen.setdefault(r.conv, set())
        n = 0
        for h in blocks:
            if h not in mine and h not in shared:
                break
            n += 1
        hit += min(n * BLOCK, (len(toks) - 1) // BLOCK * BLOCK)
        total += len(toks)
        mine.update(blocks)
        shared_tokens = 3 + r.shared_chars // CHARS_PER_TOKEN   # the system message's leading blocks
        shared.update(blocks[:shared_tokens // BLOCK])
    return hit, total


# --- driving a front -------------------------------------------------------------------------------

async def run_level(url, reqs: list[Request], times: list[float], timeout_s: float, usage: bool = False) -> list[dict]:
    """Send reqs at their arrival times (chat: not before the previous round's answer); per request:
    sent, first content, done (s from start), ok, backend (X-Backend), answer text. url: the front's, or a
    function of the time sent (s from start) that gives it (a client moving to another front). usage: ask
    for the usage chunk and record its prompt_tokens and cached_tokens."""
    import aiohttp
    out: list[dict] = [{} for _ in reqs]
    done = [asyncio.Event() for _ in reqs]
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def one(i: int):
            r = reqs[i]
            delay = t0 + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            messages = list(r.messages)
            if r.after is not None:
                await done[r.after].wait()
                messages = list(reqs[r.after].sent_messages) + [
                    {"role": "assistant", "content": out[r.after].get("answer") or "(no answer)"}]
            if r.question:
                messages.append({"role": "user", "content": r.question})
            r.sent_messages = messages
            body = {"model": "m", "messages": messages, "max_tokens": r.max_tokens, "stream": True}
            if usage:
                body["stream_options"] = {"include_usage": True}
            rec = out[i]
            rec["sent"] = time.perf_counter() - t0
            parts: list[str] = []
            try:
                front = url(rec["sent"]) if callable(url) else url
                async with session.post(front + "/v1/chat/completions", json=body) as resp:
                    rec["backend"] = resp.headers.get("X-Backend")
                    if resp.status != 200:
                        rec["error"] = f"{resp.status}"
                        await resp.read()
                    else:
                        async for line in resp.content:
                            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                                continue
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                rec["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
                                rec["cached_tokens"] = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                                    "cached_tokens")
                            choices = chunk.get("choices") or [{}]
                            piece = (choices[0].get("delta") or {}).get("content")
                            if piece:
                                if "first" not in rec:
                                    rec["first"] = time.perf_counter() - t0
                                parts.append(piece)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                rec["error"] = type(e).__name__
            rec["done"] = time.perf_counter() - t0
            rec["answer"] = "".join(parts)
            rec["ok"] = "error" not in rec and "first" in rec
            done[i].set()
        await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return out


def scrape(ports: list[int]) -> list[dict]:
    """Per sim: prefix-cache queries and hits (tokens, summed over label sets) and requests answered."""
    import urllib.request
    out = []
    for p in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10) as r:
            body = r.read().decode()
        m = {}
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)$", body, re.M)
            m[name] = sum(map(float, values)) if values else None
        with urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats", timeout=10) as r:
            m["requests"] = json.loads(r.read())["requests_total"]
        out.append(m)
    return out


def decisions(url: str) -> dict[str, float]:
    """The proxy's proxy_route_decisions_total by decision ({} for another front)."""
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            body = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for kind, value in re.findall(r'^proxy_route_decisions_total{[^}]*decision="(\w+)"[^}]*}\s+([0-9.eE+-]+)$', body, re.M):
        out[kind] = out.get(kind, 0.0) + float(value)
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(stack: Stack, front: str, w: Workload, rate: float, level_i: int, seed: int, bound: float) -> dict:
    nonce = f"{w.name}-{level_i}-{front}-{random.randrange(1 << 30):x}"
    reqs = build(w, rate, nonce, seed + level_i)
    times = arrivals(len(reqs), rate, seed + 1000 + level_i)
    before, d0 = scrape(stack.backend_ports), decisions(stack.url(front))
    recs = asyncio.run(run_level(stack.url(front), reqs, times, timeout_s=300))
    after, d1 = scrape(stack.backend_ports), decisions(stack.url(front))
    routed = {k: d1[k] - d0.get(k, 0) for k in d1}
    override = routed.get("override", 0) / sum(routed.values()) if sum(routed.values()) else None
    ok = [r for r in recs if r.get("ok")]
    ttft = [r["first"] - r["sent"] for r in ok]
    e2e = [r["done"] - r["sent"] for r in ok]
    span = (max(r["done"] for r in ok) - min(r["sent"] for r in recs)) if ok else float("nan")
    sends = max(r["sent"] for r in recs) - min(r["sent"] for r in recs)
    pace = min(1.0, (times[-1] - times[0]) / sends) if sends > 0 else 1.0
    per_sim = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    q_key, h_key = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
    if all(a[q_key] is not None for a in after):
        queries = sum(a[q_key] - (b[q_key] or 0) for a, b in zip(after, before))
        hits = sum(a[h_key] - (b[h_key] or 0) for a, b in zip(after, before))
        hit_rate = hits / queries if queries else float("nan")
    else:
        hit_rate = None
    sent_order = sorted(range(len(reqs)), key=lambda i: recs[i].get("sent", 0))
    o_hit, o_total = oracle(reqs, sent_order)
    stick = None
    if all(r.get("backend") for r in recs) and any(r.after is not None for r in reqs):
        pairs = [(recs[i]["backend"], recs[r.after]["backend"]) for i, r in enumerate(reqs) if r.after is not None]
        stick = sum(a == b for a, b in pairs) / len(pairs)
    return {"rate": rate, "requests": len(reqs), "users": len({r.conv for r in reqs}) if w.name == "chat" else None,
            "ok": len(ok), "failed": len(recs) - len(ok),
            "errors": sorted({r["error"] for r in recs if "error" in r}),
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "e2e_p50": pct(e2e, 0.5), "e2e_p99": pct(e2e, 0.99),
            "throughput": len(ok) / span if span == span and span > 0 else 0.0, "pace": pace,
            "slo": sum(t <= bound for t in ttft) / span if span == span and span > 0 else 0.0,
            "override": override,
            "hit_rate": hit_rate, "oracle": o_hit / o_total if o_total else float("nan"),
            "per_sim": per_sim, "spread": max(per_sim) / min(per_sim) if min(per_sim) > 0 else float("inf"),
            "stick": stick}


# --- the run -------------------------------------------------------------------------------------

def sim_flags() -> list[str]:
    """The engine model's flags this sim has (a sim without a prefix cache gets the rest; said so)."""
    helptext = subprocess.run([sys.executable, "-m", "fleet.sim", "serve", "--help"], cwd=ROOT,
                              capture_output=True, text=True).stdout
    flags = []
    for key, value in SIM.items():
        flag = ("--sim-" if key != "max_model_len" else "--") + key.replace("_", "-")
        if flag in helptext:
            flags += [flag, str(value)]
        else:
            print(f"bench_routing: this sim has no {flag}; its figures do not model a prefix cache", file=sys.stderr)
    # Every instance the fleet deploys answers usage.prompt_tokens_details.cached_tokens (render.py), which
    # the prefix policy learns from; the sims here do the same.
    return flags + ["--sim-output-tokens", "1000", "--enable-prompt-tokens-details"]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 2-minute smoke run: one level a workload, fewer requests")
    ap.add_argument("--fronts", default=DEFAULT_FRONTS, help=f"comma separated (default {DEFAULT_FRONTS})")
    ap.add_argument("--workloads", default="chat,groups,hotspot")
    ap.add_argument("--bound-s", type=float, default=2.5, help="the TTFT p99 bound of goodput and of the sweep")
    ap.add_argument("--routing", action="append", default=[], metavar="KEY=VALUE",
                    help="a proxy.routing key for proxy-prefix (min_match_tokens=128, ...); repeatable")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="inventory_set",
                    help="an inventory key for every proxy front (proxy.queue.headroom=1, ...); repeatable")
    ap.add_argument("--rates", help="the levels (requests/s, comma separated) instead of each workload's own")
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--baseline", help="another checkout (the code before a change) whose proxy runs the prefix "
                                       "config as front proxy-prefix-base, in the same run")
    ap.add_argument("--out", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    ws = workloads(args.quick)
    chosen = [ws[n] for n in args.workloads.split(",")]
    if args.rates:
        for w in chosen:
            w.levels = [float(r) for r in args.rates.split(",")]
    flags = sim_flags()
    started = time.monotonic()
    figures: dict = {"argv": sys.argv[1:], "cpus": os.cpu_count(), "load_before": loadavg(), "sim": SIM,
                     "bound_s": args.bound_s, "workloads": {}}
    print(f"{BACKENDS} sims x max_num_seqs {MAX_NUM_SEQS}; sim {' '.join(flags)}; TTFT p99 bound {args.bound_s:g} s; "
          f"{os.cpu_count()} CPUs, load average {figures['load_before']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        stack = Stack(Path(tmp), BACKENDS, MAX_NUM_SEQS, flags,
                      proxy_set=("proxy.routing.policy=least_conn", *args.inventory_set),
                      routing_set=tuple(f"proxy.routing.{kv}" for kv in args.routing),
                      baseline=Path(args.baseline).resolve() if args.baseline else None)
        try:
            fronts = stack.start(args.fronts.split(","))
            figures["skipped"] = stack.skipped
            figures["routing"] = stack.routing
            print(f"proxy-prefix routing: {stack.routing}", flush=True)
            for w in chosen:
                print(describe(w), flush=True)
                runs: dict = {}
                active = list(fronts)
                for li, rate in enumerate(w.levels):
                    order = active[li % len(active):] + active[:li % len(active)] if active else []
                    for front in order:
                        m = measure(stack, front, w, rate, li, args.seed, args.bound_s)
                        runs.setdefault(front, []).append(m)
                        print("  " + row(front, m), flush=True)
                    if w.sweep:
                        active = [f for f in active if held(runs[f][-1], args.bound_s)]
                figures["workloads"][w.name] = {"params": w.params, "levels": w.levels, "describe": describe(w),
                                                "runs": runs}
        finally:
            stack.stop()
    figures["load_after"] = loadavg()
    figures["seconds"] = time.monotonic() - started
    report(figures, args.bound_s)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


HEAD = (f"{'front':<25}{'rate':>5}{'reqs':>5}{'TTFT p50':>9}{'p99':>7}{'e2e p50':>8}{'p99':>7}{'pace':>5}{'thr':>6}"
        f"{'hit':>6}{'oracle':>7}{'max/min':>8}{'stick':>6}{'ovr':>5}{'fail':>5}")


def _f(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def row(front: str, m: dict) -> str:
    return (f"{FRONT_NAMES.get(front, front):<25}{m['rate']:>5g}{m['requests']:>5}{m['ttft_p50']:>9.2f}{m['ttft_p99']:>7.2f}"
            f"{m['e2e_p50']:>8.2f}{m['e2e_p99']:>7.2f}{m['pace']:>5.2f}{m['throughput']:>6.1f}{_f(m['hit_rate'], '.2f'):>6}"
            f"{m['oracle']:>7.2f}{m['spread']:>8.2f}{_f(m['stick'], '.2f'):>6}{_f(m.get('override'), '.2f'):>5}"
            f"{m['failed']:>5}")


def held(m: dict, bound: float) -> bool:
    """A level the front held: TTFT p99 under the bound, the offered pace kept (90%), nothing failed."""
    return m["ttft_p99"] <= bound and m["pace"] >= 0.9 and not m["failed"]


def goodput(runs: list[dict], bound: float) -> float:
    """The highest rate (requests/s) the front held; 0 when none."""
    good = [m["rate"] for m in runs if held(m, bound)]
    return max(good) if good else 0.0


def report(f: dict, bound: float) -> None:
    print(f"\n{f['seconds']:.0f} s; load average {f['load_before']} before, {f['load_after']} after; "
          f"TTFT p99 bound {bound:g} s (seconds; thr in answers/s, goodput in requests/s; hit: the engines' prefix-cache "
          "hit rate; oracle: the best with unbounded caches; max/min: requests per backend)")
    if f.get("skipped"):
        print("left out: " + "; ".join(f"{k}: {v}" for k, v in f["skipped"].items()))
    f["summary"] = {}
    for name, wf in f["workloads"].items():
        print(f"\n{wf['describe']}\n  {HEAD}")
        for front, runs in wf["runs"].items():
            for m in runs:
                print("  " + row(front, m))
        # The reference level: the highest that proxy least_conn held under the bound (else the first).
        lc = wf["runs"].get("proxy", [])
        ok_lc = [m for m in lc if held(m, bound)]
        ref = (ok_lc[-1] if ok_lc else lc[0])["rate"] if lc else wf["levels"][0]
        print(f"  at {ref:g} req/s (the highest rate proxy least_conn held under the bound), and goodput:")
        print(f"  {'front':<25}{'TTFT p50':>9}{'p99':>7}{'e2e p50':>8}{'p99':>7}{'hit':>6}{'oracle':>7}"
              f"{'hit/oracle':>11}{'max/min':>8}{'goodput':>8}{'slo':>6}")
        summary = {}
        for front, runs in wf["runs"].items():
            m = next((m for m in runs if m["rate"] == ref), None)
            g = goodput(runs, bound)
            slo = max(r["slo"] for r in runs)
            if m is None:
                continue
            ratio = m["hit_rate"] / m["oracle"] if m["hit_rate"] is not None and m["oracle"] else None
            summary[front] = {**{k: m[k] for k in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "hit_rate",
                                                  "oracle", "spread", "stick")},
                              "hit_over_oracle": ratio, "goodput": g, "slo": slo, "rate": ref}
            print(f"  {FRONT_NAMES.get(front, front):<25}{m['ttft_p50']:>9.2f}{m['ttft_p99']:>7.2f}{m['e2e_p50']:>8.2f}"
                  f"{m['e2e_p99']:>7.2f}{_f(m['hit_rate'], '.2f'):>6}{m['oracle']:>7.2f}{_f(ratio, '.2f'):>11}"
                  f"{m['spread']:>8.2f}{g:>8g}{slo:>6.1f}")
        f["summary"][name] = summary
        targets(name, summary)


def targets(name: str, s: dict) -> None:
    """The issue's targets for the prefix policy, met or missed by how much."""
    p, lc = s.get("proxy-prefix"), s.get("proxy")
    if not p or not lc:
        return
    lines = []

    def check(label: str, value, limit, le: bool = True):
        if value is None or limit is None:
            lines.append(f"{label}: n/a")
            return
        met = value <= limit if le else value >= limit
        lines.append(f"{label}: {value:.2f} {'<=' if le else '>='} {limit:.2f} {'met' if met else 'MISSED'}")
    if name == "chat":
        check("TTFT p50 / least_conn's (at most 0.5)", p["ttft_p50"] / lc["ttft_p50"], 0.5)
        check("goodput / least_conn's (at least 1.3)", p["goodput"] / lc["goodput"] if lc["goodput"] else None, 1.3, le=False)
        check("slo goodput / least_conn's (at least 1.3)", p["slo"] / lc["slo"] if lc["slo"] else None, 1.3, le=False)
        for other in ("vllm-router-cache", "smg-cache"):
            if other in s:
                check(f"TTFT p50 against {FRONT_NAMES[other]} (at most)", p["ttft_p50"], s[other]["ttft_p50"])
                check(f"TTFT p99 against {FRONT_NAMES[other]} (at most)", p["ttft_p99"], s[other]["ttft_p99"])
    if name == "hotspot":
        check("max/min requests per backend (at most 1.25)", p["spread"], 1.25)
        check("TTFT p99 against least_conn's (at most)", p["ttft_p99"], lc["ttft_p99"])
    check("engines' hit rate / oracle (at least 0.8)", p["hit_over_oracle"], 0.8, le=False)
    print("  targets, proxy prefix: " + "; ".join(lines))


if __name__ == "__main__":
    sys.exit(main())
