"""A stream survives its instance (proxy/resume.py): cut after its first chunk, it is finished on another
instance in the same client stream. Real proxy, real sims, real SIGKILL; loads bounded in count."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import aiohttp
import pytest

from conftest import wait_until
from proxy_helpers import start_proxy, start_sims

pytestmark = pytest.mark.process

STREAMS = 32
TOKENS = 60
COMPLETION = {"model": "m", "prompt": "Write about the sea:", "max_tokens": TOKENS, "stream": True}


def ask(i: int, stream: bool = True) -> dict:
    """The i-th conversation: its own prompt, so its own (deterministic) answer."""
    return {"model": "m", "max_tokens": TOKENS, "stream": stream, "seed": 7,
            "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "system", "content": "you answer briefly"},
                         {"role": "user", "content": f"question number {i}: what is the weather?"}]}


def new_seen() -> dict:
    return {"ids": set(), "roles": 0, "done": 0, "text": "", "usage": None, "cut": None, "gaps": [],
            "backend": None, "chunks": 0}


async def stream(session: aiohttp.ClientSession, url: str, body: dict, path: str = "/v1/chat/completions",
                 seen: dict | None = None) -> dict:
    """One streamed answer as the client sees it: its events, text, ids, role chunks, [DONE]s, usage;
    cut: the connection broke, or the stream ended without [DONE]. seen: filled as the events come (a
    test polls it)."""
    seen = new_seen() if seen is None else seen
    last = None
    try:
        async with session.post(url + path, json=body) as r:
            seen["backend"] = r.headers.get("X-Backend")
            assert r.status == 200, await r.text()
            buf = b""
            async for chunk in r.content.iter_any():
                now = time.monotonic()
                if last is not None:
                    seen["gaps"].append(now - last)
                last = now
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for e in events:
                    payload = e.strip()[len(b"data:"):].strip()
                    if payload == b"[DONE]":
                        seen["done"] += 1
                        continue
                    event = json.loads(payload)
                    assert "error" not in event, event
                    seen["ids"].add((event["id"], event["created"], event["model"]))
                    if event.get("usage"):
                        seen["usage"] = event["usage"]
                    for choice in event["choices"]:
                        delta = choice.get("delta", {})
                        seen["roles"] += "role" in delta
                        content = delta.get("content") or choice.get("text")
                        if content:
                            seen["text"] += content
                            seen["chunks"] += 1
    except aiohttp.ClientError as e:
        seen["cut"] = repr(e)
    if seen["cut"] is None and seen["done"] != 1:
        seen["cut"] = f"{seen['done']} [DONE]"
    return seen


async def whole(session: aiohttp.ClientSession, url: str, body: dict, path: str = "/v1/chat/completions") -> dict:
    async with session.post(url + path, json=body) as r:
        assert r.status == 200
        return await r.json()


async def backends(admin: int) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{admin}/admin/backends") as r:
            return {b["name"]: b for b in await r.json()}


def results_log(tmp_path) -> list[dict]:
    path = tmp_path / "req_results.log"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.xdist_group("load")
def test_sigkill_of_an_instance_holding_streams_cuts_none_and_the_texts_run_on(procs, tmp_path):
    """1. 32 streams (each its own conversation, include_usage) over 4 sims. 2. SIGKILL of the sim holding
    most of them once every stream has text. 3. Every stream ends with one [DONE]; one id, created and
    model on its every chunk; one role chunk; its text equals the same request's uninterrupted answer;
    its usage counts the whole answer. 4. The results log's final lines of the cut ones say resumed,
    naming both backends and the tokens before and after; /metrics counts them."""
    ports = start_sims(procs, tmp_path, 4, seqs=16, token_ms=25)
    port, admin = start_proxy(procs, tmp_path, ports, routing={"policy": "least_conn"})
    url = f"http://127.0.0.1:{port}"
    names = [f"127.0.0.1:{p}" for p in ports]

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            seens = [new_seen() for _ in range(STREAMS)]
            tasks = [asyncio.ensure_future(stream(s, url, ask(i), seen=seens[i])) for i in range(STREAMS)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:   # every stream started on some instance
                held = await backends(admin)
                if sum(b["in_flight"] for b in held.values()) == STREAMS:
                    break
                await asyncio.sleep(0.02)
            victim = max(names, key=lambda n: held[n]["in_flight"])
            await until(lambda: all(x["chunks"] for x in seens), "every stream's first token")   # mid-answer
            os.kill(procs.started[names.index(victim)].pid, signal.SIGKILL)
            seen = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            alone = [await whole(s, url, ask(i, stream=False)) for i in range(STREAMS)]
            return victim, held[victim]["in_flight"], seen, alone

    victim, on_victim, seen, alone = asyncio.run(run())
    assert on_victim > 0
    assert [s["cut"] for s in seen] == [None] * STREAMS
    for s, a in zip(seen, alone):
        assert len(s["ids"]) == 1 and s["roles"] == 1, s
        assert s["text"] == a["choices"][0]["message"]["content"]
        assert s["usage"]["completion_tokens"] == a["usage"]["completion_tokens"] == TOKENS
        # The continuation's prompt less the tokens sent before, as the next engine's tokenizer counted them
        # at the cut: exact where it reads its own text back as it wrote it (the sim does; most text does).
        assert s["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]
    assert sum(s["backend"] == victim for s in seen) == on_victim
    resumed = wait_until(lambda: [e for e in results_log(tmp_path) if e.get("final") and e.get("resumed")]
                         if len([e for e in results_log(tmp_path) if e.get("resumed")]) >= on_victim else None,
                         what="the resumed streams' results-log lines")
    assert len(resumed) == on_victim
    for e in resumed:
        assert e["backends"][0] == victim and e["backends"][1] != victim and e["status"] == 200
        assert 0 < e["tokens_before"] < TOKENS and e["tokens_before"] + e["tokens_after"] == TOKENS
        assert e["tokens_counted_by"] == "tokenize"
    metrics = asyncio.run(_get(f"{url}/metrics"))
    assert f'proxy_stream_resumes_total{{outcome="resumed"}} {float(on_victim)}' in metrics


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            return await r.text()


@pytest.mark.xdist_group("load")
def test_an_engine_error_chunk_and_a_stall_are_resumed_and_what_cannot_be_is_logged(procs, tmp_path):
    """1. A sim's engine dies mid-stream (it sends an error event, then [DONE]): the client sees no error,
    the stream ends on another sim, the same text as uninterrupted. 2. A sim stalls mid-stream (healthy,
    no tokens): past resume.stall_s the rest comes from another; so too for a text completion (the prompt
    plus the text so far). 3. A stream asking logprobs is cut when its sim is killed, as before, its
    results-log line saying why it was not resumed."""
    ports = start_sims(procs, tmp_path, 3, token_ms=20)
    port, admin = start_proxy(procs, tmp_path, ports, routing={"policy": "least_conn"}, resume={"stall_s": 0.5})
    url = f"http://127.0.0.1:{port}"

    async def faulted(s, i, fault, body=None, path="/v1/chat/completions"):
        seen = new_seen()
        task = asyncio.ensure_future(stream(s, url, body or ask(i), path, seen))
        held = await _holder(admin)
        await until(lambda: seen["chunks"], "the stream's first token")   # the fault comes mid-answer
        if fault == "kill":
            os.kill(procs.started[[f"127.0.0.1:{p}" for p in ports].index(held)].pid, signal.SIGKILL)
        else:
            async with s.post(f"http://{held}/sim/fault", json={"fault": fault}) as r:
                assert r.status == 200, await r.text()
        seen = await asyncio.wait_for(task, 30)
        if fault == "stall":
            async with s.post(f"http://{held}/sim/fault", json={"fault": "recover"}) as r:
                assert r.status == 200
        return held, seen

    async def run():
        async with aiohttp.ClientSession() as s:
            got = [await faulted(s, 1, "engine-death"), await faulted(s, 2, "stall"),
                   await faulted(s, 4, "stall", COMPLETION, "/v1/completions")]
            expected = [(await whole(s, url, ask(i, stream=False)))["choices"][0]["message"]["content"]
                        for i in (1, 2)]
            expected.append((await whole(s, url, {**COMPLETION, "stream": False}, "/v1/completions"))
                            ["choices"][0]["text"])
            logprobs = {**ask(3), "logprobs": True}
            return got, expected, await faulted(s, 3, "kill", logprobs)

    got, expected, (killed, cut) = asyncio.run(run())
    lines = [e for e in results_log(tmp_path) if e.get("final")]
    for (held, seen), text, cause in zip(got, expected, ("error event", "no bytes", "no bytes")):
        assert seen["cut"] is None and seen["text"] == text and len(seen["ids"]) == 1, seen
        line = next(e for e in lines if e.get("resumed") and e["backends"][0] == held)
        assert cause in line["resume_cause"] and line["backends"][1] != held
    assert cut["cut"] is not None
    line = wait_until(lambda: next((e for e in results_log(tmp_path) if e.get("final") and e["stream"]
                                    and e["backend"] == killed and not e.get("backends")), None),
                      what="the cut stream's results-log line")
    assert line.get("resumed") is False and line["resume"].startswith("logprobs asked for"), line


async def until(ready, what: str, timeout_s: float = 10) -> None:
    """Poll ready() (on this loop, every 10 ms) until it is true; AssertionError naming what past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s")
        await asyncio.sleep(0.01)


