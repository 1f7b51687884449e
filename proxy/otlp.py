"""The export of the proxy's spans (`otlp.endpoint` in its config): one SERVER span per request and a
CLIENT span per attempt at a backend, sent over OTLP/HTTP (protobuf) by the OpenTelemetry SDK.

Never on the request's path: the handler queues a small tuple when its request is over; a thread of its
own builds the spans from it a few times a second and hands them to the SDK's BatchSpanProcessor, whose
own thread exports them. Both queues are bounded: what does not fit is dropped and counted
(proxy_trace_spans_dropped_total), as are the spans of an export that failed; a collector that is down
costs the requests nothing. The span ids are the ones the proxy sent the backends in `traceparent`
(an id generator the builder sets before each span), so an engine's span is the child of its attempt.

The SDK is optional: this module imports it only when an export is configured.
"""
from __future__ import annotations

import collections
import logging
import socket
import sys
import threading

from .config import ConfigError, OtlpConfig
from .tracing import new_span_id

log = logging.getLogger("proxy")

INSTALL = "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
# What the export imports, for the deploy's check of the proxy's Python (fleet/preflight.py).
MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


def missing() -> str | None:
    """Why this Python cannot export spans (one sentence), or None when it can."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        return (f"otlp.endpoint is set but this Python ({sys.executable}) lacks the OpenTelemetry SDK "
                f"({e.name or e}); run `{INSTALL}` with it, or unset proxy.otlp.endpoint.")
    return None


class SpanExport:
    """Spans of finished requests: queued by the event loop, built and exported by other threads."""

    QUEUE = 8192          # finished requests waiting to become spans
    BUILD_S = 0.2         # how often the builder thread takes what has queued
    SDK_QUEUE = 8192      # spans the BatchSpanProcessor holds at most (the builder never overfills it)
    BATCH = 512           # spans per export
    DELAY_MS = 1000       # the processor's export period
    STOP_S = 2.0          # at a stop, how long the last spans may take to leave

    def __init__(self, config: OtlpConfig, on_dropped=None):
        reason = missing()
        if reason:
            raise ConfigError(reason)
        self.config = config
        self._on_dropped = on_dropped   # called with a count of spans lost, from the builder or exporter thread
        self._records: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._emitted = 0      # spans handed to the processor (the builder thread)
        self._taken = 0        # spans the processor handed to the exporter (its thread)
        self._failing = 0      # spans lost in the current burst of failed exports (0: none)
        self.dropped = 0       # spans lost in all

    def start(self) -> None:
        """Set up the SDK's tracer, processor and exporter, and start the builder thread."""
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.id_generator import IdGenerator
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
        # Kept for the builder (an import statement per span costs as much as a span's attributes).
        self._api = (trace.set_span_in_context, Context, NonRecordingSpan, SpanContext, TraceFlags, Status,
                     StatusCode.ERROR, SpanKind.SERVER, SpanKind.CLIENT)

        class GivenIds(IdGenerator):
            """The ids the builder sets before it starts a span (one thread starts spans)."""

            trace_id = 0
            span_id = 0

            def generate_trace_id(self) -> int:
                return self.trace_id

            def generate_span_id(self) -> int:
                return self.span_id

            def is_trace_id_random(self) -> bool:
                return True

        # The SDK says why each export failed at every retry; this module says it once per burst.
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
        self._ids = GivenIds()
        self._inner = OTLPSpanExporter(endpoint=self.config.endpoint, timeout=self.config.timeout_s)
        self._processor = BatchSpanProcessor(_Counting(self._inner, self), max_queue_size=self.SDK_QUEUE,
                                             schedule_delay_millis=self.DELAY_MS, max_export_batch_size=self.BATCH)
        resource = Resource.create({"service.name": self.config.service_name, "host.name": socket.gethostname()})
        # shutdown_on_exit=False: no atexit hook that could hold the process's exit for the SDK's 30 s.
        self._provider = TracerProvider(resource=resource, id_generator=self._ids, shutdown_on_exit=False)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("vllm-fleet.proxy")
        self._thread = threading.Thread(target=self._run, name="otlp-spans", daemon=True)
        self._thread.start()
        log.info("traces: exporting spans to %s", self.config.endpoint)

    def record(self, rec: tuple) -> None:
        """Queue one finished request (forward.Exchange.span_record's tuple); dropped when the queue is full."""
        if len(self._records) >= self.QUEUE:
            self._drop(1 + len(rec[-1]))
            return
        self._records.append(rec)

    def stop(self) -> None:
        """Build what is queued, then give the last export up to STOP_S (a collector that is down
        holds nothing up)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        closer = threading.Thread(target=self._provider.shutdown, name="otlp-stop", daemon=True)
        closer.start()
        closer.join(self.STOP_S)
        if closer.is_alive():
            self._inner.shutdown()   # ends the retries of an export still waiting on the collector

    def _drop(self, spans: int) -> None:
        self.dropped += spans
        if self._on_dropped is not None:
            self._on_dropped(spans)

    def _run(self) -> None:
        while not self._stop.wait(self.BUILD_S):
            self._build_queued()
        self._build_queued()

    def _build_queued(self) -> None:
        records = self._records
        while records:
            rec = records.popleft()
            spans = 1 + len(rec[-1])
            if self._emitted - self._taken + spans > self.SDK_QUEUE:
                self._drop(spans)      # the exporter is behind (a collector down): the SDK would drop them
                continue
            try:
                self._build(rec)
            except Exception as e:     # a span that cannot be built must not stop the others
                log.error("traces: a span could not be built: %s: %s", type(e).__name__, e)
                self._drop(spans)
                continue
            self._emitted += spans

    def _build(self, rec: tuple) -> None:
        """The request's SERVER span and its attempts' CLIENT spans, started and ended at their times."""
        in_context, Context, NonRecordingSpan, SpanContext, TraceFlags, Status, ERROR, SERVER, CLIENT = self._api
        (method, path, t0, end, wall_ns, status, trace_id, parent_id, flags, backend, model, queued_ms,
         ttfb, request_id, prompt_tokens, output_tokens, attempts) = rec

        def ns(t: float) -> int:
            return wall_ns + int((t - t0) * 1e9)
        name = f"{method} {path}"
        context = Context()
        if parent_id is not None:
            remote = SpanContext(int(trace_id, 16), int(parent_id, 16), is_remote=True,
                                 trace_flags=TraceFlags(int(flags, 16)))
            context = in_context(NonRecordingSpan(remote), context)
        # The method and path are in the span's name; each attribute costs (the SDK checks and encodes it).
        attributes = {"http.response.status_code": status, "proxy.request_id": request_id,
                      "proxy.retries": max(0, len(attempts) - 1), "proxy.queue_wait_ms": queued_ms}
        if backend:
            attributes["proxy.backend"] = backend
        if model:
            attributes["proxy.model"] = model
        if ttfb is not None:
            attributes["proxy.time_to_first_byte_ms"] = round(ttfb * 1000, 1)
        if prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = prompt_tokens
        if output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = output_tokens
        self._ids.trace_id = int(trace_id, 16)
        self._ids.span_id = int(new_span_id(), 16)
        server = self._tracer.start_span(name, context=context, kind=SERVER, attributes=attributes,
                                         start_time=ns(t0))
        if status >= 500:
            server.set_status(Status(ERROR, f"status {status}"))
        below = in_context(server, Context())
        for n, (span_id, attempt_backend, start, ms, attempt_status, error) in enumerate(attempts, 1):
            self._ids.span_id = int(span_id, 16)
            child = self._tracer.start_span(name, context=below, kind=CLIENT, start_time=ns(start),
                                            attributes={"proxy.backend": attempt_backend, "proxy.attempt": n,
                                                        "http.response.status_code": attempt_status})
            if error or attempt_status >= 400:
                child.set_status(Status(ERROR, (error or f"status {attempt_status}")[:500]))
            child.end(end_time=ns(start + ms / 1000))
        server.end(end_time=ns(end))

    def exported(self, spans: int, ok: bool) -> None:
        """The exporter's news (its thread): a failure is counted and said once per burst."""
        if not ok:
            if not self._failing:
                log.error("traces: export to %s failed (the collector is unreachable or refused it); spans are "
                          "dropped and counted in proxy_trace_spans_dropped_total until it works again",
                          self.config.endpoint)
            self._failing += spans
            self._drop(spans)
        elif self._failing:
            log.warning("traces: exporting to %s again; %d span(s) were dropped", self.config.endpoint, self._failing)
            self._failing = 0


def _Counting(inner, owner: SpanExport):
    """The exporter wrapped: what the processor hands over leaves its queue (counted first, so the
    builder's estimate of that queue never runs short), and a failed export is counted as dropped."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Counting(SpanExporter):
        def export(self, spans):
            owner._taken += len(spans)
            try:
                ok = inner.export(spans) is SpanExportResult.SUCCESS
            except Exception:
                ok = False
            owner.exported(len(spans), ok)
            return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

        def shutdown(self):
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    return Counting()
