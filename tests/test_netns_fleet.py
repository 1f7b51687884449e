"""A fleet of separate hosts for real: each host a network namespace with its own address and sshd
(tests/netns.py), reached over SSH by address. Deploy, status, chat and stop across an entry host and
its members; a member's link cut under load; a member's sshd gone during a deploy; --forks; the keeper
on a member while the entry routes around it.

Every namespace has its own ports, so each host uses the defaults (8000, 8001, 8002 + i) as a real
server would. The hosts share this machine's files and processes: deploy_dir is a directory of the
test's, and the test sees the hosts' processes by pid and tag.
"""
from __future__ import annotations

import copy
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, wait_until
from fleet_helpers import inv, stop_by_own_scripts, tagged_pids
from netns import NetnsFleet, made_by, namespace_pids, netns_fleet  # noqa: F401  (the fixture)
from proxy_helpers import results_lines

from hostagent import layout

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
    for key, value in copy.deepcopy(extra).items():
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
    from fleet.settings import inventory as inv_mod
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
    except (OSError, ValueError, http.client.HTTPException):    # refused, reset, or a stream cut short
        return None, None, time.monotonic() - t0


def admin_backends(fleet: NetnsFleet, i: int) -> dict:
    """The proxy's own view of its backends on host i (its admin port is loopback-only, so from inside the
    host's namespace): name -> its entry of GET /admin/backends."""
    url = "http://127.0.0.1:8001/admin/backends"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
    r = fleet.hosts[i].run(PYTHON, "-c", code, check=False)
    return {b["name"]: b for b in json.loads(r.stdout)} if r.returncode == 0 else {}


def streams_in_flight(fleet: NetnsFleet, i: int, backends: set[str], age_s: float) -> int:
    """How many streams (Load's: user `load-K-N`, streamed when K + N is odd) host i's proxy has had in
    flight on backends for at least age_s (their first chunks out)."""
    url = "http://127.0.0.1:8001/admin/requests"
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
    r = fleet.hosts[i].run(PYTHON, "-c", code, check=False)
    found = json.loads(r.stdout) if r.returncode == 0 else []
    return sum(1 for x in found if x["backend"] in backends and x["age_s"] >= age_s
               and str(x["trace_id"]).startswith("load-") and sum(map(int, x["trace_id"].split("-")[1:])) % 2 == 1)


class Load:
    """Client threads sending chat requests to an entry port until stopped or bounded (count and time):
    each request's start, end, status, backend and whether it streamed, in the order they ended."""

    def __init__(self, address: str, threads: int = 8, max_requests: int = 3000, max_s: float = 240,
                 max_tokens: int = 30, timeout: float = 120, pause_after_failure_s: float = 0):
        self.address, self.max_requests, self.max_s, self.max_tokens = address, max_requests, max_s, max_tokens
        self.timeout, self.pause_after_failure_s = timeout, pause_after_failure_s
        self.done: list[dict] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.sent = 0
        self.active: dict[int, float] = {}    # thread -> when its request in flight started
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def __enter__(self) -> "Load":
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=120)

    def _run(self, k: int) -> None:
        n = 0
        while not self.stopping.is_set() and time.monotonic() - self.t0 < self.max_s:
            with self.lock:
                if self.sent >= self.max_requests:
                    return
                self.sent += 1
            stream = (k + n) % 2 == 0     # half of them streamed, half whole answers
            n += 1
            start = time.monotonic()
            with self.lock:
                self.active[k] = start
            try:
                code, backend, took = post(self.address, max_tokens=self.max_tokens, timeout=self.timeout,
                                           stream=stream, user=f"load-{k}-{n}")
            finally:
                with self.lock:
                    del self.active[k]
            with self.lock:
                self.done.append({"start": start, "end": start + took, "status": code, "backend": backend,
                                  "stream": stream})
            if code != 200 and self.pause_after_failure_s:
                self.stopping.wait(self.pause_after_failure_s)     # a client backing off

    def started_before(self, t: float) -> int:
        """How many requests started before t are still in flight."""
        with self.lock:
            return sum(1 for start in self.active.values() if start < t)

    def count(self, predicate=lambda d: True) -> int:
        with self.lock:
            return sum(1 for d in self.done if predicate(d))


@pytest.fixture
def cleanup():
    """Stop what the test deployed, then a sweep by tag (never by name); runs before the fleet's own teardown
    (requested after netns_fleet). The hosts' files are this machine's: each host's own stop script runs
    here, all at once (fleet_helpers.stop_by_own_scripts); `inv stop` across the namespaces is
    test_deploy_status_chat_stop_across_namespaces's own subject."""
    deployed: list[Path] = []
    yield deployed
    for inventory in deployed:
        stop_by_own_scripts(inventory)


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