@pytest.mark.xdist_group("load")
def test_events_of_several_tokens_resume_to_the_budget_exactly(procs, tmp_path):
    """Sims that put three tokens in an event (vLLM's --stream-interval; a busy API server merges deltas
    so too). Streams that ask for no usage, each SIGKILLed mid-answer in turn (chat, then a completion):
    the client's text is the uninterrupted answer of max_tokens tokens, no more, no less, and no usage
    reaches it; the results log says the tokens before the cut were counted by the next engine's
    tokenizer and adds up to max_tokens. (Counted one a content event, the continuation was asked for
    some twice the tokens left, and the text ran past the budget.)"""
    ports = start_sims(procs, tmp_path, 3, token_ms=20, extra=("--stream-interval", "3"))
    port, admin = start_proxy(procs, tmp_path, ports, routing={"policy": "least_conn"})
    url = f"http://127.0.0.1:{port}"
    names = [f"127.0.0.1:{p}" for p in ports]
    chat = {**ask(5), "stream_options": None, "max_tokens": 90}     # 1.8 s an answer: time to cut it

    async def cut(s, body, path):
        seen = new_seen()
        task = asyncio.ensure_future(stream(s, url, body, path, seen))
        held = await _holder(admin)
        await until(lambda: seen["chunks"] >= 2, "the stream's first tokens")   # mid-answer
        os.kill(procs.started[names.index(held)].pid, signal.SIGKILL)
        return held, await asyncio.wait_for(task, 30)

    async def run():
        async with aiohttp.ClientSession() as s:
            got = [await cut(s, chat, "/v1/chat/completions"),
                   await cut(s, {**COMPLETION, "max_tokens": 90}, "/v1/completions")]
            expected = [(await whole(s, url, {**chat, "stream": False}))["choices"][0]["message"]["content"],
                        (await whole(s, url, {**COMPLETION, "max_tokens": 90, "stream": False}, "/v1/completions"))
                        ["choices"][0]["text"]]
            return got, expected

    got, expected = asyncio.run(run())
    lines = wait_until(lambda: (lambda f: f if len(f) == 2 else None)(
        [e for e in results_log(tmp_path) if e.get("final") and e.get("resumed")]), what="both resumed lines")
    for (held, seen), text, line in zip(got, expected, lines):
        assert seen["cut"] is None and seen["usage"] is None and seen["text"] == text, (seen, text)
        assert line["backends"][0] == held and line["tokens_counted_by"] == "tokenize"
        assert line["tokens_before"] % 3 == 0 and line["tokens_before"] + line["tokens_after"] == 90, line


