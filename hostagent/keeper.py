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

It never acts while the deployment's run lock is held (deploy, stop, restart, swaps), and holds that lock
itself while it restarts. In nginx mode it also does the /health watching and access-log rotation
(hostagent/watch.py). What it knows goes to run/keeper.json (read by `inv status`) and run/keeper.prom
(Prometheus text format, for node_exporter's textfile collector); its log is logs/keeper.log, rotated.
"""
from __future__ import annotations

import json
import logging
import logging.handlers
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from . import host, lock, processes, restart, watch

log = logging.getLogger("hostagent.keeper")

PROBE_USER = "fleet-keeper-probe"
PROBE_HEADER = "X-Fleet-Probe"
REASONS = ("exited", "unhealthy", "start-timeout", "stalled")


# --- facts ----------------------------------------------------------------------------------------

def pidfile_identity(cfg: dict, i: int) -> tuple[str, int] | None:
    """What identifies one start of instance i: its pid file's text and time; None without a pid file."""
    path = host.run_path(cfg, f"instance_{i}.pid")
    try:
        with open(path) as f:
            text = f.read().strip()
        return text, os.stat(path).st_mtime_ns
    except OSError:
        return None


def generated_tokens(url: str) -> float | None:
    """vllm:generation_tokens_total summed over its series, None when /metrics cannot be read."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            try:
                total += float(line.rsplit(None, 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return total if seen else None


def probe(cfg: dict, url: str) -> str:
    """One stall probe: "ok", "busy" (timed out while the engine kept generating), "timeout" or "error"."""
    body = json.dumps({"model": cfg["served_model_name"], "prompt": "ping", "max_tokens": 1,
                       "user": PROBE_USER, "stream": False}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json", PROBE_HEADER: "keeper"})
    before = generated_tokens(url)
    try:
        with urllib.request.urlopen(req, timeout=cfg["keeper"]["probe_timeout_s"]) as r:
            r.read()
            return "ok"
    except urllib.error.HTTPError:
        return "error"                      # an answer, so not a stall; /health says the rest
    except (TimeoutError, OSError) as e:
        if not isinstance(e, TimeoutError) and "timed out" not in str(e):
            return "error"
    after = generated_tokens(url)
    if before is not None and after is not None and after > before:
        return "busy"                      # queued behind long requests, but tokens are flowing
    return "timeout"


# --- one instance's record ------------------------------------------------------------------------

class Watch:
    """What the keeper knows of one instance."""

    def __init__(self, index: int, saved: dict | None = None):
        saved = saved or {}
        self.index = index
        self.identity: tuple[str, int] | None = None
        self.healthy_once = False
        self.unhealthy_since: float | None = None
        self.probe_failures = 0
        self.next_probe = 0.0
        self.probing = False
        self.dead_reason: str | None = None
        self.restart_at: float | None = None         # monotonic time of the next restart (backoff)
        self.state = "unknown"
        self.recent: list[float] = list(saved.get("recent", []))     # wall times of restarts in window
        self.restarts = int(saved.get("restarts", 0))
        self.by_reason: dict[str, int] = dict(saved.get("by_reason", {}))
        self.last_reason = saved.get("last_reason")
        self.last_at = saved.get("last_at")
        self.last_result = saved.get("last_result")
        self.crashloop = bool(saved.get("crashloop"))
        self.crashloop_identity = saved.get("crashloop_identity")
        self.probes: dict[str, int] = dict(saved.get("probes", {}))

    def new_start(self, identity) -> None:
        self.identity = identity
        self.healthy_once = False
        self.unhealthy_since = None
        self.probe_failures = 0
        self.dead_reason = None
        self.restart_at = None

    def record(self) -> dict:
        left = None if self.restart_at is None else round(max(0.0, self.restart_at - time.monotonic()), 1)
        return {"state": self.state, "restarts": self.restarts, "by_reason": self.by_reason,
                "last_reason": self.last_reason, "last_at": self.last_at, "last_result": self.last_result,
                "recent": self.recent, "crashloop": self.crashloop,
                "crashloop_identity": list(self.crashloop_identity) if self.crashloop_identity else None,
                "dead_reason": self.dead_reason, "restart_in_s": left, "probe_failures": self.probe_failures,
                "probes": self.probes}


# --- the keeper -----------------------------------------------------------------------------------

class Keeper:
    def __init__(self, cfg: dict, nginx_cfg: dict | None = None):
        self.cfg = cfg
        self.k = cfg["keeper"]
        self.nginx_cfg = nginx_cfg
        self.stop = threading.Event()
        self.held = None                 # the run lock, while the keeper restarts an instance
        self.lock_held_by_other = False
        saved = self._load_state()
        self.watches = [Watch(inst["index"], saved.get(str(inst["index"]))) for inst in cfg["instances"]]
        self.worker: threading.Thread | None = None
        self.restarting: int | None = None
        self.started_at = time.time()
        self.mode = "proxy"
        self.written = ""

    # files
    def _load_state(self) -> dict:
        try:
            with open(host.run_path(self.cfg, "keeper.json")) as f:
                return json.load(f).get("instances", {})
        except (OSError, ValueError, AttributeError):
            return {}

    def write_state(self, state: str = "running") -> None:
        data = {"pid": os.getpid(), "state": state, "started_at": self.started_at, "mode": self.mode,
                "lock_held": self.lock_held_by_other, "restarting": self.restarting,
                "interval_s": self.interval(), "instances": {str(w.index): w.record() for w in self.watches}}
        text = json.dumps(data, indent=1) + "\n"
        if text == self.written:       # written on change only: a quiet host's deploy_dir stays as it is
            return
        host.write_atomic(host.run_path(self.cfg, "keeper.json"), text)
        host.write_atomic(host.run_path(self.cfg, "keeper.prom"), self.metrics_text(state))
        self.written = text

    def metrics_text(self, state: str) -> str:
        dep = self.cfg["deployment_id"]
        lines = ["# HELP fleet_keeper_restarts_total Instance restarts by the keeper, by reason.",
                 "# TYPE fleet_keeper_restarts_total counter"]
        for w in self.watches:
            for reason in REASONS:
                lines.append(f'fleet_keeper_restarts_total{{deployment="{dep}",instance="{w.index}",'
                             f'reason="{reason}"}} {w.by_reason.get(reason, 0)}')
        lines += ["# HELP fleet_keeper_crashloop 1 while the instance is in crashloop (not restarted).",
                  "# TYPE fleet_keeper_crashloop gauge"]
        lines += [f'fleet_keeper_crashloop{{deployment="{dep}",instance="{w.index}"}} {int(w.crashloop)}'
                  for w in self.watches]
        lines += ["# HELP fleet_keeper_probes_total Stall probes sent (user fleet-keeper-probe), by result.",
                  "# TYPE fleet_keeper_probes_total counter"]
        for w in self.watches:
            for result in ("ok", "busy", "timeout", "error"):
                lines.append(f'fleet_keeper_probes_total{{deployment="{dep}",instance="{w.index}",'
                             f'result="{result}"}} {w.probes.get(result, 0)}')
        lines += ["# HELP fleet_keeper_up 1 while the keeper runs.", "# TYPE fleet_keeper_up gauge",
                  f'fleet_keeper_up{{deployment="{dep}"}} {1 if state == "running" else 0}']
        return "\n".join(lines) + "\n"

    def interval(self) -> float:
        return max(0.1, min(5.0, float(self.cfg["health_interval_s"])))

    # the loop
    def run(self) -> None:
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
        self.mode = _read(host.run_path(self.cfg, "mode")) or "proxy"
        if self.mode == "nginx" and self.nginx_cfg is not None:
            watch.step(self.nginx_cfg)
            watch.rotate_access_log(self.nginx_cfg)
        drained = {}
        if self.mode != "nginx":
            drained = {name: b.get("drained") for name, b in (restart.backends(self.cfg) or {}).items()}
        self.lock_held_by_other = False
        watches = [w for w in self.watches if w.index != self.restarting]
        # /health of every instance at once: a hung one costs a round one timeout, not one per instance.
        with ThreadPoolExecutor(max_workers=min(16, len(watches) or 1)) as pool:
            statuses = list(pool.map(self._health, watches))
        for w, (alive, status) in zip(watches, statuses):
            self.look(w, alive, status, drained.get(self.cfg["instances"][w.index]["backend"], False))

    def _health(self, w: Watch) -> tuple[bool, int | None]:
        """Whether instance w's recorded process is alive (and still the one its pid file records), and its
        /health status when it is."""
        if restart.instance_pid(self.cfg, w.index) is None:
            return False, None
        return True, restart.health(restart.instance_url(self.cfg["instances"][w.index]),
                                    timeout=min(2.0, self.interval() + 1))

    def look(self, w: Watch, alive: bool, status: int | None, drained: bool) -> None:
        """Settle one instance's state, and act on it when it is dead."""
        inst = self.cfg["instances"][w.index]
        now = time.monotonic()
        identity = pidfile_identity(self.cfg, w.index)
        if identity is None:
            w.state, w.identity = "stopped", None
            w.dead_reason = w.restart_at = None
            return
        if identity != w.identity:
            if w.crashloop and w.crashloop_identity is not None and list(identity) != list(w.crashloop_identity):
                log.warning("instance %d: started by someone else (inv restart or deploy): crashloop cleared",
                            w.index)
                w.crashloop, w.crashloop_identity, w.recent = False, None, []
            w.new_start(identity)
            w.healthy_once = os.path.exists(host.run_path(self.cfg, f"instance_{w.index}.ready"))
        reason = None
        if not alive:
            reason = "exited"
        elif status == 200:
            if not w.healthy_once:
                log.info("instance %d: healthy on :%d", w.index, inst["port"])
                _touch(host.run_path(self.cfg, f"instance_{w.index}.ready"))   # as `inv status` marks it
            w.healthy_once, w.unhealthy_since = True, None
            if w.probe_failures >= self.k["probe_failures"]:
                reason = "stalled"
            elif self.k["stall_probe"] and not w.probing and now >= w.next_probe:
                self._probe(w, restart.instance_url(inst))
        elif w.healthy_once:
            w.unhealthy_since = w.unhealthy_since or now
            if now - w.unhealthy_since >= self.k["dead_after_s"]:
                reason = "unhealthy"
        elif _age(identity) > float(self.cfg["health_timeout_s"]):
            reason = "start-timeout"
        if reason is None:
            if w.dead_reason is not None:
                log.info("instance %d: recovered before its restart", w.index)
            w.dead_reason = w.restart_at = None
            w.state = "healthy" if status == 200 else ("unhealthy" if w.healthy_once else "loading")
            if drained:
                w.state += ", drained"
            return
        self.dead(w, reason, drained)

    def dead(self, w: Watch, reason: str, drained: bool) -> None:
        if w.crashloop:
            w.state = "crashloop"
            return
        if drained:
            w.state = f"dead ({reason}), drained by the operator: left alone"
            return
        if w.dead_reason is None:
            w.dead_reason = reason
            cutoff = time.time() - self.k["window_s"]
            w.recent = [t for t in w.recent if t >= cutoff]
            if len(w.recent) >= self.k["max_restarts"]:
                w.crashloop, w.crashloop_identity, w.state = True, w.identity, "crashloop"
                log.error("instance %d: CRASHLOOP: dead again (%s) after %d restarts within %gs; no more restarts "
                          "until `inv restart --instance %d` or `inv deploy`. Last lines of logs/vllm_%d.log:\n%s",
                          w.index, reason, len(w.recent), self.k["window_s"], w.index, w.index,
                          "\n".join("    " + line for line in restart.log_tail(self.cfg, w.index)))
                return
            wait = min(self.k["backoff_max_s"], self.k["backoff_base_s"] * 2 ** len(w.recent))
            w.restart_at = time.monotonic() + wait
            log.warning("instance %d: dead (%s); restart %d in %gs", w.index, reason, len(w.recent) + 1, wait)
        w.state = f"dead ({w.dead_reason}), restart in {max(0.0, w.restart_at - time.monotonic()):.0f}s"
        if time.monotonic() < w.restart_at or self.restarting is not None:
            return
        self.held = lock.try_hold(self.cfg["deploy_dir"], f"keeper (pid {os.getpid()}): restart of instance "
                                  f"{w.index} ({w.dead_reason})")
        if self.held is None:          # taken only to act: a check alone could make a deploy fail
            self.lock_held_by_other = True
            w.state = f"dead ({w.dead_reason}), waiting: the run lock is held (deploy, stop, restart or swap)"
            return
        self.restarting = w.index
        w.state = "restarting"
        self.worker = threading.Thread(target=self._restart, args=(w,), name=f"restart-{w.index}", daemon=True)
        self.worker.start()

    def _restart(self, w: Watch) -> None:
        reason = w.dead_reason
        w.recent.append(time.time())
        w.restarts += 1
        w.by_reason[reason] = w.by_reason.get(reason, 0) + 1
        w.last_reason, w.last_at = reason, time.time()
        log.warning("instance %d: restarting (%s), restart %d within %gs", w.index, reason, len(w.recent),
                    self.k["window_s"])
        try:
            steps = restart.restart_instance(self.cfg, w.index, lambda line: log.info("  %s", line),
                                             cancelled=self.stop.is_set)
            failed = [s for s in steps if s["status"] == "failed"]
            w.last_result = "failed: " + failed[-1]["message"].splitlines()[0] if failed else "ok"
            (log.error if failed else log.warning)("instance %d: restart %s", w.index, w.last_result)
        except restart.Cancelled:
            w.last_result = "cancelled (the keeper was stopped)"
            log.warning("instance %d: restart cancelled: the keeper is stopping", w.index)
        except Exception as e:           # noqa: BLE001 - the keeper must outlive one bad restart
            w.last_result = f"failed: {e}"
            log.exception("instance %d: restart failed", w.index)
        finally:
            w.new_start(pidfile_identity(self.cfg, w.index))
            w.next_probe = time.monotonic() + self.k["probe_interval_s"]
            self.held.release()
            self.held = None
            self.restarting = None

    def _probe(self, w: Watch, url: str) -> None:
        w.probing = True
        w.next_probe = time.monotonic() + self.k["probe_interval_s"]

        def run():
            try:
                result = probe(self.cfg, url)
                w.probes[result] = w.probes.get(result, 0) + 1
                if result == "timeout":
                    w.probe_failures += 1
                    log.warning("instance %d: stall probe timed out (%d/%d) with /health 200 and no token "
                                "generated", w.index, w.probe_failures, self.k["probe_failures"])
                elif result in ("ok", "busy"):
                    w.probe_failures = 0
            finally:
                w.probing = False
        threading.Thread(target=run, name=f"probe-{w.index}", daemon=True).start()


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


def _age(identity) -> float:
    """Seconds since the pid file of this start was written."""
    return time.time() - identity[1] / 1e9


# --- process --------------------------------------------------------------------------------------

def write_pidfile(cfg: dict) -> None:
    """run/keeper.pid: this process's record, `pid=P pgid=G sid=S start=T tag=<id>/keeper`."""
    processes.write_record(host.run_path(cfg, "keeper.pid"), os.getpid(), f"{cfg['deployment_id']}/keeper")


def setup_logging(cfg: dict) -> None:
    """logs/keeper.log, rotated at log_max_mb, log_backups kept (as the results log)."""
    path = os.path.join(cfg["deploy_dir"], "logs", "keeper.log")
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=int(float(cfg["log_max_mb"]) * 1024 * 1024),
                                                   backupCount=int(cfg["log_backups"]))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def main(cfg: dict) -> int:
    """Run the keeper in this process until SIGTERM or SIGINT (handlers only set a flag)."""
    os.makedirs(os.path.join(cfg["deploy_dir"], "logs"), exist_ok=True)
    setup_logging(cfg)
    nginx_cfg = None
    try:
        nginx_cfg = host.load_config(os.path.join(cfg["deploy_dir"], cfg["nginx_config"]))
    except host.FrontError as e:
        log.warning("nginx mode's /health watching is off: %s", e)
    keeper = Keeper(cfg, nginx_cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: keeper.stop.set())
    write_pidfile(cfg)
    keeper.run()
    return 0


