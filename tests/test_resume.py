"""The pieces of a resumed stream, without I/O: which requests may be continued, the continuation request,
the splicer that makes a continuation's events the rest of the first answer, the sim's continue_final_message,
and how `inv trace` shows the hop."""
from __future__ import annotations

import json

import pytest

from proxy.resume import (CHAT, COMPLETIONS, Splice, budget_left, continuation, counted_options, refusal,
                          tokenize_request)

from fleet.commands.display import request_block
from fleet.sim import protocol

pytestmark = pytest.mark.unit


def chat(**extra) -> dict:
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("extra, why", [
    ({}, None),
    ({"n": 2}, "n > 1"),
    ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"stream": False}, "not streamed"),
    ({"continue_final_message": True}, "continues or echoes"),
])
def test_what_may_be_continued(extra, why):
    got = refusal(CHAT, chat(**extra))
    assert (got is None) if why is None else why in got
    assert "token ids" in refusal(COMPLETIONS, {"stream": True, "prompt": [1, 2, 3]})
    assert refusal(COMPLETIONS, {"stream": True, "prompt": ["one prompt"]}) is None


def test_the_continuation_request_carries_the_text_so_far_and_what_is_left_of_the_budget():
    """Chat: the messages plus the text as an open assistant message, vLLM's flags; completions: the
    prompt plus the text; max_tokens and max_completion_tokens less the tokens sent; the rest kept; the
    client's body untouched; a spent budget asks for nothing."""
    body = chat(max_tokens=50, max_completion_tokens=40, temperature=0.7, seed=11, top_p=0.9, min_tokens=5)
    got = continuation(CHAT, body, "Once upon", 12)
    assert got["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert got["messages"][:-1] == body["messages"] and len(body["messages"]) == 1
    assert got["continue_final_message"] is True and got["add_generation_prompt"] is False
    assert (got["max_tokens"], got["max_completion_tokens"], got["min_tokens"]) == (38, 28, 0)
    assert (got["temperature"], got["seed"], got["top_p"], got["stream"]) == (0.7, 11, 0.9, True)
    assert continuation(CHAT, chat(max_tokens=12), "x", 12) is None
    done = continuation(COMPLETIONS, {"prompt": ["The sky"], "max_tokens": 9, "stream": True}, " is blue", 2)
    assert done["prompt"] == "The sky is blue" and done["max_tokens"] == 7
    assert "max_tokens" not in continuation(CHAT, chat(), "a", 1)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def event(rid, content=None, role=False, finish=None, usage=None, choices=True) -> dict:
    delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content else {})
    out = {"id": rid, "object": "chat.completion.chunk", "created": 100 if rid == "a" else 200,
           "model": "m" if rid == "a" else "m-other",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []}
    if usage is not None:
        out["usage"] = usage
    return out


def events_of(data: bytes) -> list:
    return [e[len(b"data: "):] for e in data.split(b"\n\n") if e]


