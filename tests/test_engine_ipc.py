"""The engines' ZMQ IPC sockets live in deploy_dir/run/ipc (VLLM_RPC_BASE_PATH, 0700), not the world's /tmp:
every instance start sets it, a whole stop removes the directory, and the doctor checks that vLLM's socket
paths (the directory, `/`, a uuid4) fit the 107 bytes of a Unix socket path."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, free_ports, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, tagged_pids

from hostagent import layout

from fleet import render
from fleet.facts.doctor import ipc_check
from fleet.settings import inventory

# What a stray setting in env_setup (or the login environment) would say: the script's own value wins.
ENV_SETUP = "export VLLM_RPC_BASE_PATH=/tmp"


def write_vllm_inventory(tmp_path: Path, deploy_dir: Path, vllm_bin: Path) -> Path:
    """One local vllm host (1 instance on card 0), env_setup pointing vLLM's sockets at /tmp."""
    path = tmp_path / "hosts.yml"
    path.write_text(textwrap.dedent(f"""\
        hosts:
          t:
            connection: local
            engine: vllm
            vllm_bin: {vllm_bin}
            accelerator: nvidia
            accelerators: 1
            instances: 1
            base_port: {free_ports(1)}
            model: {tmp_path / 'model'}
            deploy_dir: {deploy_dir}
            stagger_s: 0
            stop_grace_s: 2
            env_setup: {ENV_SETUP}
        """))
    return path


@pytest.mark.unit
def test_every_instance_start_exports_the_deployments_ipc_directory_after_env_setup(tmp_path):
    """The rendered start_cluster.sh sets VLLM_RPC_BASE_PATH to deploy_dir/run/ipc after env_setup (whose
    own value it overrides) and before any instance starts, and makes that directory 0700."""
    hv = inventory.load(write_vllm_inventory(tmp_path, tmp_path / "deploy", tmp_path / "vllm")).host_vars("t")
    hv.settings.python = "python3"
    script = next(f.content for f in render.render_host(hv) if f.path == layout.START_CLUSTER)
    export = script.index(f'export VLLM_RPC_BASE_PATH="$DEPLOY_DIR/{layout.IPC_DIR}"\n')
    assert script.index(ENV_SETUP) < export < script.index("start_instance() {")
    sets = [line for line in script.splitlines() if "VLLM_RPC_BASE_PATH=" in line and not line.lstrip().startswith("'")]
    assert len(sets) == 2        # env_setup's, then ours (the launch record quotes env_setup): none after
    assert 'chmod 700 "$VLLM_RPC_BASE_PATH" || exit 1' in script[export:]


@pytest.mark.unit
@pytest.mark.parametrize("length, status", [(62, "ok"), (63, "fail")])
def test_the_doctor_fails_a_deploy_dir_too_long_for_vllms_socket_paths(tmp_path, length, status):
    """deploy_dir/run/ipc/<uuid4> holds 107 bytes at most: a 62-byte deploy_dir fits exactly, one byte more
    fails, and the fix names the longest deploy_dir that fits."""
    deploy_dir = ("/d" + "x" * length)[:length]
    hv = inventory.load(write_vllm_inventory(tmp_path, Path(deploy_dir), tmp_path / "vllm")).host_vars("t")
    assert layout.ipc_socket_bytes(deploy_dir) == length + 45
    check = ipc_check(hv)
    assert check.status == status, check.line()
    if status == "fail":
        assert "108 bytes, past the 107 a Unix socket path holds" in check.message
        assert check.fix == "set deploy_dir to a path of 62 bytes or fewer"


@pytest.mark.process
def test_an_instance_gets_its_ipc_directory_and_private_log_and_a_stop_removes_the_directory(tmp_path):
    """1. A stand-in engine (it prints VLLM_RPC_BASE_PATH and the mode of that directory, then waits);
       run/ipc left 0755 and the engine log and its .1 left 0644 by an earlier run; umask 022.
    2. bin/start_cluster.sh: the engine sees deploy_dir/run/ipc, not env_setup's /tmp, and that
       directory is 0700; the log and the two the start rotated are 0600, and the log says which it tightened.
    3. bin/stop_cluster.sh: the engine is gone, and so is run/ipc."""
    deploy = tmp_path / "deploy"
    engine = tmp_path / "vllm"
    engine.write_text('#!/bin/sh\necho "sockets in $VLLM_RPC_BASE_PATH, mode $(stat -c %a "$VLLM_RPC_BASE_PATH")"\n'
                      "exec sleep 60\n")
    engine.chmod(0o755)
    path = write_vllm_inventory(tmp_path, deploy, engine)
    dep = deployment_id(path)
    assert inv("render", "--host", "t", "--out", tmp_path / "out", inventory=path).returncode == 0
    shutil.copytree(ROOT / "hostagent", deploy / "hostagent")      # what deploy puts: the log writer, the stop
    (deploy / "run" / "ipc").mkdir(parents=True, mode=0o755)
    (deploy / "logs").mkdir()
    for name in ("vllm_0.log", "vllm_0.log.1"):
        (deploy / "logs" / name).write_text("an earlier run\n")
        (deploy / "logs" / name).chmod(0o644)
    loose = os.umask(0o022)
    try:
        r = subprocess.run(["bash", str(tmp_path / "out" / "bin" / "start_cluster.sh")], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        log = deploy / "logs" / "vllm_0.log"
        wait_until(lambda: log.exists() and "sockets in" in log.read_text(), what="the engine's first line")
        assert f"sockets in {deploy / 'run' / 'ipc'}, mode 700\n" in log.read_text()
        for name in (log, f"{log}.1"):     # tightened before the start rotated them to .1 and .2
            assert f"{name} was mode 0644, readable beyond its user: now 0600" in log.read_text()
        for p in (log, Path(f"{log}.1"), Path(f"{log}.2")):
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        r = subprocess.run(["bash", str(tmp_path / "out" / "bin" / "stop_cluster.sh")], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not tagged_pids(f"{dep}/0") and not (deploy / "run" / "ipc").exists()
    finally:
        os.umask(loose)
        kill_tagged(dep + "/")
