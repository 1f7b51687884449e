"""The keeper: one process per deployment, beside the proxy, that restarts dead or stalled instances
through the one restart (hostagent/restart.py), with growing waits, and gives up loudly on a crash loop.

Each round (every proxy.health_interval_s) it reads every instance:
- stopped: no pid file (the operator stopped it): left alone;
- dead: its recorded process is gone ("exited"); or /health has failed for keeper.dead_after_s after it
  had been healthy ("unhealthy"); or it never became healthy within health_timeout_s of its start
  ("start-timeout"); or the stall probe (a 1-token completion every probe_interval_s, marked with
  `user: fleet-keeper-probe` and `X-Fleet-Probe: keeper`) timed out probe_failures times in a row while
  /health said 200 and the engine's generated-token counter did not move ("stalled"). An instance still
  loading is never dead;
- drained in the proxy by the operator: left alone.
A dead instance is restarted after a wait of backoff_base_s * 2^k (k: its restarts within window_s), at
most backoff_max_s; after max_restarts within window_s it is put in `crashloop` and not restarted again
until someone else starts it (inv restart, inv deploy: a new pid file).

What is dead and what to do is decided by keeper_decisions.decide, a pure function (an instance's state
is instances.classify's, the one `inv status` uses); this module observes, calls it and carries out its
actions. It never acts while the deployment's run lock is held (deploy, stop, restart, swaps), and holds that lock
itself while it restarts. In nginx mode it also does the /health watching and access-log rotation
(hostagent/watch.py). What it knows goes to run/keeper.json (read by `inv status`) and run/keeper.prom
(Prometheus text format, for node_exporter's textfile collector), and is served at `GET /metrics` on
keeper.metrics_port (bound to the engines' address) while it runs; its log is logs/keeper.log, rotated.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import (cards, config, exposition, files, httpcall, instances, layout, lock, logfiles, parts, processes,
               proxyadmin, restart, watch)
from .errors import ConfigError, KeeperError
from .keeper_decisions import (PROBE_RESULTS, REASONS, Crashloop, Log, MarkReady, Observed, Probe, Restart, Watch,
                               begin_restart, decide, end_restart, lock_refused)

log = logging.getLogger("hostagent.keeper")

PROBE_USER = "fleet-keeper-probe"
PROBE_HEADER = "X-Fleet-Probe"


# --- facts ----------------------------------------------------------------------------------------

def pidfile_identity(cfg: dict, i: int) -> tuple[str, int] | None:
    """What identifies one start of instance i: its pid file's text and time; None without a pid file."""
    path = config.at(cfg, layout.instance_pidfile(i))
    try:
        with open(path) as f:
            text = f.read().strip()
        return text, os.stat(path).st_mtime_ns
    except OSError:
        return None


def generated_tokens(url: str) -> float | None:
    """vllm:generation_tokens_total summed over its series, None when /metrics cannot be read."""
    answer = httpcall.get(f"{url}/metrics", timeout=2)
    if answer.status != 200:
        return None
    return exposition.total(exposition.samples(answer.text()), "vllm:generation_tokens_total")


def probe(cfg: dict, url: str, model: str | None = None) -> tuple[str, float | None, float | None]:
    """One stall probe of the instance at url serving model (default: the host's served_model_name):
    (answer, generated tokens before, after); answer "ok", "error" (an HTTP error: an answer all the same)
    or "timeout". keeper_decisions.probe_result tells a stall from a busy engine."""
    body = {"model": model or cfg["served_model_name"], "prompt": "ping", "max_tokens": 1, "user": PROBE_USER,
            "stream": False}
    before = generated_tokens(url)
    answer = httpcall.call(f"{url}/v1/completions", "POST", body, cfg["keeper"]["probe_timeout_s"],
                           {PROBE_HEADER: "keeper"})
    if answer.status is not None:
        return ("ok" if answer.status < 400 else "error"), before, None
    if not answer.timed_out:
        return "error", before, None
    return "timeout", before, generated_tokens(url)


