"""Helpers for tests that deploy real (simulated) clusters through the real `inv` command line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

from conftest import PYTHON, ROOT, free_ports


def write_inventory(tmp_path: Path, name: str = "t", instances: int = 4, max_num_seqs: int = 4,
                    extra: str = "", sim: str = "{load_s: 0.3, prefill_ms: 20, token_ms: 5}") -> Path:
    """An inventory with one local sim host whose ports are free and whose deploy_dir is in tmp_path."""
    base = free_ports(instances + 2)
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


def inv(*args, inventory: Path | None = None, timeout: float = 180, check: bool = False):
    """Run `inv ARGS -i INVENTORY` from the project root; returns the CompletedProcess."""
    argv = [PYTHON, "-m", "invoke", *args]
    if inventory is not None:
        argv += ["--inventory", str(inventory)]
    env = {k: v for k, v in os.environ.items() if k != "FLEET_TAG"}
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"inv {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


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


def status_json(inventory: Path, *args: str, host: str = "t") -> dict:
    """The host's object from `inv status --json` (args: more options, such as --set)."""
    r = inv("status", "--host", host, "--json", *args, inventory=inventory)
    return json.loads(r.stdout)[0]


def deployment_id(inventory: Path, host: str = "t") -> str:
    from fleet import inventory as inv_mod
    return inv_mod.load(inventory).host_vars(host).deployment_id
