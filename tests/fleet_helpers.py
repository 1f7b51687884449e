"""Helpers for tests that deploy real (simulated) clusters through the real `inv` command line."""
from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import urllib.request
import warnings
from pathlib import Path

from conftest import PYTHON, ROOT, free_ports


def write_inventory(tmp_path: Path, name: str = "t", instances: int = 4, max_num_seqs: int = 4,
                    extra: str = "", sim: str = "{load_s: 0.3, prefill_ms: 20, token_ms: 5}") -> Path:
    """An inventory with one local sim host whose ports are free and whose deploy_dir is in tmp_path."""
    base = free_ports(instances + 3)      # the instances, the proxy's two ports, the keeper's metrics
    text = textwrap.dedent(f"""\
        hosts:
          {name}:
            connection: local
            engine: sim
            accelerator: sim
            accelerators: {instances}
            instances: {instances}
            max_num_seqs: {max_num_seqs}
            base_port: {base}
            model: /models/Test-Model
            deploy_dir: {tmp_path / 'deploy'}
            stagger_s: 0
            health_timeout_s: 60
            stop_grace_s: 3
            sim: {sim}
            proxy:
              port: {base + instances}
              admin_port: {base + instances + 1}
              health_interval_s: 0.5
        """) + textwrap.indent(textwrap.dedent(extra), "    ")
    path = tmp_path / "hosts.yml"
    path.write_text(text)
    return path


class InvResult:
    """What a run of `inv` gave: the shape of subprocess.CompletedProcess (args, returncode, stdout, stderr)."""

    def __init__(self, args, returncode: int, stdout: str, stderr: str):
        self.args, self.returncode, self.stdout, self.stderr = args, returncode, stdout, stderr

    def __repr__(self):
        return f"InvResult(args={self.args!r}, returncode={self.returncode})"


def inv_argv(args, inventory: Path | None = None) -> list[str]:
    """The argv of `inv ARGS [--inventory INVENTORY]` as a process of its own."""
    return [PYTHON, "-m", "invoke", *map(str, args), *(["--inventory", str(inventory)] if inventory else [])]


def inv_env(env: dict | None = None) -> dict:
    """inv's environment: the test's own without FLEET_TAG (a deployed process's tag must not leak into
    what inv starts), plus env."""
    return {**{k: v for k, v in os.environ.items() if k != "FLEET_TAG"}, **(env or {})}


def inv(*args, inventory: Path | None = None, timeout: float = 180, check: bool = False,
        env: dict | None = None, process: bool = False):
    """Run `inv ARGS [--inventory INVENTORY]` from the project root; returns returncode, stdout, stderr.

    In this process by default (invoke's own Program on the project's tasks: the same parsing, output and
    exit code, without a second of imports per run); process=True runs a real `python -m invoke` (for
    what only a process of its own shows: its signals, its pid, its output as a pipe). env: variables set
    for the run. timeout bounds a process; an in-process run is bounded by the test's own timeout."""
    if process:
        r = subprocess.run(inv_argv(args, inventory), cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout, env=inv_env(env))
        result = InvResult(r.args, r.returncode, r.stdout, r.stderr)
    else:
        result = _inv_here([*map(str, args), *(["--inventory", str(inventory)] if inventory else [])], env)
    if check and result.returncode != 0:
        raise AssertionError(f"inv {' '.join(map(str, args))} exited {result.returncode}\n{result.stdout}\n"
                             f"{result.stderr}")
    return result


def start_inv(*args, inventory: Path | None = None, env: dict | None = None, **popen) -> subprocess.Popen:
    """`inv ARGS` as a process of its own, started and left running (its output piped, text): for a test
    that signals it, reads its output as it comes or runs several at once. popen: more Popen arguments."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(inv_argv(args, inventory), cwd=ROOT, env=inv_env(env), **popen)


class _LastResort(logging.Handler):
    """Python's last-resort logging in a process of its own: WARNING and above to standard error when no
    handler of the program's own takes the record (pytest's capturing handlers do not count)."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record):
        logger = logging.getLogger(record.name)
        while logger:
            if any(h is not self and not type(h).__module__.startswith("_pytest") for h in logger.handlers):
                return
            logger = logger.parent if logger.propagate else None
        sys.stderr.write(self.format(record) + "\n")


