"""A request body read once: its JSON's shape checked against proxy.limits before it is parsed, parsed
with its long strings (base64 images) stood in for, and what the proxy reads of it (`model`, `user`,
the prompt) taken from that one parse.

Why not json.loads(body) on the event loop: a MiB-sized body holds the loop for milliseconds (a 6 MB
four-image request ~10 ms), and a small body can expand a hundredfold (8 MB of `{}` parts are 4,000,000
dicts: 22 s and 400 MB). So:
- the shape is scanned first, in bounded steps (SCAN_CHUNK bytes of C work between two bytecodes, so a
  worker thread lets go of the GIL often): JSON values (objects, arrays, items after a comma) and
  nesting depth are counted, and a body past proxy.limits is refused before anything is built of it;
- strings longer than a scan window are not decoded: the parse sees a stand-in, the bytes stay in
  the body (an image counts by a digest of them; hashlib lets go of the GIL), so the parse costs the
  body's structure, not its payload;
- the caller runs this in a worker thread for bodies over limits.inline_kb (forward.py).
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field
from itertools import accumulate

SCAN_CHUNK = 16 * 1024    # bytes scanned per C call (at most ~2 ms, a chunk of nothing but tiny strings): the longest the scan holds the GIL at once
DEPTH_STEP = 8192         # brackets summed per C call (~0.3 ms) for the depth
FIND_WINDOW = 1024 * 1024  # bytes searched for a string's closing quote per call (memchr: ~0.1 ms)
LONG_STRING = 4096        # a string longer than a scan window and this is stood in for, not decoded
NO_MODEL = ""             # the body names no `model` (models.py re-exports it)

# Runs of bytes outside strings and whole strings, in one C call; it stops before a string that does not
# end within its window (SCAN_CHUNK): _string_end follows that one.
_PLAIN = re.compile(rb'(?:[^"]+|"[^"\\]*(?:\\.[^"\\]*)*")*', re.S)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.S)   # a string's inside, up to its closing quote
_NOT_STRUCTURE = bytes(range(256)).translate(None, b"[]{},")
_NOT_BRACKET = bytes(range(256)).translate(None, b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_TAG = secrets.token_hex(6)   # this process's: a client's own string never reads as a stand-in
_STAND_IN = re.compile(rb'"\\u0000' + _TAG.encode() + rb':(\d+)"')


@dataclass(frozen=True)
class Limits:
    """What one request body may expand into (proxy.limits; docs/proxy.md "Bodies" says why each)."""

    max_json_values: int = 50_000
    max_json_depth: int = 128
    max_messages: int = 8192
    max_content_parts: int = 4096
    max_prompt_blocks: int = 8192
    inline_kb: int = 64


class Refused(Exception):
    """A body past one of proxy.limits: the 400's message, naming the setting."""


@dataclass
class Parsed:
    """A body as the proxy reads it. request: its top-level object (None: the body is not a JSON object,
    which the engine answers itself); long strings in it are stand-ins (text() and digest() read them)."""

    body: bytes
    limits: Limits = Limits()
    request: dict | None = None
    spans: list = field(default_factory=list)   # (start, end) in body of each stood-in string, quotes included

    def _index(self, value) -> int | None:
        if isinstance(value, str) and value.startswith("\x00" + _TAG + ":"):
            return int(value[len(_TAG) + 2:])
        return None

    def raw_len(self, value) -> int:
        """A string's length as sent (a stand-in's bytes in the body), what decoding it costs."""
        i = self._index(value)
        return len(value) if i is None else self.spans[i][1] - self.spans[i][0]

    def text(self, value):
        """value with a stand-in decoded (a long string the parse skipped)."""
        i = self._index(value)
        if i is None:
            return value
        start, end = self.spans[i]
        return json.loads(self.body[start:end])

    def digest(self, value) -> str:
        """A short digest of any JSON value (an image part), its long strings by their bytes in the body."""
        raw = json.dumps(value, sort_keys=True).encode()
        if self.spans:
            raw = _STAND_IN.sub(lambda m: self._span_digest(int(m.group(1))), raw)
        return hashlib.blake2b(raw, digest_size=8).hexdigest()

    def _span_digest(self, i: int) -> bytes:
        start, end = self.spans[i]
        return b'"' + hashlib.blake2b(memoryview(self.body)[start:end], digest_size=16).hexdigest().encode() + b'"'

    @property
    def model(self) -> str | None:
        """The top-level `model` (NO_MODEL when it has none or not a string; None: not a JSON object)."""
        if self.request is None:
            return None
        model = self.text(self.request.get("model"))
        return model if isinstance(model, str) else NO_MODEL

    @property
    def user(self):
        """The top-level `user` as sent (a string, a number, anything; None when absent)."""
        return None if self.request is None else self.text(self.request.get("user"))

    def with_user(self, user: str) -> bytes:
        """The body again with `user` set to user (its long strings copied back byte for byte); the parse
        takes it too (what is built of it later, a continuation, carries it)."""
        self.request = {**self.request, "user": user}
        return self.dumps(self.request)

    def dumps(self, value) -> bytes:
        """value (built from request: its long strings stand-ins) as JSON, its stand-ins the body's strings
        again, byte for byte: none of them decoded."""
        out = json.dumps(value, separators=(",", ":")).encode()   # ASCII: a lone surrogate encodes too
        if self.spans:
            body = self.body
            out = _STAND_IN.sub(lambda m: body[slice(*self.spans[int(m.group(1))])], out)
        return out


