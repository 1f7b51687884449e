"""The request path: pick a backend, count it, read the body, try it (and others), stream the answer back;
whatever ends a request, it is settled once (_settle): counted, its final results-log line, its span."""
from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import math
import secrets
import time
from dataclasses import dataclass, field

from aiohttp import web

from .admission import DEFAULT, Account, Tenant
from .clients import CUT
from .balancer import Backend, Balancer, QueueFull, QueueTimeout, TenantFull
from .body import Parsed, Refused, loads, parse
from .fixups import numeric_user
from .models import NO_MODEL
from .results_log import LOGGED_PATHS, ResponseObserver, trace_id_of, user_value, utc_now_ms
from .resume import Splice, budget_left, continuation, counted_options, refusal, tokenize_request, usage_asked
from .routing import Route
from .state import PROXY
from .tracing import NOT_SAMPLED, SAMPLED, chance, new_span_id, new_trace_id, parse_traceparent, sampled
from .upstream import Answer, Broken, BrokenBody, ConnectTimeout, Disconnected, Unreachable, UpstreamError

# Hop-by-hop headers (RFC 9110 7.6.1) never cross the proxy; length and encoding are the proxy's own.
HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Proxy-Connection"))
RETRY_STATUSES = frozenset({502, 503})
# What vLLM's API server answers (500) once its EngineCore died, until it exits: the engine is gone, not the
# request at fault, so the answer is held back for another backend like a 502/503 and the backend taken out.
ENGINE_DEAD = b"EngineCore encountered an issue"
ERROR_BODY_BYTES = 1024 * 1024   # a 502/503 body kept to hand on when no other backend is left
WHOLE_BODY_BYTES = 8 * 1024 * 1024  # a non-SSE answer up to this size is read whole, then sent in one write
CLIENT_CLOSED = 499              # nginx's status for "the client went away first"
RETRY_AFTER_FULL_S = 1           # a full queue empties by a slot at a time: come back soon
RETRY_AFTER_TIMEOUT_S = 5        # a request waited its whole queue.timeout_s: the fleet is overloaded
NO_BACKEND = "none"              # the metrics label of answers no backend saw (401, 413, 503)
# The client's own are replaced by the attempt's (tracestate passes through; the request id is the client's
# when it sent one, whatever its spelling); host and length are the proxy's.
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "traceparent", "x-request-id"}
TRACE_ID = "otel_trace_id"      # the request's key of its W3C trace id (the X-Trace-Id header, app.py)
TOKEN_BYTES = 4                  # a prompt not yet read is reckoned at its body's length over this
WATCH_S = 1.0                    # a resumable stream's quiet upstream is looked at this often (stall, taken out)
TOKENIZE_S = 10.0                # the bound of a cut's count of what was sent (the next engine's /tokenize)
TOKENIZE_BYTES = 16 * 1024 * 1024   # of its answer, read (the text's token ids: some 8 bytes each)


_ID_PREFIX = secrets.token_hex(8)   # this process's own: ids stay unique across restarts and workers
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """A new request id, 32 hex digits like a uuid4's, without a system call per request."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class _Kept(dict):
    """of(key) for each key, worked out once and kept: what a request would otherwise work out again from
    the same few texts (a header name's spelling, a backend's address and a target). Past most keys, or
    for a key longer than longest (a client making them up), a new one's answer is worked out and not kept:
    what a client sends can fill it with most keys of longest characters at most."""

    def __init__(self, of, most: int, longest: int):
        super().__init__()
        self.of, self.most, self.longest = of, most, longest

    def __missing__(self, key):
        value = self.of(key)
        if len(self) < self.most and len(key) <= self.longest:
            self[key] = value
        return value


# Whether a header crosses the proxy, by its name as sent (the lowercasing and the set lookup once per spelling).
_UPSTREAM = _Kept(lambda name: name.lower() not in NOT_FORWARDED, 1024, 64)
_DOWNSTREAM = _Kept(lambda name, dropped=HOP_BY_HOP | {"content-length"}: name.lower() not in dropped, 1024, 64)


def upstream_headers(headers) -> dict:
    """The client's headers as sent to the backend (the client's API key stays with the proxy)."""
    return {k: v for k, v in headers.items() if _UPSTREAM[k]}


def downstream_headers(headers) -> dict:
    """The backend's headers as sent to the client."""
    return {k: v for k, v in headers.items() if _DOWNSTREAM[k]}


def json_error(status: int, message: str, kind: str, headers: dict | None = None) -> web.Response:
    """An OpenAI-style JSON error response."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


class ClientGone(Exception):
    """The client closed its connection while the answer was being written to it."""


class Interrupted(Exception):
    """A resumable stream's backend went quiet past proxy.resume.stall_s, or was taken out by its health
    check, mid-answer. kind: the upstream error's label (stalled, taken_out)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class Outcome:
    """How one attempt on one backend ended."""

    status: int = 0
    error: str | None = None
    retryable: bool = False        # nothing reached the client and another backend may do better
    sent: bool = False             # the response was started toward the client
    observer: ResponseObserver | None = None
    buffered: tuple | None = None  # (status, headers, body) of a 502/503 held back for a retry
    attempt_ms: float = 0.0
    whole: web.Response | None = None  # a complete answer, read whole, to send in one write
    span_id: str = ""              # the attempt's span, its backend's traceparent parent id
    backend: str = ""
    t_start: float = 0.0
    delivered: bool = False        # the stream's last event went out: the client has the whole answer