def observe(cfg: dict, i: int, timeout: float) -> Observed:
    """What the keeper reads of instance i each round (all but drained and the stall probe's outcome)."""
    inst = cfg["instances"][i]
    identity = pidfile_identity(cfg, i)
    alive = identity is not None and instances.recorded_pid(cfg["deploy_dir"], cfg["deployment_id"], i) is not None
    status = instances.health(instances.url(inst), timeout=timeout) if alive else None
    return Observed(identity=identity, alive=alive, health=status,
                    listening=identity is not None and not alive and instances.listening(
                        inst["port"], inst.get("address") or "127.0.0.1"),
                    ready=os.path.exists(config.at(cfg, layout.instance_ready(i))),
                    age_s=time.time() - identity[1] / 1e9 if identity else 0.0)


# --- the keeper -----------------------------------------------------------------------------------

class Keeper:
    """The loop: each round it observes every instance, asks keeper_decisions.decide, and carries out the
    actions. Seams for the tests (as honcho's Manager): the clocks, and the methods that touch the host
    (observe, backends, try_lock, restart, probe) can be replaced."""

    def __init__(self, cfg: dict, nginx_cfg: dict | None = None, _clock=time.monotonic, _wall=time.time):
        self.cfg = cfg
        self.k = cfg["keeper"]
        self.nginx_cfg = nginx_cfg
        self.clock, self.wall = _clock, _wall
        self.stop = threading.Event()
        self.held = None                 # the run lock, while the keeper restarts an instance
        self.lock_held_by_other = False
        saved = self._load_state()
        self.watches = {inst["index"]: Watch.restore(inst["index"], saved.get(str(inst["index"])))
                        for inst in cfg["instances"]}
        self.worker: threading.Thread | None = None
        self.restarting: int | None = None
        self.probing: set[int] = set()
        self.probe_results: dict[int, tuple] = {}
        self.started_at = self.wall()
        self.mode = "proxy"
        self.written = ""
        self.metrics = self.metrics_text("running")   # what GET /metrics answers, renewed when the record changes
        self.cards = cards.Sampler(cfg, log)            # the cards' figures, added to GET /metrics only

    # the host (seams)
    def observe(self, i: int) -> Observed:
        return observe(self.cfg, i, timeout=min(2.0, self.interval() + 1))

    def backends(self) -> dict | None:
        return proxyadmin.backends(self.cfg["admin_port"])

    def try_lock(self, what: str):
        return lock.try_hold(self.cfg["deploy_dir"], what)

    def restart(self, i: int) -> list[dict]:
        return restart.restart_instance(self.cfg, i, lambda line: log.info("  %s", line), cancelled=self.stop.is_set)

    def probe(self, i: int) -> tuple:
        inst = self.cfg["instances"][i]
        return probe(self.cfg, instances.url(inst), inst.get("model"))

    # files
    def _load_state(self) -> dict:
        try:
            with open(config.at(self.cfg, layout.KEEPER_STATE)) as f:
                return json.load(f).get("instances", {})
        except (OSError, ValueError, AttributeError):
            return {}

    def write_state(self, state: str = "running") -> None:
        now = self.clock()
        data = {"pid": os.getpid(), "state": state, "started_at": self.started_at, "mode": self.mode,
                "lock_held": self.lock_held_by_other, "restarting": self.restarting,
                "interval_s": self.interval(),
                "instances": {str(i): w.record(now) for i, w in self.watches.items()}}
        text = json.dumps(data, indent=1) + "\n"
        if text == self.written:       # written on change only: a quiet host's deploy_dir stays as it is
            return                     # (the record holds every figure of the metrics: they are unchanged)
        self.metrics = self.metrics_text(state)
        files.write_atomic(config.at(self.cfg, layout.KEEPER_STATE), text)
        files.write_atomic(config.at(self.cfg, layout.KEEPER_METRICS), self.metrics)
        self.written = text

    def metrics_text(self, state: str) -> str:
        dep = self.cfg["deployment_id"]
        watches = list(self.watches.values())
        lines = ["# HELP fleet_keeper_restarts_total Instance restarts by the keeper, by reason.",
                 "# TYPE fleet_keeper_restarts_total counter"]
        for w in watches:
            for reason in REASONS:
                lines.append(f'fleet_keeper_restarts_total{{deployment="{dep}",instance="{w.index}",'
                             f'reason="{reason}"}} {w.by_reason.get(reason, 0)}')
        lines += ["# HELP fleet_keeper_crashloop 1 while the instance is in crashloop (not restarted).",
                  "# TYPE fleet_keeper_crashloop gauge"]
        lines += [f'fleet_keeper_crashloop{{deployment="{dep}",instance="{w.index}"}} {int(w.crashloop)}'
                  for w in watches]
        lines += ["# HELP fleet_keeper_probes_total Stall probes sent (user fleet-keeper-probe), by result.",
                  "# TYPE fleet_keeper_probes_total counter"]
        for w in watches:
            for result in PROBE_RESULTS:
                lines.append(f'fleet_keeper_probes_total{{deployment="{dep}",instance="{w.index}",'
                             f'result="{result}"}} {w.probes.get(result, 0)}')
        lines += ["# HELP fleet_keeper_last_restart_timestamp_seconds When the keeper last began restarting "
                  "the instance (Unix time; 0: never).",
                  "# TYPE fleet_keeper_last_restart_timestamp_seconds gauge"]
        lines += [f'fleet_keeper_last_restart_timestamp_seconds{{deployment="{dep}",instance="{w.index}"}} '
                  f'{float(w.last_at or 0)}' for w in watches]
        lines += ["# HELP fleet_keeper_instance_healthy 1 while the keeper sees the instance healthy.",
                  "# TYPE fleet_keeper_instance_healthy gauge"]
        lines += [f'fleet_keeper_instance_healthy{{deployment="{dep}",instance="{w.index}"}} '
                  f'{int(w.state == "healthy")}' for w in watches]
        lines += ["# HELP fleet_keeper_up 1 while the keeper runs.", "# TYPE fleet_keeper_up gauge",
                  f'fleet_keeper_up{{deployment="{dep}"}} {1 if state == "running" else 0}']
        return "\n".join(lines) + "\n"

    def http_text(self) -> str:
        """GET /metrics: run/keeper.prom's text plus the cards' memory and use (sampled at most every 2 s)."""
        more = cards.metrics_lines(self.cards.sample(), self.cfg["deployment_id"])
        return self.metrics + "".join(line + "\n" for line in more)

    def interval(self) -> float:
        return max(0.1, min(5.0, float(self.cfg["health_interval_s"])))

    # the loop
    def run(self) -> None:
        server = serve_metrics(self, self.k.get("metrics_address") or "127.0.0.1", self.k.get("metrics_port"))
        try:
            self._run()
        finally:
            if server is not None:        # stopped: the port serves nothing any more
                server.shutdown()
                server.server_close()

    def _run(self) -> None:
        log.info("keeper pid %d watching %d instance(s) every %gs: dead after %gs unhealthy, backoff %g-%gs, "
                 "crashloop after %d restarts in %gs, stall probe %s", os.getpid(), len(self.watches),
                 self.interval(), self.k["dead_after_s"], self.k["backoff_base_s"], self.k["backoff_max_s"],
                 self.k["max_restarts"], self.k["window_s"],
                 f"every {self.k['probe_interval_s']:g}s" if self.k["stall_probe"] else "off")
        while not self.stop.is_set():
            try:
                self.round()
                self.write_state()
            except OSError as e:            # a full disk, a vanished deploy_dir: say so, keep watching
                log.error("round failed: %s", e)
            self.stop.wait(self.interval())
        log.info("stopping%s", f": cancelling the restart of instance {self.restarting}"
                 if self.restarting is not None else "")
        if self.worker is not None:
            self.worker.join(timeout=float(self.cfg["stop_grace_s"]) + 5)
        self.write_state("stopped")
        log.info("stopped")

    def round(self) -> None:
        """Observe every instance (but the one being restarted), decide, act."""
        self.mode = _read(config.at(self.cfg, layout.MODE)) or "proxy"
        if self.mode == "nginx" and self.nginx_cfg is not None:
            watch.step(self.nginx_cfg)
            watch.rotate_access_log(self.nginx_cfg)
        drained = {}
        if self.mode != "nginx":
            drained = {name: b.get("drained") for name, b in (self.backends() or {}).items()}
        self.lock_held_by_other = False
        indexes = [i for i in self.watches if i != self.restarting]
        # every instance at once: a hung one costs a round one /health timeout, not one per instance.
        with ThreadPoolExecutor(max_workers=min(16, len(indexes) or 1)) as pool:
            observed = list(pool.map(self.observe, indexes))
        for i, obs in zip(indexes, observed):
            obs.drained = bool(drained.get(self.cfg["instances"][i]["backend"], False))
            obs.probing = i in self.probing
            obs.probe = self.probe_results.pop(i, None)
            self.watches[i], actions = decide(self.watches[i], obs, self.clock(), self.wall(), self.k,
                                              float(self.cfg["health_timeout_s"]),
                                              busy=self.restarting is not None)
            for action in actions:
                self.carry_out(action)

    def carry_out(self, action) -> None:
        if isinstance(action, Log):
            getattr(log, action.level)("%s", action.message)
        elif isinstance(action, MarkReady):
            log.info("instance %d: healthy on :%d", action.index, self.cfg["instances"][action.index]["port"])
            _touch(config.at(self.cfg, layout.instance_ready(action.index)))   # as `inv status` marks it
        elif isinstance(action, Probe):
            self._start_probe(action.index)
        elif isinstance(action, Crashloop):
            i = action.index
            log.error("instance %d: CRASHLOOP: dead again (%s) after %d restarts within %gs; no more restarts "
                      "until `inv restart --instance %d` or `inv deploy`. Last lines of %s:\n%s",
                      i, action.reason, action.restarts, self.k["window_s"], i, layout.instance_log(i),
                      "\n".join("    " + line for line in instances.engine_log_tail(self.cfg["deploy_dir"], i)))
        elif isinstance(action, Restart):
            self._start_restart(action)

    def _start_restart(self, action: Restart) -> None:
        i = action.index
        self.held = self.try_lock(f"keeper (pid {os.getpid()}): restart of instance {i} ({action.reason})")
        if self.held is None:          # taken only to act: a check alone could make a deploy fail
            self.lock_held_by_other = True
            self.watches[i] = lock_refused(self.watches[i])
            return
        self.watches[i] = w = begin_restart(self.watches[i], self.wall())
        self.restarting = i
        log.warning("instance %d: restarting (%s), restart %d within %gs", i, action.reason, len(w.recent),
                    self.k["window_s"])
        self.worker = threading.Thread(target=self._restart, args=(i,), name=f"restart-{i}", daemon=True)
        self.worker.start()

    def _restart(self, i: int) -> None:
        result = "failed: the restart did not end"
        try:
            steps = self.restart(i)
            failed = [s for s in steps if s["status"] == "failed"]
            result = "failed: " + failed[-1]["message"].splitlines()[0] if failed else "ok"
            (log.error if failed else log.warning)("instance %d: restart %s", i, result)
        except instances.Cancelled:
            result = "cancelled (the keeper was stopped)"
            log.warning("instance %d: restart cancelled: the keeper is stopping", i)
        except Exception as e:           # noqa: BLE001 - the keeper must outlive one bad restart
            result = f"failed: {e}"
            log.exception("instance %d: restart failed", i)
        finally:
            self.watches[i] = end_restart(self.watches[i], result, pidfile_identity(self.cfg, i), self.clock(),
                                          self.k)
            self.held.release()
            self.held = None
            self.restarting = None

    def _start_probe(self, i: int) -> None:
        self.probing.add(i)

        def run():
            try:
                self.probe_results[i] = self.probe(i)
            finally:
                self.probing.discard(i)
        threading.Thread(target=run, name=f"probe-{i}", daemon=True).start()


