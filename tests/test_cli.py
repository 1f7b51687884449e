"""The command line as an operator meets it at night: Ctrl-C in the middle of a run, output closed early
(`| head`), the short flags, the sentences a wrong option gets. Real `inv` processes on a local sim host."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import wait_until

from hostagent import processes

from fleet_helpers import inv, start_inv, status_json, stop_by_own_scripts, write_inventory


def start_inv_ctrl_c(*args, inventory=None) -> subprocess.Popen:
    """`inv ARGS` in its own process group, with Ctrl-C's default action (a background job may have
    inherited SIGINT ignored), its output read by the test."""
    return start_inv(*args, inventory=inventory, start_new_session=True,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def read_until(proc: subprocess.Popen, text: str, timeout: float = 60) -> list[str]:
    """Standard output's lines up to the first holding text (the test fails if it never comes)."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    pytest.fail(f"{text!r} never came; output so far:\n{''.join(lines)}\n{proc.stderr.read()}")


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is pid."""
    return [p.pid for p in processes.snapshot().values() if p.ppid == pid and p.alive]


@pytest.fixture
def make_inventory(tmp_path):
    """write_inventory(tmp_path, **kw) for a 2-instance host; whatever it deployed is stopped at the end."""
    made = []

    def make(**kw):
        path = write_inventory(tmp_path, instances=2, **kw)
        made.append(path)
        return path
    try:
        yield make
    finally:
        for path in made:     # its own stop script, then a sweep by tag (fleet_helpers.stop_by_own_scripts)
            stop_by_own_scripts(path, ["t"])


@pytest.fixture
def inventory(make_inventory):
    return make_inventory(sim="{load_s: 6, prefill_ms: 20, token_ms: 5}")


@pytest.mark.cluster
def test_ctrl_c_during_deploy_stops_before_the_next_step_and_says_what_to_do(inventory):
    # SIGINT to inv alone, as over SSH (the terminal's Ctrl-C reaches no remote command): before, the
    # deploy went on to its end and then exited 1 with no word; Ctrl-C seemed ignored for minutes.
    proc = start_inv_ctrl_c("deploy", "--host", "t", inventory=inventory)
    try:
        lines = read_until(proc, "started 2 instance(s)")
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + out
    assert proc.returncode == 130, out + err
    assert "proxy: started" not in out, out          # stopped while the instances loaded (6 s)
    assert "Traceback" not in err, err
    assert "interrupted (Ctrl-C): what had started keeps running: `inv status --host t`" in err, err
    assert not children_of(proc.pid)
    # The lock went with the run, and running the command again finishes what it left.
    again = inv("deploy", "--host", "t", inventory=inventory)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "instance 0: already" in again.stdout and "proxy: started" in again.stdout, again.stdout


@pytest.mark.cluster
def test_ctrl_c_ends_logs_follow_at_once_and_cleanly(inventory):
    deployed = inv("deploy", "--host", "t", inventory=inventory)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    proc = start_inv_ctrl_c("logs", "--host", "t", "--follow", "-n", "1", inventory=inventory)
    try:
        read_until(proc, "==> t:")
        assert wait_until(lambda: children_of(proc.pid), timeout=10), "tail -F never started"
        tails = children_of(proc.pid)
        os.kill(proc.pid, signal.SIGINT)      # to inv only: the tail must be stopped by inv itself
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err     # Ctrl-C is how --follow ends, not a failure
    assert "failed=0" in out and "Traceback" not in err, out + err
    def tails_gone() -> bool:
        alive = processes.snapshot()
        return not [p for p in tails if p in alive and alive[p].alive]
    assert tails
    wait_until(tails_gone, timeout=5, what="inv's tail -F to be gone")


@pytest.mark.cluster
def test_closed_output_ends_a_read_only_run_without_a_traceback(inventory):
    deployed = inv("deploy", "--host", "t", inventory=inventory)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    # `inv status | head -0`, `inv logs --follow | grep -m1 x`: the reader is gone before inv writes.
    for args in (["status", "--host", "t"], ["status", "--host", "t", "--json"],
                 ["logs", "--host", "t", "--follow"]):
        proc = start_inv_ctrl_c(*args, inventory=inventory)
        proc.stdout.close()
        try:
            err = proc.stderr.read()
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert "Traceback" not in err and "BrokenPipe" not in err, (args, err)


@pytest.mark.process
def test_minus_i_is_the_inventory_on_every_command(tmp_path):
    # Before, stop, restart, logs and trace answered `-i FILE` with "No idea what '-i' is!".
    path = write_inventory(tmp_path, instances=2)
    for args in (["status"], ["stop", "--check"], ["logs", "-n", "1"], ["restart", "--instance", "5"],
                 ["trace", "some-id"], ["doctor"]):
        r = inv(*args, "--host", "t", "-i", str(path))
        assert "No idea" not in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert not r.stderr.startswith("error:"), (args, r.stderr)      # the inventory was read
    r = inv("restart", "--host", "t", "-i", str(path), "--instance", "5")
    assert r.returncode == 2 and "there is no instance 5; instances are 0-1" in r.stderr, r.stderr
    # -i with an instance number in mind: one sentence, nothing stopped.
    r = inv("stop", "--host", "t", "-i", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "-i is --inventory, the inventory file (got '1'); for instance 1, write --instance 1." in r.stderr


@pytest.mark.process
def test_a_deploy_dir_that_cannot_be_written_is_one_sentence_that_says_what_to_do(tmp_path):
    # Before: "taking the lock .../run/fleet.lock failed (exit 2): cannot lock ... (Not a directory)".
    path = write_inventory(tmp_path, instances=2)
    (tmp_path / "a-file").write_text("")
    for args in (["deploy", "--no-doctor"], ["stop"], ["restart", "--instance", "0"]):
        r = inv(*args, "--host", "t", "--set", f"deploy_dir={tmp_path / 'a-file' / 'deploy'}", inventory=path)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert (f"deploy_dir {tmp_path / 'a-file' / 'deploy'} must be a directory this user can write; fix its "
                "permissions, or set deploy_dir to one you own.") in r.stderr, (args, r.stderr)
    # The doctor says so too (it checked only the free space, and said ok).
    r = inv("doctor", "--host", "t", "--set", f"deploy_dir={tmp_path / 'a-file' / 'deploy'}", inventory=path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"fail  deploy_dir: {tmp_path / 'a-file' / 'deploy'} cannot be written: {tmp_path / 'a-file'} is not a "
            "directory\n      fix: set deploy_dir to a directory you can write") in r.stdout, r.stdout


@pytest.mark.cluster
def test_status_says_where_to_look_and_what_brings_a_dead_part_back(make_inventory):
    # Before: "FAILED: instance 1: dead", "FAILED: proxy: dead", and nothing more.
    path = make_inventory(extra="keeper: {enabled: false}\n")
    r = inv("deploy", "--host", "t", inventory=path)
    assert r.returncode == 0, r.stdout + r.stderr
    st = status_json(path)
    for pid in (st["proxy"]["pid"], st["instances"][1]["pid"]):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: (lambda s: s["proxy"]["state"] == s["instances"][1]["state"] == "dead")(
        status_json(path)), what="the proxy and instance 1 seen dead")
    r = inv("status", "--host", "t", inventory=path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("t: FAILED: instance 1: dead: `inv logs --host t --instance 1` shows why; `inv restart --host t "
            "--instance 1` starts it again") in r.stderr, r.stderr
    assert "t: FAILED: proxy: dead: `inv logs --host t` shows why; `inv deploy --host t` starts it again" \
        in r.stderr, r.stderr


@pytest.mark.cluster
def test_stopping_a_stopped_instance_says_there_was_nothing_to_stop(make_inventory):
    path = make_inventory()
    r = inv("deploy", "--host", "t", inventory=path)
    assert r.returncode == 0, r.stdout + r.stderr
    first = inv("stop", "--host", "t", "--instance", "1", inventory=path)
    assert first.returncode == 0 and "instance 1: stopping pid" in first.stdout, first.stdout + first.stderr
    assert "nothing to stop" not in first.stdout
    again = inv("stop", "--host", "t", "--instance", "1", inventory=path)     # it printed the cards alone
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.startswith("instance 1: not running: nothing to stop\n"), again.stdout


@pytest.mark.process
def test_inv_in_the_test_process_answers_as_inv_in_a_process_of_its_own(tmp_path):
    """The suite runs `inv` in the test process (tests/fleet_helpers.py): a task's help, the task list, an
    unknown option, a refusal and a run each give the same exit code, standard output and standard error as
    `python -m invoke` does in a process of its own, and so does a second run in this process (the first
    leaves nothing behind: invoke takes each argument's help out of its task as it parses)."""
    path = write_inventory(tmp_path, instances=2)
    for args in (["deploy", "--help"], ["--list"], ["deploy", "--bogus"], ["restart", "--host", "t", "-i", str(path)],
                 ["status", "--host", "t", "--json", "-i", str(path)]):
        there = inv(*args, process=True)
        for _ in range(2):
            here = inv(*args)
            assert (here.returncode, here.stdout, here.stderr) == (there.returncode, there.stdout, there.stderr), args