async def _holder(admin: int) -> str:
    """The backend a lone stream is on, once it is on one."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        on = [n for n, b in (await backends(admin)).items() if b["in_flight"]]
        if on:
            return on[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no stream in flight")


def _event(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        event["usage"] = usage
    return b"data: " + json.dumps(event).encode() + b"\n\n"


ROLE = _event({"role": "assistant", "content": ""})
END = b"data: [DONE]\n\n"
ABORT = "abort"     # the backend drops the connection there
# What the scripted backend streams, by the request's `user`: bytes are written, a number is slept.
SCRIPTS = {
    "tool": [ROLE, _event({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                           "function": {"name": "weather", "arguments": ""}}]}),
             _event({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}),
             _event({}, "tool_calls"), END],
    "reasoning": [ROLE, _event({"reasoning_content": "It is"}), _event({"reasoning_content": " cold."}),
                  _event({"content": "Cold."}), _event({}, "stop"), END],
    "slow-first": [2.5, ROLE, _event({"content": "a"}), _event({"content": " b"}), _event({}, "stop"), END],
    "done-then-hold": [ROLE, _event({"content": "a"}), _event({}, "stop"), END, 2.5],
    "cut-after-finish": [ROLE, _event({"content": "a"}), _event({"content": " b"}), _event({}, "stop"), ABORT],
    "big": [ROLE, *[_event({"content": "x" * 16384})] * 500, _event({}, "stop"), END],
    # Events of three tokens each (vLLM's --stream-interval 3), cut after two; the continuation's answer.
    "merged": [ROLE, _event({"content": "One two three"}), _event({"content": " four five six"}), 0.2, ABORT],
    "merged/rest": [ROLE, _event({"content": " seven"}), _event({}, "length"),
                    _event(usage={"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}), END],
}
WHOLE = ("tool", "reasoning", "slow-first", "done-then-hold", "cut-after-finish", "big")   # answers that end whole


async def slow_reader(port: int, body: dict) -> dict:
    """A client that takes nothing of its answer for 3 s (a small receive buffer: the proxy's write
    waits), then all of it: what `stream` says of it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    await asyncio.sleep(3)
    answer = await reader.read()
    writer.close()
    whole = answer.startswith(b"HTTP/1.1 200") and answer.endswith(END + b"\r\n0\r\n\r\n")
    return {"cut": None if whole else answer[-200:], "done": answer.count(END),
            "text": "%d events of x" % answer.count(b'{"content": "x')}