@dataclass(slots=True)
class Exchange:
    """One client request as it moves through the proxy."""

    request: web.Request
    request_id: str
    t0: float = field(default_factory=time.monotonic)
    body: bytes = b""
    parsed: Parsed | None = None   # the body's one parse (proxy/body.py), when anything reads inside it
    logged: bool = False           # a chat/completions request: it gets results-log lines
    trace_id: str | None = None
    fixups: list = field(default_factory=list)
    attempts: int = 0
    backend: str = ""              # the backend whose slot it holds (the last one, after a retry)
    slot: Backend | None = None    # that backend: what the request path releases when it ends
    cut: bool = False              # still in flight at the drain bound of a stopping proxy: cancelled
    queued_ms: float = 0.0         # time it waited in the queue for a slot
    read: bool = False             # the body is read (before the pick in the models form)
    by_model: bool = False         # routed by its `model` (the models form): counted per served model too
    model: str | None = None       # the body's `model` (the models form reads it)
    pool: str | None = None        # the served model it is routed to (the models form)
    route: Route | None = None     # what its pool's policy made of it and where that led
    otel_trace: str = ""           # its W3C trace id: the client's traceparent's, or a new one
    parent_span: str | None = None  # the client's span (its traceparent's parent id), None: a new trace
    flags: str = SAMPLED           # the trace flags, passed on to the backends as the client sent them
    ttfb: float | None = None      # seconds from arrival to the first byte sent to the client
    attempt: Outcome | None = None  # the attempt under way (or the last one)
    outcome: Outcome | None = None  # how the request ended: set where it ends, settled once (_settle)
    client_left: bool = False      # the client went away before it had the whole answer
    spans: object | None = None    # where its spans go (proxy.spans at arrival), when they are exported
    tried: list | None = None      # every attempt's Outcome, kept when spans are exported
    wall_ns: int = 0               # time.time_ns() at arrival, when spans are exported
    tenant: Tenant | None = None   # whose request it is (its API key's tenant), once the key is checked
    account: Account | None = None  # its side of its tenant's accounting (admitted, settled by its usage)
    splice: Splice | None = None   # a streamed chat/completions answer as it passes (proxy/resume.py)

    def __post_init__(self) -> None:
        self.logged = self.request.method == "POST" and self.request.path in LOGGED_PATHS

    def describe(self) -> dict:
        """What names this request in a drain report."""
        return {"request_id": self.request_id, "trace_id": self.trace_id, "otel_trace_id": self.otel_trace,
                "backend": self.backend, "path": self.request.path, "age_s": round(time.monotonic() - self.t0, 1)}


async def proxy_handler(request: web.Request) -> web.StreamResponse:
    """Pick a backend and count the request on it (waiting for a free slot if need be), then read
    the body and forward it. In the models form the body is read first: its `model` names the pool."""
    return await _settled(request, _answer)


async def list_models(request: web.Request) -> web.StreamResponse:
    """GET /v1/models: in the models form, the union of the healthy backends' lists, each id once;
    in the plain form it goes to a backend like any request."""
    if not request.app[PROXY].router.by_model:
        return await proxy_handler(request)
    return await _settled(request, _listing)


async def _settled(request: web.Request, answer) -> web.StreamResponse:
    """answer(ex, proxy)'s response; whatever ends the request (an answer, the client leaving, a drain's
    cut, a fault of the proxy's), it is settled here, once: counted, its final line logged, its span kept."""
    proxy = request.app[PROXY]
    ex = _exchange(request, proxy)
    proxy.requests[id(ex)] = ex        # what a drain waits for (a queued request too), and names if it cuts it
    try:
        return await answer(ex, proxy)
    except asyncio.CancelledError:
        # aiohttp's handler_cancellation (the client hung up) or a drain's cut, wherever the request was.
        if ex.outcome is None:
            ex.outcome = Outcome(status=CLIENT_CLOSED, error=_why_gone(ex))
        raise
    finally:
        proxy.requests.pop(id(ex), None)
        _settle(ex, proxy)


def _exchange(request: web.Request, proxy) -> Exchange:
    """The request as an Exchange: its ids and trace context, and whether its spans are kept."""
    ex = Exchange(request, request.headers.get("X-Request-Id") or new_request_id())
    ex.otel_trace, parent, flags = _trace_context(request)
    if parent is not None:
        ex.parent_span, ex.flags = parent, flags
    spans = proxy.spans
    if spans is not None and parent is None and chance() >= spans.config.sample_ratio:
        ex.flags = NOT_SAMPLED   # a trace the proxy starts, past otlp.sample_ratio: no one records it
    if spans is not None and sampled(ex.flags):
        ex.spans, ex.tried, ex.wall_ns = spans, [], time.time_ns()
    return ex


def _trace_context(request: web.Request) -> tuple[str, str | None, str]:
    """(trace id, parent span id or None, flags) from the client's traceparent, or a new trace when it
    sent none or an invalid one; the trace id goes out as X-Trace-Id on whatever answers the request."""
    context = parse_traceparent(request.headers.get("traceparent"))
    if context is None:
        context = (new_trace_id(), None, SAMPLED)
    request[TRACE_ID] = context[0]
    return context


def _settle(ex: Exchange, proxy) -> None:
    """Count the request, write its final results-log line and record its span (the spans are built off
    the event loop, proxy/otlp.py: here a tuple is queued). The one place a request is accounted for."""
    out = ex.outcome or Outcome(status=500, error="the proxy failed on this request; see its proxy.log")
    _cut_by_deadline(ex, out)
    metrics = proxy.metrics
    label = ex.backend if ex.attempts else NO_BACKEND   # a 413 never reached the backend it was given
    _count(proxy, ex, label, out.status)
    if ex.client_left:
        metrics.aborted.labels(ex.backend).inc()
    if ex.slot is not None:    # timed from arrival when it got a slot (the queue's refusals are not)
        elapsed = time.monotonic() - ex.t0
        metrics.took(label, elapsed)
        if ex.ttfb is None and (out.status != CLIENT_CLOSED or out.sent):
            ex.ttfb = elapsed     # a whole answer: its first byte goes out as the handler returns it
        if ex.ttfb is not None:
            metrics.first_byte_after(label, ex.pool or "", ex.ttfb)
    _log_attempt(ex, proxy, ex.backend if ex.attempts else None, out, final=True)   # a whole answer parsed here
    if out.observer is not None and out.observer.reported_tokens is not None:
        metrics.produced(ex.backend, ex.pool or "", out.observer.reported_tokens)
    if ex.tenant is not None:
        _tenant_settled(ex, proxy, out)
    if ex.spans is not None:
        ex.spans.record(_span_record(ex, out.status))


def _cut_by_deadline(ex: Exchange, out: Outcome) -> None:
    """A request whose connection the proxy cut past a deadline (proxy/clients.py: a stalled body, a
    stream the client took nothing of) ends with that deadline's status and error, not as a client gone."""
    if out.status != CLIENT_CLOSED:
        return      # first: a key the request lacks costs aiohttp's mapping a KeyError
    cut = ex.request.get(CUT)
    if cut is None:
        return
    for o in {id(out): out, id(ex.attempt): ex.attempt}.values():
        if o is not None and o.status == CLIENT_CLOSED:
            o.status, o.error = cut


def _tenant_settled(ex: Exchange, proxy, out: Outcome) -> None:
    """The tenant's side of a settled request: its answer counted, its account settled by the answer's
    usage (what it really took against what admission reckoned), or refunded when it never got a slot."""
    prompt, output = _usage(ex, out)
    proxy.metrics.tenant_answered(ex.tenant.name, out.status, prompt or 0, output)
    if ex.account is not None:
        ex.account.settle(ex.slot is not None, prompt, output)


