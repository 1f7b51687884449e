"""The export of the proxy's spans (`otlp.endpoint` in its config): one SERVER span per request and a
CLIENT span per attempt at a backend, sent over OTLP/HTTP (protobuf) by the OpenTelemetry SDK in a child
process, the span exporter (proxy/otlp_export.py), so that building and encoding them never competes with
the event loop for the proxy's GIL.

Never on the request's path: the handler queues a small tuple when its request is over; a thread of the
proxy takes what has queued a few times a second and writes it to the exporter's standard input as one
batch (a marshal, a few tenths of a microsecond per request). The queue is bounded, and an exporter that
does not read holds up only that thread: what does not fit is dropped and counted
(proxy_trace_spans_dropped_total), as are the spans the exporter says it dropped (its own queue full, an
export that failed) and those a dead exporter took with it. An exporter that dies is said in one line and
started again, at most every RESTART_S. The span ids are the ones the proxy sent the backends in
`traceparent`, so an engine's span is the child of its attempt.

The SDK is optional: the exporter imports it; this module only checks that it is there (missing()).
"""
from __future__ import annotations

import collections
import logging
import marshal
import os
import select
import signal
import subprocess
import sys
import threading
import time

from .config import ConfigError, OtlpConfig

log = logging.getLogger("proxy")

INSTALL = "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
# What the export imports, for the deploy's check of the proxy's Python (fleet/host/preflight.py).
MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
# The directory that holds the proxy package: the exporter imports it from there whatever its cwd.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def missing() -> str | None:
    """Why this Python cannot export spans (one sentence), or None when it can."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        return (f"otlp.endpoint is set but this Python ({sys.executable}) lacks the OpenTelemetry SDK "
                f"({e.name or e}); run `{INSTALL}` with it, or unset proxy.otlp.endpoint.")
    return None


class _Child:
    """One span exporter process, and what the proxy knows of its spans."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid
        self.fd = popen.stdin.fileno()
        os.set_blocking(self.fd, False)   # the writer waits with poll, a bounded time at a stop
        self.poll = select.poll()         # (not select: a proxy holding many sockets has descriptors past 1024)
        self.poll.register(self.fd, select.POLLOUT)
        self.sent = 0        # spans written to it whole (the writer thread)
        self.settled = 0     # of those, spans it said were exported or dropped (the reader thread)
        self.reader: threading.Thread | None = None


