"""The simulated engine: vLLM's HTTP surface, its queue, its faults, and the child that outlives it."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from conftest import PYTHON, ROOT, Processes, free_port, http_status, wait_until
from fleet.sim import devices, lora, protocol
from fleet.sim.cli import parse
from fleet.sim.config import settle
from fleet.sim.scheduler import Scheduler
from fleet.sim.server import is_loopback

pytestmark = pytest.mark.process

MODEL = "sim-model"
FIXTURES = ROOT.parent / "shared" / "fixtures" / "smi"
# A 1x1 PNG: what a client sends as an image part.
PNG_1PX = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")).decode()


@dataclass
class Sim:
    """A running `python -m fleet.sim serve` and where to reach it."""

    proc: subprocess.Popen
    port: int
    dev_dir: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stats(self) -> dict:
        return request(self.url("/sim/stats"))[1]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key="x", max_retries=0, timeout=20)


def start_sim(procs: Processes, workdir: Path, *flags: str, env: dict | None = None,
              load_s: float = 0.2, wait_ready: bool = True) -> Sim:
    """Start a sim server on a free loopback port, its devices under workdir/sim-dev."""
    port = free_port()
    dev_dir = workdir / "sim-dev"
    base = {k: v for k, v in os.environ.items() if not k.startswith(
        ("FLEET_SIM_", "SIM_VISIBLE", "HIP_VISIBLE", "CUDA_VISIBLE", "VLLM_ALLOW_RUNTIME_LORA"))}
    full_env = {**base, "PYTHONPATH": str(ROOT), "FLEET_SIM_DEV_DIR": str(dev_dir), **(env or {})}
    log = open(workdir / f"sim-{port}.log", "wb")
    argv = [PYTHON, "-m", "fleet.sim", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--sim-load-s", str(load_s), "--sim-prefill-ms", "5", "--sim-token-ms", "2", *flags]
    proc = procs.start(argv, env=full_env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    sim = Sim(proc, port, dev_dir)
    if wait_ready:
        wait_until(lambda: http_status(sim.url("/health")) == 200, timeout=20, what="sim /health 200")
    return sim


def request(url: str, body=None, data: bytes | None = None, timeout: float = 10.0) -> tuple[int, dict | str]:
    """Status and decoded body of a GET (no body) or a JSON POST."""
    if body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()



def smi(dev_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "fleet.sim", "smi", "--dev-dir", str(dev_dir), *flags],
                          capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT)})


def used_mib(dev_dir: Path, card: int) -> int:
    out = smi(dev_dir).stdout
    return int(re.search(rf"HCU\[{card}\]\s*: vram Total Used Memory \(MiB\): (\d+)", out).group(1))


def chat(text: str = "hello", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def open_stream(port: int, body: dict) -> socket.socket:
    """A raw streaming request, so the test decides exactly when the client hangs up."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def kill_quietly(pid: int | None) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def group_members(pgid: int) -> list[int]:
    """Live processes in a process group (the server's session: itself, its child, the resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found.append(int(entry))
    return found


# --- one shared server for the API tests -------------------------------------------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """A ready sim: max_num_seqs 2, 20-token answers at 10 ms a token."""
    procs = Processes()
    try:
        yield start_sim(procs, tmp_path_factory.mktemp("api"), "--max-num-seqs", "2",
                        "--sim-token-ms", "10", "--sim-output-tokens", "20", "--max-model-len", "4096",
                        "--trust-remote-code", "--limit-mm-per-prompt", '{"image":4}',
                        "--gpu-memory-utilization", "0.9")
    finally:
        procs.stop_all()


@pytest.mark.xdist_group("sim_api")
def test_openai_chat_non_stream(api):
    r = api.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert r.id.startswith("chatcmpl-")
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + 20


@pytest.mark.xdist_group("sim_api")
def test_openai_chat_stream_with_usage(api):
    chunks = list(api.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert len(text.split()) == 20
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


@pytest.mark.xdist_group("sim_api")
def test_openai_completions_cut_by_max_tokens(api):
    c = api.client()
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and len(r.choices[0].text.split()) == 5
    chunks = list(c.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True))
    assert len("".join(ch.choices[0].text for ch in chunks).split()) == 3
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.xdist_group("sim_api")
def test_image_part_is_accepted_and_counted(api):
    c = api.client()
    plain = c.chat.completions.create(model=MODEL, max_tokens=2,
                                      messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}]}])
    parts = [{"type": "text", "text": "what?"},
             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_1PX}"}}]
    with_image = c.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": parts}])
    assert with_image.usage.prompt_tokens == plain.usage.prompt_tokens + protocol.TOKENS_PER_IMAGE


@pytest.mark.xdist_group("sim_api")
def test_thinking_opens_with_think_block_and_runs_longer(api):
    r = api.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hard question"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    content = r.choices[0].message.content
    assert content.startswith("<think>") and "</think>" in content
    assert r.usage.completion_tokens == 60 and r.choices[0].finish_reason == "stop"


@pytest.mark.xdist_group("sim_api")
def test_integer_user_is_refused_like_vllm(api):
    status, body = request(api.url("/v1/chat/completions"), chat(user=12345))
    assert status == 400
    err = body["error"]  # vLLM 0.32's ErrorResponse: {"error": {message, type, param, code}}
    assert err["type"] == "BadRequestError" and err["param"] is None and err["code"] == 400
    assert "user" in err["message"] and "Input should be a valid string" in err["message"]
    with pytest.raises(openai.BadRequestError):
        api.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                             user=12345)


@pytest.mark.parametrize("body, data, status, err_type", [
    (None, b"{not json", 400, "BadRequestError"),
    (chat(model="other-model"), None, 404, "NotFoundError"),
    (chat(max_tokens=5000), None, 400, "BadRequestError"),  # over --max-model-len 4096
])
@pytest.mark.xdist_group("sim_api")
def test_malformed_json_unknown_model_and_too_many_tokens_get_vllms_error_answer(api, body, data, status,
                                                                                 err_type):
    """Each bad request gets vLLM's status and error body: {"error": {type, code, ...}}."""
    got, reply = request(api.url("/v1/chat/completions"), body, data=data)
    assert got == status and reply["error"]["type"] == err_type and reply["error"]["code"] == status


