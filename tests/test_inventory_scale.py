"""A control plane that scales with the inventory (issue 21): loading N hosts costs N, rendering one host of
1,000 costs one host, a clash among 1,000 hosts is named as fast, and a file that would expand past a bound
(an alias bomb) or is too large is refused in one sentence at once.

The bounds count work (pydantic validations, `fronts_of` calls) rather than time it, so a busy machine
cannot fail them: the quadratic loader did 90,000 validations for 300 hosts, and a linear one does a few
per host. Wall-clock assertions are loose backstops only, said so where they are made.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from fleet_helpers import inv

from fleet.errors import InventoryError
from fleet.host import sync
from fleet.settings import inventory, schema


def fleet_text(hosts: int, clash: bool = False, entry: bool = True) -> str:
    """N SSH hosts x 8 instances, each at its own address, in a `fleet` group and racks of 50; an entry host
    `gw` fronting h1-h4; `clash`: the last host also at h1's address (so at h1's ports)."""
    lines = ["defaults:", "  accelerator: nvidia", "  accelerators: 8", "  instances: 8",
             "  model: /data/models/Qwen2.5-7B-Instruct", "  ssh: {user: ops}",
             "groups:", "  fleet:", "    hosts: [" + ", ".join(f"h{i}" for i in range(hosts)) + "]",
             "    max_num_seqs: 8"]
    for rack in range(0, hosts, 50):
        lines += [f"  rack-{rack // 50}:",
                  "    hosts: [" + ", ".join(f"h{i}" for i in range(rack, min(hosts, rack + 50))) + "]",
                  "    release_timeout_s: 90"]
    lines.append("hosts:")
    for i in range(hosts):
        address = "10.0.0.1" if clash and i == hosts - 1 else f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
        lines += [f"  h{i}:", f"    ssh: {{host: {address}}}"]
    if entry:
        lines += ["  gw:", "    ssh: {host: 10.255.0.1}", "    fronts: [h1, h2, h3, h4]"]
    return "\n".join(lines) + "\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


class Work:
    """Counts the pydantic validations of the host schema and the `fronts_of` calls made meanwhile."""

    def __init__(self, monkeypatch):
        self.validations = self.fronts = 0
        validate, fronts_of = schema.HostSettings.model_validate, inventory.Inventory.fronts_of

        def counted_validate(*args, **kw):
            self.validations += 1
            return validate(*args, **kw)

        def counted_fronts_of(inv_, *args, **kw):
            self.fronts += 1
            return fronts_of(inv_, *args, **kw)
        monkeypatch.setattr(schema.HostSettings, "model_validate", counted_validate)
        monkeypatch.setattr(inventory.Inventory, "fronts_of", counted_fronts_of)

    def reset(self) -> tuple[int, int]:
        done, self.validations, self.fronts = (self.validations, self.fronts), 0, 0
        return done


@pytest.mark.unit
def test_loading_is_linear_and_one_host_costs_one_host(tmp_path, monkeypatch):
    """Loading (every host validated, every check across hosts) grows linearly from 100 to 1,000 hosts:
    at most 10x the work (with 10% margin), where the quadratic loader did 100x; a few validations per
    host. Then one host's variables and files, what `inv render --host h0` adds, cost a few validations
    whatever the inventory's size; an entry host's members are still widened to their address."""
    work = Work(monkeypatch)
    cost = {}
    for n in (100, 1000):
        loaded = inventory.load(write(tmp_path, f"h{n}.yml", fleet_text(n)))
        cost[n] = work.reset()
        assert cost[n][0] <= 3 * (n + 1) + 30, cost[n]      # each host's own layer, its merged keys
        hv = loaded.host_vars("h0")
        assert sync.host_files(hv)
        assert work.reset()[0] <= 5
        assert loaded.host_vars("h1").settings.bind == "10.0.0.1"    # fronted by gw: reachable at its address
        assert loaded.host_vars("h5").settings.bind == "127.0.0.1"   # fronted by none
        assert loaded.host_vars("gw").backends[:2] == ["10.0.0.1:8002", "10.0.0.1:8003"]
        work.reset()
    (v100, f100), (v1000, f1000) = cost[100], cost[1000]
    assert v1000 <= 11 * v100 and f1000 <= 11 * f100, cost


@pytest.mark.unit
def test_the_clash_among_1000_hosts_is_named_at_linear_cost(tmp_path, monkeypatch):
    """The last of 1,000 hosts at h1's address, so at h1's ports: named in one sentence after the same
    linear work as loading a valid file (the quadratic loader took 101 s for it)."""
    work = Work(monkeypatch)
    cost = {}
    for n in (100, 1000):
        with pytest.raises(InventoryError) as e:
            inventory.load(write(tmp_path, f"c{n}.yml", fleet_text(n, clash=True)))
        assert str(e.value).endswith(
            f"hosts.h{n - 1}.base_port: port 8002 (instance 0) is also the port of h1's instance 0 on the "
            "machine 10.0.0.1:22; give each host on one machine its own ports.")
        cost[n] = work.reset()
        assert cost[n][0] <= 3 * (n + 1) + 30, cost[n]
    assert cost[1000][0] <= 11 * cost[100][0] and cost[1000][1] <= 11 * cost[100][1], cost


def bomb(levels: int = 9) -> str:
    """The issue's alias bomb: nine levels of nine aliases under extra_args (9^9 strings once expanded)."""
    items = ["      - &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    items += [f"      - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return ("hosts:\n  h0:\n    connection: local\n    engine: sim\n    accelerator: sim\n    extra_args:\n"
            + "\n".join(items) + "\n")


@pytest.mark.unit
def test_an_alias_bomb_or_a_self_alias_is_refused_before_any_validation(tmp_path, monkeypatch):
    """The loader counts values as aliases expand them, each node once: the bomb is refused without
    walking its expansion and before any host is validated; so is an alias inside the node it names. The
    time bound is a loose backstop (the count is the test): the refusal takes milliseconds, the old loader
    kept a core busy for more than 100 s."""
    work = Work(monkeypatch)
    start = time.monotonic()
    with pytest.raises(InventoryError, match=r"bomb\.yml: its aliases expand to more than 1,000,000 values "
                                             r"\(or an alias holds itself\), .*; write the values out"):
        inventory.load(write(tmp_path, "bomb.yml", bomb()))
    assert time.monotonic() - start < 10
    assert work.reset() == (0, 0)
    with pytest.raises(InventoryError, match="its aliases expand"):
        inventory.load(write(tmp_path, "self.yml", "hosts:\n  h0:\n    extra_args: &a [x, *a]\n"))
    # Aliases that stay under the bound are still fine (a node named twice is checked once).
    fine = ("defaults: {engine: sim, accelerator: sim, connection: local}\n"
            "groups: {g: {hosts: [h0], extra_args: &a [--trust-remote-code]}}\n"
            "hosts:\n  h0: {}\n  h1: {extra_args: *a, base_port: 9002, proxy: {port: 9000, admin_port: 9001}}\n")
    assert inventory.load(write(tmp_path, "fine.yml", fine)).host_vars("h1").settings.extra_args == ["--trust-remote-code"]


@pytest.mark.unit
def test_an_inventory_past_the_size_bounds_is_refused(tmp_path, monkeypatch):
    """A file past MAX_BYTES is refused before it is parsed; a file of more values than MAX_VALUES (here
    lowered to 1,000: a plain 200-host file has more) is refused before any validation."""
    big = tmp_path / "big.yml"
    with big.open("w") as f:
        f.write(fleet_text(10))
        line = "# " + "x" * 1022 + "\n"
        for _ in range(inventory.MAX_BYTES // len(line) + 1):
            f.write(line)
    with pytest.raises(InventoryError, match=r"big\.yml: the inventory is larger than 16 MiB, more than this "
                                             r"toolkit reads; split it into several inventories\.$"):
        inventory.load(big)
    work = Work(monkeypatch)
    monkeypatch.setattr(inventory, "MAX_VALUES", 1000)
    with pytest.raises(InventoryError, match="expand to more than 1,000 values"):
        inventory.load(write(tmp_path, "h200.yml", fleet_text(200)))
    assert work.reset() == (0, 0)


@pytest.mark.process
def test_the_command_line_on_1000_hosts(tmp_path):
    """`inv render --host h0` and `inv deploy --check --host h0` on 1,000 hosts, the clash, and the alias
    bomb, each as a process of its own: the outcome, one sentence, no traceback. The time bounds are loose
    backstops only (the counts above are the tests): each is about 10x what a run took on a busy 2-core
    machine (render 2.6 s and the rest about 1.5 s at load average 8; an idle machine: under 1 s), so
    another test's load cannot fail them, while the quadratic loader (98 s for render) would."""
    good = write(tmp_path, "h1000.yml", fleet_text(1000))
    start = time.monotonic()
    r = inv("render", "--host", "h0", "--out", tmp_path / "out", inventory=good, process=True)
    assert r.returncode == 0 and (tmp_path / "out" / "bin" / "start_cluster.sh").exists(), r.stderr
    assert time.monotonic() - start < 30

    # h0 at a loopback port where nothing listens: the whole control plane runs, the connection is refused.
    closed = write(tmp_path, "closed.yml", fleet_text(1000).replace(
        "  h0:\n    ssh: {host: 10.0.0.0}", "  h0:\n    ssh: {host: 127.0.0.1, port: 9, connect_timeout_s: 5}"))
    start = time.monotonic()
    r = inv("deploy", "--check", "--host", "h0", inventory=closed, process=True)
    assert r.returncode == 4 and "h0 : ok=0 changed=0 skipped=0 failed=0 unreachable=1" in r.stdout, r
    assert time.monotonic() - start < 30

    start = time.monotonic()
    r = inv("render", "--host", "h0", "--out", tmp_path / "bad", inventory=write(
        tmp_path, "c1000.yml", fleet_text(1000, clash=True)), process=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "hosts.h999.base_port: port 8002 (instance 0) is also the port of h1's instance 0" in r.stderr
    assert time.monotonic() - start < 30

    start = time.monotonic()
    r = inv("render", "--host", "h0", "--out", tmp_path / "bomb", inventory=write(tmp_path, "bomb.yml", bomb()),
            process=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "its aliases expand to more than 1,000,000 values" in r.stderr
    assert time.monotonic() - start < 15
