"""`inv top`: a live view of one host, or of an entry host's whole fleet, refreshed every second.

Each host runs a sampler (hostagent/probes/top.py, sent like every probe) that prints a frame a second:
its instances' states, the samples of their engines' /metrics that the view uses and the proxy's (numbers,
parsed on the host), the front, the keeper's record and, at most every 2 s, the smi's output. This module keeps the last
minute of frames per host and turns them into what the operator reads (`view`, a pure function): per
instance its state, load, requests and output tokens per second, time to first token p50/p95 over the
last minute (the engine's own histogram), KV-cache use, prefix-cache hit rate and the keeper's restarts;
per host its front, queue, 429/503 answers, keeper and cards; a line per event (`events`). `render` draws
that with rich (a Live display: one library, plain terminal output, and a frame that prints as text for
`--once`); textual's full-screen applications would have cost a second event loop for a read-only view.
"""
from __future__ import annotations

import json
import math
import os
import select
import shlex
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from fleet.errors import FleetError
from fleet.facts.state import prepare
from fleet.host import smi
from fleet.settings import cluster
from fleet.settings.inventory import HostVars, Inventory, local_address
from fleet.transport import agent
from fleet.transport.connection import Running, connect

WINDOW_S = 60.0       # percentiles and the hit rate: over the last minute
RATE_S = 10.0         # requests and tokens per second: over the last 10 s
SMI_EVERY_S = 2.0     # the smi is sampled no more often than this
EVENTS_KEPT = 8       # event lines shown
QUEUE_FILLING = 0.5   # a queue this full (of proxy.queue.max) is an event
TURNED_AWAY_EVERY_S = 10.0   # 429/503 events: at most one per host in this time
RESTART_AFTER_S = 5.0        # a sampler that ended is started again after this


# --- what a frame says ------------------------------------------------------------------------------

class Metrics:
    """The samples the sampler read from one /metrics (`[name, labels, value]`, parsed on the host): totals
    and histogram buckets by name and matching labels."""

    def __init__(self, samples):
        self.by_name: dict[str, list[tuple[dict, float]]] = {}
        for name, labels, value in samples or ():
            self.by_name.setdefault(name, []).append((labels, float(value)))

    def total(self, name: str, **match) -> float | None:
        """The sum of name's series whose labels include match; None when it has none."""
        found = [v for labels, v in self.by_name.get(name, ()) if all(labels.get(k) == w for k, w in match.items())]
        return sum(found) if found else None

    def values(self, name: str, label: str) -> dict[str, float]:
        """name's value by one label's value (summed over the other labels)."""
        out: dict[str, float] = {}
        for labels, v in self.by_name.get(name, ()):
            out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + v
        return out

    def buckets(self, name: str) -> dict[float, float]:
        """A histogram's cumulative bucket counts by upper bound (`name` is the histogram's base name)."""
        out: dict[float, float] = {}
        for labels, v in self.by_name.get(name + "_bucket", ()):
            try:
                le = float(labels.get("le", "nan"))
            except ValueError:
                continue
            out[le] = out.get(le, 0.0) + v
        return out


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts: linear within the bucket; None when
    the histogram counted nothing. A quantile in the +Inf bucket is the highest finite bound."""
    bounds = sorted(b for b in buckets if not math.isnan(b))
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if math.isinf(b):
                return lower_bound
            if count == lower_count:
                return b
            return lower_bound + (b - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = b, count
    return bounds[-1]


def delta_buckets(new: dict[float, float], old: dict[float, float]) -> dict[float, float]:
    """What a histogram counted between two frames (new's counts alone after a reset: a restart)."""
    diff = {b: new[b] - old.get(b, 0.0) for b in new}
    return new if any(v < 0 for v in diff.values()) else diff


@dataclass
class Frame:
    """One sampler frame, parsed."""

    t: float
    raw: dict
    engines: dict[int, Metrics]
    proxy: Metrics | None
    cards: list | None = None        # smi.Card list when this frame sampled the smi
    smi_error: str | None = None

    @classmethod
    def parse(cls, raw: dict, hv: HostVars) -> "Frame":
        engines = {i["index"]: Metrics(i["metrics"]) for i in raw.get("instances", []) if i.get("metrics") is not None}
        p = raw.get("proxy") or {}
        frame = cls(raw["t"], raw, engines, Metrics(p["metrics"]) if p.get("metrics") is not None else None)
        s = raw.get("smi")
        if s is not None:
            try:
                if s.get("rc") != 0:
                    why = (s.get("err") or "").strip().splitlines() or ["no output"]
                    raise smi.SmiError(f"exit {s.get('rc')}: {why[-1][:160]}")
                frame.cards = smi.parse_output(hv, s.get("out", ""))
            except smi.SmiError as e:
                frame.smi_error = f"the smi ({smi.locate_note(hv)}): {e}"
        return frame


@dataclass
class Row:
    """One instance in the view: where it runs, and who fronts it."""

    host: str
    index: int
    backend: str
    proxy_host: str | None        # the host whose proxy fronts it (None: nobody's, nginx or no front)
    model: str | None
    max_num_seqs: int


@dataclass
class Target:
    """One sampled host: its variables, its connection, its sampler and its last minute of frames."""

    hv: HostVars
    conn: object = None
    sampler: Running | None = None
    frames: deque = field(default_factory=deque)
    error: str | None = None            # why no frame comes (unreachable, the sampler ended)
    entry: str | None = None            # the entry host whose proxy fronts this host's instances
    proxy_only: bool = False            # sampled for its proxy alone (an entry host not selected)
    next_start: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, frame: Frame) -> None:
        with self.lock:
            self.frames.append(frame)
            while len(self.frames) > 2 and frame.t - self.frames[0].t > WINDOW_S + 5:
                self.frames.popleft()
            self.error = None

    def window(self) -> list[Frame]:
        with self.lock:
            return list(self.frames)


