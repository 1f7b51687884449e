"""Restarts through the proxy's drain: a rolling restart under continuous load fails no request."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory


def post_chat(port: int) -> int | None:
    body = json.dumps({"model": "Test-Model", "max_tokens": 8, "user": "load",
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def admin_backends(port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/backends", timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_rolling_restart_under_load_fails_no_request(tmp_path):
    """1. deploy 4 sim instances behind the proxy; 2. 4 clients send requests without pause and a monitor
    reads the proxy's backends; 3. `inv restart --rolling`; 4. every instance has a new pid, no request
    failed, requests were served throughout, and never more than one backend was out of service."""
    inventory = write_inventory(tmp_path, extra="release_timeout_s: 20\n")
    dep = deployment_id(inventory)
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        st = status_json(inventory)
        port, admin = st["proxy"]["port"], st["proxy"]["port"] + 1
        old_pids = [i["pid"] for i in st["instances"]]

        stop = threading.Event()
        results: list[int | None] = []
        out_of_service: list[int] = []

        def client():
            while not stop.is_set():
                results.append(post_chat(port))

        def monitor():
            while not stop.is_set():
                try:
                    bs = admin_backends(admin)
                    out_of_service.append(sum(1 for b in bs if b["drained"] or not b["healthy"]))
                except OSError:
                    out_of_service.append(-1)
                time.sleep(0.05)

        threads = [threading.Thread(target=client) for _ in range(4)] + [threading.Thread(target=monitor)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: results.count(200) >= 4, what="the clients' first answers")
            t0 = time.monotonic()
            r = inv("restart", "--host", "t", "--rolling", inventory=inventory, timeout=240)
            took = time.monotonic() - t0
            before = len(results)   # every client goes on being answered after the restart
            wait_until(lambda: results[before:].count(200) >= 4, what="4 answers after the restart")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        for i in range(4):
            assert f"instance {i}: drained 127.0.0.1:" in r.stdout and f"instance {i}: back in the proxy" in r.stdout
        failed = [s for s in results if s != 200]
        print(f"rolling restart of 4 instances: {took:.1f}s, {len(results)} requests, {len(failed)} failed")
        assert len(results) > 50 and failed == [], (len(results), failed[:10])
        assert out_of_service and max(out_of_service) == 1 and -1 not in out_of_service
        st = status_json(inventory)
        assert all(i["state"] == "healthy" for i in st["instances"])
        assert all(i["pid"] != old for i, old in zip(st["instances"], old_pids))
        assert all(not b["drained"] and b["healthy"] for b in admin_backends(admin))
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


@pytest.mark.unit
def test_restart_needs_instance_or_rolling(tmp_path):
    inventory = write_inventory(tmp_path)
    r = inv("restart", "--host", "t", inventory=inventory)
    assert r.returncode == 2 and "needs either --instance I or --rolling" in r.stderr
    r = inv("restart", "--host", "t", "--instance", "9", inventory=inventory)
    assert r.returncode == 2 and "there is no instance 9; instances are 0-3" in r.stderr + r.stdout
