"""The results log: one JSON line per chat/completions request, written off the event loop."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import re
import threading
import time
from datetime import datetime, timezone

from . import logfile
from .body import loads
from .resume import json_string
from .config import ResultsLogConfig

log = logging.getLogger("proxy")

SNIPPET_CHARS = 120
PREFIX_CHARS = 256  # content kept per response: the snippet, and room to see an opening <think>
BODY_KEEP_BYTES = 4 * 1024 * 1024  # a non-stream or error body is kept whole up to this size
LOGGED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

# A JSON key "user" followed by a scalar. Only a key can be followed by ':' and an escaped quote
# inside a string never matches '"user"', so this finds the request's user field without parsing
# a body that may carry tens of MiB of base64 images.
_USER_KEY = b'"user"'
_USER_VALUE = re.compile(   # a string of at most 1,024 characters: each try is bounded
    rb'\s*:\s*("(?:[^"\\]|\\.){0,1024}"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)')


# The `"user"` texts looked at, at most: a body of millions of them costs a bounded scan, not one step each.
USER_HITS = 64


def user_value(body: bytes) -> bytes | None:
    """The raw JSON text of the request's `user` value (b'"abc"', b'42', b'null'), None when absent (or
    not among the first USER_HITS places the text `"user"` appears). The request path reads `user` from
    the body's parse (proxy/body.py); this scan is for a body that is not a JSON object."""
    at = body.find(_USER_KEY)
    for _ in range(USER_HITS):
        if at == -1:
            break
        m = _USER_VALUE.match(body, at + len(_USER_KEY))
        if m:
            return m.group(1)
        at = body.find(_USER_KEY, at + len(_USER_KEY))
    return None


# One JSON line: compact, UTF-8 as it is (json.dumps with these arguments makes an encoder per call).
_LINE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_SECOND = [None, ""]   # the last whole second a line was stamped in, and its text


