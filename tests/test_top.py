"""`inv top`: the view's arithmetic and events on made-up frames (unit), the sampler alone on a host with
nothing deployed (process), `--once` against a sim cluster under load, and the live view as a person uses
it, in a real terminal (tmux): it starts, its numbers move under load, `q` ends it and its samplers."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request

import pytest
from conftest import PYTHON, ROOT, require_tool, wait_until
from fleet_helpers import deploy_sim_cluster, deployment_id, inv, inv_env, kill_tagged, load, write_inventory
from rich.console import Console

from hostagent import exposition, processes

from fleet.commands import top
from fleet.settings import inventory as fleet_inventory
from fleet.transport import hostcode

# --- the view on made-up frames -------------------------------------------------------------------------


def sent(lines):
    """What the sampler sends of /metrics lines: their samples, parsed on the host, through JSON."""
    return json.loads(json.dumps(exposition.samples("\n".join(lines))))


def engine_lines(done=0.0, tokens=0.0, kv=0.25, hits=0.0, queries=0.0, ttft=None, running=1.0):
    """An engine's /metrics samples as the sampler sends them; ttft: {le: cumulative count}."""
    m = 'engine="0",model_name="m"'
    lines = [f"vllm:num_requests_running{{{m}}} {running}", f"vllm:num_requests_waiting{{{m}}} 0.0",
             f"vllm:kv_cache_usage_perc{{{m}}} {kv}", f"vllm:generation_tokens_total{{{m}}} {tokens}",
             f'vllm:request_success_total{{{m},finished_reason="stop"}} {done}',
             f'vllm:request_success_total{{{m},finished_reason="length"}} 0.0',
             f"vllm:prefix_cache_queries_total{{{m}}} {queries}", f"vllm:prefix_cache_hits_total{{{m}}} {hits}"]
    for le, count in (ttft or {}).items():
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{m},le="{le}"}} {count}')
    return sent(lines)


def proxy_lines(in_flight=1, slots=4, healthy=1, queue=0, r429=0, backend="127.0.0.1:8002"):
    return sent([f'proxy_backend_in_flight{{backend="{backend}"}} {in_flight}',
            f'proxy_backend_slots{{backend="{backend}"}} {slots}',
            f'proxy_backend_healthy{{backend="{backend}"}} {healthy}',
            f'proxy_backend_drained{{backend="{backend}"}} 0', f"proxy_queue_length {queue}",
            f'proxy_requests_total{{backend="{backend}",status="200"}} 10.0',
            f'proxy_requests_total{{backend="none",status="429"}} {r429}'])


def raw_frame(t, engine, proxy, state="healthy", keeper=None):
    return {"t": t, "mode": "proxy", "nginx": False, "took_ms": 3.0,
            "keeper": {"alive": True, "state": "running", "instances": keeper or {}},
            "instances": [{"index": 0, "state": state, "reason": None, "health": 200, "pid": 1,
                           "metrics": engine, "error": None}],
            "proxy": {"alive": True, "metrics": proxy, "error": None}}


@pytest.fixture
def one_host(tmp_path):
    hosts, rows, _ = top.plan(fleet_inventory.load(write_inventory(tmp_path, instances=1)), "t")
    rows[0].backend = "127.0.0.1:8002"
    return hosts[0], rows


@pytest.mark.unit
def test_quantile_is_prometheus_histogram_quantile():
    buckets = {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, float("inf"): 40.0}
    assert top.quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)   # within (0.1, 0.5]
    assert top.quantile(0.25, buckets) == pytest.approx(0.1)
    assert top.quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * (38 - 30) / 10)
    assert top.quantile(0.99, {0.1: 0.0, float("inf"): 5.0}) == 0.1     # in +Inf: the highest finite bound
    assert top.quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
    assert top.delta_buckets({0.1: 5.0}, {0.1: 8.0}) == {0.1: 5.0}       # a reset: the new counts alone


