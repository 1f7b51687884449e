"""Routing on real traffic: a production trace replayed open loop against sims behind every front.

    .venv/bin/python bench/bench_trace.py [TRACE.jsonl] [--speed 6] [--minutes 10] [--requests N]
                                          [--fronts proxy-prefix,proxy,...] [--ttft-slo 2] [--out FILE.json]
    .venv/bin/python bench/bench_trace.py --lockstep [--fronts proxy-prefix,proxy]

A trace is Mooncake's format (../shared/traces/README.md): one JSON object a line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids`, the prompt as 512-token blocks named by ids. Each id
becomes a fixed text of 2,048 characters (512 of the sim's 4-character tokens), so two prompts that share
their leading ids share their leading text: the proxy's 64-byte blocks hash alike (proxy/routing/prefix.py)
and the sims' 16-token blocks chain alike (fleet/sim/prefix_cache.py). A prompt is its ids' text cut to
`input_length` tokens (less the chat template's), sent as one user message at `timestamp` / speed whether
or not earlier answers came back (open loop), with max_tokens min(output_length, 64).

Fresh sims per front (8 x 8 slots, 640,000 tokens of KV each, prefill 60 ms per 1,000 uncached tokens,
20 ms a token; one step budget of --budget tokens shared by what runs: fleet/sim/step.py), so every front starts cold. Per front: the
engines' hit rate (their prefix-cache counters), the oracle's (the same ids through one LRU cache the size
of the whole fleet's KV: what an ideal router could find), TTFT p50/p90/p99, inter-token latency p99,
goodput (answers a second whose TTFT was within --ttft-slo, and their share), failures; for the proxy, its
routing decisions, its prediction (match_tokens against the engines' cached_tokens, from its results
log) and where the oracle's hits went (per route, and `sent from its holder`: a request sent away from the
backend whose cache held more of it). Every process it starts is stopped by pid.

--lockstep: the routing-truth check's workload (tests/test_proxy_prefix.py): 2 sims of 4 slots whose KV
caches (400 blocks) are too small for 12 conversations of 4 rounds sent in lockstep; prints the share of
prompt tokens the engines found cached and the prediction's error. Each request carries `X-Request-Id`
c<conversation>-r<round>, so a proxy's results log tells where each round went and what it found.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_routing import decisions, loadavg, pct  # noqa: E402
from stack import ROOT, Stack  # noqa: E402

# ../shared/traces beside the main checkout (ROOT.parent), or beside the worktrees' folder (wt/NAME)
TRACES = next((d for d in (ROOT.parent / "shared" / "traces", ROOT.parent.parent / "shared" / "traces")
               if d.is_dir()), ROOT.parent / "shared" / "traces")
DEFAULT_TRACE = TRACES / "mooncake_conversation_0-30min.jsonl"
ID_TOKENS, CHARS_PER_TOKEN = 512, 4          # a trace block; the sim's tokenizer
TEMPLATE_TOKENS = 7                          # ChatML around one user message and the generation prompt
BACKENDS, MAX_NUM_SEQS, KV_TOKENS = 8, 8, 640_000
ANSWER_CAP = 64
FRONT_NAMES = {"proxy-prefix": "proxy prefix", "proxy-prefix-base": "proxy prefix, baseline", "proxy": "proxy least_conn",
               "vllm-router-cache": "vllm-router cache_aware", "vllm-router-random": "vllm-router random",
               "smg-cache": "smg cache_aware"}
DEFAULT_FRONTS = ",".join(f for f in FRONT_NAMES if f != "proxy-prefix-base")
# The proxy fronts' prompt bound: the synthetic trace's longest prompt is 191,374 tokens (765 KB of text).
PROXY_SET = ("proxy.routing.policy=least_conn", "proxy.limits.max_prompt_blocks=16384")


@dataclass
class Request:
    """One trace line: when it arrives (s from the trace's start), its blocks, its lengths."""

    at: float
    ids: list[int]
    input_length: int
    output_length: int


def load(path: Path, minutes: float | None, limit: int | None) -> list[Request]:
    """The trace's requests in arrival order: the first `minutes` of it, at most `limit` of them."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            at = r["timestamp"] / 1000
            if minutes is not None and at >= minutes * 60:
                break
            out.append(Request(at, list(r["hash_ids"]), int(r["input_length"]), int(r["output_length"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def block_text(block_id: int) -> str:
    """Block id's fixed text: 2,048 characters (512 tokens) no other id's text shares a 16-token block with."""
    return hashlib.shake_256(f"trace-block-{block_id}".encode()).hexdigest(ID_TOKENS * CHARS_PER_TOKEN // 2)


def prompt_text(r: Request, texts: dict[int, str]) -> str:
    """The request's user message: its ids' texts, cut so the templated prompt is input_length tokens."""
    chars = max(1, r.input_length - TEMPLATE_TOKENS) * CHARS_PER_TOKEN
    parts, n = [], 0
    for i in r.ids:
        if n >= chars:
            break
        t = texts.get(i)
        if t is None:
            t = texts[i] = block_text(i)
        parts.append(t)
        n += len(t)
    return "".join(parts)[:chars]


def oracle(reqs: list[Request], capacity_tokens: int) -> float:
    """The share of prompt tokens an ideal router finds cached: every request's ids through one LRU cache
    of capacity_tokens (the whole fleet's KV), each request's leading run of ids found counted."""
    hits = oracle_hits(reqs, capacity_tokens)
    total = sum(r.input_length for r in reqs)
    return sum(hits) / total if total else float("nan")


def leading_run(r: Request, cache) -> int:
    """The prompt tokens of r's leading ids that cache holds (its leading run of ids, at most the prompt)."""
    run = 0
    for i in r.ids:
        if i not in cache:
            break
        run += 1
    return min(run * ID_TOKENS, r.input_length)


def _use(lru: OrderedDict[int, None], r: Request, cap: int) -> None:
    """r's ids become lru's most recent; the least recent beyond cap ids leave."""
    for i in r.ids:
        lru[i] = None
        lru.move_to_end(i)
    while len(lru) > cap:
        lru.popitem(last=False)


def oracle_hits(reqs: list[Request], capacity_tokens: int) -> list[int]:
    """Per request, the prompt tokens the oracle's one LRU cache (capacity_tokens) holds when it comes."""
    lru: OrderedDict[int, None] = OrderedDict()
    cap = max(1, capacity_tokens // ID_TOKENS)
    hits = []
    for r in reqs:
        hits.append(leading_run(r, lru))
        _use(lru, r, cap)
    return hits


def losses(reqs: list[Request], recs: list[dict], log: list[dict], capacity_tokens: int,
           per_request: list[dict] | None = None) -> dict:
    """Where the oracle's hits went, for a proxy front: per route decision, the prompt tokens the oracle
    found cached that the engine did not (each request's shortfall, none below 0), and per `overruled`
    (what the prediction overruled to keep it on its holder: it missed all the same); of the `prefix` ones,
    the part the proxy predicted and the engine had evicted (eviction the index did not see); and of all,
    the part another backend held (`sent from its holder`) and the part no backend held any more, only the
    oracle's one pooled cache (`in no engine`), by held(); as shares of all prompt tokens. per_request:
    a list that gets each judged request's figures and decision (--out's `per_request`)."""
    by_id = {e.get("request_id"): e for e in log}
    total = sum(r.input_length for r in reqs) or 1
    out: dict[str, float] = {}

    def add(key: str, tokens: int) -> None:
        out[key] = out.get(key, 0) + tokens / total
    for r, rec, o, (best, mine, holder) in zip(reqs, recs, oracle_hits(reqs, capacity_tokens),
                                               held(reqs, recs, capacity_tokens // BACKENDS)):
        e = by_id.get(rec.get("id"))
        if e is None or not isinstance(e.get("cached_tokens"), int):
            continue
        if per_request is not None:
            per_request.append({"id": rec.get("id"), "sent": rec.get("sent"), "done": rec.get("done"), "ttft": rec.get("first", 0) - rec["sent"]
                                if "first" in rec else None, "prompt": r.input_length, "backend": rec.get("backend"),
                                "holder": holder, "best": best, "mine": mine, "oracle": o,
                                **{k: e.get(k) for k in ("route", "overruled", "match_tokens", "cached_tokens",
                                                         "queued_ms")}})
        missed = max(0, o - e["cached_tokens"])
        add(e.get("route", "?"), missed)
        if e.get("overruled"):
            add(f"overruled {e['overruled']}", missed)
        if e.get("route") == "prefix":
            add("unseen eviction", max(0, e["match_tokens"] - e["cached_tokens"]))
        add("sent from its holder", min(missed, best - mine))
        add("in no engine", min(missed, max(0, o - best)))
    return out


def held(reqs: list[Request], recs: list[dict], kv_tokens: int) -> list[tuple[int, int, str | None]]:
    """Per request, the prompt tokens held by the backend that held the most of it and by the one it went
    to (X-Backend), and the first's name: each backend's ids through an LRU of kv_tokens, in the order the
    requests were sent (the engines' caches, as far as ids tell). The difference is what routing gave away
    by sending it from the holder of its longest prefix."""
    cap = max(1, kv_tokens // ID_TOKENS)
    lrus: dict[str, OrderedDict[int, None]] = {}
    out: list[tuple[int, int, str | None]] = [(0, 0, None)] * len(reqs)
    for i in sorted(range(len(reqs)), key=lambda i: recs[i].get("sent", float("inf"))):
        r, name = reqs[i], recs[i].get("backend")
        if name is None:
            continue
        mine = lrus.setdefault(name, OrderedDict())
        holder = max(lrus, key=lambda n: (leading_run(r, lrus[n]), n == name))
        out[i] = (leading_run(r, lrus[holder]), leading_run(r, mine), holder)
        _use(mine, r, cap)
    return out


# --- driving a front ---------------------------------------------------------------------------------

async def replay(url: str, reqs: list[Request], speed: float, drain_s: float) -> list[dict]:
    """Send every request at its arrival time / speed (open loop), streamed, usage asked; per request:
    sent, first (first content), gaps (between content chunks), done, ok, prompt and cached tokens,
    backend. Requests still running drain_s after the last send are cancelled and count as failed."""
    import aiohttp
    texts: dict[int, str] = {}
    out: list[dict] = [{} for _ in reqs]
    t0 = time.perf_counter() + 0.5

    async def one(i: int, session) -> None:
        r, rec = reqs[i], out[i]
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt_text(r, texts)}],
                           "max_tokens": max(1, min(r.output_length, ANSWER_CAP)), "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        delay = t0 + r.at / speed - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec["id"] = f"trace-{i}"
        rec["sent"] = time.perf_counter() - t0
        rec["late"] = rec["sent"] - r.at / speed
        gaps, last = [], None
        try:
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json", "X-Request-Id": rec["id"]}) as resp:
                rec["backend"] = resp.headers.get("X-Backend")
                if resp.status != 200:
                    rec["error"] = str(resp.status)
                    await resp.read()
                    return
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage")
                    if usage:
                        rec["prompt_tokens"] = usage.get("prompt_tokens")
                        rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    choices = chunk.get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        now = time.perf_counter() - t0
                        if last is None:
                            rec["first"] = now
                        else:
                            gaps.append(now - last)
                        last = now
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            rec["error"] = type(e).__name__
        except asyncio.CancelledError:
            rec["error"] = "drain timeout"
        finally:
            rec["gaps"] = gaps
            rec["done"] = time.perf_counter() - t0
            rec["ok"] = "error" not in rec and "first" in rec

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)) as session:
        tasks = [asyncio.ensure_future(one(i, session)) for i in range(len(reqs))]
        end = (reqs[-1].at / speed if reqs else 0) + drain_s
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, t0 + end - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return out


def results_log(stack: Stack, front: str) -> list[dict]:
    """A proxy front's results-log lines ([] for another front)."""
    path = stack.deploy / "logs" / f"req_results_{front}.log"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def engines_hit_rate(stats: list[dict]) -> float:
    q = sum(s["prefix_cache"]["queries_tokens"] for s in stats)
    return sum(s["prefix_cache"]["hits_tokens"] for s in stats) / q if q else float("nan")


def figures(recs: list[dict], stats: list[dict], log: list[dict], routed: dict, slo: float) -> dict:
    """One front's figures from its requests' records, its sims' stats and its results log."""
    ok = [r for r in recs if r.get("ok")]
    ttft = [r["first"] - r["sent"] for r in ok]
    gaps = [g for r in ok for g in r["gaps"]]
    sent = [r["sent"] for r in recs if "sent" in r]
    span = (max(r["done"] for r in ok) - min(sent)) if ok and sent else float("nan")
    good = sum(t <= slo for t in ttft)
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    judged = [e for e in log if isinstance(e.get("cached_tokens"), int) and "match_tokens" in e]
    judged_prompt = sum(e.get("prompt_tokens") or 0 for e in judged)
    return {"requests": len(recs), "ok": len(ok), "failed": len(recs) - len(ok),
            "errors": sorted({r["error"] for r in recs if "error" in r}),
            "hit_rate": engines_hit_rate(stats), "usage_hit_rate": cached / prompt if prompt else float("nan"),
            "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9), "ttft_p99": pct(ttft, 0.99),
            "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99),
            "goodput": good / span if span == span and span > 0 else 0.0, "good_share": good / len(recs) if recs else 0.0,
            "late_p99": pct([r["late"] for r in recs if "late" in r], 0.99),
            "per_sim": [s["requests_total"] for s in stats], "routed": routed,
            "predicted": sum(e["match_tokens"] for e in judged), "engine_cached": sum(e["cached_tokens"] for e in judged),
            "prediction_error": (sum(abs(e["match_tokens"] - e["cached_tokens"]) for e in judged) / judged_prompt
                                 if judged_prompt else None)}


def sim_flags(kv_tokens: int, max_model_len: int, budget: int, extra: list[str]) -> list[str]:
    """The sims' engine model: the issue's timing, the step's budget (0: each prefill paid on its own)."""
    return ["--sim-prefill-ms", "60", "--sim-token-ms", "20", "--max-num-batched-tokens", str(budget),
            "--sim-kv-blocks", str(kv_tokens // 16), "--max-model-len", str(max_model_len),
            "--sim-output-tokens", "1000", "--enable-prompt-tokens-details", *extra]


def run_front(front: str, reqs: list[Request], args, work: Path) -> dict | None:
    """Fresh sims and one front over them; the trace replayed; everything stopped. None: not installed."""
    longest = max(r.input_length for r in reqs) + ANSWER_CAP + 16
    flags = sim_flags(KV_TOKENS, max(32768, longest), args.budget, args.sim)
    (work / front).mkdir()
    stack = Stack(work / front, BACKENDS, MAX_NUM_SEQS, flags, proxy_set=(*PROXY_SET, *args.inventory_set),
                  routing_set=tuple(f"proxy.routing.{kv}" for kv in args.routing),
                  baseline=Path(args.baseline).resolve() if args.baseline else None)
    try:
        if not stack.start([front]):
            return None
        d0 = decisions(stack.url(front))
        recs = asyncio.run(replay(stack.url(front), reqs, args.speed, args.drain_s))
        d1 = decisions(stack.url(front))
        stats = stack.sim_stats()
        routed = {k: d1[k] - d0.get(k, 0) for k in d1}
        log = results_log(stack, front)
        per_request: list[dict] = []
        return {**figures(recs, stats, log, routed, args.ttft_slo),
                "losses": losses(reqs, recs, log, BACKENDS * KV_TOKENS, per_request) if log else {},
                "per_request": per_request}
    finally:
        stack.stop()


# --- the lockstep overflow case ------------------------------------------------------------------------

LOCKSTEP = {"backends": 2, "slots": 4, "kv_blocks": 400, "max_model_len": 4096, "conversations": 12,
            "rounds": 4, "max_tokens": 60}


def document(c: int) -> str:
    """Conversation c's own ~1,300-token document (unlike any other's from its start)."""
    return " ".join(f"doc{c}-line{i}: the river {c} passes mill {i} before the bridge." for i in range(90))


def lockstep(url: str, conversations: int, rounds: int, max_tokens: int) -> list[dict]:
    """conversations of `rounds` rounds, every conversation's round n before any round n+1, all of a
    round at once; returns each answer's usage."""
    import urllib.request
    histories = [[{"role": "user", "content": document(c) + " What does the river pass first?"}]
                 for c in range(conversations)]
    usages: list[dict] = []

    def ask(messages: list[dict]) -> dict:
        body = json.dumps({"model": "m", "max_tokens": max_tokens, "messages": messages}).encode()
        c, n = histories.index(messages), len(messages) // 2     # named in the results log: c<conversation>-r<round>
        req = urllib.request.Request(url + "/v1/chat/completions", body, {
            "Content-Type": "application/json", "X-Request-Id": f"c{c}-r{n}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And after that?"}]
        return answer["usage"]
    with ThreadPoolExecutor(conversations) as pool:
        for _ in range(rounds):
            usages += pool.map(ask, histories)
    return usages


def run_lockstep(front: str, args, work: Path) -> dict | None:
    """The lockstep overflow case on fresh sims behind front: cached share and the prediction's error."""
    c = LOCKSTEP
    flags = ["--sim-prefill-ms", "20", "--sim-token-ms", "1", "--max-num-batched-tokens", str(args.budget),
             "--sim-kv-blocks", str(c["kv_blocks"]),
             "--max-model-len", str(c["max_model_len"]), "--enable-prompt-tokens-details", *args.sim]
    (work / front).mkdir()
    stack = Stack(work / front, c["backends"], c["slots"], flags, proxy_set=(*PROXY_SET, *args.inventory_set),
                  routing_set=tuple(f"proxy.routing.{kv}" for kv in args.routing),
                  baseline=Path(args.baseline).resolve() if args.baseline else None)
    try:
        if not stack.start([front]):
            return None
        usages = lockstep(stack.url(front), c["conversations"], c["rounds"], c["max_tokens"])
        log = [e for e in results_log(stack, front) if "match_tokens" in e]
        deadline = time.monotonic() + 10   # the results log is written as each answer settles
        while "proxy" in front and len(log) < len(usages) and time.monotonic() < deadline:
            time.sleep(0.1)
            log = [e for e in results_log(stack, front) if "match_tokens" in e]
    finally:
        stack.stop()
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages)
    judged = [e for e in log if isinstance(e.get("cached_tokens"), int)]
    return {"requests": len(usages), "prompt": prompt, "cached": cached, "cached_share": cached / prompt,
            "predicted": sum(e["match_tokens"] for e in judged) if judged else None,
            "prediction_error": (sum(abs(e["match_tokens"] - e["cached_tokens"]) for e in judged) / prompt
                                 if judged else None)}


# --- the run ------------------------------------------------------------------------------------------

def _f(v, fmt: str) -> str:
    return "n/a" if v is None or v != v else format(v, fmt)


HEAD = (f"{'front':<25}{'hit':>6}{'oracle':>7}{'hit/or':>7}{'TTFT p50':>9}{'p90':>7}{'p99':>7}{'ITL p99':>8}"
        f"{'goodput':>8}{'good':>6}{'fail':>5}{'pred err':>9}")


def row(front: str, m: dict, oracle_rate: float) -> str:
    return (f"{FRONT_NAMES.get(front, front):<25}{_f(m['hit_rate'], '.3f'):>6}{oracle_rate:>7.3f}"
            f"{_f(m['hit_rate'] / oracle_rate if oracle_rate else None, '.2f'):>7}{m['ttft_p50']:>9.2f}"
            f"{m['ttft_p90']:>7.2f}{m['ttft_p99']:>7.2f}{m['itl_p99']:>8.3f}{m['goodput']:>8.2f}"
            f"{m['good_share']:>6.2f}{m['failed']:>5}{_f(m['prediction_error'], '.3f'):>9}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), help=f"a trace file (default {DEFAULT_TRACE})")
    ap.add_argument("--speed", type=float, default=6.0, help="time compressed this many times (default 6)")
    ap.add_argument("--minutes", type=float, default=10.0, help="the trace's first minutes replayed (default 10)")
    ap.add_argument("--requests", type=int, help="at most this many requests (a quick run)")
    ap.add_argument("--fronts", help=f"comma separated (default {DEFAULT_FRONTS}; --lockstep: proxy-prefix,proxy)")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="goodput's TTFT bound in seconds (default 2)")
    ap.add_argument("--drain-s", type=float, default=180.0,
                    help="how long answers may take after the last send before they count as failed (default 180)")
    ap.add_argument("--budget", type=int, default=2048,
                    help="the sims' --max-num-batched-tokens: one token budget a step shared by what runs "
                         "(fleet/sim/step.py; default 2048, vLLM's serving default on CPU and A100s; 0: each "
                         "request's prefill paid on its own, the sims' older model)")
    ap.add_argument("--sim", action="append", default=[], metavar="FLAG",
                    help="one more sim flag for every sim (--sim=--max-num-batched-tokens=2048); repeatable")
    ap.add_argument("--routing", action="append", default=[], metavar="KEY=VALUE",
                    help="a proxy.routing key for proxy-prefix; repeatable")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="inventory_set",
                    help="an inventory key for every proxy front; repeatable")
    ap.add_argument("--baseline", help="another checkout (the code before a change) whose proxy runs the prefix config "
                                       "as front proxy-prefix-base, in the same run")
    ap.add_argument("--lockstep", action="store_true", help="the lockstep overflow case instead of a trace")
    ap.add_argument("--out", help="also write every figure to this JSON file (a proxy front's per_request: each "
                                  "request's figures, holder and routing decision, for finding where hits went)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    fronts = (args.fronts or ("proxy-prefix,proxy" if args.lockstep else DEFAULT_FRONTS)).split(",")
    unknown = [f for f in fronts if f not in Stack.FRONTS]
    if unknown:
        print(f"error: unknown front {', '.join(unknown)}; choose from {', '.join(Stack.FRONTS)}.", file=sys.stderr)
        return 2
    load_before = loadavg()
    out: dict = {"argv": sys.argv[1:], "cpus": os.cpu_count(), "load_before": load_before, "fronts": {}}
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as tmp:
        if args.lockstep:
            c = LOCKSTEP
            print(f"lockstep overflow: {c['backends']} sims x {c['slots']} slots, {c['kv_blocks']} KV blocks each; "
                  f"{c['conversations']} conversations x {c['rounds']} rounds in lockstep; "
                  f"{os.cpu_count()} CPUs, load average {load_before}", flush=True)
            for front in fronts:
                m = run_lockstep(front, args, Path(tmp))
                if m is None:
                    print(f"{front}: not installed, left out", flush=True)
                    continue
                out["fronts"][front] = m
                print(f"{FRONT_NAMES.get(front, front):<25} cached {m['cached']:>6} of {m['prompt']:>6} prompt tokens "
                      f"({m['cached_share']:.3f}); predicted {m['predicted']}, error "
                      f"{_f(m['prediction_error'], '.3f')} of prompt tokens", flush=True)
        else:
            path = Path(args.trace)
            if not path.is_file():
                print(f"error: no trace file {path}; give one of {TRACES}/*.jsonl.", file=sys.stderr)
                return 2
            reqs = load(path, args.minutes, args.requests)
            if not reqs:
                print(f"error: {path} has no requests in its first {args.minutes:g} minutes.", file=sys.stderr)
                return 2
            orc = oracle(reqs, BACKENDS * KV_TOKENS)
            out.update(trace=str(path), speed=args.speed, requests=len(reqs), oracle=orc, ttft_slo=args.ttft_slo)
            print(f"{path.name}: {len(reqs)} requests over {reqs[-1].at:.0f} s at {args.speed:g}x "
                  f"({reqs[-1].at / args.speed:.0f} s); {BACKENDS} sims x {MAX_NUM_SEQS} slots, {KV_TOKENS:,} tokens "
                  f"of KV each; sim {' '.join(sim_flags(KV_TOKENS, 0, args.budget, args.sim)[:8] + args.sim)}; oracle {orc:.3f}; "
                  f"{os.cpu_count()} CPUs, load average {load_before}", flush=True)
            print(HEAD, flush=True)
            for front in fronts:
                m = run_front(front, reqs, args, Path(tmp))
                if m is None:
                    print(f"{FRONT_NAMES.get(front, front):<25}not installed, left out (bench/setup_routers.sh)", flush=True)
                    continue
                out["fronts"][front] = m
                print(row(front, m, orc), flush=True)
    out["load_after"] = loadavg()
    out["seconds"] = time.monotonic() - started
    print(f"{out['seconds']:.0f} s; load average {load_before} before, {out['load_after']} after (seconds; hit: the "
          "engines' prefix-cache hit rate; oracle: one LRU the size of the fleet's KV; goodput: answers a second "
          f"within TTFT {args.ttft_slo:g} s, good: their share; pred err: |match - cached| over prompt tokens)")
    for front, m in out["fronts"].items():
        if m.get("routed"):
            total = sum(m["routed"].values()) or 1
            print(f"  {FRONT_NAMES.get(front, front)}: routes " + ", ".join(
                f"{k} {v / total:.2f}" for k, v in sorted(m["routed"].items())) + f"; per sim {m['per_sim']}")
        if m.get("losses"):
            print(f"  {FRONT_NAMES.get(front, front)}: the oracle's hits missed, by route (share of prompt tokens): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in sorted(m["losses"].items())))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
