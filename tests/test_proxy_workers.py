"""Several worker processes on the entry port (proxy.workers > 1; proxy/workers.py): each worker owns a part
of every engine's slots and lends idle ones to a worker whose requests wait, so together they never put more
requests on an engine than its slots, and a few client connections that all landed on one worker still
get every slot; the operator sees one proxy (one /metrics, one results log, one admin port)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import aiohttp
import pytest
import yaml
from conftest import wait_until
from proxy_helpers import results_lines, start_proxy, start_sims

from proxy.config import ConfigError, Workers, parse_config
from proxy.workers import admin_path, lessons, merged_metrics

from fleet import render
from fleet.settings import inventory


def _start(procs, tmp_path, sims, **extra):
    """The proxy over sims with slots 4 and 2 workers (extra: more config keys), once its admin port
    (worker 0's) answers too: the public port answers as soon as either worker listens."""
    port, admin = start_proxy(procs, tmp_path, sims, slots=4, workers=2, **extra)

    def admin_up():
        try:
            return _get(f"http://127.0.0.1:{admin}/admin/config")["workers"] == 2
        except OSError:
            return False
    wait_until(admin_up, what="the admin port of 2 workers")
    return port, admin


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _post(url, body=b""):
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _reset(sims):
    for s in sims:
        _post(f"http://127.0.0.1:{s}/sim/reset-stats")


def _stats(sims, key):
    return [_get(f"http://127.0.0.1:{s}/sim/stats")[key] for s in sims]


def _workers_of(pid):
    """The worker pids of the supervisor pid (its children), in the order it started them."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return sorted(int(x) for x in f.read().split())


def _metric(port, name, **labels):
    total = 0.0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def _load(port, requests, connections):
    """requests chat completions over at most `connections` kept-alive connections; their statuses."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as session:
        async def one(i):
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                    json={**body, "user": f"u{i}"}) as r:
                await r.read()
                return r.status
        return await asyncio.gather(*(one(i) for i in range(requests)))


def _host(tmp_path, proxy: str):
    path = tmp_path / "hosts.yml"
    path.write_text(f"""hosts:
  h:
    connection: local
    engine: sim
    accelerator: sim
    accelerators: 3
    instances: 3
    deploy_dir: {tmp_path}/deploy
    proxy: {proxy}
""")
    hv = inventory.load(path).host_vars("h")
    hv.settings.python = "python3"
    return yaml.safe_load({f.path: f.content for f in render.render_host(hv)}["conf/proxy.yaml"])


@pytest.mark.unit
def test_workers_render_from_the_inventory_and_auto_leaves_the_engines_their_cores(tmp_path):
    """1. The default (1) renders no `workers` key at all. 2. `auto` renders the engines' cores (2 an
    instance): on 16 cores, 10 workers; on 4, 1 (at least one). 3. A number renders as it is."""
    assert "workers" not in _host(tmp_path, "{port: 8000}")
    auto = parse_config(_host(tmp_path, "{workers: auto}")).workers
    assert auto == Workers("auto", 6) and auto.resolve(16) == 10 and auto.resolve(4) == 1
    assert parse_config(_host(tmp_path, "{workers: 3}")).workers.resolve(16) == 3


@pytest.mark.unit
def test_workers_beside_tenants_or_out_of_bounds_are_refused_in_one_sentence(tmp_path):
    """Several workers do not split a tenant's limits yet: the inventory and the proxy's config refuse
    the pair, naming the key; 0 workers is no number of processes."""
    with pytest.raises(inventory.InventoryError, match=r"hosts\.h\.proxy\.workers: several workers do not split"):
        _host(tmp_path, "{workers: 2, tenants: {app: {}}}")
    with pytest.raises(inventory.InventoryError, match=r"proxy\.workers: expected auto or a number"):
        _host(tmp_path, "{workers: 0}")
    with pytest.raises(ConfigError, match="workers above 1 do not split the tenants"):
        parse_config({"backends": ["a:1"], "workers": "auto", "tenants": {"app": {}}})