def test_queue_holds_max_num_seqs_running(procs, tmp_path):
    """Six requests at once against max_num_seqs 2: two run, four wait, all six finish. Its own sim, whose
    answers take 1 s (the module's take 0.2 s): on a loaded machine the sixth request still arrives while
    the first two run."""
    api = start_sim(procs, tmp_path, "--max-num-seqs", "2", "--sim-token-ms", "50", "--sim-output-tokens", "20")
    assert request(api.url("/sim/reset-stats"), {})[0] == 200
    client = api.client()
    results = []
    together = threading.Barrier(6)     # all six sent at once, however late each thread got to start

    def one():
        together.wait(timeout=30)
        results.append(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}]))

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stats = api.stats()
    assert len(results) == 6
    assert stats["peak_running"] == 2 and stats["peak_in_flight"] == 6
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["requests_total"] == 6


@pytest.mark.xdist_group("sim_api")
def test_metrics_has_vllm_gauges(api):
    status, text = request(api.url("/metrics"))
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "fleet_sim:peak_in_flight"):
        assert re.search(rf'^{name}{{engine="0",model_name="{MODEL}"}} \d', text, re.M), name


@pytest.mark.xdist_group("sim_api")
def test_models_lists_served_name(api):
    status, body = request(api.url("/v1/models"))
    assert status == 200 and body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]


# --- startup, disconnects, faults: a server each ---------------------------------------------

def test_health_503_while_loading_then_200(procs, tmp_path):
    sim = start_sim(procs, tmp_path, load_s=1.5, wait_ready=False)
    wait_until(lambda: http_status(sim.url("/v1/models")) == 200, timeout=20, what="/v1/models 200")
    assert http_status(sim.url("/health")) == 503
    assert request(sim.url("/v1/completions"), {"prompt": "x"})[0] == 503
    wait_until(lambda: http_status(sim.url("/health")) == 200, timeout=10, what="/health 200 after load")