def test_teardown_removes_every_namespace_link_and_process_of_the_fleet(tmp_path):
    """1. build a fleet of two hosts; they reach each other and the control node reaches them; 2. a
    process left running inside a namespace; 3. teardown kills it and the sshds, and removes the
    namespaces, the veths and the bridge: nothing of the fleet is left on the machine."""
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
    assert left.wait(timeout=10) == -signal.SIGTERM
    assert made_by(fleet) == []
    assert not [p for p in fleet.pids + killed if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]


def test_member_sshd_stopped_deploy_reports_it_unreachable(netns_fleet, tmp_path, cleanup):
    """1. the entry and four members; m3's sshd is stopped (its port refuses connections); 2. `inv deploy
    --host fleet` reports m3 UNREACHABLE in one sentence and its recap says unreachable=1; 3. the other
    members deploy and serve, and the entry deploys fronting them (m3's backends unhealthy, requests
    through the entry all answered); 4. exit code 4."""
    fleet = netns_fleet(5)
    inventory = fleet_inventory(fleet, tmp_path)
    cleanup.append(inventory)
    down = fleet.hosts[3]
    fleet.stop_sshd(down)

    r = inv("deploy", "--host", "fleet", inventory=inventory)
    assert r.returncode == 4, r.stdout + r.stderr
    assert recap(r.stdout, "m3")["unreachable"] == 1, r.stdout
    assert re.search(rf"^m3: UNREACHABLE: m3: cannot reach {re.escape(down.address)}:22 .*; check the "
                     r"address and that sshd runs there\.$", r.stderr, re.M), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    for name in ("entry", "m1", "m2", "m4"):
        assert recap(r.stdout, name)["unreachable"] == 0 and recap(r.stdout, name)["failed"] == 0, r.stdout
    assert not (tmp_path / "h3").exists()

    st = statuses(inventory, "entry,m1,m2,m4")
    for name in ("m1", "m2", "m4"):
        assert [x["state"] for x in st[name]["instances"]] == ["healthy", "healthy"], st[name]
    healthy = {x["name"] for x in st["entry"]["proxy"]["backends"] if x["healthy"]}
    assert healthy == {f"{fleet.hosts[i].address}:{BASE + k}" for i in (1, 2, 4) for k in range(2)}
    answers = [post(fleet.hosts[0].address)[:2] for _ in range(12)]
    assert all(code == 200 for code, _ in answers), answers
    assert not any(backend.startswith(down.address + ":") for _, backend in answers)


def test_forks_deploys_hosts_in_parallel(netns_fleet, tmp_path, cleanup):
    """1. four hosts (no entry) whose instances take 15 s to load, as a real engine's take longer;
    2. `inv deploy --forks 4`: every host is deployed; 3. the hosts were deployed at once: every host's
    instances had started (their pid files written) before any host's were seen healthy (their ready
    markers), an order --forks 1 cannot give, since it waits for each host's health before the next.

    Why the order holds on a loaded machine: the hosts' deploys start together and each spends a few
    seconds of work (SSH, the doctor, the sims' imports) before its instances start; the spread of those
    starts stays under the instances' 15 s of loading, which is pure waiting."""
    fleet = netns_fleet(4)
    slow = {"load_s": 15}
    inventory = fleet_inventory(fleet, tmp_path, members=3, entry=False, sim=slow)
    hosts = yaml.safe_load(inventory.read_text())
    hosts["hosts"] = {"m0": member(fleet, 0, tmp_path, sim=slow), **hosts["hosts"]}
    hosts["groups"]["fleet"]["hosts"] = list(hosts["hosts"])
    inventory.write_text(yaml.safe_dump(hosts, sort_keys=False))
    cleanup.append(inventory)

    t0 = time.monotonic()
    r = inv("deploy", "--host", "fleet", "--forks", "4", inventory=inventory)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("m0", "m1", "m2", "m3"):
        assert recap(r.stdout, name)["failed"] == 0, r.stdout
    dirs = [Path(h["deploy_dir"]) for h in hosts["hosts"].values()]
    started = [(d / layout.instance_pidfile(i)).stat().st_mtime for d in dirs for i in range(2)]
    ready = [(d / layout.instance_ready(i)).stat().st_mtime for d in dirs for i in range(2)]
    print(f"\ndeploy of 4 hosts x 2 sim instances (load_s 15), --forks 4: {took:.1f}s; the last start "
          f"{max(started) - min(started):.1f}s after the first, the first ready {min(ready) - min(started):.1f}s after it")
    assert max(started) < min(ready), (started, ready)


