"""Shared fixtures: free loopback ports, readiness polls, and processes that are always stopped."""
from __future__ import annotations

import atexit
import collections
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# The suite runs as root, and a deploy installs a boot hook in the user's crontab: no test's deploy may
# leave a line there. The boot hook's own tests (tests/test_boot.py) set it back to auto, and remove
# exactly their lines.
os.environ["FLEET_BOOT_HOOK"] = "off"
_rng = random.Random()   # seeded from the OS: concurrent runs pick different ports
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=1024)   # the last ports free_ports handed out


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports (instances use base_port + i).

    Picked below the kernel's ephemeral range: a port the kernel hands out with bind(0) is also what it
    gives the next outgoing connection, so under load a client socket could take it before the server
    that was meant to listen there (seen as 'address already in use' when several suites share a machine).
    """
    lo, _ = _ephemeral_range()
    top = lo if lo > 12000 else 65535
    bottom = 10000
    # Under pytest-xdist each worker picks in its own slice: a port one worker found free is not then taken
    # by a server another worker starts before this one binds it.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0")[2:] or 0)
    if workers > 1:
        size = (top - bottom) // workers
        bottom, top = bottom + worker * size, bottom + (worker + 1) * size
    for _ in range(500):
        base = _rng.randrange(bottom, top - n)
        run = range(base, base + n)
        # Nothing listens on a port handed out a moment ago until its test starts the server: two hosts of
        # one inventory got overlapping runs once (the inventory refused them, as it should).
        if not set(run).intersection(_HANDED_OUT) and all(_bindable(p) for p in run):
            _HANDED_OUT.extend(run)
            return base
    raise RuntimeError(f"no run of {n} free ports found")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (outside the ephemeral range)."""
    return free_ports(1)


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


TIERS = ("unit", "process", "cluster", "ssh", "nginx", "real_engine", "netns")   # registered in pyproject.toml


def pytest_collection_modifyitems(config, items):
    """Every test says what it needs (a tier marker, docs/testing.md): one without is a collection error,
    so `pytest -m unit` can never quietly pick up a test that deploys a cluster."""
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if unmarked:
        raise pytest.UsageError("these tests have no tier marker (" + ", ".join(TIERS) + "):\n  "
                                + "\n  ".join(unmarked))
    if getattr(config.option, "loadgroup", False):   # an xdist worker under --dist loadgroup
        items.sort(key=_slowest_first)


# The groups that bound the suite's time, longest first. Under `--dist loadgroup --no-loadscope-reorder`
# (scripts/test.sh) xdist hands out groups in collection order, so these start at once, each on its own
# worker, and everything else fills the workers around them; a group started last would end last.
SLOWEST_GROUPS = ("real_engine", "real_engine_models", "netns", "netns_join", "load")


def _slowest_first(item) -> int:
    group = item.get_closest_marker("xdist_group")
    name = (group.args[0] if group.args else group.kwargs.get("name")) if group else None
    return SLOWEST_GROUPS.index(name) if name in SLOWEST_GROUPS else len(SLOWEST_GROUPS)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Under `--dist loadgroup` a worker names each grouped test `ID@GROUP` (how xdist keeps a group on one
    worker): a pytest whose ids xdist cannot rename would spread the real engine's tests over every worker,
    each deploying its own cluster, so say it rather than run so."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    ignored = [item.nodeid for item in session.items
               if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rsplit("]", 1)[-1]]
    if ignored:
        raise pytest.UsageError(f"--dist loadgroup: pytest {pytest.__version__} with this pytest-xdist ignores "
                                f"the xdist_group marks ({ignored[0]}, ...); install the versions pyproject.toml "
                                "names (./scripts/setup.sh test).")


@pytest.fixture
def procs():
    ps = Processes()
    yield ps
    ps.stop_all()


@pytest.fixture
def short_dir():
    """A directory of its own with a short path, removed at the end: a deploy_dir for an engine-vllm host
    whose doctor must pass. tmp_path's can pass 62 bytes, too long for vLLM's IPC sockets under it (the
    doctor fails such a deploy_dir: docs/host.md)."""
    d = Path(tempfile.mkdtemp(prefix="vf-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sim_cluster(tmp_path):
    """deploy(**kw): a local sim cluster through `inv deploy` (fleet_helpers.deploy_sim_cluster), its
    inventory and host variables; stopped (and its tagged processes killed) at the end."""
    from fleet_helpers import deploy_sim_cluster, deployment_id, inv, kill_tagged
    made = []

    def deploy(**kw):
        path, hv = deploy_sim_cluster(tmp_path, **kw)
        made.append(path)
        return path, hv
    yield deploy
    for path in made:
        inv("stop", "--host", "t", inventory=path)
        kill_tagged(deployment_id(path) + "/")


# FLEET_TEST_TIMELINE=FILE: each test appends "WORKER START END CPU NODEID" to FILE: its wall time (setup to
# teardown, epoch seconds) and the CPU seconds it cost, counted by a cpuacct cgroup (cgroup v1, as root) that
# the worker and every process it starts (servers, sshd and what runs under it, vLLM) belong to; "-" when
# no such cgroup can be made. Which worker ends last, what it ran, what costs the cores: docs/testing.md.
_TIMELINE = os.environ.get("FLEET_TEST_TIMELINE")


def _cpu_meter():
    """A function returning the CPU seconds this worker's process tree has used, or None."""
    group = Path(f"/sys/fs/cgroup/cpuacct/fleet-test-{os.getpid()}")
    for old in group.parent.glob("fleet-test-*"):     # an earlier run's, left while a child of it lived on
        if not Path(f"/proc/{old.name.rsplit('-', 1)[1]}").exists():
            try:
                old.rmdir()
            except OSError:                           # a process is still in it
                pass
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        usage = group / "cpuacct.usage"
    except OSError:
        return lambda: None

    def leave():   # back to the root group, and the group goes once its last process has
        try:
            (group.parent / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()
        except OSError:
            pass
    atexit.register(leave)
    return lambda: int(usage.read_text()) / 1e9


if _TIMELINE:
    _cpu_used = _cpu_meter()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start, cpu = time.time(), _cpu_used()
        yield
        spent = _cpu_used()
        spent = f"{spent - cpu:.2f}" if spent is not None and cpu is not None else "-"
        with open(_TIMELINE, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'gw0')} {start:.2f} {time.time():.2f} {spent} "
                    f"{item.nodeid}\n")
