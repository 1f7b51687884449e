"""Inventory: resolution order, and every kind of mistake is one line naming the file and the key."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fleet import inventory
from fleet.errors import InventoryError

from conftest import ROOT

BASE = """
defaults:
  base_port: 9002
  max_num_seqs: 2
groups:
  lab:
    hosts: [a]
    max_num_seqs: 3
hosts:
  a:
    engine: sim
    accelerator: sim
    accelerators: 4
    instances: 4
    max_num_seqs: 5
  b:
    engine: sim
    accelerator: sim
    accelerators: 2
    instances: 2
"""


def write(tmp_path, text):
    p = tmp_path / "hosts.yml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_resolution_order_defaults_group_host_set(tmp_path):
    inv = inventory.load(write(tmp_path, BASE))
    assert inv.host_vars("b")["max_num_seqs"] == 2                      # defaults
    assert inv.host_vars("b")["base_port"] == 9002
    assert inv.host_vars("a")["max_num_seqs"] == 5                      # host beats group
    assert inv.host_vars("a", ["max_num_seqs=6"])["max_num_seqs"] == 6  # --set beats host
    assert inv.host_vars("a", ["proxy.results_log.backups=7"])["proxy"]["results_log"]["backups"] == 7
    assert inv.host_vars("a")["proxy"]["port"] == 8000                  # built-in default kept beside it
    assert inv.host_vars("a").ports == [9002, 9003, 9004, 9005]


def test_group_var_applies_without_host_override(tmp_path):
    text = BASE.replace("    max_num_seqs: 5\n", "")
    assert inventory.load(write(tmp_path, text)).host_vars("a")["max_num_seqs"] == 3


def test_select_hosts_groups_all_and_lists(tmp_path):
    inv = inventory.load(write(tmp_path, BASE))
    assert inv.select("lab") == ["a"]
    assert inv.select("all") == ["a", "b"]
    assert inv.select("b,lab") == ["b", "a"]
    with pytest.raises(InventoryError, match="no host or group named 'zz'"):
        inv.select("zz")


def test_ssh_block_means_ssh_connection(tmp_path):
    text = BASE + "    ssh: {host: 10.0.0.5, user: ops}\n"
    assert inventory.load(write(tmp_path, text)).host_vars("b")["connection"] == "ssh"
    assert inventory.load(write(tmp_path, BASE)).host_vars("b")["connection"] == "local"


ERRORS = [
    # (edit of BASE, expected message after "FILE: ")
    (("    max_num_seqs: 5", "    max_num_seqs: four"),
     "hosts.a.max_num_seqs: expected an integer, got 'four'."),
    (("    max_num_seqs: 5", "    max_num_seq: 5"),
     "hosts.a.max_num_seq: unknown key; see the inventory reference in README.md."),
    (("  max_num_seqs: 2", "  enforce_eager: 'yes'"),
     "defaults.enforce_eager: expected true or false, got 'yes'."),
    (("    max_num_seqs: 3", "    base_port: 70000"),
     "groups.lab.base_port: expected a port number (1-65535), got 70000."),
    (("    instances: 2", "    instances: 3"),
     "hosts.b.instances: 3 instances but the host has 2 accelerators (one instance per card); "
     "lower instances or raise accelerators."),
    (("    instances: 2", "    instances: 2\n    proxy: {port: 9003}"),
     "hosts.b.proxy.port: 9003 clashes with instance 1 (ports 9002-9003); move one of them."),
    (("    instances: 2", "    instances: 2\n    proxy: {admin_port: 9002}"),
     "hosts.b.proxy.admin_port: 9002 clashes with instance 0 (ports 9002-9003); move one of them."),
    (("    instances: 2", "    instances: 2\n    proxy: {admin_port: 8000}"),
     "hosts.b.proxy.admin_port: 8000 is also proxy.port; give the admin listener its own port."),
    (("    instances: 2", "    instances: 2\n    proxy: {results_log: {backups: x}}"),
     "hosts.b.proxy.results_log.backups: expected an integer, got 'x'."),
    (("    hosts: [a]", "    hosts: [a, c]"),
     "groups.lab.hosts: 'c' is not defined under hosts."),
    (("    engine: sim\n    accelerator: sim\n    accelerators: 4", "    engine: vllm\n    accelerator: dcu\n    accelerators: 4"),
     "hosts.a.model: the vllm engine needs a model path; set model."),
    (("    instances: 2", "    instances: 2\n    extra_args: --trust-remote-code"),
     "hosts.b.extra_args: expected a list of strings, got '--trust-remote-code'."),
    (("    instances: 2", "    instances: 2\n    ssh: {port: 22}"),
     "hosts.b.ssh.host: connection is ssh but no ssh.host is given; add it."),
    (("    instances: 2", "    instances: 2\n    proxy: {queue: {max: -1}}"),
     "hosts.b.proxy.queue.max: expected a non-negative integer, got -1."),
    (("    instances: 2", "    instances: 2\n    proxy: {queue: {timeout_s: 0}}"),
     "hosts.b.proxy.queue.timeout_s: expected a finite number above 0, got 0."),
    (("    instances: 2", "    instances: 2\n    proxy: {queue: {headroom: 1.5}}"),
     "hosts.b.proxy.queue.headroom: expected an integer, got 1.5."),
]


@pytest.mark.parametrize("edit,message", ERRORS, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in enumerate(ERRORS)])
def test_inventory_errors_name_file_and_key(tmp_path, edit, message):
    old, new = edit
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    assert str(e.value) == f"{path}: {message}"
    assert "\n" not in str(e.value)


def test_set_errors_name_the_key(tmp_path):
    inv = inventory.load(write(tmp_path, BASE))
    with pytest.raises(InventoryError, match=r"^--set: max_num_seqs: expected an integer, got 'lots'\.$"):
        inv.host_vars("a", ["max_num_seqs=lots"])
    with pytest.raises(InventoryError, match=r"^--set nokey: expected key=value"):
        inv.host_vars("a", ["nokey"])
    with pytest.raises(InventoryError, match=r"^--set: bogus: unknown key"):
        inv.host_vars("a", ["bogus=1"])


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "hosts:\n  a: {engine: sim\n")
    with pytest.raises(InventoryError, match=r"not valid YAML at line \d+"):
        inventory.load(path)


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(InventoryError, match="no such inventory file; pass -i FILE or set FLEET_INVENTORY"):
        inventory.load(tmp_path / "nope.yml")


def test_example_inventory_is_valid():
    inv = inventory.load(ROOT / "inventory" / "hosts.yml")
    k = inv.host_vars("k100-01")
    assert (k["accelerator"], k["instances"], k["max_num_seqs"], k["base_port"]) == ("dcu", 8, 4, 8002)
    assert k["connection"] == "ssh" and "--trust-remote-code" in k["extra_args"]
    assert inv.host_vars("local")["engine"] == "sim"


def test_cli_error_is_one_line_without_traceback(tmp_path):
    path = write(tmp_path, BASE.replace("    max_num_seqs: 5", "    max_num_seqs: four"))
    r = subprocess.run([sys.executable, "-m", "invoke", "status", "--host", "a", "-i", path],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {path}: hosts.a.max_num_seqs: expected an integer, got 'four'."
    assert "Traceback" not in r.stdout + r.stderr
