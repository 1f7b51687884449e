"""Rendering: golden files of k100-01, the quoting proof, and start_cluster.sh's idempotence."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import PYTHON, ROOT, free_ports, require_tool, wait_until

from hostagent import processes
from hostagent.processes import parse_record

from fleet import render
from fleet.settings import inventory

GOLDEN = Path(__file__).parent / "golden" / "k100-01"


def k100(overrides=()):
    hv = inventory.load(ROOT / "inventory" / "hosts.yml").host_vars("k100-01", overrides)
    hv.settings.python = "python3"
    hv.inventory_path = "inventory/hosts.yml"    # as `inv` shows it from the project root, wherever that is
    return hv


def rendered(hv) -> dict[str, render.RenderedFile]:
    return {f.path: f for f in render.render_host(hv)}


@pytest.mark.parametrize("path", ["bin/start_cluster.sh", "bin/stop_cluster.sh", "conf/proxy.yaml",
                                  "conf/nginx.conf", "conf/prometheus.yml"])
@pytest.mark.unit
def test_k100_renders_its_golden_file(path):
    """Compare with tests/golden; after an intended change: UPDATE_GOLDEN=1 pytest tests/test_render.py."""
    content = rendered(k100())[path].content
    golden = GOLDEN / path
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(content)
    assert content == golden.read_text()


@pytest.mark.unit
def test_proxy_slots_are_max_num_seqs_plus_headroom_and_the_proxy_reads_them(tmp_path):
    """The rendered conf/proxy.yaml gives each backend max_num_seqs + proxy.queue.headroom slots and
    the queue's bounds, and the proxy's own loader takes the file as it is."""
    from proxy.config import load_config
    conf = tmp_path / "proxy.yaml"
    conf.write_text(rendered(k100())["conf/proxy.yaml"].content)
    default = load_config(conf)
    assert (default.slots, default.queue.max, default.queue.timeout_s) == (4, 256, 60.0)
    conf.write_text(rendered(k100(["max_num_seqs=6", "proxy.queue.headroom=2", "proxy.queue.max=0",
                                   "proxy.queue.timeout_s=2.5"]))["conf/proxy.yaml"].content)
    changed = load_config(conf)
    assert (changed.slots, changed.queue.max, changed.queue.timeout_s) == (8, 0, 2.5)


@pytest.mark.unit
def test_render_is_pure_and_modes_are_set():
    a, b = render.render_host(k100()), render.render_host(k100())
    assert a == b
    modes = {f.path: f.mode for f in a}
    assert modes["bin/start_cluster.sh"] == 0o755 and modes["conf/proxy.yaml"] == 0o644


@pytest.mark.unit
def test_scripts_are_valid_bash():
    for f in render.render_host(k100()):
        if f.path.endswith(".sh"):
            r = subprocess.run(["bash", "-n"], input=f.content, text=True, capture_output=True)
            assert r.returncode == 0, (f.path, r.stderr)


@pytest.mark.unit
def test_k100_engine_command_and_device_visibility():
    script = rendered(k100())["bin/start_cluster.sh"].content
    assert "ENGINE=(vllm serve /data/models/MiniCPM-V-4_5 --enable-prompt-tokens-details)" in script
    assert 'HIP_VISIBLE_DEVICES="$i"' in script and "ROCR_VISIBLE_DEVICES" not in script
    nvidia = rendered(k100(["accelerator=nvidia"]))["bin/start_cluster.sh"].content
    assert 'CUDA_VISIBLE_DEVICES="$i"' in nvidia and "HIP_VISIBLE_DEVICES" not in nvidia


RECORDER = textwrap.dedent("""\
    #!{python}
    # An engine that records its argv and environment, then listens on --port like vllm serve.
    import json, os, socket, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    with open(os.environ["RECORD_DIR"] + "/argv_%d.json" % port, "w") as f:
        json.dump({{"argv": sys.argv[1:], "tag": os.environ.get("FLEET_TAG"),
                   "hip": os.environ.get("HIP_VISIBLE_DEVICES"), "spt_noenv": os.environ.get("SPT_NOENV"),
                   "cpus": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                   "kvcache": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                   "pgid": os.getpgid(0), "pid": os.getpid()}}, f)
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port)); s.listen(8)
    time.sleep(120)