def plan(inv: Inventory, pattern: str, overrides=()) -> tuple[list[HostVars], list[Row], set[str]]:
    """The hosts to sample, the instance rows, and the hosts sampled for their proxy alone: the selected
    hosts, and for an entry host the hosts it fronts (each once); a fronted instance's proxy is its entry
    host's, read for its proxy alone when the entry itself is not selected."""
    hosts: dict[str, HostVars] = {}
    fronted: dict[tuple[str, int], tuple[str, str]] = {}     # (host, index) -> (backend, entry host)
    selected = inv.select(pattern)
    for name in selected:
        hv = inv.host_vars(name, overrides)
        hosts.setdefault(hv.name, hv)
        if hv.settings.fronts:
            for backend, member, index in hv.fronted:
                hosts.setdefault(member.name, member)
                fronted[(member.name, index)] = (backend, hv.name)
    proxies: dict[str, HostVars] = {}      # entry hosts read for their proxy alone: they front a host shown
    for name in selected:
        entries = sorted(inv.fronted_by(name, overrides) - set(hosts))
        if entries and not any((name, i) in fronted for i in range(len(hosts[name].ports))):
            entry = proxies.get(entries[0]) or inv.host_vars(entries[0], overrides)
            proxies[entry.name] = entry
            for backend, member, index in entry.fronted or []:
                if member.name == name:
                    fronted[(name, index)] = (backend, entry.name)
    rows = []
    for hv in hosts.values():
        own_proxy = None if hv.settings.fronts else hv.name
        for i, port in enumerate(hv.ports):
            backend, proxy_host = fronted.get((hv.name, i), (cluster.backend_name(hv.instance_host, port), own_proxy))
            group = hv.group_of(i) if hv.groups and not hv.plain else None
            rows.append(Row(hv.name, i, backend, proxy_host, group.name if group else None,
                            group.max_num_seqs if group else hv.settings.max_num_seqs))
    return list(hosts.values()) + list(proxies.values()), rows, set(proxies)


# --- the view: frames in, numbers out -----------------------------------------------------------------

