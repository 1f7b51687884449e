"""Several models on one host (issue 18), the inventory's half: groups, cards, what each file says, the
refusals; and the rendered start script run with a recording engine."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, ROOT, free_ports, require_tool, wait_until
from test_render import stop_recorded, write_rendered

from hostagent.facts import Tagged

from fleet import render
from fleet.commands import display
from fleet.facts.state import InstanceStatus, ModelStatus, ProxyStatus, Status
from fleet.errors import InventoryError
from fleet.plan import steps as plan
from fleet.settings import inventory
from fleet.settings.cluster import Pool
from fleet.settings.inventory import ServedModel


def load(text: str, tmp_path: Path) -> inventory.Inventory:
    path = tmp_path / "hosts.yml"
    path.write_text(textwrap.dedent(text))
    return inventory.load(path)


def files(hv) -> dict[str, str]:
    return {f.path: f.content for f in render.render_host(hv)}


def example(name: str = "k100-02", overrides=()):
    hv = inventory.load(ROOT / "inventory" / "hosts.yml").host_vars(name, overrides)
    hv.settings.python = "python3"
    return hv


@pytest.mark.unit
def test_the_example_host_hands_out_cards_in_order_and_renders_pools():
    hv = example()
    assert hv.settings.instances == 7 and hv.ports == list(range(8002, 8009))
    assert hv.cards == [(0,), (1,), (2,), (3,), (4,), (5,), (6, 7)]
    assert [g.name for g in hv.groups] == ["MiniCPM-V-4_5", "Qwen2.5-32B-Instruct"]
    out = files(hv)
    script = out["bin/start_cluster.sh"]
    assert "#   instance 6 (port 8008): Qwen2.5-32B-Instruct, cards 6,7 (tensor parallel 2)" in script
    assert "#   instance 0 (port 8002): MiniCPM-V-4_5, card 0" in script
    assert 'CARDS_OF=("0" "1" "2" "3" "4" "5" "6,7")' in script and 'HIP_VISIBLE_DEVICES="${CARDS_OF[$i]}"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    proxy = yaml.safe_load(out["conf/proxy.yaml"])
    assert proxy["models"] == [
        {"name": "MiniCPM-V-4_5", "aliases": ["vision"], "adapters": ["invoice-ocr", "chart-qa"], "slots": 4,
         "backends": [f"127.0.0.1:{p}" for p in range(8002, 8008)]},
        {"name": "Qwen2.5-32B-Instruct", "aliases": [], "adapters": [], "slots": 8,
         "backends": ["127.0.0.1:8008"]}]
    agent = json.loads(out["conf/hostagent.json"])
    assert agent["instances"][6]["cards"] == [6, 7] and agent["instances"][6]["model"] == "Qwen2.5-32B-Instruct"
    assert agent["models"][1] == {"name": "Qwen2.5-32B-Instruct", "instances": [6], "aliases": [], "runtime_lora": True,
                                  "lora_modules": {}}


@pytest.mark.unit
def test_a_plain_host_says_nothing_of_models():
    """One group, one card per instance, no alias or adapter: the files of before (the golden ones)."""
    out = files(example("k100-01"))
    assert "models:" not in out["conf/proxy.yaml"] and '"models"' not in out["conf/hostagent.json"]
    assert "CARDS_OF" not in out["bin/start_cluster.sh"]


@pytest.mark.unit
def test_tensor_parallel_on_a_minimal_nvidia_host_lists_every_card(tmp_path):
    inv = load("""\
        hosts:
          gpu:
            ssh: {host: 10.0.0.5}
            accelerator: nvidia
            model: /models/qwen-32b
            instances: 4
            tensor_parallel_size: 2
        """, tmp_path)
    hv = inv.host_vars("gpu")
    assert hv.cards == [(0, 1), (2, 3), (4, 5), (6, 7)]
    script = files(hv)["bin/start_cluster.sh"]
    assert 'CUDA_VISIBLE_DEVICES="${CARDS_OF[$i]}"' in script and 'CARDS_OF=("0,1" "2,3" "4,5" "6,7")' in script
    assert "GROUP_ARGS=(--tensor-parallel-size 2)" in script
    # the nvidia card files of both cards count for the instance's release check
    agent = json.loads(files(hv)["conf/hostagent.json"])
    assert agent["instances"][1]["card_files"] == ["/dev/nvidia2", "/dev/nvidia3"]


BAD = [
    ("models: [{name: m, instances: 5, tensor_parallel_size: 2}]",
     "hosts.h.models: the instances need 10 cards (m 5 x 2: instances x tensor_parallel_size) but the host "
     "has 8 accelerators"),
    ("extra_args: [--tensor-parallel-size, '2']",
     "hosts.h.extra_args: --tensor-parallel-size is set by the key tensor_parallel_size; use that key instead."),
    ("extra_args: ['--served-model-name=x']",
     "hosts.h.extra_args: --served-model-name is set by the key name (or served_model_name) and aliases"),
    ("extra_args: [-tp, '2']", "-tp is set by the key tensor_parallel_size"),
    ("models: [{name: a, instances: 1}, {name: a, model: /m2, instances: 1}]",
     "hosts.h.models: the name 'a' is used by groups 0 (a) and 1 (a)"),
    ("models: [{name: a, instances: 1, aliases: [b]}, {name: b, model: /m2, instances: 1}]",
     "the name 'b' is used by groups 0 (a) and 1 (b)"),
    ("models: [{name: a, lora_modules: {x: /l}}, {name: b, aliases: [x]}]", "the name 'x' is used by groups 0 (a) and 1 (b)"),
    ("models: [{name: a, instances: 1, extra_args: [--served-model-name, b]}]",
     "hosts.h.models[0].extra_args: --served-model-name is set by the key"),
    ("models: [{name: 'a b'}]", "hosts.h.models.name: expected a name without blanks, control characters or '='"),
    ("models: []", "hosts.h.models: expected a list of model groups"),
]


@pytest.mark.unit
@pytest.mark.parametrize("keys,message", BAD)
def test_the_schema_refuses_in_one_sentence(tmp_path, keys, message):
    with pytest.raises(InventoryError) as e:
        load(f"""\
            hosts:
              h:
                ssh: {{host: 10.0.0.5}}
                accelerator: dcu
                model: /m
                served_model_name: m
                instances: 1
                {keys}
            """, tmp_path)
    assert message in str(e.value), str(e.value)
    assert str(e.value).count("\n") == 0


@pytest.mark.unit
def test_cpu_instances_take_no_tensor_parallel(tmp_path):
    """vLLM's CPU build runs tensor parallel ranks on core sets of their own (VLLM_CPU_OMP_THREADS_BIND
    "0-3|4-7"); the toolkit gives a cpu instance one core set, so T > 1 is refused there."""
    with pytest.raises(InventoryError, match=r"hosts\.c\.tensor_parallel_size: 2 on accelerator cpu"):
        load("""\
            hosts:
              c: {connection: local, accelerator: cpu, model: /m, instances: 1, tensor_parallel_size: 2}
            """, tmp_path)


@pytest.mark.unit
def test_an_entry_host_pools_every_fronted_host_by_model(tmp_path):
    inv = load("""\
        hosts:
          entry: {connection: local, fronts: [a, b, c]}
          a: {ssh: {host: 10.0.0.1}, accelerator: dcu, model: /m/vision, instances: 2, aliases: [v]}
          b: {ssh: {host: 10.0.0.2}, accelerator: dcu, model: /m/vision, instances: 1, aliases: [v]}
          c: {ssh: {host: 10.0.0.3}, accelerator: dcu, model: /m/text, instances: 1, max_num_seqs: 8}
        """, tmp_path)
    hv = inv.host_vars("entry")
    assert hv.pools == [
        Pool("vision", 4, ["10.0.0.1:8002", "10.0.0.1:8003", "10.0.0.2:8002"], aliases=["v"]),
        Pool("text", 8, ["10.0.0.3:8002"])]
    assert hv.settings.served_model_name == "vision"          # inv chat's default on an entry without a model
    assert [m.name for m in hv.served_models()] == ["vision", "text"]
    assert hv.served_model("v") == ServedModel("v", instances=3, max_num_seqs=4)
    with pytest.raises(InventoryError, match="serves no model 'nope'; it serves vision, text"):
        hv.served_model("nope")


@pytest.mark.unit
def test_two_fronted_hosts_disagreeing_on_a_model_are_refused(tmp_path):
    with pytest.raises(InventoryError, match="give the model one max_num_seqs on every host"):
        load("""\
            hosts:
              entry: {connection: local, fronts: [a, b], model: /m/x}
              a: {ssh: {host: 10.0.0.1}, accelerator: dcu, model: /m/vision, instances: 1, aliases: [v]}
              b: {ssh: {host: 10.0.0.2}, accelerator: dcu, model: /m/vision, instances: 1, max_num_seqs: 2}
            """, tmp_path)


@pytest.mark.unit
def test_nginx_refuses_a_host_that_routes_by_model():
    assert plan.nginx_refusal(example("k100-01")) is None
    why = plan.nginx_refusal(example())
    assert "nginx cannot be the front here: it does not read the request body" in why
    assert "MiniCPM-V-4_5, Qwen2.5-32B-Instruct" in why


@pytest.mark.unit
def test_status_shows_each_instance_model_and_cards():
    st = Status(host="k100-02", front="proxy", deploy_dir="/d",
                proxy=ProxyStatus(port=8000, pid=1, state="healthy", backends=[]),
                models=[ModelStatus("vision", aliases=["v"], adapters=["ocr"], instances=[0]),
                        ModelStatus("text", instances=[1])],
                instances=[
                    InstanceStatus(index=0, port=8002, accelerator=0, cards=[0], model="vision", pid=10, pgid=10,
                                   state="healthy"),
                    InstanceStatus(index=1, port=8003, accelerator=1, cards=[1, 2], model="text", pid=11, pgid=11,
                                   state="healthy")])
    table = display.status_table(st)
    assert "model vision: instance(s) 0 (alias v, adapter ocr)" in table
    assert "  1        8003   text    1,2    11" in table, table


RECORDER = """\
#!{python}
# Records its argv and the environment the start script gives it, then listens on --port.
import json, os, socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
keep = ("CUDA_VISIBLE_DEVICES", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "FLEET_TAG")
with open(os.environ["RECORD_DIR"] + "/argv_%d.json.tmp" % port, "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keep}}, "pid": os.getpid(),
               "pgid": os.getpgid(0)}}, f)