def test_client_disconnect_frees_the_slot(procs, tmp_path):
    """1. A long stream takes the only slot; a second request queues behind it.
    2. The queued client hangs up: it leaves the queue at once, counted as aborted.
    3. The streaming client hangs up: its slot is free at once, long before its answer would end.
    """
    sim = start_sim(procs, tmp_path, "--max-num-seqs", "1", "--sim-token-ms", "10", "--sim-output-tokens", "500")
    streaming = open_stream(sim.port, chat(stream=True))
    try:
        got = b""
        while b'"content":"' not in got.split(b'"role"', 1)[-1]:
            got += streaming.recv(4096)
        queued = open_stream(sim.port, chat(stream=True))
        wait_until(lambda: sim.stats()["waiting"] == 1, timeout=5, what="a queued request")
        queued.close()
        wait_until(lambda: sim.stats()["waiting"] == 0, timeout=5, what="the queued request to leave")
        assert sim.stats()["aborted_total"] == 1 and sim.stats()["running"] == 1
    finally:
        streaming.close()
    wait_until(lambda: sim.stats()["running"] == 0, timeout=3, what="the slot to be freed")
    assert sim.stats()["aborted_total"] == 2   # the stream was cut, not finished (its 500 tokens take 5 s)
    assert request(sim.url("/v1/chat/completions"), chat(max_tokens=2))[0] == 200


def test_engine_death_fault(procs, tmp_path):
    """1. POST /sim/fault engine-death kills the engine child.
    2. /health answers 503, but /v1/models still 200 (the vLLM trap), completions 500.
    3. The card is free again: smi shows idle memory.
    """
    sim = start_sim(procs, tmp_path)
    assert used_mib(sim.dev_dir, 0) > 50000
    assert request(sim.url("/sim/fault"), {"fault": "engine-death"}) == (200, {"ok": True, "fault": "engine-death"})
    wait_until(lambda: http_status(sim.url("/health")) == 503, timeout=5, what="/health 503")
    assert http_status(sim.url("/v1/models")) == 200
    status, body = request(sim.url("/v1/chat/completions"), chat())
    assert status == 500 and body["error"]["type"] == "InternalServerError" and "EngineCore" in body["error"]["message"]
    assert sim.stats()["engine_alive"] is False
    wait_until(lambda: used_mib(sim.dev_dir, 0) == 2, timeout=5, what="smi to show the card idle")
    assert request(sim.url("/sim/fault"), {"fault": "melt"})[0] == 400


def test_hang_by_signal_then_recover_then_death_by_signal(procs, tmp_path):
    sim = start_sim(procs, tmp_path)
    os.kill(sim.proc.pid, signal.SIGUSR2)
    wait_until(lambda: sim.stats()["hung"], timeout=5, what="the hang")
    assert http_status(sim.url("/health"), timeout=0.5) is None
    assert request(sim.url("/sim/fault"), {"fault": "recover"})[0] == 200
    assert http_status(sim.url("/health")) == 200
    os.kill(sim.proc.pid, signal.SIGUSR1)
    wait_until(lambda: http_status(sim.url("/health")) == 503, timeout=5, what="/health 503 after SIGUSR1")
    assert http_status(sim.url("/v1/models")) == 200


def test_orphaned_child_keeps_the_card(procs, tmp_path):
    """The incident: a SIGKILLed server leaves its engine child holding the device.

    1. The server spawns a child that holds renderD129 (SIM_VISIBLE_DEVICES=1) and renames itself
       `VLLM::EngineCore` (so its command line names neither the port nor the model); with SPT_NOENV=1
       it still carries the server's FLEET_TAG.
    2. SIGKILL the server: the child lives on and smi still shows the card used.
    3. Kill the child by pid: smi shows the card idle.
    """
    sim = start_sim(procs, tmp_path, env={"FLEET_TAG": "fleet-test/7", "SIM_VISIBLE_DEVICES": "1,2",
                                          "SPT_NOENV": "1"})
    child = None
    try:
        held = devices.holders(sim.dev_dir)
        assert list(held) == [1]
        [child] = held[1]
        assert child != sim.proc.pid and sim.stats()["engine_pid"] == child
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert cmdline.strip() == "VLLM::EngineCore" and str(sim.port) not in cmdline
        assert b"FLEET_TAG=fleet-test/7" in Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        assert used_mib(sim.dev_dir, 1) > 50000

        sim.proc.kill()
        sim.proc.wait(5)
        time.sleep(0.5)  # long enough for a child that reacts to its parent's death to have gone
        assert devices.pid_alive(child)
        assert used_mib(sim.dev_dir, 1) > 50000

        os.kill(child, signal.SIGKILL)
        wait_until(lambda: not devices.pid_alive(child), timeout=5, what="the child to die")
        assert used_mib(sim.dev_dir, 1) == 2
    finally:
        kill_quietly(child)


