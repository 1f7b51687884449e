"""The /health watcher of nginx mode: open-source nginx has no active health checks, so this polls each
backend's /health, marks the failing ones `down` in the upstream file and reloads nginx (SIGHUP to its
master), and undoes it when they recover. Without it nginx would keep sending requests to an instance
whose engine died (vLLM answers 500 then, which nginx's passive checks do not count as a failure).
"""
from __future__ import annotations

import logging
import os
import signal
import threading

from . import apikeys, logfiles, nginx_front, upstream

log = logging.getLogger("hostagent.watch")


def step(cfg: dict) -> tuple[set[str], bool]:
    """One round: check every backend, rewrite the upstream file, reload nginx when it changed.
    Returns (the backends down, whether nginx was reloaded)."""
    down = nginx_front.check_health(cfg)
    try:
        keys_changed = nginx_front.write_keys(cfg)
        if keys_changed:
            log.warning("api_keys_file changed: nginx's keys rewritten")
    except apikeys.KeysError as e:     # nginx keeps the keys it has: never open the door for a bad file
        keys_changed = False
        log.error("%s nginx keeps the keys it had.", e)
    try:
        with open(cfg["upstream_file"]) as f:
            before = upstream.parse_down(f.read())
    except OSError:
        before = None
    if not nginx_front.write_upstream(cfg, down) and not keys_changed:
        return down, False
    pid = nginx_front.nginx_pid(cfg)
    if before is not None:
        for b in sorted(down - before):
            log.warning("%s: /health failed, marked down", b)
        for b in sorted(before - down):
            log.warning("%s: /health answers 200 again, back in the upstream", b)
    if len(down) == len(cfg["backends"]):
        log.warning("every backend fails /health: nginx answers 502 until one recovers")
    if pid:
        os.kill(pid, signal.SIGHUP)
        log.info("nginx pid %d reloaded (down: %s)", pid, ", ".join(sorted(down)) or "none")
        return down, True
    log.info("nginx is not running: upstream file written, nothing to reload")
    return down, False


def rotate_access_log(cfg: dict) -> bool:
    """Rotate nginx's access log like the proxy's results log (max_mb x backups; the seed's unrotated
    log reached 769 MB): rename .N-1 -> .N ... -> .1, then SIGUSR1 makes nginx reopen its logs."""
    path = cfg.get("access_log")
    if not path:
        return False
    try:
        if os.path.getsize(path) < float(cfg["access_log_max_mb"]) * 1024 * 1024:
            return False
    except OSError:
        return False
    pid = nginx_front.nginx_pid(cfg)
    backups = int(cfg["access_log_backups"])
    for k in range(backups - 1, 0, -1):
        if os.path.exists(f"{path}.{k}"):
            os.replace(f"{path}.{k}", f"{path}.{k + 1}")
    os.replace(path, f"{path}.1")
    os.close(logfiles.open_fd(path))   # made 0600 here: one nginx makes at its reopen would be 0644
    if pid:
        os.kill(pid, signal.SIGUSR1)   # nginx: reopen log files
    log.info("access log rotated to %s.1 (kept %d)", path, backups)
    return True


def run(cfg: dict) -> None:
    """Poll until SIGTERM or SIGINT; the handlers only set a flag."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("watching %s of %s every %ss", cfg["health_path"], ", ".join(cfg["backends"]), cfg["interval_s"])
    while not stop.is_set():
        try:
            step(cfg)
            rotate_access_log(cfg)
        except OSError as e:            # a full disk, a vanished deploy_dir: say so, keep watching
            log.error("round failed: %s", e)
        stop.wait(float(cfg["interval_s"]))
    log.info("stopped")