def _since(frames: list[Frame], seconds: float) -> Frame | None:
    """The oldest frame within the last `seconds` before the newest (None with fewer than two frames)."""
    if len(frames) < 2:
        return None
    now = frames[-1].t
    for f in frames[:-1]:
        if now - f.t <= seconds + 0.5:
            return f
    return frames[-2]


def _rate(new: float | None, old: float | None, dt: float) -> float | None:
    if new is None or old is None or dt <= 0:
        return None
    return (new - old if new >= old else new) / dt     # a counter that went back: the engine restarted


def instance_view(row: Row, frames: list[Frame], proxy_frames: list[Frame], keeper: dict) -> dict:
    """One instance's line: state, load, rates and latencies, cache, the keeper's restarts."""
    last = frames[-1]
    raw = next((i for i in last.raw.get("instances", []) if i["index"] == row.index), {})
    state = raw.get("state", "?")
    m = last.engines.get(row.index)
    w = keeper.get(str(row.index)) or {}
    out = {"host": row.host, "index": row.index, "backend": row.backend, "model": row.model, "state": state,
           "reason": raw.get("reason"), "in_flight": None, "slots": row.max_num_seqs, "rps": None,
           "ttft_p50": None, "ttft_p95": None, "tokens_s": None, "kv": None, "hit": None,
           "restarts": w.get("restarts", 0), "last_reason": w.get("last_reason"),
           "crashloop": bool(w.get("crashloop")), "error": raw.get("error")}
    if out["crashloop"]:
        out["state"] = "crashloop"
    pm = proxy_frames[-1].proxy if proxy_frames else None
    if pm is not None and pm.by_name:
        flight = pm.values("proxy_backend_in_flight", "backend").get(row.backend)
        slots = pm.values("proxy_backend_slots", "backend").get(row.backend)
        out["in_flight"] = int(flight) if flight is not None else None
        if slots:
            out["slots"] = int(slots)
        if state == "healthy" and pm.values("proxy_backend_drained", "backend").get(row.backend):
            out["state"] = "drained"
        elif state == "healthy" and pm.values("proxy_backend_healthy", "backend").get(row.backend) == 0:
            out["state"] = "proxy-out"
    if m is not None:
        # The bases of the rates and the window: frames that read this engine (a frame whose scrape failed,
        # or taken while it loaded, would give no rate, or the histogram since the engine started).
        read = [f for f in frames if row.index in f.engines]
        if out["in_flight"] is None:            # no proxy in front (nginx mode): what the engine holds
            running = m.total("vllm:num_requests_running")
            waiting = m.total("vllm:num_requests_waiting")
            if running is not None:
                out["in_flight"] = int(running + (waiting or 0))
        kv = m.total("vllm:kv_cache_usage_perc")
        out["kv"] = kv
        old = _since(read, RATE_S)
        if old is not None:
            om, dt = old.engines[row.index], last.t - old.t
            out["rps"] = _rate(m.total("vllm:request_success_total"), om.total("vllm:request_success_total"), dt)
            out["tokens_s"] = _rate(m.total("vllm:generation_tokens_total"),
                                    om.total("vllm:generation_tokens_total"), dt)
        first = _since(read, WINDOW_S)
        base = first.engines[row.index] if first is not None else None
        ttft = m.buckets("vllm:time_to_first_token_seconds")
        window = delta_buckets(ttft, base.buckets("vllm:time_to_first_token_seconds")) if base else ttft
        out["ttft_p50"], out["ttft_p95"] = quantile(0.5, window), quantile(0.95, window)
        hits, queries = m.total("vllm:prefix_cache_hits_total"), m.total("vllm:prefix_cache_queries_total")
        if base is not None and hits is not None and queries is not None:
            bh, bq = base.total("vllm:prefix_cache_hits_total"), base.total("vllm:prefix_cache_queries_total")
            if bq is not None and queries >= bq:     # else the engine restarted: its counts since then
                hits, queries = hits - (bh or 0), queries - bq   # none in the window: no rate ("-")
        out["hit"] = hits / queries if hits is not None and queries else None
    if out["rps"] is None and pm is not None:     # an engine without vLLM's request counter: the proxy's
        old = _since(proxy_frames, RATE_S)
        if old is not None and old.proxy is not None:
            out["rps"] = _rate(pm.values("proxy_requests_total", "backend").get(row.backend),
                               old.proxy.values("proxy_requests_total", "backend").get(row.backend),
                               proxy_frames[-1].t - old.t)
    return out


