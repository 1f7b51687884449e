"""What the aiohttp proxy costs next to nginx, the Rust routers and no front at all, measured side by side.

    .venv/bin/python bench/bench_proxy.py [--seconds 5] [--rounds 5] [--connections 64] [--backends 4]
                                          [--fronts direct,proxy,...] [--chat-only | --sse-only] [--prompt-chars N]
                                          [--out FILE.json]

Starts --backends sim engines in instant mode (no model time: every cost measured is the front's) and,
before them, the proxy (on uvloop, and again on asyncio's loop as `proxy-asyncio`) and nginx, both from
the files `inv render` makes for a local sim host, plus vllm-router and smg when bench/setup_routers.sh
installed them. Several backends, so that no front is capped by one sim's speed (with one, nginx was held
to that sim's pace and the proxy looked closer to it than it is). Each front is driven with wrk at
--connections on loopback with short chat completions, in interleaved rounds (direct, proxy, nginx, ...,
the order turned each round) so a noisy machine hurts all alike; the median round of each is reported with
the ratios. `direct` is wrk against the sims themselves, the connections split evenly over them (one wrk
each; its p99 is the worst of theirs). Then SSE: 1,000-chunk streams, direct, the proxy and those of proxy-base, proxy-w2,
proxy-w2-plain, nginx, vllm-router and smg started, interleaved, as ratios of the proxy's (and proxy-w2's) chunks/s to each, median
of the rounds' ratios, with the CPU per chunk relayed of every front (all its processes: proxy-w2's workers,
nginx's) and of the sims behind it: where they share the cores, a front's chunks/s is what its CPU per chunk
leaves the sims (--sse-only: these rounds alone). Then the
latency the proxy adds at a fixed rate below capacity (open loop), which is what a client feels on a
cluster that is not overloaded. Needs wrk (Debian package `wrk`); nginx is optional (`nginx` package).
Every process it starts is stopped by pid at the end.

Routing by model: `proxy-models` is the proxy in the models form with the sims split into two pools of
half the backends each, served names `m` and `m2`; `proxy-models-1` one pool of every sim (`m`, alias
`m2`). When either is among the fronts, every front (plain `proxy` too) is driven with the same mix: a
wrk Lua script whose `request()` alternates two pre-formatted requests, model `m` then `m2` (one wrk
process, so every front sees the same connections and the same client cost), every sim answering both
names; the report adds their requests/s, p50 and p99 as ratios to `proxy`, round by round.

Routing by prefix: `proxy-prefix` is the proxy with `proxy.routing.policy=prefix`; with --prompt-chars N
every request's message is N characters of text (the prefix policy hashes every 64 bytes of it; "hi"
has no whole block), and the report adds its requests/s, p50, p99 and CPU per request as ratios to
`proxy` (least_conn), round by round.

Tenants: `proxy-tenants` is the proxy with API keys naming two tenants (`app`, `batch`) and `proxy.tenants`
set; every front is sent `app`'s key (the others ignore it), so `--fronts proxy,proxy-tenants --chat-only`
gives the cost of tenants on (key lookup, buckets, the fair queue's bookkeeping) as ratios round by round.

Tracing: `proxy-otel` is the proxy exporting every request's spans (proxy.otlp) to a local sink that
discards them, `proxy-otel-down` the same with its collector down; `proxy-base` (with --baseline DIR, a checkout of the code before a change, such as the
main branch's worktree) is that checkout's proxy on the same config: `--fronts proxy,proxy-otel,proxy-base
--chat-only` gives export on against off, and off against before, as ratios round by round; without
--chat-only the open-loop latency run (below capacity: what a client feels) takes every one of them too.
CPU per request is the front's own process; a proxy's children (the span exporter, proxy/otlp_export.py)
are measured apart and reported beside it, and their sum as a ratio too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import Stack  # noqa: E402

CHAT = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
CHAT2 = {**CHAT, "model": "m2"}
MODELS_FRONTS = ("proxy-models", "proxy-models-1")
# Half the requests name `m`, half `m2`: two requests formatted once per wrk thread, taken in turn.
MIX_LUA = """wrk.method = 'POST'
wrk.headers['Content-Type'] = 'application/json'
local reqs, n = {}, 0
function init(args)
  reqs[1] = wrk.format(nil, nil, nil, os.getenv('BENCH_BODY'))
  reqs[2] = wrk.format(nil, nil, nil, os.getenv('BENCH_BODY2'))
end
function request()
  n = n + 1
  return reqs[n % 2 + 1]
