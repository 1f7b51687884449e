"""A stream that survives its instance: an answer cut after its first chunk is finished on another
instance, in the same client stream (issue 38; NVIDIA Dynamo calls it request migration).

Pure pieces, no I/O (proxy/forward.py does the sending): why a request cannot be continued honestly
(`refusal`); what counts the tokens sent at a cut (the text so far, by the next
engine's own tokenizer, `tokenize_request`); the continuation request (`continuation`: vLLM's own `continue_final_message` for
chat, the prompt plus the text so far for completions, the token budget reduced by what was sent); and
the splicer (`Splice`), which reads the stream as it passes (a read of the common shape at once, any other
event by event), withholds an engine's error event, and makes the continuation's events look like the
rest of the first answer: the first answer's `id`, `created` and `model` on every chunk, no second role
chunk, one `[DONE]`, a usage chunk counting the whole answer.
"""
from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import dataclass, field

from .body import loads

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Requests whose output a continuation cannot reproduce honestly, by key: what the partial text cannot
# carry over (several choices, per-token probabilities) or what it may already have broken (a grammar).
GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs", "guided_decoding_backend")
DONE = b"data: [DONE]\n\n"
BUDGETS = ("max_tokens", "max_completion_tokens")   # a request's token budgets, less what was sent at a cut
_EVENT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))   # an event written anew: compact, UTF-8
_USAGE = b'"usage"'
_VALUE = json.JSONDecoder()

# The common shape of a stream's events, read a whole read at a time (Splice._run) instead of event by event:
# `data: {...}` on one line each, the first choice index 0 with its content as the engine's JSON string (its
# body: one pattern per character, the alternatives disjoint, so a failed match costs one pass), usage
# (when there) the event's last member, an object of counts. A raw `"` is never inside a JSON string (it is
# escaped there), so a pattern that holds one matches the event's own keys, never its text.
_STRING = rb'([^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*)'
_CONTENT = {True: re.compile(rb'"choices":\[\{"index":0,"delta":\{"content":"' + _STRING + rb'"\}'),
            False: re.compile(rb'"choices":\[\{"index":0,"text":"' + _STRING + rb'"')}
_COUNT = rb'(?:-?(?:0|[1-9][0-9]*)|null)'
_COUNTS = rb'\{(?:"[a-z_]+":' + _COUNT + rb'(?:,"[a-z_]+":' + _COUNT + rb')*)?\}'
_USAGE_VALUE = rb'(?:"[a-z_]+":(?:' + _COUNT + rb'|' + _COUNTS + rb'))'
# `,"usage":` and its value, when it is the event's last member (as vLLM writes it), found in one pass.
_USAGE_MEMBER = re.compile(rb',"usage":(null|\{(?:' + _USAGE_VALUE + rb'(?:,' + _USAGE_VALUE + rb')*)?\})(?=\}\n\n)')
_RUN_START = b"data: {"
_NEXT_EVENT = b"\n\ndata: {"


@dataclass(frozen=True)
class ResumeConfig:
    """The proxy's `resume` section: whether a cut stream is continued, how many times, the stall bound."""

    enabled: bool = True
    max_attempts: int = field(default=1, metadata={"bounds": (1, 8)})
    stall_s: float = field(default=30.0, metadata={"bounds": (0.1, 3600)})


def refusal(path: str, request: dict | None) -> str | None:
    """Why a streamed request cannot be continued on another instance (a sentence), or None when it can."""
    if path not in (CHAT, COMPLETIONS) or not isinstance(request, dict):
        return "not a chat or completions request the proxy could read"
    if not request.get("stream"):
        return "not streamed"
    n = request.get("n")
    if n not in (None, 1) or request.get("best_of") not in (None, 1):
        return "n > 1: several choices share the stream"
    if request.get("logprobs") or request.get("top_logprobs") or request.get("prompt_logprobs"):
        return "logprobs asked for: the continuation's would not be the first answer's"
    for key in GUIDED:
        value = request.get(key)
        if value and not (key == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            return f"{key}: the text so far may already have left the grammar"
    if path == CHAT:
        if not isinstance(request.get("messages"), list):
            return "no list of messages"
        if request.get("continue_final_message") or request.get("echo"):
            return "the request continues or echoes a message already"
    elif request.get("echo") or request.get("suffix"):
        return "echo or suffix: the prompt is part of the answer"
    elif not _text_prompt(request.get("prompt")):
        return "the prompt is not one text (token ids, or several prompts)"
    return None


def _json_object(payload: bytes) -> dict | None:
    """An SSE event's data as a JSON object, None when it is not one."""
    try:
        event = loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def json_string(body: bytes) -> str:
    """The text of a JSON string whose body (between its quotes) is body, as the engine sent it."""
    if b"\\" not in body:
        return body.decode("utf-8", "replace")
    try:
        return json.loads(b'"' + body + b'"')
    except ValueError:
        return json.loads((b'"' + body + b'"').decode("utf-8", "replace"))


def _text_prompt(prompt) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))