def test_the_splice_makes_one_stream_of_two_answers():
    """1. The first answer's events pass as sent, an event cut by a chunk boundary once complete; its engine's
    error event (and the [DONE] after it) is withheld. 2. After the cut, the continuation's role chunk is
    dropped, its ids are the first answer's, its usage counts the whole answer (the text so far is in its
    prompt), one [DONE]. 3. What the results log says of it."""
    s = Splice(CHAT, None, include_usage=True)
    first = sse(event("a", role=True)) + sse(event("a", "Once")) + sse(event("a", " upon"))
    assert s.feed(first[:30]) == b""
    assert s.feed(first[30:]) == first
    assert s.feed(sse({"error": {"message": "EngineCore died", "code": 500}}) + b"data: [DONE]\n\n") == b""
    assert s.error == "EngineCore died" and not s.done and s.tokens == 2
    s.cut("b0:1", "b0:1 sent an error event")
    s.moved("b1:1")
    rest = (sse(event("b", role=True)) + sse(event("b", " a")) + sse(event("b", " time", finish="length"))
            + sse(event("b", usage={"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}, choices=False))
            + b"data: [DONE]\n\n")
    got = events_of(s.feed(rest))
    assert got[-1] == b"[DONE]" and s.done
    events = [json.loads(e) for e in got[:-1]]
    assert [(e["id"], e["created"], e["model"]) for e in events] == [("a", 100, "m")] * 3
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"content": " a"}, {"content": " time"}]
    assert events[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    assert "".join(s.text) == "Once upon a time" and s.tokens == 4
    fields = s.log_fields()
    assert fields["resumed"] and fields["backends"] == ["b0:1", "b1:1"]
    assert (fields["tokens_before"], fields["tokens_after"], fields["completion_tokens"]) == (2, 2, 4)
    assert fields["resume_gap_ms"] is not None and "error event" in fields["resume_cause"]


def test_a_tool_call_under_way_stops_the_splice_and_the_bytes_pass_as_they_come():
    """A tool call makes the stream not resumable. 1. The client asked for usage itself (the proxy added
    nothing): from then on the bytes pass as they come. 2. The proxy asked for the closing usage chunk
    (counted_options): events still pass whole, as sent (an engine's usage on an event too), all but that
    chunk."""
    call = {"id": "a", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"name": "f", "arguments": "{"}}]}, "finish_reason": None}]}
    s = Splice(CHAT, None, include_usage=True)
    data = sse(event("a", role=True)) + sse(call) + b"data: {\"half"
    assert s.feed(data) == data and not s.resumable and "tool call" in s.refused
    assert s.feed(b" an event") == b" an event"
    assert Splice(CHAT, "n > 1").feed(b"raw") == b"raw"
    counted = Splice(CHAT, None)
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    more = {**call, "usage": usage}
    assert counted.feed(sse(event("a", role=True)) + sse(call) + sse(more)[:20]) == \
        sse(event("a", role=True)) + sse(call) and not counted.resumable
    tail = sse(more)[20:] + sse({"id": "a", "created": 1, "model": "m", "choices": [], "usage": usage})
    assert counted.feed(tail + b"data: [DONE]\n\n") == sse(more) + b"data: [DONE]\n\n"
    assert counted.done


def test_the_sim_continues_its_own_answer_as_vllm_does():
    """continue_final_message: the final assistant message is left open and the answer goes on from its
    text (the uninterrupted answer's rest); with add_generation_prompt true too, vLLM's 400."""
    messages = [{"role": "user", "content": "tell me"}]
    whole = protocol.parse("chat", {"messages": messages, "max_tokens": 30}, ["m"], 4096)
    tokens, finish = protocol.output_tokens(whole, 200)
    sent = "".join(tokens[:11])
    body = {"messages": [*messages, {"role": "assistant", "content": sent}], "max_tokens": 19,
            "continue_final_message": True, "add_generation_prompt": False}
    rest = protocol.parse("chat", body, ["m"], 4096)
    assert protocol.output_tokens(rest, 200) == (tokens[11:], finish)
    assert rest.prompt.tokens[-1] != "<|im_end|>" and rest.prompt.tokens[:len(whole.prompt.tokens)] == whole.prompt.tokens
    with pytest.raises(protocol.ApiError, match="Cannot set both"):
        protocol.parse("chat", {**body, "add_generation_prompt": True}, ["m"], 4096)
    # A completion continued: the prompt plus the text so far goes on as the uninterrupted answer does.
    whole = protocol.parse("completion", {"prompt": "The sky over the sea", "max_tokens": 30}, ["m"], 4096)
    tokens, finish = protocol.output_tokens(whole, 200)
    for cut in (1, 7, 13):
        rest = protocol.parse("completion", {"prompt": "The sky over the sea" + "".join(tokens[:cut]),
                                             "max_tokens": 30 - cut}, ["m"], 4096)
        assert protocol.output_tokens(rest, 200) == (tokens[cut:], finish)
    other = protocol.parse("completion", {"prompt": "The sky over the sea the quick model", "max_tokens": 5},
                           ["m"], 4096)
    assert other.continued == "" or other.continued.startswith("the")


def test_trace_shows_the_hop():
    cut = request_block({"attempt": 1, "final": False, "backend": "h:8000", "error": "stream interrupted: gone"})
    assert "(continued elsewhere)" in cut
    block = request_block({"attempt": 2, "final": True, "backend": "h:8001", "resumed": True,
                           "backends": ["h:8000", "h:8001"], "tokens_before": 7, "tokens_after": 13,
                           "resume_cause": "stream interrupted: gone", "resume_gap_ms": 41.0})
    assert "resumed: h:8000 -> h:8001 after 7 tokens" in block and "13 more" in block and "41.0 ms" in block
    assert "not resumed: logprobs" in request_block({"resume": "logprobs asked for"})


