"""The span exporter: the proxy's child process that turns its finished requests into OpenTelemetry spans
and sends them over OTLP/HTTP (`python -m proxy.otlp_export --endpoint URL ...`, started by
proxy/otlp.py's SpanExport with the proxy's own Python and environment, so it carries the proxy's
FLEET_TAG and a stop of the proxy finds it).

Its standard input is the proxy's records, in batches: 4 bytes (big-endian length) then a marshal of a
list of forward._span_record tuples (the proxy and this process run the same interpreter). Each batch is
built into spans at once (one SERVER span per request, a CLIENT span per attempt, with the span ids the
proxy sent the backends) and handed to the SDK's BatchSpanProcessor, whose thread exports them.

Its standard output is its news for the proxy, one line each: `exported N` and `dropped N` (spans),
`error TEXT` and `warning TEXT` (for the proxy's log); its standard error goes the same way.

It exits at the end of its input (the proxy closed it, or died), after giving the last export up to
STOP_S. SIGTERM and SIGINT are ignored: a signal to the proxy's process group (a stop, Ctrl-C) must not
lose the spans the proxy still hands over while it drains.
"""
from __future__ import annotations

import argparse
import logging
import marshal
import os
import signal
import socket
import sys
import threading

from .tracing import new_span_id


class Report:
    """The lines this process tells the proxy (from the main thread and the exporter's)."""

    def __init__(self, stream):
        self._stream = stream
        self._lock = threading.Lock()

    def say(self, word: str, text) -> None:
        line = f"{word} {' '.join(str(text).split())}\n"
        with self._lock:
            try:
                self._stream.write(line)
                self._stream.flush()
            except (OSError, ValueError):   # the proxy is gone: nobody to tell
                pass


class Builder:
    """The SDK's tracer, processor and exporter, and the spans of each record."""

    SDK_QUEUE = 8192      # spans the BatchSpanProcessor holds at most (the builder never overfills it)
    BATCH = 512           # spans per export
    DELAY_MS = 1000       # the processor's export period
    STOP_S = 2.0          # at the end of the input, how long the last spans may take to leave

    def __init__(self, endpoint: str, timeout_s: float, service_name: str, report: Report):
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.id_generator import IdGenerator
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
        self.endpoint = endpoint
        self.report = report
        self._emitted = 0      # spans handed to the processor (the main thread)
        self._taken = 0        # spans the processor handed to the exporter (its thread)
        self._failing = 0      # spans lost in the current burst of failed exports (0: none)
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

        # The SDK says why each export failed at every retry; this process says it once per burst.
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
        self._ids = GivenIds()
        self._inner = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)
        self._processor = BatchSpanProcessor(_Counting(self._inner, self), max_queue_size=self.SDK_QUEUE,
                                             schedule_delay_millis=self.DELAY_MS, max_export_batch_size=self.BATCH)
        resource = Resource.create({"service.name": service_name, "host.name": socket.gethostname()})
        # shutdown_on_exit=False: no atexit hook that could hold the process's exit for the SDK's 30 s.
        self._provider = TracerProvider(resource=resource, id_generator=self._ids, shutdown_on_exit=False)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("vllm-fleet.proxy")

    def build_all(self, records: list) -> None:
        """Build a batch of records; what the processor cannot take is dropped (and said)."""
        dropped = 0
        for rec in records:
            spans = 1 + len(rec[-1])
            if self._emitted - self._taken + spans > self.SDK_QUEUE:
                dropped += spans       # the exporter is behind (a collector down): the SDK would drop them
                continue
            try:
                self._build(rec)
            except Exception as e:     # a span that cannot be built must not stop the others
                self.report.say("error", f"traces: a span could not be built: {type(e).__name__}: {e}")
                dropped += spans
                continue
            self._emitted += spans
        if dropped:
            self.report.say("dropped", dropped)

    def _build(self, rec) -> None:
        """The request's SERVER span and its attempts' CLIENT spans, started and ended at their times."""
        in_context, Context, NonRecordingSpan, SpanContext, TraceFlags, Status, ERROR, SERVER, CLIENT = self._api
        (method, path, t0, end, wall_ns, status, trace_id, parent_id, flags, backend, model, queued_ms,
         ttfb, request_id, prompt_tokens, output_tokens, tenant, attempts) = rec

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
        if tenant:
            attributes["proxy.tenant"] = tenant
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
        """The exporter's news (its thread): told to the proxy; a failure said once per burst."""
        if ok:
            self.report.say("exported", spans)
            if self._failing:
                self.report.say("warning", f"traces: exporting to {self.endpoint} again; {self._failing} "
                                           "span(s) were dropped")
                self._failing = 0
            return
        if not self._failing:
            self.report.say("error", f"traces: export to {self.endpoint} failed (the collector is unreachable "
                                     "or refused it); spans are dropped and counted in "
                                     "proxy_trace_spans_dropped_total until it works again")
        self._failing += spans
        self.report.say("dropped", spans)

    def stop(self) -> None:
        """Give the last export up to STOP_S (a collector that is down holds nothing up)."""
        closer = threading.Thread(target=self._provider.shutdown, name="otlp-stop", daemon=True)
        closer.start()
        closer.join(self.STOP_S)
        if closer.is_alive():
            self._inner.shutdown()   # ends the retries of an export still waiting on the collector


def _Counting(inner, owner: Builder):
    """The exporter wrapped: what the processor hands over leaves its queue (counted first, so the
    builder's estimate of that queue never runs short), and each export's outcome is told."""
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


def batches(stream):
    """The record batches on stream, until its end (a batch cut short by the end is not one)."""
    while True:
        head = stream.read(4)
        if len(head) < 4:
            return
        size = int.from_bytes(head, "big")
        data = stream.read(size)
        if len(data) < size:
            return
        yield marshal.loads(data)


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m proxy.otlp_export")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--service-name", required=True)
    args = parser.parse_args(argv)
    report = Report(sys.stdout)
    builder = Builder(args.endpoint, args.timeout_s, args.service_name, report)
    for records in batches(sys.stdin.buffer):
        builder.build_all(records)
    builder.stop()
    sys.stdout.flush()
    os._exit(0)   # not held up by an exporter thread still in its retries


if __name__ == "__main__":
    sys.exit(main())
