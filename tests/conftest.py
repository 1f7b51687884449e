"""Shared fixtures: free loopback ports, readiness polls, and processes that are always stopped."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports (instances use base_port + i)."""
    for _ in range(200):
        base = free_port()
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no run of {n} free ports found")


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll predicate until it returns a truthy value; fail the test naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def require_tool(name: str) -> str:
    """The path of a system tool; skip without it, except in CI where a missing tool is a failure."""
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None)
    if path:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(f"{name} is not installed; .ci/run must install it")
    pytest.skip(f"{name} is not installed")


class Processes:
    """Starts processes in their own session and stops every one of them (by process group) at teardown."""

    def __init__(self):
        self.started: list[subprocess.Popen] = []

    def start(self, argv, **kw) -> subprocess.Popen:
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(argv, **kw)
        self.started.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        """Stop one of them (its process group) now, and forget it."""
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 2)):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                pass
        self.started.remove(p)

    def stop_all(self):
        for p in self.started:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in self.started:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs():
    ps = Processes()
    yield ps
    ps.stop_all()
