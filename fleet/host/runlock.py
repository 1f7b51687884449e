"""One run at a time per deployment: deploy, stop, restart and the swaps hold `deploy_dir/run/fleet.lock`.

The lock is a flock on the host, held by a small process there (hostagent/lock.py, sent with the
command, so it works where nothing is deployed yet) that keeps it while its standard input stays open.
The run closes that input when it ends; if the run dies, the pipe or the SSH channel closes, and the
kernel drops the lock with the process. A second run fails at once naming the holder, or waits (--wait).
"""
from __future__ import annotations

import getpass
import json
import os
import shlex
import socket
import threading
from contextlib import contextmanager, nullcontext
from typing import Callable

from fleet.errors import FleetError, RemoteError
from fleet.host import preflight
from fleet.transport import agent

# Runs of this process already holding a deployment's lock: a restart's stop does not lock twice.
_held: dict[tuple[int, str], int] = {}
_guard = threading.Lock()


class LockedError(FleetError):
    """Another run holds the deployment's lock."""


def describe(holder: dict | None) -> str:
    """`inv deploy by alice@ctl (lock holder pid 123 on the host) since 2026-12-03 12:01:02 UTC`."""
    if not holder:
        return "another run"
    pid = f" (lock holder pid {holder['pid']} on the host)" if holder.get("pid") else ""
    return f"{holder.get('what') or 'another run'}{pid} since {holder.get('since') or 'an unknown time'}"


def what(step: str) -> str:
    """How this run is named in the lock file: the command, the user, the machine and its pid."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"inv {step} by {user}@{socket.gethostname()} (pid {os.getpid()})"


def held_unless(check: bool, conn, hv, step: str, emit: Callable[[str], None] = lambda line: None,
                 wait: bool = False, needs: bool = False):
    """held(...), except for a --check run, which changes nothing and takes no lock."""
    return nullcontext() if check else held(conn, hv, step, emit, wait, needs)


@contextmanager
def held(conn, hv, step: str, emit: Callable[[str], None] = lambda line: None, wait: bool = False,
         needs: bool = False):
    """Hold the deployment's lock for the block (hv prepared: deploy_dir absolute). needs: the holder first
    checks what step needs on the host (fleet.host.preflight), and a host that lacks something fails in one
    sentence naming it all, before the lock is taken (nothing created)."""
    d = hv.settings.deploy_dir
    key = (id(conn), d)
    with _guard:
        if key in _held:
            _held[key] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield
        finally:
            with _guard:
                _held[key] -= 1
        return
    running = agent.start_module(conn, hv, "lock", f"hold {shlex.quote(d)} --what {shlex.quote(what(step))}"
                                 + (" --wait" if wait else ""), preflight.prelude(hv, step) if needs else "")
    missing: list[str] = []
    try:
        while True:
            line = running.readline(timeout=None if wait else 60)
            if line is None:
                status = running.close(5)
                err = running.stderr()
                why = (err.strip().splitlines() or ["no output"])[-1]
                if status == preflight.NEEDS_EXIT and missing:
                    preflight.judge(hv, step, missing)
                failed_setup = agent.env_setup_failure(hv, err)
                if failed_setup:
                    raise RemoteError(failed_setup)
                if status == 2:    # the holder could not create or open the file: deploy_dir is not writable
                    raise RemoteError(f"{hv.name}: {why}: deploy_dir {d} must be a directory this user can "
                                      "write; fix its permissions, or set deploy_dir to one you own.")
                raise RemoteError(f"{hv.name}: taking the lock {d}/run/fleet.lock failed (exit {status}): {why}")
            if line.startswith(preflight.NEEDS):
                missing.append(line[len(preflight.NEEDS):])
            if not line.startswith("FLEET_LOCK "):
                continue
            msg = json.loads(line[len("FLEET_LOCK "):])
            if msg["state"] == "locked":
                break
            if msg["state"] == "waiting":
                emit(f"lock: {d} is held by {describe(msg['holder'])}; waiting for it (--wait)")
            elif msg["state"] == "held":
                raise LockedError(f"{hv.name}: another run holds {d}/run/fleet.lock: {describe(msg['holder'])}; "
                                  "wait for it to end, or run again with --wait.")
    except BaseException:
        running.close(5)
        raise
    with _guard:
        _held[key] = 1
    try:
        yield
    finally:
        with _guard:
            del _held[key]
        running.close()
