"""What a running proxy holds: its config, backends, metrics, results log and clients; and reload."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import sys
import threading

import aiohttp
from aiohttp import web

from .admission import DEFAULT, Tenants
from .config import ConfigError, ProxyConfig, load_api_keys, load_config
from .metrics import Metrics
from .models import Router
from .otlp import SpanExport
from .results_log import ResultsLog
from .share import my_slots
from .upstream import Upstream

log = logging.getLogger("proxy")
# How often a thread running Python hands the GIL to another (5 ms by default): a worker thread digesting a
# large body (proxy/body.py) lets the event loop run at least this often (bench/profile_body.py).
SWITCH_S = 0.001


class Proxy:
    """The live state behind both applications; SIGHUP swaps its config without dropping a request."""

    def __init__(self, config: ProxyConfig, config_path: str | None = None):
        self._use(config)
        self.config_path = config_path
        self.api_keys = load_api_keys(config.api_keys_file, tenant_names(config))
        self.router = Router(config)     # the pools: one of every backend, or one per served model
        # `default` and those of config.tenants: counts, buckets of this proxy's part of their limits
        self.tenants = Tenants(config.tenants, part=self.limit_part)
        self.metrics = Metrics(lambda: self.router, lambda: self.tenants)
        self.metrics.cover(self.router.backends)     # each backend's series at 0 from the start
        self.metrics.cover_tenants(self.tenants.names())
        self.results = ResultsLog(config.results_log, self.metrics.results_dropped.inc)
        self.spans = self._span_export(config)   # None: no export (otlp.endpoint unset)
        self.session: aiohttp.ClientSession | None = None   # the health checks', the peers' and the scrapes'
        self.upstream: Upstream | None = None                # the requests' (proxy/upstream.py)
        # Where bodies over proxy.limits.inline_kb are parsed and hashed (forward._read_body): off the event
        # loop; two threads, as the GIL lets little more run at once, and a burst of large bodies queues here.
        self.parser = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="proxy-body")
        sys.setswitchinterval(SWITCH_S)
        self.log = log
        self.check_now = asyncio.Event()  # wakes the health loop early (after a reload)
        self.checked = asyncio.Event()    # the first round of health checks is done
        self.closing = False              # shutting down: every answer says Connection: close
        self.requests: dict[int, object] = {}   # the requests in flight: id -> their forward.Exchange
        self.stop = asyncio.Event()       # SIGTERM or POST /admin/drain-and-exit: drain, then exit
        self.drain_s: float | None = None  # the drain bound asked for (None: shutdown_timeout_s)
        self.drained: asyncio.Future | None = None  # what the drain came to, for /admin/drain-and-exit
        self.pending_restart: tuple[str, ...] = ()  # RESTART_ONLY settings the config file changed since start
        # Reloads applied and refused, and why the last one was refused: /admin/config reports them, so a
        # deploy that sent SIGHUP knows what came of it.
        self.reloads = {"applied": 0, "refused": 0, "last_error": None}
        # With proxy.workers > 1: what answers the public /metrics, every worker's series as one (proxy/workers.py).
        self.gather_metrics = None

    def reload(self) -> bool:
        """Re-read the config file and apply it; an invalid one is refused and the old one stays."""
        try:
            new = load_config(self.config_path)
            keys = load_api_keys(new.api_keys_file, tenant_names(new))
            new, pending = self._keep_restart_only(new)
            results, spans = None, self.spans
            if new.otlp != self.config.otlp:
                spans = self._span_export(new)   # refused when the SDK is missing
            if new.results_log != self.config.results_log:
                results = ResultsLog(new.results_log, self.metrics.results_dropped.inc)
                results.start()   # may fail (an unwritable path): then nothing has changed yet
            if spans is not self.spans and spans is not None:
                try:
                    spans.start()   # may fail (no thread to be had): the new results log goes too
                except BaseException:
                    if results is not None:
                        threading.Thread(target=results.stop, name="results-log-stop", daemon=True).start()
                    raise
        except ConfigError as e:
            return self._refused(str(e))
        except Exception as e:   # whatever it is, a reload must never take the running proxy down
            return self._refused(f"{type(e).__name__}: {e}")
        if results is not None:
            self.results, old_results = results, self.results
            # Flushing the old file joins its writer thread: not on the event loop.
            threading.Thread(target=old_results.stop, name="results-log-stop", daemon=True).start()
        if spans is not self.spans:
            old_spans, self.spans = self.spans, spans
            if old_spans is not None:
                threading.Thread(target=old_spans.stop, name="otlp-stop", daemon=True).start()
        added, removed = self.router.update(new)
        self.metrics.cover(added)
        self._use(new)
        self.tenants.update(new.tenants)
        self.metrics.cover_tenants(self.tenants.names())
        self.api_keys = keys
        self.pending_restart = pending
        self.reloads["applied"] += 1
        self.reloads["last_error"] = None
        self.check_now.set()
        log.info("reloaded %s: %d backends (added %s, removed %s)%s", self.config_path, len(new.backends),
                 ", ".join(added) or "none", ", ".join(removed) or "none",
                 ", API keys on" if keys is not None else "")
        return True

    def limit_part(self, limit: int) -> int:
        """What this proxy admits of a tenant's per-minute limit: all of it, or, with active-active entries,
        its share, split as its slots are (proxy/share.py), so the entries together admit the limit."""
        return my_slots(limit, self.config.share, self.router.alive)

    def _refused(self, why: str) -> bool:
        log.error("reload refused, the running config stays: %s", why)
        self.reloads["refused"] += 1
        self.reloads["last_error"] = why
        return False

    def _span_export(self, config: ProxyConfig) -> SpanExport | None:
        """The span export config.otlp asks for (not started), or None; ConfigError without the SDK (an
        optional dependency, which proxy.otlp imports only then)."""
        if config.otlp.endpoint is None:
            return None
        return SpanExport(config.otlp, self.metrics.spans_dropped.inc)

    def _use(self, config: ProxyConfig) -> None:
        """Make config the running one."""
        self.config = config

    def _keep_restart_only(self, new: ProxyConfig) -> tuple[ProxyConfig, tuple[str, ...]]:
        """new, with the settings a running proxy cannot change put back to the running ones (logged),
        and their names: /admin/config reports them, so a deploy knows a restart is still owed."""
        old = self.config
        fixed = {k: getattr(old, k) for k in RESTART_ONLY if getattr(new, k) != getattr(old, k)}
        if fixed:
            log.warning("reload: %s stay as they are until the proxy restarts (`inv deploy` restarts it "
                        "beside this one, without a gap)", ", ".join(fixed))
            new = dataclasses.replace(new, **fixed)
        return new, tuple(fixed)


def tenant_names(config: ProxyConfig) -> tuple[str, ...]:
    """The tenants an API key may name: `default` and those of config.tenants."""
    return (DEFAULT, *config.tenants)


# The settings a reload cannot change: bound when the listeners and the application are built. The docs
# list them by their inventory keys (tests/test_docs.py holds the lists to this one).
RESTART_ONLY = ("listen", "admin", "shutdown_timeout_s", "max_body_mb", "log", "client", "workers")


PROXY = web.AppKey("proxy", Proxy)
