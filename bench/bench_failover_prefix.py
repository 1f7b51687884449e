"""Prefix affinity across an entry failover: the hit-rate dip when clients move to a proxy with a cold index.

    .venv/bin/python bench/bench_failover_prefix.py [--rate 10] [--rounds 6] [--seconds 18] [--window 1.5]
                                                    [--out FILE.json]

bench_routing's chat workload (a shared system prompt, each user's own document, then the conversation's
history) on its 8 sim engines x max_num_seqs 4 with a prefix cache each, behind two proxies with the prefix
policy over the same engines (proxy-prefix: the master entry's, proxy-prefix-b: the backup's, each its own
index). Two runs of the same arrivals and users (a nonce of their own, so neither finds the other's blocks):

- `stay`: every request through the master's proxy;
- `move`: through the master's until the switch (half the run), then through the backup's: what the
  virtual address moving does to the clients (their next connection lands on the other entry);
- `warm`: the same move, the two proxies sharing their prefix routing as entries of one group do (each
  config's `share`, split false: active-passive; both started with one PYTHONHASHSEED, as the rendered
  start script does; proxy/share.py): the backup has learned the master's decisions at each poll.

Per window of send time, from the engines' own word (usage.prompt_tokens_details.cached_tokens over
prompt_tokens, summed): the hit rate and TTFT p50 of both runs. The dip: the hit rate of the requests sent in
the first `--seconds / --rounds` after the switch (one round of every user) against the same requests in
`stay`; the recovery: the first window after the switch from which every window's hit rate is within 0.1
of `stay`'s. Also the prompt tokens the engines computed after the switch in each run (their ratio).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_routing import BACKENDS, MAX_NUM_SEQS, Workload, arrivals, build, loadavg, pct, run_level, sim_flags  # noqa: E402
from stack import Stack  # noqa: E402


def windows(recs: list[dict], start: float, width: float, end: float) -> list[dict]:
    """Per window of send time [start + k*width, ...): requests, engine hit rate, TTFT p50 and p99."""
    out = []
    at = start
    while at < end:
        inside = [r for r in recs if at <= r["sent"] < at + width and r.get("ok")]
        prompt = sum(r.get("prompt_tokens") or 0 for r in inside)
        cached = sum(r.get("cached_tokens") or 0 for r in inside)
        ttft = [r["first"] - r["sent"] for r in inside]
        out.append({"from": at, "requests": len(inside), "hit": cached / prompt if prompt else None,
                    "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99)})
        at += width
    return out


def hit(recs: list[dict]) -> float | None:
    prompt = sum(r.get("prompt_tokens") or 0 for r in recs if r.get("ok"))
    return sum(r.get("cached_tokens") or 0 for r in recs if r.get("ok")) / prompt if prompt else None


def computed(recs: list[dict]) -> int:
    """Prompt tokens the engines computed (not found in their caches)."""
    return sum((r.get("prompt_tokens") or 0) - (r.get("cached_tokens") or 0) for r in recs if r.get("ok"))


def run(stack: Stack, w: Workload, rate: float, seed: int, label: str, switch: float | None) -> list[dict]:
    nonce = f"failover-{label}-{random.randrange(1 << 30):x}"
    reqs = build(w, rate, nonce, seed)
    times = arrivals(len(reqs), rate, seed + 1000)
    a, b = stack.url("proxy-prefix"), stack.url("proxy-prefix-b")
    front = a if switch is None else (lambda sent: a if sent < switch else b)
    return asyncio.run(run_level(front, reqs, times, timeout_s=300, usage=True))


def share(stack: Stack, on: bool) -> None:
    """Give the two proxies each other as peers (share, split false) or take that away, by a reload."""
    fronts = ["proxy-prefix", "proxy-prefix-b"]
    for me, front in enumerate(fronts):
        path = stack.deploy / "conf" / f"{front}.yaml"
        conf = yaml.safe_load(path.read_text())
        conf.pop("share", None)
        if on:
            conf["share"] = {"me": me, "split": False, "entries": [
                {"name": f, "weight": 1, "health": None if f == front else stack.url(f) + "/health"} for f in fronts]}
        path.write_text(yaml.safe_dump(conf))
        req = urllib.request.Request(stack.admin_url(front) + "/admin/reload", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["reloaded"], f"{front} refused its share"
    if on:   # both have polled their peer once: from then on each keeps its decisions for the other
        deadline = time.monotonic() + 30
        while not all(((json.loads(urllib.request.urlopen(stack.admin_url(f) + "/admin/config", timeout=5).read())
                        .get("share") or {}).get("serving")) for f in fronts):
            if time.monotonic() > deadline:
                raise SystemExit("bench: the proxies did not poll each other within 30 s")
            time.sleep(0.1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=10.0, help="requests/s")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each user's conversation")
    ap.add_argument("--seconds", type=float, default=18.0, help="the run's length (D): a user's rounds D/R apart")
    ap.add_argument("--window", type=float, default=1.5, help="the windows' width, seconds of send time")
    ap.add_argument("--runs", default="stay,move,warm", help="comma separated: stay, move, warm")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    w = Workload("chat", {"R": args.rounds, "S": 1000, "H": 2000, "Q": 32, "A": 32, "D": args.seconds}, [args.rate])
    switch = args.seconds / 2
    gap = args.seconds / args.rounds
    figures: dict = {"argv": sys.argv[1:], "cpus": os.cpu_count(), "load_before": loadavg(), "params": w.params,
                     "rate": args.rate, "switch_s": switch, "runs": {}}
    started = time.monotonic()
    print(f"{BACKENDS} sims x max_num_seqs {MAX_NUM_SEQS}; chat at {args.rate:g} req/s, {args.rounds} rounds "
          f"{gap:g} s apart; the switch at {switch:g} s; load average {figures['load_before']}", flush=True)
    os.environ["PYTHONHASHSEED"] = "1729"   # the proxies' (and sims'): one seed, as a group's start script sets
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        stack = Stack(Path(tmp), BACKENDS, MAX_NUM_SEQS, sim_flags(), proxy_set=("proxy.routing.policy=prefix",))
        try:
            stack.start(["proxy-prefix", "proxy-prefix-b"])
            for label in args.runs.split(","):
                if label == "warm":
                    share(stack, on=True)
                recs = run(stack, w, args.rate, args.seed, label, None if label == "stay" else switch)
                figures["runs"][label] = recs
                print(f"{label}: {len(recs)} requests, {sum(not r.get('ok') for r in recs)} failed, hit rate "
                      f"{hit(recs):.3f}", flush=True)
        finally:
            stack.stop()
    figures["load_after"] = loadavg()
    figures["seconds"] = time.monotonic() - started
    report(figures, args.window, gap)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


def report(f: dict, width: float, gap: float) -> None:
    runs, switch = f["runs"], f["switch_s"]
    end = max(r["sent"] for recs in runs.values() for r in recs) + 1e-9
    start = switch - width * int(switch // width)
    table = {k: windows(v, start, width, end) for k, v in runs.items()}
    names = list(runs)
    print(f"\n{f['seconds']:.0f} s; load average {f['load_before']} before, {f['load_after']} after; "
          f"windows of {width:g} s of send time, the switch at {switch:g} s")
    print(f"{'from s':>7}" + "".join(f"{n + ' reqs':>11}{'hit':>6}{'TTFT p50':>9}{'p99':>6}" for n in names))
    for k in range(len(table[names[0]])):
        row = f"{table[names[0]][k]['from']:>7.1f}"
        for n in names:
            c = table[n][k]
            row += (f"{c['requests']:>11}{'-' if c['hit'] is None else format(c['hit'], '.2f'):>6}"
                    f"{c['ttft_p50']:>9.2f}{c['ttft_p99']:>6.2f}")
        print(row + ("   <- switch" if abs(table[names[0]][k]["from"] - switch) < 1e-6 else ""))
    f["windows"] = table
    if "stay" not in runs:
        return
    stay = runs["stay"]
    for n in names:
        if n == "stay":
            continue
        recs = runs[n]
        dip_stay = hit([r for r in stay if switch <= r["sent"] < switch + gap])
        dip_move = hit([r for r in recs if switch <= r["sent"] < switch + gap])
        after_stay = computed([r for r in stay if r["sent"] >= switch])
        after_move = computed([r for r in recs if r["sent"] >= switch])
        ttft_stay = [r["first"] - r["sent"] for r in stay if r.get("ok") and switch <= r["sent"] < switch + gap]
        ttft_move = [r["first"] - r["sent"] for r in recs if r.get("ok") and switch <= r["sent"] < switch + gap]
        recovered = None
        for k, c in enumerate(table[n]):
            if c["from"] < switch - 1e-6:
                continue
            if all(x["hit"] is None or y["hit"] is None or x["hit"] >= y["hit"] - 0.1
                   for x, y in zip(table[n][k:], table["stay"][k:])):
                recovered = c["from"] - switch
                break
        summary = {"hit_first_gap": dip_move, "hit_first_gap_stay": dip_stay,
                   "ttft_p50_first_gap": pct(ttft_move, 0.5), "ttft_p50_first_gap_stay": pct(ttft_stay, 0.5),
                   "computed_after": after_move, "computed_after_stay": after_stay,
                   "recovered_s": recovered, "hit_before": hit([r for r in recs if r["sent"] < switch]),
                   "hit_before_stay": hit([r for r in stay if r["sent"] < switch])}
        f.setdefault("summary", {})[n] = summary
        print(f"{n} against stay: hit rate in the {gap:g} s after the switch {dip_move:.2f} against {dip_stay:.2f} "
              f"({dip_move / dip_stay:.2f}x); TTFT p50 there {summary['ttft_p50_first_gap']:.2f} s against "
              f"{summary['ttft_p50_first_gap_stay']:.2f} s ({summary['ttft_p50_first_gap'] / summary['ttft_p50_first_gap_stay']:.2f}x); "
              f"prompt tokens computed after the switch {after_move} against {after_stay} "
              f"({after_move / after_stay:.2f}x); back within 0.1 of stay's hit rate "
              f"{'never' if recovered is None else format(recovered, '.1f') + ' s'} after the switch")


if __name__ == "__main__":
    sys.exit(main())