def host_view(target: Target) -> dict:
    """One host's line: front, proxy queue and refusals, keeper, cards, what could not be read."""
    hv, frames = target.hv, target.window()
    out = {"host": hv.name, "front": None, "queue": None, "queue_max": hv.settings.proxy.queue.max,
           "r429": None, "r503": None, "r429_min": None, "r503_min": None, "keeper": None, "cards": None,
           "errors": [], "ok": bool(frames)}
    if target.error:
        out["errors"].append(target.error)
    if not frames:
        return out
    last = frames[-1]
    raw = last.raw
    proxy = raw.get("proxy") or {}
    if raw.get("mode") == "nginx" and raw.get("nginx"):
        out["front"] = "nginx"
    elif proxy.get("alive"):
        out["front"] = "proxy"
    elif target.entry and target.entry != hv.name:
        out["front"] = f"via {target.entry}"
    else:
        out["front"] = "none"
    k = raw.get("keeper") or {}
    out["keeper"] = ("running" if k.get("alive") else "stopped") if hv.settings.keeper.enabled else "disabled"
    if k.get("alive") and k.get("restarting") is not None:
        out["keeper"] = f"restarting {k['restarting']}"
    elif k.get("alive") and k.get("lock_held"):
        out["keeper"] = "waiting (a run holds the lock)"
    if proxy.get("error"):
        out["errors"].append(f"proxy: {proxy['error']}")
    for i in raw.get("instances", []):
        if i.get("error"):
            out["errors"].append(f"instance {i['index']}: {i['error']}")
    pm = last.proxy
    if pm is not None:
        out["queue"] = pm.total("proxy_queue_length")
        by_status = pm.values("proxy_requests_total", "status")
        out["r429"], out["r503"] = by_status.get("429", 0.0), by_status.get("503", 0.0)
        first = _since(frames, WINDOW_S)
        if first is not None and first.proxy is not None:
            old = first.proxy.values("proxy_requests_total", "status")
            out["r429_min"] = max(0.0, out["r429"] - old.get("429", 0.0))
            out["r503_min"] = max(0.0, out["r503"] - old.get("503", 0.0))
        out["tenants"] = tenant_views(hv.name, frames)
    for f in reversed(frames):              # the newest smi reading (sampled every 2 s at most)
        if f.cards is not None or f.smi_error:
            out["cards"] = f.cards
            if f.smi_error:
                out["errors"].append(f.smi_error)
            break
    return out


def tenant_views(host: str, frames: list[Frame]) -> list[dict]:
    """A proxy's tenants (none when it has only `default`): slots held, waiting, requests per second,
    refusals by their limits, and the wait for a slot (p50 over the last minute)."""
    pm = frames[-1].proxy
    flight = pm.values("proxy_tenant_in_flight", "tenant")
    if set(flight) <= {"default"}:
        return []
    queued = pm.values("proxy_tenant_queue_length", "tenant")
    weight = pm.values("proxy_tenant_weight", "tenant")
    served = pm.values("proxy_tenant_requests_total", "tenant")
    limited = pm.values("proxy_tenant_limited_total", "tenant")
    old = _since(frames, RATE_S)
    first = _since(frames, WINDOW_S)
    out = []
    for name in flight:
        rps = None
        if old is not None and old.proxy is not None:
            rps = _rate(served.get(name), old.proxy.values("proxy_tenant_requests_total", "tenant").get(name),
                        frames[-1].t - old.t)
        wait = None
        if first is not None and first.proxy is not None:
            wait = quantile(0.5, delta_buckets(_tenant_buckets(pm, name), _tenant_buckets(first.proxy, name)))
        out.append({"host": host, "tenant": name, "weight": weight.get(name), "in_flight": flight[name],
                    "queued": queued.get(name), "rps": rps, "limited": limited.get(name, 0.0), "wait_p50": wait})
    return out