def titled(pgid: int) -> dict[str, int]:
    """Title -> pid of the renamed members of a process group (VLLM::EngineCore, VLLM::Worker)."""
    out = {}
    for pid in group_members(pgid):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        if cmd.startswith("VLLM::"):
            out[cmd] = pid
    return out


def environ_has(pid: int, entry: bytes) -> bool:
    return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


@pytest.mark.parametrize("spt_noenv", [False, True])
def test_engine_and_worker_rename_themselves_and_hide_the_tag_without_spt_noenv(procs, tmp_path, spt_noenv):
    """What vLLM does and the sim long hid: EngineCore and Worker rename themselves with setproctitle,
    which overwrites the memory /proc/PID/environ shows. 1. Start the sim with FLEET_TAG (and SPT_NOENV=1
    or not). 2. Its group holds VLLM::EngineCore and VLLM::Worker, in the server's session. 3. Their
    environ shows FLEET_TAG only with SPT_NOENV=1; the server's always does."""
    env = {"FLEET_TAG": "fleet-test/3", **({"SPT_NOENV": "1"} if spt_noenv else {})}
    sim = start_sim(procs, tmp_path, env=env)
    found = wait_until(lambda: len(titled(sim.proc.pid)) == 2 and titled(sim.proc.pid),
                       what="VLLM::EngineCore and VLLM::Worker")
    assert set(found) == {"VLLM::EngineCore", "VLLM::Worker"}
    assert found["VLLM::EngineCore"] == sim.stats()["engine_pid"]
    tag = b"FLEET_TAG=fleet-test/3"
    assert environ_has(sim.proc.pid, tag)
    for pid in found.values():
        assert os.getsid(pid) == sim.proc.pid
        assert environ_has(pid, tag) is spt_noenv


@pytest.mark.parametrize("mode, stays", [("exit", False), ("stay", True)])
def test_after_engine_death_api_server_exits_like_vllm_032_or_stays_like_011(procs, tmp_path, mode, stays):
    """1. SIGKILL the engine core alone. 2. /health 503 while /v1/models still answers 200 (both modes).
    3. exit (vLLM 0.32, the default): the API server exits by itself after --sim-exit-delay-s, its worker
    gone too; stay (vLLM 0.11): it stays up, /health 503."""
    sim = start_sim(procs, tmp_path, "--sim-after-engine-death", mode, "--sim-exit-delay-s", "1.5")
    core = sim.stats()["engine_pid"]
    worker = wait_until(lambda: titled(sim.proc.pid).get("VLLM::Worker"), what="the worker")
    os.kill(core, signal.SIGKILL)
    wait_until(lambda: http_status(sim.url("/health")) == 503, timeout=5, what="/health 503")
    assert http_status(sim.url("/v1/models")) == 200
    wait_until(lambda: not devices.pid_alive(worker), timeout=5, what="the worker to follow its engine")
    if stays:
        # the one way the API server ends by itself is the exit its engine's death schedules: none here
        assert sim.stats()["exit_scheduled"] is False
        assert sim.proc.poll() is None and http_status(sim.url("/health")) == 503
    else:
        assert sim.proc.wait(10) == 1
        wait_until(lambda: not group_members(sim.proc.pid), timeout=10, what="the whole group gone")


