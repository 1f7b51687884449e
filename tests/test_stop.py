"""`inv stop` done right on the sim accelerator, which runs the same code as a DCU host: process groups,
the tag sweep, the wait for release read from the smi, --force, and another user's holder."""
from __future__ import annotations

import os
import pwd
import re
import signal
import subprocess

import pytest
from conftest import require_tool, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, session_members, status_json, tagged_pids, write_inventory

from fleet.facts.state import prepare
from fleet.host import smi
from fleet.settings import inventory as inv_mod
from fleet.sim import devices
from fleet.transport.connection import LocalTransport

pytestmark = pytest.mark.cluster

OTHER_USER = "fleet-other"


def cards_used(inventory) -> dict[int, float]:
    """Card -> used MiB, read with the real smi path (python -m fleet.sim smi through the transport)."""
    hv = prepare(LocalTransport("t"), inv_mod.load(inventory).host_vars("t"))
    return {c.index: c.used_mib for c in smi.read_cards(LocalTransport("t"), hv)}


def table_rows(output: str) -> dict[int, str]:
    """The per-card table of a stop: card -> its state word(s)."""
    return {int(m.group(1)): m.group(2).strip() for m in
            re.finditer(r"^\s+(\d+)\s+\S+ MiB\s+\S+ MiB\s+(.+)$", output, re.M)}