def test_the_continuation_goes_where_the_prefix_is_next_never_back():
    """The pool's pick with the failed backend left out: with prefix routing, the backend holding most of
    the conversation after it, rather than the least loaded one; never the one that failed."""
    from proxy.balancer import Balancer
    from proxy.routing import RoutingConfig
    from proxy.routing.prefix import PrefixRoute
    b = Balancer([f"b{i}:1" for i in range(4)], slots=4, queue_max=4,
                 routing=RoutingConfig(min_match_tokens=0, min_match_ratio=0))
    for backend in b.backends.values():
        b.mark(backend, True)
    blocks = list(range(1, 9))
    b.adopt("b0:1", blocks)
    b.adopt("b2:1", blocks[:5])
    first = b.acquire(route=PrefixRoute(blocks))
    assert first.name == "b0:1"
    rest = b.acquire(exclude=[first], over=True, route=PrefixRoute(blocks))
    assert rest.name == "b2:1"
    b.mark(b.backends["b2:1"], False)
    assert b.acquire(exclude=[first], over=True, route=PrefixRoute(blocks)).name not in ("b0:1", "b2:1")


def test_several_tokens_an_event_are_counted_as_the_engine_counts_them():
    """vLLM's --stream-interval (or speculative decoding) puts several tokens in one event: when the events
    carry usage (continuous_usage_stats), the engine's count is what was sent before the cut (the budget
    left is reduced by it, the continuation's usage counts from it), and the tenant is charged that plus the
    continuation's own count; the proxy's own `usage` chunk carries the same count."""
    from types import SimpleNamespace

    from proxy.forward import Outcome, _usage

    def usage(prompt, n):
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    s = Splice(CHAT, None, include_usage=True)
    s.feed(sse(event("a", role=True)) + sse(event("a", "Once upon", usage=usage(5, 3)))
           + sse(event("a", " a time", usage=usage(5, 6))))
    assert (s.tokens, s.sent) == (2, 6)
    s.cut("b0:1", "gone")
    s.moved("b1:1")
    assert s.hops[0].tokens_before == 6
    assert continuation(CHAT, chat(max_tokens=50), "".join(s.text), s.sent)["max_tokens"] == 44
    got = events_of(s.feed(sse(event("b", " there", finish="stop"))
                           + sse(event("b", usage=usage(11, 3), choices=False)) + b"data: [DONE]\n\n"))
    assert json.loads(got[-2])["usage"] == usage(5, 9)
    continued = Outcome(observer=SimpleNamespace(reported_tokens=3, prompt_tokens=11))
    assert _usage(SimpleNamespace(splice=s), continued) == (5, 9)
    assert (s.log_fields()["tokens_before"], s.log_fields()["tokens_after"]) == (6, 3)
    closed = Splice(CHAT, None, include_usage=True)
    closed.feed(sse(event("a", role=True)) + sse(event("a", "Hi", usage=usage(5, 2))) + sse(event("a", finish="stop")))
    last = json.loads(events_of(closed.closing(99))[0])
    assert last["usage"] == usage(5, 2) and last["choices"] == [] and last["id"] == "a"
    assert closed.closing(99) == b""     # [DONE] went out: nothing more