os.rename(os.environ["RECORD_DIR"] + "/argv_%d.json.tmp" % port, os.environ["RECORD_DIR"] + "/argv_%d.json" % port)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen(8)
time.sleep(120)
"""


@pytest.mark.process
def test_each_instance_starts_with_its_group_argv_cards_and_environment(tmp_path):
    require_tool("ss")
    engine = tmp_path / "fake-vllm"
    engine.write_text(RECORDER.format(python=PYTHON))
    engine.chmod(0o755)
    base = free_ports(3)
    inv = load(f"""\
        hosts:
          h:
            connection: local
            accelerator: nvidia
            accelerators: 4
            vllm_bin: {engine}
            deploy_dir: {tmp_path / 'deploy'}
            base_port: {base}
            stagger_s: 0
            models:
              - {{name: vision, model: /m/vision, instances: 2, aliases: [v, see], lora_modules: {{ocr: /l/ocr}},
                 extra_args: [--trust-remote-code]}}
              - {{name: text, model: /m/text, tensor_parallel_size: 2, max_num_seqs: 8, runtime_lora: true}}
        """, tmp_path)
    hv = inv.host_vars("h")
    hv.settings.python = PYTHON
    deploy = tmp_path / "deploy"
    write_rendered(hv, deploy)
    env = {**os.environ, "RECORD_DIR": str(tmp_path)}
    try:
        r = subprocess.run([str(deploy / "bin" / "start_cluster.sh")], env={**env, "MAX_LEN": "1024"},
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert "instance 2: started pid" in r.stdout and "text on card(s) 2,3" in r.stdout, r.stdout

        def recorded(port):
            p = tmp_path / f"argv_{port}.json"
            return wait_until(lambda: p.exists() and json.loads(p.read_text()), what=f"argv of :{port}")
        first, third = recorded(base), recorded(base + 2)
        argv = first["argv"]
        assert argv[:2] == ["serve", "/m/vision"]
        assert argv[argv.index("--served-model-name") + 1:argv.index("--host")] == ["vision", "v", "see"]
        assert argv[argv.index("--max-num-seqs") + 1] == "4" and argv[argv.index("--max-model-len") + 1] == "1024"
        assert argv[argv.index("--lora-modules") + 1] == "ocr=/l/ocr" and "--enable-lora" in argv
        assert argv[-1] == "--trust-remote-code" and "--tensor-parallel-size" not in argv
        assert first["env"] == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": None,
                                "FLEET_TAG": f"{hv.deployment_id}/0"}
        assert first["pgid"] == first["pid"]     # env execs setsid: the instance still leads its session
        argv = third["argv"]
        assert argv[:2] == ["serve", "/m/text"] and argv[argv.index("--max-num-seqs") + 1] == "8"
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and "--lora-modules" not in argv
        assert third["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
        assert third["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    finally:
        stop_recorded(deploy)


@pytest.mark.unit
def test_status_counts_running_instances_log_writers_apart_from_strays():
    """Each running instance's log writer (tag <id>/log-<i>, its own session) is expected; a tagged
    process in no running session, and a log writer of a stopped instance, are leftovers."""
    st = Status(host="h", front="proxy", deploy_dir="/d",
                proxy=ProxyStatus(port=8000, pid=1, state="healthy", backends=[]),
                instances=[InstanceStatus(index=0, port=8002, accelerator=0, pid=10, pgid=10, state="healthy"),
                           InstanceStatus(index=1, port=8003, accelerator=1, state="stopped")],
                tagged=[Tagged(12, "dep/0", sid=10), Tagged(13, "dep/log-0", sid=13),
                        Tagged(14, "dep/log-1", sid=14), Tagged(15, "dep/1", sid=15)])
    table = display.status_table(st)
    assert "+ 1 engine process(es) in the running instances' sessions" in table
    assert "+ 1 log writer(s) of the running instances" in table
    assert "2 process(es) carry the deployment's tag outside any running instance" in table
    assert table.rstrip().endswith("14, 15"), table



@pytest.mark.unit
def test_status_counts_the_proxys_span_exporter_apart_from_strays():
    """The proxy's span exporter (its child, tag <id>/proxy, in its session) is expected, not an orphan nor
    an engine process; one whose proxy is gone (another parent) is a leftover."""
    st = Status(host="h", front="proxy", deploy_dir="/d",
                proxy=ProxyStatus(port=8000, pid=5, state="healthy", backends=[]),
                instances=[InstanceStatus(index=0, port=8002, accelerator=0, pid=10, pgid=10, state="healthy")],
                tagged=[Tagged(6, "dep/proxy", sid=5, ppid=5), Tagged(7, "dep/proxy", sid=4, ppid=1)])
    table = display.status_table(st)
    assert "+ 1 span exporter(s) of the proxy (proxy.otlp), pid 6" in table
    assert "engine process" not in table
    assert "1 process(es) carry the deployment's tag outside any running instance" in table
    assert table.rstrip().endswith(": 7"), table
