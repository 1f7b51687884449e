"""Day two across hosts, under load, on both fronts: a host joins an entry host's fleet and another leaves
it, the API keys rotate, and the entry host is lost and replaced; 0 failed requests throughout.

Three network namespaces (tests/netns.py): the entry host (namespace 0, no instance of its own, its key
file in proxy.api_keys_file) and two members of one sim instance each. Every change is a command sequence
of docs/operations.md, run here as written there. Figures print with `-s`.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import require_tool, wait_until
from fleet_helpers import inv
from hostagent import apikeys, layout
from netns import NetnsFleet, netns_fleet  # noqa: F401  (the fixture)
from test_netns_fleet import BASE, PORT, Load, admin_backends, cleanup, member, recap  # noqa: F401  (a fixture)

# Its own group (not "netns", already the longest): this module's fleets run beside that one.
pytestmark = [pytest.mark.netns, pytest.mark.ssh, pytest.mark.cluster, pytest.mark.xdist_group("netns_join"),
              pytest.mark.timeout(600)]

OLD, NEW = "sk-old-0a1b2c3d", "sk-new-4e5f6a7b"
SIM = {"token_ms": 20, "output_tokens": 200}     # about 0.4 s an answer of 20 tokens: a light load


def write_keys(path: Path, *keys: str) -> None:
    """Replace the key file at once (a reader never sees it half written)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("".join(k + "\n" for k in keys))
    os.replace(tmp, path)


def write_inventory(fleet: NetnsFleet, tmp_path: Path, keys: Path, entries: dict[str, tuple[int, list[str]]],
                    file: str = "hosts.yml", members: tuple[str, ...] = ("m1", "m2")) -> Path:
    """The members (m1 and m2: namespaces 1 and 2, one sim instance each) and each entry host of entries,
    name -> (its namespace, its `fronts`): no instance of its own, the key file."""
    # m1 answers slower (2 s): requests are still in flight there when the entry lets it go
    hosts = {m: member(fleet, i, tmp_path, instances=1, sim=sim) for i, m, sim in
             ((1, "m1", {**SIM, "token_ms": 100}), (2, "m2", SIM)) if m in members}
    for name, (i, fronts) in entries.items():
        hosts[name] = member(fleet, i, tmp_path, instances=0, fronts=fronts, sim=SIM,
                             deploy_dir=str(tmp_path / name), proxy={"api_keys_file": str(keys)})
    path = tmp_path / file
    path.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=False))
    return path


