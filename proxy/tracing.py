"""W3C trace context (https://www.w3.org/TR/trace-context/) on the request path: the client's `traceparent`
read, a trace started when it has none, a span id per attempt at a backend. Cheap: one regular
expression per request, ids from a seeded generator (no system call per request)."""
from __future__ import annotations

import random
import re

# version-traceid-parentid-flags, lowercase hex only; a version after 00 may carry more fields after a '-'.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
SAMPLED = "01"     # the flags of a trace the proxy starts: recorded (the proxy and the engines export it)
NOT_SAMPLED = "00"  # ... or, past otlp.sample_ratio, not recorded by anyone

_random = random.Random()           # seeded from os.urandom once, at import
_bits = _random.getrandbits


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid `traceparent` header, else None.

    Valid as the W3C spec says: version 00 is exactly 55 characters; a later version (not ff) is read as
    00 when its first 55 characters are; ids are lowercase hex and not all zeros."""
    if not value or len(value) < 55:
        return None
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return None
    version, trace, parent, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None) or trace == _ZERO_TRACE or parent == _ZERO_SPAN:
        return None
    return trace, parent, flags


def new_trace_id() -> str:
    """A random 128-bit trace id in 32 lowercase hex digits (never all zeros)."""
    value = _bits(128)
    while not value:
        value = _bits(128)
    return f"{value:032x}"


def new_span_id() -> str:
    """A random 64-bit span id in 16 lowercase hex digits (never all zeros)."""
    value = _bits(64)
    while not value:
        value = _bits(64)
    return f"{value:016x}"


def chance() -> float:
    """A random number in [0, 1): the sampling draw of a trace the proxy starts."""
    return _random.random()


def sampled(flags: str) -> bool:
    """Whether the flags' sampled bit is set (the caller records this trace)."""
    return bool(int(flags, 16) & 1)
