"""A failing env_setup stops what comes after it: the start scripts, the host code run after it, deploy."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from fleet_helpers import inv, write_inventory

pytestmark = pytest.mark.process

FAILING = "env_setup: echo loading the DTK; source /nonexistent/dtk/env.sh"


def _kill_recorded(deploy: os.PathLike) -> None:
    """Stop what a start script recorded despite everything (the code before the fix starts the engines),
    by the process group its pid file names."""
    run = os.path.join(deploy, "run")
    for name in os.listdir(run) if os.path.isdir(run) else []:
        if name.endswith(".pid"):
            fields = dict(f.split("=", 1) for f in open(os.path.join(run, name)).read().split() if "=" in f)
            try:
                os.killpg(int(fields.get("pgid", fields["pid"])), signal.SIGKILL)
            except (ProcessLookupError, KeyError, ValueError):
                pass


def test_a_failing_env_setup_stops_the_start_scripts_the_doctor_and_deploy(tmp_path):
    """1. a sim host whose env_setup prints a line and then sources a file that is not there (exit 1);
    2. bin/start_cluster.sh, run by hand, exits 1 with env_setup's status and last lines, and starts no
       instance (no pid file); so does bin/start_proxy.sh;
    3. inv doctor and inv deploy name env_setup's exit status and its last line, and deploy starts nothing."""
    inventory = write_inventory(tmp_path, instances=1, extra=FAILING)
    deploy = tmp_path / "deploy"
    out = tmp_path / "rendered"
    assert inv("render", "--host", "t", "--out", out, inventory=inventory).returncode == 0
    try:
        for script, pidfile in (("start_cluster.sh", "instance_0.pid"), ("start_proxy.sh", "proxy.pid")):
            r = subprocess.run(["bash", str(out / "bin" / script)], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "STAGGER_S": "0"})
            assert r.returncode == 1, (script, r.stdout, r.stderr)
            assert "env_setup failed (exit 1); its last lines:\n    loading the DTK\n" in r.stderr, r.stderr
            assert "/nonexistent/dtk/env.sh: No such file or directory" in r.stderr, r.stderr
            assert not (deploy / "run" / pidfile).exists(), script
            assert not list((deploy / "run").glob("env_setup.*")), "the kept-aside output is removed"
    finally:
        _kill_recorded(deploy)

    r = inv("doctor", "--host", "t", inventory=inventory)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "env_setup exited 1 on the host (its last lines: loading the DTK | " in r.stdout + r.stderr, \
        r.stdout + r.stderr
    r = inv("deploy", "--host", "t", inventory=inventory)
    assert r.returncode == 2 and "env_setup exited 1 on the host" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (deploy / "run" / "instance_0.pid").exists()
