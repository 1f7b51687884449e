"""hostagent/layout.py, the one spelling of deploy_dir's paths and of the tag, and how host code is bundled
(fleet/transport/hostcode.py): each probe runs alone on standard input with the modules it imports in front."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hostagent import layout

from fleet.settings import inventory as fleet_inventory
from fleet.transport import hostcode

pytestmark = pytest.mark.unit


def test_paths_under_deploy_dir():
    assert layout.instance_pidfile(3) == "run/instance_3.pid"
    assert layout.instance_log(3) == "logs/vllm_3.log"
    assert layout.instance_ready(3) == "run/instance_3.ready"
    assert (layout.PROXY_PID, layout.KEEPER_PID, layout.NGINX_PID) == ("run/proxy.pid", "run/keeper.pid",
                                                                         "run/nginx.pid")
    assert (layout.LOCK, layout.MODE, layout.KEEPER_STATE, layout.KEEPER_METRICS) == (
        "run/fleet.lock", "run/mode", "run/keeper.json", "run/keeper.prom")
    assert (layout.PROXY_LOG, layout.RESULTS_LOG, layout.KEEPER_LOG) == ("logs/proxy.log", "logs/req_results.log",
                                                                         "logs/keeper.log")
    assert (layout.HOSTAGENT_CONF, layout.PROXY_CONF, layout.NGINX_FRONT_CONF, layout.NGINX_CONF) == (
        "conf/hostagent.json", "conf/proxy.yaml", "conf/nginx_front.json", "conf/nginx.conf")
    assert layout.START_CLUSTER == "bin/start_cluster.sh" and layout.STOP_CLUSTER == "bin/stop_cluster.sh"
    assert layout.path("/srv/d", layout.instance_pidfile(0)) == "/srv/d/run/instance_0.pid"
    assert [layout.pidfile_instance(n) for n in ("instance_12.pid", "instance_x.pid", "proxy.pid")] == [12, None,
                                                                                                        None]


def test_tags():
    assert layout.tag("ab12", 3) == "ab12/3" and layout.tag("ab12", "keeper") == "ab12/keeper"
    assert layout.parse_tag("ab12/3") == ("ab12", "3") and layout.parse_tag("ab12/nginx-watch") == ("ab12", "nginx-watch")
    assert layout.parse_tag("nonsense") is None and layout.parse_tag("") is None and layout.parse_tag(None) is None
    assert layout.tag_instance("ab12/3", "ab12") == 3
    assert layout.tag_instance("ab12/proxy", "ab12") is None and layout.tag_instance("zz/3", "ab12") is None
    assert layout.tag_prefix("ab12") == "ab12/"


def test_layout_is_importable_alone():
    """Standard library only, no import of the rest of the package (the control plane imports it)."""
    assert hostcode.imports("layout") == ()
    code = f"import runpy; m = runpy.run_path({str(hostcode.path('layout'))!r}); print(m['instance_pidfile'](1))"
    r = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "run/instance_1.pid", r.stderr


def test_each_probe_is_bundled_with_what_it_imports_in_dependency_order():
    assert hostcode.needs("probes.state") == ["files", "apikeys", "layout", "boothook", "facts", "httpcall", "processes",
                                              "instances", "proxyadmin", "errors", "lora", "logfiles", "config", "parts",
                                              "vrrp", "observe"]
    assert hostcode.needs("vrrp") == ["layout", "logfiles", "files", "processes", "errors", "config", "parts"]
    assert hostcode.needs("probes.top") == ["exposition", "httpcall", "layout", "files", "processes", "instances",
                                            "proxyadmin", "observe"]
    assert hostcode.needs("probes.doctor") == ["files", "apikeys", "layout", "boothook", "httpcall", "processes",
                                               "instances", "logfiles", "errors", "config", "parts", "vrrp", "facts"]
    deploy = hostcode.needs("probes.deploy")         # another probe's modules, then that probe
    assert deploy.index("probes.doctor") > deploy.index("processes") and deploy[-1] == "probes.state", deploy
    assert set(deploy) == set(hostcode.needs("probes.doctor") + hostcode.needs("probes.state")
                              + ["probes.doctor", "probes.state"]), deploy
    assert hostcode.needs("probes.holders") == ["files", "layout", "processes", "facts"]
    assert hostcode.needs("probes.cpu_mem") == ["layout", "files", "processes"]
    assert hostcode.needs("processes") == ["files", "layout"] and hostcode.needs("lock") == ["layout"]


@pytest.mark.parametrize("bind,address", [("", "127.0.0.1"), ("*", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"),
                                          ("::", "::1"), ("[::]", "::1"), ("10.0.0.5", "10.0.0.5"),
                                          ("[fd00::5]", "fd00::5"), ("127.0.0.2", "127.0.0.2")])
def test_a_wildcard_bind_is_reached_on_loopback_and_one_address_on_itself(bind, address):
    """One rule for both sides: the host agent's entry port checks and the control plane's sampler spec."""
    assert layout.local_address(bind) == address
    assert fleet_inventory.local_address(bind) == address


@pytest.mark.parametrize("state_spec", [{}, {"health_timeout_s": 30}])
def test_the_state_probe_runs_alone_on_standard_input(tmp_path, state_spec):
    """As the control node runs it where nothing is deployed: `python3 - SPEC` from another directory, the
    bundle on standard input; every instance answers its state (instances.classify)."""
    spec = {"deploy_dir": str(tmp_path / "none"), "ports": [1, 2], "proxy_port": 3, "admin_port": 4,
            "deployment_id": "d", **state_spec}
    r = subprocess.run([sys.executable, "-I", "-", json.dumps(spec)], input=hostcode.probe("state"),
                       capture_output=True, text=True, cwd="/", timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [(i["index"], i["state"], i["reason"]) for i in out["instances"]] == [(0, "stopped", None),
                                                                               (1, "stopped", None)]


def test_the_deploy_probe_runs_alone_on_standard_input_with_the_probes_it_bundles(tmp_path):
    """deploy's first read (fleet.facts.survey) as the control node sends it: the deploy probe bundled with the
    doctor and state probes it imports, run from another directory; it answers the preflight script's
    lines, the doctor's facts and the state in one JSON object."""
    d = str(tmp_path / "none")
    state = {"deploy_dir": d, "ports": [1], "proxy_port": 3, "admin_port": 4, "deployment_id": "d"}
    doctor = {"deploy_dir": d, "deployment_id": "d", "engine": {"kind": "sim", "cmd": [sys.executable, "-c", ""],
                                                                "deep": False},
              "model": "m", "check_model": False, "ports": [], "api_keys_file": None, "tenants": [], "smi_cmd": None}
    spec = {"needs": "echo missing tool nothere-xyz", "doctor": doctor, "state": state}
    r = subprocess.run([sys.executable, "-I", "-", json.dumps(spec)], input=hostcode.probe("deploy"),
                       capture_output=True, text=True, cwd="/", timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["needs"] == ["missing tool nothere-xyz"]
    assert out["doctor"]["engine"]["exit"] == 0 and out["doctor"]["disk"]["dir"] == str(tmp_path)
    assert [(i["index"], i["state"]) for i in out["state"]["instances"]] == [(0, "stopped")]