def _put_back_environ(saved: dict) -> None:
    """Make os.environ what it was, changing only the variables that differ. Not clear() then update():
    each setenv may move the C environment, and a thread of the test that starts a process meanwhile
    (CPython starts it with vfork, sharing this memory) would exec with a moved or empty one (OSError
    EFAULT, "Bad address", seen from a sampler thread while an in-process deploy ended)."""
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _inv_here(argv: list[str], env: dict | None) -> InvResult:
    """Run invoke's Program on the project's tasks in this process, as `python -m invoke ARGV` would run
    from the project root: its output captured, its exit code returned, what it changes in this process
    (environment, directory, signal handlers, logging, fleet's Ctrl-C level) put back."""
    from invoke import Collection, Program, __version__

    class ProjectProgram(Program):
        def load_collection(self):
            # What invoke's loader does with the tasks.py it finds from the root, by import: the module is
            # loaded once for the whole test session, wherever its tasks live.
            if str(ROOT) not in sys.path:
                sys.path.insert(0, str(ROOT))
            self.config.set_project_location(str(ROOT))
            self.config.load_project()
            tasks = Collection.from_module(importlib.import_module("tasks"), loaded_from=str(ROOT),
                                           auto_dash_names=self.config.tasks.auto_dash_names)
            # A copy: parsing takes each argument's help out of its task (invoke pops it from task.help).
            self.collection = copy.deepcopy(tasks)

    out, err = io.StringIO(), io.StringIO()
    saved_env, cwd = dict(os.environ), os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)}
    saved_hook = threading.excepthook
    last_resort = _LastResort()
    os.environ.pop("FLEET_TAG", None)
    os.environ.update(env or {})
    os.chdir(ROOT)
    threading.excepthook = threading.__excepthook__     # a thread's traceback goes to stderr, as in a process
    logging.getLogger().addHandler(last_resort)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()                 # a fresh interpreter's filters: only __main__'s show
            for action, category in (("default", DeprecationWarning), ("ignore", DeprecationWarning),
                                     ("ignore", PendingDeprecationWarning), ("ignore", ImportWarning),
                                     ("ignore", ResourceWarning)):
                warnings.filterwarnings(action, category=category, append=True,
                                        module="__main__" if action == "default" else "")
            try:
                ProjectProgram(name="Invoke", binary="inv[oke]", version=__version__).run(
                    ["inv", *argv], exit=True)
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                    code = 1
                else:
                    code = e.code or 0
            except Exception:            # as an uncaught exception ends a process: its traceback, exit 1
                traceback.print_exc()
                code = 1
    finally:
        logging.getLogger().removeHandler(last_resort)
        threading.excepthook = saved_hook
        os.chdir(cwd)
        _put_back_environ(saved_env)
        for s, handler in saved_signals.items():
            signal.signal(s, handler)
        _reset_interrupt()
    return InvResult(["inv", *argv], code, out.getvalue(), err.getvalue())


def _reset_interrupt() -> None:
    """Put fleet's Ctrl-C state (the INTERRUPT object of the module that holds it) back to level 0, as a
    new process would start: the next run in this process must not see the last one's interrupt."""
    for name, module in list(sys.modules.items()):
        interrupt = getattr(module, "INTERRUPT", None) if name.split(".")[0] == "fleet" else None
        if interrupt is not None and hasattr(interrupt, "level"):
            interrupt.level = 0


