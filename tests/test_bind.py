"""Engines are bound to what needs them: loopback unless another host's proxy fronts them, so the proxy
(and its API keys) is the only door to the instances."""
from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
import yaml
from conftest import ROOT, free_ports, http_status
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory

from fleet import render
from fleet.settings import inventory

pytestmark = pytest.mark.cluster


def outside_address() -> str:
    """A non-loopback IPv4 address of this machine, or skip: without one there is nothing to be exposed on."""
    candidates = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))       # UDP connect sends nothing: it only picks the route
            candidates.append(s.getsockname()[0])
        except OSError:
            pass
    try:
        candidates += subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    except OSError:
        pass
    for a in candidates:
        if "." in a and not a.startswith("127."):
            return a
    pytest.skip("this machine has no non-loopback IPv4 address to test exposure on")


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def post(port: int, key: str | None) -> int:
    body = b'{"model": "Test-Model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_instances_listen_on_loopback_and_the_key_is_the_only_door(tmp_path):
    """1. A local sim host with proxy.api_keys_file, deployed with `inv deploy`.  2. Each instance answers
    /health on 127.0.0.1 but takes no connection on this machine's outside address (it is bound to
    loopback); the proxy (bound to 0.0.0.0) does.  3. Through the proxy: no key -> 401, the key -> 200.
    4. status and doctor still see the instances (they probe the bind address)."""
    outside = outside_address()
    keys = tmp_path / "keys"
    keys.write_text("sk-test-1-long-enough\n")
    keys.chmod(0o600)
    path = write_inventory(tmp_path, instances=2)
    path.write_text(path.read_text().replace(
        "      health_interval_s: 0.5\n", f"      health_interval_s: 0.5\n      api_keys_file: {keys}\n"))
    dep = deployment_id(path)
    try:
        r = inv("deploy", "--host", "t", inventory=path)
        assert r.returncode == 0, r.stdout + r.stderr
        st = status_json(path)
        ports = [i["port"] for i in st["instances"]]
        assert [i["state"] for i in st["instances"]] == ["healthy", "healthy"]
        for port in ports:
            assert http_status(f"http://127.0.0.1:{port}/health") == 200
            assert not reachable(outside, port), f"instance port {port} is open on {outside}"
        proxy_port = st["proxy"]["port"]
        assert reachable(outside, proxy_port)
        assert post(proxy_port, None) == 401
        assert post(proxy_port, "sk-wrong") == 401
        assert post(proxy_port, "sk-test-1-long-enough") == 200
        doctor = inv("doctor", "--host", "t", inventory=path)
        assert "instance 0" in doctor.stdout + doctor.stderr
        assert "WARNING" not in r.stdout + r.stderr       # open beyond loopback, with keys: no warning
    finally:
        inv("stop", "--host", "t", inventory=path)
        kill_tagged(dep + "/")


def test_fronted_instances_listen_on_their_address(tmp_path):
    """1. Host m (local, `address:` this machine's outside address) is fronted by entry host e's proxy.
    2. `inv deploy --host all`: m's instances listen on that address (and not on loopback), and e's proxy
    reaches them there.  3. `bind:` overrides what is derived (render only)."""
    outside = outside_address()
    mb, eb = free_ports(4), free_ports(4)
    hosts = {
        "m": {"connection": "local", "engine": "sim", "accelerator": "sim", "accelerators": 2, "instances": 2,
              "base_port": mb, "address": outside, "model": "/models/Test-Model",
              "deploy_dir": str(tmp_path / "m"), "stagger_s": 0, "health_timeout_s": 60, "stop_grace_s": 3,
              "sim": {"load_s": 0.3, "prefill_ms": 20, "token_ms": 5},
              "proxy": {"port": mb + 2, "admin_port": mb + 3, "health_interval_s": 0.5}},
        "e": {"connection": "local", "engine": "sim", "accelerator": "sim", "accelerators": 1,
              "base_port": eb, "fronts": ["m"], "model": "/models/Test-Model", "deploy_dir": str(tmp_path / "e"),
              "stagger_s": 0, "health_timeout_s": 60, "stop_grace_s": 3,
              "proxy": {"port": eb + 2, "admin_port": eb + 3, "health_interval_s": 0.5}},
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"hosts": hosts}))
    loaded = inventory.load(path)
    assert loaded.host_vars("m").settings.bind == outside
    assert loaded.host_vars("e").backends == [f"{outside}:{mb}", f"{outside}:{mb + 1}"]
    deps = [loaded.host_vars(h).deployment_id for h in ("m", "e")]
    try:
        r = inv("deploy", "--host", "all", inventory=path)
        assert r.returncode == 0, r.stdout + r.stderr
        for port in (mb, mb + 1):
            assert http_status(f"http://{outside}:{port}/health") == 200
            assert not reachable("127.0.0.1", port), f"instance port {port} is open on loopback"
        st = status_json(path, host="m")
        assert [i["state"] for i in st["instances"]] == ["healthy", "healthy"]
        assert post(eb + 2, None) == 200           # no keys on this entry: it serves whoever reaches it
    finally:
        inv("stop", "--host", "all", inventory=path)
        for dep in deps:
            kill_tagged(dep + "/")

    override = inventory.load(path).host_vars("m", ["bind=0.0.0.0"])
    script = {f.path: f.content for f in render.render_host(override)}["bin/start_cluster.sh"]
    assert 'BIND=${BIND:-0.0.0.0}\n' in script and '--host "$BIND"' in script
    assert override.instance_host == "127.0.0.1"
    assert inventory.load(path).host_vars("e").settings.bind == "127.0.0.1"     # nobody fronts e: loopback


