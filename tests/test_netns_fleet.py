"""A fleet of separate hosts for real: each host a network namespace with its own address and sshd
(tests/netns.py), reached over SSH by address. Deploy, status, chat and stop across an entry host and
its members; a member's link cut under load; a member's sshd gone during a deploy; --forks; the keeper
on a member while the entry routes around it.

Every namespace has its own ports, so each host uses the defaults (8000, 8001, 8002 + i) as a real
server would. The hosts share this machine's files and processes: deploy_dir is a directory of the
test's, and the test sees the hosts' processes by pid and tag.
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import PYTHON, wait_until
from fleet_helpers import inv, kill_tagged, tagged_pids
from netns import NetnsFleet, made_by, namespace_pids, netns_fleet  # noqa: F401  (the fixture)

# Namespaces are this machine's network: one fleet at a time (their load tests must not compete for the
# cores either), on one worker, one test after the other.
pytestmark = [pytest.mark.netns, pytest.mark.ssh, pytest.mark.cluster, pytest.mark.xdist_group("netns"),
              pytest.mark.timeout(600)]

SIM = {"load_s": 0.3, "prefill_ms": 5, "token_ms": 2, "output_tokens": 8}
PORT, BASE = 8000, 8002          # the defaults: every host has its own network, hence its own ports


def member(fleet: NetnsFleet, i: int, tmp_path: Path, instances: int = 2, **extra) -> dict:
    """Host i of the fleet as an inventory host: a sim cluster over SSH by address, deploy_dir in tmp_path."""
    host = fleet.hosts[i]
    vars_ = {"ssh": fleet.ssh_block(host), "engine": "sim", "accelerator": "sim",
             "accelerators": max(instances, 1), "instances": instances, "model": "/models/Test-Model",
             "python": PYTHON, "deploy_dir": str(tmp_path / f"h{i}"), "stagger_s": 0,
             "health_timeout_s": 60, "stop_grace_s": 3, "sim": dict(SIM),
             "proxy": {"health_interval_s": 0.5, "connect_timeout_s": 2}}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(vars_.get(key), dict):
            vars_[key] = {**vars_[key], **value}
        else:
            vars_[key] = value
    return vars_


def fleet_inventory(fleet: NetnsFleet, tmp_path: Path, members: int = 4, entry: bool = True,
                    **extra) -> Path:
    """Hosts m1..m<members> (namespaces 1..), and with entry the host `entry` (namespace 0) fronting them
    all; the group `fleet` holds every one of them."""
    hosts = {f"m{i}": member(fleet, i, tmp_path, **extra) for i in range(1, members + 1)}
    if entry:
        hosts = {"entry": member(fleet, 0, tmp_path, instances=0, fronts=list(hosts), **extra), **hosts}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"hosts": hosts, "groups": {"fleet": {"hosts": list(hosts)}}},
                                   sort_keys=False))
    return path


def recap(output: str, host: str) -> dict:
    m = re.search(rf"^{re.escape(host)} : ok=(\d+) changed=(\d+) skipped=(\d+) failed=(\d+) "
                  r"unreachable=(\d+)$", output, re.M)
    assert m, output
    return dict(zip(["ok", "changed", "skipped", "failed", "unreachable"], map(int, m.groups())))


def dep_ids(inventory: Path) -> list[str]:
    from fleet import inventory as inv_mod
    loaded = inv_mod.load(inventory)
    return [loaded.host_vars(h).deployment_id for h in loaded.select("all")]


def statuses(inventory: Path, host: str = "fleet") -> dict:
    r = inv("status", "--host", host, "--json", inventory=inventory)
    assert r.returncode in (0, 2, 4), r.stdout + r.stderr
    return {s["host"]: s for s in json.loads(r.stdout)}


def post(address: str, max_tokens: int = 8, timeout: float = 60, stream: bool = False,
         user: str = "netns") -> tuple[int | None, str | None, float]:
    """One chat completion through an entry port: (status or None when the connection failed, X-Backend,
    seconds it took). A stream is read to its end; a broken one is a failure (None)."""
    body = json.dumps({"model": "Test-Model", "max_tokens": max_tokens, "user": user, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"http://{address}:{PORT}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
            if stream and not data.rstrip().endswith(b"data: [DONE]"):
                return None, r.headers.get("X-Backend"), time.monotonic() - t0
            return r.status, r.headers.get("X-Backend"), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Backend"), time.monotonic() - t0
    except (OSError, ValueError):
        return None, None, time.monotonic() - t0


@pytest.fixture
def cleanup():
    """Stop what the test deployed (inv stop over SSH), then a sweep by tag (never by name); runs before
    the fleet's own teardown (requested after netns_fleet)."""
    deployed: list[Path] = []
    yield deployed
    for inventory in deployed:
        inv("stop", "--host", "all", "--forks", "8", inventory=inventory)
        for dep in dep_ids(inventory):
            kill_tagged(dep + "/")