def tagged_pids(prefix: str) -> list[int]:
    """Pids of this user's processes carrying FLEET_TAG=<prefix>..."""
    found = []
    needle = f"FLEET_TAG={prefix}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != os.getuid():
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if any(e.startswith(needle) for e in f.read().split(b"\0")):
                    found.append(int(name))
        except OSError:
            continue
    return found


def session_members(sids) -> list[int]:
    """Pids of the live processes in the given sessions (an instance leads one: renamed or reparented,
    its processes stay in it), whatever their tag or title."""
    sids, found = set(sids), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[3]) in sids:
            found.append(int(name))
    return found


def kill_tagged(prefix: str) -> None:
    """Test cleanup: kill what a test's deployment started, found by its tag (never by name)."""
    for pid in tagged_pids(prefix):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while tagged_pids(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_by_own_scripts(inventory: Path, hosts: list[str] | None = None) -> None:
    """Test cleanup: run each host's own bin/stop_cluster.sh (the deployment's stop by pid-file record,
    session and tag: hostagent/processes.py) on this machine, every host at once, then the sweep by tag.
    For hosts whose deploy_dir is on this machine (SSH and namespace hosts in tests): no SSH round, drain or
    card wait just to end a test; the tests of `inv stop` itself keep those."""
    import yaml

    from hostagent import layout

    from fleet.settings import inventory as inv_mod
    loaded = inv_mod.load(inventory)
    names = hosts if hosts is not None else list(yaml.safe_load(Path(inventory).read_text())["hosts"])
    stops = []
    for name in names:
        script = Path(loaded.host_vars(name).settings.deploy_dir) / layout.STOP_CLUSTER
        if script.exists():
            stops.append(subprocess.Popen(["bash", str(script)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
    for stop in stops:
        stop.wait(timeout=120)
    for name in names:
        kill_tagged(loaded.host_vars(name).deployment_id + "/")


def status_json(inventory: Path, *args: str, host: str = "t") -> dict:
    """The host's object from `inv status --json` (args: more options, such as --set)."""
    r = inv("status", "--host", host, "--json", *args, inventory=inventory)
    return json.loads(r.stdout)[0]


def deployment_id(inventory: Path, host: str = "t") -> str:
    from fleet.settings import inventory as inv_mod
    return inv_mod.load(inventory).host_vars(host).deployment_id


def load(port: int, stop: threading.Event, seconds: float = 120) -> None:
    """Chat requests to the proxy until stop is set (at most `seconds`), streamed and not, 127.0.0.1 only."""
    deadline = time.monotonic() + seconds
    body = {"model": "Test-Model", "max_tokens": 8, "messages": [{"role": "user", "content": "hello " * 40}]}
    n = 0
    while not stop.is_set() and time.monotonic() < deadline:
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        data = json.dumps(streamed if n % 2 == 0 else body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        except OSError:
            time.sleep(0.05)
        n += 1


def deploy_sim_cluster(tmp_path, instances: int = 2, queue_max: int | None = None,
                       sim: str = "{load_s: 0.2, prefill_ms: 20, token_ms: 4, output_tokens: 8}"):
    """A local sim cluster through `inv deploy` (on ports of this xdist worker's slice: conftest.free_ports):
    its inventory and host variables. queue_max: the proxy's proxy.queue.max. A deploy that fails
    leaves nothing running."""
    from fleet.settings import inventory as inv_mod
    path = write_inventory(tmp_path, instances=instances, sim=sim)
    if queue_max is not None:
        interval = "      health_interval_s: 0.5\n"
        path.write_text(path.read_text().replace(interval, interval + f"      queue: {{max: {queue_max}}}\n"))
    r = inv("deploy", "--host", "t", inventory=path)
    if r.returncode != 0:
        inv("stop", "--host", "t", inventory=path)
        kill_tagged(deployment_id(path) + "/")
    assert r.returncode == 0, r.stdout + r.stderr
    return path, inv_mod.load(path).host_vars("t")