@pytest.mark.unit
def test_an_instance_line_has_rates_over_10_s_and_percentiles_over_the_last_minute(one_host):
    hv, rows = one_host
    target = top.Target(hv)
    # A minute ago 100 requests answered fast; in the last minute 100 more, all between 0.5 and 1 s.
    early = {0.1: 100.0, 0.5: 100.0, 1.0: 100.0, float("inf"): 100.0}
    late = {0.1: 100.0, 0.5: 100.0, 1.0: 200.0, float("inf"): 200.0}
    t0 = 1000.0
    target.add(top.Frame.parse(raw_frame(t0 - 70, engine_lines(0, 0, ttft=early), proxy_lines()), hv))
    target.add(top.Frame.parse(raw_frame(t0 - 55, engine_lines(50, 1000, ttft=early, hits=0, queries=0),
                                         proxy_lines()), hv))
    target.add(top.Frame.parse(raw_frame(t0 - 10, engine_lines(100, 3000, hits=10, queries=100, ttft=early),
                                         proxy_lines()), hv))
    target.add(top.Frame.parse(raw_frame(t0, engine_lines(150, 5000, kv=0.5, hits=70, queries=200, ttft=late),
                                         proxy_lines(in_flight=3)), hv))
    v = top.view({hv.name: target}, rows)
    line = v["instances"][0]
    assert line["rps"] == pytest.approx(5.0) and line["tokens_s"] == pytest.approx(200.0)
    assert line["in_flight"] == 3 and line["slots"] == 4 and line["kv"] == 0.5
    assert 0.5 < line["ttft_p50"] <= 1.0 and line["ttft_p95"] <= 1.0    # the early fast ones are out of it
    assert line["hit"] == pytest.approx(70 / 200)     # the window's base frame had no queries yet
    assert v["hosts"][0]["front"] == "proxy" and v["hosts"][0]["queue"] == 0


@pytest.mark.unit
def test_a_frame_that_could_not_read_the_engine_is_no_base_for_its_rates_or_window(one_host):
    """1. The frames 50 s and 10 s ago could not read the engine's /metrics (a timeout under load): the
    next frames are the bases, so the rate is the engine's and the percentiles the last minute's (not the
    proxy's count, nor the histogram since the engine started).  2. No prefix-cache query in the window:
    no hit rate ("-"), not the one since the engine started."""
    hv, rows = one_host
    target = top.Target(hv)
    early = {0.1: 100.0, 0.5: 100.0, 1.0: 100.0, float("inf"): 100.0}
    late = {0.1: 100.0, 0.5: 100.0, 1.0: 200.0, float("inf"): 200.0}
    t0 = 1000.0
    unread = raw_frame(t0 - 50, None, proxy_lines())
    unread["instances"][0]["error"] = "http://127.0.0.1:8002/metrics: timed out"
    target.add(top.Frame.parse(unread, hv))
    target.add(top.Frame.parse(raw_frame(t0 - 49, engine_lines(0, 0, hits=90, queries=100, ttft=early),
                                         proxy_lines()), hv))
    target.add(top.Frame.parse({**unread, "t": t0 - 10}, hv))
    target.add(top.Frame.parse(raw_frame(t0 - 8, engine_lines(100, 1000, hits=90, queries=100, ttft=early),
                                         proxy_lines()), hv))
    target.add(top.Frame.parse(raw_frame(t0, engine_lines(140, 1800, hits=90, queries=100, ttft=late),
                                         proxy_lines()), hv))
    line = top.view({hv.name: target}, rows)["instances"][0]
    assert line["rps"] == pytest.approx(5.0) and line["tokens_s"] == pytest.approx(100.0)
    assert 0.5 < line["ttft_p50"] <= 1.0
    assert line["hit"] is None


@pytest.mark.unit
def test_events_name_what_changed(one_host):
    hv, rows = one_host
    target = top.Target(hv)
    target.add(top.Frame.parse(raw_frame(1.0, engine_lines(), proxy_lines(queue=0)), hv))
    before = top.view({hv.name: target}, rows)
    target.add(top.Frame.parse(raw_frame(2.0, None, proxy_lines(queue=200, r429=7), state="dead",
                                         keeper={"0": {"restarts": 1, "last_reason": "exited"}}), hv))
    target.frames[-1].raw["instances"][0]["reason"] = "exited"
    target.frames[-1].raw["proxy"]["error"] = "http://127.0.0.1:1/metrics: refused"
    after = top.view({hv.name: target}, rows)
    memory: dict = {}
    lines = top.events(before, after, memory)
    text = "\n".join(lines)
    assert "instance 0: restarted by the keeper (exited)" in text
    assert "instance 0: healthy -> dead (exited)" in text
    assert "queue is filling up: 200 waiting of 256" in text
    assert "7 requests answered 429/503" in text
    assert "cannot read proxy: http://127.0.0.1:1/metrics: refused" in text
    # Refusals are said at most once per 10 s per host; a crash loop has its own line.
    target.add(top.Frame.parse(raw_frame(3.0, None, proxy_lines(queue=200, r429=9), state="dead",
                                         keeper={"0": {"restarts": 1, "crashloop": True}}), hv))
    third = top.view({hv.name: target}, rows)
    text = "\n".join(top.events(after, third, memory))
    assert "429/503" not in text and "crash-looping" in text