""")

NASTY = """/data/my models/Mini "CPM" 'V' $(touch PWNED) `touch PWNED2`; touch PWNED3 && echo \\ $HOME"""


def recorder_deploy(tmp_path, *overrides):
    """k100-01 rendered into tmp_path/deploy with a recording engine in place of vllm; its HostVars."""
    require_tool("ss")
    engine = tmp_path / "fake-vllm"
    engine.write_text(RECORDER.format(python=PYTHON))
    engine.chmod(0o755)
    base = free_ports(2)
    hv = k100([f"vllm_bin={engine}", f"deploy_dir={tmp_path / 'deploy'}", f"base_port={base}",
               "proxy.port=1", "proxy.admin_port=2", "stagger_s=0", "env_setup=", "instances=2", *overrides])
    hv.settings.model = NASTY
    hv.settings.served_model_name = "name with 'quotes' and $(x)"
    hv.settings.extra_args = ["--limit-mm-per-prompt", '{"image": 4}', "; touch PWNED4"]
    write_rendered(hv, tmp_path / "deploy")
    return hv


def recorded(tmp, port: int) -> dict:
    """What the recording engine on `port` wrote, once it is whole (waits for it)."""
    def read():
        try:
            return json.loads((tmp / f"argv_{port}.json").read_text())
        except (OSError, ValueError):
            return None
    return wait_until(read, what=f"the engine's argv on :{port}")


def write_rendered(hv, deploy):
    for f in render.render_host(hv):
        p = deploy / f.path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f.content)
        p.chmod(f.mode)


def stop_recorded(deploy):
    """Stop what the script started, by the records it wrote (only a process that still matches one)."""
    for pidfile in (deploy / "run").glob("instance_*.pid"):
        rec = parse_record(pidfile.read_bytes())
        if rec["start"] is not None and (processes.read_stat(rec["pid"]) or ())[4:] == (rec["start"],):
            try:
                os.killpg(rec["pgid"], 9)
            except ProcessLookupError:
                pass


@pytest.fixture
def recorder_host(tmp_path):
    """k100-01 rendered into tmp_path with a recording engine in place of vllm."""
    hv = recorder_deploy(tmp_path)
    env = {**os.environ, "RECORD_DIR": str(tmp_path)}
    yield hv, tmp_path, env
    stop_recorded(tmp_path / "deploy")


@pytest.mark.process
def test_nasty_values_reach_the_engine_as_one_literal_argument(recorder_host):
    hv, tmp, env = recorder_host
    script = tmp / "deploy" / "bin" / "start_cluster.sh"
    r = subprocess.run([str(script)], cwd=tmp, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rec = recorded(tmp, hv.ports[0])
    argv = rec["argv"]
    assert argv[:2] == ["serve", NASTY]
    assert "--served-model-name=name with 'quotes' and $(x)" in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    assert argv[-3:] == ["--limit-mm-per-prompt", '{"image": 4}', "; touch PWNED4"]
    assert rec["spt_noenv"] == "1"     # vLLM's setproctitle would otherwise erase FLEET_TAG
    assert not list(tmp.glob("PWNED*")) and not list((tmp / "deploy").glob("**/PWNED*"))
    # Device visibility, tag, and its own session (setsid), its identity recorded: pid, pgid, sid, start, tag.
    assert rec["hip"] == "0" and rec["tag"] == f"{hv.deployment_id}/0"
    assert rec["pgid"] == rec["pid"]
    record = parse_record((tmp / "deploy" / "run" / "instance_0.pid").read_bytes())
    state, _, pgid, sid, start = processes.read_stat(rec["pid"])
    assert record == {"pid": rec["pid"], "pgid": rec["pid"], "sid": rec["pid"], "start": start,
                        "tag": f"{hv.deployment_id}/0"}


@pytest.mark.process
def test_start_twice_skips_every_instance_and_honours_env_overrides(recorder_host):
    hv, tmp, env = recorder_host
    script = str(tmp / "deploy" / "bin" / "start_cluster.sh")
    first = subprocess.run([script], env={**env, "MAX_SEQS": "1", "MAX_LEN": "4096"}, capture_output=True,
                           text=True, timeout=30)
    assert first.stdout.count(": started pid") == 2, first.stdout
    for port in hv.ports:
        wait_until(lambda: subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout.count(
            f":{port} ") > 0, what=f"port {port} listening")
    rec = json.loads((tmp / f"argv_{hv.ports[1]}.json").read_text())["argv"]
    assert rec[rec.index("--max-num-seqs") + 1] == "1" and rec[rec.index("--max-model-len") + 1] == "4096"
    second = subprocess.run([script], env=env, capture_output=True, text=True, timeout=30)
    assert second.returncode == 0
    for i, port in enumerate(hv.ports):
        assert f"instance {i}: port {port} already listening, skipped" in second.stdout
    assert "started 0 instance(s)" in second.stdout
    # The previous log is kept as .1 on a real restart; N=1 starts only instance 0. The rotating writer
    # (its own process) makes the file as it starts.
    wait_until(lambda: (tmp / "deploy" / "logs" / "vllm_0.log").exists(), what="logs/vllm_0.log")


@pytest.mark.process
def test_n_override_starts_fewer(recorder_host):
    hv, tmp, env = recorder_host
    r = subprocess.run([str(tmp / "deploy" / "bin" / "start_cluster.sh")], env={**env, "N": "1"},
                       capture_output=True, text=True, timeout=30)
    assert "started 1 instance(s)" in r.stdout and "instance 1" not in r.stdout


@pytest.mark.unit
def test_inv_render_applies_every_set_override(tmp_path):
    """`--set` is repeatable: each override lands in the rendered files, later ones on top."""
    from fleet_helpers import inv
    out = tmp_path / "out"
    r = inv("render", "--host", "k100-01", "--out", str(out), "--set", "instances=2",
            "--set", "max_num_seqs=6", "--set", "proxy.retries=0", inventory=ROOT / "inventory" / "hosts.yml")
    assert r.returncode == 0, r.stderr
    proxy = (out / "conf" / "proxy.yaml").read_text()
    assert proxy.count('  - "127.0.0.1:') == 2 and "retries: 0" in proxy
    assert 'MAX_SEQS="${MAX_SEQS:-6}"' in (out / "bin" / "start_cluster.sh").read_text()


@pytest.mark.process
def test_extra_args_are_never_read_as_served_names(recorder_host):
    """--served-model-name takes one or more values in vLLM: an extra argument that does not start with
    `-` right after it became another served name. The rendered argv, parsed with the same argparse
    definition (nargs="+", as vLLM's; the sim's parser), serves one name and keeps the extra argument."""
    from fleet.sim import cli
    hv, tmp, env = recorder_host
    hv.settings.extra_args = ["positional-looking", "--dtype", "bfloat16"]
    write_rendered(hv, tmp / "deploy")
    r = subprocess.run([str(tmp / "deploy" / "bin" / "start_cluster.sh")], env={**env, "N": "1"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rec = recorded(tmp, hv.ports[0])
    args, ignored = cli.parse(rec["argv"])
    assert args.served_model_name == ["name with 'quotes' and $(x)"]
    assert "positional-looking" in ignored


@pytest.mark.process
def test_cpu_instances_get_disjoint_cores_and_their_kv_cache(tmp_path):
    """accelerator cpu: 1. instance i gets cores [i*C, (i+1)*C) of the host's (here C = the cores split
    evenly), no --gpu-memory-utilization, VLLM_CPU_KVCACHE_SPACE from cpu_kvcache_gib. 2. More cores than
    the host has is refused with one sentence, exit 3, and nothing started."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores to split")
    hv = recorder_deploy(tmp_path, "accelerator=cpu", "cpu_kvcache_gib=3")
    env = {**os.environ, "RECORD_DIR": str(tmp_path)}
    script = str(tmp_path / "deploy" / "bin" / "start_cluster.sh")
    try:
        r = subprocess.run([script], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        recs = [recorded(tmp_path, p) for p in hv.ports]
        per = len(cores) // 2
        assert [rec["cpus"] for rec in recs] == [",".join(map(str, cores[:per])),
                                                 ",".join(map(str, cores[per:2 * per]))]
        assert {rec["kvcache"] for rec in recs} == {"3"} and {rec["spt_noenv"] for rec in recs} == {"1"}
        assert not any("--gpu-memory-utilization" in rec["argv"] for rec in recs)
    finally:
        stop_recorded(tmp_path / "deploy")
    too_many = subprocess.run([script], env={**env, "CPUS_PER_INSTANCE": str(len(cores))},
                              capture_output=True, text=True, timeout=30)
    assert too_many.returncode == 3 and "started" not in too_many.stdout
    assert too_many.stderr.strip() == (f"2 instance(s) x {len(cores)} core(s) do not fit the {len(cores)} "
                                       "core(s) of this host; lower instances or cpus_per_instance.")


@pytest.mark.unit
def test_a_models_group_path_with_a_tilde_reaches_the_engine_under_the_hosts_home(tmp_path):
    """1. A models group's `model` and a LoRA adapter's path start with `~/`.
    2. Rendered for a host whose home is /home/ops, the engine command and --lora-modules name
       /home/ops/...: the script quotes each argument, so no shell would expand the tilde."""
    inv_path = tmp_path / "hosts.yml"
    inv_path.write_text(textwrap.dedent("""\
        hosts:
          h:
            connection: local
            accelerator: nvidia
            accelerators: 2
            models:
              - {name: a, model: ~/models/a, lora_modules: {ocr: ~/lora/ocr}}
              - {name: b, model: /data/b}
        """))
    hv = render.offline(inventory.load(inv_path).host_vars("h", []), "/home/ops")
    script = rendered(hv)["bin/start_cluster.sh"].content
    assert "ENGINE=(vllm serve /home/ops/models/a --enable-prompt-tokens-details)" in script and "ENGINE=(vllm serve /data/b --enable-prompt-tokens-details)" in script
    assert "ocr=/home/ops/lora/ocr" in script and "~/" not in script


@pytest.mark.unit
def test_inv_render_writes_what_deploy_puts_on_a_local_host_and_names_an_ssh_hosts_placeholder(tmp_path):
    """render once wrote DEPLOY_DIR=/home/user/... and PYTHON=python3 where deploy put /root/... and the
    venv's Python: a local host's files are now deploy's own (fleet.facts.state.prepare, then sync.host_files);
    an SSH host whose paths use `~` gets a line naming the placeholder."""
    from fleet_helpers import inv, write_inventory

    from fleet.facts import state as facts
    from fleet.host import sync
    from fleet.transport.connection import LocalTransport
    inventory_path = write_inventory(tmp_path, instances=2)
    inventory_path.write_text(inventory_path.read_text().replace(f"deploy_dir: {tmp_path / 'deploy'}",
                                                                 "deploy_dir: ~/fleet-t"))
    out = tmp_path / "out"
    r = inv("render", "--host", "t", "--out", out, inventory=inventory_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    hv = facts.prepare(LocalTransport(), inventory.load(inventory_path).host_vars("t"))
    for f in sync.host_files(hv):
        assert (out / f.path).read_text() == f.content, f.path
    assert sys.executable in (out / "bin" / "start_proxy.sh").read_text()
    assert os.path.expanduser("~/fleet-t") in (out / "bin" / "start_cluster.sh").read_text()
    r = inv("render", "--host", "k100-01", "--out", tmp_path / "k", "-e", "deploy_dir=~/vllm-fleet",
            inventory=ROOT / "inventory" / "hosts.yml")
    assert r.returncode == 0 and r.stderr == (
        "k100-01: /home/aiops stands for the home of aiops on the host, which render does not contact; deploy "
        "writes the host's own (an absolute deploy_dir and model paths render exactly).\n"), r.stderr