def counted_options(path: str, request: dict | None) -> dict | None:
    """The stream_options a resumable stream is sent upstream with when the client's lack the closing usage
    chunk: that chunk (include_usage), so the whole answer's tokens are the engine's count (the results
    log's, a tenant's charge, a continuation's); not usage on every event (continuous_usage_stats), which
    costs the engine's API server some 15% more CPU an event. The splice drops the chunk the client did
    not ask for. None: not resumable, or asked for already."""
    if refusal(path, request) is not None or usage_asked(request)[0]:
        return None
    options = request.get("stream_options")
    return {**(options if isinstance(options, dict) else {}), "include_usage": True, "continuous_usage_stats": False}


def usage_asked(request: dict) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as vLLM 0.32 reads a request's stream_options: both off by
    default, a value pydantic takes as true (true, 1, "true"...) on, continuous only with include_usage."""
    options = request.get("stream_options")
    options = options if isinstance(options, dict) else {}
    include = _true(options.get("include_usage"))
    return include, include and _true(options.get("continuous_usage_stats"))


def _true(value) -> bool:
    """Whether pydantic's lax bool reads value as true (its false values and anything it refuses: false)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "t", "yes", "y", "on")
    return value is True or (type(value) in (int, float) and value == 1)


def continuation(path: str, request: dict, text: str, tokens: int) -> dict | None:
    """The request that finishes an answer of which text (tokens of it) reached the client: chat, the
    messages plus an assistant message of text, continued (vLLM's continue_final_message, no generation
    prompt); completions, the prompt plus text. The token budget is reduced by tokens; sampling settings
    and seed kept. None: the budget is spent (the answer is whole as it is)."""
    if not budget_left(request, tokens):
        return None
    body = copy.deepcopy(request)
    for key in BUDGETS:
        if _count(body.get(key)):
            body[key] -= tokens
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - tokens)
    if path == CHAT:
        body["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        prompt = body["prompt"]
        body["prompt"] = (prompt if isinstance(prompt, str) else prompt[0]) + text
    options = counted_options(path, request)
    if options is not None:
        body["stream_options"] = options
    return body


def budget_left(request: dict, tokens: int) -> bool:
    """Whether the token budgets (BUDGETS) leave room after tokens were sent."""
    return all(not _count(request.get(key)) or request[key] - tokens > 0 for key in BUDGETS)


def _count(value) -> bool:
    """Whether value is a count of tokens (an int; JSON's true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def tokenize_request(request: dict, text: str) -> dict:
    """The /tokenize request that counts text, an answer cut after it, as the engine's tokenizer reads it:
    the text alone, no special tokens (vLLM's TokenizeCompletionRequest). A model's own text reads back
    as the tokens it generated but where a sampled token split a word otherwise than the tokenizer would;
    alone, it is counted without the chat template (whose generation prompt may hold more than the
    assistant's header: a reasoning model's empty think block) and without the prompt's images."""
    model = request.get("model")
    return {**({"model": model} if isinstance(model, str) else {}), "prompt": text, "add_special_tokens": False}


@dataclass
class Hop:
    """One move of the stream to another instance."""

    failed: str          # the backend that broke off
    backend: str         # the one that took the rest
    tokens_before: int   # tokens the client had when it broke off
    why: str             # how it broke off
    t_cut: float         # when the proxy saw it (time.monotonic())
    counted: str = "events"  # what counted tokens_before (Splice.recount): usage, tokenize, events
    t_before: float = 0.0  # when the last event before the cut went out
    gap_s: float | None = None   # from the last event before the cut to the first after it (the client's gap)


class Splice:
    """One streamed answer as it passes: what reached the client (text, tokens, ids), and the events of a
    continuation made to look like the rest of it. refused: why it cannot be continued (None: it can);
    events then pass as bytes untouched."""

    def __init__(self, path: str, refused: str | None, include_usage: bool = False):
        self.chat = path == CHAT
        self.refused = refused
        self.include_usage = include_usage    # the client asked for the closing usage chunk
        # The proxy asked for the closing usage chunk (counted_options): it does not reach the client.
        self.strip = refused is None and not include_usage
        self.ids: dict | None = None      # id, created, model of the first answer's first event
        self._text: list[str | bytes] = []    # the text sent: str, or a read's JSON string bodies (Splice._run)
        self.tokens = 0                   # content events sent (one token each, as vLLM streams by default)
        self.uncounted = 0                # tokens more than the events, counted at a cut (recount)
        self.reported: int | None = None  # completion_tokens of the last usage that went out (the engine's count)
        self.usage_out = False            # the closing usage chunk (no choices) went out
        self.finished = False             # a finish_reason went out: the answer is whole but for [DONE]
        self.done = False                 # `data: [DONE]` went out
        self.error: str | None = None     # an engine's error event, withheld
        self.hops: list[Hop] = []
        self.last_write = 0.0             # time.monotonic() of the last event written to the client
        self.prompt_tokens: int | None = None   # the whole answer's prompt, from a continuation's usage
        self.declined: str | None = None  # cut, and not continued: why (the results log's `resume`)
        self.fed = False                  # an SSE answer passed through it (one to continue)
        self._pending = b""
        self._tail = b""                  # the last bytes passed untouched: where `data: [DONE]` is seen

    @property
    def resumable(self) -> bool:
        return self.refused is None

    @property
    def sent(self) -> int:
        """Tokens of the answer the client has: the engine's own count when its events carried usage (the
        client asked vLLM's stream_options.continuous_usage_stats), else one per content event and what a
        cut's count found more (recount): one per event alone is short when an event carries several
        tokens (a busy API server merges the deltas it has not taken yet; --stream-interval)."""
        counted = self.tokens + self.uncounted
        return counted if self.reported is None else max(self.reported, counted)

    def recount(self, tokens: int | None) -> str:
        """At a cut: the text sent as the next engine's tokenizer counts it (tokens; None: it could not
        say). What counted the tokens sent: usage (the engine's, every event carried it), tokenize, or
        events (one a content event: short when one carries several)."""
        if self.reported is not None:
            return "usage"
        if tokens is None:
            return "events"
        self.uncounted = max(self.uncounted, tokens - self.tokens)
        return "tokenize"

    @property
    def text(self) -> list[str]:
        """The answer's text that reached the client, in pieces (what a continuation carries on from)."""
        return [p if isinstance(p, str) else json_string(p) for p in self._text]

    def feed(self, chunk: bytes, observer=None) -> bytes:
        """The bytes of chunk to write to the client now: complete events only (the rest waits for the
        next chunk), a continuation's rewritten, an error event withheld (and what follows it). observer:
        the results log's (proxy.results_log.ResponseObserver), given every byte of chunk, each event
        parsed once for both (the caller feeds it itself when this is not resumable). The events of the
        common shape are read a whole read at a time (_run); the rest one by one."""
        if not self.resumable and not self.strip:
            return self._passed(chunk)
        self.fed = True
        data = self._pending + chunk
        end = data.rfind(b"\n\n") + 2
        if end == 1:
            self._pending = data
            return b""
        block, self._pending = data[:end], data[end:]
        if self.ids is None and self.resumable and not self.hops:   # the first event: the ids, a role chunk
            first, _, block = block.partition(b"\n\n")
            out = self._events(first + b"\n\n", observer)
        else:
            out = []
        if block:
            out += self._read(block, observer)
        if not self.resumable and not self.strip:    # it stopped being resumable (a tool call began): bytes pass as they come
            if observer is not None:
                observer.feed(self._pending)
            out.append(self._pending)
            self._pending = b""
            self._passed(b"".join(out))
        if out:
            self.last_write = time.monotonic()
            hop = self.hops[-1] if self.hops else None
            if hop is not None and hop.gap_s is None:
                hop.gap_s = self.last_write - hop.t_before
        return b"".join(out)

    def _events(self, block: bytes, observer=None) -> list[bytes]:
        """The bytes for the client of block's events (each ends with a blank line), read one by one."""
        events = block.split(b"\n\n")
        events.pop()
        out = []
        for i, raw in enumerate(events):
            if self.error is not None or self.done:
                if observer is not None:
                    observer.feed(b"".join(e + b"\n\n" for e in events[i:]))
                break
            if self.resumable or self.strip:
                passed = self._event(raw, observer)
            else:
                passed = raw + b"\n\n"
                if observer is not None:
                    observer.feed(passed)
            if passed is not None:
                out.append(passed)
        return out

    def _read(self, block: bytes, observer=None) -> list[bytes]:
        """The bytes for the client of block's events: read at once (_run) when they can be; else the
        events before the first with a finish_reason at once and the rest (the answer's end: the finish,
        the usage chunk, [DONE], often in one read with many before them) one by one; else one by one."""
        run = self._run(block, observer)
        if run is not None:
            return [run]
        finish = block.find(b'"finish_reason":"')
        end = block.rfind(b"\n\n", 0, finish) + 2 if finish != -1 else 0
        run = self._run(block[:end], observer) if end > 2 else None
        if run is not None:
            return [run, *self._events(block[end:], observer)]
        return self._events(block, observer)

    def _run(self, block: bytes, observer=None) -> bytes | None:
        """block's events for the client, read at once, when every one is of the common shape (a first
        answer's content events: one choice, index 0, a content and no finish_reason, no error, each on one
        `data: ` line, usage its last member if any), as a C pass or two each (counts, two patterns) instead
        of a parse and Python work per event: the contents counted and kept as sent (decoded when a
        continuation or the results log needs them), the last usage parsed. None: not that shape (block
        then goes event by event)."""
        if self.hops or self.error is not None or self.done or self.ids is None or not self.resumable:
            return None
        n = block.count(_NEXT_EVENT) + 1
        if not block.startswith(_RUN_START) or block.count(b"\n") != 2 * n or b'"error"' in block:
            return None
        if block.count(b'"index"') != n or block.count(b'"finish_reason":null') != n:
            return None     # a second choice, a finish
        if not self.chat and (b'"tool_calls"' in block or b'"reasoning' in block):
            return None     # (a chat's delta of the shape holds its content alone)
        contents = _CONTENT[self.chat].findall(block)
        if len(contents) != n:
            return None
        usage = None
        if _USAGE in block:
            last = _USAGE_MEMBER.match(block, block.rfind(b',"usage":'))
            if last is None:
                return None
            usage = _VALUE.scan_once(last.group(1).decode(), 0)[0]   # ASCII by its pattern: one C call
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    self.reported = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    self.prompt_tokens = usage["prompt_tokens"]
        said = n - contents.count(b"")
        self.tokens += said
        if said:
            self._text.append(b"".join(contents))
        if observer is not None:
            observer.take_run(contents, usage, said)
        return block

    def _passed(self, data: bytes) -> bytes:
        """data, passed untouched (the stream is no longer read event by event), its end still noticed:
        a tool call's answer ends with `data: [DONE]` like any other."""
        if data:
            self._tail = (self._tail + data)[-2 * len(DONE):]
            self.done = self.done or self._tail.rstrip().endswith(DONE.rstrip())
        return data

    def pending(self) -> bytes:
        """The start of an event not yet complete (what a stream that ends here leaves unread)."""
        return self._pending

    def _event(self, raw: bytes, observer=None) -> bytes | None:
        """One event's bytes for the client (None: withheld or dropped); observer takes it first, as sent."""
        data = raw.strip()
        payload = data[5:].strip() if data.startswith(b"data:") else None
        event = _json_object(payload) if payload is not None and payload != b"[DONE]" else None
        if observer is not None:
            if event is not None and b"\n" not in data:
                observer.take_event(event)      # the one parse, before a continuation's rewrite
            else:
                observer.feed(raw + b"\n\n")    # [DONE], a comment, several lines: its own line by line
        if payload is None:
            return raw + b"\n\n" if data else None
        if payload == b"[DONE]":
            self.done = True
            return DONE
        if event is None:
            return raw + b"\n\n"
        if not self.resumable:      # no longer read for a continuation (a tool call began): passed as sent
            return None if self._unasked(event) else raw + b"\n\n"
        if "error" in event or event.get("object") == "error":
            err = event.get("error", event)
            self.error = err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
            return None
        if self.ids is None:
            self.ids = {k: event.get(k) for k in ("id", "created", "model")}
        if self.hops and not self._rewrite(event):
            return None
        self._absorb(event)
        if self._unasked(event):
            return None
        self.usage_out = self.usage_out or (isinstance(event.get("usage"), dict) and not event.get("choices"))
        if not self.hops:       # the engine's bytes as sent: nothing in the event changed
            return raw + b"\n\n"
        return b"data: " + _EVENT.encode(event).encode() + b"\n\n"

    def _unasked(self, event: dict) -> bool:
        """Whether event is the closing usage chunk (no choices) the proxy asked for and the client did not
        (counted_options): it goes no further than the proxy."""
        return self.strip and not event.get("choices") and isinstance(event.get("usage"), dict)

    def _rewrite(self, event: dict) -> bool:
        """Make a continuation's event the first answer's: its ids, no second role, the whole usage; False:
        drop it (the role chunk that opens every chat stream)."""
        event.update(self.ids)
        usage = event.get("usage")
        if isinstance(usage, dict):
            before = self.hops[-1].tokens_before   # the text so far is in the continuation's prompt
            prompt = usage.get("prompt_tokens")
            if isinstance(prompt, int):   # counted once, as output
                usage["prompt_tokens"] = max(0, prompt - before)
            if isinstance(usage.get("completion_tokens"), int):
                usage["completion_tokens"] += before
            if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and "role" in delta:
                del delta["role"]
                if not delta.get("content") and not choice.get("finish_reason") and not delta.get("tool_calls"):
                    return False
        return True

    def _absorb(self, event: dict) -> None:
        """Take the event's text and count its token; what it shows that a continuation cannot carry over
        (a tool call, reasoning streamed apart, a second choice) makes the stream not resumable; its usage
        (a continuation's rewritten already: the whole answer's) is the count of what was sent."""
        usage = event.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.reported = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.refused = "several choices share the stream"
            delta = choice.get("delta") if self.chat else choice
            delta = delta if isinstance(delta, dict) else {}
            if delta.get("tool_calls"):
                self.refused = "a tool call was in progress: its arguments cannot be continued as text"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.refused = "reasoning streamed apart (a reasoning parser): the raw text to continue is unknown"
            content = delta.get("content") if self.chat else delta.get("text")
            if isinstance(content, str) and content:
                self._text.append(content)
                self.tokens += 1
            if choice.get("finish_reason"):
                self.finished = True

    def cut(self, failed: str, why: str, counted: str = "events") -> None:
        """The stream broke off at failed: a hop begins (its backend named by `moved`); counted: what
        counted the tokens sent (recount)."""
        self._pending = b""     # a half event of the instance that died is never completed
        self.error = None
        now = time.monotonic()
        self.hops.append(Hop(failed, "", self.sent, why, now, counted=counted, t_before=self.last_write or now))

    def moved(self, backend: str) -> None:
        """The hop's continuation goes to backend."""
        self.hops[-1].backend = backend

    def closing(self, prompt_tokens: int) -> bytes:
        """What ends a stream the proxy closes itself (the answer was whole, or its budget spent, when the
        instance broke off): a finish_reason `length` when none went out (the budget was spent), the usage
        chunk when one was asked for and none went out (prompt_tokens: the engine's count when an event
        told it, else the caller's reckoning), then [DONE]; nothing once [DONE] went out."""
        if self.done:
            return b""
        self.done = True
        if self.ids is None:
            return DONE
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        out = b""
        if not self.finished:
            choice = {"index": 0, **({"delta": {}} if self.chat else {"text": ""}), "finish_reason": "length"}
            out = b"data: " + _EVENT.encode({**self.ids, "object": kind, "choices": [choice]}).encode() + b"\n\n"
            self.finished = True
        if not self.include_usage or self.usage_out:
            return out + DONE
        prompt = prompt_tokens if self.prompt_tokens is None else self.prompt_tokens
        usage = {"prompt_tokens": prompt, "completion_tokens": self.sent, "total_tokens": prompt + self.sent}
        event = {**self.ids, "object": kind, "choices": [], "usage": usage}
        return out + b"data: " + _EVENT.encode(event).encode() + b"\n\n" + DONE

    def log_fields(self) -> dict:
        """The results log's fields of a stream cut by its instance: how it was resumed, or why not."""
        if not self.hops:
            return {} if self.declined is None else {"resumed": False, "resume": self.declined}
        first = self.hops[0]
        gaps = [h.gap_s for h in self.hops if h.gap_s is not None]
        return {"resumed": True, "backends": [first.failed, *(h.backend for h in self.hops)],
                "tokens_before": first.tokens_before, "tokens_after": self.sent - first.tokens_before,
                "completion_tokens": self.sent, "tokens_counted_by": first.counted, "resume_cause": first.why,
                **({} if self.declined is None else {"resume": self.declined}),
                "resume_gap_ms": round(max(gaps) * 1000, 1) if gaps else None}