@pytest.mark.unit
@pytest.mark.parametrize("width,shown,hidden", [(160, ["TTFT p50", "p95", "tok/s", "KV", "hit", "restarts", "cards"], []),
                                                (90, ["TTFT p50", "KV", "cards"], ["restarts"]),
                                                (60, ["state", "flight", "r/s", "TTFT p50"], ["KV", "cards"])])
def test_a_narrow_terminal_keeps_the_essentials(one_host, width, shown, hidden):
    hv, rows = one_host
    target = top.Target(hv)
    target.add(top.Frame.parse(raw_frame(1.0, engine_lines(), proxy_lines()), hv))
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(top.render(top.view({hv.name: target}, rows), [], width, 1.0, "vllm-fleet top: t"))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    for word in shown:
        assert word in text, text
    for word in hidden:
        assert word not in text, text


@pytest.mark.unit
@pytest.mark.parametrize("bind,address", [("0.0.0.0", "127.0.0.1"), ("::", "::1"), ("127.0.0.2", "127.0.0.2")])
def test_the_sampler_reads_the_proxy_where_it_listens(tmp_path, bind, address):
    """proxy.bind set to one address: the proxy is not on loopback, and its /metrics is read there."""
    inv_ = fleet_inventory.load(write_inventory(tmp_path, instances=1))
    hv = inv_.host_vars("t", [f"proxy.bind='{bind}'"])
    assert top.sampler_spec(hv, 1.0, 0)["proxy_address"] == address


# --- the sampler alone -----------------------------------------------------------------------------------

