"""Only ours: through the real `inv` command line, every signal goes to a process proven the deployment's.
Real sim clusters, real strangers (same user), checked by pid."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import PYTHON, wait_until

from hostagent import processes
from hostagent.processes import parse_record

from fleet_helpers import deployment_id, inv, kill_tagged, start_inv, status_json, tagged_pids, write_inventory

pytestmark = pytest.mark.cluster


def leaders(dep: str, i: int) -> list[int]:
    """The session leaders carrying instance i's tag: one per running instance."""
    return [p for p in tagged_pids(f"{dep}/{i}") if (processes.read_proc(p) or processes.Proc()).sid == p]


def test_pid_file_naming_an_unrelated_group_leader(tmp_path, procs):
    """1. a 2-instance cluster; 2. run/instance_1.pid is replaced by `P P` naming an unrelated `setsid sleep`
    of the same user (a pid reused after a reboot, a file edited by mistake); 3. status does not call the
    stranger healthy; 4. `inv stop` says the file is stale and signals nothing of the stranger; 5. the real
    instance 1 is still stopped, found by its tag and its session."""
    inventory = write_inventory(tmp_path, instances=2)
    dep = deployment_id(inventory)
    stranger = procs.start(["sleep", "600"])
    try:
        inv("deploy", "--host", "t", inventory=inventory, check=True)
        real = status_json(inventory)["instances"][1]["pid"]
        pidfile = tmp_path / "deploy" / "run" / "instance_1.pid"
        pidfile.write_text(f"{stranger.pid} {stranger.pid}\n")
        st = status_json(inventory)
        assert st["instances"][1]["pid"] != stranger.pid and st["instances"][1]["state"] != "healthy", st
        # By hand on the host: the deployed wrapper runs the same code, and --check touches nothing.
        env = {k: v for k, v in os.environ.items() if k != "FLEET_TAG"}
        r = subprocess.run([str(tmp_path / "deploy" / "bin" / "stop_cluster.sh"), "--instance", "1", "--check"],
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"instance 1: pid file names pid {stranger.pid}, which does not carry" in r.stdout, r.stdout
        assert re.search(rf"^instance 1: would stop pid {real} \(", r.stdout, re.M), r.stdout
        assert pidfile.exists() and processes.alive(real)
        r = inv("stop", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (f"instance 1: pid file names pid {stranger.pid}, which does not carry the deployment's tag: "
                "not ours, not touched") in r.stdout, r.stdout
        assert stranger.poll() is None
        assert "instance 1" not in r.stderr, r.stderr         # a stale file is said, not a failure
        assert re.search(rf"^instance 1: stopping pid {real} \(.*\): FLEET_TAG={dep}/1$", r.stdout, re.M), r.stdout
        assert tagged_pids(dep + "/") == [] and not pidfile.exists()
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


def test_orphans_whose_tag_was_erased_are_found_by_session(tmp_path):
    """1. the engine of instance 0 leaves, in its session, a child without FLEET_TAG (as vLLM's EngineCore
    renamed by setproctitle); 2. its API server is SIGKILLed: the child is an orphan nothing tagged leads
    to; 3. `inv stop` finds it by the session the pid file recorded, and stops it."""
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text("#!/bin/bash\n"
                       'if [ "${2:-}" = fleet.sim ] && [ "${3:-}" = serve ]; then env -u FLEET_TAG sleep 600 & fi\n'
                       f'exec {PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    inventory = write_inventory(tmp_path, instances=2, extra=f"python: {wrapper}\n")
    dep = deployment_id(inventory)
    try:
        inv("deploy", "--host", "t", inventory=inventory, check=True)
        rec = parse_record((tmp_path / "deploy" / "run" / "instance_0.pid").read_bytes())
        assert rec["sid"] == rec["pid"] and rec["tag"] == f"{dep}/0" and rec["start"]
        erased = [p.pid for p in processes.snapshot().values()
                  if p.sid == rec["sid"] and p.tag is None and p.cmdline == "sleep 600"]
        assert len(erased) == 1
        os.kill(rec["pid"], signal.SIGKILL)
        wait_until(lambda: not processes.alive(rec["pid"]), what="the API server gone")
        assert processes.alive(erased[0])
        r = inv("stop", "--host", "t", "--instance", "0", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"instance 0: stopping pid {erased[0]} (sleep 600): session {rec['sid']} of instance 0" in r.stdout, \
            r.stdout
        wait_until(lambda: not processes.alive(erased[0]), timeout=5, what="the erased orphan stopped")
        assert tagged_pids(f"{dep}/0") == [] and len(leaders(dep, 1)) == 1
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


def test_non_utf8_pid_file_is_one_sentence_and_the_stop_finishes(tmp_path):
    inventory = write_inventory(tmp_path, instances=2)
    dep = deployment_id(inventory)
    try:
        inv("deploy", "--host", "t", inventory=inventory, check=True)
        (tmp_path / "deploy" / "run" / "instance_0.pid").write_bytes(b"\xff\xfe12\x00 34\n")
        r = inv("stop", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        about = [line for line in (r.stdout + r.stderr).splitlines() if "instance_0.pid" in line]
        assert about == ["instance 0: run/instance_0.pid holds bytes that are not UTF-8 text: not read; its "
                         "processes are looked for by tag"], r.stdout + r.stderr
        assert "Traceback" not in r.stderr and "UnicodeDecodeError" not in r.stdout + r.stderr
        assert tagged_pids(dep + "/") == []
        assert [i["state"] for i in status_json(inventory)["instances"]] == ["stopped", "stopped"]
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


def test_a_strangers_listener_on_an_instance_port(tmp_path, procs):
    """1. `python3 -m http.server` of the same user listens on instance 1's port, in a deploy_dir never
    deployed; 2. `inv deploy` refuses before starting anything, naming it; 3. `inv stop` names it and
    leaves it; 4. it survives both."""
    inventory = write_inventory(tmp_path, instances=2)
    dep = deployment_id(inventory)
    port = status_json(inventory)["instances"][1]["port"]
    server = procs.start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: processes.listeners([port]).get(port), what="http.server listening")
    sentence = (f"port {port} is held by pid {server.pid} ({sys.executable} -m http.server --bind 127.0.0.1 "
                f"{port}), which is not this deployment's; stop it yourself or change base_port")
    try:
        for doctor in ("--doctor", "--no-doctor"):     # the doctor's check, or deploy's own without it
            r = inv("deploy", "--host", "t", doctor, inventory=inventory)
            assert r.returncode == 2, r.stdout + r.stderr
            assert re.search(rf"^t: FAILED: (doctor )?port {port}( \(instance 1\))?: {re.escape(sentence)}$",
                             r.stderr, re.M), r.stderr
            assert tagged_pids(dep + "/") == [] and not list((tmp_path / "deploy").glob("run/*.pid"))
        r = inv("stop", "--host", "t", inventory=inventory)
        assert sentence in r.stdout, r.stdout
        assert server.poll() is None
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


def test_two_deploys_started_together(tmp_path):
    """1. two `inv deploy` start at the same moment: one runs, the other fails at once naming the holder;
    2. again with --wait on both: both end well, the second finding everything running; 3. the cluster is
    healthy with one process per instance."""
    inventory = write_inventory(tmp_path, instances=2)
    dep = deployment_id(inventory)

    def together(*extra):
        runs = [start_inv("deploy", "--host", "t", *extra, inventory=inventory) for _ in range(2)]
        t0 = time.monotonic()
        ended = {}
        while len(ended) < 2 and time.monotonic() - t0 < 240:
            for k, p in enumerate(runs):
                if k not in ended and p.poll() is not None:
                    ended[k] = time.monotonic() - t0      # when each one ended, to tell "at once" from waiting
            time.sleep(0.02)
        return [(p.returncode, *p.communicate(timeout=10), ended.get(k)) for k, p in enumerate(runs)]
    try:
        results = sorted(together(), key=lambda r: r[0])
        assert [r[0] for r in results] == [0, 2], results
        loser = results[1]
        assert re.search(rf"^t: FAILED: run: another run holds {tmp_path}/deploy/run/fleet.lock: inv deploy by \S+ "
                         r"\(pid \d+\) "
                         r"\(lock holder pid \d+ on the host\) since .* UTC; wait for it to end, or run again with "
                         r"--wait\.$", loser[2], re.M), loser
        assert loser[3] < results[0][3], "the second deploy waited instead of failing at once"
        assert [len(leaders(dep, i)) for i in range(2)] == [1, 1]
        inv("stop", "--host", "t", inventory=inventory, check=True)

        results = together("--wait")
        assert [r[0] for r in results] == [0, 0], results
        assert any("waiting for it (--wait)" in r[1] for r in results), results
        st = status_json(inventory)
        assert [i["state"] for i in st["instances"]] == ["healthy", "healthy"] and st["proxy"]["state"] == "healthy"
        assert [len(leaders(dep, i)) for i in range(2)] == [1, 1]
        assert len(tagged_pids(f"{dep}/proxy")) == 1
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


def test_deploy_repairs_an_instance_whose_pid_file_was_lost(tmp_path):
    """1. a running instance's pid file disappears: its port is held by a process carrying its tag;
    2. status calls it port-taken, and deploy does not call it a stranger: it stops it (found by tag) and
    starts the instance again, with a new record; 3. one process per instance afterwards."""
    inventory = write_inventory(tmp_path, instances=2)
    dep = deployment_id(inventory)
    try:
        inv("deploy", "--host", "t", inventory=inventory, check=True)
        old = status_json(inventory)["instances"][0]["pid"]
        (tmp_path / "deploy" / "run" / "instance_0.pid").unlink()
        assert status_json(inventory)["instances"][0]["state"] == "port-taken"
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(rf"^instance 0: stopping pid {old} \(.*\): FLEET_TAG={dep}/0$", r.stdout, re.M), r.stdout
        st = status_json(inventory)
        assert [i["state"] for i in st["instances"]] == ["healthy", "healthy"] and st["instances"][0]["pid"] != old
        rec = parse_record((tmp_path / "deploy" / "run" / "instance_0.pid").read_bytes())
        assert rec["pid"] == st["instances"][0]["pid"] and rec["sid"] == rec["pid"]
        assert [len(leaders(dep, i)) for i in range(2)] == [1, 1]
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")