def _tenant_buckets(pm: Metrics, tenant: str) -> dict[float, float]:
    """One tenant's queue-wait histogram buckets."""
    out: dict[float, float] = {}
    for labels, v in pm.by_name.get("proxy_tenant_queue_wait_seconds_bucket", ()):
        if labels.get("tenant") == tenant:
            try:
                out[float(labels.get("le", "nan"))] = v
            except ValueError:
                continue
    return out


def view(targets: dict[str, Target], rows: list[Row]) -> dict:
    """Everything one screen shows: the hosts' lines and the instances' lines."""
    hosts = [host_view(t) for t in targets.values()]
    windows = {name: t.window() for name, t in targets.items()}   # one copy of each host's frames a view
    instances = []
    for row in rows:
        frames = windows[row.host]
        if not frames or targets[row.host].error:   # none yet, or its sampler lost: no frozen numbers
            instances.append({"host": row.host, "index": row.index, "backend": row.backend, "model": row.model,
                              "state": "unread", "slots": row.max_num_seqs})
            continue
        proxy_frames = windows.get(row.proxy_host, [])
        keeper = (frames[-1].raw.get("keeper") or {}).get("instances") or {}
        instances.append(instance_view(row, frames, proxy_frames, keeper))
    return {"hosts": hosts, "instances": instances, "at": time.time()}


def events(old: dict | None, new: dict, memory: dict) -> list[str]:
    """What changed between two views, a line each: an instance's state, a restart by the keeper, a
    crash loop, an ejection, a queue filling up, requests turned away, a source lost or back. memory
    keeps what rate-limits the refusal lines between calls."""
    if old is None:
        return []
    stamp = time.strftime("%H:%M:%S", time.localtime(new["at"]))
    lines = []
    before = {(i["host"], i["index"]): i for i in old["instances"]}
    for i in new["instances"]:
        was = before.get((i["host"], i["index"]))
        if was is None or was["state"] == "unread":     # its host's first frame: nothing changed
            continue
        who = f"{i['host']} instance {i['index']}"
        if i.get("restarts", 0) > was.get("restarts", 0):
            lines.append(f"{stamp} {who}: restarted by the keeper ({i.get('last_reason') or 'no reason recorded'})")
        if i["state"] != was["state"]:
            if i["state"] == "crashloop":
                lines.append(f"{stamp} {who}: crash-looping; the keeper stopped restarting it "
                             f"(`inv logs --host {i['host']} --instance {i['index']}`)")
            elif i["state"] == "proxy-out":
                lines.append(f"{stamp} {who}: out of the proxy's rotation (a failed /health, or errors); "
                             "back at its next good /health")
            else:
                why = f" ({i['reason']})" if i.get("reason") else ""
                lines.append(f"{stamp} {who}: {was['state']} -> {i['state']}{why}")
    old_hosts = {h["host"]: h for h in old["hosts"]}
    for h in new["hosts"]:
        was = old_hosts.get(h["host"])
        if was is None:
            continue
        q, qmax = h.get("queue"), h.get("queue_max") or 0
        if q is not None and qmax and q >= QUEUE_FILLING * qmax > (was.get("queue") or 0):
            lines.append(f"{stamp} {h['host']}: the proxy's queue is filling up: {q:.0f} waiting of {qmax}")
        turned = (h.get("r429") or 0) + (h.get("r503") or 0) - (was.get("r429") or 0) - (was.get("r503") or 0)
        if turned > 0 and was.get("r429") is not None and new["at"] - memory.get(h["host"], 0) >= TURNED_AWAY_EVERY_S:
            memory[h["host"]] = new["at"]
            lines.append(f"{stamp} {h['host']}: {turned:.0f} requests answered 429/503 in the last "
                         f"{max(1.0, new['at'] - old['at']):.0f}s "
                         f"({h.get('r429_min') or 0:.0f}/{h.get('r503_min') or 0:.0f} in the last minute)")
        for e in h["errors"]:
            if e not in was["errors"]:
                lines.append(f"{stamp} {h['host']}: cannot read {e}")
        for e in was["errors"]:
            if e not in h["errors"] and h["ok"]:
                lines.append(f"{stamp} {h['host']}: readable again: {e.split(':', 1)[0]}")
    return lines


