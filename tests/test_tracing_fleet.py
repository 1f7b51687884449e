"""OpenTelemetry from the inventory: proxy.otlp rendered into conf/proxy.yaml, otlp_traces_endpoint into
the engines' command, and the deploy's refusal when the proxy's Python lacks the SDK."""
from __future__ import annotations

import re
import shlex

import pytest
from conftest import PYTHON
from fleet_helpers import write_inventory
from test_render import k100, rendered

from fleet import render
from fleet.errors import InventoryError, RemoteError
from fleet.facts import survey
from fleet.host import preflight
from fleet.settings import inventory
from fleet.transport.connection import LocalTransport

COLLECTOR = "http://collector.example:4318/v1/traces"


@pytest.mark.unit
def test_otlp_keys_render_into_the_proxy_config_and_the_engine_command(tmp_path):
    """proxy.otlp.endpoint reaches conf/proxy.yaml (which the proxy's own loader takes); otlp_traces_endpoint
    becomes vLLM's --otlp-traces-endpoint, in the plain form and the models form, and the sim's (ignored)."""
    from proxy.config import load_config
    files = rendered(k100([f"proxy.otlp.endpoint={COLLECTOR}", "proxy.otlp.timeout_s=3",
                           "proxy.otlp.sample_ratio=0.25", "otlp_traces_endpoint=http://collector.example:4317"]))
    conf = tmp_path / "proxy.yaml"
    conf.write_text(files["conf/proxy.yaml"].content)
    otlp = load_config(conf).otlp
    assert (otlp.endpoint, otlp.timeout_s, otlp.sample_ratio) == (COLLECTOR, 3.0, 0.25)
    engine = re.search(r"^ENGINE=\((.*)\)$", files["bin/start_cluster.sh"].content, re.M).group(1)
    assert shlex.split(engine)[-2:] == ["--otlp-traces-endpoint", "http://collector.example:4317"]
    sim = inventory.load(write_inventory(tmp_path, instances=1, extra=f"otlp_traces_endpoint: {COLLECTOR}\n"))
    sim_hv = sim.host_vars("t")
    sim_hv.settings.python = PYTHON
    assert render.engine_argv(sim_hv)[-2:] == ["--otlp-traces-endpoint", COLLECTOR]
    # Unset (the default), nothing of either is rendered: tests/golden stays as it was.
    plain = rendered(k100())
    assert "otlp" not in plain["conf/proxy.yaml"].content and "otlp" not in plain["bin/start_cluster.sh"].content


@pytest.mark.unit
@pytest.mark.parametrize("override, key", [
    ("proxy.otlp.endpoint=collector:4318", "proxy.otlp.endpoint"),
    ("proxy.otlp.endpoint=http://", "proxy.otlp.endpoint"),
    ("otlp_traces_endpoint=grpc://x:4317", "otlp_traces_endpoint"),
    ("proxy.otlp.timeout_s=0", "proxy.otlp.timeout_s"),
])
def test_bad_otlp_values_are_refused_in_one_sentence(override, key):
    with pytest.raises(InventoryError) as e:
        k100([override])
    assert key in str(e.value) and "\n" not in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.unit
def test_otlp_flag_in_extra_args_is_refused():
    with pytest.raises(InventoryError, match="otlp_traces_endpoint"):
        k100(['extra_args=["--otlp-traces-endpoint", "http://x:4317"]'])


@pytest.mark.unit
def test_preflight_asks_for_the_sdk_only_when_the_proxy_exports():
    assert "opentelemetry" not in preflight.script(k100(), "deploy")
    script = preflight.script(k100([f"proxy.otlp.endpoint={COLLECTOR}"]), "deploy")
    assert "opentelemetry.sdk opentelemetry.exporter.otlp.proto.http" in script


@pytest.mark.unit
def test_preflight_refuses_the_endpoint_without_the_sdk_in_one_sentence():
    hv = k100([f"proxy.otlp.endpoint={COLLECTOR}"])
    with pytest.raises(RemoteError) as e:
        preflight.judge(hv, "deploy", ["missing modules opentelemetry.sdk opentelemetry.exporter.otlp.proto.http"])
    message = str(e.value)
    assert message.count(".") >= 1 and "\n" not in message
    assert "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http" in message
    assert "proxy.otlp.endpoint" in message and "aiohttp" not in message
    with pytest.raises(RemoteError) as e:    # other modules missing too: each said, in the one sentence
        preflight.judge(hv, "deploy", ["missing modules aiohttp opentelemetry.sdk"])
    assert "the modules aiohttp in python3" in str(e.value) and "opentelemetry-sdk" in str(e.value)


