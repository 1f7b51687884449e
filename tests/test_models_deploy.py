"""Several models on one sim host, deployed by `inv` (issue 18): requests routed by `model`, status with
each instance's model and cards, a stop that releases every card of a tensor-parallel instance."""
from __future__ import annotations

import json
import textwrap
import urllib.error
import urllib.request

import openai
import pytest

from conftest import free_ports
from fleet_helpers import deployment_id, inv, kill_tagged, status_json

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("models_deploy")]


def write(tmp_path):
    base = free_ports(5)
    path = tmp_path / "hosts.yml"
    path.write_text(textwrap.dedent(f"""\
        hosts:
          t:
            connection: local
            engine: sim
            accelerator: sim
            accelerators: 4
            base_port: {base}
            deploy_dir: {tmp_path / 'deploy'}
            stagger_s: 0
            health_timeout_s: 60
            stop_grace_s: 3
            release_timeout_s: 10
            sim: {{load_s: 0.3, prefill_ms: 20, token_ms: 5}}
            models:
              - {{name: vision, model: /m/vision, instances: 2, aliases: [see]}}
              - {{name: text, model: /m/text, tensor_parallel_size: 2, max_num_seqs: 2}}
            proxy:
              port: {base + 3}
              admin_port: {base + 4}
              health_interval_s: 0.5
        """))
    return path, base


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    inventory, base = write(tmp)
    dep = deployment_id(inventory)
    r = inv("deploy", "--host", "t", inventory=inventory)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield inventory, base, r.stdout
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


def test_requests_land_on_their_models_instances(host):
    inventory, base, _ = host
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 3}/v1", api_key="x", max_retries=0, timeout=30)
    seen: dict[str, set] = {}
    for model in ["vision", "text", "see"] * 3:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert raw.parse().model == {"see": "vision"}.get(model, model)  # vLLM: the first served name
        seen.setdefault(model, set()).add(raw.headers["X-Backend"])
    vision = {f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"}
    assert seen["vision"] <= vision and seen["see"] <= vision
    assert seen["text"] == {f"127.0.0.1:{base + 2}"}
    ids = {m.id for m in client.models.list().data}
    assert {"vision", "see", "text"} <= ids
    try:
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{base + 3}/v1/chat/completions",
            json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
            {"Content-Type": "application/json"}), timeout=10)
        raise AssertionError("an unknown model was answered")
    except urllib.error.HTTPError as e:
        assert e.code == 404 and json.loads(e.read())["error"]["message"] == "The model `nope` does not exist."


def test_status_shows_model_and_cards(host):
    inventory, _, _ = host
    st = status_json(inventory)
    assert [(i["model"], i["cards"], i["state"]) for i in st["instances"]] == [
        ("vision", [0], "healthy"), ("vision", [1], "healthy"), ("text", [2, 3], "healthy")]
    r = inv("status", "--host", "t", inventory=inventory)
    assert "model text: instance(s) 2" in r.stdout and "model vision: instance(s) 0, 1 (alias see)" in r.stdout


def test_swap_to_nginx_refuses_in_one_sentence(host):
    inventory, _, _ = host
    r = inv("swap-to-nginx", "--host", "t", inventory=inventory)
    assert r.returncode != 0
    assert "nginx cannot be the front here: it does not read the request body" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_stopping_the_tensor_parallel_instance_releases_both_its_cards(host):
    inventory, _, _ = host
    r = inv("stop", "--host", "t", "--instance", "2", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip()[:1] in "0123"
            and ("released" in line or "NOT" in line)]
    assert [row[0] for row in rows] == ["2", "3"], r.stdout
    assert all(row[-1] == "released" for row in rows), r.stdout
    st = status_json(inventory)
    assert [i["state"] for i in st["instances"]] == ["healthy", "healthy", "stopped"]