# --- drawing ------------------------------------------------------------------------------------------

STATE_STYLE = {"healthy": "green", "loading": "yellow", "drained": "yellow", "proxy-out": "red", "dead": "bold red",
               "crashloop": "bold red", "stopped": "dim", "port-taken": "red", "unread": "dim"}


def _num(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def _ms(seconds):
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def render(v: dict, events_shown: list[str], width: int, interval: float, title: str):
    """The screen as one rich renderable; columns drop out as the terminal narrows (state, load,
    requests per second and time to first token stay)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    wide, medium = width >= 120, width >= 80
    head = Text(f"{title}  {time.strftime('%H:%M:%S', time.localtime(v['at']))}  every {interval:g}s  q quits",
                style="bold")
    hosts = Table(box=None, pad_edge=False, expand=False, show_edge=False)
    for col in ("host", "front", "keeper", "queue", "429", "503") + (("cards (used/total, util)",) if medium else ()):
        hosts.add_column(col, no_wrap=col != "cards (used/total, util)")
    for h in v["hosts"]:
        queue = "-" if h["queue"] is None else f"{h['queue']:.0f}/{h['queue_max']}"
        r429 = "-" if h["r429"] is None else f"{h['r429']:.0f}" + (f" (+{h['r429_min']:.0f}/min)" if h["r429_min"] else "")
        r503 = "-" if h["r503"] is None else f"{h['r503']:.0f}" + (f" (+{h['r503_min']:.0f}/min)" if h["r503_min"] else "")
        cells = [h["host"], h["front"] or "-", h["keeper"] or "-", queue, r429, r503]
        if medium:
            cells.append(_cards(h["cards"]) if h["cards"] is not None else "-")
        hosts.add_row(*cells)
    several = len({i["host"] for i in v["instances"]}) > 1
    models = any(i.get("model") for i in v["instances"])
    cols = ["inst", "state", "flight", "r/s", "TTFT p50"]
    if medium:
        cols += ["p95", "tok/s", "KV", "hit"]
    if wide:
        cols += ["restarts"]
    table = Table(box=None, pad_edge=False, show_edge=False)
    for col in cols:
        table.add_column(col, justify="left" if col in ("inst", "state", "restarts") else "right", no_wrap=True)
    for i in v["instances"]:
        name = (f"{i['host']}/{i['index']}" if several else str(i["index"]))
        if models and medium and i.get("model"):
            name += f" {i['model']}"
        flight = f"{_num(i.get('in_flight'), '{:.0f}')}/{i.get('slots') or '-'}"
        cells = [name, Text(i["state"], style=STATE_STYLE.get(i["state"], "")), flight,
                 _num(i.get("rps")), _ms(i.get("ttft_p50"))]
        if medium:
            cells += [_ms(i.get("ttft_p95")), _num(i.get("tokens_s"), "{:.0f}"),
                      _num(i.get("kv"), "{:.0%}"), _num(i.get("hit"), "{:.0%}")]
        if wide:
            r = i.get("restarts") or 0
            cells.append(f"{r} ({i['last_reason']})" if r and i.get("last_reason") else str(r))
        table.add_row(*cells)
    parts = [head, hosts, Text(""), table]
    tenants = [t for h in v["hosts"] for t in h.get("tenants") or ()]
    if tenants:
        several_hosts = len({t["host"] for t in tenants}) > 1
        by_tenant = Table(box=None, pad_edge=False, show_edge=False)
        for col in ("tenant", "weight", "flight", "queued", "r/s", "wait p50", "429"):
            by_tenant.add_column(col, justify="left" if col == "tenant" else "right", no_wrap=True)
        for t in tenants:
            name = f"{t['host']}/{t['tenant']}" if several_hosts else t["tenant"]
            by_tenant.add_row(name, _num(t["weight"], "{:.0f}"), _num(t["in_flight"], "{:.0f}"),
                              _num(t["queued"], "{:.0f}"), _num(t["rps"]), _ms(t["wait_p50"]),
                              _num(t["limited"], "{:.0f}"))
        parts += [Text(""), by_tenant]
    errors = [f"{h['host']}: {e}" for h in v["hosts"] for e in h["errors"]]
    if errors:
        parts.append(Text(""))
        parts += [Text(f"unreadable: {e}", style="red") for e in errors[:6]]
    if events_shown:
        parts.append(Text(""))
        parts += [Text(e[:max(20, width - 1)]) for e in events_shown[-EVENTS_KEPT:]]
    return Group(*parts)


def _cards(cards) -> str:
    shown = []
    for c in cards:
        used = c.used_fraction
        mem = (f"{c.used_mib / 1024:.0f}/{c.total_mib / 1024:.0f}G" if not math.isnan(c.used_mib)
               and not math.isnan(c.total_mib) else (f"{used:.0%}" if used is not None else "?"))
        util = f" {c.util_pct:.0f}%" if c.util_pct is not None else ""
        shown.append(f"{c.index}:{mem}{util}")
    return " ".join(shown) or "no cards"


# --- running it ----------------------------------------------------------------------------------------

def sampler_spec(hv: HostVars, interval: float, count: int, proxy_only: bool = False) -> dict:
    """What the host's sampler reads; an entry host shown for its proxy alone (it fronts a host selected
    without it) is not asked for its instances or cards."""
    instances = [] if proxy_only else [{"index": i, "port": p, "address": hv.instance_host}
                                       for i, p in enumerate(hv.ports)]
    with_smi = bool(instances) and hv.settings.accelerator != "none"
    return {"deploy_dir": hv.settings.deploy_dir, "deployment_id": hv.deployment_id, "instances": instances,
            "proxy_port": hv.settings.proxy.port, "proxy_address": local_address(hv.settings.proxy.bind),
            "health_timeout_s": hv.settings.health_timeout_s,
            "interval_s": interval, "count": count, "exit_at_eof": True,
            "smi": smi.smi_command(hv) if with_smi else None, "smi_every_s": max(SMI_EVERY_S, interval)}


def _start(target: Target, interval: float, count: int) -> None:
    """Connect and start the host's sampler; a failure is the target's error, tried again later."""
    try:
        if target.conn is None:
            target.conn = connect(target.hv)
            target.hv = prepare(target.conn, target.hv)
        spec = sampler_spec(target.hv, interval, count, target.proxy_only)
        target.sampler = agent.start_module(target.conn, target.hv, "probes.top", shlex.quote(json.dumps(spec)))
    except FleetError as e:
        target.error = "the host: " + str(e).removeprefix(f"{target.hv.name}: ")
        target.sampler, target.next_start = None, time.monotonic() + RESTART_AFTER_S
        if target.conn is not None:
            _close(target)


def _close(target: Target) -> None:
    if target.sampler is not None:
        try:
            target.sampler.close(timeout=3)
        except Exception:      # noqa: BLE001 -- leaving: the rest still closes
            pass
        target.sampler = None
    if target.conn is not None:
        try:
            target.conn.close()
        except Exception:      # noqa: BLE001
            pass
        target.conn = None


def _pump(target: Target, stop: threading.Event, interval: float, count: int) -> None:
    """Read the host's frames until stop; a sampler that ends is started again (its error shown)."""
    while not stop.is_set():
        if target.sampler is None:
            if time.monotonic() < target.next_start:
                stop.wait(0.2)
                continue
            _start(target, interval, count)
            if stop.is_set():                         # the view ended while this one started: no sampler left
                _close(target)
                return
            if count and target.sampler is None:      # --once: a host that cannot be reached is said, not awaited
                return
            continue
        sampler = target.sampler     # the view's end closes and clears target.sampler from another thread
        try:
            line = sampler.readline(timeout=max(10.0, 5 * interval))
        except FleetError as e:
            line, why = None, str(e)
        else:
            why = None
        if stop.is_set():
            return
        if line is None:
            err = sampler.stderr().strip().splitlines() if why is None else [why]
            if count and len(target.frames) >= count:
                return
            target.error = f"its sampler: it ended ({(err or ['no output'])[-1][:200]}); starting it again"
            _close(target)
            target.next_start = time.monotonic() + RESTART_AFTER_S
            continue
        try:
            raw = json.loads(line)
            target.add(Frame.parse(raw, target.hv))
        except (ValueError, KeyError, TypeError):
            continue             # a shell's stray line: not a frame
        if count and len(target.frames) >= count:
            return