def test_what_was_sent_at_a_cut_is_counted_by_the_next_engines_tokenizer():
    """Found on the real engine: a busy vLLM merges the deltas its API server has not taken yet, so one
    content event is several tokens, and a budget reckoned per event let a resumed answer run past the
    client's max_tokens. 1. A resumable stream is sent with the closing usage chunk asked (not usage on
    every event, which costs the engine's API server some 15% more CPU an event); nothing is added to what
    cannot be continued or asks for it already. 2. At a cut the text sent is counted by the next engine's
    /tokenize: events of three tokens each leave the budget the tokenizer's count leaves. 3. The client who asked for no usage gets none; one who asked gets the
    closing chunk counting the whole answer; the results log says what counted the tokens before the cut."""
    asked = {"include_usage": True, "continuous_usage_stats": False}
    assert counted_options(CHAT, chat()) == asked
    assert counted_options(CHAT, chat(stream_options={"continuous_usage_stats": True})) == asked   # off without include_usage
    assert counted_options(CHAT, chat(stream_options={"include_usage": True})) is None
    assert counted_options(CHAT, chat(stream_options={"include_usage": 1, "continuous_usage_stats": "true"})) is None
    assert counted_options(CHAT, chat(n=2)) is None and counted_options(CHAT, chat(stream=False)) is None
    assert continuation(CHAT, chat(max_tokens=9), "a", 1)["stream_options"] == asked

    def usage(n, prompt=5):
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    for include in (False, True):
        s = Splice(CHAT, None, include_usage=include)
        out = s.feed(sse(event("a", role=True)) + sse(event("a", "One two three")) + sse(event("a", " four five six")))
        assert (s.tokens, s.sent) == (2, 2) and len(events_of(out)) == 3
        assert s.recount(6) == "tokenize" and s.sent == 6
        s.cut("b0:1", "gone", "tokenize")
        s.moved("b1:1")
        assert continuation(CHAT, chat(max_tokens=10), "".join(s.text), s.sent)["max_tokens"] == 4
        rest = events_of(s.feed(sse(event("b", role=True)) + sse(event("b", " seven eight"))
                                + sse(event("b", " nine ten", finish="length"))
                                + sse(event("b", usage=usage(4, 11), choices=False)) + b"data: [DONE]\n\n"))
        assert rest[-1] == b"[DONE]" and s.sent == 10
        closing = [json.loads(e) for e in rest[:-1] if not json.loads(e)["choices"]]
        assert [c["usage"] for c in closing] == ([usage(10)] if include else [])
        assert all("usage" not in json.loads(e) for e in rest[:-1] if json.loads(e)["choices"])
        fields = s.log_fields()
        assert (fields["tokens_before"], fields["tokens_after"], fields["tokens_counted_by"]) == (6, 4, "tokenize")
    # What the engine could not count leaves the events' count; the engine's own usage on every event
    # (the client asked for it) is not counted again.
    s = Splice(CHAT, None)
    s.feed(sse(event("a", role=True)) + sse(event("a", "One two")))
    assert s.recount(None) == "events" and s.sent == 1
    s = Splice(CHAT, None, include_usage=True)
    s.feed(sse(event("a", role=True)) + sse(event("a", "One two", usage=usage(2))))
    assert s.recount(7) == "usage" and s.sent == 2
    assert budget_left(chat(max_tokens=10), 9) and not budget_left(chat(max_tokens=10), 10)
    assert not budget_left(chat(max_completion_tokens=4, max_tokens=10), 4) and budget_left(chat(), 10 ** 6)


