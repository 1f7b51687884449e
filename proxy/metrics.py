"""The proxy's Prometheus metrics, in a registry of its own (GET /metrics on the public port)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from .clients import CUT_REASONS
from .models import Router

DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
# Time to first byte: the duration buckets, finer below a second (a first token comes in tens of ms).
TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = tuple(2 ** k for k in range(16))   # 1 .. 32768 output tokens
# The event loop's lag (proxy.loop_lag): a few ms is a busy turn, 100 ms is the stall issue 37 forbids.
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
# The label values known before any event: their series are made at start (or when a reload adds a
# backend), so a panel or an increase() over them starts from 0 instead of "no data".
QUEUE_REJECT_REASONS = ("full", "timeout", "gone")
RESUME_OUTCOMES = ("resumed", "closed", "failed", "no_backend", "refused", "off")
EJECTION_REASONS = ("connect_timeout", "connect", "5xx", "engine_dead")
TENANT_LIMITS = ("max_in_flight", "max_queued", "requests_per_minute", "tokens_per_minute")
TENANT_STATUSES = ("200", "429")    # a known tenant's answers made at start: served, and refused by a limit
UPSTREAM_ERROR_KINDS = ("connect_timeout", "connect", "disconnected", "timeout", "payload", "connection", "stalled",
                        "taken_out", "other")


class BackendState:
    """Per-backend gauges read from the pools at scrape time, so a reload needs no bookkeeping."""

    def __init__(self, router_of):
        self._router_of = router_of  # a callable: the router changes object never, its pools do

    def collect(self):
        router: Router = self._router_of()
        in_flight = GaugeMetricFamily("proxy_backend_in_flight", "Requests in flight per backend",
                                      labels=["backend"])
        peak = GaugeMetricFamily("proxy_backend_peak_in_flight", "Peak in-flight per backend since start",
                                 labels=["backend"])
        healthy = GaugeMetricFamily("proxy_backend_healthy",
                                    "1 when the backend takes requests by its health (its /health, no ejection)",
                                    labels=["backend"])
        drained = GaugeMetricFamily("proxy_backend_drained", "1 while the backend is drained by the admin",
                                    labels=["backend"])
        slots = GaugeMetricFamily("proxy_backend_slots",
                                  "Requests the proxy sends a backend at once (0: no limit)", labels=["backend"])
        for b in router.backends.values():
            in_flight.add_metric([b.name], b.in_flight)
            peak.add_metric([b.name], b.peak_in_flight)
            healthy.add_metric([b.name], 1 if b.healthy else 0)
            drained.add_metric([b.name], 1 if b.drained else 0)
            slots.add_metric([b.name], b.slots)
        queued = GaugeMetricFamily("proxy_queue_length", "Requests waiting in the proxy for a free slot")
        queued.add_metric([], router.queued)
        families = [in_flight, peak, healthy, drained, slots, queued]
        if router.by_model:
            model = GaugeMetricFamily("proxy_backend_model", "1 for the served model each backend is in",
                                      labels=["backend", "model"])
            for b in router.backends.values():
                model.add_metric([b.name, router.model_label(b)], 1)
            pool_queued = GaugeMetricFamily("proxy_model_queue_length",
                                            "Requests waiting for a free slot, per served model", labels=["model"])
            for name, pool in router.pools.items():
                pool_queued.add_metric([name], pool.queued)
            families += [model, pool_queued]
        return families


class TenantState:
    """Per-tenant gauges read from the proxy's tenants at scrape time."""

    def __init__(self, tenants_of):
        self._tenants_of = tenants_of

    def collect(self):
        in_flight = GaugeMetricFamily("proxy_tenant_in_flight", "Slots each tenant holds now", labels=["tenant"])
        queued = GaugeMetricFamily("proxy_tenant_queue_length", "Requests of each tenant waiting for a slot",
                                   labels=["tenant"])
        weight = GaugeMetricFamily("proxy_tenant_weight", "Each tenant's weight in the fair share of slots",
                                   labels=["tenant"])
        for t in self._tenants_of().by_name.values():
            in_flight.add_metric([t.name], t.in_flight)
            queued.add_metric([t.name], t.queued)
            weight.add_metric([t.name], t.weight)
        return [in_flight, queued, weight]