class Keys:
    """`q` from a terminal's keyboard, read in cbreak mode (restored at exit); nothing when stdin is no tty."""

    def __init__(self):
        self.saved = None
        if sys.stdin.isatty():
            import termios
            import tty
            fd = sys.stdin.fileno()
            self.saved = termios.tcgetattr(fd)
            tty.setcbreak(fd)

    def quit_pressed(self, timeout: float) -> bool:
        if self.saved is None:
            time.sleep(timeout)
            return False
        ready, _, _ = select.select([sys.stdin], [], [], timeout)
        return bool(ready) and os.read(sys.stdin.fileno(), 64).lower().startswith(b"q")

    def restore(self) -> None:
        if self.saved is not None:
            import termios
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, self.saved)


def run(inv: Inventory, pattern: str, overrides=(), interval: float = 1.0, once: bool = False,
        console=None) -> int:
    """Show the live view until q or Ctrl-C (once: sample twice, print one frame, exit); the exit status."""
    from rich.console import Console
    from rich.live import Live

    hosts, rows, proxy_only = plan(inv, pattern, overrides)
    console = console or Console()
    entries = {r.host: r.proxy_host for r in rows if r.proxy_host}
    targets = {hv.name: Target(hv, entry=entries.get(hv.name), proxy_only=hv.name in proxy_only) for hv in hosts}
    count = 2 if once else 0           # two frames: a rate needs an interval
    stop = threading.Event()
    threads = [threading.Thread(target=_pump, args=(t, stop, interval, count), daemon=True)
               for t in targets.values()]
    for th in threads:
        th.start()
    title = "vllm-fleet top: " + ", ".join(targets)
    try:
        if once:
            deadline = time.monotonic() + max(30.0, 10 * interval)
            try:
                for th in threads:
                    th.join(max(0.0, deadline - time.monotonic()))
            except KeyboardInterrupt:
                return 130
            v = view(targets, rows)
            console.print(render(v, [], console.width, interval, title))
            return 0 if all(h["ok"] for h in v["hosts"]) else 1
        keys = Keys()
        shown: deque = deque(maxlen=EVENTS_KEPT)
        memory: dict = {}
        previous = None
        try:
            with Live(console=console, auto_refresh=False, screen=False, transient=False) as live:
                while True:
                    v = view(targets, rows)
                    shown.extend(events(previous, v, memory))
                    previous = v
                    live.update(render(v, list(shown), console.width, interval, title), refresh=True)
                    if keys.quit_pressed(interval):
                        return 0
        except KeyboardInterrupt:
            return 0
        finally:
            keys.restore()
    finally:
        stop.set()
        for t in targets.values():
            _close(t)
        for th in threads:         # each sees its sampler's output end, or stop, and returns
            th.join(timeout=1.0)