end
"""
SSE = {"model": "m", "max_tokens": 1000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
SSE_FRONTS = ("proxy", "proxy-base", "proxy-w2", "proxy-w2-plain", "nginx", "vllm-router", "smg")   # the streamed rounds' fronts, when started
DEFAULT_FRONTS = "direct,proxy,proxy-asyncio,nginx,vllm-router,smg"


def wrk(wrk_bin: str, url: str, body: dict, connections: int, seconds: float, work: Path, threads: int = 2,
        body2: dict | None = None) -> dict:
    """One wrk run: requests/s, p50 and p99 in ms, errors. With body2: requests alternate body, body2."""
    script = work / ("mix.lua" if body2 else "post.lua")
    if not script.exists():
        # Every front gets proxy-tenants' key of `app` (the others ignore it): the same request for all.
        script.write_text(MIX_LUA if body2 else "wrk.method = 'POST'\nwrk.headers['Content-Type'] = "
                          "'application/json'\nwrk.headers['Authorization'] = 'Bearer sk-app'\n"
                          "wrk.body = os.getenv('BENCH_BODY')\n")
    out = subprocess.run([wrk_bin, f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(script),
                          url], capture_output=True, text=True, timeout=seconds + 30,
                         env={**os.environ, "BENCH_BODY": json.dumps(body),
                              "BENCH_BODY2": json.dumps(body2 or body)}).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    lat = {m.group(1): _ms(m.group(2), m.group(3)) for m in re.finditer(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)}
    if len(lat) < 2:
        print(f"bench_proxy: no latency distribution in wrk's output:\n{out}", file=sys.stderr)
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {"rps": rps, "requests": total, "p50_ms": lat.get("50", float("nan")), "p99_ms": lat.get("99", float("nan")),
            "non_2xx": int(bad.group(1)) if bad else 0, "socket_errors": sum(map(int, errs.groups())) if errs else 0}


def drive(wrk_bin: str, stack: Stack, front: str, body: dict, connections: int, seconds: float, work: Path,
          body2: dict | None = None) -> dict:
    """wrk against a front; `direct` is one wrk per sim at the same time, the connections split evenly."""
    path = "/v1/chat/completions"
    if front != "direct":
        return wrk(wrk_bin, stack.url(front) + path, body, connections, seconds, work, body2=body2)
    urls = [f"http://127.0.0.1:{p}{path}" for p in stack.backend_ports]
    each = max(1, connections // len(urls))
    with ThreadPoolExecutor(len(urls)) as pool:
        runs = list(pool.map(lambda u: wrk(wrk_bin, u, body, each, seconds, work, threads=1, body2=body2), urls))
    return {"rps": sum(r["rps"] for r in runs), "p50_ms": statistics.median(r["p50_ms"] for r in runs),
            "p99_ms": max(r["p99_ms"] for r in runs), "non_2xx": sum(r["non_2xx"] for r in runs),
            "socket_errors": sum(r["socket_errors"] for r in runs),
            **({"requests": sum(r["requests"] for r in runs)} if all("requests" in r for r in runs) else {})}


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


async def open_loop(url: str, rate: float, seconds: float) -> list[float]:
    """Latencies (ms) of requests sent at a fixed rate, whatever the answers' pace (no coordinated omission)."""
    import aiohttp
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one():
            t = time.perf_counter()
            async with s.post(url, json=CHAT) as r:
                await r.read()
                if r.status == 200:
                    latencies.append((time.perf_counter() - t) * 1000)
        tasks, start, n = [], time.perf_counter(), int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each wrk run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--backends", type=int, default=4, help="sims behind every front")
    ap.add_argument("--fronts", default=DEFAULT_FRONTS, help=f"comma separated (default {DEFAULT_FRONTS})")
    ap.add_argument("--rate", type=float, default=300.0, help="requests/s of the open-loop latency run")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--chat-only", action="store_true", help="the chat rounds alone: no SSE, no open loop")
    only.add_argument("--sse-only", action="store_true", help="the streamed rounds alone: no chat rounds, no open loop")
    ap.add_argument("--prompt-chars", type=int, default=0, help="a message of N characters instead of 'hi'")
    ap.add_argument("--out", help="also write every figure to this JSON file")
    ap.add_argument("--baseline", help="another checkout (the main branch) whose proxy runs as front proxy-base")
    args = ap.parse_args(argv)
    global CHAT, CHAT2
    if args.prompt_chars:
        words = "the image shows a small red house near the river under a grey sky "
        text = (words * (args.prompt_chars // len(words) + 1))[:args.prompt_chars]
        CHAT = {**CHAT, "messages": [{"role": "user", "content": text}]}
        CHAT2 = {**CHAT, "model": "m2"}
    mix = any(f in MODELS_FRONTS for f in args.fronts.split(","))
    wrk_bin = shutil.which("wrk")
    if not wrk_bin:
        print("bench_proxy: wrk is not installed; `apt-get install wrk` (Debian) and run again.", file=sys.stderr)
        return 2
    figures: dict = {"connections": args.connections, "seconds": args.seconds, "rounds": args.rounds,
                     "backends": args.backends, "cpus": os.cpu_count(), "models_mix": mix, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        # max_num_seqs 256 (vLLM's default): slots enough that the proxy's queue never holds a request here.
        # `proxy` is least_conn, `proxy-prefix` the prefix policy (the default), to compare the two
        # The sims answer 1,000 tokens (their own length is 200): a stream is the 1,000 chunks it is counted as.
        stack = Stack(Path(tmp), args.backends, 256, ["--sim-instant", "--sim-output-tokens", "1000"],
                      served=("m", "m2") if mix else ("m",),
                      proxy_set=("proxy.routing.policy=least_conn",),
                      baseline=Path(args.baseline).resolve() if args.baseline else None)
        try:
            fronts = stack.start(args.fronts.split(","))
            figures["skipped"] = stack.skipped
            print(f"chat completions, max_tokens 16, {args.connections} connections, {args.seconds:g}s x "
                  f"{args.rounds} interleaved rounds; {args.backends} sim engines in instant mode; "
                  f"{os.cpu_count()} CPUs" + ("; every front: model m and m2 in turn" if mix else ""), flush=True)
            for r in range(0 if args.sse_only else args.rounds):
                for name in fronts[r % len(fronts):] + fronts[:r % len(fronts)]:
                    cpu = stack.cpu_s(name) if name in stack.pids else None
                    kids = stack.children_cpu_s(name) if name in stack.pids else None
                    run = drive(wrk_bin, stack, name, CHAT, args.connections, args.seconds, Path(tmp),
                                body2=CHAT2 if mix else None)
                    if cpu is not None and run.get("requests"):   # the front's CPU time per request answered
                        run["cpu_us_per_request"] = (stack.cpu_s(name) - cpu) / run["requests"] * 1e6
                        # Its children's (the span exporter's), apart: the proxy's own cost is the first.
                        run["child_cpu_us_per_request"] = max(0.0, stack.children_cpu_s(name) - kids) \
                            / run["requests"] * 1e6
                        run["total_cpu_us_per_request"] = run["cpu_us_per_request"] + run["child_cpu_us_per_request"]
                    figures["runs"].setdefault(name, []).append(run)
                    cpu = f"  cpu {run['cpu_us_per_request']:.0f} us/req" if "cpu_us_per_request" in run else ""
                    if run.get("child_cpu_us_per_request"):
                        cpu += f" (+ {run['child_cpu_us_per_request']:.0f} in its children: span exporter, workers)"
                    print(f"  round {r + 1} {name:<14} {run['rps']:>8.0f} r/s  p50 {run['p50_ms']:.1f} ms  "
                          f"p99 {run['p99_ms']:.1f} ms  errors {run['non_2xx'] + run['socket_errors']}{cpu}", flush=True)
            if not args.chat_only:
                sse = {}
                streamed = ["direct", *(n for n in SSE_FRONTS if n in fronts)]
                for r in range(args.rounds):
                    for name in streamed[r % len(streamed):] + streamed[:r % len(streamed)]:
                        # The CPU per chunk of the front's processes (a proxy's workers, nginx's, a router's)
                        # and of the sims: on a machine whose cores they share, the two add up to the run.
                        cpu = {who: stack.tree_cpu_s(who) for who in (name, "sims") if who != "direct"}
                        run = drive(wrk_bin, stack, name, SSE, 16, args.seconds, Path(tmp))
                        if run.get("requests"):
                            chunks = run["requests"] * SSE["max_tokens"]
                            for who, before in cpu.items():
                                key = "sims_cpu_us_per_chunk" if who == "sims" else "cpu_us_per_chunk"
                                run[key] = (stack.tree_cpu_s(who) - before) / chunks * 1e6
                        sse.setdefault(name, []).append(run)
                figures["sse"] = sse
                lat = {}
                for name in ("direct", "proxy", "nginx", "proxy-otel", "proxy-otel-down", "proxy-base"):
                    if name not in fronts or args.sse_only:
                        continue
                    url = (f"http://127.0.0.1:{stack.backend_ports[0]}" if name == "direct" else stack.url(name))
                    values = asyncio.run(open_loop(url + "/v1/chat/completions", args.rate, args.seconds))
                    lat[name] = {"n": len(values), "p50_ms": pct(values, 0.5), "p99_ms": pct(values, 0.99)}
                figures["open_loop"] = {"rate": args.rate, **lat}
        finally:
            stack.stop()
    return _finish(figures, args)


def _finish(figures: dict, args) -> int:
    report(figures)   # adds the per-round ratios to figures
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]


def report_chat(f: dict) -> None:
    """The chat rounds' table and ratios (f["ratios"])."""
    runs = {name: median_run(r) for name, r in f["runs"].items()}
    print(f"\nmedian of {f['rounds']} rounds, {f['connections']} connections, {f['backends']} backends:")
    print(f"  {'front':<14}{'r/s':>9}{'p50 ms':>9}{'p99 ms':>9}  errors")
    for name, r in runs.items():
        print(f"  {name:<14}{r['rps']:>9.0f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}  {r['non_2xx'] + r['socket_errors']}")
    f["ratios"] = {}
    pairs = [("proxy", o) for o in ("nginx", "vllm-router", "smg", "proxy-asyncio", "direct", "proxy-base")]
    pairs += [("proxy-w2", o) for o in ("proxy", "nginx", "vllm-router", "smg")]
    for mine, other in pairs:
        if other not in runs or mine not in runs:
            continue
        per_round = [p["rps"] / o["rps"] for p, o in zip(f["runs"][mine], f["runs"][other])]
        p99 = [p["p99_ms"] / o["p99_ms"] for p, o in zip(f["runs"][mine], f["runs"][other])]
        # keyed by the other front (proxy's), or "mine/other"
        key = other if mine == "proxy" and other != "proxy-base" else f"{mine}/{other}"
        f["ratios"][key] = {"rps_by_round": per_round, "rps_median": statistics.median(per_round),
                            "p99_by_round": p99, "p99_median": statistics.median(p99)}
        print(f"  {mine} / {other}: requests/s {statistics.median(per_round):.2f}x (rounds "
              f"{', '.join(f'{r:.2f}' for r in per_round)}), p99 {statistics.median(p99):.2f}x")
    for other in (*MODELS_FRONTS, "proxy-prefix", "proxy-tenants", "proxy-otel", "proxy-otel-down", "proxy-base"):
        if other not in runs or "proxy" not in runs:
            continue
        pairs = list(zip(f["runs"][other], f["runs"]["proxy"]))
        by = {k: [o[k] / p[k] for o, p in pairs] for k in ("rps", "p50_ms", "p99_ms", "cpu_us_per_request")}
        f["ratios"][other] = {**{f"{k}_by_round": v for k, v in by.items()},
                              **{f"{k}_median": statistics.median(v) for k, v in by.items()}}
        print(f"  {other} / proxy: requests/s {statistics.median(by['rps']):.3f}x (rounds "
              f"{', '.join(f'{r:.3f}' for r in by['rps'])}), p50 {statistics.median(by['p50_ms']):.3f}x, "
              f"p99 {statistics.median(by['p99_ms']):.3f}x; CPU per request {statistics.median(by['cpu_us_per_request']):.3f}x "
              f"(rounds {', '.join(f'{r:.3f}' for r in by['cpu_us_per_request'])})")
        if any(r.get("child_cpu_us_per_request") for r in f["runs"][other]):
            total = [o["total_cpu_us_per_request"] / p["total_cpu_us_per_request"] for o, p in pairs]
            child = statistics.median(o["child_cpu_us_per_request"] for o, _ in pairs)
            own = statistics.median(o["cpu_us_per_request"] for o, _ in pairs)
            f["ratios"][other].update(total_cpu_us_per_request_by_round=total,
                                      total_cpu_us_per_request_median=statistics.median(total))
            print(f"    {other}: the proxy process {own:.0f} us/req, its exporter child {child:.0f} us/req (medians); "
                  f"CPU per request with the child {statistics.median(total):.3f}x proxy's "
                  f"(rounds {', '.join(f'{r:.3f}' for r in total)})")
    if "proxy-prefix" in runs:
        print("  target: routing by prefix costs at most 10% (requests/s at least 0.90x proxy's)")
    if "proxy-tenants" in runs:
        print("  target: tenants on cost at most 5% (proxy-tenants' requests/s at least 0.95x proxy's)")
    if "proxy-otel" in runs:
        print("  target: exporting spans costs at most 10% (proxy-otel's requests/s at least 0.90x proxy's)")
    if "proxy-base" in runs:
        print("  targets: tracing off costs at most 3% over the baseline (proxy-base's requests/s at most 1.03x "
              "proxy's); a cheaper request, one worker at least 1.25x the baseline's requests/s (proxy / proxy-base)")
    if any(o in runs for o in MODELS_FRONTS):
        cpu = {n: statistics.median(r["cpu_us_per_request"] for r in f["runs"][n]) for n in ("proxy", *MODELS_FRONTS)
               if n in runs}
        print("  proxy CPU per request answered, median: " + ", ".join(f"{n} {v:.0f} us" for n, v in cpu.items()))
        print("  target: routing by model costs at most 5% (requests/s at least 0.95x proxy's)")
    elif not any(o in runs for o in ("proxy-prefix", "proxy-otel", "proxy-otel-down", "proxy-base")):
        print("  targets: requests/s at least vllm-router's (1.00x), p99 at most 1.5x nginx's")


def report(f: dict) -> None:
    if f["runs"]:
        report_chat(f)
    f.setdefault("ratios", {})
    if "sse" not in f:
        return
    sse = {name: median_run(r) for name, r in f["sse"].items()}
    print(f"SSE, 1,000-chunk streams, 16 connections: direct {sse['direct']['rps'] * 1000:.0f} chunks/s" + "".join(
        f", {n} {sse[n]['rps'] * 1000:.0f} chunks/s: {sse[n]['rps'] / sse['direct']['rps']:.0%} of direct"
        for n in SSE_FRONTS if n in sse))
    cpu = {n: statistics.median(r["cpu_us_per_chunk"] for r in f["sse"][n]) for n in SSE_FRONTS
           if n in sse and all("cpu_us_per_chunk" in r for r in f["sse"][n])}
    if cpu:
        print("  CPU per chunk relayed (every process of the front), median: "
              + ", ".join(f"{n} {v:.2f} us" for n, v in cpu.items()))
    sims = {n: statistics.median(r["sims_cpu_us_per_chunk"] for r in f["sse"][n]) for n in ("direct", *SSE_FRONTS)
            if n in sse and all("sims_cpu_us_per_chunk" in r for r in f["sse"][n])}
    if sims:
        print("  the sims' CPU per chunk they answered behind each, median: "
              + ", ".join(f"{n} {v:.2f} us" for n, v in sims.items()))
    f["sse_ratios"] = {}
    for mine in ("proxy", "proxy-w2", "proxy-w2-plain"):
        for name in SSE_FRONTS:
            if name == mine or mine not in sse or name not in sse or (mine != "proxy" and name == "proxy-base") \
                    or (mine == "proxy-w2-plain" and name not in ("proxy-w2", "nginx")):
                continue
            per_round = [m["rps"] / o["rps"] for m, o in zip(f["sse"][mine], f["sse"][name])]
            f["sse_ratios"][f"{mine}/{name}"] = {"by_round": per_round, "median": statistics.median(per_round)}
            cpu = [m["cpu_us_per_chunk"] / o["cpu_us_per_chunk"] for m, o in zip(f["sse"][mine], f["sse"][name])
                   if "cpu_us_per_chunk" in m and "cpu_us_per_chunk" in o]
            if cpu:
                f["sse_ratios"][f"{mine}/{name}"].update(cpu_by_round=cpu, cpu_median=statistics.median(cpu))
            print(f"  {mine} / {name}: chunks/s {statistics.median(per_round):.2f}x (median of the rounds' ratios: "
                  f"{', '.join(f'{r:.2f}' for r in per_round)})" + (
                      f"; CPU per chunk {statistics.median(cpu):.3f}x (rounds {', '.join(f'{r:.3f}' for r in cpu)})"
                      if cpu else ""))
    ol = f["open_loop"]
    for name in ("proxy", "nginx", "proxy-otel", "proxy-otel-down", "proxy-base"):
        if name in ol and "direct" in ol:
            print(f"open loop at {ol['rate']:g} r/s: {name} p50 {ol[name]['p50_ms']:.1f} / p99 {ol[name]['p99_ms']:.1f} ms "
                  f"against direct {ol['direct']['p50_ms']:.1f} / {ol['direct']['p99_ms']:.1f} ms: adds "
                  f"{ol[name]['p50_ms'] - ol['direct']['p50_ms']:.1f} ms at p50, "
                  f"{ol[name]['p99_ms'] - ol['direct']['p99_ms']:.1f} ms at p99")


if __name__ == "__main__":
    sys.exit(main())