@pytest.mark.process
def test_preflight_finds_the_sdk_missing_on_a_real_host(tmp_path):
    """The check as `deploy --check` runs it (its first read, fleet.facts.survey: the deploy probe after env_setup), on this
    machine: a Python whose path shadows the `opentelemetry` package with an empty one (as a Python without
    the SDK) is refused; the test venv's own passes."""
    shadow = tmp_path / "shadow" / "opentelemetry"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    path = write_inventory(tmp_path, instances=1)
    hv = inventory.load(path).host_vars("t", [f"python={PYTHON}", f"proxy.otlp.endpoint={COLLECTOR}"])
    survey.read(LocalTransport(), hv, with_doctor=False, needs=True)       # this venv has the SDK (the test extra)
    hv = inventory.load(path).host_vars("t", [f"python={PYTHON}", f"proxy.otlp.endpoint={COLLECTOR}",
                                              f"env_setup=export PYTHONPATH={shadow.parent}"])
    with pytest.raises(RemoteError, match="lacks what deploy needs: the OpenTelemetry SDK in"):
        survey.read(LocalTransport(), hv, with_doctor=False, needs=True)


@pytest.mark.cluster
def test_the_span_exporter_is_the_proxys_for_status_restart_and_stop(tmp_path):
    """1. deploy one sim instance with proxy.otlp.endpoint at a live collector: the proxy has one span
    exporter child, tagged <id>/proxy; `inv status` counts it as the proxy's (not an orphan); a request's spans reach the collector; 2. a zero-gap proxy restart (a restart-only
    setting): the new proxy has its own exporter, the old one's is gone with it; 3. `inv stop` leaves no
    process of the deployment, the exporter included."""
    import json
    import urllib.request

    from conftest import wait_until
    from fleet_helpers import deployment_id, inv, kill_tagged, status_json, tagged_pids
    from otlp_helpers import Collector, Servers, environ_tag, exporters_of
    servers = Servers()
    collector = Collector(servers)
    inventory = write_inventory(tmp_path, instances=1)
    dep = deployment_id(inventory)
    sets = ["--set", f"proxy.otlp.endpoint={collector.url}"]
    try:
        r = inv("deploy", "--host", "t", *sets, inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        st = status_json(inventory, *sets)
        old = st["proxy"]["pid"]
        child = wait_until(lambda: exporters_of(old), what="the proxy's span exporter")
        assert len(child) == 1 and environ_tag(child[0]) == f"{dep}/proxy"
        text = inv("status", "--host", "t", *sets, inventory=inventory).stdout
        assert f"+ 1 span exporter(s) of the proxy (proxy.otlp), pid {child[0]}" in text, text
        assert "outside any running instance" not in text, text
        req = urllib.request.Request(f"http://127.0.0.1:{st['proxy']['port']}/v1/chat/completions",
                                     data=json.dumps({"model": "Test-Model", "max_tokens": 2, "messages": [
                                         {"role": "user", "content": "hi"}]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as answer:
            trace = answer.headers["X-Trace-Id"]
        wait_until(lambda: len(collector.of_trace(trace)) == 2, what="the request's spans at the collector")

        r = inv("deploy", "--host", "t", *sets, "--set", "proxy.max_body_mb=32", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        new = status_json(inventory, *sets)["proxy"]["pid"]
        assert new != old
        wait_until(lambda: not exporters_of(old) and child[0] not in tagged_pids(dep + "/"), timeout=10,
                   what="the old proxy's exporter gone")
        assert len(wait_until(lambda: exporters_of(new), what="the new proxy's span exporter")) == 1

        r = inv("stop", "--host", "t", *sets, inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert tagged_pids(dep + "/") == [], r.stdout
    finally:
        inv("stop", "--host", "t", *sets, "--now", inventory=inventory)
        kill_tagged(dep + "/")
        servers.close()