def _usage(ex: Exchange, out: Outcome | None) -> tuple[int | None, int]:
    """(prompt tokens or None, output tokens) of an answer, as its usage (or its stream) told; of a resumed
    stream, the whole answer's: the tokens before the last cut (as counted at the cut: Splice.recount) and
    the continuation's own count (its usage counts the text so far as prompt; without usage, the stream's
    content events); of a stream cut, or left, before its closing usage chunk, the tokens it sent."""
    observer = out.observer if out is not None else None
    if observer is None:
        return None, 0
    splice = ex.splice
    if splice is not None and splice.hops:
        after = observer.reported_tokens
        return splice.prompt_tokens, splice.sent if after is None else splice.hops[-1].tokens_before + after
    if observer.reported_tokens is None and splice is not None and splice.fed:
        return observer.prompt_tokens, splice.sent   # cut or left before its closing usage: what was sent
    return observer.prompt_tokens, observer.reported_tokens or 0


def _count(proxy, ex: Exchange, backend: str, status: int) -> None:
    """Count an answer by backend, and by served model in the models form."""
    proxy.metrics.answered(backend, status)
    if ex.by_model:
        proxy.metrics.answered_model(ex.pool or NO_BACKEND, status)


def _span_record(ex: Exchange, status: int) -> tuple:
    """What proxy/otlp.py builds the request's spans from (plain values: the request itself is let go)."""
    final = ex.tried[-1].observer if ex.tried else None
    attempts = [(o.span_id, o.backend, o.t_start, o.attempt_ms, o.status or CLIENT_CLOSED,
                 o.error or (None if o.status else "the client went away")) for o in ex.tried]
    return (ex.request.method, ex.request.path, ex.t0, time.monotonic(), ex.wall_ns, status, ex.otel_trace,
            ex.parent_span, ex.flags, ex.backend, ex.pool or ex.model, ex.queued_ms, ex.ttfb, ex.request_id,
            final.prompt_tokens if final else None, final.reported_tokens if final else None,
            ex.tenant.name if ex.tenant is not None else None, attempts)


def _ended(ex: Exchange, response: web.Response) -> web.Response:
    """The proxy's own answer (an OpenAI-style error) as the request's outcome."""
    ex.outcome = Outcome(status=response.status, error=json.loads(response.body)["error"]["message"])
    return response


async def _answer(ex: Exchange, proxy) -> web.StreamResponse:
    """The request path once the request is an Exchange: key, pool, slot, then the backends."""
    refused = _refused(ex, proxy)
    if refused is not None:
        return _ended(ex, refused)     # its body stays unread: nothing of it reaches the results log
    pool = await _pool(ex, proxy)
    if isinstance(pool, web.Response):
        return pool
    _route(ex, pool)
    limited = _rate_limited(ex, proxy)
    if limited is not None:
        return await _turned_away(ex, proxy, limited)
    # Counted here, before the body is read (the seed's pile-up fix), in the plain form; in the models
    # form and with a policy that reads the body right after it, pick and count still one step. A request that
    # finds no slot, or someone its pool's fair queue serves first, waits its turn in that queue; the policy
    # may have it wait a little for its home backend (a hold) though another has a free slot.
    may_take = pool.may_take(ex.tenant)     # reads the fair queue's order: once, not per question
    hold = pool.hold(ex.route) if may_take else None
    backend = pool.acquire(route=ex.route, tenant=ex.tenant, tokens=ex.account.tokens) if may_take and hold is None else None
    if backend is None:
        backend = await _wait_for_slot(ex, proxy, pool, hold)
        if isinstance(backend, web.Response):
            return backend
    return await _forward(ex, proxy, pool, backend)


async def _pool(ex: Exchange, proxy) -> Balancer | web.Response:
    """The pool the request goes to, or the answer when it ends before one (400, 404, 413)."""
    if proxy.router.needs_body:
        return await _pool_of(ex, proxy)
    return proxy.router.only()


def _rate_limited(ex: Exchange, proxy) -> web.Response | None:
    """The 429 of a tenant past its requests or tokens per minute, else None (and the request is taken
    from its buckets: its prompt's tokens as reckoned now, corrected by its usage when it ends)."""
    ex.account = Account(ex.tenant)
    why = ex.account.admit(_prompt_tokens(ex))
    if why is None:
        return None
    limit, message, wait = why
    return _limit_error(ex, proxy, limit, message, max(1, math.ceil(wait)))


def _limit_error(ex: Exchange, proxy, limit: str, message: str, retry_after: int) -> web.Response:
    """A tenant's 429: OpenAI's rate-limit error shape, naming the limit, with Retry-After."""
    proxy.metrics.tenant_limited(ex.tenant.name, limit)
    return web.json_response({"error": {"message": message, "type": "rate_limit_exceeded", "param": limit,
                                        "code": 429}}, status=429,
                             headers={"X-Request-Id": ex.request_id, "Retry-After": str(retry_after)})


def _prompt_tokens(ex: Exchange) -> int:
    """The request's prompt in tokens, as well as admission can tell: the routing policy's count when it
    read the body, else the body's length (the request's Content-Length when unread) over TOKEN_BYTES."""
    if ex.route is not None:
        return ex.route.prompt_tokens
    size = len(ex.body) if ex.read else (ex.request.content_length or 0)
    return size // TOKEN_BYTES


def _route(ex: Exchange, pool: Balancer) -> None:
    """What the pool's policy made of the request's body (a prefix route: its prompt's blocks, taken with
    the body's parse in _read_body: every pool has the same policy), before the pick."""
    if not pool.needs_body or not ex.logged:
        ex.route = None


def _hold(ex: Exchange, backend: Backend) -> None:
    """The request now holds a slot on backend."""
    ex.slot, ex.backend = backend, backend.name


async def _forward(ex: Exchange, proxy, pool: Balancer, backend: Backend) -> web.StreamResponse:
    """With a slot on backend: read the body, try the backends, hand on the answer; the slot (the
    last backend's, after a retry) is released whatever happens."""
    _hold(ex, backend)
    try:
        if ex.route is not None:
            proxy.metrics.routed(ex.route)
        response = None if ex.read else await _read_body(ex, proxy, backend)
        if response is not None:
            return _ended(ex, response)
        ex.splice = _splice_for(ex, proxy)
        out = await _tries(ex, proxy, pool)
        return _reply(ex, out)
    except (ClientGone, asyncio.CancelledError) as gone:
        # ClientGone: a write found the client gone; CancelledError: aiohttp's handler_cancellation,
        # the client hung up while we waited.
        _client_gone(ex)
        if isinstance(gone, asyncio.CancelledError):
            raise
        return ex.request["response"]      # already started; aiohttp has nobody left to send it to
    finally:
        _finish(ex, proxy, pool)