def test_orphans_of_killed_api_servers_are_found_by_tag_and_every_card_released(tmp_path):
    """1. deploy 4 sim instances; 2. SIGKILL every API server and lose the pid files, so neither a port
    nor a process group leads to the spawned engine children; 3. the orphans (VLLM::EngineCore and
    VLLM::Worker, renamed with setproctitle as vLLM's are) keep their cards used; 4. `inv stop` (no
    --force) finds them by FLEET_TAG, which they keep only because start_cluster.sh exports SPT_NOENV=1;
    5. the table shows every card released."""
    inventory = write_inventory(tmp_path, extra="release_timeout_s: 20\n")
    dep = deployment_id(inventory)
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        st = status_json(inventory)
        for i in st["instances"]:
            os.kill(i["pid"], signal.SIGKILL)
        for i in range(4):
            (tmp_path / "deploy" / "run" / f"instance_{i}.pid").unlink()
        wait_until(lambda: all(not os.path.exists(f"/proc/{i['pid']}") or
                               open(f"/proc/{i['pid']}/stat").read().split(")")[1].split()[0] == "Z"
                               for i in st["instances"]), timeout=10, what="API servers gone")
        # Found by session (tags aside): each instance's VLLM::EngineCore and VLLM::Worker.
        orphans = session_members(i["pid"] for i in st["instances"])
        assert len(orphans) >= 8
        holding = {p for pids in devices.holders(tmp_path / "deploy" / "sim-dev").values() for p in pids}
        assert len(holding) == 4 and holding <= set(orphans)
        used = cards_used(inventory)
        assert all(used[c] >= devices.ENGINE_MIB for c in range(4)), used

        r = inv("stop", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        swept = {int(p) for p in re.findall(r"^instance \d: stopping pid (\d+) \(.*\): FLEET_TAG=", r.stdout, re.M)}
        # The engine cores holding the cards are found by tag (their workers may end with them first).
        assert holding <= swept, r.stdout
        assert not [p for p in orphans if devices.pid_alive(p)]
        assert table_rows(r.stdout) == {c: "released" for c in range(4)}, r.stdout
        assert tagged_pids(dep + "/") == []
        assert all(u <= devices.IDLE_MIB for u in cards_used(inventory).values())
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")
        kill_pids(session_members(i["pid"] for i in st["instances"]) if "st" in locals() else [])


def kill_pids(pids) -> None:
    """Test cleanup of processes found by session (renamed, without the tag): by pid."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def bare_host(tmp_path):
    """A sim host with its device files but nothing deployed, and a short release timeout."""
    inventory = write_inventory(tmp_path, extra="release_timeout_s: 2\n")
    devices.ensure_card(tmp_path / "deploy" / "sim-dev", list(range(4)))
    return inventory, tmp_path / "deploy" / "sim-dev"


def hold(procs, path, user: str | None = None):
    """A process holding `path` open (as `user` via setpriv, the file opened before the switch)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        argv = ["sleep", "120"]
        if user:
            pw = pwd.getpwnam(user)
            argv = [require_tool("setpriv"), f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
                    "--", *argv]
        p = procs.start(argv, pass_fds=(fd,))
    finally:
        os.close(fd)
    return p


def test_untagged_holder_is_listed_by_check_and_killed_only_by_force(bare_host, procs):
    """1. a process of this user, with no tag, holds card 1's device file; 2. `--check` lists it and kills
    nothing; 3. a plain stop leaves it, fails naming it and says --force; 4. `--force` kills it and the
    card is released."""
    require_tool("fuser")
    inventory, dev = bare_host
    holder = hold(procs, dev / "renderD129")
    wait_until(lambda: cards_used(inventory)[1] >= devices.ENGINE_MIB, what="card 1 used")

    r = inv("stop", "--host", "t", "--check", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(rf"holder {holder.pid}: pid {holder.pid} \(user \S+: sleep 120\) holds \S+renderD129: "
                     r"would be killed with --force", r.stdout), r.stdout
    r = inv("stop", "--host", "t", "--check", "--force", inventory=inventory)
    assert re.search(rf"holder {holder.pid}: .*: would be killed$", r.stdout, re.M), r.stdout
    assert holder.poll() is None

    r = inv("stop", "--host", "t", inventory=inventory)
    assert r.returncode == 2, r.stdout + r.stderr
    assert table_rows(r.stdout)[1] == "NOT RELEASED" and table_rows(r.stdout)[0] == "released"
    assert re.search(rf"FAILED: release: not released after 2s: card 1 \(52002/65520 MiB\); held by pid "
                     rf"{holder.pid} .*--force` kills the ones that are yours", r.stderr), r.stderr
    assert holder.poll() is None

    r = inv("stop", "--host", "t", "--force", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"force: killed pid {holder.pid}" in r.stdout
    assert table_rows(r.stdout) == {c: "released" for c in range(4)}, r.stdout
    assert holder.wait(timeout=5) == -signal.SIGTERM


def ensure_other_user() -> str:
    """A second local user for the holder of another user (CI runs as root; skipped elsewhere)."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run as root to create a second user")
        pytest.skip("needs root to run a process as another user")
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run([require_tool("useradd"), "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        OTHER_USER], check=True, capture_output=True)
    return OTHER_USER


def test_another_users_holder_is_never_killed_and_is_named(bare_host, procs):
    """1. a process of another user holds card 2's device file; 2. `--check --force` says it is never
    killed; 3. `--force` leaves it alive, and the stop fails naming it as the holder."""
    require_tool("fuser")
    user = ensure_other_user()
    inventory, dev = bare_host
    holder = hold(procs, dev / "renderD130", user=user)
    wait_until(lambda: cards_used(inventory)[2] >= devices.ENGINE_MIB, what="card 2 used")

    r = inv("stop", "--host", "t", "--check", "--force", inventory=inventory)
    assert re.search(rf"holder {holder.pid}: pid {holder.pid} \(user {user}: sleep 120\) .*never killed",
                     r.stdout), r.stdout
    r = inv("stop", "--host", "t", "--force", inventory=inventory)
    assert r.returncode == 2, r.stdout + r.stderr
    assert holder.poll() is None
    assert re.search(rf"card 2 \(52002/65520 MiB\); held by pid {holder.pid} \(user {user}: sleep 120\) "
                     r"\[another user's\]; ask the holder's owner", r.stderr), r.stderr
    assert "force: killed" not in r.stdout
    assert table_rows(r.stdout)[2] == "NOT RELEASED"


def test_force_on_one_instance_spares_the_others(tmp_path, procs):
    """1. a running 2-instance cluster, and an untagged process of yours holding card 0's device file;
    2. `inv stop --instance 0 --force` kills instance 0 and that holder; 3. instance 1, its engine child
    and the proxy live on, untouched."""
    require_tool("fuser")
    inventory = write_inventory(tmp_path, instances=2, extra="release_timeout_s: 10\n")
    dep = deployment_id(inventory)
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        others = set(tagged_pids(f"{dep}/1")) | set(tagged_pids(f"{dep}/proxy"))
        assert len(others) >= 3
        holder = hold(procs, tmp_path / "deploy" / "sim-dev" / "renderD128")
        r = inv("stop", "--host", "t", "--instance", "0", "--force", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"force: killed pid {holder.pid}" in r.stdout
        assert holder.wait(timeout=5) is not None
        assert table_rows(r.stdout) == {0: "released"}, r.stdout
        assert set(tagged_pids(f"{dep}/1")) | set(tagged_pids(f"{dep}/proxy")) == others
        assert tagged_pids(f"{dep}/0") == []
        st = status_json(inventory)
        assert [i["state"] for i in st["instances"]] == ["stopped", "healthy"]
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


def test_cpu_accelerator_release_is_no_process_left_read_from_proc(tmp_path):
    """accelerator cpu (here with the sim engine): no smi, so the memory table of a stop shows each
    instance's resident memory read from /proc (its tagged processes and its session). 1. deploy 2
    instances on their own cores; doctor checks cores and RAM. 2. SIGKILL instance 0's API server: its
    engine and worker live on. 3. `inv stop`: both instances' rows go from used to 0 MiB, `released`,
    nothing skipped, no process of the deployment left."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs 2 cores to split")
    inventory = write_inventory(tmp_path, instances=2, extra="cpu_kvcache_gib: 1\n")
    inventory.write_text(inventory.read_text().replace("accelerator: sim", "accelerator: cpu"))
    dep = deployment_id(inventory)
    sessions = []
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(rf"ok    cores: 2 instance\(s\) x {cores // 2} core\(s\), each on its own", r.stdout), r.stdout
        assert re.search(r"ok    memory: [\d.]+ GiB available of [\d.]+ GiB; needs [\d.]+ GiB", r.stdout), r.stdout
        st = status_json(inventory)
        sessions = [i["pid"] for i in st["instances"]]
        os.kill(sessions[0], signal.SIGKILL)
        wait_until(lambda: status_json(inventory)["instances"][0]["state"] == "dead", what="instance 0 dead")
        assert len(session_members(sessions[:1])) >= 2        # VLLM::EngineCore and VLLM::Worker live on

        r = inv("stop", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "instances' memory (resident in their processes/host total, from /proc):" in r.stdout
        rows = re.findall(r"^\s+(\d)\s+([\d.]+)/\d+ MiB\s+([\d.]+)/\d+ MiB\s+(\S+)$", r.stdout, re.M)
        assert [(i, state) for i, _, _, state in rows] == [("0", "released"), ("1", "released")], r.stdout
        assert all(float(before) > 10 and float(after) == 0 for _, before, after, _ in rows), rows
        assert "skipped" not in r.stdout.replace("skipped=0", "")
        assert not session_members(sessions) and not tagged_pids(dep + "/")
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")
        kill_pids(session_members(sessions))


def test_a_skipped_step_says_why_on_its_own_line():
    """No step is skipped silently: the CLI prints each skipped step with its reason (display.skips)."""
    from fleet.commands import display
    from fleet.report import Report
    report = Report("h")
    report.add("release", "skipped", "cannot read the cards' memory: no smi found")
    report.add("instance 0", "ok", "already stopped")
    report.add("holders", "skipped")
    assert display.skips(report) == ["h: skipped: release: cannot read the cards' memory: no smi found",
                                      "h: skipped: holders: no reason given"]