def post(address: str, key: str, stream: bool, user: str) -> tuple[int | None, str | None]:
    """One chat completion through the entry port with key: (status, or None when the connection failed
    or a stream broke; X-Backend)."""
    body = json.dumps({"model": "Test-Model", "max_tokens": 20, "user": user, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"http://{address}:{PORT}/v1/chat/completions", body,
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
            if stream and not data.rstrip().endswith(b"data: [DONE]"):
                return None, r.headers.get("X-Backend")
            return r.status, r.headers.get("X-Backend")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Backend")
    except (OSError, ValueError, http.client.HTTPException):
        return None, None


class Clients(Load):
    """Client threads, each with its API key, sending requests (half streamed) to an entry port until
    stopped, at most max_s: each request's start, end, key, status and backend."""

    def __init__(self, address: str, keys: list[str], max_s: float = 300):
        self.keys = keys
        super().__init__(address, threads=len(keys), max_s=max_s)

    def _run(self, k: int) -> None:
        key, n, refused = self.keys[k], 0, 0
        # a client whose key was refused 3 times in a row gives up, as a real one would
        while not self.stopping.is_set() and time.monotonic() - self.t0 < self.max_s and refused < 3:
            n += 1
            start = time.monotonic()
            code, backend = post(self.address, key, stream=(k + n) % 2 == 0, user=f"c{k}-{n}")
            refused = refused + 1 if code == 401 else 0
            with self.lock:
                self.done.append({"start": start, "end": time.monotonic(), "key": key, "status": code,
                                  "backend": backend})

    def failed(self) -> list[dict]:
        """Requests that did not succeed although their key was valid (every key but a removed one)."""
        with self.lock:
            return [d for d in self.done if d["status"] != 200]


def assert_keys_taken(output: str, front: str, tmp_path: Path) -> None:
    """The deploy had the front take the key file: the proxy says so; nginx's map holds the file's keys
    (its watcher may have taken the file a moment before the deploy, which then had nothing to do)."""
    if front == "proxy":
        assert "API keys taken from the key file" in output, output
    else:
        keys = apikeys.load(str(tmp_path / "api_keys"))
        assert apikeys.conf_digest(str(tmp_path / "entry" / layout.NGINX_KEYS)) == apikeys.digest(keys)


def timed(*args, inventory: Path) -> tuple[object, float]:
    t0 = time.monotonic()
    r = inv(*args, inventory=inventory)
    print(f"\n$ inv {' '.join(args)}  ({time.monotonic() - t0:.1f}s)\n{r.stdout}")
    return r, time.monotonic() - t0


@pytest.mark.parametrize("front", ["proxy", "nginx"])
def test_hosts_join_and_leave_and_keys_rotate_under_load_with_no_failed_request(netns_fleet, tmp_path, cleanup,
                                                                                 front):
    """1. the entry fronts m1 (one sim instance), its key file holds OLD; with front nginx, `inv
    swap-to-nginx` makes nginx the entry's front; clients send requests with OLD (half streamed) from
    here to the end of step 4;
    2. join: m2 is added to the entry's `fronts`; `inv deploy --host m2,entry` starts m2, then the entry
    takes its backend once healthy: requests reach m2;
    3. leave: m1 is dropped from `fronts`; `inv deploy --host entry` drains m1's backend (the requests in
    flight there finish; the deploy waits for them), then `inv stop --host m1`: no request reaches m1
    after the deploy, none fails;
    4. rotate: the key file holds OLD and NEW; `inv deploy --host entry` has the front take it (the proxy
    reloads, same pid; nginx reloads its key map) and a second set of clients uses NEW; then the file
    holds NEW alone and a deploy takes it: OLD is answered 401 from then on, never before the file lost
    it, and NEW's clients never fail;
    5. (the proxy front) the entry host is lost (its link down): another host (m1's, free since step 3)
    becomes the entry with the same `fronts`, `inv deploy --host entry2`, and serves with NEW.
    Every change's time and the requests' counts are printed."""
    if front == "nginx":
        require_tool("nginx")
    fleet = netns_fleet(3)
    keys = tmp_path / "api_keys"
    write_keys(keys, OLD)
    inventory = write_inventory(fleet, tmp_path, keys, {"entry": (0, ["m1"])})
    cleanup.append(inventory)
    entry = fleet.hosts[0].address
    on = {m: f"{fleet.hosts[i].address}:{BASE}" for i, m in ((1, "m1"), (2, "m2"))}
    r = inv("deploy", "--host", "m1,entry", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    if front == "nginx":
        r = inv("swap-to-nginx", "--host", "entry", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
    figures = []

    with Clients(entry, [OLD] * 3) as old_clients:
        wait_until(lambda: old_clients.count(lambda d: d["status"] == 200) >= 3, 60, 0.1, what="load served")

        # 2. join
        inventory = write_inventory(fleet, tmp_path, keys, {"entry": (0, ["m1", "m2"])})
        r, took = timed("deploy", "--host", "m2,entry", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert recap(r.stdout, "entry")["failed"] == 0, r.stdout
        figures.append(f"join (deploy --host m2,entry): {took:.1f}s")
        t_joined = time.monotonic()
        wait_until(lambda: old_clients.count(lambda d: d["backend"] == on["m2"] and d["status"] == 200) >= 3,
                   60, 0.1, what="requests served by m2")

        # 3. leave
        inventory = write_inventory(fleet, tmp_path, keys, {"entry": (0, ["m2"])})
        t_leave = time.monotonic()
        r, took = timed("deploy", "--host", "entry", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        drained = re.search(r"1 removed, drained in [\d.]+s|old workers finished their requests in [\d.]+ ms",
                            r.stdout)
        assert drained, r.stdout
        t_left = time.monotonic()
        figures.append(f"leave (deploy --host entry): {took:.1f}s ({drained.group(0)})")
        if front == "proxy":
            assert on["m1"] not in admin_backends(fleet, 0)
        r = inv("stop", "--host", "m1", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        after = old_clients.count()
        wait_until(lambda: old_clients.count() >= after + 10, 60, 0.1, what="requests served after m1 stopped")
    served = old_clients.done
    assert old_clients.failed() == [], old_clients.failed()[:5]
    assert any(d["backend"] == on["m1"] and d["start"] > t_joined for d in served)
    assert not [d for d in served if d["backend"] == on["m1"] and d["start"] > t_left]
    # requests on m1 while the deploy that removed it ran: each finished (the drain), none failed
    across = [d for d in served if d["backend"] == on["m1"] and d["start"] < t_left and d["end"] > t_leave]
    assert across and all(d["status"] == 200 for d in across)
    figures.append(f"{len(served)} requests with OLD through join and leave, "
                   f"{sum(d['backend'] == on['m2'] for d in served)} on m2, {len(across)} on m1 during the "
                   f"leave's deploy, {len(old_clients.failed())} failed")

    # 4. rotate: OLD -> OLD+NEW -> NEW
    with Clients(entry, [OLD, OLD]) as old_c:
        wait_until(lambda: old_c.count(lambda d: d["status"] == 200) >= 2, 60, 0.1, what="OLD served")
        write_keys(keys, OLD, NEW)
        r, took = timed("deploy", "--host", "entry", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert_keys_taken(r.stdout, front, tmp_path)
        figures.append(f"keys OLD -> OLD+NEW (deploy --host entry): {took:.1f}s")
        with Clients(entry, [NEW, NEW]) as new_c:
            wait_until(lambda: new_c.count(lambda d: d["status"] == 200) >= 4, 60, 0.1, what="NEW served")
            t_dropped = time.monotonic()
            write_keys(keys, NEW)
            r, took = timed("deploy", "--host", "entry", inventory=inventory)
            t_deployed = time.monotonic()
            assert r.returncode == 0, r.stdout + r.stderr
            assert_keys_taken(r.stdout, front, tmp_path)
            figures.append(f"keys OLD+NEW -> NEW (deploy --host entry): {took:.1f}s")
            wait_until(lambda: old_c.count(lambda d: d["start"] > t_dropped and d["status"] == 401) >= 2, 60, 0.1,
                       what="OLD refused")
            after = new_c.count()
            wait_until(lambda: new_c.count() >= after + 4, 60, 0.1, what="NEW served after OLD's removal")
    assert new_c.failed() == [], new_c.failed()[:5]
    old_done = old_c.done
    refused = [d for d in old_done if d["status"] == 401]
    assert [d for d in old_done if d["status"] not in (200, 401)] == []
    assert refused and min(d["start"] for d in refused) > t_dropped
    assert all(d["status"] == 401 for d in old_done if d["start"] > t_deployed)
    figures.append(f"rotation: {len(new_c.done)} requests with NEW, {len(new_c.failed())} failed; "
                   f"{len(old_done)} with OLD, {sum(d['status'] == 200 for d in old_done)} served, "
                   f"{len(refused)} refused (401), all after the file dropped it")

    # 5. the entry host is lost: another host becomes the entry
    if front == "proxy":
        # the cleanup stops what the first entry runs too (hosts.yml names entry2 from here on)
        cleanup.append(write_inventory(fleet, tmp_path, keys, {"entry": (0, ["m2"])}, file="first.yml",
                                       members=("m2",)))
        t_lost = time.monotonic()
        fleet.hosts[0].link(up=False)
        try:
            # m1 left the fleet (step 3): its machine is the new entry's
            inventory = write_inventory(fleet, tmp_path, keys, {"entry2": (1, ["m2"])}, members=("m2",))
            r, took = timed("deploy", "--host", "entry2", inventory=inventory)
            assert r.returncode == 0, r.stdout + r.stderr
            figures.append(f"lost entry, entry2 deployed (deploy --host entry2): {took:.1f}s")
            answers = [post(fleet.hosts[1].address, NEW, stream=n % 2 == 0, user=f"e2-{n}") for n in range(6)]
            assert answers == [(200, on["m2"])] * 6, answers
            figures.append(f"serving through entry2 {time.monotonic() - t_lost:.1f}s after the entry's link went down")
        finally:
            fleet.hosts[0].link(up=True)
    print(f"\n{front}: " + "; ".join(figures))