def test_sigterm_stops_server_and_child(procs, tmp_path):
    sim = start_sim(procs, tmp_path)
    child = sim.stats()["engine_pid"]
    try:
        assert devices.holders(sim.dev_dir)[0] == [child]
        os.kill(sim.proc.pid, signal.SIGTERM)
        assert sim.proc.wait(10) == 0
        assert not devices.pid_alive(child)
        wait_until(lambda: not group_members(sim.proc.pid), timeout=5, what="the whole process group to exit")
        assert used_mib(sim.dev_dir, 0) == 2
    finally:
        kill_quietly(child)


# --- served names, LoRA adapters, tensor parallel: vLLM 0.32's shapes (issue 18) ------------------

def answer(sim: Sim, model: str | None) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return request(sim.url("/v1/chat/completions"), body if model is None else {**body, "model": model})


def test_every_served_name_answers_and_an_unknown_model_gets_vllms_404(procs, tmp_path):
    """1. --served-model-name A B: A, B and no model at all answer 200; like vLLM 0.32 every answer carries
       the first served name (OpenAIServingModels.model_name).
    2. An unknown model: 404 with vLLM 0.32's body, the served names appended (serve/engine/serving.py).
    """
    sim = start_sim(procs, tmp_path, "--served-model-name", "A", "B")
    for asked in ("A", "B", None):
        status, body = answer(sim, asked)
        assert status == 200 and body["model"] == "A", (asked, body)
    assert sim.client().chat.completions.create(model="B", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=1).model == "A"
    assert answer(sim, "nope") == (404, {"error": {
        "message": "The model `nope` does not exist. Valid aliases: A, B.",
        "type": "NotFoundError", "param": "model", "code": 404}})
    assert [m["id"] for m in request(sim.url("/v1/models"))[1]["data"]] == ["A", "B"]


def test_static_adapters_are_served_and_listed_like_vllm(procs, tmp_path):
    """1. --enable-lora --lora-modules in both of vLLM's forms: each adapter answers under its own name.
    2. /v1/models lists the served names, then the adapters: root = the adapter's path, parent = its
       base_model_name or the first served name, no max_model_len.
    3. Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the load and unload routes do not exist (404).
    """
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    sim = start_sim(procs, tmp_path, "--served-model-name", "A", "B", "--enable-lora", "--max-loras", "2",
                    "--lora-modules", f"one={one}", json.dumps({"name": "two", "path": str(two),
                                                                "base_model_name": "B"}))
    for name in ("one", "two"):
        status, body = answer(sim, name)
        assert status == 200 and body["model"] == name
    models = request(sim.url("/v1/models"))[1]["data"]
    assert [m["id"] for m in models] == ["A", "B", "one", "two"]
    base, adapter = models[0], models[2]
    assert (base["root"], base["parent"], base["max_model_len"]) == (MODEL, None, 32768)
    assert (adapter["root"], adapter["parent"], adapter["max_model_len"]) == (str(one), "A", None)
    assert models[3]["parent"] == "B" and models[3]["root"] == str(two)
    assert adapter["owned_by"] == "vllm" and adapter["permission"][0]["object"] == "model_permission"
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert request(sim.url(route), {"lora_name": "x", "lora_path": str(one)}) == (404, {"detail": "Not Found"})