class SpanExport:
    """Spans of finished requests: queued by the event loop, handed to the exporter process by a thread."""

    QUEUE = 8192          # finished requests waiting to be handed over
    BUILD_S = 0.2         # how often the writer thread takes what has queued
    STOP_S = 2.0          # at a stop: to hand the last records over, and for the exporter to send them
    RESTART_S = 5.0       # an exporter that died is started again at most this often

    def __init__(self, config: OtlpConfig, on_dropped=None):
        reason = missing()
        if reason:
            raise ConfigError(reason)
        self.config = config
        self._on_dropped = on_dropped   # called with a count of spans lost, from the writer or reader thread
        self._records: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._child: _Child | None = None
        self._next_start = 0.0
        self._lock = threading.Lock()   # the drop count (writer and reader threads)
        self.dropped = 0       # spans lost in all
        self.restarts = 0      # exporters started again after one died

    @property
    def child_pid(self) -> int | None:
        """The running exporter's pid (None: none runs)."""
        child = self._child
        return child.pid if child is not None and child.popen.poll() is None else None

    def start(self) -> None:
        """Start the exporter process and the writer thread."""
        self._spawn()
        self._thread = threading.Thread(target=self._run, name="otlp-spans", daemon=True)
        self._thread.start()
        log.info("traces: exporting spans to %s (span exporter pid %s)", self.config.endpoint, self.child_pid)

    def record(self, rec: tuple) -> None:
        """Queue one finished request (forward.Exchange.span_record's tuple); dropped when the queue is full."""
        if len(self._records) >= self.QUEUE:
            self._drop(1 + len(rec[-1]))
            return
        self._records.append(rec)

    def stop(self) -> None:
        """Hand what is queued over (up to STOP_S), close the exporter's input and give it STOP_S and a
        second to send the last spans and exit; then it is killed, by its pid."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        child, self._child = self._child, None
        if child is None:
            return
        try:
            child.popen.wait(self.STOP_S + 1)
        except subprocess.TimeoutExpired:
            log.warning("traces: the span exporter (pid %d) did not exit within %gs of its input's end; "
                        "killed", child.pid, self.STOP_S + 1)
            self._kill(child)
        self._settle(child)

    def _drop(self, spans: int) -> None:
        if spans <= 0:
            return
        with self._lock:
            self.dropped += spans
        if self._on_dropped is not None:
            self._on_dropped(spans)

    # --- the exporter process ---------------------------------------------------------------------

    def _spawn(self) -> None:
        """Start an exporter (the proxy's Python and environment: its FLEET_TAG, its process group)."""
        self._next_start = time.monotonic() + self.RESTART_S
        env = dict(os.environ)
        env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        argv = [sys.executable, "-m", "proxy.otlp_export", "--endpoint", self.config.endpoint,
                "--timeout-s", repr(float(self.config.timeout_s)), "--service-name", self.config.service_name]
        try:
            popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, close_fds=True)
        except OSError as e:
            log.error("traces: the span exporter could not be started (%s); trying again in %gs",
                      e.strerror or e, self.RESTART_S)
            return
        child = _Child(popen)
        child.reader = threading.Thread(target=self._read, args=(child,), name="otlp-news", daemon=True)
        child.reader.start()
        self._child = child

    def _read(self, child: _Child) -> None:
        """The exporter's news, until its output ends: spans exported or dropped, lines for the log."""
        levels = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}
        for raw in child.popen.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            word, _, rest = line.partition(" ")
            if word in ("exported", "dropped") and rest.isdigit():
                n = int(rest)
                with self._lock:
                    child.settled += n
                if word == "dropped":
                    self._drop(n)
            elif word in levels:
                log.log(levels[word], "%s", rest)
            elif line:
                log.warning("traces: span exporter (pid %d): %s", child.pid, line[:500])

    def _settle(self, child: _Child) -> None:
        """After an exporter's end: read its last news, count the spans it took with it as dropped."""
        if child.reader is not None:
            child.reader.join(2)
        try:
            child.popen.stdout.close()
        except OSError:
            pass
        with self._lock:
            lost = child.sent - child.settled
        self._drop(lost)

    def _kill(self, child: _Child) -> None:
        try:
            os.kill(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            child.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def _buried(self, child: _Child) -> None:
        """An exporter that exited on its own: one line, its spans counted, a new one started in time."""
        self._child = None
        try:
            child.popen.stdin.close()
        except OSError:
            pass
        self._settle(child)
        code = child.popen.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        wait = max(0.0, self._next_start - time.monotonic())
        again = "not started again: the proxy stops" if self._stop.is_set() else \
            "starting it again" + (f" in {wait:.1f}s" if wait > 0.05 else "")
        log.error("traces: the span exporter (pid %d) %s; %d span(s) it held are dropped; %s",
                  child.pid, how, max(0, child.sent - child.settled), again)

    # --- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.BUILD_S):
            self._guarded(None)
        self._guarded(time.monotonic() + self.STOP_S)
        child = self._child
        if child is not None:
            try:
                child.popen.stdin.close()    # the exporter's end of input: it sends what it has, and exits
            except OSError:
                pass

    def _guarded(self, deadline: float | None) -> None:
        try:
            self._tick(deadline)
        except Exception as e:        # the writer thread must outlive whatever one batch did
            log.error("traces: handing spans to the exporter failed: %s: %s", type(e).__name__, e)

    def _tick(self, deadline: float | None) -> None:
        """Take what has queued and write it to the exporter as one batch; mind a dead exporter."""
        child = self._child
        if child is not None and child.popen.poll() is not None:
            self._buried(child)
            child = None
        if child is None and deadline is None and time.monotonic() >= self._next_start:
            self._spawn()
            child = self._child
            if child is not None:
                self.restarts += 1
        records = self._records
        if not records:
            return
        batch = []
        spans = 0
        while records:
            rec = records.popleft()
            batch.append(rec)
            spans += 1 + len(rec[-1])
        if child is None:
            self._drop(spans)
            return
        try:
            data = marshal.dumps(batch)
        except ValueError as e:       # a value marshal does not know: never expected, never fatal
            log.error("traces: a batch of spans could not be written: %s", e)
            self._drop(spans)
            return
        if self._write(child, len(data).to_bytes(4, "big") + data, deadline):
            child.sent += spans
        else:
            self._drop(spans)

    def _write(self, child: _Child, frame: bytes, deadline: float | None) -> bool:
        """Write frame whole to the exporter's input; False when it died, or at a stop past the deadline."""
        view = memoryview(frame)
        while view:
            try:
                view = view[os.write(child.fd, view):]
                continue
            except BlockingIOError:
                pass
            except OSError:           # EPIPE: it died
                return False
            if child.popen.poll() is not None:
                return False
            if deadline is None and self._stop.is_set():
                deadline = time.monotonic() + self.STOP_S
            if deadline is not None and time.monotonic() >= deadline:
                return False
            child.poll.poll(100)
        return True