def stop(cfg: dict) -> int | None:
    """Stop the running keeper (SIGTERM, grace, SIGKILL); its pid, or None when none ran."""
    pidfile = host.run_path(cfg, "keeper.pid")
    p = host.ours(cfg, "keeper.pid", "keeper")
    pid = p.pid if p else None
    if p:
        host.stop_group(p.pgid, p.pid, float(cfg["stop_grace_s"]) + 5)
    if os.path.exists(pidfile):
        os.remove(pidfile)
    return pid


def start(cfg: dict, config_path: str) -> int:
    """Start the keeper in its own session, tagged <id>/keeper (a running one is stopped first);
    wait until it wrote its pid file."""
    stop(cfg)
    pidfile = host.run_path(cfg, "keeper.pid")
    out = open(os.path.join(cfg["deploy_dir"], "logs", "keeper.out"), "a")
    p = subprocess.Popen([sys.executable, "-m", "hostagent", "keeper", "--config", config_path],
                         cwd=cfg["deploy_dir"], env=host.tagged_env(cfg, "keeper"), stdin=subprocess.DEVNULL,
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and p.poll() is None and not os.path.exists(pidfile):
        time.sleep(0.02)
    if not os.path.exists(pidfile):
        raise host.FrontError("the keeper did not start: " + host.log_tail(
            os.path.join(cfg["deploy_dir"], "logs", "keeper.out")))
    return p.pid