def test_runtime_adapters_load_and_unload_like_vllm(procs, tmp_path):
    """With VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-loras 1:
    1. A path that does not exist: 404, vLLM's LoRAAdapterNotFoundError with the path sanitized.
    2. Load: 200 and vLLM's success text; the adapter answers under its name and is listed; a second
       adapter loads too (vLLM evicts from its LRU cache past --max-loras, it does not refuse).
    3. Loading it again, or under a served name: 400; a rank over --max-lora-rank: 500.
    4. Unload: 200, then 404 "cannot be found"; the name is unknown again.
    5. A new process knows nothing of the runtime adapters.
    """
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    flags = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "16")
    sim = start_sim(procs, tmp_path, *flags, env=env)
    load, unload = sim.url("/v1/load_lora_adapter"), sim.url("/v1/unload_lora_adapter")
    adapter, other, wide = tmp_path / "adapter", tmp_path / "other", tmp_path / "wide"
    for d in (adapter, other, wide):
        d.mkdir()
    (wide / "adapter_config.json").write_text(json.dumps({"r": 64}))

    assert request(load, {"lora_name": "rt", "lora_path": str(tmp_path / "missing")}) == (404, {"error": {
        "message": "Loading lora rt failed: No adapter found for <path>", "type": "NotFoundError",
        "param": None, "code": 404}})
    assert request(load, {"lora_name": "rt", "lora_path": str(adapter)}) == (
        200, "Success: LoRA adapter 'rt' added successfully.")
    status, body = answer(sim, "rt")
    assert status == 200 and body["model"] == "rt"
    assert request(load, {"lora_name": "rt2", "lora_path": str(other)})[0] == 200
    listed = {m["id"]: m for m in request(sim.url("/v1/models"))[1]["data"]}
    assert listed["rt"]["root"] == str(adapter) and listed["rt"]["parent"] == MODEL and "rt2" in listed

    status, body = request(load, {"lora_name": "rt", "lora_path": str(adapter)})
    assert status == 400 and body["error"] == {
        "message": "The lora adapter 'rt' has already been loaded. If you want to load the adapter in place, "
                   "set 'load_inplace' to True.", "type": "InvalidUserInput", "param": None, "code": 400}
    status, body = request(load, {"lora_name": MODEL, "lora_path": str(adapter)})
    assert status == 400 and body["error"]["message"] == f"The lora adapter '{MODEL}' conflicts with a served base model."
    status, body = request(load, {"lora_name": "wide", "lora_path": str(wide)})
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert body["error"]["message"] == "Call to add_lora method failed: LoRA rank 64 is greater than max_lora_rank 16."

    assert request(unload, {"lora_name": "rt"}) == (200, "Success: LoRA adapter 'rt' removed successfully.")
    assert request(unload, {"lora_name": "rt"}) == (404, {"error": {
        "message": "The lora adapter 'rt' cannot be found.", "type": "NotFoundError", "param": None, "code": 404}})
    assert answer(sim, "rt")[0] == 404

    procs.stop(sim.proc)
    again = start_sim(procs, tmp_path, *flags, env=env)
    assert [m["id"] for m in request(again.url("/v1/models"))[1]["data"]] == [MODEL]
    assert answer(again, "rt2")[0] == 404


def test_runtime_load_without_enable_lora_is_vllms_500(procs, tmp_path):
    sim = start_sim(procs, tmp_path, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    status, body = request(sim.url("/v1/load_lora_adapter"), {"lora_name": "a", "lora_path": str(tmp_path)})
    assert status == 500 and body["error"] == {
        "message": "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA.",
        "type": "InternalServerError", "param": None, "code": 500}


@pytest.mark.parametrize("flags, env, line", [
    (["--lora-modules", "a={tmp}"], {},
     "ValueError: Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA."),
    (["--enable-lora", "--lora-modules", "a={tmp}/missing"], {},
     "ValueError: Loading lora a failed: No adapter found for <path>"),
    (["--tensor-parallel-size", "2"], {"SIM_VISIBLE_DEVICES": "1"},
     "ValueError: World size (2) is larger than the number of available GPUs (1) in this node."),
])
def test_what_vllm_refuses_at_startup_ends_the_process(tmp_path, flags, env, line):
    """Static adapters vLLM cannot load and tensor parallel over too few cards end the server before it
    listens, with vLLM's last line and exit code 1."""
    argv = [PYTHON, "-m", "fleet.sim", "serve", MODEL, "--port", str(free_port()),
            *(f.format(tmp=tmp_path) for f in flags)]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_SIM_", "SIM_VISIBLE", "HIP_VISIBLE",
                                                                      "CUDA_VISIBLE"))}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False,
                       env={**base, "PYTHONPATH": str(ROOT), "FLEET_SIM_DEV_DIR": str(tmp_path / "dev"), **env})
    assert r.returncode == 1 and r.stderr.rstrip().splitlines()[-1].endswith(line), r.stderr
    assert not (tmp_path / "dev").exists()  # no engine was started


