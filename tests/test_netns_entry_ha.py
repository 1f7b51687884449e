"""No single entry: two entry hosts behind two virtual addresses (keepalived, VRRP, unicast), in network
namespaces with the real keepalived, under load through the addresses (docs/entry-ha.md).

One topology for the module (tests/netns.py): entries e1 and e2 (namespaces 0 and 1, no instance of their
own) front m1 (namespace 2: two sim instances of max_num_seqs 2), all deployed over SSH by `inv deploy`.
Address A (.100) is e1's to master, B (.101) e2's: active-active, so each proxy has half of every
engine's slots. The tests run in order, each failing whichever entry holds A at the time, so A moves
back and forth: a graceful `inv stop`, a SIGKILL of the proxy, a SIGKILL of keepalived itself (the stale
address case), and a cut link; then, on the same topology, a deploy that changes a vrrp setting on both
entries at once (each keepalived reloads in turn) and a swap to nginx and back (keepalived stays). A
sampler reads `ip addr` in both namespaces every few tens of milliseconds throughout; no read ever proves
one address on both. Figures print with `-s`; the module's
fixture prints the table of them at the end (docs/PERFORMANCE.md quotes it).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import yaml

from conftest import PYTHON, wait_until
from fleet_helpers import inv, kill_tagged
from hostagent import layout, processes
from netns import build, teardown
from test_netns_fleet import Load, dep_ids, member, recap

pytestmark = [pytest.mark.netns, pytest.mark.ssh, pytest.mark.cluster, pytest.mark.xdist_group("entry_ha"),
              pytest.mark.timeout(300)]

SIM = {"load_s": 0.3, "prefill_ms": 5, "token_ms": 20, "output_tokens": 20}   # about 0.4 s an answer
ENTRIES = ("e1", "e2")
FIGURES: dict[str, str] = {}


class Sampler:
    """`ip -o -4 addr` of e1's and e2's eth0 in turn, every few ms, in a thread: a stream of reads
    (time, entry, the addresses it had). An address is proven on both at once when one entry's read shows
    it between two reads of the other that both show it (no address moves twice within milliseconds), so
    the order of the reads never makes a move look like an overlap."""

    def __init__(self, fleet, addresses):
        self.fleet, self.addresses = fleet, addresses
        self.reads: list[tuple[float, str, set[str]]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        env = {"PATH": os.environ["PATH"]}     # its own: the test's in-process `inv` runs change os.environ
        while not self.stopping.is_set():
            for i in (0, 1):
                out = subprocess.run(["ip", "-n", self.fleet.hosts[i].netns, "-o", "-4", "addr", "show", "dev",
                                      "eth0"], capture_output=True, text=True, env=env).stdout
                self.reads.append((time.monotonic(), ENTRIES[i], {a for a in self.addresses if f" {a}/" in out}))
            time.sleep(0.01)

    def holder(self, address: str) -> set[str]:
        """Who had address at each entry's last read."""
        assert self.thread.is_alive() or self.stopping.is_set(), "the address sampler died (its traceback is above)"
        last = {}
        for _, entry, held in list(self.reads)[-2:]:
            last[entry] = address in held
        return {e for e, has in last.items() if has}

    def both(self) -> list[tuple[float, str]]:
        """(time, address) of every read that proves an address on both entries."""
        r = list(self.reads)
        return [(r[k][0], a) for k in range(1, len(r) - 1) for a in self.addresses
                if a in r[k][2] and a in r[k - 1][2] and a in r[k + 1][2]]

    def holderless(self, after: float) -> list[tuple[float, str]]:
        """(time, address) of every read after the time given that proves an address on neither entry (a
        read without it between two reads of the other entry without it)."""
        r = [x for x in list(self.reads) if x[0] > after]
        return [(r[k][0], a) for k in range(1, len(r) - 1) for a in self.addresses
                if a not in r[k][2] and a not in r[k - 1][2] and a not in r[k + 1][2]]

    def first(self, address: str, entry: str, after: float) -> float | None:
        """When the sampler first saw entry hold address after the time given."""
        return next((t for t, e, held in list(self.reads) if t > after and e == entry and address in held), None)

    def last(self, address: str, entry: str, before: float) -> float | None:
        """When the sampler last saw entry hold address before the time given."""
        return next((t for t, e, held in reversed(list(self.reads)) if t < before and e == entry and address in held),
                    None)