def test_deploy_status_chat_stop_across_namespaces(netns_fleet, tmp_path, cleanup):
    """1. five namespaces: the entry and four members of 2 sim instances each, over SSH by address;
    2. `inv deploy --host fleet` brings the members up, then the entry's proxy fronting all 8 instances;
    3. each member's engines listen on its own address only (not loopback, not every address);
    4. `inv status` reads every host back, the entry's 8 backends healthy; 5. `inv chat` through the
    entry answers, and requests reach every member; 6. `inv stop --host fleet` stops every process the
    deployment had in every namespace."""
    fleet = netns_fleet(5)
    inventory = fleet_inventory(fleet, tmp_path)
    cleanup.append(inventory)
    entry = fleet.hosts[0].address
    backends = {f"{fleet.hosts[i].address}:{BASE + k}" for i in range(1, 5) for k in range(2)}

    r = inv("deploy", "--host", "fleet", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("entry", "m1", "m2", "m3", "m4"):
        assert recap(r.stdout, name)["failed"] == 0, r.stdout
    # The members were up before the entry started its proxy.
    assert r.stdout.index("m4 | instance 1: healthy") < r.stdout.index("entry | proxy: started")

    for i in range(1, 5):
        address = fleet.hosts[i].address
        listening = fleet.hosts[i].listening()
        for k in range(2):
            assert f"{address}:{BASE + k}" in listening, listening
            assert not {f"127.0.0.1:{BASE + k}", f"0.0.0.0:{BASE + k}", f"*:{BASE + k}",
                        f"[::]:{BASE + k}"} & set(listening), listening
    # The entry runs no instance of its own.
    assert not any(a.endswith((f":{BASE}", f":{BASE + 1}")) for a in fleet.hosts[0].listening())

    st = statuses(inventory)
    for i in range(1, 5):
        assert [x["state"] for x in st[f"m{i}"]["instances"]] == ["healthy", "healthy"], st[f"m{i}"]
    assert {x["name"] for x in st["entry"]["proxy"]["backends"] if x["healthy"]} == backends

    r = inv("chat", "--host", "entry", "--max-tokens", "4", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"X-Backend: (\S+),", r.stdout)
    assert m and m.group(1) in backends, r.stdout
    seen = set()
    for _ in range(40):
        code, backend, _ = post(entry)
        assert code == 200
        seen.add(backend)
        if seen == backends:
            break
    assert seen == backends

    r = inv("stop", "--host", "fleet", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    for dep in dep_ids(inventory):
        assert tagged_pids(dep + "/") == [], dep
    st = statuses(inventory)
    for i in range(1, 5):
        assert {x["state"] for x in st[f"m{i}"]["instances"]} == {"stopped"}
    # Only the fixture's sshds are left in the namespaces (an SSH session's own sshd ends as it closes).
    wait_until(lambda: set(namespace_pids(fleet)) <= set(fleet.pids), 10, what="only the sshds left")
    assert post(entry, timeout=5)[0] is None


def test_fixture_removes_everything(tmp_path):
    """1. build a fleet of two hosts; they reach each other and the control node reaches them; 2. a
    process left running inside a namespace; 3. teardown kills it and the sshds, and removes the
    namespaces, the veths and the bridge: nothing of the fleet is left on the machine."""
    import subprocess
    from netns import build, teardown
    fleet = build(tmp_path / "fleet", 2)
    try:
        a, b = fleet.hosts
        probe = f"import socket; socket.create_connection(('{b.address}', 22), 5); print('ok')"
        assert a.run(PYTHON, "-c", probe).stdout.strip() == "ok"
        left = subprocess.Popen(a.exec_argv("sleep", "600"), start_new_session=True)
        wait_until(lambda: left.pid in namespace_pids(fleet), 10, what="the sleep inside the namespace")
    finally:
        killed = teardown(fleet)
    assert left.pid in killed
    assert made_by(fleet) == []
    assert not [p for p in fleet.pids + killed if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