@pytest.mark.parametrize("var", ["SIM_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"])
def test_tensor_parallel_holds_every_visible_card_and_releases_them_on_exit(procs, tmp_path, var):
    """1. --tensor-parallel-size 2 with cards 1,2 visible: the engine child holds both; smi shows the
       engine's memory on each.
    2. SIGTERM: the server exits 0 and smi shows both cards idle.
    """
    sim = start_sim(procs, tmp_path, "--tensor-parallel-size", "2", env={var: "1,2"})
    child = sim.stats()["engine_pid"]
    try:
        assert devices.holders(sim.dev_dir) == {1: [child], 2: [child]}
        assert used_mib(sim.dev_dir, 1) > 50000 and used_mib(sim.dev_dir, 2) > 50000
        os.kill(sim.proc.pid, signal.SIGTERM)
        assert sim.proc.wait(10) == 0
        wait_until(lambda: not devices.pid_alive(child), timeout=5, what="the engine child to exit")
        assert (used_mib(sim.dev_dir, 1), used_mib(sim.dev_dir, 2)) == (2, 2)
    finally:
        kill_quietly(child)


@pytest.mark.parametrize("values, expected", [
    (["a=/p/a"], [("a", "/p/a", None)]),
    (['{"name": "b", "path": "/p/b", "base_model_name": "m"}'], [("b", "/p/b", "m")]),
    (["", "c=/p/c=x"], [("c", "/p/c=x", None)]),
])
def test_lora_modules_parse_like_vllm(values, expected):
    assert [(m.name, m.path, m.base_model_name) for m in lora.parse_lora_modules(values)] == expected


@pytest.mark.parametrize("value, message", [
    ("{bad", "Invalid JSON format for --lora-modules: {bad"),
    ('{"name": "a", "pth": "/p"}', "Invalid fields for --lora-modules: "),
])
def test_lora_modules_refused_like_vllm(value, message):
    with pytest.raises(ValueError) as e:
        lora.parse_lora_modules([value])
    assert str(e.value).startswith(message)


# --- in-process: devices, smi, CLI, scheduler ---------------------------------------------------