def admin(fleet, i: int, path: str) -> dict:
    """GET a loopback-only admin path of entry i's proxy, from inside its namespace."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8001{path}', timeout=5).read().decode())"
    r = fleet.hosts[i].run(PYTHON, "-c", code, check=False)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def sim_stats(fleet, port: int) -> dict:
    code = (f"import urllib.request; print(urllib.request.urlopen('http://{fleet.hosts[2].address}:{port}"
            "/sim/stats', timeout=5).read().decode())")
    return json.loads(fleet.hosts[2].run(PYTHON, "-c", code).stdout)


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    """The module's topology, deployed; the sampler running. Stopped and torn down at the end."""
    if not shutil.which("keepalived") and not os.path.exists("/usr/sbin/keepalived"):
        if os.environ.get("CI") == "true":
            pytest.fail("keepalived is not installed; .ci/run installs it")
        pytest.skip("keepalived is not installed")
    tmp = tmp_path_factory.mktemp("entry_ha")
    fleet = build(tmp / "netns", 3)
    inventory = None
    sampler = None
    try:
        a, b = f"{fleet.prefix}.100", f"{fleet.prefix}.101"
        vrrp = {"addresses": [f"{a}/24", f"{b}/24"], "interface": "eth0"}
        hosts = {"m1": member(fleet, 2, tmp, instances=2, max_num_seqs=2, sim=SIM)}
        for i, name in enumerate(ENTRIES):
            hosts[name] = member(fleet, i, tmp, instances=0, fronts=["m1"], sim=SIM, max_num_seqs=2,
                                 deploy_dir=str(tmp / name), address=fleet.hosts[i].address, vrrp=vrrp)
        inventory = tmp / "hosts.yml"
        inventory.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=False))
        sampler = Sampler(fleet, (a, b))
        r = inv("deploy", "--host", "all", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_until(lambda: sampler.holder(a) == {"e1"} and sampler.holder(b) == {"e2"}, timeout=20,
                   what="e1 holding A and e2 holding B")
        yield {"fleet": fleet, "inventory": inventory, "sampler": sampler, "a": a, "b": b, "tmp": tmp}
    finally:
        if sampler is not None:
            sampler.stopping.set()
        if inventory is not None:       # by tag (the stops themselves are tested above): the fastest way out
            for dep in dep_ids(inventory):
                kill_tagged(dep + "/")
        teardown(fleet)
        if FIGURES:
            print("\nentry HA figures:\n" + "\n".join(f"  {k}: {v}" for k, v in FIGURES.items()))


def assert_never_both(ha) -> None:
    both = ha["sampler"].both()
    assert not both, f"an address was on both entries at once: {both[:5]}"


def share(ha, i: int) -> dict:
    return admin(ha["fleet"], i, "/admin/config").get("share") or {}


def failover(ha, fault, name: str, graceful: bool = False) -> dict:
    """Under load through A (held by e1), fault() e1; when e2 holds A, wait for requests through A to
    succeed again. What was measured goes to FIGURES: the time from the fault to e2 holding A, how long
    no entry held it, the failures (those in flight at the fault among them) and those started after the
    move, which must be none."""
    s, a = ha["sampler"], ha["a"]
    assert s.holder(a) == {"e1"}, s.holder(a)
    # Clients as real ones: a 5 s timeout (a request in flight on an entry that lost the address gets no
    # answer: its connection was to the old holder), a pause of 0.2 s after a failure.
    with Load(a, threads=4, max_s=60, max_tokens=10, timeout=5, pause_after_failure_s=0.2) as load:
        wait_until(lambda: load.count(lambda d: d["status"] == 200) >= 8, what="load flowing through A")
        t0 = time.monotonic()
        fault()
        wait_until(lambda: s.holder(a) == {"e2"}, timeout=30, what="e2 holding A")
        moved = s.first(a, "e2", t0)
        lost = s.last(a, "e1", moved + 1) or t0
        wait_until(lambda: load.count(lambda d: d["start"] > moved + 0.05 and d["status"] == 200) >= 6,
                   timeout=30, what="requests through A succeeding after the move")
    if graceful:
        t0 = lost         # the fault is e1 letting A go (the stop's first steps before it change nothing)
    failed = [d for d in load.done if d["status"] != 200]
    late = [d for d in failed if d["start"] > moved + 0.05]
    # In flight on e1 between the fault and its losing A: their connections were e1's (to its proxy killed,
    # or to an address it no longer has).
    cut = [d for d in load.done if d["start"] < lost and d["end"] > min(t0, lost)]
    m = {"failover_s": moved - (lost if graceful else t0), "gap_s": max(0.0, moved - lost),
         "failed": len(failed), "in_flight": len(cut), "failed_in_flight": sum(1 for d in failed if d in cut),
         "failed_after_move": len(late), "requests": len(load.done)}
    FIGURES[name] = (f"A on e2 {m['failover_s']:.2f} s after " + ("e1 let it go" if graceful else "the fault")
                     + f" (no holder for {m['gap_s']:.2f} s); {m['failed']} failed of {m['requests']} "
                     f"({m['failed_in_flight']} of the {m['in_flight']} sent to e1 from before the fault until it let A go, "
                     f"the rest while no entry held A), {m['failed_after_move']} started after the move")
    print(f"\n{name}: {FIGURES[name]}")
    assert late == [], late[:5]
    # Every failure was in flight on e1 when it lost A, or sent between the fault and the move (the sampler reads
    # every few tens of ms: 0.1 s of slack on both ends).
    odd = [d for d in failed if d not in cut and not min(t0, lost) - 0.1 <= d["start"] <= moved + 0.1]
    assert odd == [], (odd[:5], lost, moved)
    assert_never_both(ha)
    return m


def comes_back(ha, action, name: str) -> None:
    """action() brings e1 back; A returns to it (preemption: active-active's default), never on both."""
    s = ha["sampler"]
    t0 = time.monotonic()
    action()
    wait_until(lambda: s.holder(ha["a"]) == {"e1"}, timeout=30, what="A back on e1")
    FIGURES[name + ", return"] = f"A back on e1 {s.first(ha['a'], 'e1', t0) - t0:.2f} s after e1 came back"
    assert_never_both(ha)


def deploy(ha, host: str) -> None:
    r = inv("deploy", "--host", host, inventory=ha["inventory"])
    assert r.returncode == 0 and recap(r.stdout, host)["failed"] == 0, r.stdout + r.stderr


def test_both_entries_serve_and_together_never_exceed_an_engines_slots(ha):
    """1. Active-active: e1 holds A, e2 holds B; each proxy has 1 of each engine's 2 slots (share).
    2. Load through both addresses at once (6 clients each, three times the 4 slots): every request
       succeeds, and no engine ever had more than its 2 requests in flight (the sim's own peak: running
       plus waiting); it did have 2.
    3. `inv status` says which entry holds which address."""
    fleet = ha["fleet"]
    for i in (0, 1):
        wait_until(lambda: share(ha, i).get("slots") == "1", what=f"entry {i} at 1 slot of 2")
    for port in (8002, 8003):
        code = (f"import urllib.request; urllib.request.urlopen(urllib.request.Request('http://"
                f"{fleet.hosts[2].address}:{port}/sim/reset-stats', b'', method='POST'), timeout=5)")
        fleet.hosts[2].run(PYTHON, "-c", code)
    with Load(ha["a"], threads=6, max_requests=30, max_tokens=10) as la, \
            Load(ha["b"], threads=6, max_requests=30, max_tokens=10) as lb:
        wait_until(lambda: la.count() + lb.count() >= 60, timeout=60, what="60 requests through A and B")
    assert [d for d in la.done + lb.done if d["status"] != 200] == []
    peaks = [sim_stats(fleet, p)["peak_in_flight"] for p in (8002, 8003)]
    FIGURES["honest slots"] = (f"60 requests through A and B with 12 clients: engines' peak in flight {peaks} "
                               "(max_num_seqs 2)")
    print(f"\n{FIGURES['honest slots']}")
    assert max(peaks) == 2, peaks
    r = inv("status", "--host", "e1,e2", inventory=ha["inventory"])
    assert f"vrrp    master of {ha['a']}/24 on eth0" in r.stdout, r.stdout
    assert f"vrrp    master of {ha['b']}/24 on eth0" in r.stdout, r.stdout
    assert "carry the deployment's tag" not in r.stdout, r.stdout
    assert_never_both(ha)


def test_graceful_stop_of_the_master_hands_the_address_over_at_once(ha):
    """1. Load through A, held by e1. 2. `inv stop --host e1`: keepalived goes first (it hands A over),
    then e1's proxy drains. 3. e2 holds A within a second: the only failures are the requests in flight on
    e1 when it let A go (their connections were e1's), none sent after.
    4. `inv deploy --host e1`: A comes back to e1."""
    m = failover(ha, lambda: inv("stop", "--host", "e1", inventory=ha["inventory"]), "graceful stop", graceful=True)
    assert m["gap_s"] < 1.5, m
    comes_back(ha, lambda: deploy(ha, "e1"), "graceful stop")


def test_sigkill_of_the_masters_proxy_moves_the_address_by_its_track_script(ha):
    """1. Load through A, held by e1. 2. SIGKILL of e1's proxy: its track script fails twice (1 s apart),
    keepalived goes to FAULT and gives A up; e2 takes it. 3. Failures only among the requests in flight on
    e1 and those sent before the move; every request after it succeeds. 4. e2's proxy, alone now, takes
    all of each engine's slots. 5. `inv deploy --host e1` starts e1's proxy again: A comes back, and e2
    gives e1 its share of the slots back."""
    rec = processes.read_record_file(str(ha["tmp"] / "e1" / layout.PROXY_PID))[0]
    failover(ha, lambda: os.kill(rec["pid"], signal.SIGKILL), "SIGKILL of the proxy")
    wait_until(lambda: share(ha, 1).get("slots") == "2", what="e2 takes every slot while e1 is gone")
    comes_back(ha, lambda: deploy(ha, "e1"), "SIGKILL of the proxy")
    wait_until(lambda: share(ha, 1).get("slots") == "1", what="e2 gives e1 its share back")


def test_sigkill_of_keepalived_leaves_no_stale_address(ha):
    """1. Load through A, held by e1. 2. SIGKILL of both keepalived processes on e1 (the case where the
    address stayed on the dead master's interface): its supervisor takes A off the interface at once
    and starts keepalived again. 3. e2 takes A after VRRP's master-down time; the address is never on
    both. 4. e1's new keepalived takes A back once vrrp.preempt_delay_s (5 s) has passed."""
    d = ha["tmp"] / "e1"
    pids = [int((d / rel).read_text().split()[0]) for rel in (layout.KEEPALIVED_MAIN_PID, layout.KEEPALIVED_VRRP_PID)]

    def kill():
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    failover(ha, kill, "SIGKILL of keepalived")
    comes_back(ha, lambda: None, "SIGKILL of keepalived")


def test_cut_link_of_the_master_moves_the_address(ha):
    """1. Load through A, held by e1. 2. e1's link goes down. 3. e2 takes A after the master-down time;
    requests started after the move succeed. 4. The link comes back: A returns to e1, never on both."""
    fleet = ha["fleet"]
    try:
        failover(ha, lambda: fleet.hosts[0].link(False), "cut link")
    finally:
        fleet.hosts[0].link(True)
    comes_back(ha, lambda: None, "cut link")


def supervisors(ha) -> list[int]:
    """Each entry's keepalived supervisor pid and keepalived's own (a reload keeps them; a restart not)."""
    out = []
    for e in ENTRIES:
        out.append(processes.read_record_file(str(ha["tmp"] / e / layout.KEEPALIVED_PID))[0]["pid"])
        out.append(int((ha["tmp"] / e / layout.KEEPALIVED_MAIN_PID).read_text().split()[0]))
    return out


def test_a_changed_vrrp_setting_reloads_each_entry_in_turn_and_every_address_keeps_a_holder(ha):
    """1. Both entries' vrrp.preempt_delay_s changes (their keepalived.conf with it). 2. `inv deploy` of both
    at once: each entry's keepalived re-reads its config (the same processes), one entry after the other.
    3. Throughout, every read shows each address on one entry: none was ever without a holder, nor on
    both; e1 holds A and e2 holds B after."""
    s = ha["sampler"]
    wait_until(lambda: s.holder(ha["a"]) == {"e1"} and s.holder(ha["b"]) == {"e2"}, what="A on e1, B on e2")
    pids = supervisors(ha)
    inventory = yaml.safe_load(ha["inventory"].read_text())
    for e in ENTRIES:
        inventory["hosts"][e]["vrrp"]["preempt_delay_s"] = 4
    ha["inventory"].write_text(yaml.safe_dump(inventory, sort_keys=False))
    t0 = time.monotonic()
    r = inv("deploy", "--host", "e1,e2", inventory=ha["inventory"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("keepalived") and r.stdout.count("reloaded, supervisor pid") == 2, r.stdout
    assert supervisors(ha) == pids
    assert s.holderless(t0) == [] and s.holder(ha["a"]) == {"e1"} and s.holder(ha["b"]) == {"e2"}
    assert_never_both(ha)


def test_swap_to_nginx_and_back_leaves_keepalived_and_the_address_where_they_are(ha):
    """1. Load through B, held by e2. 2. `inv swap-to-nginx --host e2`, then `inv swap-to-proxy`: the
    track script checks the port, whoever serves it, so keepalived runs on (the same processes) and B
    never leaves e2. 3. Every request through B succeeds."""
    s = ha["sampler"]
    pids = supervisors(ha)
    t0 = time.monotonic()
    with Load(ha["b"], threads=2, max_s=60, max_tokens=10, timeout=5) as load:
        wait_until(lambda: load.count(lambda d: d["status"] == 200) >= 4, what="load flowing through B")
        for verb in ("swap-to-nginx", "swap-to-proxy"):
            r = inv(verb, "--host", "e2", inventory=ha["inventory"])
            assert r.returncode == 0, r.stdout + r.stderr
            n = load.count()
            wait_until(lambda: load.count(lambda d: d["status"] == 200) >= n + 4, what=f"B serving after {verb}")
    assert [d for d in load.done if d["status"] != 200] == []
    assert supervisors(ha) == pids
    assert s.holderless(t0) == [] and s.holder(ha["b"]) == {"e2"}
    assert_never_both(ha)
