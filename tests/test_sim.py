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
from fleet.sim import devices, protocol
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
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_SIM_", "SIM_VISIBLE"))}
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
    assert body["object"] == "error" and body["type"] == "BadRequestError"
    assert body["param"] is None and body["code"] == 400
    assert "user" in body["message"] and "Input should be a valid string" in body["message"]
    with pytest.raises(openai.BadRequestError):
        api.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                             user=12345)


@pytest.mark.parametrize("body, data, status, err_type", [
    (None, b"{not json", 400, "BadRequestError"),
    (chat(model="other-model"), None, 404, "NotFoundError"),
    (chat(max_tokens=5000), None, 400, "BadRequestError"),  # over --max-model-len 4096
])
@pytest.mark.xdist_group("sim_api")
def test_bad_requests(api, body, data, status, err_type):
    got, reply = request(api.url("/v1/chat/completions"), body, data=data)
    assert got == status and reply["type"] == err_type and reply["code"] == status


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
    started = time.monotonic()
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
    assert sim.stats()["aborted_total"] == 2
    assert time.monotonic() - started < 4  # the answer would have taken 5 s
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
    assert status == 500 and body["type"] == "InternalServerError" and "EngineCore" in body["message"]
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
        time.sleep(2.5)
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


# --- in-process: devices, smi, CLI, scheduler ---------------------------------------------------

def test_smi_matches_hy_smi_text(tmp_path):
    devices.ensure_devices(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kfd", "renderD128", "renderD129"]
    report = devices.smi_report(tmp_path)
    assert report.splitlines()[2:] == ["HCU[1]          : vram Total Memory (MiB): 65520",
                                       "HCU[1]          : vram Total Used Memory (MiB): 2"]
    fixture = FIXTURES / "hysmi_showmeminfo_vram_spaces.txt"
    if fixture.exists():
        assert report.splitlines()[:2] == fixture.read_text().splitlines()[:2]


def test_holders_sees_open_files(tmp_path):
    devices.ensure_devices(tmp_path, 2)
    with open(tmp_path / "renderD129", "rb"):
        assert devices.holders(tmp_path) == {0: [], 1: [os.getpid()]}
        assert "HCU[1]          : vram Total Used Memory (MiB): 52002" in devices.smi_report(tmp_path)
    assert devices.holders(tmp_path) == {0: [], 1: []}


def test_smi_showuse_reads_fresh_files_of_live_writers(tmp_path):
    devices.ensure_devices(tmp_path, 2)
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
    assert ignored == ["--trust-remote-code", "--limit-mm-per-prompt", '{"image":4}',
                       "--gpu-memory-utilization", "0.9", "--max-num-batched-tokens", "8192"]


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
