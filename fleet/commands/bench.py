"""The load test: scenarios sent through a host's entry port, a concurrency sweep, statistics, reports.

`inv bench --host H` lets a user reach the seed's three conclusions about their own cluster: whether
the server's slots (instances x max_num_seqs) really run in parallel, where throughput stops growing
(beyond the server's capacity client concurrency only adds queueing), and how busy the accelerators
were. Every request is a streamed chat completion with an image (OpenAI multimodal format, base64 data
URL), so time to first token is measured too.

Data flow: `parse_*` settle the options; `run_host` sends the requests (aiohttp, in one event loop) while
a thread samples the accelerators through the smi reader; `summarize_level` and `analyse` turn samples
into figures and findings; `write_reports` renders the terminal table, JSON, Markdown and SVG.
"""
from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import re
import statistics
import struct
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import aiohttp

from fleet.errors import FleetError
from fleet.facts.state import prepare
from fleet.host import smi
from fleet.render import environment
from fleet.report import Report
from fleet.settings.inventory import HostVars
from fleet.transport.client import auth_headers, entry_url, key_refused
from fleet.transport.connection import INTERRUPT, connect

DEFAULT_CONCURRENCY = (8, 16, 32, 48, 64)
# Throughput that grows by no more than this from one level to the next has stopped growing.
SATURATION_GROWTH = 0.05
# The seed's daily estimate: sustained throughput x seconds a day x a 0.75 discount for real traffic.
DAILY_FACTOR = 0.75
# How many error bodies each scenario keeps to show, and how much of each.
ERROR_BODIES = 3
ERROR_BODY_CHARS = 400
SAMPLE_INTERVAL_S = 0.5


class BenchError(FleetError):
    """A bench option or the entry port is not usable as given."""


@dataclass(frozen=True)
class Scenario:
    """One kind of request: what the seed called short answers, detailed descriptions, thinking."""

    name: str
    max_tokens: int
    thinking: bool
    prompt: str


SCENARIOS = {
    "short": Scenario("short", 64, False, "What is in this picture? Answer in one short sentence."),
    "detailed": Scenario("detailed", 384, False,
                         "Describe this picture in detail: objects, colours, text, layout and mood."),
    "thinking": Scenario("thinking", 1024, True,
                         "Look at this picture carefully, reason about what it shows, then describe it."),
}


# --- options ------------------------------------------------------------------------------------

def parse_scenarios(text: str) -> list[Scenario]:
    """`short,detailed` -> the Scenarios, in the order given."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        raise BenchError(f"--scenario needs at least one of {', '.join(SCENARIOS)}.")
    for n in names:
        if n not in SCENARIOS:
            raise BenchError(f"--scenario: unknown scenario {n!r}; choose from {', '.join(SCENARIOS)}.")
    return [SCENARIOS[n] for n in dict.fromkeys(names)]


def parse_concurrency(text: str) -> list[int]:
    """`8,16,32` -> sorted distinct positive levels."""
    try:
        levels = sorted({int(x) for x in (text or "").split(",") if x.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise BenchError(f"--concurrency takes a comma list of positive integers (for example 8,16,32), "
                         f"got {text!r}.")
    return levels


# --- the image ----------------------------------------------------------------------------------

def make_png(width: int = 64, height: int = 48) -> bytes:
    """A small RGB PNG (a colour gradient), built with zlib and struct."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(v for x in range(width) for v in
                                    (x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), 160))
                    for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + \
        chunk(b"IEND", b"")


_MAGIC = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF87a": "image/gif",
          b"GIF89a": "image/gif"}


def image_mime(data: bytes) -> str | None:
    """The image type from a file's first bytes (PNG, JPEG, GIF, WebP), None when it is none of them."""
    for magic, mime in _MAGIC.items():
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


NO_IMAGE = "none"
# What an engine answers when it is sent an image it cannot take (vLLM: a text-only model).
_NOT_MULTIMODAL = re.compile(r"not a multimodal model|does not support multimodal|at most 0 image|"
                             r"image input is not supported|not multimodal", re.I)


