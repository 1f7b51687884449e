"""keepalived's host side without the network namespaces: what it reads of the host, and a deploy on a host
where keepalived cannot run, which says what is missing in one sentence and deploys the rest."""
from __future__ import annotations

import struct

import pytest
import yaml

from conftest import PYTHON, free_ports
from fleet_helpers import deployment_id, inv, kill_tagged
from hostagent import vrrp


@pytest.mark.unit
def test_file_capabilities_read_the_permitted_set():
    """A v2 and a v3 security.capability value: cap_net_admin (12) and cap_net_raw (13) permitted."""
    mask = 1 << 12 | 1 << 13
    v2 = struct.pack("<5I", 0x02000001, mask, 0, 0, 0)
    v3 = struct.pack("<6I", 0x03000001, mask, 0, 0, 0, 0)
    assert vrrp.parse_file_caps(v2) == {12, 13} == vrrp.parse_file_caps(v3)
    assert vrrp.parse_file_caps(b"") == set()


@pytest.mark.unit
def test_cannot_run_says_what_is_missing_in_one_sentence(tmp_path):
    """1. A binary that is not there: install it, or set vrrp.keepalived. 2. An interface the host does
    not have: set vrrp.interface (root here, so the capabilities are there)."""
    missing = vrrp.cannot_run({"keepalived": str(tmp_path / "keepalived"), "interface": "lo",
                               "addresses": ["127.0.0.100/8"]})
    assert "keepalived is not installed" in missing and "vrrp.keepalived" in missing
    fake = tmp_path / "bin-keepalived"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    no_if = vrrp.cannot_run({"keepalived": str(fake), "interface": "nosuch0", "addresses": ["127.0.0.100/8"]})
    assert no_if is not None and "\n" not in no_if
    assert "the interface nosuch0 does not exist" in no_if or "CAP_NET_ADMIN" in no_if


def _inventory(tmp_path):
    base = free_ports(7)
    common = {"connection": "local", "engine": "sim", "accelerator": "sim", "model": "/models/Test-Model",
              "python": PYTHON, "stagger_s": 0, "health_timeout_s": 60, "stop_grace_s": 3, "max_num_seqs": 2,
              "sim": {"load_s": 0.2}}
    vrrp_block = {"addresses": ["127.0.0.100/8"], "interface": "nosuch0"}
    hosts = {"m1": {**common, "accelerators": 1, "instances": 1, "base_port": base, "deploy_dir": str(tmp_path / "m1"),
                    "proxy": {"port": base + 1, "admin_port": base + 2}, "keeper": {"enabled": False}}}
    for k, name in enumerate(("e1", "e2")):
        hosts[name] = {**common, "address": f"127.0.0.{k + 1}", "fronts": ["m1"], "deploy_dir": str(tmp_path / name),
                       "proxy": {"port": base + 3 + 2 * k, "admin_port": base + 4 + 2 * k}, "vrrp": vrrp_block,
                       "keeper": {"enabled": False}}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=False))
    return path


@pytest.mark.process
def test_deploy_where_keepalived_cannot_run_says_so_and_serves(tmp_path):
    """1. An entry behind a virtual address on an interface this host lacks. 2. `inv doctor` fails its
    keepalived line with the one sentence. 3. `inv deploy --no-doctor` deploys the member and the entry's
    proxy, skips keepalived with the same sentence beside the recap, and exits 0. 4. `inv status` says
    keepalived is not running and why. 5. `inv stop` stops it all, nothing tagged left."""
    path = _inventory(tmp_path)
    try:
        r = inv("doctor", "--host", "e1", inventory=path)
        assert "keepalived: the interface nosuch0 does not exist" in r.stdout, r.stdout
        r = inv("deploy", "--host", "m1,e1", "--no-doctor", inventory=path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "keepalived: not started: the interface nosuch0 does not exist on this host" in r.stdout + r.stderr
        r = inv("status", "--host", "e1", inventory=path)
        assert "keepalived NOT RUNNING: the interface nosuch0 does not exist" in r.stdout, r.stdout
        r = inv("stop", "--host", "e1,m1", inventory=path)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        for host in ("e1", "m1"):
            kill_tagged(deployment_id(path, host) + "/")