def scripted_backend(servers, tokenize=None, bodies=None) -> int:
    """A backend streaming SCRIPTS[the request's user] (its /health always 200; a continuation, SCRIPTS
    of the user + "/rest"); its port. tokenize: its /tokenize's answer to a body (None: it has none);
    bodies: where it puts each chat request's body."""
    from aiohttp import web

    async def health(request):
        return web.json_response({})

    async def count(request):
        return web.json_response(tokenize(await request.json()))

    async def chat(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)     # headers first, as vLLM sends them, before any token
        body = await request.json()
        if bodies is not None:
            bodies.append(body)
        for step in SCRIPTS[body["user"] + ("/rest" if body.get("continue_final_message") else "")]:
            if step == ABORT:
                request.transport.abort()
                return resp
            if isinstance(step, bytes):
                await resp.write(step)
            else:
                await asyncio.sleep(step)
        await resp.write_eof()
        return resp
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    if tokenize is not None:
        app.router.add_post("/tokenize", count)
    return servers.serve(app)


@pytest.mark.xdist_group("load")
@pytest.mark.parametrize("answer", ["words", None, "absurd"], ids=["tokenize", "no-tokenize", "absurd-count"])
def test_the_count_at_a_cut_is_the_next_engines_tokenizer_or_else_one_an_event(procs, tmp_path, answer):
    """Two scripted backends whose events carry three tokens each; a stream asking no usage is cut after
    two events. 1. The backends answer /tokenize (the text alone, no special tokens: what they are asked):
    the continuation's max_tokens is the budget less the tokenizer's 6, its stream_options ask the closing
    usage chunk alone (not usage on every event), and the results log says `tokenize`. 2. They have no
    /tokenize (an older engine), or answer a count the text cannot have (more tokens than its bytes): the
    count is one a content event (2), said `events`. The client gets no usage either way, the text of
    both answers, one [DONE]."""
    from otlp_helpers import Servers
    asked = []
    tokenizes = answer == "words"

    def tokenize(body):
        asked.append(body)
        count = len(body["prompt"].split()) if tokenizes else 10 ** 9      # a word a token
        return {"count": count, "max_model_len": 4096, "tokens": []}
    servers, bodies = Servers(), []
    try:
        ports = [scripted_backend(servers, tokenize if answer else None, bodies) for _ in range(2)]
        port, _ = start_proxy(procs, tmp_path, [f"127.0.0.1:{p}" for p in ports])
        url = f"http://127.0.0.1:{port}"

        async def run():
            async with aiohttp.ClientSession() as s:
                return await stream(s, url, {**ask(0), "user": "merged", "max_tokens": 20, "stream_options": None})
        seen = asyncio.run(run())
    finally:
        servers.close()
    before = 6 if tokenizes else 2
    assert (seen["cut"], seen["done"], seen["usage"], seen["text"]) == (None, 1, None, "One two three four five six seven")
    first, rest = bodies
    assert first["stream_options"] == rest["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert rest["max_tokens"] == 20 - before and rest["messages"][-1]["content"] == "One two three four five six"
    assert asked == ([{"model": "m", "prompt": "One two three four five six", "add_special_tokens": False}]
                     if answer else [])
    line = wait_until(lambda: next((e for e in results_log(tmp_path) if e.get("final")), None),
                      what="the stream's final results-log line")
    assert (line["tokens_before"], line["tokens_counted_by"]) == (before, "tokenize" if tokenizes else "events"), line


@pytest.mark.xdist_group("load")
def test_whole_answers_pass_whole_with_resume_on(procs, tmp_path):
    """One scripted backend, resume on, stall_s 1. 1. A tool call's stream and a reasoning stream (not
    resumable once they show it) end cleanly with their [DONE]. 2. A first token 2.5 s after the headers
    is waited for (the stall counts from the first chunk). 3. A backend holding the connection open 2.5 s
    after [DONE]: one [DONE]. 4. A client that takes nothing for 3 s of an 8 MB answer is not the backend's
    silence. 5. A backend gone between finish_reason and the usage chunk: the proxy sends the usage it
    can count (include_usage), [DONE], and counts the stream `closed`."""
    from otlp_helpers import Servers
    servers = Servers()
    try:
        port, _ = start_proxy(procs, tmp_path, [f"127.0.0.1:{scripted_backend(servers)}"],
                              resume={"stall_s": 1})
        url = f"http://127.0.0.1:{port}"

        async def one(s, script, **extra) -> dict:
            body = {**ask(0), "user": script, "max_tokens": 1000, **extra}
            return await (stream(s, url, body) if script != "big" else slow_reader(port, body))

        async def run():
            async with aiohttp.ClientSession() as s:
                return {script: await one(s, script) for script in WHOLE}
        seen = asyncio.run(run())
        metrics = asyncio.run(_get(f"{url}/metrics"))
    finally:
        servers.close()
    texts = {"tool": "", "reasoning": "Cold.", "slow-first": "a b", "done-then-hold": "a", "cut-after-finish": "a b",
             "big": "500 events of x"}
    assert {k: (s["cut"], s["done"], s["text"]) for k, s in seen.items()} == {k: (None, 1, texts[k]) for k in WHOLE}
    usage = seen["cut-after-finish"]["usage"]
    assert usage is not None and usage["completion_tokens"] == 2, seen["cut-after-finish"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 2 and usage["prompt_tokens"] > 0
    assert 'proxy_stream_resumes_total{outcome="closed"} 1.0' in metrics
    def finals():
        lines = [e for e in results_log(tmp_path) if e.get("final")]
        return lines if len(lines) >= len(WHOLE) else None
    lines = wait_until(finals, what="every stream's final results-log line")
    assert [e["status"] for e in lines] == [200] * len(WHOLE), lines