def test_a_stream_cut_before_its_usage_counts_what_it_sent_and_a_spent_budget_ends_with_length():
    """1. A stream cut (or left by its client) before the closing usage chunk the proxy asked for, and not
    resumed: its tenant is charged the tokens it sent, not 0. 2. One the proxy closes because its budget is
    spent ends as an engine's would: a finish_reason `length`, the usage chunk when asked for, [DONE]."""
    from types import SimpleNamespace

    from proxy.forward import Outcome, _usage
    s = Splice(CHAT, None)
    s.feed(sse(event("a", role=True)) + sse(event("a", "One two three")) + sse(event("a", " four")))
    s.recount(4)
    unread = Outcome(observer=SimpleNamespace(reported_tokens=None, prompt_tokens=None))
    assert _usage(SimpleNamespace(splice=s), unread) == (None, 4)
    for include in (False, True):
        s = Splice(CHAT, None, include_usage=include)
        s.feed(sse(event("a", role=True)) + sse(event("a", "Hi")))
        end = [json.loads(e) for e in events_of(s.closing(7))[:-1]]
        assert end[0]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}] and end[0]["id"] == "a"
        assert [e["usage"] for e in end[1:]] == ([{"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}]
                                                 if include else [])
    done = Splice(COMPLETIONS, None)
    done.feed(sse({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}))
    assert done.closing(7) == b"data: [DONE]\n\n"      # its finish went out: nothing more but [DONE]


def test_the_text_sent_is_counted_alone_as_the_engine_wrote_it():
    """The /tokenize request of a cut: the text alone, no special tokens, the model kept (no template, no
    images, nothing of the sampling). On the sim, as on an engine whose tokenizer reads its own text back,
    the count is the tokens generated, and a continuation's prompt counts them so too (its usage less the
    tokens before the cut is the first prompt's)."""
    body = chat(max_tokens=50, temperature=0.7, chat_template_kwargs={"enable_thinking": False})
    assert tokenize_request(body, "Once upon") == {"model": "m", "prompt": "Once upon", "add_special_tokens": False}
    assert tokenize_request({"prompt": "x"}, " y") == {"prompt": " y", "add_special_tokens": False}
    messages = [{"role": "user", "content": "tell me a story about the sea"}]
    whole = protocol.parse("chat", {"messages": messages, "max_tokens": 30}, ["m"], 4096)
    tokens, _ = protocol.output_tokens(whole, 200)
    for cut in (1, 5, 17):
        text = "".join(tokens[:cut])
        assert protocol.tokenize(tokenize_request({"model": "m"}, text), ["m"], 4096)["count"] == cut
        rest = protocol.parse("chat", continuation(CHAT, {"messages": messages, "max_tokens": 30}, text, cut),
                              ["m"], 4096)
        assert rest.prompt_tokens - cut == whole.prompt_tokens
    prompt = "The sky over the sea"
    whole = protocol.parse("completion", {"prompt": prompt, "max_tokens": 30}, ["m"], 4096)
    tokens, _ = protocol.output_tokens(whole, 200)
    for cut in (1, 7):
        text = "".join(tokens[:cut])
        assert protocol.tokenize({"prompt": text}, ["m"], 4096)["count"] == cut
        rest = protocol.parse("completion", {"prompt": prompt + text, "max_tokens": 30 - cut}, ["m"], 4096)
        assert rest.prompt_tokens - cut == whole.prompt_tokens
    assert protocol.tokenize({"prompt": "Some other text"}, ["m"], 4096)["count"] == 4     # 4 characters a token
    with pytest.raises(protocol.ApiError, match="does not exist"):
        protocol.tokenize({"model": "other", "prompt": "x"}, ["m"], 4096)


def compact(obj) -> bytes:
    """An event as vLLM writes it (pydantic's JSON: compact, UTF-8 as it is)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def test_the_closing_usage_the_client_did_not_ask_for_is_all_it_does_not_get():
    """The proxy asks for the closing usage chunk; a client that did not ask gets every other event as the
    engine wrote it, byte for byte (a text with escapes, a number as written, an engine's usage on an
    event), and not that chunk; a closing chunk whose usage is null is none the proxy asked for: it goes
    on as sent."""
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}
    events = [compact(event("a", role=True)), compact(event("a", "l\u00e9 \"quoted\" \\ {braces} [x]")),
              b'data: {"id":"a","x":1.50e2,"choices":[{"index":0,"delta":{"content":"y"}}],"usage":{"p":1}}\n\n',
              compact({**event("a", "u"), "usage": usage})]
    closing = compact({"id": "a", "created": 1, "model": "m", "choices": [], "usage": usage})
    for include in (False, True):
        s = Splice(CHAT, None, include_usage=include)
        got = s.feed(b"".join(events) + closing + b"data: [DONE]\n\n")
        assert got == b"".join(events) + (closing if include else b"") + b"data: [DONE]\n\n"
    for resumable in (True, False):
        s = Splice(CHAT, None if resumable else "n > 1")
        s.strip = True
        null = b'data: {"id":"a","choices":[],"usage":null}\n\n'
        assert s.feed(null) == null


def test_the_continuation_is_built_from_the_one_parse(monkeypatch):
    """The continuation's body comes from the body's parse, its long strings (an image) copied back byte
    for byte, never decoded: json.loads never sees the body; a numeric `user` the proxy made a string is a
    string in the continuation too."""
    import asyncio
    from types import SimpleNamespace

    from proxy import forward
    from proxy.body import LONG_STRING, parse
    image = "data:image/png;base64," + "QUJD\\u00e9" * LONG_STRING
    raw = ('{"model": "m", "stream": true, "max_tokens": 20, "user": 42, "messages": [{"role": "user", '
           '"content": [{"type": "image_url", "image_url": {"url": "' + image + '"}}]}]}').encode()
    parsed = parse(raw)
    assert len(parsed.spans) == 1
    parsed.with_user("42")
    splice = Splice(CHAT, None)
    splice.feed(sse(event("a", role=True)) + sse(event("a", "It is")))
    ex = SimpleNamespace(splice=splice, request=SimpleNamespace(path=CHAT), parsed=parsed, body=raw)
    proxy = SimpleNamespace(config=SimpleNamespace(limits=SimpleNamespace(inline_kb=1 << 20)))
    expected = continuation(CHAT, {**json.loads(raw), "user": "42"}, "It is", 1)
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: (_ for _ in ()).throw(AssertionError("decoded"))
                        if s is raw else loads(s, *a, **k))
    body = asyncio.run(forward._continuation_body(ex, proxy))
    assert image.encode() in body
    assert loads(body) == expected


def test_the_events_of_a_read_read_at_once_are_what_they_are_one_by_one(monkeypatch):
    """The common shape of a stream (a first answer's content events, usage on each) is read a whole read
    at a time (Splice._run); anything else event by event. 1. Streams of every kind the proxy relays (chat
    and completions; usage the proxy asked for, the client asked for, or none; written as the sim and as
    vLLM write them; texts with escapes, non-ASCII, the text `"usage"` or `data: {`; an error event, a
    second choice, a comment, a usage not last), cut into reads at random places: the bytes for the client,
    the text and tokens a continuation starts from, the usage counted and the results log's summary are
    those of the events read one by one. 2. The reads of the common shape were read at once."""
    import random

    from proxy.results_log import ResponseObserver

    words = [" a", " b\\c", ' "q"', " \u00e9", " \u65e5\u672c", "\n", " usage", ' "usage"', " \U0001f600", " data: {",
             "\t", ' "error"', "x" * 300]
    odd = [b'data: {"error":{"message":"boom","code":500}}\n\n', b": ping\n\n",
           b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"e"},"finish_reason":null}],"error":"x"}\n\n',
           b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"y"},"finish_reason":null},'
           b'{"index":1,"delta":{"content":"z"},"finish_reason":null}]}\n\n',
           b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"z"},"finish_reason":null}],'
           b'"usage":{"prompt_tokens":1},"x":1}\n\n']
    rng = random.Random(7)

    def stream(kind: str, include: bool, continuous: bool) -> bytes:
        job = protocol.Job(kind=kind, model="m", prompt_tokens=9, images=0, max_tokens=40, stream=True,
                           include_usage=include, thinking=False, seed=1, continuous_usage=continuous,
                           details=True, cached_tokens=3)
        n = rng.randint(1, 40)
        events = [protocol.chunk(job, "c", 1, None, role=True)] if kind == "chat" else []
        events += [protocol.chunk(job, "c", 1, rng.choice(words), "length" if i == n - 1 else None, tokens=i + 1)
                   for i in range(n)]
        events += [protocol.usage_chunk(job, "c", 1, n)] if include else []
        if rng.random() < 0.5:
            events = [compact(json.loads(e[len(b"data: "):])) for e in events]
        if rng.random() < 0.2:
            events.insert(rng.randrange(len(events)), rng.choice(odd))
        return b"".join(events) + protocol.DONE

    def relayed(reads, path, include, continuous) -> tuple:
        s, seen = Splice(path, None, include), ResponseObserver(200, True)
        return [(s.feed(r, seen), "".join(s.text), s.tokens, s.reported, s.prompt_tokens, s.refused, s.done,
                 s.finished, s.usage_out, seen.reported_tokens, seen.cached_tokens, seen.summary()) for r in reads]

    at_once = 0
    run = Splice._run
    for _ in range(200):
        kind = rng.choice(["chat", "completion"])
        include, continuous = rng.choice([(False, False), (True, False), (True, True)])
        asked = rng.random() < 0.7      # by the proxy (counted_options): the closing usage chunk
        data = stream(kind, include or asked, continuous)
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 25))))
        reads = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        path = CHAT if kind == "chat" else COMPLETIONS
        monkeypatch.setattr(Splice, "_run", lambda self, block, observer=None: None)
        one_by_one = relayed(reads, path, include, continuous)
        monkeypatch.setattr(Splice, "_run", run)
        counted = []
        monkeypatch.setattr(Splice, "_run", lambda self, block, observer=None: counted.append(
            run(self, block, observer)) or counted[-1])
        assert relayed(reads, path, include, continuous) == one_by_one
        at_once += sum(r is not None for r in counted)
    assert at_once > 500