def test_member_link_down_under_load(netns_fleet, tmp_path, cleanup):
    """1. the entry and four members (2 sim instances each, ~2.5 s answers); 8 clients send requests
    through the entry, half of them streamed; 2. while the entry has requests in flight on m2, m2's link
    goes down inside its namespace (`ip link set eth0 down`): no RST, no FIN, its packets simply vanish;
    3. the entry ejects m2's two backends; every request that had not started on m2 before the cut
    succeeds (new ones sent to m2 before the ejection are retried elsewhere); the attempts in flight on
    m2 end within seconds while the link is still down, not at the 300 s upstream timeout: a whole
    answer not begun is retried on another backend, a stream already begun is finished on another member
    (proxy.resume: the entry's health check takes m2 out, the stream's wait for its next chunk sees it);
    nothing fails; 4. the link comes
    back: m2's backends return to service without any command, and requests reach them again. The
    counts and the latencies are printed."""
    fleet = netns_fleet(5)
    inventory = fleet_inventory(fleet, tmp_path, sim={"token_ms": 20, "output_tokens": 200})
    cleanup.append(inventory)
    r = inv("deploy", "--host", "fleet", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    victim = fleet.hosts[2]
    on_victim = {f"{victim.address}:{BASE + k}" for k in range(2)}
    entry = fleet.hosts[0].address

    def victim_view() -> list[dict]:
        view = admin_backends(fleet, 0)
        return [view[name] for name in on_victim if name in view]

    with Load(entry, max_tokens=120) as load:
        try:
            wait_until(lambda: load.count(lambda d: d["status"] == 200 and d["backend"] in on_victim) >= 4,
                       120, 0.2, what="load reaching m2")
            wait_until(lambda: sum(b["in_flight"] for b in victim_view()) >= 2
                       and streams_in_flight(fleet, 0, on_victim, 0.3) >= 1, 60, 0.05,
                       what="two requests in flight on m2, a stream among them")
            t_cut = time.monotonic()
            victim.link(up=False)
            wait_until(lambda: {b["healthy"] for b in victim_view()} == {False}, 60, 0.2,
                       what="the entry ejecting m2's backends")
            t_ejected = time.monotonic()
            # The requests in flight at the cut end while the link is still down: none waits for it.
            wait_until(lambda: load.started_before(t_cut) == 0, 60, 0.2,
                       what="the requests in flight at the cut to end with m2's link down")
            t_settled = time.monotonic()
            # Load goes on around m2 for a while.
            after = load.count()
            wait_until(lambda: load.count() >= after + 40, 120, 0.2, what="requests served around m2")
            t_up = time.monotonic()
        finally:
            victim.link(up=True)
        wait_until(lambda: {b["healthy"] for b in victim_view()} == {True}, 60, 0.2,
                   what="m2's backends healthy again")
        t_back = time.monotonic()
        wait_until(lambda: load.count(lambda d: d["start"] > t_back and d["status"] == 200
                                      and d["backend"] in on_victim) >= 2, 60, 0.2,
                   what="requests served by m2 again")
    done = load.done
    failed = [d for d in done if d["status"] != 200]
    ok = [d for d in done if d["status"] == 200]
    in_flight_at_cut = [d for d in done if d["start"] < t_cut < d["end"]]
    # The entry's own account of its attempts on m2 that failed (the results log, one line per attempt).
    attempts = results_lines(tmp_path / "h0/logs/req_results.log")
    lost = [a for a in attempts if a["backend"] in on_victim and (a["status"] != 200 or a.get("error"))]
    latencies = ", ".join(f"{d['end'] - t_cut:.1f}s" for d in failed) or "-"
    lost_after = ", ".join(f"{a['attempt_ms'] / 1000:.1f}s" for a in lost)
    lost_why = "; ".join(sorted({str(a.get("error"))[:70] for a in lost}))
    print(f"\nlink down on m2 under load: {len(done)} requests, {len(ok)} succeeded, {len(failed)} failed "
          f"({sum(d['stream'] for d in failed)} streamed), ending {latencies} after the cut; "
          f"{len(in_flight_at_cut)} in flight at the cut; the entry's attempts on m2 that failed: "
          f"{len(lost)}, after {lost_after} ({lost_why}); ejected {t_ejected - t_cut:.1f}s "
          f"after the cut; the last request in flight at the cut ended {t_settled - t_cut:.1f}s after it; "
          f"back in service {t_back - t_up:.1f}s after the link came up")
    # Requests were in flight on m2 when its link went down, and each such attempt ended fast.
    assert lost, attempts[-20:]
    assert all(a["attempt_ms"] < 30_000 for a in lost), lost
    # Nothing failed: a stream begun on m2 went on on another member, in its client's stream.
    assert not failed, failed
    cut_streams = [d for d in in_flight_at_cut if d["stream"] and d["backend"] in on_victim]
    resumed = [a for a in attempts if a.get("resumed") and a["backends"][0] in on_victim]
    print(f"streams begun on m2 at the cut: {len(cut_streams)}, resumed on another member: {len(resumed)} "
          f"(gaps {[a['resume_gap_ms'] for a in resumed]} ms)")
    assert len(resumed) >= len(cut_streams) and all(a["backends"][1] not in on_victim for a in resumed), resumed
    # While the link was down nothing was answered by m2, and everything else was answered.
    assert not [d for d in ok if d["backend"] in on_victim and t_cut + 1 < d["start"] and d["end"] < t_up]
    assert all(d["status"] == 200 for d in done if d["start"] >= t_cut)


def test_keeper_on_a_member_restarts_a_killed_instance(netns_fleet, tmp_path, cleanup):
    """1. the entry and two members, the members' keepers with small timings; 8 clients send requests
    through the entry; 2. SIGKILL of m1's instance 0 (its API server only: its engine child lives on as
    an orphan holding the card, as vLLM's EngineCore does); 3. the entry takes that backend out and
    every request started after the kill is answered 200 by the others; 4. m1's keeper finds the
    instance dead, stops the orphan, starts it again (a new pid) and the entry routes to it again
    without any command; `inv status` shows it healthy."""
    fleet = netns_fleet(3)
    keeper = {"dead_after_s": 3, "backoff_base_s": 1, "backoff_max_s": 4, "max_restarts": 3, "window_s": 120}
    inventory = fleet_inventory(fleet, tmp_path, members=2, keeper=keeper, release_timeout_s=20)
    cleanup.append(inventory)
    r = inv("deploy", "--host", "fleet", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    old = statuses(inventory, "m1")["m1"]["instances"][0]
    name = f"{fleet.hosts[1].address}:{BASE}"
    entry = fleet.hosts[0].address

    with Load(entry, max_tokens=30) as load:
        wait_until(lambda: load.count(lambda d: d["status"] == 200 and d["backend"] == name) >= 2, 120, 0.2,
                   what="load reaching m1's instance 0")
        t_kill = time.monotonic()
        os.kill(old["pid"], signal.SIGKILL)
        wait_until(lambda: admin_backends(fleet, 0).get(name, {}).get("healthy") is False, 60, 0.2,
                   what="the entry taking the killed backend out")
        t_out = time.monotonic()
        wait_until(lambda: (lambda i: i["state"] == "healthy" and i["pid"] != old["pid"])(
            statuses(inventory, "m1")["m1"]["instances"][0]), 120, 0.5, what="m1's keeper restarting instance 0")
        t_restarted = time.monotonic()
        wait_until(lambda: load.count(lambda d: d["start"] > t_restarted and d["status"] == 200
                                      and d["backend"] == name) >= 2, 60, 0.2,
                   what="the entry routing to the restarted instance")
    done = load.done
    failed = [d for d in done if d["status"] != 200]
    ends = ", ".join(f"{d['end'] - t_kill:.1f}s" for d in failed) or "-"
    print(f"\nkeeper on m1: {len(done)} requests, {len(done) - len(failed)} succeeded, {len(failed)} failed "
          f"(ending {ends} after the kill); "
          f"out of the entry {t_out - t_kill:.1f}s after the kill, healthy again after "
          f"{t_restarted - t_kill:.1f}s")
    # Only requests in flight on the killed instance may fail, and none started after the kill.
    assert all(d["start"] < t_kill for d in failed), failed
    assert len(failed) <= 6, failed       # its slots: max_num_seqs 4 + the proxy's headroom
    assert all(d["status"] == 200 for d in done if d["start"] > t_kill)
    keeper_log = (tmp_path / "h1/logs/keeper.log").read_text()
    assert "instance 0" in keeper_log, keeper_log[-2000:]
    st = statuses(inventory, "m1")["m1"]
    assert [i["state"] for i in st["instances"]] == ["healthy", "healthy"]