def load_image(path: str | None) -> dict:
    """The image every request carries: {source, mime, bytes, url} (url is the base64 data URL);
    `--image none` sends text only (url None), for a text-only model."""
    if path == NO_IMAGE:
        return {"source": "none (text only)", "mime": None, "bytes": 0, "url": None}
    if path:
        try:
            data = Path(path).expanduser().read_bytes()
        except FileNotFoundError:
            raise BenchError(f"--image {path}: no such file; give the path of a PNG or JPEG.") from None
        except OSError as e:
            raise BenchError(f"--image {path}: cannot read it ({e.strerror}).") from None
        mime = image_mime(data)
        if mime is None:
            raise BenchError(f"--image {path}: not a PNG, JPEG, GIF or WebP file; give an image.")
        source = str(path)
    else:
        data, mime, source = make_png(), "image/png", "generated 64x48 PNG"
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"source": source, "mime": mime, "bytes": len(data), "url": url}


def request_body(scenario: Scenario, model: str, image_url: str | None, user: str) -> bytes:
    """A streamed chat completion with one text part and one image part (text only without image_url)."""
    content = scenario.prompt if image_url is None else [
        {"type": "text", "text": scenario.prompt},
        {"type": "image_url", "image_url": {"url": image_url}},
    ]
    body = {
        "model": model, "max_tokens": scenario.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "user": user,
        "messages": [{"role": "user", "content": content}],
    }
    if scenario.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    return json.dumps(body).encode()


# --- one request --------------------------------------------------------------------------------

@dataclass
class Sample:
    """What one request did. status: the HTTP status as text, `500 in stream` for an error event after
    the headers, `timeout` or `connection error`; ok only for a whole 200 stream."""

    status: str
    ok: bool
    start_s: float
    latency_s: float
    ttft_s: float | None = None
    output_tokens: int = 0
    backend: str | None = None
    error: str | None = None


async def send(session: aiohttp.ClientSession, url: str, body: bytes, origin: float,
               timeout_s: float) -> Sample:
    """POST one streamed request and read it to the end."""
    t0 = time.monotonic()
    sample = Sample("connection error", False, round(t0 - origin, 4), 0.0)
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            sample.backend = r.headers.get("X-Backend")
            sample.status = str(r.status)
            if r.status != 200:
                sample.error = (await r.read()).decode("utf-8", "replace")[:ERROR_BODY_CHARS]
            else:
                await _read_stream(r, sample, t0)
    except asyncio.TimeoutError:
        sample.status, sample.ok, sample.error = "timeout", False, f"no complete answer within {timeout_s:g}s"
    except aiohttp.ClientError as e:
        sample.status, sample.ok, sample.error = "connection error", False, f"{type(e).__name__}: {e}"
    sample.latency_s = round(time.monotonic() - t0, 4)
    return sample


async def _read_stream(r: aiohttp.ClientResponse, sample: Sample, t0: float) -> None:
    """Count the content chunks of an SSE answer, note the first one's time and the usage event."""
    chunks, usage_tokens, done = 0, None, False
    async for line in r.content:
        line = line.strip()
        if done or not line.startswith(b"data:"):
            continue   # after [DONE]: read on to the response's end, so the connection is kept for reuse
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            sample.status, sample.error = "bad stream", data[:ERROR_BODY_CHARS].decode("utf-8", "replace")
            return
        if "error" in event:
            err = event["error"]
            code = err.get("code") if isinstance(err, dict) else None
            sample.status = f"{code or 'error'} in stream"
            sample.error = json.dumps(err)[:ERROR_BODY_CHARS]
            return
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                if sample.ttft_s is None:
                    sample.ttft_s = round(time.monotonic() - t0, 4)
                chunks += 1
    sample.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if done:
        sample.ok = True
    else:
        sample.status, sample.error = "cut short", "the stream ended without data: [DONE]"


# --- accelerator sampling -----------------------------------------------------------------------