@pytest.mark.process
def test_the_sampler_names_what_it_cannot_read_and_prints_a_frame_anyway(tmp_path):
    spec = {"deploy_dir": str(tmp_path / "nothing"), "deployment_id": "t-0", "interval_s": 0.2, "count": 2,
            "proxy_port": 1, "instances": [{"index": 0, "port": 1, "address": "127.0.0.1"}],
            "smi": "echo 'no smi found' >&2; exit 127", "smi_every_s": 2}
    r = subprocess.run([sys.executable, "-c", hostcode.probe("top"), json.dumps(spec)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    frames = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(frames) == 2 and frames[0]["instances"][0]["state"] == "stopped"
    assert frames[0]["smi"]["rc"] == 127 and "smi" not in frames[1]      # the smi: every 2 s at most
    assert frames[0]["proxy"] == {"alive": False, "metrics": None, "error": None}


# --- against a sim cluster ---------------------------------------------------------------------------------

SIM = "{load_s: 0.3, prefill_ms: 20, token_ms: 10}"


class Load:
    """The shared chat load (fleet_helpers.load, bounded in time) from a few threads, until stop()."""

    def __init__(self, port: int, threads: int = 6):
        self.port, self.done = port, threading.Event()
        self.threads = [threading.Thread(target=load, args=(port, self.done, 120), daemon=True)
                        for _ in range(threads)]
        for th in self.threads:
            th.start()

    def answered(self) -> float:
        """The proxy's own count of 200 answers."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(v) for v in re.findall(r'^proxy_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', text, re.M))

    def stop(self):
        self.done.set()
        for th in self.threads:
            th.join(timeout=35)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    inventory, hv = deploy_sim_cluster(tmp_path_factory.mktemp("top"), sim=SIM)
    try:
        yield inventory, hv.settings.proxy.port
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(deployment_id(inventory) + "/")


def instance_rows(text: str) -> dict[int, list[str]]:
    """The instance lines of a frame: index -> its cells."""
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0].isdigit() and len(cells) >= 5 and "/" in cells[2]:
            rows[int(cells[0])] = cells
    return rows


def once(inventory, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "invoke", "top", "--host", "t", "--once", *extra, "--inventory",
                           str(inventory)], cwd=ROOT, capture_output=True, text=True, timeout=90,
                          env=inv_env({"COLUMNS": "160"}))


@pytest.mark.cluster
@pytest.mark.xdist_group("top")
def test_once_prints_a_frame_with_the_fleet_at_work(cluster):
    inventory, port = cluster
    work = Load(port)
    try:
        wait_until(lambda: work.answered() >= 20, timeout=60, what="the load's first answers")
        r = once(inventory)
    finally:
        work.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    rows = instance_rows(r.stdout)
    assert sorted(rows) == [0, 1], r.stdout
    header = next(line for line in r.stdout.splitlines() if line.startswith("inst"))
    assert header.split()[:10] == ["inst", "state", "flight", "r/s", "TTFT", "p50", "p95", "tok/s", "KV", "hit"]
    for cells in rows.values():
        assert cells[1] == "healthy"
        assert float(cells[3]) > 0, r.stdout              # requests per second
        assert float(cells[6]) > 0, r.stdout              # output tokens per second
    host_line = next(line for line in r.stdout.splitlines() if line.startswith("t "))
    assert host_line.split()[1:3] == ["proxy", "running"] and "0:" in host_line   # front, keeper, card 0


@pytest.mark.cluster
@pytest.mark.xdist_group("top")
def test_a_source_that_cannot_be_read_is_named_and_the_rest_still_shows(cluster):
    inventory, _ = cluster
    r = once(inventory, "--set", "smi=/nonexistent/hy-smi")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "unreadable: t: the smi (/nonexistent/hy-smi)" in r.stdout, r.stdout
    assert [cells[1] for cells in instance_rows(r.stdout).values()] == ["healthy", "healthy"]


@pytest.mark.cluster
@pytest.mark.xdist_group("top")
def test_in_a_real_terminal_the_numbers_move_under_load_and_q_quits(cluster, tmp_path):
    tmux = require_tool("tmux")
    inventory, port = cluster
    server = f"fleet-top-{os.getpid()}"          # a tmux server of this test's own
    rc_file = tmp_path / "rc"
    command = (f"cd {ROOT} && {PYTHON} -m invoke top --host t --inventory {inventory}; "
               f"echo $? > {rc_file}; sleep 60")
    env = {k: v for k, v in inv_env().items() if not k.startswith("TMUX")}
    subprocess.run([tmux, "-L", server, "new-session", "-d", "-x", "160", "-y", "40", command], check=True, env=env)

    def pane() -> str:
        return subprocess.run([tmux, "-L", server, "capture-pane", "-p"], capture_output=True, text=True,
                              env=env).stdout
    work = None
    try:
        wait_until(lambda: len(instance_rows(pane())) == 2, timeout=60, what="inv top's first frame in tmux")
        work = Load(port)
        seen = []

        def moving() -> bool:
            rows = instance_rows(pane())
            if len(rows) == 2:
                seen.append(tuple(rows[0][2:8]))
            busy = [c for c in rows.values() if c[3] != "-" and float(c[3]) > 0 and float(c[6]) > 0]
            return len(busy) == 2 and len(set(seen)) >= 3
        wait_until(moving, timeout=60, interval=0.5, what="requests and tokens per second moving in the pane")
        subprocess.run([tmux, "-L", server, "send-keys", "q"], check=True, env=env)
        wait_until(lambda: rc_file.exists() and rc_file.read_text().strip() != "", timeout=20,
                   what="inv top to end after q")
        assert rc_file.read_text().strip() == "0"
        dep = str(inventory.parent / "deploy")
        wait_until(lambda: not _samplers(dep), timeout=10, what="the sampler to end with the view")
    finally:
        if work is not None:
            work.stop()
        subprocess.run([tmux, "-L", server, "kill-server"], capture_output=True, env=env)


def _samplers(deploy_dir: str) -> list[int]:
    """Processes running the live view's sampler for deploy_dir."""
    return [p.pid for p in processes.snapshot().values() if "exit_at_eof" in p.cmdline and deploy_dir in p.cmdline]


@pytest.mark.unit
def test_a_host_whose_sampler_was_lost_shows_no_frozen_numbers(one_host):
    hv, rows = one_host
    target = top.Target(hv)
    target.add(top.Frame.parse(raw_frame(1.0, engine_lines(), proxy_lines()), hv))
    assert top.view({hv.name: target}, rows)["instances"][0]["state"] == "healthy"
    target.error = "its sampler: it ended (Broken pipe); starting it again"
    v = top.view({hv.name: target}, rows)
    assert v["instances"][0]["state"] == "unread" and v["instances"][0].get("rps") is None
    assert "its sampler: it ended (Broken pipe); starting it again" in v["hosts"][0]["errors"]


@pytest.mark.unit
def test_a_fronted_host_alone_is_shown_with_its_entry_hosts_proxy(tmp_path):
    """inv top --host b, where a fronts b: b's rows take their load from a's proxy, a is read for its
    proxy alone (no rows, no cards); --host a shows both hosts' rows."""
    import yaml
    base = {"connection": "local", "engine": "sim", "accelerator": "sim", "accelerators": 2, "instances": 2}
    hosts = {"a": {**base, "base_port": 21000, "fronts": ["a", "b"], "proxy": {"port": 21010, "admin_port": 21011},
                   "deploy_dir": str(tmp_path / "a")},
             "b": {**base, "base_port": 21100, "proxy": {"port": 21110, "admin_port": 21111},
                   "deploy_dir": str(tmp_path / "b")}}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"hosts": hosts}))
    inv_ = fleet_inventory.load(path)
    sampled, rows, proxy_only = top.plan(inv_, "b")
    assert [h.name for h in sampled] == ["b", "a"] and proxy_only == {"a"}
    assert [(r.host, r.proxy_host) for r in rows] == [("b", "a"), ("b", "a")]
    assert top.sampler_spec(sampled[1], 1.0, 0, proxy_only=True)["instances"] == []
    assert top.sampler_spec(sampled[1], 1.0, 0, proxy_only=True)["smi"] is None
    sampled, rows, proxy_only = top.plan(inv_, "a")
    assert not proxy_only and sorted((r.host, r.index, r.proxy_host) for r in rows) == [
        ("a", 0, "a"), ("a", 1, "a"), ("b", 0, "a"), ("b", 1, "a")]