# --- GET /metrics ----------------------------------------------------------------------------------

class _MetricsHandler(BaseHTTPRequestHandler):
    keeper: "Keeper"

    def do_GET(self):                                   # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "the keeper serves /metrics only")
            return
        body = self.keeper.http_text().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):                       # a scrape every few seconds is not news
        pass


def serve_metrics(keeper: "Keeper", address: str, port: int | None) -> ThreadingHTTPServer | None:
    """Serve keeper.metrics at GET /metrics on address:port in a daemon thread; None (one log line) when
    the port cannot be had: the keeper goes on without it."""
    if not port:
        return None
    handler = type("MetricsHandler", (_MetricsHandler,), {"keeper": keeper})
    server_class = type("MetricsServer", (ThreadingHTTPServer,), {
        "daemon_threads": True, "address_family": socket.AF_INET6 if ":" in address else socket.AF_INET})
    try:
        server = server_class((address, port), handler)
    except OSError as e:
        log.warning("metrics over HTTP are off: cannot listen on %s:%d (%s); run/keeper.prom is still written",
                    address, port, e.strerror or e)
        return None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics at http://%s/metrics", f"[{address}]:{port}" if ":" in address else f"{address}:{port}")
    return server


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _touch(path: str) -> None:
    try:
        open(path, "a").close()
    except OSError:
        pass


