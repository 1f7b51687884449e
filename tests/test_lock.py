"""One run at a time per deployment: the flock on deploy_dir/run/fleet.lock, held on the host by a process
that lives as long as the run (hostagent/lock.py), taken through the transport (fleet/host/runlock.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import wait_until
from sshd import keygen, sshd  # noqa: F401  (the module-scoped fixture)

from hostagent import lock, processes

from fleet.host import runlock
from fleet.transport.connection import LocalTransport


class HV:
    """The few host settings the lock needs (prepared: deploy_dir absolute, python resolved)."""

    name = "t"

    def __init__(self, **settings):
        self.settings = SimpleNamespace(**settings)


@pytest.fixture
def hv(tmp_path):
    return HV(deploy_dir=str(tmp_path / "deploy"), connection="local", python=sys.executable, env_setup="")


@pytest.mark.unit
def test_try_hold_is_refused_while_held_and_names_the_holder(tmp_path):
    d = str(tmp_path)
    held = lock.try_hold(d, "inv deploy")
    assert held is not None
    assert lock.try_hold(d, "keeper") is None
    info = lock.holder(d)
    assert info["pid"] == os.getpid() and info["what"] == "inv deploy" and info["since"].endswith("UTC")
    held.release()
    assert lock.holder(d) is None
    with lock.try_hold(d, "keeper") as again:
        assert again is not None and lock.holder(d)["what"] == "keeper"
    assert lock.holder(d) is None


@pytest.mark.process
def test_a_second_run_fails_at_once_naming_the_holder(hv):
    with runlock.held(LocalTransport("t"), hv, "deploy"):
        info = lock.holder(hv.settings.deploy_dir)
        assert info["what"].startswith("inv deploy by ") and info["pid"] != os.getpid()
        # the holder keeps the lock until this block ends: a second run that waited would never end
        with pytest.raises(runlock.LockedError) as e:
            with runlock.held(LocalTransport("t"), hv, "stop"):
                pass
        msg = str(e.value)
        assert msg.startswith(f"t: another run holds {hv.settings.deploy_dir}/run/fleet.lock: inv deploy by ")
        assert f"(lock holder pid {info['pid']} on the host) since {info['since']}" in msg
        assert msg.endswith("wait for it to end, or run again with --wait.")
    assert lock.holder(hv.settings.deploy_dir) is None
    # The same run, nested (a restart's stop): no second lock, no refusal.
    conn = LocalTransport("t")
    with runlock.held(conn, hv, "restart"):
        with runlock.held(conn, hv, "stop"):
            assert lock.holder(hv.settings.deploy_dir)["what"].startswith("inv restart by ")
    assert lock.holder(hv.settings.deploy_dir) is None


@pytest.mark.process
def test_wait_takes_the_lock_when_the_holder_ends(hv):
    said = []
    order = []
    first = runlock.held(LocalTransport("t"), hv, "deploy")
    first.__enter__()

    def second():
        with runlock.held(LocalTransport("t"), hv, "stop", emit=said.append, wait=True):
            order.append("second")
    t = threading.Thread(target=second)
    t.start()
    wait_until(lambda: said, what="the second run to say it waits")
    assert said[0].startswith(f"lock: {hv.settings.deploy_dir} is held by inv deploy by ") and \
        said[0].endswith("; waiting for it (--wait)")
    time.sleep(0.3)
    assert order == []
    order.append("first")
    first.__exit__(None, None, None)
    t.join(timeout=20)
    assert order == ["first", "second"]


@pytest.mark.process
def test_a_lock_left_by_a_dead_run_is_taken_over(hv, tmp_path):
    """1. a run (another process) takes the lock; 2. it is SIGKILLed: no cleanup of its own runs;
    3. the lock is free at once, and the file's stale holder line is not obeyed."""
    code = ("import sys, time; sys.path.insert(0, %r); from fleet.host import runlock; from fleet.transport.connection import "
            "LocalTransport\nfrom types import SimpleNamespace\nclass HV: name = 't'\nhv = HV()\n"
            "hv.settings = SimpleNamespace(deploy_dir=%r, connection='local', python=%r, env_setup='')\n"
            "with runlock.held(LocalTransport('t'), hv, 'deploy'):\n    print('held', flush=True)\n"
            "    time.sleep(600)\n" % (str(os.path.dirname(os.path.dirname(__file__))), hv.settings.deploy_dir,
                                      sys.executable))
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        assert run.stdout.readline().strip() == "held"
        holder = lock.holder(hv.settings.deploy_dir)
        assert holder is not None
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=5)
        wait_until(lambda: lock.holder(hv.settings.deploy_dir) is None, timeout=10, what="the lock released")
        wait_until(lambda: not processes.alive(holder["pid"]), timeout=10, what="the holder on the host gone")
        with runlock.held(LocalTransport("t"), hv, "stop"):
            assert lock.holder(hv.settings.deploy_dir)["what"].startswith("inv stop by ")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


@pytest.mark.ssh
def test_over_ssh_the_lock_is_on_the_host_and_a_dropped_connection_frees_it(sshd, tmp_path):  # noqa: F811
    """1. a run over SSH holds the lock (the holder runs on the host, behind the real sshd); 2. a second
    SSH connection is refused, naming it; 3. the first connection drops without a word (as when the
    control node dies): the holder on the host sees its input close and the lock is free."""
    from test_ssh import ssh_host, write

    from fleet.facts.state import prepare
    from fleet.settings import inventory
    from fleet.transport.connection import connect

    path = write(tmp_path, {"s": ssh_host(sshd, tmp_path, "s")})
    hv = inventory.load(path).host_vars("s")
    first, second = connect(hv), connect(hv)
    try:
        hv = prepare(first, hv)
        held = runlock.held(first, hv, "deploy")
        held.__enter__()
        holder = lock.holder(hv.settings.deploy_dir)
        assert holder["what"].startswith("inv deploy by ") and processes.alive(holder["pid"])
        with pytest.raises(runlock.LockedError, match="another run holds .* inv deploy by "):
            with runlock.held(second, hv, "stop"):
                pass
        first.close()                   # the connection goes; the run never released the lock
        wait_until(lambda: lock.holder(hv.settings.deploy_dir) is None, timeout=15, what="the lock freed on the host")
        with runlock.held(second, hv, "stop"):
            assert lock.holder(hv.settings.deploy_dir)["what"].startswith("inv stop by ")
    finally:
        first.close()
        second.close()