@pytest.mark.unit
def test_merged_metrics_sum_the_workers_and_keep_a_state_gauge_once():
    """Two workers' texts: a counter and the in-flight gauge summed, a histogram's buckets summed, the
    backend's health (a state gauge) its largest value, not 2; _created samples left out."""
    one = ('# HELP proxy_requests_total Proxied\n# TYPE proxy_requests_total counter\n'
           'proxy_requests_total{backend="a",status="200"} 3.0\n'
           '# HELP proxy_requests_created Proxied\n# TYPE proxy_requests_created gauge\n'
           'proxy_requests_created{backend="a",status="200"} 1.7e9\n'
           '# HELP proxy_backend_in_flight In flight\n# TYPE proxy_backend_in_flight gauge\n'
           'proxy_backend_in_flight{backend="a"} 2.0\n'
           '# HELP proxy_backend_healthy Up\n# TYPE proxy_backend_healthy gauge\nproxy_backend_healthy{backend="a"} 1.0\n'
           '# HELP proxy_queue_wait_seconds Wait\n# TYPE proxy_queue_wait_seconds histogram\n'
           'proxy_queue_wait_seconds_bucket{le="0.1"} 1.0\nproxy_queue_wait_seconds_bucket{le="+Inf"} 2.0\n'
           'proxy_queue_wait_seconds_count 2.0\nproxy_queue_wait_seconds_sum 0.5\n')
    two = one.replace("} 3.0", "} 4.0").replace('in_flight{backend="a"} 2.0', 'in_flight{backend="a"} 1.0')
    merged = merged_metrics([one, two]).decode()
    assert 'proxy_requests_total{backend="a",status="200"} 7.0' in merged
    assert 'proxy_backend_in_flight{backend="a"} 3.0' in merged
    assert 'proxy_backend_healthy{backend="a"} 1.0' in merged
    assert 'proxy_queue_wait_seconds_bucket{le="+Inf"} 4.0' in merged and "proxy_queue_wait_seconds_count 4.0" in merged
    assert "_created" not in merged


@pytest.mark.process
def test_two_workers_never_put_more_on_an_engine_than_its_slots(procs, tmp_path):
    """1. Two sims with max_num_seqs 4; the proxy with slots 4 and 2 workers. 2. 300 requests over 48
    connections (more than the 8 slots; the kernel spreads them over the workers). 3. No sim ever held more
    than 4 (its own peak_in_flight: running plus waiting), and the load filled them; all 300 answered 200.
    4. One /metrics counts the 300 (summed over the workers); one results log holds 300 whole JSON lines."""
    sims = start_sims(procs, tmp_path, 2, seqs=4, token_ms=5)
    port, admin = _start(procs, tmp_path, sims)
    assert len(_workers_of(_get(f"http://127.0.0.1:{port}/health")["pid"])) == 2
    _reset(sims)
    statuses = asyncio.run(_load(port, 300, 48))
    assert statuses == [200] * 300
    peaks = _stats(sims, "peak_in_flight")
    assert max(peaks) <= 4 and min(peaks) == 4, peaks
    assert _metric(port, "proxy_requests_total", status="200") == 300
    log = tmp_path / "req_results.log"
    wait_until(lambda: len(log.read_text().splitlines()) >= 300, what="300 lines in the results log")
    lines = log.read_text().splitlines()
    assert len(lines) == 300 and all(json.loads(line)["status"] == 200 for line in lines)


@pytest.mark.process
def test_one_results_log_rotated_by_its_workers_loses_and_cuts_no_line(procs, tmp_path):
    """1. 2 workers, the results log rotated at 20 KB with 20 backups. 2. 200 requests over 16 connections
    (both workers write). 3. It rotated, and the files together hold exactly 200 whole JSON lines: 200
    request ids, none twice (a worker that did not rotate followed the new file; none rotated twice)."""
    sims = start_sims(procs, tmp_path, 1, seqs=4, token_ms=0)
    port, _ = _start(procs, tmp_path, sims, results_log={"path": str(tmp_path / "req_results.log"), "max_mb": 0.02,
                                                          "backups": 20})
    assert asyncio.run(_load(port, 200, 16)) == [200] * 200

    def lines():
        return [line for p in tmp_path.glob("req_results.log*") for line in p.read_text().splitlines()]
    wait_until(lambda: len(lines()) >= 200, what="200 lines in the results logs")
    assert (tmp_path / "req_results.log.1").exists()
    ids = [json.loads(line)["request_id"] for line in lines()]
    assert len(ids) == 200 and len(set(ids)) == 200


@pytest.mark.process
def test_connections_all_on_one_worker_still_use_every_slot(procs, tmp_path):
    """1. One sim with max_num_seqs 4; 2 workers (2 slots each). 2. Worker 1 stopped (SIGSTOP) while 4
    kept-alive client connections are opened: worker 0 accepts them all. 3. Worker 1 runs again; 80
    requests over those 4 connections only (none opened anew): the sim ran 4 at once (worker 1 lent its 2
    idle slots to worker 0), never more."""
    sims = start_sims(procs, tmp_path, 1, seqs=4, token_ms=20)
    port, admin = _start(procs, tmp_path, sims)
    supervisor = _get(f"http://127.0.0.1:{port}/health")["pid"]
    w0, w1 = _workers_of(supervisor)

    async def run():
        created: list = []
        trace = aiohttp.TraceConfig()

        async def opened(session, ctx, params):
            created.append(1)
        trace.on_connection_create_end.append(opened)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4), trace_configs=[trace]) as session:
            async def one(i):
                async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}) as r:
                    await r.read()
                    return r.status
            os.kill(w1, signal.SIGSTOP)
            try:
                assert await asyncio.gather(*(one(i) for i in range(4))) == [200] * 4
            finally:
                os.kill(w1, signal.SIGCONT)
            assert len(created) == 4
            _reset(sims)
            return await asyncio.gather(*(one(i) for i in range(80))), len(created)
    statuses, opened = asyncio.run(run())
    assert statuses == [200] * 80
    assert opened == 4        # the same 4 connections throughout, all accepted by worker 0
    peaks = _stats(sims, "peak_in_flight")
    assert peaks == [4], peaks