def _finish(ex: Exchange, proxy, pool: Balancer) -> None:
    """The request ends at its pool, once: its slot released, what the engine said of the prompt's cache
    hit to the policy (and to the prediction's metrics), its answer's tokens to its tenant's fair share."""
    out = ex.outcome
    cached = prompt = timing = None
    if ex.route is not None and out is not None and out.observer is not None and out.status == 200:
        cached, prompt = out.observer.engine_cache()
        if cached is not None:
            proxy.metrics.predicted(ex.route, cached)
        if ex.splice is not None and not ex.splice.hops and ex.attempts <= 1 and ex.ttfb is not None:
            # a stream from one backend: its first token's time from the slot, and the rest's
            timing = (ex.ttfb - ex.queued_ms / 1000, time.monotonic() - ex.t0 - ex.ttfb)
    pool.finish(ex.slot, ex.tenant, ex.route, cached, prompt, _usage(ex, out)[1], timing)


async def _tries(ex: Exchange, proxy, pool: Balancer) -> Outcome:
    """Attempts on the backend held, then on others while one fails before any byte reached the client."""
    tried: list[Backend] = []
    while True:
        out = await _attempt(ex, proxy, ex.slot)
        tried.append(ex.slot)
        if out.sent and out.error and ex.splice is not None and (ex.splice.fed or not ex.splice.resumable):
            return await _resume(ex, proxy, pool, out, tried)
        if not out.retryable or len(tried) > proxy.config.retries:
            return out
        # The request holds a slot already: it may go over another backend's slots, never wait.
        other = pool.acquire(exclude=tried, over=True, route=ex.route)
        if other is None:
            return out
        failed = ex.slot
        _hold(ex, other)       # first: ex.slot is what _forward releases
        pool.release(failed)
        _retried(ex, proxy, failed, out)


def _splice_for(ex: Exchange, proxy) -> Splice | None:
    """The splice of a streamed chat/completions request (None for any other): resumable, or why not."""
    request = ex.parsed.request if ex.parsed is not None else None
    if not ex.logged or not isinstance(request, dict) or not request.get("stream"):
        return None
    why = refusal(ex.request.path, request) if proxy.config.resume.enabled else "off (proxy.resume.enabled false)"
    return Splice(ex.request.path, why, usage_asked(request)[0])


async def _resume(ex: Exchange, proxy, pool: Balancer, out: Outcome, tried: list) -> Outcome:
    """A stream its backend broke off after the first chunk: the rest from another instance of its pool,
    relayed into the same client stream (proxy/resume.py), up to proxy.resume.max_attempts times; like a
    retry it goes over the slots (the client waits mid-answer: ahead of every request queued), and the
    policy's pick with the failed backends left out is the prefix index's next choice. The last
    attempt's outcome; a stream that cannot go on ends as any broken stream does, the cause logged."""
    splice, config = ex.splice, proxy.config.resume
    if splice.done:           # cut after its `data: [DONE]` went out: the client has the whole answer
        out.error, out.delivered = None, True
        return out
    for _ in range(config.max_attempts):
        if not splice.resumable:
            return _not_resumed(ex, proxy, out, "refused" if config.enabled else "off", splice.refused)
        if splice.finished or not budget_left(ex.parsed.request, splice.sent):
            return await _closed(ex, proxy, out)    # the answer was whole (its finish_reason out, its budget spent)
        # (the policy counts other's pick as sent there, even when the budget then proves spent: rare)
        other = pool.acquire(exclude=tried, over=True, route=ex.route)
        if other is None:
            return _not_resumed(ex, proxy, out, "no_backend", "no other healthy instance in its pool")
        try:        # other's slot is this request's only once held (_hold): until then, given back here
            ask = splice.reported is None and splice.tokens > 0    # (no text sent: 0 is the count)
            counted = splice.recount(await _tokenized(ex, proxy, other) if ask else None)
            rest = await _continuation_body(ex, proxy)
        except BaseException:
            pool.release(other)
            raise
        if rest is None:      # the budget spent, as the engine's tokenizer counts what was sent
            pool.release(other)
            return await _closed(ex, proxy, out)
        failed = ex.slot
        splice.cut(failed.name, out.error, counted)
        splice.moved(other.name)
        _hold(ex, other)       # first: ex.slot is what _forward releases
        pool.release(failed)
        _retried(ex, proxy, failed, out)
        out = await _attempt(ex, proxy, other, rest)
        tried.append(other)
        if not out.error:
            proxy.metrics.resumes.labels("resumed").inc()
            return out
    return _not_resumed(ex, proxy, out, "failed", f"{config.max_attempts} continuation(s) broke off too "
                        "(proxy.resume.max_attempts)")


def _not_resumed(ex: Exchange, proxy, out: Outcome, outcome: str, why: str) -> Outcome:
    """A cut stream that goes no further: counted by outcome, the cause kept for its results-log line."""
    proxy.metrics.resumes.labels(outcome).inc()
    ex.splice.declined = why
    return out


async def _closed(ex: Exchange, proxy, out: Outcome) -> Outcome:
    """A stream cut when every token of its answer was out already: the proxy ends it (its finish_reason
    `length` when its budget was spent, its usage chunk when asked for, the prompt reckoned as admission
    did when no event told it; [DONE]), seen by the results log as sent (but after a hop: out's observer
    is the continuation's, whose own count _usage adds to the tokens before the hop)."""
    proxy.metrics.resumes.labels("closed").inc()
    end = ex.splice.closing(_prompt_tokens(ex))
    if out.observer is not None and not ex.splice.hops:
        out.observer.feed(end)
    try:
        await ex.request["response"].write(end)
    except ConnectionResetError as e:
        raise ClientGone() from e
    await _eof(ex.request["response"])
    out.error, out.delivered = None, True
    return out


async def _continuation_body(ex: Exchange, proxy) -> bytes | None:
    """The continuation's body (proxy/resume.py), built from the body's one parse (its long strings, the
    images, copied back byte for byte, never decoded); in a worker thread past proxy.limits.inline_kb.
    None: its budget is spent."""
    splice, path, parsed = ex.splice, ex.request.path, ex.parsed

    def build() -> bytes | None:
        body = continuation(path, parsed.request, "".join(splice.text), splice.sent)
        return None if body is None else parsed.dumps(body)
    if len(ex.body) <= proxy.config.limits.inline_kb * 1024:
        return build()
    return await asyncio.get_running_loop().run_in_executor(proxy.parser, build)


