"""The deployment's own parts on this host as processes (proxy, nginx, the watcher, the keeper): which runs
now (its pid file, identity-checked), the environment that tags one started, and the stop of its group."""
from __future__ import annotations

import os
import signal
import time

from . import layout, processes
from .config import at

alive = processes.alive


def ours(cfg: dict, pidfile: str, what: str):
    """The live process the pid file records (a layout path), when it still is the deployment's `what`
    (its record's start time and tag); None otherwise: a stale pid file is never acted on."""
    return processes.verified(at(cfg, pidfile), layout.tag(cfg["deployment_id"], what))


def proxy_pid(cfg: dict) -> tuple[int | None, int | None]:
    p = ours(cfg, layout.PROXY_PID, "proxy")
    return (p.pid, p.pgid) if p else (None, None)


def tagged_env(cfg: dict, what: str) -> dict:
    return {**os.environ, layout.TAG_VAR: layout.tag(cfg["deployment_id"], what)}


def signal_group(pgid: int | None, pid: int, sig) -> None:
    """Signal pid's process group when pid leads it (never group 0 or 1, nor this process's own),
    else pid alone."""
    if pgid == pid and pgid not in processes.PROTECTED and pgid != os.getpgid(0):
        os.killpg(pgid, sig)
    elif pid not in processes.PROTECTED:
        os.kill(pid, sig)


def stop_group(pgid: int | None, pid: int | None, grace_s: float, sig=signal.SIGTERM) -> bool:
    """Signal a process group (see signal_group), wait up to grace_s for pid to go, then SIGKILL the group.
    True when it went within the grace period."""
    if not pgid or not alive(pid):
        return True
    try:
        signal_group(pgid, pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if alive(pid):
        try:
            signal_group(pgid, pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return False
    return True