@pytest.mark.process
def test_the_admin_port_and_signals_reach_every_worker(procs, tmp_path):
    """1. Two sims (4 slots), 2 workers. 2. A backend drained on the admin port: a load then goes to the
    other sim only (both workers obey). 3. Enabled again, the config's slots lowered to 2 and SIGHUP sent
    to the supervisor: a load puts at most 2 on each sim (both workers reloaded, 1 slot each, lending).
    4. /admin/backends sums the workers' counts (nothing in flight now; their peaks). 5. POST /admin/drain-and-exit answers
    with the supervisor's pid, and the supervisor exits 0."""
    sims = start_sims(procs, tmp_path, 2, seqs=4, token_ms=5)
    port, admin = _start(procs, tmp_path, sims)
    supervisor = _get(f"http://127.0.0.1:{port}/health")["pid"]
    first = f"127.0.0.1:{sims[0]}"
    assert _post(f"http://127.0.0.1:{admin}/admin/backends/{first}/drain")["drained"] is True
    _reset(sims)
    assert asyncio.run(_load(port, 40, 16)) == [200] * 40
    assert _stats(sims, "requests_total") == [0, 40]
    _post(f"http://127.0.0.1:{admin}/admin/backends/{first}/enable")
    conf = yaml.safe_load((tmp_path / "proxy.yaml").read_text())
    (tmp_path / "proxy.yaml").write_text(yaml.safe_dump({**conf, "slots": 2}))
    os.kill(supervisor, signal.SIGHUP)
    wait_until(lambda: all(b["slots"] == 2 for b in _get(f"http://127.0.0.1:{admin}/admin/backends")),
               what="worker 0 at slots 2")
    wait_until(lambda: (tmp_path / "proxy.log").read_text().count("INFO proxy: reloaded ") == 2,
               what="both workers reloaded")
    _reset(sims)
    assert asyncio.run(_load(port, 120, 32)) == [200] * 120
    peaks = _stats(sims, "peak_in_flight")
    assert max(peaks) <= 2 and min(peaks) == 2, peaks
    served = _get(f"http://127.0.0.1:{admin}/admin/backends")
    assert sum(b["in_flight"] for b in served) == 0 and sum(b["peak_in_flight"] for b in served) >= 4
    answer = _post(f"http://127.0.0.1:{admin}/admin/drain-and-exit", json.dumps({"pid": supervisor}).encode())
    assert answer["pid"] == supervisor and answer["workers_answered"] == 2 and answer["cut"] == []
    wait_until(lambda: not os.path.exists(f"/proc/{supervisor}") or _zombie(supervisor), what="the supervisor exits")


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


