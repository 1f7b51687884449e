"""start_cluster.sh's environment overrides cannot split the brain: refused while the keeper runs (which,
with the proxy, follows the inventory), never taken by deploy or the keeper from their environment."""
from __future__ import annotations

import os
import subprocess

import pytest

from conftest import wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory

pytestmark = pytest.mark.cluster


def _script(deploy, env: dict, *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "FLEET_TAG"}
    return subprocess.run([str(deploy / "bin" / "start_cluster.sh"), *args], capture_output=True, text=True,
                          timeout=120, env={**clean, **env})


def _engine_argv(deploy, i: int) -> list[str]:
    rec = dict(f.split("=", 1) for f in (deploy / "run" / f"instance_{i}.pid").read_text().split() if "=" in f)
    return (open(f"/proc/{rec['pid']}/cmdline", "rb").read().decode().split("\0"))


def test_overrides_are_refused_while_the_keeper_runs_and_never_reach_deploy(tmp_path):
    """1. deploy one sim instance with max_num_seqs 4: the keeper runs;
    2. `MAX_SEQS=1 bin/start_cluster.sh` exits 5 with one sentence naming the override and the keeper, and
       how to debug (stop the keeper first, or change the inventory); instance 0 is untouched;
    3. instance 0 stopped, `inv deploy` run with MAX_SEQS=1 N=0 in its environment starts it with the
       inventory's values (--max-num-seqs 4): deploy does not pass them on;
    4. with the keeper stopped (bin/stop_cluster.sh --keeper), the same override runs (the instance's port
       listens, so it is skipped, exit 0);
    5. instance 0 stopped and started by hand with MAX_SEQS=1: status marks it stale ("MAX_SEQS=1 set by
       hand"), and `inv deploy` rolls it back to the inventory's 4."""
    inventory = write_inventory(tmp_path, instances=1)
    deploy = tmp_path / "deploy"
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        keeper = status_json(inventory)["keeper"]
        assert keeper["state"] == "running" and keeper["pid"], keeper
        before = (deploy / "run" / "instance_0.pid").read_text()

        r = _script(deploy, {"MAX_SEQS": "1"})
        assert r.returncode == 5, r.stdout + r.stderr
        assert r.stderr == (f"MAX_SEQS=1 refused: this deployment's keeper (pid {keeper['pid']}) runs, and it and "
                            "the proxy follow the inventory, not the environment. To debug with it, stop the "
                            "keeper first (./bin/stop_cluster.sh --keeper); to keep it, change the inventory and "
                            "run inv deploy.\n")
        assert r.stdout == "" and (deploy / "run" / "instance_0.pid").read_text() == before

        stop = subprocess.run([str(deploy / "bin" / "stop_cluster.sh"), "--instance", "0"], capture_output=True,
                              text=True, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        r = inv("deploy", "--host", "t", inventory=inventory, env={"MAX_SEQS": "1", "N": "0"})
        assert r.returncode == 0, r.stdout + r.stderr
        argv = _engine_argv(deploy, 0)
        assert argv[argv.index("--max-num-seqs") + 1] == "4", argv

        stop = subprocess.run([str(deploy / "bin" / "stop_cluster.sh"), "--keeper"], capture_output=True,
                              text=True, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        wait_until(lambda: status_json(inventory)["keeper"]["state"] != "running", timeout=30,
                   what="the keeper stopped")
        r = _script(deploy, {"MAX_SEQS": "1"})
        assert r.returncode == 0 and "instance 0: port" in r.stdout and "skipped" in r.stdout, r.stdout + r.stderr

        stop = subprocess.run([str(deploy / "bin" / "stop_cluster.sh"), "--instance", "0"], capture_output=True,
                              text=True, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        r = _script(deploy, {"MAX_SEQS": "1"})
        assert r.returncode == 0 and "instance 0: started" in r.stdout, r.stdout + r.stderr
        wait_until(lambda: status_json(inventory)["instances"][0]["state"] == "healthy", what="instance 0 healthy")
        inst = status_json(inventory)["instances"][0]
        assert inst["launch"] == "stale" and inst["stale_settings"] == ["MAX_SEQS=1 set by hand"], inst
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0 and "instance 0: rolling (MAX_SEQS=1 set by hand)" in r.stdout, r.stdout
        argv = _engine_argv(deploy, 0)
        assert argv[argv.index("--max-num-seqs") + 1] == "4", argv
        assert status_json(inventory)["instances"][0]["launch"] == "current"
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(deployment_id(inventory) + "/")