class Metrics:
    """Counters the request path bumps, plus the backend and tenant gauges."""

    def __init__(self, router_of, tenants_of=None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("proxy_requests", "Proxied requests by backend and status",
                                ["backend", "status"], registry=r)
        self.duration = Histogram("proxy_request_duration_seconds", "Time to the last byte",
                                  ["backend"], buckets=DURATION_BUCKETS, registry=r)
        self.retries = Counter("proxy_retries", "Attempts moved to another backend, by the one that failed",
                               ["backend"], registry=r)
        self.ejections = Counter("proxy_ejections", "Backends taken out by the proxy, by reason",
                                 ["backend", "reason"], registry=r)
        self.upstream_errors = Counter("proxy_upstream_errors", "Upstream failures by kind",
                                       ["backend", "kind"], registry=r)
        self.aborted = Counter("proxy_client_aborts", "Requests whose client went away first",
                               ["backend"], registry=r)
        self.queue_wait = Histogram("proxy_queue_wait_seconds",
                                    "Time a request waited for a slot, of those that found none free",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.queue_rejected = Counter("proxy_queue_rejected",
                                      "Requests the queue turned away: full (429), timeout (503)",
                                      ["reason"], registry=r)
        self.results_dropped = Counter("proxy_results_log_dropped",
                                       "Results-log lines lost because the file could not be written",
                                       registry=r)
        self.model_requests = Counter("proxy_model_requests",
                                      "Requests by the served model they were routed to, and status (the models "
                                      "form; model \"none\": a name no backend serves, or no model)",
                                      ["model", "status"], registry=r)
        self.route_decisions = Counter("proxy_route_decisions",
                                       "Prefix policy: where each request went: prefix (where its prompt's "
                                       "prefix was sent), load (no long enough match), override (a match, "
                                       "but that backend was too loaded), shared (only a prefix other "
                                       "conversations share matched: the least loaded took it)", ["decision"], registry=r)
        self.route_tokens = Counter("proxy_route_prompt_tokens",
                                    "Prefix policy: prompt tokens routed (about 4 bytes each, whole 16-token "
                                    "blocks), and of them matched on the chosen backend by the router's own index",
                                    ["kind"], registry=r)
        self.route_error = Counter("proxy_route_prediction_error_tokens",
                                   "Prefix policy: how far the router's match was from the prompt tokens the "
                                   "engine said it had cached (usage.prompt_tokens_details.cached_tokens): over "
                                   "(predicted more than it had), under (had more than predicted), and cached "
                                   "(what it had), summed over the answers that said", ["kind"], registry=r)
        # model: the served model (its pool) in the models form; "" in the plain form (no label then).
        self.first_byte = Histogram("proxy_time_to_first_byte_seconds",
                                    "From the request's arrival to the first byte of its answer sent to the "
                                    "client (a stream's first chunk; a whole answer when it is sent)",
                                    ["backend", "model"], buckets=TTFB_BUCKETS, registry=r)
        self.output_tokens = Histogram("proxy_output_tokens",
                                       "Output tokens per request, where the answer says (usage.completion_tokens)",
                                       ["backend", "model"], buckets=TOKEN_BUCKETS, registry=r)
        self.spans_dropped = Counter("proxy_trace_spans_dropped",
                                     "Spans not exported (proxy.otlp): the export queue full, or the collector "
                                     "unreachable or refusing them", registry=r)
        self.tenant_requests = Counter("proxy_tenant_requests", "Requests by tenant (its API key's) and status",
                                       ["tenant", "status"], registry=r)
        self.tenant_wait = Histogram("proxy_tenant_queue_wait_seconds",
                                     "Time a tenant's request waited for a slot, of those that found none free",
                                     ["tenant"], buckets=WAIT_BUCKETS, registry=r)
        self.tenant_tokens = Counter("proxy_tenant_tokens", "Tokens by tenant: prompt and output, from usage",
                                     ["tenant", "kind"], registry=r)
        self.tenant_limits = Counter("proxy_tenant_limited", "Requests refused with 429 by a tenant's limit",
                                     ["tenant", "limit"], registry=r)
        self.client_connections = Gauge("proxy_client_connections", "Client connections open on the public port",
                                        registry=r)
        self.client_cuts = Counter("proxy_client_connections_cut",
                                   "Client connections the proxy closed: header_timeout, body_timeout, "
                                   "send_timeout (past a deadline), shed (idle, at client.max_connections), "
                                   "refused (answered 503 at the bound, none idle)", ["reason"], registry=r)
        for reason in CUT_REASONS:
            self.client_cuts.labels(reason)
        self.resumes = Counter("proxy_stream_resumes",
                               "Streams cut by their instance after the first chunk, by what came of it: resumed "
                               "(finished on another instance), closed (its answer was whole: the proxy ended it), "
                               "failed (the continuations broke off too), "
                               "no_backend (no other instance), refused (not resumable: the results log says why), "
                               "off (proxy.resume.enabled false)", ["outcome"], registry=r)
        for outcome in RESUME_OUTCOMES:
            self.resumes.labels(outcome)
        self.loop_lag = Histogram("proxy_event_loop_lag_seconds",
                                  "How late the event loop ran a task due every 10 ms (a busy or stalled loop)",
                                  buckets=LAG_BUCKETS, registry=r)
        self.loop_lag_worst = Gauge("proxy_event_loop_lag_worst_seconds",
                                    "The event loop's worst lag since the proxy started", registry=r)
        r.register(BackendState(router_of))
        if tenants_of is not None:
            r.register(TenantState(tenants_of))
        self._tenant_answered: dict = {}   # (tenant, status) -> its counter child
        self._tenant_waited: dict = {}     # (tenant,) -> its histogram child
        self._tenant_tokens: dict = {}     # (tenant, kind) -> its counter child
        self._tenant_limited: dict = {}    # (tenant, limit) -> its counter child
        self._answered: dict = {}   # (backend, status) -> its counter child: labels() costs on every call
        self._timed: dict = {}      # backend -> its duration histogram child
        self._by_model: dict = {}   # (model, status) -> its counter child
        self._decisions: dict = {}  # decision -> its counter child
        self._tokens: dict = {}     # kind -> its counter child
        self._errors: dict = {}     # kind -> its counter child (the prediction error)
        self._first: dict = {}      # (backend, model) -> its time-to-first-byte child
        self._output: dict = {}     # (backend, model) -> its output-tokens child
        self._covered: set = set()  # backends whose series are made
        for reason in QUEUE_REJECT_REASONS:
            self.queue_rejected.labels(reason)

    def cover(self, backends) -> None:
        """Make the per-backend series of backends (names) not seen yet, at 0."""
        for name in backends:
            if name in self._covered:
                continue
            self._covered.add(name)
            self.retries.labels(name)
            self.aborted.labels(name)
            self._timed[name] = self.duration.labels(name)
            for reason in EJECTION_REASONS:
                self.ejections.labels(name, reason)
            for kind in UPSTREAM_ERROR_KINDS:
                self.upstream_errors.labels(name, kind)

    def cover_tenants(self, names) -> None:
        """Make each known tenant's series at 0 (a panel then starts from 0, not "no data")."""
        for name in names:
            for status in TENANT_STATUSES:
                self.tenant_requests.labels(name, status)
            for kind in ("prompt", "output"):
                self.tenant_tokens.labels(name, kind)
            for limit in TENANT_LIMITS:
                self.tenant_limits.labels(name, limit)
            self.tenant_wait.labels(name)

    def tenant_answered(self, tenant: str, status: int, prompt_tokens: int, output_tokens: int) -> None:
        """Count one settled request of tenant, and the tokens its usage reported."""
        _child(self._tenant_answered, self.tenant_requests, tenant, str(status)).inc()
        if prompt_tokens:
            _child(self._tenant_tokens, self.tenant_tokens, tenant, "prompt").inc(prompt_tokens)
        if output_tokens:
            _child(self._tenant_tokens, self.tenant_tokens, tenant, "output").inc(output_tokens)

    def tenant_waited(self, tenant: str, seconds: float) -> None:
        """Observe how long one of tenant's requests waited for its slot."""
        _child(self._tenant_waited, self.tenant_wait, tenant).observe(seconds)

    def tenant_limited(self, tenant: str, limit: str) -> None:
        """Count one request refused by one of tenant's limits."""
        _child(self._tenant_limited, self.tenant_limits, tenant, limit).inc()

    def answered(self, backend: str, status: int) -> None:
        """Count one answer of status for backend (a label, "none" when no backend saw it)."""
        child = self._answered.get((backend, status))
        if child is None:
            child = self._answered[(backend, status)] = self.requests.labels(backend, str(status))
        child.inc()

    def answered_model(self, model: str, status: int) -> None:
        """Count one answer of status for a served model (the models form)."""
        child = self._by_model.get((model, status))
        if child is None:
            child = self._by_model[(model, status)] = self.model_requests.labels(model, str(status))
        child.inc()

    def routed(self, route) -> None:
        """Count one routing decision (a proxy.routing.Route)."""
        _child(self._decisions, self.route_decisions, route.decision).inc()
        _child(self._tokens, self.route_tokens, "prompt").inc(route.prompt_tokens)
        _child(self._tokens, self.route_tokens, "matched").inc(route.matched_tokens)

    def predicted(self, route, cached: int) -> None:
        """Count how far a route's match was from the engine's cached tokens."""
        error = route.matched_tokens - cached
        _child(self._errors, self.route_error, "over" if error > 0 else "under").inc(abs(error))
        _child(self._errors, self.route_error, "cached").inc(cached)

    def took(self, backend: str, seconds: float) -> None:
        """Observe one request's time to its last byte."""
        child = self._timed.get(backend)
        if child is None:
            child = self._timed[backend] = self.duration.labels(backend)
        child.observe(seconds)

    def first_byte_after(self, backend: str, model: str, seconds: float) -> None:
        """Observe one answer's time to its first byte."""
        _child(self._first, self.first_byte, backend, model).observe(seconds)

    def produced(self, backend: str, model: str, tokens: int) -> None:
        """Observe one answer's output tokens (its usage.completion_tokens)."""
        _child(self._output, self.output_tokens, backend, model).observe(tokens)


def _child(cache: dict, metric, *labels: str):
    """metric's child for labels, made once (labels() costs on every call)."""
    child = cache.get(labels)
    if child is None:
        child = cache[labels] = metric.labels(*labels)
    return child
