"""nginx mode with real nginx: the rendered config, balancing, SSE, the body limit, the /health watcher,
and the swap proxy <-> nginx under load (`inv swap-to-nginx`, `inv swap-to-proxy`)."""
from __future__ import annotations

import http.client
import json
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import PYTHON, ROOT, require_tool, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory

sys.path.insert(0, str(ROOT / "scripts"))
from swap_under_load import Load  # noqa: E402

sys.path.insert(0, str(ROOT))
from hostagent import upstream  # noqa: E402

pytestmark = pytest.mark.nginx

MODEL = "Test-Model"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A deployed 4-instance sim cluster behind the proxy; stopped and swept by tag at the end."""
    require_tool("nginx")
    tmp = tmp_path_factory.mktemp("nginx")
    # 5 ms a token with no cap on the answer: chat(N) takes N x 5 ms (the sim stops at 200 tokens otherwise)
    inventory = write_inventory(tmp, sim="{load_s: 0.3, prefill_ms: 20, token_ms: 5, output_tokens: 5000}")
    dep = deployment_id(inventory)
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        yield inventory, tmp / "deploy", status_json(inventory)
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")


@pytest.fixture
def nginx_front(cluster):
    """The cluster with nginx as its front (swapped if it is not yet)."""
    inventory, deploy, st = cluster
    r = inv("swap-to-nginx", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    return inventory, deploy, st


def post(port: int, body: dict, timeout: float = 30) -> tuple[int, dict, dict]:
    """Status, headers and JSON body of a chat completion sent to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def chat(max_tokens: int = 2, **extra) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}], **extra}


def sim_stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/stats", timeout=5) as r:
        return json.loads(r.read())


def fault(port: int, name: str) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/sim/fault", data=json.dumps({"fault": name}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()