class UtilSampler:
    """Samples the host's cards through the smi reader in a thread while a level runs.

    read: a function returning the cards now (fleet.host.smi.read_cards bound to a connection), or None when
    the host has no smi reader; `reason` then says why.
    """

    def __init__(self, read: Callable[[], list] | None, interval_s: float = SAMPLE_INTERVAL_S,
                 reason: str = ""):
        self.read, self.interval_s, self.reason = read, interval_s, reason
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        self.samples = []
        if self.read is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="bench-smi", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join(30)
            self._thread = None

    def _loop(self) -> None:
        origin = time.monotonic()
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                cards = self.read()
            except Exception as e:  # noqa: BLE001 - a failing smi must not stop the load test
                self.reason = f"smi failed: {e}"
                self.read = None
                return
            self.samples.append({"t_s": round(t - origin, 3), "cards": [card_figures(c) for c in cards]})
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))


def card_figures(card) -> dict:
    """A fleet.host.smi Card as JSON-safe figures (what the smi did not report is None)."""
    def known(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else x
    used = card.used_fraction
    return {"index": card.index, "util_pct": known(card.util_pct), "used_mib": known(card.used_mib),
            "total_mib": known(card.total_mib), "mem_pct": None if used is None else round(100 * used, 1)}


def smi_reader(hv: HostVars) -> tuple[Callable[[], list] | None, str, Callable[[], None]]:
    """(read, reason, close): the host's smi through its own connection, or None and why not."""
    conn = connect(hv)
    return (lambda: smi.read_cards(conn, hv)), "", conn.close


def util_summary(samples: list[dict]) -> dict | None:
    """Median over the samples of the cards' mean utilisation and of memory used, in percent."""
    util, mem = [], []
    for s in samples:
        cards = s["cards"]
        if not cards:
            continue
        known = [c["util_pct"] for c in cards if c["util_pct"] is not None]
        if known:
            util.append(sum(known) / len(known))
        used = [c["mem_pct"] for c in cards if c["mem_pct"] is not None]
        if used:
            mem.append(sum(used) / len(used))
    if not util and not mem:
        return None
    return {"util_pct": round(statistics.median(util), 1) if util else None,
            "mem_pct": round(statistics.median(mem), 1) if mem else None,
            "samples": len(samples), "cards": max(len(s["cards"]) for s in samples)}


# --- statistics ---------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _r(x, nd=4):
    return None if x is None else round(x, nd)


def summarize_level(concurrency: int, samples: list[Sample], total_s: float, util: dict | None) -> dict:
    """The figures of one level: the seed's columns plus percentiles, TTFT, tokens/s, backends, failures."""
    ok = [s for s in samples if s.ok]
    lat = [s.latency_s for s in ok]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    failures = Counter(s.status for s in samples if not s.ok)
    return {
        "concurrency": concurrency, "requests": len(samples), "ok": len(ok),
        "success_rate": round(len(ok) / len(samples), 4) if samples else 0.0,
        "total_s": round(total_s, 4),
        "throughput_rps": round(len(ok) / total_s, 3) if total_s > 0 else 0.0,
        "latency_s": {"p50": _r(percentile(lat, 50)), "p95": _r(percentile(lat, 95)),
                      "p99": _r(percentile(lat, 99)), "max": _r(max(lat, default=None))},
        "ttft_s": {"p50": _r(percentile(ttft, 50)), "p95": _r(percentile(ttft, 95)),
                   "p99": _r(percentile(ttft, 99))},
        "output_tokens": sum(s.output_tokens for s in ok),
        "output_tokens_per_s": round(sum(s.output_tokens for s in ok) / total_s, 1) if total_s > 0 else 0.0,
        "by_backend": dict(sorted(Counter(s.backend for s in samples if s.backend).items())),
        "failures": dict(sorted(failures.items())),
        "utilisation": util,
    }


def saturation(levels: list[dict]) -> int | None:
    """The concurrency after which throughput grows by no more than 5%; None while it still grows."""
    for prev, cur in zip(levels, levels[1:]):
        if cur["throughput_rps"] <= prev["throughput_rps"] * (1 + SATURATION_GROWTH):
            return prev["concurrency"]
    return None


def analyse(scenario: dict, capacity: int, capacity_text: str) -> dict:
    """The findings of one scenario: parallelism at capacity, saturation, utilisation, daily estimate."""
    levels = scenario["levels"]
    single = scenario["single"]
    single_s = single["latency_s"] if single["ok"] else None
    sat = saturation(levels)
    peak = max(levels, key=lambda lv: lv["throughput_rps"])
    daily = peak["throughput_rps"] * 86400 * DAILY_FACTOR
    findings = {"capacity": capacity, "saturation": sat, "peak_concurrency": peak["concurrency"],
                "peak_throughput_rps": peak["throughput_rps"], "daily_estimate": int(daily),
                "single_latency_s": single_s}
    text = [f"Server capacity: {capacity} concurrent sequences ({capacity_text})."]

    at_cap = [lv for lv in levels if lv["concurrency"] <= capacity]
    if at_cap and single_s:
        lv = at_cap[-1]
        # --requests beyond the concurrency sends them in waves: each client's requests run one after
        # another, so the level takes `waves` request times even when every slot runs in parallel.
        waves = math.ceil(lv["requests"] / lv["concurrency"]) if lv["concurrency"] else 1
        ratio = lv["total_s"] / (single_s * waves)
        findings.update(parallel_concurrency=lv["concurrency"], parallel_ratio=round(ratio, 3))
        verdict = ("the slots run in parallel" if ratio <= 1.5 else
                   "requests queued below capacity: check the requests per backend and the engines' logs")
        alone = (f"one request alone ({single_s:.2f} s)" if waves == 1 else
                 f"{waves} requests one after another ({waves} x {single_s:.2f} s)")
        text.append(f"At concurrency {lv['concurrency']} the {lv['requests']} requests took "
                    f"{lv['total_s']:.2f} s in all, {ratio:.2f}x {alone}: {verdict}.")
    if sat is not None:
        nxt = levels[[lv["concurrency"] for lv in levels].index(sat) + 1]
        at = next(lv for lv in levels if lv["concurrency"] == sat)
        growth = (nxt["throughput_rps"] / at["throughput_rps"] - 1) * 100 if at["throughput_rps"] else 0.0
        text.append(f"Throughput stops growing at concurrency {sat} ({at['throughput_rps']:.1f} r/s; "
                    f"{nxt['concurrency']} gave {nxt['throughput_rps']:.1f} r/s, {growth:+.0f}%).")
    else:
        text.append(f"Throughput still grew at the highest concurrency ({levels[-1]['concurrency']}): the "
                    "server was not saturated; add higher levels to --concurrency to find its limit.")
    text.append("Client concurrency beyond the server's capacity only adds queueing: to serve more, raise "
                "max_num_seqs or add instances, not client concurrency."
                + ("" if levels[-1]["concurrency"] > capacity else
                   f" (No level of this run went beyond the capacity of {capacity}.)"))
    util_lv = next((lv for lv in levels if lv["concurrency"] == (sat or peak["concurrency"])), peak)
    u = util_lv["utilisation"]
    if u and u["util_pct"] is not None:
        mem = f", memory {u['mem_pct']:.0f}%" if u["mem_pct"] is not None else ""
        room = (" There is compute to spare: a higher max_num_seqs may raise throughput, at the cost of "
                "each request's latency." if u["util_pct"] < 85 else "")
        text.append(f"Accelerators at concurrency {util_lv['concurrency']}: median utilisation "
                    f"{u['util_pct']:.0f}%{mem}.{room}")
    text.append(f"Daily capacity estimate: {peak['throughput_rps']:.1f} r/s x 86,400 x {DAILY_FACTOR} = "
                f"{int(daily):,} requests a day (peak throughput, at concurrency {peak['concurrency']}).")
    failed = sum(lv["requests"] - lv["ok"] for lv in levels)
    if failed:
        by = Counter()
        for lv in levels:
            by.update(lv["failures"])
        text.append(f"{failed} request(s) failed: " + ", ".join(f"{n} x {k}" for k, n in sorted(by.items()))
                    + ".")
    findings["text"] = text
    return findings


# --- the run ------------------------------------------------------------------------------------

class Progress:
    """A progress bar on standard error: redrawn in place on a terminal, a line per level elsewhere."""

    def __init__(self, stream=None, width: int = 30):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.width = width

    def update(self, label: str, done: int, total: int, failed: int) -> None:
        if not self.tty and done < total:
            return
        filled = self.width * done // max(1, total)
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"{label:<22} [{bar}] {done}/{total}" + (f"  {failed} failed" if failed else "")
        self.stream.write(("\r" + line + ("\n" if done >= total else "")) if self.tty else line + "\n")
        self.stream.flush()


async def run_level(session, url: str, body: bytes, concurrency: int, n: int, timeout_s: float,
                    on_done: Callable[[int, int], None]) -> tuple[list[Sample], float]:
    """n requests kept `concurrency` at a time; the samples and the level's wall time."""
    pending = iter(range(n))
    samples: list[Sample] = []
    origin = time.monotonic()

    async def client():
        for _ in pending:      # one shared iterator: each client takes the next request number
            samples.append(await send(session, url, body, origin, timeout_s))
            on_done(len(samples), sum(1 for s in samples if not s.ok))

    await asyncio.gather(*(client() for _ in range(min(concurrency, n))))
    return samples, time.monotonic() - origin


def check_entry(hv: HostVars, url: str) -> None:
    """Fail early, in one sentence, when nothing answers at the entry or no backend is healthy."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/health", timeout=10):
            return
    except urllib.error.HTTPError as e:
        if e.code == 503:
            raise BenchError(f"{hv.name}: {url} has no healthy backend; see `inv status --host {hv.name}`.") \
                from None
        return  # an entry without /health (another front): the requests will tell
    except OSError as e:
        raise BenchError(f"{hv.name}: nothing answers at {url} ({getattr(e, 'reason', e)}); run "
                         f"`inv deploy --host {hv.name}` first.") from None


async def _sweep(hv, url, model, scenarios, levels, requests, image, timeout_s, sampler, progress, key=""):
    out = []
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, headers=auth_headers(key)) as session:
        for sc in scenarios:
            body = request_body(sc, model, image["url"], f"fleet-bench-{sc.name}")
            # One request alone first: the latency the parallel check compares with (and a warm-up).
            single, _ = await run_level(session, url, body, 1, 1, timeout_s, lambda d, f: None)
            first = single[0]
            if first.status == "401":
                raise BenchError(key_refused(hv, url, key))
            if image["url"] is not None and not first.ok and _NOT_MULTIMODAL.search(first.error or ""):
                raise BenchError(f"{hv.name}: the model {model} answers that it takes no image "
                                 f"({' '.join((first.error or '').split())[:160]}); bench it with --image none.")
            result = {"scenario": sc.name, "max_tokens": sc.max_tokens, "thinking": sc.thinking,
                      "single": asdict(single[0]), "levels": []}
            for c in levels:
                n = max(c, requests or c)
                label = f"{sc.name} c={c}"
                with sampler:
                    samples, total = await run_level(
                        session, url, body, c, n, timeout_s,
                        lambda d, f, label=label, n=n: progress.update(label, d, n, f))
                lv = summarize_level(c, samples, total, util_summary(sampler.samples))
                lv["samples"] = [asdict(s) for s in samples]
                lv["util_samples"] = list(sampler.samples)
                result["levels"].append(lv)
            errors = [{"status": s["status"], "backend": s["backend"], "body": s["error"]}
                      for lv in result["levels"] for s in lv["samples"] if not s["ok"]][:ERROR_BODIES]
            result["errors"] = errors
            out.append(result)
    return out


async def _until_interrupted(host: str, coro):
    """Run coro; Ctrl-C (the run's interrupt) cancels it, and with it the requests in flight."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        await asyncio.wait([task], timeout=0.2)
        if INTERRUPT.level and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            INTERRUPT.check(host)
    return task.result()


def run(hv: HostVars, scenarios: list[Scenario], levels: list[int], requests: int = 0,
        image_path: str | None = None, timeout_s: float | None = None, progress: Progress | None = None,
        model: str = "", key: str = "") -> dict:
    """Benchmark one model of a host through its entry port (model: a served name; the first when
    empty; key: the API key sent, if any); every raw figure and the findings, as plain data.

    requests: requests per level (default and minimum: one per concurrent client, one wave as the
    seed's test sent); hv: prepared (absolute deploy_dir) host variables.
    """
    served = hv.served_model(model)
    image = load_image(image_path)
    url = entry_url(hv)
    check_entry(hv, url)
    timeout_s = timeout_s or float(hv.settings.proxy.timeout_s)
    capacity = served.instances * served.max_num_seqs
    capacity_text = (f"{served.instances} instance{'s' if served.instances != 1 else ''} x max_num_seqs "
                     f"{served.max_num_seqs}")
    read, reason, close = smi_reader(hv)
    sampler = UtilSampler(read, reason=reason)
    started = time.time()
    try:
        results = asyncio.run(_until_interrupted(hv.name, _sweep(
            hv, url + "/v1/chat/completions", served.name, scenarios, levels, requests, image, timeout_s, sampler,
            progress or Progress(), key)))
    finally:
        close()
    for r in results:
        r["findings"] = analyse(r, capacity, capacity_text)
    return {
        "host": hv.name, "url": url, "model": served.name, "started": started,
        "finished": time.time(), "instances": served.instances, "max_num_seqs": served.max_num_seqs,
        "capacity": capacity, "concurrency": levels, "requests_per_level": requests or None,
        "image": {k: image[k] for k in ("source", "mime", "bytes")},
        # Why there are no utilisation figures, when there are none.
        "utilisation_note": None if any(lv["utilisation"] for r in results for lv in r["levels"])
        else sampler.reason or "the smi reader returned no card",
        "scenarios": results,
    }


# --- reports ------------------------------------------------------------------------------------

def _fmt(x, spec=".2f", unit="") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _backends_cell(by_backend: dict, instances: int) -> str:
    if not by_backend:
        return "-"
    counts = list(by_backend.values())
    spread = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
    return f"{len(counts)}/{instances} x {spread}"


def rows(result: dict, scenario: dict) -> list[dict]:
    """The table rows of one scenario as strings: shared by the terminal and the Markdown report."""
    out = []
    for lv in scenario["levels"]:
        u = lv["utilisation"] or {}
        out.append({
            "concurrency": str(lv["concurrency"]), "success": f"{lv['success_rate'] * 100:.0f}%",
            "total": f"{lv['total_s']:.2f}s", "rps": f"{lv['throughput_rps']:.1f}",
            "p50": _fmt(lv["latency_s"]["p50"]), "p95": _fmt(lv["latency_s"]["p95"]),
            "p99": _fmt(lv["latency_s"]["p99"]), "ttft": _fmt(lv["ttft_s"]["p50"]),
            "ttft95": _fmt(lv["ttft_s"]["p95"]), "tps": f"{lv['output_tokens_per_s']:.0f}",
            "util": _fmt(u.get("util_pct"), ".0f", "%"), "mem": _fmt(u.get("mem_pct"), ".0f", "%"),
            "backends": _backends_cell(lv["by_backend"], result["instances"]),
        })
    return out


COLUMNS = [("concurrency", "conc"), ("success", "success"), ("total", "total"), ("rps", "r/s"),
           ("p50", "p50 s"), ("p95", "p95 s"), ("p99", "p99 s"), ("ttft", "ttft p50"),
           ("ttft95", "ttft p95"), ("tps", "tok/s"), ("util", "util"), ("mem", "mem"),
           ("backends", "backends")]


def terminal_report(result: dict) -> str:
    """The tables and findings for the terminal."""
    lines = [f"bench {result['host']} ({result['model']}) via {result['url']}: capacity {result['capacity']} "
             f"({result['instances']} x max_num_seqs {result['max_num_seqs']}), image "
             + (f"{result['image']['source']} ({result['image']['bytes']:,} bytes)" if result['image']['mime']
                else "none (text only)")]
    for sc in result["scenarios"]:
        lines.append("")
        single = sc["single"]
        alone = f"{single['latency_s']:.2f}s" if single["ok"] else f"failed ({single['status']})"
        lines.append(f"{sc['scenario']} (max_tokens {sc['max_tokens']}"
                     f"{', thinking' if sc['thinking'] else ''}): one request alone {alone}")
        table = rows(result, sc)
        widths = {k: max(len(h), *(len(r[k]) for r in table)) for k, h in COLUMNS}
        lines.append("  " + "  ".join(f"{h:<{widths[k]}}" for k, h in COLUMNS).rstrip())
        for r in table:
            lines.append("  " + "  ".join(f"{r[k]:<{widths[k]}}" for k, _ in COLUMNS).rstrip())
        for t in sc["findings"]["text"]:
            lines.append(f"  - {t}")
        for e in sc["errors"]:
            lines.append(f"  ! {e['status']} from {e['backend'] or 'no backend'}: {' '.join((e['body'] or '').split())}")
    if result.get("utilisation_note"):
        lines.append("")
        lines.append(f"accelerator utilisation not sampled: {result['utilisation_note']}.")
    return "\n".join(lines)


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / ticks if span > 0 else 1.0
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def _axis(vmax: float) -> tuple[float, list[float]]:
    step = _nice_step(vmax or 1.0)
    top = step * max(1, math.ceil((vmax or 1.0) / step))
    return top, [round(i * step, 6) for i in range(int(round(top / step)) + 1)]


def chart_context(result: dict) -> dict:
    """The geometry of the SVG chart: one panel per scenario, throughput and p95 latency vs concurrency."""
    width, panel_h, top_margin, left, right, inner_top, inner_bottom = 760, 300, 40, 70, 70, 40, 50
    plot_w = width - left - right
    plot_h = panel_h - inner_top - inner_bottom
    panels = []
    for i, sc in enumerate(result["scenarios"]):
        levels = sc["levels"]
        xs = [lv["concurrency"] for lv in levels]
        xmax = max(xs)
        rps_top, rps_ticks = _axis(max(lv["throughput_rps"] for lv in levels))
        lat = [lv["latency_s"]["p95"] for lv in levels]
        lat_top, lat_ticks = _axis(max((x for x in lat if x is not None), default=1.0))
        y0 = top_margin + i * panel_h + inner_top

        def px(c):
            return round(left + plot_w * c / xmax, 1)

        def py(v, vtop):
            return round(y0 + plot_h - plot_h * v / vtop, 1)
        panels.append({
            "title": f"{sc['scenario']} (max_tokens {sc['max_tokens']})", "y0": y0, "y1": y0 + plot_h,
            "x0": left, "x1": left + plot_w,
            "x_ticks": [{"x": px(c), "label": str(c)} for c in xs],
            "rps_ticks": [{"y": py(v, rps_top), "label": f"{v:g}"} for v in rps_ticks],
            "lat_ticks": [{"y": py(v, lat_top), "label": f"{v:g}"} for v in lat_ticks],
            "rps_points": [{"x": px(lv["concurrency"]), "y": py(lv["throughput_rps"], rps_top),
                            "label": f"{lv['throughput_rps']:.1f}"} for lv in levels],
            "lat_points": [{"x": px(lv["concurrency"]), "y": py(v, lat_top), "label": f"{v:.2f}"}
                           for lv, v in zip(levels, lat) if v is not None],
            "capacity_x": px(result["capacity"]) if result["capacity"] <= xmax else None,
            "saturation_x": px(sc["findings"]["saturation"]) if sc["findings"]["saturation"] else None,
            "saturation_anchor": "end" if (sc["findings"]["saturation"] or 0) > xmax / 2 else "start",
        })
    return {"width": width, "height": top_margin + panel_h * len(panels), "panels": panels,
            "title": f"{result['host']}: throughput and p95 latency against concurrency "
                     f"(capacity {result['capacity']})"}


def _render(template: str, ctx: dict) -> str:
    return environment().get_template(template).render(ctx)


def markdown_report(result: dict) -> str:
    scenarios = [{**sc, "rows": rows(result, sc),
                  "backends": sorted({b for lv in sc["levels"] for b in lv["by_backend"]})}
                 for sc in result["scenarios"]]
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(result["started"]))
    return _render("bench/report.md.j2", {"r": result, "scenarios": scenarios, "started": started,
                                          "columns": COLUMNS})


def svg_chart(result: dict) -> str:
    return _render("bench/chart.svg.j2", chart_context(result))


def write_reports(result: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """bench.json, report.md and chart.svg into out_dir, each written whole (temporary file, rename)."""
    d = Path(out_dir)
    files = {"json": ("bench.json", json.dumps(result, indent=1) + "\n"),
             "markdown": ("report.md", markdown_report(result)),
             "svg": ("chart.svg", svg_chart(result))}
    written = {}
    try:
        d.mkdir(parents=True, exist_ok=True)
        for key, (name, text) in files.items():
            tmp = d / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, d / name)
            written[key] = d / name
    except OSError as e:
        raise BenchError(f"cannot write the reports into {d} ({e.strerror}); choose another --out.") from None
    return written


def check_writable(d: Path) -> None:
    """Create d and write a probe file in it, or say in one sentence why the reports could not go there."""
    made = [p for p in (d, *d.parents) if not p.exists()]   # removed again: a failed run leaves nothing
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".bench-write-test"
        probe.write_text("")
        probe.unlink()
        for p in made:
            p.rmdir()
    except OSError as e:
        raise BenchError(f"cannot write the reports into {d} ({e.strerror}); choose another --out.") from None


def default_out(host: str) -> Path:
    return Path("bench-results") / f"{host}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_host(conn, hv: HostVars, emit: Callable[[str], None], scenarios: list[Scenario], levels: list[int],
             requests: int = 0, image_path: str | None = None, out_dir: str | os.PathLike | None = None,
             progress: Progress | None = None, model: str = "", key: str = ""):
    """The `inv bench` action on one host: run, write the reports, print the tables; a Report back.
    Every model the host serves in turn, one table each (model: only that one); with several, each
    model's reports go to OUT/MODEL.

    A scenario in which no request succeeded is a failed step; the reports are written all the same.
    """
    report = Report(hv.name)
    models = [hv.served_model(model).name] if model else [m.name for m in hv.served_models()]
    out_dir = Path(out_dir or default_out(hv.name))
    check_writable(out_dir)   # before any load is sent: a sweep's results are not to be lost at the end
    hv = prepare(conn, hv)
    for name in models:
        result = run(hv, scenarios, levels, requests, image_path, progress=progress, model=name, key=key)
        written = write_reports(result, out_dir / name if len(models) > 1 else out_dir)
        emit(terminal_report(result))
        emit("")
        emit("wrote " + ", ".join(str(p) for p in written.values()))
        label = f" {name}" if len(models) > 1 else ""
        for sc in result["scenarios"]:
            ok = sum(lv["ok"] for lv in sc["levels"])
            sent = sum(lv["requests"] for lv in sc["levels"])
            status = "ok" if ok else "failed"
            report.add(f"bench{label} {sc['scenario']}", status, f"{ok}/{sent} requests succeeded"
                       + ("" if ok else "; see the error bodies above and the host's logs/req_results.log"))
        report.data.setdefault("benches", []).append(result)
        report.data["bench"] = result
        report.data["files"] = {k: str(v) for k, v in written.items()}
    return report