@pytest.mark.process
def test_a_zero_gap_restart_of_two_workers_refuses_no_connection(procs, tmp_path):
    """1. A 2-worker proxy serves a load of 8 clients, a new connection for every request. 2. A second
    2-worker proxy of the same config starts beside it (SO_REUSEPORT, --admin-wait-s) and answers /health.
    3. SIGTERM to the first supervisor: its workers steer new connections to the second, drain, and it
    exits 0. 4. Not one request of the load failed, and the second proxy serves on, the admin port too."""
    from conftest import PYTHON, ROOT
    sims = start_sims(procs, tmp_path, 1, seqs=4, token_ms=5)
    port, admin = _start(procs, tmp_path, sims)
    old = _get(f"http://127.0.0.1:{port}/health")["pid"]
    errors: list = []
    answered = [0]

    async def run():
        stop = asyncio.Event()

        async def client(session):
            while not stop.is_set():
                try:
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) as r:
                        await r.read()
                        answered[0] += 1
                        if r.status != 200:
                            errors.append(r.status)
                except aiohttp.ClientError as e:
                    errors.append(repr(e))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            load = asyncio.gather(*(client(session) for _ in range(8)))
            with open(tmp_path / "proxy-new.log", "ab") as log:
                new = procs.start([PYTHON, "-m", "proxy", "--config", str(tmp_path / "proxy.yaml"), "--admin-wait-s",
                                   "20"], cwd=ROOT, stderr=log)
            seen: set = set()
            while new.pid not in seen:       # the kernel gives each new connection to one proxy or the other
                seen.add((await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/health"))["pid"])
            before = answered[0]
            os.kill(old, signal.SIGTERM)
            await asyncio.to_thread(wait_until, lambda: _zombie(old), 60, 0.05, "the old supervisor exits")
            while answered[0] < before + 50:  # the load goes on through the new proxy alone
                await asyncio.sleep(0.05)
            stop.set()
            await load
            return new
    new = asyncio.run(run())
    assert errors == [], errors[:5]
    assert _get(f"http://127.0.0.1:{port}/health")["pid"] == new.pid
    wait_until(lambda: _get(f"http://127.0.0.1:{admin}/admin/config")["pid"] == new.pid, what="the new proxy's admin")


@pytest.mark.process
def test_a_conversation_keeps_its_home_whichever_worker_takes_its_next_round(procs, tmp_path):
    """1. Four sims, 2 workers, the prefix policy. 2. Worker 1 stopped: three conversations' first rounds
    go through worker 0, each to some sim. 3. Worker 1 runs again and adopts worker 0's decisions (its own
    admin answer counts them); worker 0 stopped. 4. Each conversation's second round, through worker 1, goes
    to its first round's sim by its prefix (the results log's `route`), not by load."""
    sims = start_sims(procs, tmp_path, 4, seqs=4, token_ms=5)
    port, admin = _start(procs, tmp_path, sims, routing={"policy": "prefix"})
    supervisor = _get(f"http://127.0.0.1:{port}/health")["pid"]
    w0, w1 = _workers_of(supervisor)
    with open(f"/proc/{w1}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    run_dir = argv[argv.index("--run-dir") + 1]

    def chat(c, rounds):
        messages = [{"role": "system", "content": f"conversation {c}: " + "a long shared history " * 60}]
        for r in range(rounds):
            messages += [{"role": "user", "content": f"question {r} of conversation {c}"}]
            if r < rounds - 1:
                messages += [{"role": "assistant", "content": f"answer {r} of conversation {c}"}]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(
            {"model": "m", "messages": messages, "max_tokens": 4}).encode(),
            {"Content-Type": "application/json", "X-Request-Id": f"c{c}-r{rounds}"})
        with urllib.request.urlopen(req, timeout=30) as r:   # a new connection each: whoever accepts it
            r.read()
            return r.headers["X-Backend"]

    async def learned_by_worker_1():
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=admin_path(run_dir, 1))) as s:
            async with s.get("http://worker/admin/config") as r:
                return (await r.json())["learned_from_workers"]

    os.kill(w1, signal.SIGSTOP)
    try:
        first = [chat(c, 1) for c in range(3)]
    finally:
        os.kill(w1, signal.SIGCONT)
    wait_until(lambda: asyncio.run(learned_by_worker_1()) >= 3, what="worker 1 adopting worker 0's decisions")
    os.kill(w0, signal.SIGSTOP)
    try:
        second = [chat(c, 2) for c in range(3)]
    finally:
        os.kill(w0, signal.SIGCONT)
    assert second == first

    def logged():
        return {line["request_id"]: line for line in results_lines(tmp_path / "req_results.log")}
    wait_until(lambda: all(f"c{c}-r2" in logged() for c in range(3)), what="the second rounds' lines")
    lines = logged()
    assert [lines[f"c{c}-r2"]["route"] for c in range(3)] == ["prefix"] * 3, lines


@pytest.mark.unit
@pytest.mark.parametrize("decisions", [
    [("127.0.0.1:1", [-(2 ** 63) + 1] * 1000), ("127.0.0.1:2", [-(2 ** 63) + 1] * 1000),
     ("127.0.0.1:3", list(range(5000)))],                                   # a few long prompts
    [(f"backend-with-a-long-name-{i:04}.example:8002", [-(2 ** 63) + 1]) for i in range(1024)],   # many short
])
def test_lessons_fit_a_datagram_read_and_keep_a_long_prompts_prefix(decisions):
    """LEARN messages are at most TEACH_BYTES (a worker reads 64 KiB of a datagram) whatever the decisions'
    count, names and lengths, every decision in its order; a prompt longer than TEACH_BLOCKS is taught by its
    first blocks, what a next round matches."""
    from proxy.workers import TEACH_BLOCKS, TEACH_BYTES
    messages = lessons("m", decisions)
    taught = [json.loads(m) for m in messages]
    assert all(len(m.encode()) <= TEACH_BYTES for m in messages)
    flat = [d for t in taught for d in t["d"]]
    assert [d[0] for d in flat] == [b for b, _ in decisions] and all(t["pool"] == "m" for t in taught)
    assert [d[1] for d in flat] == [blocks[:TEACH_BLOCKS] for _, blocks in decisions]