# --- process --------------------------------------------------------------------------------------

def write_pidfile(cfg: dict) -> None:
    """run/keeper.pid: this process's record, `pid=P pgid=G sid=S start=T tag=<id>/keeper`."""
    processes.write_record(config.at(cfg, layout.KEEPER_PID), os.getpid(), layout.tag(cfg["deployment_id"], "keeper"))


def setup_logging(cfg: dict) -> None:
    """logs/keeper.log (0600), rotated at log_max_mb, log_backups kept (as the results log)."""
    path = config.at(cfg, layout.KEEPER_LOG)
    notes = logfiles.tighten(path, int(cfg["log_backups"]))
    handler = logfiles.RotatingFileHandler(path, maxBytes=int(float(cfg["log_max_mb"]) * 1024 * 1024),
                                           backupCount=int(cfg["log_backups"]))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for note in notes:
        log.warning("%s", note)


def main(cfg: dict) -> int:
    """Run the keeper in this process until SIGTERM or SIGINT (handlers only set a flag)."""
    logfiles.make_dir(config.at(cfg, layout.LOGS))
    setup_logging(cfg)
    nginx_cfg = None
    try:
        nginx_cfg = config.load_config(config.at(cfg, cfg["nginx_config"]))
    except ConfigError as e:
        log.warning("nginx mode's /health watching is off: %s", e)
    keeper = Keeper(cfg, nginx_cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: keeper.stop.set())
    write_pidfile(cfg)
    keeper.run()
    return 0


