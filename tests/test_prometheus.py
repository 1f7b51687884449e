"""conf/prometheus.yml from the inventory (`inv render`): the scrape jobs of every proxy, engine instance and
keeper, with their labels, an entry host's fronted hosts included; checked by promtool, then run by a real
Prometheus against a sim cluster under load, which answers the dashboard's key queries."""
from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, free_port, free_ports, http_status, require_tool, wait_until
from fleet_helpers import inv, load

from fleet import render
from fleet.settings import inventory

ENTRY = """\
hosts:
  e:
    connection: local
    engine: sim
    accelerator: sim
    accelerators: 2
    instances: 2
    base_port: {e}
    deploy_dir: {tmp}/e
    proxy: {{port: {e_proxy}, admin_port: {e_admin}}}
    fronts: [e, m]
  m:
    ssh: {{host: 10.9.0.7}}
    engine: sim
    accelerators: 4
    models:
      - {{name: small, instances: 2}}
      - {{name: big, instances: 1, tensor_parallel_size: 2}}
    base_port: 9002
    keeper: {{metrics_port: 9100}}
  lone:
    connection: local
    engine: sim
    instances: 1
    accelerators: 1
    base_port: {lone}
    deploy_dir: {tmp}/lone
    proxy: {{port: {lone_proxy}, admin_port: {lone_admin}}}
    keeper: {{enabled: false}}
"""


def entry_inventory(tmp_path: Path) -> Path:
    e = free_ports(10)      # one pick for both hosts: two picks could overlap
    lone = e + 6
    path = tmp_path / "hosts.yml"
    path.write_text(ENTRY.format(tmp=tmp_path, e=e, e_proxy=e + 2, e_admin=e + 3, lone=lone, lone_proxy=lone + 1,
                                 lone_admin=lone + 2))
    return path


def prometheus_text(path: Path, host: str) -> str:
    """The conf/prometheus.yml host renders from the inventory at path."""
    hv = inventory.load(path).host_vars(host)
    hv.settings.python = "python3"
    return {f.path: f for f in render.render_host(hv)}["conf/prometheus.yml"].content


def prometheus_yml(path: Path, host: str) -> dict:
    return yaml.safe_load(prometheus_text(path, host))


def targets(conf: dict) -> dict[str, list[tuple[str, dict]]]:
    """job -> [(target, labels)] of a loaded prometheus.yml."""
    return {job["job_name"]: [(t, sc["labels"]) for sc in job["static_configs"] for t in sc["targets"]]
            for job in conf["scrape_configs"]}


@pytest.mark.unit
def test_an_entry_host_scrapes_every_proxy_engine_and_keeper_it_fronts(tmp_path):
    """1. Entry host e fronts itself and m (ssh, two models, one of them on two cards).  2. Its prometheus.yml
    has both proxies, all five engines and both keepers; m's at its address, e's on loopback, each labelled
    host, instance, card(s) and model.  3. A host without a keeper (keeper.enabled false) has no keeper target."""
    path = entry_inventory(tmp_path)
    e = inventory.load(path).host_vars("e")
    conf = prometheus_yml(path, "e")
    got = targets(conf)
    assert got["vllm-fleet-proxy"] == [(f"127.0.0.1:{e.settings.proxy.port}", {"host": "e", "instance": "proxy"}),
                                       ("10.9.0.7:8000", {"host": "m", "instance": "proxy"})]
    assert got["vllm-fleet-engine"] == [
        (f"127.0.0.1:{e.ports[0]}", {"host": "e", "instance": "0", "card": "0", "model": "sim-model"}),
        (f"127.0.0.1:{e.ports[1]}", {"host": "e", "instance": "1", "card": "1", "model": "sim-model"}),
        ("10.9.0.7:9002", {"host": "m", "instance": "0", "card": "0", "model": "small"}),
        ("10.9.0.7:9003", {"host": "m", "instance": "1", "card": "1", "model": "small"}),
        ("10.9.0.7:9004", {"host": "m", "instance": "2", "card": "2,3", "model": "big"})]
    assert got["vllm-fleet-keeper"] == [(f"127.0.0.1:{e.ports[1] + 3}", {"host": "e", "instance": "keeper"}),
                                        ("10.9.0.7:9100", {"host": "m", "instance": "keeper"})]
    assert e.settings.keeper.metrics_port == e.settings.proxy.admin_port + 1      # the port after the host's own
    assert next(j for j in conf["scrape_configs"]
                if j["job_name"] == "vllm-fleet-keeper")["honor_labels"] is True
    assert targets(prometheus_yml(path, "lone"))["vllm-fleet-keeper"] == []