def test_the_host_agent_reaches_its_own_instances_where_they_listen(tmp_path):
    """The keeper and the host agent's restart drain, probe and health-check this host's own instances:
    1. a fronted member's instances listen on its address, so conf/hostagent.json names that address;
    2. an entry host that fronts another host and itself lists every host's backends in its proxy, but
       its host agent gets only its own, in its own order (a restart must drain the instance it stops)."""
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({
        "defaults": {"engine": "sim", "accelerator": "sim", "instances": 2, "accelerators": 2},
        "hosts": {"m": {"connection": "local", "address": "10.20.0.12", "base_port": 18002,
                        "deploy_dir": str(tmp_path / "m"), "proxy": {"port": 18000, "admin_port": 18001}},
                  "e": {"connection": "local", "address": "10.20.0.11", "fronts": ["m", "e"], "base_port": 19002,
                        "deploy_dir": str(tmp_path / "e"), "proxy": {"port": 19000, "admin_port": 19001}}}}))
    loaded = inventory.load(path)

    def agent(name):
        hv = loaded.host_vars(name)
        hv.settings.python = "python3"
        return json.loads({f.path: f.content for f in render.render_host(hv)}["conf/hostagent.json"])

    m, e = agent("m"), agent("e")
    assert [(i["address"], i["port"], i["backend"]) for i in m["instances"]] == \
        [("10.20.0.12", 18002, "10.20.0.12:18002"), ("10.20.0.12", 18003, "10.20.0.12:18003")]
    assert loaded.host_vars("e").backends[:2] == ["10.20.0.12:18002", "10.20.0.12:18003"]   # m's first
    assert [i["backend"] for i in e["instances"]] == [f"{e['instances'][0]['address']}:19002",
                                                      f"{e['instances'][0]['address']}:19003"]


def test_the_demo_host_listens_on_loopback_and_an_open_entry_port_without_keys_is_warned_in_the_recap(tmp_path):
    """1. The `local` demo host as inventory/hosts.yml defines it (ports and deploy_dir moved for the test),
       deployed: its entry port answers on 127.0.0.1 and takes no connection on this machine's outside
       address; no warning.
    2. Deployed again with proxy.bind 0.0.0.0 and no key file: the entry port is open outside, and one
       `local: WARNING: entry port ...` line stands right above the recap.
    3. With proxy.api_keys_file set, `deploy --check` warns of nothing."""
    outside = outside_address()
    shipped = yaml.safe_load((ROOT / "inventory" / "hosts.yml").read_text())
    demo = shipped["hosts"]["local"]
    assert demo["proxy"]["bind"] == "127.0.0.1"
    base = free_ports(5)
    demo.update(instances=1, base_port=base, deploy_dir=str(tmp_path / "deploy"), sim={"load_s": 0.3},
                proxy={**demo["proxy"], "port": base + 1, "admin_port": base + 2, "health_interval_s": 0.5},
                keeper={"metrics_port": base + 3})
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"defaults": shipped["defaults"], "hosts": {"local": demo}}))
    dep, entry = deployment_id(path, "local"), base + 1
    keys = tmp_path / "keys"
    keys.write_text("sk-test-1-long-enough\n")
    keys.chmod(0o600)
    try:
        r = inv("deploy", "--host", "local", inventory=path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert http_status(f"http://127.0.0.1:{entry}/health") == 200
        assert not reachable(outside, entry), f"the demo's entry port {entry} is open on {outside}"
        assert "WARNING" not in r.stdout + r.stderr

        inv("stop", "--host", "local", inventory=path)     # a new bind is a new proxy: start it afresh
        r = inv("deploy", "--host", "local", "--set", "proxy.bind=0.0.0.0", inventory=path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert reachable(outside, entry)
        lines = r.stdout.splitlines()
        recap = next(i for i, line in enumerate(lines) if line.startswith("local : ok="))
        assert lines[recap - 1] == (
            f"local: WARNING: entry port {entry}: listens on 0.0.0.0 with no API key: whoever reaches it may use "
            "the engines; set proxy.api_keys_file (one key per line; both fronts check it), or proxy.bind: "
            "127.0.0.1 behind your own gateway"), r.stdout
        assert (r.stdout + r.stderr).count("WARNING") == 1

        r = inv("deploy", "--host", "local", "--check", "--set", "proxy.bind=0.0.0.0", "--set",
                f"proxy.api_keys_file={keys}", inventory=path)
        assert r.returncode == 0 and "WARNING" not in r.stdout + r.stderr, r.stdout + r.stderr
    finally:
        inv("stop", "--host", "local", inventory=path)
        kill_tagged(dep + "/")