def stop(cfg: dict) -> int | None:
    """Stop the running keeper (SIGTERM, grace, SIGKILL); its pid, or None when none ran."""
    pidfile = config.at(cfg, layout.KEEPER_PID)
    p = parts.ours(cfg, layout.KEEPER_PID, "keeper")
    pid = p.pid if p else None
    if p:
        parts.stop_group(p.pgid, p.pid, float(cfg["stop_grace_s"]) + 5)
    if os.path.exists(pidfile):
        os.remove(pidfile)
    return pid


def start(cfg: dict, config_path: str) -> int:
    """Start the keeper in its own session, tagged <id>/keeper (a running one is stopped first);
    wait until it wrote its pid file."""
    stop(cfg)
    pidfile = config.at(cfg, layout.KEEPER_PID)
    logfiles.make_dir(config.at(cfg, layout.LOGS))
    out = logfiles.open_append(config.at(cfg, layout.KEEPER_OUT), say=True)
    p = subprocess.Popen([sys.executable, "-m", "hostagent", "keeper", "--config", config_path],
                         cwd=cfg["deploy_dir"], env=parts.tagged_env(cfg, "keeper"), stdin=subprocess.DEVNULL,
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and p.poll() is None and not os.path.exists(pidfile):
        time.sleep(0.02)
    if not os.path.exists(pidfile):
        raise KeeperError("the keeper did not start: " + instances.log_line(config.at(cfg, layout.KEEPER_OUT)))
    return p.pid