@pytest.mark.unit
def test_promtool_accepts_every_rendered_prometheus_yml(tmp_path):
    """`promtool check config` on the entry host's file, a host without a keeper, and the example inventory's."""
    promtool = require_tool("promtool")
    path = entry_inventory(tmp_path)
    files = [(tmp_path / "e.yml", path, "e"), (tmp_path / "lone.yml", path, "lone")]
    files += [(tmp_path / f"{h}.yml", ROOT / "inventory" / "hosts.yml", h) for h in ("k100-01", "k100-02", "cpu")]
    for out, inv_path, host in files:
        out.write_text(prometheus_text(inv_path, host))
        r = subprocess.run([promtool, "check", "config", str(out)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (host, r.stdout + r.stderr)


@pytest.mark.unit
def test_inv_render_writes_conf_prometheus_yml(tmp_path):
    path = entry_inventory(tmp_path)
    r = inv("render", "--host", "e", "--out", str(tmp_path / "out"), inventory=path)
    assert r.returncode == 0, r.stderr
    assert f"wrote {tmp_path / 'out' / 'conf' / 'prometheus.yml'}" in r.stdout
    assert "job_name: vllm-fleet-engine" in (tmp_path / "out" / "conf" / "prometheus.yml").read_text()


# --- a real Prometheus against a sim cluster under load ----------------------------------------------------

def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def answer(port: int, query: str) -> list:
    """The result of an instant query; [] while Prometheus cannot answer yet."""
    try:
        got = api(port, "query", query=query)
    except OSError:
        return []
    return got["data"]["result"] if got.get("status") == "success" else []


def start_prometheus(procs, tmp_path: Path, config: dict) -> int:
    """A real Prometheus on a free loopback port with its own storage under tmp_path; its port once ready."""
    binary = require_tool("prometheus")
    conf = tmp_path / "prometheus.yml"
    conf.write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    procs.start([binary, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    log.close()

    wait_until(lambda: http_status(f"http://127.0.0.1:{port}/-/ready") == 200, timeout=60, interval=0.2, what=f"Prometheus ready (log: {tmp_path / 'prometheus.log'})")
    return port


@pytest.mark.cluster
@pytest.mark.xdist_group("load")
@pytest.mark.timeout(400)
def test_a_real_prometheus_with_the_rendered_config_answers_the_dashboards_queries(sim_cluster, procs, tmp_path):
    """1. Deploy a sim cluster (2 instances of 4 slots, a proxy queue of 2: a burst gets 429s).
    2. `inv render` its conf/prometheus.yml; scrape every 1 s (the test's only change to it).
    3. Start a real Prometheus on it; 12 clients load the proxy (127.0.0.1, bounded in time).
    4. Every target is up, and each of the dashboard's queries gets a non-empty answer, polled until it does or the deadline passes."""
    from test_dashboard import DASHBOARD, panel_exprs
    path, hv = sim_cluster(queue_max=2)
    out = tmp_path / "rendered"
    r = inv("render", "--host", "t", "--out", str(out), inventory=path)
    assert r.returncode == 0, r.stderr
    config = yaml.safe_load((out / "conf" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    port = start_prometheus(procs, tmp_path, config)
    stop = threading.Event()
    clients = [threading.Thread(target=load, args=(hv.settings.proxy.port, stop, 150), daemon=True) for _ in range(12)]
    for c in clients:
        c.start()
    try:
        def all_up():
            active = api(port, "targets")["data"]["activeTargets"]
            return len(active) == 2 + len(hv.ports) and all(t["health"] == "up" for t in active) and active
        active = wait_until(all_up, timeout=60, interval=0.5, what="every target up")
        assert {t["labels"]["job"] for t in active} == {"vllm-fleet-proxy", "vllm-fleet-engine", "vllm-fleet-keeper"}
        queries = [e.replace("$host", "t") for e in panel_exprs(json.loads(DASHBOARD.read_text()))]
        deadline = time.monotonic() + 120
        empty = list(queries)
        while empty and time.monotonic() < deadline:
            empty = [q for q in empty if not answer(port, q)]
            if empty:
                time.sleep(1)
        assert not empty, f"no answer within 120 s to: {empty}"
        engine = answer(port, 'vllm:num_requests_running{host="t"}')
        assert {(s["metric"]["instance"], s["metric"]["card"], s["metric"]["model"]) for s in engine} == {
            (str(i), str(i), "Test-Model") for i in range(len(hv.ports))}
        restarts = answer(port, 'fleet_keeper_restarts_total{host="t",reason="exited"}')
        assert {s["metric"]["instance"] for s in restarts} == {str(i) for i in range(len(hv.ports))}
    finally:
        stop.set()
        for c in clients:
            c.join(40)
