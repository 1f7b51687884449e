"""The keeper, end to end: a killed or hung instance is restarted through the host agent's one restart and
status shows it; a crash loop is reported by `inv status`; `inv stop` stops the keeper first, even during a
restart. Real sim clusters, deployed through the real `inv` command line, with the keeper's timings made
small through inventory keys. What the keeper decides (dead or loading, stalled or busy, backoff, window,
crash loop, drained, the lock) is tested without processes in test_keeper_decisions.py."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, tagged_pids, write_inventory
from hostagent import keeper, lock

KEEPER = """\
keeper: {{dead_after_s: 3, backoff_base_s: {base}, backoff_max_s: 4, max_restarts: 3, window_s: 120,
         stall_probe: {probe}, probe_interval_s: 0.5, probe_timeout_s: 1, probe_failures: 2}}
release_timeout_s: 20
"""


def keeper_inventory(tmp_path: Path, instances: int = 2, base: float = 1, probe: bool = False,
                     sim: str = "{load_s: 0.3, prefill_ms: 20, token_ms: 5}") -> Path:
    return write_inventory(tmp_path, instances=instances, sim=sim,
                           extra=KEEPER.format(base=base, probe="true" if probe else "false"))


def keeper_state(deploy: Path) -> dict:
    try:
        return json.loads((deploy / "run" / "keeper.json").read_text())
    except (OSError, ValueError):
        return {}


def watch_of(deploy: Path, i: int) -> dict:
    return (keeper_state(deploy).get("instances") or {}).get(str(i)) or {}


def card_holders(deploy: Path, card: int) -> set[int]:
    """Pids holding the sim card's device file (what the sim's smi counts as used memory)."""
    target = os.path.realpath(deploy / "sim-dev" / f"renderD{128 + card}")
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{name}/fd"):
                if os.readlink(f"/proc/{name}/fd/{fd}") == target:
                    found.add(int(name))
                    break
        except OSError:
            continue
    return found


def post(port: int, max_tokens: int = 8, timeout: float = 30) -> tuple[int | None, str | None]:
    body = json.dumps({"model": "Test-Model", "max_tokens": max_tokens, "user": "load",
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, r.headers.get("X-Backend")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Backend")
    except OSError:
        return None, None


def admin_backends(port: int) -> dict[str, dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/backends", timeout=5) as r:
        return {b["name"]: b for b in json.loads(r.read())}


@pytest.fixture
def cluster(tmp_path):
    """Deploy a keeper_inventory (made by the test through the factory), and always stop it."""
    made = []

    def deploy(**kw):
        inventory = keeper_inventory(tmp_path, **kw)
        made.append(inventory)
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        st = status_json(inventory)
        assert st["keeper"]["state"] == "running" and st["keeper"]["pid"], st["keeper"]
        return inventory, tmp_path / "deploy", st
    yield deploy
    for inventory in made:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(deployment_id(inventory) + "/")


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_sigkill_of_an_api_server_under_load(cluster):
    """1. 4 sim instances behind the proxy, 16 clients sending without pause.
    2. SIGKILL instance 1's API server only: its engine child lives on as an orphan, holding the card.
    3. The keeper finds it gone, waits its backoff (1 s), stops the orphan by identity, waits for the card,
       starts the instance, and the proxy routes to it again.
    4. Failed requests: at most the 4 in flight on instance 1 when it died, all started before its death;
       none after. The orphan is gone, one process group holds the card.
    5. A SIGSTOPped instance is restarted for "unhealthy" and does not come back beside its successor.
    (When each instance is dead, and the waits: tests/test_keeper_decisions.py.)"""
    inventory, deploy, st = cluster(instances=4)
    port, admin = st["proxy"]["port"], st["proxy"]["port"] + 1
    victim = st["instances"][1]
    name = f"127.0.0.1:{victim['port']}"
    orphans = set(tagged_pids(f"{st['deployment_id']}/1")) - {victim["pid"]}
    assert orphans, "the sim's engine child should carry the instance's tag"

    stop = threading.Event()
    results: list[tuple[float, float, int | None, str | None]] = []

    def client():
        while not stop.is_set():
            t0 = time.monotonic()
            status, backend = post(port)
            results.append((t0, time.monotonic(), status, backend))

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    try:
        # requests run on instance 1 when it dies
        wait_until(lambda: any(s == 200 and b == name for _, _, s, b in results[-200:]), 20,
                   what="answers from instance 1")
        t_kill = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        began = wait_until(lambda: watch_of(deploy, 1).get("restarts", 0) >= 1 and time.monotonic(), 20,
                           what="the keeper to begin restarting instance 1")
        wait_until(lambda: watch_of(deploy, 1).get("last_result") == "ok", 60,
                   what="the keeper's restart of instance 1 to finish")
        t_back = wait_until(lambda: any(b == name and t0 > began for t0, _, s, b in results[-200:]
                                        if s == 200) and time.monotonic(), 20,
                            what="the proxy to route to instance 1 again")
        # every client sends again after that: a request failing after the death would be among these
        wait_until(lambda: sum(1 for t0, _, _, _ in results if t0 > t_back) >= 16, 20,
                   what="16 requests sent after instance 1 was back")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)

    # The keeper waited its backoff (1 s) once (when it notices a death: tests/test_keeper_decisions.py).
    log = (deploy / "logs" / "keeper.log").read_text()
    assert [line.split(" in ")[-1] for line in log.splitlines()
            if "instance 1: dead (exited); restart" in line] == ["1s"], log
    assert t_kill < began
    failed = [(t0, s) for t0, _, s, _ in results if s != 200]
    print(f"{len(results)} requests, {len(failed)} failed; restart began {began - t_kill:.1f}s after the kill, "
          f"routed again after {t_back - t_kill:.1f}s")
    assert len(results) > 200
    assert len(failed) <= 4, failed
    assert all(t0 < t_kill for t0, _ in failed), "a request sent after the death failed"
    st = status_json(inventory)
    inst = st["instances"][1]
    assert inst["state"] == "healthy" and inst["pid"] != victim["pid"]
    # exactly one restart for the death (a shared, loaded machine may add one for a slow /health)
    assert inst["restarts_by_reason"].get("exited") == 1, inst
    assert not any(os.path.exists(f"/proc/{p}") and p in tagged_pids(st["deployment_id"] + "/1")
                   for p in orphans), "the orphaned engine child was not stopped"
    holders = card_holders(deploy, 1)
    assert holders and holders <= set(tagged_pids(f"{st['deployment_id']}/1")), holders
    assert all(b["healthy"] and not b["drained"] for b in admin_backends(admin).values())
    prom = (deploy / "run" / "keeper.prom").read_text()
    assert 'instance="1",reason="exited"} 1' in prom

    # 5. SIGSTOP instance 2's API server: /health answers nothing. After dead_after_s the keeper restarts
    #    it ("unhealthy"); once that restart began, SIGCONT the stopped process: it must not come back
    #    beside the new one, and the card is held by the new instance only.
    old2 = st["instances"][2]
    os.kill(old2["pid"], signal.SIGSTOP)
    try:
        wait_until(lambda: watch_of(deploy, 2).get("restarts") == 1, 30,
                   what="the keeper to restart the stopped instance 2")
    finally:
        os.kill(old2["pid"], signal.SIGCONT)
    wait_until(lambda: watch_of(deploy, 2).get("last_result") == "ok", 60, what="instance 2's restart to end")
    inst = status_json(inventory)["instances"][2]
    assert inst["state"] == "healthy" and inst["pid"] != old2["pid"], inst
    assert inst["last_restart_reason"] == "unhealthy", inst
    assert not os.path.exists(f"/proc/{old2['pid']}") or old2["pid"] not in tagged_pids(st["deployment_id"] + "/")
    holders = card_holders(deploy, 2)
    assert holders and holders <= set(tagged_pids(f"{st['deployment_id']}/2")), holders
    assert post(port)[0] == 200


@pytest.mark.cluster
def test_an_engine_that_exits_at_every_start_ends_in_crashloop(cluster, tmp_path):
    """1. Deploy 2 instances; then start_cluster.sh is rendered with an engine that exits at once.
    2. Kill instance 1 (its whole process group): the keeper restarts it 3 times (max_restarts), with
       growing waits, each start exiting at once.
    3. Dead again: crashloop. No restart after that; `inv status` fails, says CRASHLOOP with the log lines;
       instance 0 serves on."""
    inventory, deploy, st = cluster(base=0.3)
    out = tmp_path / "rendered"
    r = inv("render", "--host", "t", "--out", str(out), "--set", "extra_args=[--sim-fail-start]",
            "--set", f"python={sys.executable}",
            inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.copy(out / "bin" / "start_cluster.sh", deploy / "bin" / "start_cluster.sh")
    os.killpg(st["instances"][1]["pgid"], signal.SIGKILL)

    wait_until(lambda: watch_of(deploy, 1).get("crashloop"), 60, what="instance 1 to be put in crashloop")
    w = watch_of(deploy, 1)
    assert w["restarts"] == 3 and w["state"] == "crashloop", w
    # (that no restart comes after it, however long: tests/test_keeper_decisions.py, on the decisions)
    log = (deploy / "logs" / "keeper.log").read_text()
    waits = [float(line.split(" in ")[-1].rstrip("s\n")) for line in log.splitlines()
             if "instance 1: dead (exited); restart" in line]
    assert waits == [0.3, 0.6, 1.2], waits
    assert "CRASHLOOP" in log

    st = status_json(inventory)
    assert st["instances"][1]["state"] == "crashloop" and st["instances"][1]["restarts"] == 3
    assert st["instances"][0]["state"] == "healthy"
    r = inv("status", "--host", "t", inventory=inventory)
    assert r.returncode == 2
    assert "CRASHLOOP" in r.stdout + r.stderr
    assert "Engine core initialization failed" in r.stdout + r.stderr

    # 4. The operator drains it, fixes the cause: `inv restart` puts the good start_cluster.sh back and
    # starts it, which clears crashloop, and gives the backend back to the proxy.
    admin = st["proxy"]["port"] + 1
    name = f"127.0.0.1:{st['instances'][1]['port']}"
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{admin}/admin/backends/{name}/drain",
                                                  data=b"", method="POST"), timeout=5).read()
    r = inv("restart", "--host", "t", "--instance", "1", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_until(lambda: not watch_of(deploy, 1).get("crashloop") and watch_of(deploy, 1).get("state") == "healthy",
               10, what="the keeper to clear crashloop")
    after = status_json(inventory)
    assert after["instances"][1]["state"] == "healthy" and after["instances"][1]["restarts"] == 3
    assert admin_backends(admin)[name]["healthy"] and not admin_backends(admin)[name]["drained"]

    # 5. A stop refused by the lock leaves the keeper running: `inv stop` stops the keeper first (it must
    # not restart what a stop takes down), is refused by the lock naming the holder, and starts the
    # keeper again: a refused stop must not leave the instances without their keeper.
    held = lock.try_hold(str(deploy), "inv deploy (this test)")
    assert held is not None
    try:
        r = inv("stop", "--host", "t", inventory=inventory)
        assert r.returncode != 0 and "another run holds" in r.stdout + r.stderr, r.stdout + r.stderr
        assert "keeper: started again" in r.stdout + r.stderr, r.stdout + r.stderr
    finally:
        held.release()
    again = status_json(inventory)
    assert again["keeper"]["state"] == "running" and again["keeper"]["pid"] != after["keeper"]["pid"], again
    assert [i["state"] for i in again["instances"]] == ["healthy", "healthy"]


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_a_stall_is_restarted_and_a_busy_instance_is_not(cluster):
    """The stall probe end to end, on one cluster of two instances with stall_probe on:
    1. Instance 0 is saturated by 8 clients whose requests take 2 s, above the probe's 1 s timeout: its
       probes queue and time out, but the engine's generated-token counter moves: "busy", never a restart,
       and every client request is answered 200.
    2. Instance 1 stalls (the sim's stall fault: /health 200, no token): the probe fails twice and the
       keeper restarts it for "stalled"; it serves again, its card held by its new instance only."""
    inventory, deploy, st = cluster(probe=True)
    dep = st["deployment_id"]
    busy_port, old1 = st["instances"][0]["port"], st["instances"][1]
    stop = threading.Event()
    codes = []

    def client():
        while not stop.is_set():
            codes.append(post(busy_port, max_tokens=400)[0])     # 400 tokens x 5 ms: 2 s

    threads = [threading.Thread(target=client) for _ in range(8)]   # 4 running, 4 waiting
    for t in threads:
        t.start()
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{old1['port']}/sim/fault",
                                     json.dumps({"fault": "stall"}).encode(), {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()
        wait_until(lambda: (watch_of(deploy, 0).get("probes") or {}).get("busy", 0) >= 3, 30,
                   what="three stall probes on instance 0 to time out behind the load")
        wait_until(lambda: watch_of(deploy, 1).get("last_result") == "ok", 60, what="instance 1's restart to end")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    w = watch_of(deploy, 0)
    assert w["restarts"] == 0 and w["probes"].get("timeout", 0) == 0, w
    assert codes and set(codes) == {200}, codes
    inst = status_json(inventory)["instances"][1]
    assert inst["state"] == "healthy" and inst["pid"] != old1["pid"], inst
    assert inst["last_restart_reason"] == "stalled", inst
    assert not os.path.exists(f"/proc/{old1['pid']}") or old1["pid"] not in tagged_pids(dep + "/")
    holders = card_holders(deploy, 1)
    assert holders and holders <= set(tagged_pids(f"{dep}/1")), holders
    assert "stall probe timed out (2/2)" in (deploy / "logs" / "keeper.log").read_text()
    assert post(st["proxy"]["port"])[0] == 200


@pytest.mark.cluster
def test_stop_during_a_restart_leaves_nothing(cluster):
    """1. Instances take 3 s to load. Kill instance 0's process group: the keeper begins its restart.
    2. While the restart waits for /health, `inv stop`: the keeper is stopped first (its restart is
       cancelled), then everything else.
    3. Nothing with the deployment's tag is left, and nothing restarts in the seconds after."""
    inventory, deploy, st = cluster(base=0.2, sim="{load_s: 3, prefill_ms: 20, token_ms: 5}")
    dep = st["deployment_id"]
    os.killpg(st["instances"][0]["pgid"], signal.SIGKILL)
    wait_until(lambda: "instance 0: started pid" in (deploy / "logs" / "keeper.log").read_text(), 30,
               what="the keeper's restart to start instance 0")
    r = inv("stop", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    # Nothing can start later: the keeper and every process a restart starts carry the deployment's tag
    # from their exec (children inherit it), so with none left there is no parent left to start one.
    assert tagged_pids(dep + "/") == []
    assert not list((deploy / "run").glob("*.pid"))
    log = (deploy / "logs" / "keeper.log").read_text()
    assert "restart cancelled: the keeper is stopping" in log
    st = status_json(inventory)
    assert st["keeper"]["state"] == "stopped" and all(i["state"] == "stopped" for i in st["instances"])


@pytest.mark.unit
def test_the_keeper_log_is_rotated(tmp_path):
    """logs/keeper.log rotates at proxy.results_log.max_mb, keeping proxy.results_log.backups files."""
    (tmp_path / "logs").mkdir()
    cfg = {"deploy_dir": str(tmp_path), "log_max_mb": 0.001, "log_backups": 2}
    root = logging.getLogger()
    before = list(root.handlers)
    keeper.setup_logging(cfg)
    try:
        for n in range(200):
            keeper.log.warning("line %d of the keeper's log", n)
    finally:
        for h in set(root.handlers) - set(before):
            root.removeHandler(h)
            h.close()
    names = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert names == ["keeper.log", "keeper.log.1", "keeper.log.2"], names
    assert all(p.stat().st_size <= 1100 for p in (tmp_path / "logs").iterdir())