def tenant_lines(served_app=10.0, served_batch=100.0, app_waits=None):
    """A proxy's per-tenant samples: app and batch, batch waiting, app refused once by its rate."""
    lines = []
    for name, weight, flight, queued, served in (("default", 1, 0, 0, 0.0), ("app", 3, 1, 0, served_app),
                                                 ("batch", 1, 3, 20, served_batch)):
        lines += [f'proxy_tenant_in_flight{{tenant="{name}"}} {flight}',
                  f'proxy_tenant_queue_length{{tenant="{name}"}} {queued}',
                  f'proxy_tenant_weight{{tenant="{name}"}} {weight}',
                  f'proxy_tenant_requests_total{{tenant="{name}",status="200"}} {served}']
    lines.append('proxy_tenant_limited_total{tenant="app",limit="requests_per_minute"} 1.0')
    for le, count in (app_waits or {}).items():
        lines.append(f'proxy_tenant_queue_wait_seconds_bucket{{tenant="app",le="{le}"}} {count}')
    return sent(lines)


@pytest.mark.unit
def test_tenants_show_with_their_share_their_queue_their_rate_and_their_refusals(one_host):
    """1. two frames 10 s apart of a proxy with tenants app (weight 3) and batch; 2. the host's view has a
    line per tenant: slots held, waiting, requests per second over the 10 s, its 429s, its wait p50;
    3. the screen shows the tenants' table; a proxy with `default` alone shows none."""
    hv, rows = one_host
    target = top.Target(hv)
    target.add(top.Frame.parse(raw_frame(90.0, engine_lines(), proxy_lines() + tenant_lines(
        app_waits={0.01: 0.0, 0.05: 0.0, "+Inf": 0.0})), hv))
    target.add(top.Frame.parse(raw_frame(100.0, engine_lines(), proxy_lines() + tenant_lines(
        served_app=30.0, served_batch=110.0, app_waits={0.01: 4.0, 0.05: 10.0, "+Inf": 10.0})), hv))
    v = top.view({hv.name: target}, rows)
    lines = {t["tenant"]: t for t in v["hosts"][0]["tenants"]}
    assert set(lines) == {"default", "app", "batch"}
    assert lines["app"]["rps"] == pytest.approx(2.0) and lines["batch"]["rps"] == pytest.approx(1.0)
    assert lines["batch"]["queued"] == 20 and lines["app"]["in_flight"] == 1 and lines["app"]["weight"] == 3
    assert lines["app"]["limited"] == 1 and 0.01 < lines["app"]["wait_p50"] <= 0.05
    console = Console(width=120, record=True, file=open(os.devnull, "w"))
    console.print(top.render(v, [], 120, 1.0, "vllm-fleet top: t"))
    text = console.export_text()
    assert "tenant" in text and "batch" in text and "wait p50" in text
    plain = top.Target(hv)
    plain.add(top.Frame.parse(raw_frame(100.0, engine_lines(), proxy_lines() + sent(
        ['proxy_tenant_in_flight{tenant="default"} 0'])), hv))
    assert top.view({hv.name: plain}, rows)["hosts"][0]["tenants"] == []