def loads(text: bytes):
    """json.loads(text): of a text that opens an object (a body, an SSE event's data) decoded as UTF-8 at
    once, as json.loads finds it must be after working out the encoding (a UTF-16 or UTF-32 text begins
    with a BOM or a zero byte); ValueError as json.loads."""
    if text[:1] == b"{" and text[1:2] != b"\x00":
        return json.loads(text.decode("utf-8", "surrogatepass"))
    return json.loads(text)


def parse(body: bytes, limits: Limits = Limits()) -> Parsed:
    """body read as the proxy reads it; Refused when its shape is past limits (the parse never starts)."""
    parsed = Parsed(body, limits)
    if not body.lstrip()[:1] == b"{":
        return parsed          # empty, an array, not JSON: the engine answers it (or it has no body)
    skeleton = body if _small(body, limits) else _skeleton(body, parsed.spans, limits)
    if skeleton is None:
        return parsed          # an unterminated string: not JSON
    try:
        request = loads(skeleton)
    except (ValueError, RecursionError):
        return parsed
    parsed.request = request if isinstance(request, dict) else None
    return parsed


def _small(body: bytes, limits: Limits) -> bool:
    """Whether body is within every limit the scan checks whatever its content: no string in it can be
    long, it has fewer bytes than the values allowed (a value takes one at least) and fewer brackets,
    strings' included, than the depth allowed. Most requests are: json.loads takes them as sent."""
    return (len(body) <= min(LONG_STRING, limits.max_json_values)
            and body.count(b"[") + body.count(b"{") <= limits.max_json_depth)


def _skeleton(body: bytes, spans: list, limits: Limits) -> bytes | None:
    """body with its long strings replaced by stand-ins (their spans appended to spans), its JSON values
    and depth counted on the way (Refused past limits); None when a string never ends."""
    out, n, pos = [], len(body), 0
    values = depth = 0
    while pos < n:
        end = _PLAIN.match(body, pos, min(n, pos + SCAN_CHUNK)).end()
        if end > pos:
            segment = body[pos:end]
            out.append(segment)
            values, depth = _count(_STRING.sub(b"", segment), values, depth, limits)
            pos = end
            continue
        # a long string, or one with escapes, or a short one cut by the chunk's end
        close = _string_end(body, pos)
        if close is None:
            return None
        if close - pos > LONG_STRING:
            out.append(b'"\\u0000%s:%d"' % (_TAG.encode(), len(spans)))
            spans.append((pos, close))
        else:
            out.append(body[pos:close])
        pos = close
    return b"".join(out)


def _string_end(body: bytes, start: int) -> int | None:
    """The index past the closing quote of the string opening at start (None: it never closes), found a
    window at a time: memchr for the quote while no escape comes first, the regex over escapes."""
    pos, n = start + 1, len(body)
    while pos < n:
        window = min(n, pos + FIND_WINDOW)
        quote = body.find(b'"', pos, window)
        escape = body.find(b"\\", pos, window if quote == -1 else quote)
        if escape == -1:
            if quote != -1:
                return quote + 1
            pos = window
            continue
        pos = _STRING_REST.match(body, escape, min(n, escape + SCAN_CHUNK)).end()
        if pos >= n or (body[pos] == 0x5C and pos + 1 >= n):
            return None                      # no closing quote, or a backslash as the body's last byte
        if body[pos] == 0x22:                # '"'
            return pos + 1
        # else the chunk ended (or cut an escape in two): go on from there
    return None


def _count(bare: bytes, values: int, depth: int, limits: Limits) -> tuple[int, int]:
    """Add a stretch of JSON outside strings to the running count of values and depth; Refused past limits."""
    structure = bare.translate(None, _NOT_STRUCTURE)
    values += len(structure) - structure.count(b"]") - structure.count(b"}")
    if values > limits.max_json_values:
        raise Refused(f"the body holds more than {limits.max_json_values} JSON values; at most that many "
                      "are accepted (proxy.limits.max_json_values)")
    brackets = structure.translate(None, b",")
    for at in range(0, len(brackets), DEPTH_STEP):      # a short C call each: the GIL changes hands between
        piece = brackets[at:at + DEPTH_STEP]
        if max(accumulate(map(_STEP.__getitem__, piece), initial=depth)) > limits.max_json_depth:
            raise Refused(f"the body's JSON nests deeper than {limits.max_json_depth} levels; at most that "
                          "many are accepted (proxy.limits.max_json_depth)")
        depth += 2 * (piece.count(b"[") + piece.count(b"{")) - len(piece)
    return values, depth