def test_rendered_config_passes_nginx_t(tmp_path):
    """The config deploy renders passes `nginx -t` (run by hostagent's preflight, with the same
    -p/-e/-c/-g nginx is started with) and carries the directives the seed's users rely on."""
    require_tool("nginx")
    inventory = write_inventory(tmp_path, instances=2)
    out = tmp_path / "deploy"
    r = inv("render", "--host", "t", "--out", str(out), inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    conf = (out / "conf" / "nginx.conf").read_text()
    for directive in ("least_conn;", "keepalive 64;", "proxy_http_version 1.1;", "proxy_buffering off;",
                      "proxy_read_timeout 300s;", "proxy_send_timeout 300s;", "client_max_body_size 64m;",
                      "add_header X-Backend $upstream_addr always;", "proxy_next_upstream error timeout;",
                      "zone vllm_backends", f"listen 0.0.0.0:{status_port(inventory)} sndbuf=16k;"):
        assert directive in conf, directive
    assert not any("non_idempotent" in line.split("#")[0] for line in conf.splitlines())
    check = subprocess.run([PYTHON, "-m", "hostagent", "check", "--config", "conf/nginx_front.json"],
                           cwd=out, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    result = json.loads(check.stdout.splitlines()[-1].split(" ", 1)[1])
    assert check.returncode == 0 and result["ok"], check.stdout + check.stderr
    # No instance runs: every backend is marked down, and the config is still valid.
    assert len(upstream.parse_down((out / "run" / "nginx_upstream.conf").read_text())) == 2


def test_fractional_sizes_and_times_render_exactly_and_pass_nginx_t(tmp_path):
    """proxy.max_body_mb 0.5 and sub-second timeouts reach nginx.conf exactly (512k, 500ms; `| int` made
    them `0m`, no limit, and `0s`), nginx.worker_processes takes a number, and `nginx -t` accepts it all."""
    require_tool("nginx")
    inventory = write_inventory(tmp_path, instances=2)
    out = tmp_path / "deploy"
    sets = ["proxy.max_body_mb=0.5", "proxy.timeout_s=0.5", "proxy.connect_timeout_s=1.25",
            "nginx.worker_processes=2", "nginx.fail_timeout_s=3"]
    r = inv("render", "--host", "t", "--out", str(out), *[a for s in sets for a in ("--set", s)],
            inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    conf = (out / "conf" / "nginx.conf").read_text()
    for directive in ("client_max_body_size 512k;", "proxy_read_timeout 500ms;", "proxy_connect_timeout 1250ms;",
                      "worker_processes 2;", "larger than 0.5 MiB"):
        assert directive in conf, directive
    check = subprocess.run([PYTHON, "-m", "hostagent", "check", "--config", "conf/nginx_front.json"],
                           cwd=out, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert check.returncode == 0, check.stdout + check.stderr
    assert "fail_timeout=3s" in (out / "run" / "nginx_upstream.conf").read_text()


def status_port(inventory) -> int:
    from fleet.settings import inventory as inv_mod
    return inv_mod.load(inventory).host_vars("t").settings.proxy.port


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_swap_under_load_and_in_flight_streams_survive(cluster):
    """1. 32 clients send chat completions (about 0.3 s each) back to back through the entry port, never
    retrying.
    2. Four SSE streams (about 1.5 s each) are open when each swap starts.
    3. swap-to-nginx, then swap-to-proxy: both succeed and say how long the port refused connections.
    4. Both fronts answered; the streams finished with [DONE] (in-flight requests drain); the failed
       requests are counted and printed (the figure documented in docs/RUNBOOK.md).
    """
    inventory, deploy, st = cluster
    port = st["proxy"]["port"]
    streams_ok, streams_open = [], []

    def stream():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(chat(300, stream=True)),
                     {"Content-Type": "application/json"})
        answer = conn.getresponse()
        streams_open.append(answer.status)    # its headers came: the stream runs on the front being left
        streams_ok.append(b"data: [DONE]" in answer.read())
        conn.close()

    def answered_by(front: str, more_than: int):
        with load.lock:
            return load.outcomes[f"ok {front}"] > more_than

    outputs, spans = [], []
    # about 0.3 s a request (60 tokens): 32 in flight at every moment of the swaps
    with Load(port, MODEL, clients=32, max_tokens=60) as load:
        for verb, leaving in (("swap-to-nginx", "proxy"), ("swap-to-proxy", "nginx")):
            # the front being left has served its share of the load before it goes (asserted below)
            wait_until(lambda: answered_by(leaving, 50), what=f"50 answers by the {leaving}")
            openers = [threading.Thread(target=stream) for _ in range(4)]
            for t in openers:
                t.start()
            wait_until(lambda: len(streams_open) == len(spans) * 4 + 4, what="four streams open")
            t0 = time.monotonic()
            r = inv(verb, "--host", "t", inventory=inventory)
            spans.append((t0, time.monotonic() + 0.2))
            assert r.returncode == 0, r.stdout + r.stderr
            outputs.append(r.stdout)
            for t in openers:
                t.join(timeout=30)
        # the load reaches the proxy again after the swap back
        before = load.outcomes["ok proxy"]
        wait_until(lambda: answered_by("proxy", before), what="an answer by the proxy after the swap back")
    gaps = [float(o.split("refused connections for at most ")[1].split(" ms")[0]) for o in outputs]
    per_swap = [sum(1 for t, _ in load.failures if a <= t <= b) for a, b in spans]
    print(f"\nswap under load: {load.total} requests, {load.failed} failed ({per_swap[0]} in the swap to "
          f"nginx, {per_swap[1]} in the swap to the proxy); port refused connections for at most "
          f"{gaps[0]} ms and {gaps[1]} ms; outcomes {dict(load.outcomes)}")
    assert streams_ok == [True] * 8
    assert load.outcomes["ok nginx"] > 50 and load.outcomes["ok proxy"] > 50
    assert load.failed <= 0.01 * load.total, load.outcomes   # measured: 0-2 of 1,600-4,600
    assert gaps[0] < 100 and gaps[1] < 2000
    assert status_json(inventory)["front"] == "proxy"


@pytest.mark.xdist_group("nginx")
@pytest.mark.cluster
def test_status_deploy_keeps_nginx_mode(nginx_front):
    inventory, deploy, st = nginx_front
    s = status_json(inventory)
    assert s["front"] == "nginx" and s["nginx"]["pid"] and s["nginx"]["watcher_pid"]
    assert s["proxy"]["state"] == "stopped" and (deploy / "run" / "mode").read_text().strip() == "nginx"
    r = inv("deploy", "--host", "t", inventory=inventory)
    assert r.returncode == 0 and "changed=0" in r.stdout, r.stdout + r.stderr
    after = status_json(inventory)
    assert after["front"] == "nginx" and after["nginx"]["pid"] == s["nginx"]["pid"] and not after["proxy"]["pid"]
    # inv top names the front, and with no proxy to ask takes each instance's load from its engine.
    r = inv("top", "--host", "t", "--once", inventory=inventory, process=True, env={"COLUMNS": "160"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert next(ln for ln in r.stdout.splitlines() if ln.startswith("t ")).split()[1] == "nginx", r.stdout
    rows = [ln.split() for ln in r.stdout.splitlines() if ln[:1].isdigit()]
    assert len(rows) == 4 and all(c[1] == "healthy" and c[2] == "0/4" for c in rows), r.stdout


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_least_connections(nginx_front):
    """1. Three long requests (3 s) keep three backends busy (least_conn puts each on an idle one).
    2. Short requests sent one after another all go to the fourth, idle backend.
    3. 16 concurrent requests (1.5 s) over 4 backends: none sees more than 5 at once.
    """
    inventory, deploy, st = nginx_front
    port = st["proxy"]["port"]
    ports = [i["port"] for i in st["instances"]]
    long_backends = []
    threads = [threading.Thread(target=lambda: long_backends.append(post(port, chat(600))[1]["x-backend"]))
               for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: sum(sim_stats(p)["running"] for p in ports) == 3, timeout=10, what="3 long requests")
    busy = {f"127.0.0.1:{p}" for p in ports if sim_stats(p)["running"]}
    short = [post(port, chat(1))[1]["x-backend"] for _ in range(6)]
    for t in threads:
        t.join(timeout=30)
    assert len(busy) == 3 and set(long_backends) == busy
    assert len(set(short)) == 1 and short[0] not in busy, (short, busy)

    for p in ports:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{p}/sim/reset-stats", data=b""),
                               timeout=5).read()
    results = []

    def one():
        try:
            results.append(post(port, chat(300))[0])
        except Exception as e:          # noqa: BLE001 - the test reports it
            results.append(repr(e))
    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    peaks = [sim_stats(p)["peak_in_flight"] for p in ports]
    assert results == [200] * 16, results
    assert max(peaks) <= 5 and min(peaks) >= 3, peaks


@pytest.mark.xdist_group("nginx")
@pytest.mark.cluster
def test_sse_first_chunk_before_the_last_token(nginx_front):
    """A 300-token stream: its first chunk reaches the client through nginx while the engine is still
    generating it (its backend counts it running), so nginx does not buffer the stream."""
    inventory, deploy, st = nginx_front
    conn = http.client.HTTPConnection("127.0.0.1", st["proxy"]["port"], timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat(300, stream=True)),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("X-Front") == "nginx" and r.getheader("X-Backend")
    backend = int(r.getheader("X-Backend").rsplit(":", 1)[1])
    running_at_first = None
    lines = 0
    while True:
        line = r.fp.readline()     # the raw chunked stream: chunk sizes and SSE lines, as they come
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            lines += 1
            if running_at_first is None:
                running_at_first = sim_stats(backend)["running"]
    conn.close()
    assert lines > 100
    # the tests of this cluster run one at a time: the one request running is this stream
    assert running_at_first == 1, running_at_first
    assert sim_stats(backend)["running"] == 0


@pytest.mark.xdist_group("nginx")
@pytest.mark.cluster
def test_body_over_64_mib_gets_413(nginx_front):
    inventory, deploy, st = nginx_front
    conn = http.client.HTTPConnection("127.0.0.1", st["proxy"]["port"], timeout=60)
    conn.request("POST", "/v1/chat/completions", b"x" * (64 * 1024 * 1024 + 1), {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    assert r.status == 413 and r.getheader("X-Front") == "nginx" and r.getheader("X-Request-Id")
    assert body["error"]["code"] == 413


@pytest.mark.xdist_group("nginx")
@pytest.mark.cluster
def test_request_id_forwarded_and_access_log(nginx_front):
    inventory, deploy, st = nginx_front
    conn = http.client.HTTPConnection("127.0.0.1", st["proxy"]["port"], timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat()),
                 {"Content-Type": "application/json", "X-Request-Id": "rid-nginx-42"})
    r = conn.getresponse()
    r.read()
    conn.close()
    assert r.status == 200 and r.getheader("X-Request-Id") == "rid-nginx-42"

    def logged():
        lines = (deploy / "logs" / "nginx_access.log").read_text().splitlines()
        return [json.loads(x) for x in lines if "rid-nginx-42" in x]
    entry = wait_until(logged, timeout=5, what="the access-log line")[0]
    assert entry["status"] == 200 and entry["backend"] == r.getheader("X-Backend")
    assert entry["uri"] == "/v1/chat/completions" and float(entry["upstream_time"]) >= 0
    for name in ("nginx_access.log", "nginx_error.log"):   # what callers sent: the deployment user's alone
        assert stat.S_IMODE((deploy / "logs" / name).stat().st_mode) == 0o600, name


@pytest.mark.xdist_group("nginx")
@pytest.mark.cluster
def test_watcher_takes_an_unhealthy_backend_out_and_puts_it_back(nginx_front):
    """1. Backend 0's /health turns 503 (sim fault "unhealthy"; its requests would still work).
    2. The watcher marks it down in run/nginx_upstream.conf and reloads nginx: no request goes there.
    3. Fault recover: /health 200 again, the watcher puts it back, requests reach it again.
    """
    inventory, deploy, st = nginx_front
    port = st["proxy"]["port"]
    b0 = st["instances"][0]["port"]
    name = f"127.0.0.1:{b0}"
    upstream_file = deploy / "run" / "nginx_upstream.conf"
    master = status_json(inventory)["nginx"]["pid"]
    old_workers = serving_workers(master)
    fault(b0, "unhealthy")
    try:
        wait_until(lambda: upstream.parse_down(upstream_file.read_text()) == {name}, timeout=10,
                   what="the watcher to mark backend 0 down")
        # The reload (SIGHUP after the file is written): new workers take over, the old ones stop accepting.
        wait_until(lambda: (lambda now: now and not now & old_workers)(serving_workers(master)),
                   what="nginx's reload to replace its workers")
        seen = [post(port, chat(1))[1]["x-backend"] for _ in range(12)]
        assert name not in seen and len(set(seen)) == 3, seen
    finally:
        fault(b0, "recover")
    wait_until(lambda: not upstream.parse_down(upstream_file.read_text()), timeout=10,
               what="the watcher to put backend 0 back")
    wait_until(lambda: post(port, chat(1))[1]["x-backend"] == name, timeout=10, interval=0.01,
               what="a request on backend 0 again")
    log = (deploy / "logs" / "keeper.log").read_text()      # the keeper watches (keeper.enabled)
    assert f"{name}: /health failed, marked down" in log and f"{name}: /health answers 200 again" in log


def serving_workers(master: int) -> set[int]:
    """Pids of nginx master's workers that accept connections (not those shutting down after a reload)."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            title = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, ValueError):
            continue
        if ppid == master and title == "nginx: worker process":
            found.add(int(name))
    return found


@pytest.mark.xdist_group("nginx")
@pytest.mark.cluster
def test_stop_stops_nginx_and_watcher_then_deploy_starts_nginx(nginx_front):
    inventory, deploy, st = nginx_front
    s = status_json(inventory)
    pids = [s["nginx"]["pid"], s["nginx"]["watcher_pid"]]
    r = inv("stop", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]
                   for p in pids)
    assert status_json(inventory)["front"] is None
    r = inv("deploy", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    after = status_json(inventory)
    assert after["front"] == "nginx" and not after["proxy"]["pid"]


@pytest.mark.xdist_group("nginx")
@pytest.mark.cluster
def test_trace_and_logs_use_the_access_log_in_nginx_mode(nginx_front):
    """nginx writes no results log: `inv trace` finds a request by its X-Request-Id in nginx's JSON
    access log, and `inv logs` shows that log and says why."""
    inventory, deploy, st = nginx_front
    port = status_json(inventory)["proxy"]["port"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat()),
                 {"Content-Type": "application/json", "X-Request-Id": "rid-nginx-7"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("X-Request-Id") == "rid-nginx-7"
    r.read()
    conn.close()
    access = deploy / "logs" / "nginx_access.log"
    wait_until(lambda: access.exists() and "rid-nginx-7" in access.read_text(), what="the access-log line")
    t = inv("trace", "rid-nginx-7", "--host", "t", inventory=inventory)
    assert t.returncode == 0, t.stdout + t.stderr
    assert "request rid-nginx-7" in t.stdout and "status 200" in t.stdout and "attempt nginx" in t.stdout
    lg = inv("logs", "--host", "t", "-n", "5", inventory=inventory)
    assert "runs nginx as its front" in lg.stdout and "rid-nginx-7" in lg.stdout


def test_watcher_rotates_the_access_log(tmp_path):
    """The access log rotates like the results log (max_mb x backups): the seed's reached 769 MB."""
    from hostagent import watch
    log = tmp_path / "nginx_access.log"
    cfg = {"access_log": str(log), "access_log_max_mb": 0.001, "access_log_backups": 2,
           "pid_file": str(tmp_path / "nginx.pid"), "deployment_id": "t-0"}
    for n in range(4):
        log.write_text(f"{n}\n" * 600)
        assert watch.rotate_access_log(cfg)
    assert (tmp_path / "nginx_access.log.1").read_text().startswith("3\n")
    assert (tmp_path / "nginx_access.log.2").read_text().startswith("2\n")
    assert not (tmp_path / "nginx_access.log.3").exists() and log.read_text() == ""
    assert stat.S_IMODE(log.stat().st_mode) == 0o600     # made before nginx reopens it (nginx's own is 0644)
    log.write_text("small\n")
    assert not watch.rotate_access_log(cfg)
