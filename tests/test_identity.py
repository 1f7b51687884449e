"""Process identity on the host (hostagent/processes.py): pid file records, what counts as the
deployment's, and a stop that signals only that. Real processes, found and checked by pid."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid

import pytest
from conftest import free_port, free_ports, wait_until

from hostagent import processes
from hostagent.processes import RecordError, format_record, parse_record

from fleet.transport import hostcode

# --- records ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("pid=12 pgid=12 sid=12 start=345 tag=d/0\n", {"pid": 12, "pgid": 12, "sid": 12, "start": 345, "tag": "d/0"}),
    ("pid=12 pgid=13 sid=14 start=345", {"pid": 12, "pgid": 13, "sid": 14, "start": 345, "tag": None}),
    ("pid=12 start=9 boot=abc", {"pid": 12, "pgid": None, "sid": None, "start": 9, "tag": None}),
    ("4242 4242\n", {"pid": 4242, "pgid": 4242, "sid": None, "start": None, "tag": None}),
    ("4242", {"pid": 4242, "pgid": None, "sid": None, "start": None, "tag": None}),
])
@pytest.mark.unit
def test_records_are_parsed_in_both_forms(text, want):
    assert parse_record(text) == want
    assert parse_record(text.encode()) == want


@pytest.mark.parametrize("data, why", [
    (b"", "is empty"), (b"  \n", "is empty"), (b"\xff\xfe12 12\n", "not UTF-8"),
    (b"garbage here\n", "does not hold a pid record"), (b"12 13 14", "does not hold a pid record"),
    (b"pid=12 start=", "does not hold a pid record"), (b"pgid=3 sid=3", "does not hold a pid record"),
    (b"pid=1", None),
])
@pytest.mark.unit
def test_unreadable_records_say_why(data, why):
    if why is None:
        assert parse_record(data)["pid"] == 1       # readable; check_record refuses it later
        return
    with pytest.raises(RecordError, match=why):
        parse_record(data)


@pytest.mark.process
def test_a_live_processes_record_holds_its_start_time_group_session_and_tag(procs):
    p = procs.start(["sleep", "60"], env={**os.environ, "FLEET_TAG": "dep/3"})
    wait_until(lambda: processes.read_tag(p.pid) == "dep/3", what="the child exec'd")
    rec = parse_record(processes.record_of(p.pid))
    with open(f"/proc/{p.pid}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    assert rec == {"pid": p.pid, "pgid": p.pid, "sid": p.pid, "start": start, "tag": "dep/3"}
    assert format_record(**rec) == processes.record_of(p.pid)
    assert processes.check_record(rec, "dep/3", processes.read_proc(p.pid)) is None
    assert processes.check_record({**rec, "start": start - 1}, "dep/3", processes.read_proc(p.pid)) == \
        "started at another time"
    assert processes.check_record(rec, "dep/4", processes.read_proc(p.pid)) == "which carries another tag (dep/3)"
    assert processes.check_record({**rec, "pid": 1}, "dep/3", processes.read_proc(1)) == "which is never signalled"


# --- a host with a deployment -------------------------------------------------------------------

@pytest.fixture
def host(tmp_path):
    """A deploy_dir with a run directory and a spec for processes.stop (3 instances, free ports)."""
    (tmp_path / "run").mkdir()
    base = free_ports(3)
    return {"deploy_dir": str(tmp_path), "deployment_id": f"test-{uuid.uuid4().hex[:8]}", "instances": 3,
            "base_port": base, "proxy_port": free_port(), "grace_s": 3}


def children_of(pid: int) -> list[int]:
    return [p.pid for p in processes.snapshot().values() if p.ppid == pid and p.alive]


def start_instance(procs, spec, i: int, erase: bool = False, record: bool = True):
    """A stand-in instance: a tagged session leader (bash) with two children; erase: the children have no
    FLEET_TAG (what setproctitle does to vLLM's EngineCore without SPT_NOENV). Its record goes to the
    instance's pid file, as start_cluster.sh writes it."""
    tag = f"{spec['deployment_id']}/{i}"
    child = "env -u FLEET_TAG sleep 600" if erase else "sleep 600"
    p = procs.start(["bash", "-c", f"{child} & {child} & wait"], env={**os.environ, "FLEET_TAG": tag})
    kids = wait_until(lambda: len(children_of(p.pid)) == 2 and children_of(p.pid), what="two children")
    if erase:
        wait_until(lambda: all(processes.read_tag(k) is None for k in kids), what="children without tag")
    if record:
        processes.write_record(os.path.join(spec["deploy_dir"], "run", f"instance_{i}.pid"), p.pid, tag)
    return p, kids


def gone(pid: int) -> bool:
    return not processes.alive(pid)


@pytest.mark.process
def test_pid_file_naming_an_unrelated_group_leader_is_stale_and_it_survives(host, procs):
    """1. instance 0 runs (tagged leader, two children); 2. its pid file is replaced by one naming an
    unrelated `setsid sleep` of the same user, in both the old and the new form; 3. the stop says the file
    is stale, removes it, signals nothing of the stranger; 4. the real instance is found by tag and session
    and stopped."""
    inst, kids = start_instance(procs, host, 0)
    stranger = procs.start(["sleep", "600"])
    pidfile = os.path.join(host["deploy_dir"], "run", "instance_0.pid")
    for text in (f"{stranger.pid} {stranger.pid}\n",
                 format_record(stranger.pid, stranger.pid, stranger.pid, 12345, f"{host['deployment_id']}/0")):
        with open(pidfile, "w") as f:
            f.write(text)
        lines = []
        processes.stop(host, only=0, check=True, say=lines.append)
        why = "which does not carry the deployment's tag" if "=" not in text else "started at another time"
        assert f"instance 0: pid file names pid {stranger.pid}, {why}: not ours, not touched" in lines, lines
    lines = []
    left = processes.stop(host, only=0, say=lines.append)
    assert left == []
    assert stranger.poll() is None, "the unrelated process was signalled"
    assert not os.path.exists(pidfile)
    assert inst.wait(timeout=5) is not None and all(gone(k) for k in kids)
    said = "\n".join(lines)
    assert f"instance 0: stopping pid {inst.pid} (bash -c sleep 600 & sleep 600 & wait): " \
           f"FLEET_TAG={host['deployment_id']}/0" in said
    for k in kids:
        assert f"stopping pid {k} (sleep 600): " in said


@pytest.mark.process
def test_orphans_whose_tag_was_erased_are_found_by_session(host, procs):
    """1. instance 1's children carry no FLEET_TAG; 2. its leader is SIGKILLed, so nothing tagged and no
    live pid file leads to them; 3. the stop finds them by the session its pid file recorded."""
    inst, kids = start_instance(procs, host, 1, erase=True)
    os.kill(inst.pid, signal.SIGKILL)
    inst.wait(timeout=5)
    assert all(processes.read_proc(k).sid == inst.pid for k in kids)
    lines = []
    assert processes.stop(host, only=1, say=lines.append) == []
    assert all(gone(k) for k in kids)
    for k in kids:
        assert f"instance 1: stopping pid {k} (sleep 600): session {inst.pid} of instance 1" in lines, lines


@pytest.mark.process
def test_a_stop_signals_only_the_real_instance_whatever_its_pid_file_names(host, procs):
    """Pid files naming pgid 0, pid 1, pgid 1, the stopping process itself and a process of its own group
    (with a matching record): a stop whose kill is a recorder signals exactly the real instance."""
    inst, kids = start_instance(procs, host, 0)
    run = os.path.join(host["deploy_dir"], "run")
    dep = host["deployment_id"]
    sibling = subprocess.Popen(["sleep", "600"], env={**os.environ, "FLEET_TAG": f"{dep}/2"})  # my group
    try:
        wait_until(lambda: processes.read_tag(sibling.pid) == f"{dep}/2", what="sibling exec'd")
        files = {"instance_1.pid": "0 0\n", "proxy.pid": "1 1\n", "nginx.pid": "pid=1 pgid=1 sid=1 start=1\n",
                 "nginx_watch.pid": format_record(os.getpid(), os.getpgid(0), os.getsid(0),
                                                  processes.read_proc(os.getpid()).start, f"{dep}/nginx-watch"),
                 "instance_2.pid": processes.record_of(sibling.pid)}
        for name, text in files.items():
            with open(os.path.join(run, name), "w") as f:
                f.write(text)
        calls = []
        lines = []
        left = processes.stop(host, kill=lambda pid, sig: calls.append((pid, sig)), say=lines.append, grace_s=0.3)
        signalled = {pid for pid, _ in calls}
        assert signalled == {inst.pid, *kids}, (calls, lines)
        assert {sig for _, sig in calls} == {signal.SIGTERM, signal.SIGKILL}
        assert sorted(left) == sorted([inst.pid, *kids])       # the recorder killed nothing
        assert sibling.poll() is None
        said = "\n".join(lines)
        assert "instance 1: pid file names pid 0, which is never signalled: not ours, not touched" in said
        assert "proxy: pid file names pid 1, which is never signalled: not ours, not touched" in said
        assert f"instance 2: pid {sibling.pid} (sleep 600): pid file record of instance 2, but in this stop's " \
            "own session, process group or ancestry: not touched" in said
        assert re.search(rf"^nginx watcher: pid {os.getpid()} \(.*\): pid file record of nginx watcher, but in "
                         "this stop's own session", said, re.M), said
        with pytest.raises(ValueError):
            processes._signal(lambda pid, sig: None, 0, signal.SIGTERM)
    finally:
        sibling.kill()
        sibling.wait()


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"", b"pid=", b"12 13 14 15"])
@pytest.mark.process
def test_unreadable_pid_file_is_one_sentence_and_the_stop_goes_on(host, procs, content):
    inst, kids = start_instance(procs, host, 2, record=False)
    pidfile = os.path.join(host["deploy_dir"], "run", "instance_2.pid")
    with open(pidfile, "wb") as f:
        f.write(content)
    lines = []
    assert processes.stop(host, say=lines.append) == []
    assert inst.wait(timeout=5) is not None and all(gone(k) for k in kids)
    about = [line for line in lines if "instance_2.pid" in line]
    assert len(about) == 1 and about[0].startswith("instance 2: run/instance_2.pid ") and \
        about[0].endswith(": not read; its processes are looked for by tag"), lines
    assert not os.path.exists(pidfile)


@pytest.mark.process
def test_a_strangers_listener_on_an_instance_port_is_named_and_left_alone(host, procs):
    port = host["base_port"] + 1
    server = procs.start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: processes.listeners([port]).get(port), what="http.server listening")
    assert processes.listeners([port])[port] == [(server.pid, os.getuid())]
    lines = []
    assert processes.stop(host, say=lines.append) == []
    assert server.poll() is None
    assert (f"port {port} is held by pid {server.pid} ({sys.executable} -m http.server --bind 127.0.0.1 "
            f"{port}), which is not this deployment's; stop it yourself or change base_port") in lines, lines


@pytest.mark.process
def test_processes_py_runs_alone_from_standard_input(host, procs):
    """`python3 - stop SPEC` with the file on stdin, as inv stop runs it where nothing is deployed."""
    import json
    inst, kids = start_instance(procs, host, 0)
    src = hostcode.script("processes")          # the file, with the layout module it imports in front
    r = subprocess.run([sys.executable, "-", "stop", json.dumps(host), "--instance", "0"], input=src,
                       capture_output=True, text=True, cwd="/", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert inst.wait(timeout=5) is not None and all(gone(k) for k in kids)
    assert "instance 0: stopped 3 processes" in r.stdout