async def _tokenized(ex: Exchange, proxy, backend: Backend) -> int | None:
    """The tokens of the text a cut stream sent, as backend's engine counts them (its /tokenize; proxy/
    resume.py tokenize_request); None when it cannot say (an engine without the endpoint, an error, past
    TOKENIZE_S). Costs the cut one small request, where usage on every event (continuous_usage_stats)
    cost the engine's API server 15% more CPU an event on every stream."""
    text = "".join(ex.splice.text)
    body = json.dumps(tokenize_request(ex.parsed.request, text)).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": ex.request_id}
    try:
        async with proxy.upstream.request("POST", backend.url, "/tokenize", headers, body, TOKENIZE_S,
                                          min(proxy.config.connect_timeout_s, TOKENIZE_S)) as up:
            answer = await _read_up_to(up, TOKENIZE_BYTES)
            status = up.status
        answer = loads(answer) if status == 200 else None
    except (UpstreamError, asyncio.TimeoutError, ConnectionResetError, ValueError):
        return None
    count = answer.get("count") if isinstance(answer, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= len(text.encode()) + 1:
        return None     # not a count of this text (a token is a byte of it at least; a tokenizer's prefix)
    return count


def _retried(ex: Exchange, proxy, failed: Backend, out: Outcome) -> None:
    """An attempt given up for another backend: its backend's answer counted, its line not final."""
    _count(proxy, ex, failed.name, out.status)
    proxy.metrics.retries.labels(failed.name).inc()
    _log_attempt(ex, proxy, failed.name, out, final=False)


def _client_gone(ex: Exchange) -> None:
    """The client left with a slot held. One that hangs up once the stream's last event (`data: [DONE]`)
    reached it, without waiting for the stream's end, was served: its attempt is its outcome."""
    if ex.attempt is not None and ex.attempt.delivered:
        ex.outcome = ex.attempt
        return
    ex.outcome = Outcome(status=CLIENT_CLOSED, error=_why_gone(ex))
    ex.client_left = True
    if ex.attempt is not None:   # the attempt it left ends so (its span), not with its backend's status
        ex.attempt.status, ex.attempt.error = ex.outcome.status, ex.outcome.error


def _why_gone(ex: Exchange, queued: bool = False) -> str:
    """The error of a request that ended without its answer: the client left, or a drain cut it."""
    if queued:
        return ("cut while queued: still waiting when the stopping proxy's drain bound passed" if ex.cut
                else "the client went away while queued")
    return ("cut: still in flight when the stopping proxy's drain bound passed" if ex.cut
            else "the client went away")


async def _pool_of(ex: Exchange, proxy) -> Balancer | web.Response:
    """Read the body (the models form, a policy that needs it) and find the pool its `model` reaches (the
    only pool when not routing by model); or the answer when the request ends here: 413, 400 (no model
    and several served), 404 (a model nobody serves, in vLLM's own words), never sent to an engine."""
    router = proxy.router
    ex.by_model = router.by_model
    response = await _read_body(ex, proxy, None)
    if response is not None:
        return _ended(ex, response)
    if not router.by_model:
        return router.only()     # the body was read for the routing policy
    ids = {"X-Request-Id": ex.request_id}
    name = ex.parsed.model if ex.parsed is not None else NO_MODEL
    ex.model = name or None
    if not name:
        only = router.only()
        if only is not None:
            ex.pool = router.served_names()[0]
            return only
        message = (f"the request names no `model`; this host serves {', '.join(router.served_names())}: "
                   "set `model` to one of them.")
        return _ended(ex, json_error(400, message, "BadRequestError", ids))
    pool = router.resolve(name)
    if pool is not None:
        ex.pool = pool
        return router.pools[pool]
    # vLLM's own 404 (serving_models.py, 0.32), without its list of the names it knows.
    message = f"The model `{name}` does not exist."
    return _ended(ex, web.json_response({"error": {"message": message, "type": "NotFoundError", "param": "model",
                                                   "code": 404}}, status=404, headers=ids))


async def _listing(ex: Exchange, proxy) -> web.Response:
    """The models form's answer to GET /v1/models."""
    refused = _refused(ex, proxy)
    if refused is not None:
        return _ended(ex, refused)
    listing = proxy.router.listing()
    if not listing:
        return _ended(ex, json_error(503, "no healthy backend is available; check `inv status`.", "no_backend"))
    ex.outcome = Outcome(status=200)
    return web.json_response({"object": "list", "data": listing})


async def _wait_for_slot(ex: Exchange, proxy, pool: Balancer, hold=None) -> Backend | web.Response:
    """Wait in the queue for a slot; the backend it got, or the answer when the request ends here:
    503 (no backend at all, or queue.timeout_s waited, with Retry-After) or 429 (the queue is full)."""
    config, metrics = proxy.config, proxy.metrics
    ids = {"X-Request-Id": ex.request_id}
    try:
        backend = await pool.wait_for_slot(config.queue.timeout_s, ex.route, ex.tenant, ex.account.tokens, hold)
    except TenantFull as full:
        limit, message = full.args
        return await _turned_away(ex, proxy, _limit_error(ex, proxy, limit, message, RETRY_AFTER_FULL_S))
    except QueueFull:
        metrics.queue_rejected.labels("full").inc()
        return await _turned_away(ex, proxy, json_error(
            429, f"every backend is busy and {config.queue.max} requests already wait; retry shortly.",
            "queue_full", {**ids, "Retry-After": str(RETRY_AFTER_FULL_S)}))
    except QueueTimeout:
        metrics.queue_rejected.labels("timeout").inc()
        metrics.queue_wait.observe(time.monotonic() - ex.t0)
        return await _turned_away(ex, proxy, json_error(
            503, f"no backend slot came free within {config.queue.timeout_s:g}s; retry later.",
            "queue_timeout", {**ids, "Retry-After": str(RETRY_AFTER_TIMEOUT_S)}))
    except asyncio.CancelledError:      # the client left while it waited (or a drain cut it): out of the queue
        metrics.queue_rejected.labels("gone").inc()
        ex.outcome = Outcome(status=CLIENT_CLOSED, error=_why_gone(ex, queued=True))
        raise
    if backend is None:
        where = f" serves {ex.pool}" if ex.pool else " is available"
        return await _turned_away(ex, proxy, json_error(
            503, f"no healthy backend{where}; check `inv status`.", "no_backend", ids))
    ex.queued_ms = round((time.monotonic() - ex.t0) * 1000, 1)
    metrics.queue_wait.observe(ex.queued_ms / 1000)
    metrics.tenant_waited(ex.tenant.name, ex.queued_ms / 1000)
    return backend


async def _turned_away(ex: Exchange, proxy, response: web.Response) -> web.Response:
    """A request refused before any slot: its body is read only for the log's trace id (the refusal is
    its outcome already, should the client leave during that read)."""
    _ended(ex, response)
    if ex.logged and not ex.read and (ex.request.content_length or 0) <= proxy.config.max_body_bytes:
        try:
            ex.trace_id = (await _digested(proxy, await ex.request.read(), None, False))[2]
        except (web.HTTPRequestEntityTooLarge, Refused):
            pass
    return response


def _refused(ex: Exchange, proxy) -> web.Response | None:
    """The 401 for a request without one of the API keys (when keys are set), else None; the request's
    tenant is then its key's (`default` when keys are off)."""
    keys = proxy.api_keys
    name = DEFAULT if keys is None else _tenant_of(ex.request, keys)
    if name is not None:
        ex.tenant = proxy.tenants[name]
        return None
    return json_error(401, "missing or wrong API key; send `Authorization: Bearer <key>`.",
                      "unauthorized", {"X-Request-Id": ex.request_id, "WWW-Authenticate": "Bearer"})


def _tenant_of(request: web.Request, keys: dict) -> str | None:
    """The tenant of the request's key, or None when it sent none of keys (each compared in constant time)."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    key = key.strip().encode("utf-8", "surrogateescape")  # aiohttp keeps undecodable bytes as surrogates
    if scheme.lower() != "bearer":
        return None
    found = None
    for k, tenant in keys.items():
        if hmac.compare_digest(key, k):
            found = tenant
    return found


async def _read_body(ex: Exchange, proxy, backend: Backend | None) -> web.Response | None:
    """Read the body and read inside it once (digest: in a worker thread past proxy.limits.inline_kb);
    a response when the request ends here (413, or a 400 past proxy.limits). backend: the one picked
    (None: the models form, or a policy that reads the body, reads it before the pick)."""
    request, config, router = ex.request, proxy.config, proxy.router
    if (request.content_length or 0) > config.max_body_bytes:
        return _too_large(ex, config, backend)
    try:
        ex.body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _too_large(ex, config, backend)
    ex.read = True
    if not ex.logged and not router.by_model:
        return None      # nothing reads inside it: it goes to the engine as it came
    pool = next(iter(router.pools.values())) if router.needs_body and ex.logged else None
    fix = ex.logged and config.fix_numeric_user
    counted = request.path if ex.logged and config.resume.enabled else None
    try:
        digested = await _digested(proxy, ex.body, pool, fix, counted)
    except Refused as refused:
        return json_error(400, f"{refused}.", "BadRequestError", _body_ids(ex, backend))
    ex.parsed, ex.route, ex.trace_id, fixed, fixups = digested
    if fixed is not None:
        ex.body, ex.fixups = fixed, fixups
    return None


def _body_ids(ex: Exchange, backend: Backend | None) -> dict:
    """The headers of an answer that ends a request at its body: its id, and the backend picked if any."""
    return {"X-Request-Id": ex.request_id, **({"X-Backend": backend.name} if backend else {})}


def _too_large(ex: Exchange, config, backend: Backend | None) -> web.Response:
    return json_error(413, f"request body over {config.max_body_mb:g} MiB", "too_large", _body_ids(ex, backend))


async def _digested(proxy, body: bytes, pool: Balancer | None, fix: bool, counted: str | None = None) -> tuple:
    """digest of body: on the event loop up to proxy.limits.inline_kb, in a worker thread beyond."""
    limits = proxy.config.limits
    if len(body) <= limits.inline_kb * 1024:
        return digest(body, limits, pool, fix, counted)
    return await asyncio.get_running_loop().run_in_executor(proxy.parser, digest, body, limits, pool, fix, counted)


def digest(body: bytes, limits, pool: Balancer | None, fix: bool, counted: str | None = None) -> tuple:
    """(the body's parse, its route by pool's policy (None: no policy reads it), the trace id from its `user`,
    the body to send when it changed (else None), the results log's names of the changes); Refused past
    limits. Changes: a numeric `user` made a string (fix), and a resumable stream's closing usage asked
    (counted: the request's path; proxy/resume.py counted_options). Runs in a worker thread for a large
    body: it touches nothing shared."""
    parsed = parse(body, limits)
    route = pool.route_of(parsed) if pool is not None else None
    user = parsed.user if parsed.request is not None else None
    if parsed.request is None:
        trace = trace_id_of(user_value(body))    # not a JSON object: the engine answers it; a `user` scanned
    else:
        trace = user if isinstance(user, str) or user is None else (
            json.dumps(user) if isinstance(user, (int, float)) else None)
    fixups = ["user-to-string"] if fix and numeric_user(user) else []
    fixed = parsed.with_user(json.dumps(user)) if fixups else None   # a continuation is built of it too
    options = counted_options(counted, parsed.request) if counted and parsed.request is not None else None
    if options is not None:
        fixed = parsed.dumps({**parsed.request, "stream_options": options})
    return parsed, route, trace, fixed, fixups


async def _attempt(ex: Exchange, proxy, backend: Backend, rest: bytes | None = None) -> Outcome:
    """Send the request to backend; stream a good answer to the client, hold back a 502/503. rest: the
    body of a continuation (proxy/resume.py), whose answer goes on in the client's stream."""
    request = ex.request
    ex.attempts += 1
    out = ex.attempt = Outcome(span_id=new_span_id(), backend=backend.name, sent=rest is not None)
    if ex.tried is not None:
        ex.tried.append(out)
    out.t_start = time.monotonic()
    try:
        config = proxy.config
        async with proxy.upstream.request(request.method, backend.url, target(request), _headers_for(ex, proxy, out),
                                          rest or ex.body or None, config.timeout_s, config.connect_timeout_s) as up:
            await (_take if rest is None else _take_rest)(ex, proxy, backend, out, up)
    except (UpstreamError, asyncio.TimeoutError, ConnectionResetError, Interrupted) as e:
        _failed(proxy, backend, out, e)
    finally:
        out.attempt_ms = round((time.monotonic() - out.t_start) * 1000, 1)
    if out.sent:
        out.retryable = False   # never retry once a byte went to the client
    return out


def target(request: web.Request) -> str:
    """The request's path and query as the client sent them; of an absolute-form target
    (`POST http://host/v1/... HTTP/1.1`, RFC 9112 3.2.2) its path and query only."""
    raw = request.raw_path
    return raw if raw.startswith("/") else request.rel_url.raw_path_qs


def _headers_for(ex: Exchange, proxy, out: Outcome) -> dict:
    """The headers an attempt sends: the client's, its request id, the attempt's own traceparent."""
    headers = upstream_headers(ex.request.headers)
    headers["X-Request-Id"] = ex.request_id
    headers["traceparent"] = f"00-{ex.otel_trace}-{out.span_id}-{ex.flags}"
    if proxy.api_keys is not None:    # the client's key stays with the proxy, however it spelled the header
        for name in [n for n in headers if n.lower() == "authorization"]:
            del headers[name]
    return headers


async def _take(ex: Exchange, proxy, backend: Backend, out: Outcome, up: Answer) -> None:
    """Take the backend's answer: hold a 502/503 back, read a small whole answer, stream the rest."""
    out.status = up.status
    _answered(proxy, backend, up.status)
    if up.status in RETRY_STATUSES:
        body = await _read_up_to(up, ERROR_BODY_BYTES)
        out.retryable, out.error = True, body.decode("utf-8", "replace")
        out.buffered = (up.status, downstream_headers(up.headers), body)
        return
    streamed = up.headers.get("Content-Type", "").startswith("text/event-stream")
    out.observer = ResponseObserver(up.status, streamed) if ex.logged else None
    headers = {**downstream_headers(up.headers), **_ids(ex, backend)}
    if up.status == 500 and not streamed:
        body = await _read_up_to(up, ERROR_BODY_BYTES)
        if ENGINE_DEAD in body:
            out.retryable, out.error = True, body.decode("utf-8", "replace")
            out.buffered = (up.status, downstream_headers(up.headers), body)
            if proxy.router.eject(backend, f"{backend.name}: its engine died (EngineCore encountered an issue)"):
                _ejected(proxy, backend, "engine_dead")
            return
        if out.observer is not None:
            out.observer.feed(body)
        out.whole = web.Response(status=up.status, body=body, headers=headers)
        return
    if not streamed and up.content_length is not None and up.content_length <= WHOLE_BODY_BYTES:
        # A whole answer (not SSE) of known, bounded size goes out in one write with its
        # headers: nothing is gained by streaming what the engine sent all at once.
        body = await up.read()
        if out.observer is not None:
            out.observer.feed(body)
        out.whole = web.Response(status=up.status, body=body, headers=headers)
        return
    resp = web.StreamResponse(status=up.status, headers=headers)
    await resp.prepare(ex.request)
    out.sent = True
    ex.request["response"] = resp
    await _relay(ex, proxy, backend, out, up, resp)


async def _take_rest(ex: Exchange, proxy, backend: Backend, out: Outcome, up: Answer) -> None:
    """Take a continuation's answer: a stream, relayed into the client's (any other answer is its failure)."""
    out.status = 200                 # what the client has, whatever this backend answers
    _answered(proxy, backend, up.status)
    if up.status != 200 or not up.headers.get("Content-Type", "").startswith("text/event-stream"):
        body = (await _read_up_to(up, ERROR_BODY_BYTES)).decode("utf-8", "replace")
        out.error = f"stream interrupted: {backend.name} answered the continuation {up.status}: {body[:500]}"
        return
    out.observer = ResponseObserver(200, True)
    await _relay(ex, proxy, backend, out, up, ex.request["response"])


async def _relay(ex: Exchange, proxy, backend: Backend, out: Outcome, up: Answer,
                 resp: web.StreamResponse) -> None:
    """Write the backend's answer to the client chunk by chunk, as it comes; a resumable stream through
    its splice (proxy/resume.py), watched for a stall and for its backend's ejection, and left open when
    it breaks off (out.error), for a continuation to finish."""
    sse = up.headers.get("Content-Type", "").startswith("text/event-stream")
    splice = ex.splice if ex.splice is not None and ex.splice.resumable and sse else None
    watch = None if splice is None else _Watch(up, backend, proxy.config.resume.stall_s, splice)
    try:
        await _chunks(ex, out, up, resp, splice, watch)
    finally:
        if watch is not None:
            watch.stop()
        if splice is not None and splice.resumable and out.observer is not None and out.observer.streamed:
            out.observer.feed(splice.pending())   # the lines of an event the stream never completed
    if splice is not None and splice.resumable and not splice.done:   # else it ends as any stream does
        why = (f"{backend.name} sent an error event: {splice.error}" if splice.error is not None
               else f"{backend.name} ended the stream before `data: [DONE]`")
        _upstream_error(proxy, backend, out, "payload", why)
        return
    await _eof(resp)


async def _chunks(ex: Exchange, out: Outcome, up: Answer, resp: web.StreamResponse,
                  splice: Splice | None, watch: _Watch | None) -> None:
    """The upstream's chunks to the client as they come (a resumable stream's through its splice), until
    its end or its engine's error event."""
    observer = out.observer
    async for chunk in up.content.iter_any():
        if splice is None or not splice.resumable or observer is None or not observer.streamed:
            if observer is not None:
                observer.feed(chunk)
            data = chunk if splice is None else splice.feed(chunk)
        else:
            data = splice.feed(chunk, observer)    # each read taken once, for the splice and the log
        if ex.ttfb is None:
            ex.ttfb = time.monotonic() - ex.t0
        if watch is not None:
            watch.writing = True     # a client slow to take the chunk is not the backend's silence
        try:
            if data:
                await resp.write(data)
        except ConnectionResetError as e:
            raise ClientGone() from e
        if watch is not None:
            watch.seen()
        if not out.delivered and (_ends_stream(chunk, out.observer) if splice is None else splice.done):
            out.delivered = True
        if splice is not None and splice.error is not None:
            return      # its engine failed: what follows (its [DONE]) is not the answer's end


async def _eof(resp: web.StreamResponse) -> None:
    """End a stream whose every byte was written."""
    try:
        await resp.write_eof()
    except ConnectionResetError:
        # Every byte of the answer was written: a client that closes at once after the last one
        # (the openai client does after `data: [DONE]`) got its answer; it did not go away first.
        pass


class _Watch:
    """A resumable stream's watch, off the chunk path: a timer every WATCH_S (at most stall_s) ends the
    upstream's read with Interrupted when no chunk came for stall_s or the backend was taken out by its
    health check meanwhile. Only while the stream is resumable (else it waits as any stream does), from
    the upstream's first chunk on (before it, an engine's prefill may take long: timeout_s bounds it, as
    any request's), while no write to the client is under way, and until `data: [DONE]` went out. A
    chunk costs it one clock read."""

    def __init__(self, up: Answer, backend: Backend, stall_s: float, splice: Splice):
        self.up, self.backend, self.stall_s, self.splice = up, backend, stall_s, splice
        self.last = time.monotonic()
        self.started = False     # a chunk came from this upstream
        self.writing = False     # a chunk is being written to the client
        self.every = min(stall_s, WATCH_S)
        self.timer = asyncio.get_running_loop().call_later(self.every, self._check)

    def seen(self) -> None:
        self.last = time.monotonic()
        self.started, self.writing = True, False

    def stop(self) -> None:
        self.timer.cancel()

    def _check(self) -> None:
        name, splice = self.backend.name, self.splice
        if splice.done:
            return      # the answer is whole: nothing left to watch for
        watched = splice.resumable and self.started and not self.writing
        if watched and not self.backend.healthy:
            return self.up.content.set_exception(
                Interrupted("taken_out", f"{name} was taken out: {self.backend.last_error}"))
        if watched and time.monotonic() - self.last >= self.stall_s:
            return self.up.content.set_exception(
                Interrupted("stalled", f"no bytes from {name} for {self.stall_s:g}s (proxy.resume.stall_s)"))
        self.timer = asyncio.get_running_loop().call_later(self.every, self._check)


def _failed(proxy, backend: Backend, out: Outcome, e: Exception) -> None:
    """Name an attempt's failure (the first matching kind, subclasses before their bases), count it."""
    config, name = proxy.config, backend.name
    if isinstance(e, Interrupted):
        _upstream_error(proxy, backend, out, e.kind, str(e))
    elif isinstance(e, ConnectTimeout):
        _upstream_error(proxy, backend, out, "connect_timeout",
                        f"no connection to {name} within {config.connect_timeout_s:g}s", eject=True)
        out.status = 504
    elif isinstance(e, Unreachable):
        _upstream_error(proxy, backend, out, "connect", f"cannot connect to {name}: {e.os_error}", eject=True)
    elif isinstance(e, Disconnected):
        # Before any byte: the engine died or closed a kept-alive connection; another backend may take it.
        _upstream_error(proxy, backend, out, "disconnected", f"{name} closed the connection")
        if not out.sent:
            _answered(proxy, backend, 502)
    elif isinstance(e, asyncio.TimeoutError):
        out.status = 504
        out.error = f"{name} did not answer within {config.timeout_s:g}s"
        proxy.metrics.upstream_errors.labels(name, "timeout").inc()
        _answered(proxy, backend, 504)
    elif isinstance(e, BrokenBody):
        _upstream_error(proxy, backend, out, "payload", f"{name} broke off its answer: {e}")
    elif isinstance(e, (Broken, ConnectionResetError)):
        _upstream_error(proxy, backend, out, "connection", f"connection to {name} failed: {e}")
    else:   # anything else: still one clear answer
        _upstream_error(proxy, backend, out, "other", f"{name}: {type(e).__name__}: {e}")


def _ends_stream(chunk: bytes, observer: ResponseObserver | None) -> bool:
    """Whether an SSE chunk just written carried the stream's last event, `data: [DONE]`."""
    if observer is not None:
        return observer.done
    return chunk.rstrip().endswith(b"data: [DONE]")


async def _read_up_to(up: Answer, limit: int) -> bytes:
    """The upstream body, whole up to limit bytes (content.read(n) returns only what has arrived)."""
    chunks, size = [], 0
    async for chunk in up.content.iter_any():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def _upstream_error(proxy, backend: Backend, out: Outcome, kind: str, message: str, eject=False) -> None:
    proxy.metrics.upstream_errors.labels(backend.name, kind).inc()
    out.error = message
    if out.sent:
        out.error = f"stream interrupted: {message}"
        return
    out.status, out.retryable = 502, True   # whatever status line came first, no answer went out
    if eject and proxy.router.eject(backend, message):
        _ejected(proxy, backend, kind)


def _answered(proxy, backend: Backend, status: int) -> None:
    """Count an answer (or its failure, as the 5xx it amounts to) toward the backend's max_fails."""
    if proxy.router.answered(backend, status, proxy.config.max_fails):
        _ejected(proxy, backend, "5xx")


def _ejected(proxy, backend: Backend, reason: str) -> None:
    proxy.metrics.ejections.labels(backend.name, reason).inc()
    proxy.log.warning("backend %s taken out until its next good /health: %s", backend.name, backend.last_error)


def _ids(ex: Exchange, backend: Backend) -> dict:
    return {"X-Backend": backend.name, "X-Request-Id": ex.request_id, "X-Retries": str(ex.attempts - 1)}


def _reply(ex: Exchange, out: Outcome) -> web.StreamResponse:
    """The last attempt as the request's outcome, and what the client gets of it."""
    ex.outcome = out
    backend = ex.slot
    if out.sent:
        if out.error and ex.request.transport is not None:
            # The upstream broke off mid-answer: cut the client's connection too, so it sees a broken
            # stream rather than a cleanly terminated (and silently truncated) one.
            ex.request.transport.abort()
        return ex.request["response"]
    if out.whole is not None:
        return out.whole
    if out.buffered is not None:
        status, headers, body = out.buffered
        return web.Response(status=status, body=body, headers={**headers, **_ids(ex, backend)})
    out.status = out.status or 502
    kind = "upstream_timeout" if out.status == 504 else "upstream_error"
    return json_error(out.status, out.error or "upstream failed", kind, _ids(ex, backend))


def _log_attempt(ex: Exchange, proxy, backend: str | None, out: Outcome, final: bool) -> None:
    """One results-log line per attempt at a chat/completions request (backend None: it got none)."""
    if not ex.logged:
        return
    entry = {"ts": utc_now_ms(),
             "trace_id": ex.trace_id, "otel_trace_id": ex.otel_trace, "request_id": ex.request_id,
             "backend": backend,
             "path": ex.request.path, "status": out.status,
             "latency_ms": round((time.monotonic() - ex.t0) * 1000, 1),
             "attempt": ex.attempts, "attempt_ms": out.attempt_ms, "final": final,
             "retries": max(0, ex.attempts - 1), "queued_ms": ex.queued_ms,
             "stream": bool(out.observer and out.observer.streamed)}
    if ex.model is not None or ex.pool is not None:
        entry["model"] = ex.model
        if ex.pool != ex.model:
            entry["served_model"] = ex.pool   # an alias or an adapter: the group it belongs to
    if ex.route is not None:
        entry["route"] = ex.route.decision
        entry["match_tokens"] = ex.route.matched_tokens
        entry["overruled"] = ex.route.overruled
        entry["cached_tokens"] = out.observer.engine_cache()[0] if out.observer else None
    if ex.tenant is not None:
        entry["tenant"] = ex.tenant.name
    if ex.fixups:
        entry["fixups"] = ex.fixups
    summary = out.observer.summary() if out.observer else {"error": out.error}
    if out.error and not summary.get("error"):
        summary["error"] = out.error
    entry.update(summary)
    if final and ex.splice is not None:
        entry.update(ex.splice.log_fields())
    proxy.results.write(entry)