def utc_now_ms() -> str:
    """Now, as datetime.now(timezone.utc).isoformat(timespec="milliseconds") writes it (a line's `ts`),
    the date and time of day worked out once a second."""
    ns = time.time_ns()
    second, rest = divmod(ns, 1_000_000_000)
    if second != _SECOND[0]:
        _SECOND[:] = second, datetime.fromtimestamp(second, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{_SECOND[1]}.{rest // 1_000_000:03d}+00:00"


def trace_id_of(raw: bytes | None) -> str | None:
    """The trace id from the raw `user` value user_value found: a string (a number stays its digits)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) or value is None else json.dumps(value)


class ResponseObserver:
    """Sums up a chat/completions response as its chunks pass by on their way to the client.

    status: the upstream status. streamed: the response is SSE (parsed event by event, only the
    first PREFIX_CHARS of content kept); otherwise the body is kept (bounded) and parsed once.
    """

    def __init__(self, status: int, streamed: bool):
        self.status = status
        self.streamed = streamed and status == 200
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.reported_tokens: int | None = None   # usage.completion_tokens as the answer said (no estimate)
        self.cached_tokens: int | None = None     # usage.prompt_tokens_details.cached_tokens (the engine's)
        self._parsed = False
        self.error: str | None = None
        self.done = False   # the stream's last event (`data: [DONE]`) has passed
        self._content_chunks = 0
        self._reasoning = False
        self._prefix: list[str] = []
        self._prefix_len = 0
        self._pending = b""  # an SSE line cut by a chunk boundary
        self._body: list[bytes] = []
        self._body_len = 0

    def feed(self, chunk: bytes) -> None:
        """Take the next chunk of the response body."""
        if self.streamed:
            self._feed_sse(chunk)
        elif self._body_len < BODY_KEEP_BYTES:
            self._body.append(chunk)
            self._body_len += len(chunk)

    def engine_cache(self) -> tuple[int | None, int | None]:
        """The prompt's tokens the engine found in its prefix cache, and its prompt tokens, as its usage
        said (None: it did not say; vLLM says the first with --enable-prompt-tokens-details)."""
        if not self.streamed:
            self._parse_body()
        return self.cached_tokens, self.prompt_tokens

    def summary(self) -> dict:
        """The results log fields this response determines."""
        if not self.streamed:
            self._parse_body()
        elif self.completion_tokens is None and self._content_chunks:
            # No usage chunk (the client did not ask for include_usage): one chunk is one token.
            self.completion_tokens = self._content_chunks
        prefix = "".join(self._prefix)
        return {
            "finish_reason": self.finish_reason,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "think": self._reasoning or "<think>" in prefix,
            "snippet": prefix[:SNIPPET_CHARS],
            "error": self.error,
        }

    def _feed_sse(self, chunk: bytes) -> None:
        """Parse the complete SSE lines in pending + chunk."""
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            if not payload:
                continue
            try:
                event = loads(payload)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._absorb(event, "delta")

    def take_event(self, event: dict) -> None:
        """One SSE event (a one-line `data:` JSON object) parsed by the stream's splice: taken as
        _feed_sse takes it, without a second parse."""
        self._absorb(event, "delta")

    def take_run(self, contents: list[bytes], usage, said: int) -> None:
        """A run of SSE events the stream's splice read at once (resume.Splice._run: one choice each, its
        content, no finish_reason, no error): their contents as the bodies of the engine's JSON strings,
        said of them not empty, usage the last event's (None: none). Taken as _absorb takes them one by one:
        the usage the last one's, the contents counted, decoded only while the snippet's prefix needs them."""
        if isinstance(usage, dict):
            self._usage(usage)
        self._content_chunks += said
        for body in contents:
            if self._prefix_len >= PREFIX_CHARS:
                break
            if body:
                content = json_string(body)
                self._prefix.append(content)
                self._prefix_len += len(content)

    def _parse_body(self) -> None:
        """Parse the kept body once: a completion when 200, else the backend's error text."""
        if self._parsed:
            return
        self._parsed = True
        body = b"".join(self._body)
        if self.status != 200:
            self.error = body.decode("utf-8", "replace")
            return
        try:
            event = loads(body)
        except ValueError:
            return
        if isinstance(event, dict):
            self._absorb(event, "message")

    def _absorb(self, event: dict, part: str) -> None:
        """Take usage, finish_reason and content from one response object or SSE event."""
        if "error" in event and self.status == 200:
            self.error = json.dumps(event["error"], ensure_ascii=False)  # vLLM's mid-stream error
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        choices = event.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            inner = choice.get(part)
            inner = inner if isinstance(inner, dict) else {}
            content = inner.get("content") or choice.get("text")  # chat, or legacy completions
            reasoning = inner.get("reasoning_content") or inner.get("reasoning")
            if reasoning:
                self._reasoning = True
            if content or reasoning:
                self._content_chunks += 1
            if content and self._prefix_len < PREFIX_CHARS:
                self._prefix.append(content)
                self._prefix_len += len(content)

    def _usage(self, usage: dict) -> None:
        """Take an answer's usage: its tokens (the engine's count), its prompt's, its cache hit."""
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        tokens = usage.get("completion_tokens")
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
            self.reported_tokens = tokens
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
            self.cached_tokens = cached


class ResultsLog:
    """A rotated JSON-lines file written by a thread of its own, so the event loop never waits on the disk.

    The writer takes every line queued since its last write and writes them at once: one write, one
    flush and one stat (to notice a file deleted or moved under it) per batch, the size tracked in
    memory, so a busy proxy does not pay that per request while holding the GIL its event loop needs.
    """

    BATCH = 4096     # lines per write at most
    # With proxy.workers > 1 every worker appends to the same file (whole batches, O_APPEND: one write each;
    # proxy/workers.py sets this once per process): the size is the file's own, read per batch, and the
    # worker that finds it full rotates it under a lock on its directory; one that finds, under the lock,
    # that another has rotated it only opens the new file (the others follow by their per-batch stat).
    shared = False
    GATHER_S = 0.05  # how long the writer lets lines gather after the first one of a batch

    def __init__(self, config: ResultsLogConfig, on_dropped=None):
        self.config = config
        self._on_dropped = on_dropped          # called with the count of lines lost, from the writer thread
        self.path = os.path.abspath(config.path)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._file = None
        self._size = 0
        self._error: OSError | None = None   # why the file could not be opened again
        self._dropped = 0                      # lines lost in the current burst of failures (0: none)

    def start(self) -> None:
        """Open the file (creating its directory) and start the writer thread."""
        os.makedirs(os.path.dirname(self.path), mode=logfile.DIR_MODE, exist_ok=True)
        for note in logfile.tighten(self.path, self.config.backups):
            log.warning("%s", note)
        self._open()
        self._thread = threading.Thread(target=self._run, name="results-log", daemon=True)
        self._thread.start()

    def write(self, entry: dict) -> None:
        """Queue one entry as a JSON line."""
        self._queue.put(_LINE.encode(entry) + "\n")

    def stop(self) -> None:
        """Write what is queued, then close the file."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> None:
        # backslashreplace: a lone surrogate (a client's broken `user`, a header byte aiohttp kept as
        # surrogateescape) is written as its JSON escape \udcff instead of killing the writer.
        # 0600: its lines hold callers' `user` values and answer snippets.
        self._file = logfile.open_private(self.path, encoding="utf-8", errors="backslashreplace")
        self._size = self._file.tell()

    def _moved(self) -> bool:
        """Whether the path no longer names the open file (deleted or moved by hand, or by logrotate)."""
        try:
            here, ours = os.stat(self.path), os.fstat(self._file.fileno())
        except OSError:
            return True
        return (here.st_dev, here.st_ino) != (ours.st_dev, ours.st_ino)

    def _reopen(self) -> None:
        """After a failed write: open the file again (it may have been deleted), or try next batch."""
        try:
            if self._file is not None:
                self._file.close()
        except OSError:
            pass
        self._file = None
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._open()
            self._error = None
        except OSError as e:
            self._error = e

    def _run(self) -> None:
        done = False
        while not done:
            lines = [self._queue.get()]
            # Let a batch gather: woken per line, this thread would take the GIL from the event loop
            # thousands of times a second under load (measured: a third of the proxy's throughput).
            time.sleep(self.GATHER_S)
            while len(lines) < self.BATCH:
                try:
                    lines.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if None in lines:
                done = True
                lines = [x for x in lines if x is not None]
            try:
                self._write(lines)
            except Exception as e:   # a full disk or a deleted file must not stop the log, nor the serving
                self._failed(e, len(lines))
                self._reopen()
            else:
                self._recovered()

    def _failed(self, error: Exception, lines: int) -> None:
        """Say once per burst of failures why the file cannot be written; count the lines lost."""
        if not self._dropped:
            why = (f"{error.strerror} (errno {error.errno})" if isinstance(error, OSError) and error.strerror
                   else f"{type(error).__name__}: {error}")
            log.error("results log %s: cannot write: %s; its lines are dropped until it can be written "
                      "again, and the proxy goes on serving", self.path, why)
        self._dropped += lines
        if self._on_dropped is not None:
            self._on_dropped(lines)

    def _recovered(self) -> None:
        if self._dropped:
            log.warning("results log %s: written again; %d line(s) were dropped", self.path, self._dropped)
            self._dropped = 0

    def _write(self, lines: list[str]) -> None:
        """Write lines, rotating first whenever the next line would take the file past max_bytes."""
        limit = self.config.max_bytes
        batch: list[str] = []
        batch_size = 0
        if self._file is None or self._moved():
            self._reopen()
            if self._file is None:
                raise self._error or OSError("the file is not open")
        if self.shared:
            self._size = os.fstat(self._file.fileno()).st_size
        for line in lines:
            n = len(line.encode("utf-8", "backslashreplace"))
            if self._size + batch_size + n > limit and (self._size + batch_size) > 0:
                self._flush(batch)
                self._rotate()
                batch, batch_size = [], 0
            batch.append(line)
            batch_size += n
        self._flush(batch)
        self._size += batch_size

    def _flush(self, batch: list[str]) -> None:
        if batch:
            self._file.write("".join(batch))
            self._file.flush()

    def _rotate(self) -> None:
        """req_results.log -> .1 -> .2 ... up to backups; the oldest goes. Shared: under the directory's
        lock, and only when no other worker has rotated it since this one opened it."""
        if not self.shared:
            return self._rotate_now()
        lock = os.open(os.path.dirname(self.path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._moved():
                self._file.close()
                self._file = None
                self._open()
            else:
                self._rotate_now()
        finally:
            os.close(lock)      # and the lock with it

    def _rotate_now(self) -> None:
        self._file.close()
        self._file = None
        try:
            for k in range(self.config.backups - 1, 0, -1):
                src = f"{self.path}.{k}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{k + 1}")
            if os.path.exists(self.path):
                os.replace(self.path, f"{self.path}.1")
        finally:
            self._open()