def test_smi_matches_hy_smi_text(tmp_path):
    devices.ensure_card(tmp_path, list(range(2)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kfd", "renderD128", "renderD129"]
    report = devices.smi_report(tmp_path)
    assert report.splitlines()[2:] == ["HCU[1]          : vram Total Memory (MiB): 65520",
                                       "HCU[1]          : vram Total Used Memory (MiB): 2"]
    fixture = FIXTURES / "hysmi_showmeminfo_vram_spaces.txt"
    if fixture.exists():
        assert report.splitlines()[:2] == fixture.read_text().splitlines()[:2]


def test_holders_sees_open_files(tmp_path):
    devices.ensure_card(tmp_path, list(range(2)))
    with open(tmp_path / "renderD129", "rb"):
        assert devices.holders(tmp_path) == {0: [], 1: [os.getpid()]}
        assert "HCU[1]          : vram Total Used Memory (MiB): 52002" in devices.smi_report(tmp_path)
    assert devices.holders(tmp_path) == {0: [], 1: []}


def test_smi_showuse_reads_fresh_files_of_live_writers(tmp_path):
    devices.ensure_card(tmp_path, list(range(2)))
    devices.write_use(tmp_path, 0, 50.0)
    devices.use_path(tmp_path, 1).write_text(json.dumps({"pid": os.getpid(), "use": 75, "time": time.time() - 60}))
    out = smi(tmp_path, "--showuse")
    assert out.returncode == 0
    assert "HCU[0]          : HCU use (%): 50\n" in out.stdout
    assert "HCU[1]          : HCU use (%): 0\n" in out.stdout  # stale


def test_smi_without_devices_fails(tmp_path):
    out = smi(tmp_path / "nothing-here")
    assert out.returncode == 1 and "no sim devices" in out.stderr and out.stdout == ""


def test_cli_ignores_unknown_vllm_flags():
    args, ignored = parse(["serve", "m", "--port", "9", "--trust-remote-code", "--limit-mm-per-prompt",
                           '{"image":4}', "--gpu-memory-utilization", "0.9", "--max-num-seqs", "3",
                           "--max-num-batched-tokens", "8192", "--enforce-eager"])
    assert (args.model, args.port, args.max_num_seqs, args.enforce_eager) == ("m", 9, 3, True)
    assert args.max_num_batched_tokens == 8192   # taken: the engine step's budget (fleet/sim/step.py)
    assert ignored == ["--trust-remote-code", "--limit-mm-per-prompt", '{"image":4}',
                       "--gpu-memory-utilization", "0.9"]


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, {"load_s": 3.0, "prefill_ms": 100.0, "token_ms": 10.0, "output_tokens": 200, "card": 0}),
    ([], {"FLEET_SIM_LOAD_S": "7", "FLEET_SIM_TOKEN_MS": "1", "SIM_VISIBLE_DEVICES": "3,4"},
     {"load_s": 7.0, "token_ms": 1.0, "card": 3}),
    (["--sim-load-s", "0.5", "--sim-output-tokens", "9"], {"FLEET_SIM_LOAD_S": "7"},
     {"load_s": 0.5, "output_tokens": 9}),
    (["--sim-instant"], {}, {"load_s": 0.0, "prefill_ms": 0.0, "token_ms": 0.0}),
    ([], {"FLEET_SIM_INSTANT": "1"}, {"load_s": 0.0, "token_ms": 0.0}),
    (["--served-model-name", "a", "b"], {"FLEET_SIM_DEV_DIR": "/d"},
     {"served_model_names": ["a", "b"], "dev_dir": Path("/d")}),
    (["-tp", "2"], {"HIP_VISIBLE_DEVICES": "4,5"}, {"tensor_parallel_size": 2, "cards": [4, 5], "card": 4}),
    (["--tensor-parallel-size", "2"], {"SIM_VISIBLE_DEVICES": "6,7", "CUDA_VISIBLE_DEVICES": "0,1"},
     {"cards": [6, 7]}),
    (["--enable-lora", "--max-loras", "3"], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
     {"enable_lora": True, "max_loras": 3, "max_lora_rank": 16, "runtime_lora": True}),
    ([], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"}, {"runtime_lora": False}),  # vLLM takes 1 or true only
])
def test_settings_flags_over_environment(argv, environ, expected):
    config = settle(vars(parse(["serve", "m", *argv])[0]), environ)
    assert {k: getattr(config, k) for k in expected} == expected


@pytest.mark.parametrize("remote, ok", [("127.0.0.1", True), ("::1", True), ("10.1.2.3", False), (None, False)])
def test_faults_are_loopback_only(remote, ok):
    assert is_loopback(remote) is ok


async def test_scheduler_fifo_and_cancel_while_queued():
    s = Scheduler(1)
    order = []

    async def job(name, hold):
        async with s.slot():
            order.append(name)
            await hold.wait()

    gates = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(job(i, g)) for i, g in enumerate(gates)]
    await asyncio.sleep(0)
    assert (s.running, s.waiting) == (1, 2)
    tasks[1].cancel()
    await asyncio.sleep(0)
    assert (s.running, s.waiting) == (1, 1)
    for g in gates:
        g.set()
    await asyncio.gather(tasks[0], tasks[2])
    assert order == [0, 2] and (s.running, s.waiting, s.peak_in_flight) == (0, 0, 3)


def test_unhealthy_fault_is_reversible(procs, tmp_path):
    """1. POST /sim/fault unhealthy: /health answers 503 while completions are still served.
    2. POST /sim/fault recover: /health answers 200 again (a dead engine would not come back).
    """
    sim = start_sim(procs, tmp_path)
    assert request(sim.url("/sim/fault"), {"fault": "unhealthy"}) == (200, {"ok": True, "fault": "unhealthy"})
    assert http_status(sim.url("/health")) == 503
    assert request(sim.url("/v1/chat/completions"), chat(max_tokens=2))[0] == 200
    assert request(sim.url("/sim/fault"), {"fault": "recover"})[0] == 200
    assert http_status(sim.url("/health")) == 200
