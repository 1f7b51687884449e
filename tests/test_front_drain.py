"""The front under load when it changes: a proxy restart beside the running proxy refuses no connection
and fails no request; `inv stop` drains the front first, so no accepted request fails within the bound,
and past the bound the cut requests are counted and named."""
from __future__ import annotations

import http.client
import json
import re
import sys
import time
from collections import Counter

import pytest

from conftest import ROOT, http_status, require_tool, wait_until

from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory

sys.path.insert(0, str(ROOT / "scripts"))
from swap_under_load import Load  # noqa: E402


MODEL = "Test-Model"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def cluster(tmp_path):
    """A deployed 4-instance sim cluster behind the proxy; stopped and swept by tag whatever happens."""
    inventory = write_inventory(tmp_path, max_num_seqs=8, sim="{load_s: 0.3, prefill_ms: 10, token_ms: 5, output_tokens: 5000}")
    dep = deployment_id(inventory)
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        yield inventory, tmp_path / "deploy", status_json(inventory)
    finally:
        inv("stop", "--host", "t", "--now", inventory=inventory)
        kill_tagged(dep + "/")


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_proxy_restart_under_load_refuses_nothing(cluster):
    """1. 12 clients open a new connection per request and 12 keep theirs alive, closed loop, never
    retrying, each request about 0.5 s (100 tokens): 24 in flight at any moment, not as many requests as
    the two cores can make (that load would only slow the suite's other tests). 2. `inv deploy --set proxy.max_body_mb=32` (a restart-only setting): the new proxy starts
    beside the old, is confirmed, the old one drains. 3. Deploy again without the override: a second
    restart, after the first left its steering program on the port. 4. Not one connection refused, not
    one request failed, each restart replaced the pid, the old proxy is gone and the new one answers on
    the admin port."""
    inventory, deploy, st = cluster
    port = st["proxy"]["port"]
    pids = [st["proxy"]["pid"]]
    spans, outputs = [], []
    with Load(port, MODEL, clients=12, max_tokens=100) as fresh, \
            Load(port, MODEL, clients=12, keepalive=True, max_tokens=100) as kept:
        for sets in (["--set", "proxy.max_body_mb=32"], []):
            # each load has 50 answers from the proxy about to be replaced (or the one before it)
            _answered_more(fresh, kept, 50)
            t0 = time.monotonic()
            r = inv("deploy", "--host", "t", *sets, inventory=inventory)
            spans.append((t0, time.monotonic()))
            assert r.returncode == 0, r.stdout + r.stderr
            outputs.append(r.stdout)
            pids.append(status_json(inventory, *sets)["proxy"]["pid"])
        _answered_more(fresh, kept, 50)   # and from the last proxy
    during = [sum(1 for load in (fresh, kept) for t, _ in load.failures if a <= t <= b) for a, b in spans]
    print(f"\nproxy restarts under load: new connections {fresh.total} requests {dict(fresh.outcomes)}; "
          f"kept-alive {kept.total} requests {dict(kept.outcomes)}; failed during the restarts {during}")
    for out in outputs:
        assert re.search(r"restarted beside the old one on :\d+, pid \d+ -> \d+: the port refused no "
                         r"connection", out), out
    assert fresh.outcomes["refused"] == 0 and kept.outcomes["refused"] == 0
    assert fresh.failed == 0 and kept.failed == 0, (fresh.outcomes, kept.outcomes)
    assert fresh.total > 100 and kept.total > 100
    assert len(set(pids)) == 3 and not any(alive(p) for p in pids[:2]), pids
    st = status_json(inventory)
    assert st["proxy"]["state"] == "healthy" and st["proxy"]["backends"] is not None
    assert not (deploy / "run" / "proxy.next.pid").exists()
    log = (deploy / "logs" / "proxy.log").read_text()   # both proxies append to it; each old one drained
    assert log.count("stopping: no new connections") == 2 and log.count("drained in") == 2, log[-3000:]


def results_log(deploy) -> dict[str, dict]:
    """Trace id -> the proxy's final results-log line for that request."""
    lines = []
    for path in sorted((deploy / "logs").glob("req_results.log*")):
        lines += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {x["trace_id"]: x for x in lines if x.get("final")}


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_stop_under_load_fails_no_accepted_request(cluster):
    """1. 8 clients with a new connection per request and 8 with kept-alive ones send ~0.5 s requests
    (4 instances x 8 seqs: every request runs at once), each with its own trace id. 2. `inv stop` while
    they run. 3. It drains first, with progress, and says the requests in flight finished. 4. Every
    request the proxy accepted (its results log) answered 200, and the client got that 200; the others
    never reached the proxy (the port refused them, or reset them from its accept queue) and failed
    without an answer."""
    inventory, deploy, st = cluster
    port = st["proxy"]["port"]
    with Load(port, MODEL, 8, max_tokens=100) as fresh, Load(port, MODEL, 8, True, 100) as kept:
        wait_until(lambda: sum(_running(i["port"]) for i in st["instances"]) >= 8, what="8 requests running")
        t0 = time.monotonic()
        r = inv("stop", "--host", "t", inventory=inventory)
        took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    accepted = results_log(deploy)
    outcomes = fresh.records + kept.records
    at_stop = [(trace, o) for trace, o, t in outcomes if t >= t0]
    print(f"\nstop under load: {len(outcomes)} requests, {len(at_stop)} ended during the stop ({took:.1f}s); "
          f"outcomes {dict(Counter(o for _, o in at_stop))}")
    assert {x["status"] for x in accepted.values()} == {200}, Counter(x["status"] for x in accepted.values())
    for trace, outcome, _ in outcomes:
        if trace in accepted:
            assert outcome == "ok proxy", (trace, outcome)
        else:
            assert outcome in ("refused", "ConnectionResetError", "RemoteDisconnected", "BrokenPipeError"), \
                (trace, outcome)
    m = re.search(r"drain: the proxy finished its requests in flight \((\d+) when it stopped accepting\) in "
                  r"([\d.]+)s$", r.stdout, re.M)
    assert m, r.stdout
    # requests were in flight when it stopped accepting, and none was cut (how many is the load's moment: 8
    # seen running before the stop, 7 left when its drain began in one fresh-clone run)
    assert int(m.group(1)) >= 1 and "cut request" not in r.stdout
    assert re.search(r"^t : .*failed=0", r.stdout, re.M)
    assert sum(1 for _, o in at_stop if o == "ok proxy") >= 8
    assert status_json(inventory)["front"] is None


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_stop_one_instance_under_load_drains_it_first(cluster):
    """1. `--check` says instance 0 would be drained. 2. 8 clients with new connections and 8 with
    kept-alive ones send ~0.5 s requests. 3. `inv stop --instance 0` while they run: the proxy stops
    sending it requests, those in flight on it finish, then it is stopped. 4. Not one request failed.
    5. The backend is enabled again (its health check, not a drain, keeps it out), so `inv deploy`
    brings it back into service with nothing more."""
    inventory, deploy, st = cluster
    port = st["proxy"]["port"]
    backend = f"127.0.0.1:{st['instances'][0]['port']}"
    check = inv("stop", "--host", "t", "--instance", "0", "--check", inventory=inventory)
    assert "would drain it in the proxy and wait up to 60s (drain_timeout_s)" in check.stdout, check.stdout
    with Load(port, MODEL, 8, max_tokens=100) as fresh, Load(port, MODEL, 8, True, 100) as kept:
        wait_until(lambda: _running(st["instances"][0]["port"]) > 0, what="requests running on instance 0")
        r = inv("stop", "--host", "t", "--instance", "0", inventory=inventory)
        _answered_more(fresh, kept, 16)   # the others go on answering once it has stopped
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"\nstop --instance 0 under load: {dict(fresh.outcomes)} {dict(kept.outcomes)}")
    assert fresh.failed == 0 and kept.failed == 0, (fresh.outcomes, kept.outcomes)
    assert re.search(rf"^instance 0: drained {backend} in [\d.]+s$", r.stdout, re.M), r.stdout
    assert fresh.total > 16 and kept.total > 16
    st = status_json(inventory)
    assert [i["state"] for i in st["instances"]] == ["stopped", "healthy", "healthy", "healthy"]
    b0 = next(b for b in st["proxy"]["backends"] if b["name"] == backend)
    assert not b0["drained"], b0
    again = inv("deploy", "--host", "t", inventory=inventory)
    assert again.returncode == 0, again.stdout + again.stderr
    wait_until(lambda: next(b for b in status_json(inventory)["proxy"]["backends"]
                            if b["name"] == backend)["healthy"], what="instance 0 back in the proxy")


@pytest.mark.xdist_group("load")
@pytest.mark.cluster
def test_stop_past_the_drain_bound_names_the_cut_requests(cluster):
    """1. `--check` says the front would be drained. 2. Four ~20 s streams run, each with a known request
    id. 3. `inv stop --set drain_timeout_s=2`: the proxy stops accepting, prints its progress, and after
    2 s cuts the four streams and names each. 4. `--now` on a running cluster skips the drain."""
    inventory, deploy, st = cluster
    port = st["proxy"]["port"]
    check = inv("stop", "--host", "t", "--check", inventory=inventory)
    assert "would stop the proxy taking requests and wait up to 60s (drain_timeout_s)" in check.stdout, check.stdout
    with Load(port, MODEL, 4, True, 4000, stream=True) as streams:
        wait_until(lambda: sum(b["in_flight"] for b in status_json(inventory)["proxy"]["backends"]) == 4,
                   what="4 streams in flight")
        streams.stop.set()     # each client ends with the stream it has running
        r = inv("stop", "--host", "t", "--set", "drain_timeout_s=2", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    traces = {trace for trace, _, _ in streams.records}
    named = set(re.findall(r"^t: drain: cut request (\w+) \(trace (\w+), /v1/chat/completions\) on 127\.0\.0\.1:\d+: "
                           r"in flight for [\d.]+s, past the 2s bound$", r.stdout, re.M))
    assert len(named) == 4 and {a for a, b in named} == {b for a, b in named} <= traces, r.stdout
    assert re.search(r"^t: drain: 4 request\(s\) in flight at the proxy, 1s of 2s$", r.stdout, re.M), r.stdout
    assert re.search(r"^t: drain: the proxy finished its requests in flight \(4 when it stopped accepting\) in "
                     r"[\d.]+s, but 4, cut at the 2s bound \(named above\)$", r.stdout, re.M), r.stdout
    assert len(streams.records) == 4 and not any(o.startswith("ok") for _, o, _ in streams.records), streams.records
    logged = results_log(deploy)
    assert all(logged[t]["status"] == 499 and logged[t]["error"].startswith("cut: still in flight")
               for t in traces), [logged.get(t) for t in traces]

    again = inv("deploy", "--host", "t", inventory=inventory)
    assert again.returncode == 0, again.stdout + again.stderr
    now = inv("stop", "--host", "t", "--now", inventory=inventory)
    assert now.returncode == 0 and "drain: the proxy" not in now.stdout, now.stdout
    assert "skipped: drain: --now: no drain; requests in flight are cut" in now.stdout, now.stdout
    assert status_json(inventory)["front"] is None


@pytest.mark.cluster
def test_stop_in_nginx_mode_lets_streams_finish(cluster):
    """1. nginx is the front; four ~10 s streams run. 2. `inv stop`: the watcher stops, nginx quits
    gracefully, the stop waits for it; only then are the instances stopped. 3. Every stream ends with
    [DONE]."""
    require_tool("nginx")
    inventory, deploy, st = cluster
    r = inv("swap-to-nginx", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    port = st["proxy"]["port"]
    with Load(port, MODEL, 4, max_tokens=2000, stream=True) as streams:
        wait_until(lambda: not streams.records and
                   sum(_running(i["port"]) for i in st["instances"]) == 4, what="4 streams running")
        streams.stop.set()
        r = inv("stop", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^t: drain: nginx pid \d+ quits gracefully", r.stdout, re.M), r.stdout
    # A line a second while it waits (the first at 1 s, or later on a busy machine's late wake-up).
    assert re.search(r"^t: drain: 4 request\(s\) in flight at the instances, \d+s of 60s$", r.stdout, re.M), r.stdout
    assert re.search(r"^t: drain: nginx finished its requests and exited in [\d.]+s$", r.stdout, re.M), r.stdout
    assert [o for _, o, _ in streams.records] == ["ok nginx"] * 4, streams.records


def _answered_more(fresh, kept, n: int) -> None:
    """Wait until each load has had n more answers (200s) than it had when called."""
    before = [load.outcomes["ok proxy"] for load in (fresh, kept)]
    wait_until(lambda: all(load.outcomes["ok proxy"] >= b + n for load, b in zip((fresh, kept), before)),
               what=f"{n} more answers on each load")


def _running(port: int) -> int:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/stats", timeout=5) as r:
        return json.loads(r.read())["running"]


@pytest.mark.process
def test_drain_and_exit_refuses_another_pid_then_cuts_the_stream_still_running_at_its_bound(tmp_path, procs):
    """The proxy's drain call on its own: 1. a request with a known id is listed by GET /admin/requests;
    2. drain-and-exit naming another pid is refused (409) and changes nothing; 3. with the proxy's own
    pid and a bound of 0.5 s, the port refuses new connections at once, the call answers after the
    bound naming the request it cut, and the proxy exits 0."""
    from proxy_helpers import start_proxy, start_sims
    ports = start_sims(procs, tmp_path, 1, token_ms=20)
    port, admin = start_proxy(procs, tmp_path, ports)
    proxy = procs.started[-1]

    def call(method, path, body=None, timeout=10):
        conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=timeout)
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())

    stream = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    stream.request("POST", "/v1/chat/completions", json.dumps({
        "model": "m", "max_tokens": 150, "stream": True, "user": "job-17",
        "messages": [{"role": "user", "content": "hi"}]}), {"Content-Type": "application/json",
                                                            "X-Request-Id": "rid-17"})
    stream.getresponse()
    listed = wait_until(lambda: call("GET", "/admin/requests")[1], what="the stream listed")
    assert [(r["request_id"], r["trace_id"], r["backend"]) for r in listed] == \
        [("rid-17", "job-17", f"127.0.0.1:{ports[0]}")]
    status, body = call("GET", "/admin/config")
    pid = body["pid"]
    assert pid == proxy.pid
    status, body = call("POST", "/admin/drain-and-exit", {"timeout_s": 0.5, "pid": pid + 1})
    assert status == 409 and f"this proxy is pid {pid}" in body["error"]["message"]
    assert http_status(f"http://127.0.0.1:{port}/health") == 200
    assert call("POST", "/admin/drain-and-exit", {"timeout_s": -1})[0] == 400

    status, body = call("POST", "/admin/drain-and-exit", {"timeout_s": 0.5, "pid": pid})
    assert status == 200 and body["pid"] == pid and body["in_flight_at_start"] == 1
    assert [(c["request_id"], c["trace_id"]) for c in body["cut"]] == [("rid-17", "job-17")]
    assert body["bound_s"] == 0.5 and body["waited_s"] >= body["bound_s"]   # cut at its bound, not before
    assert http_status(f"http://127.0.0.1:{port}/health") is None
    assert proxy.wait(timeout=10) == 0
    stream.close()


@pytest.mark.process
def test_steering_sends_new_connections_to_the_listener_taking_over():
    """proxy.listener on two sockets sharing a port: 1. the kernel spreads connections over both;
    2. once the first (index 0) steers away, every new connection goes to the second, so the first can
    close with an empty accept queue; 3. stop_steering puts the spreading back."""
    import socket
    from proxy.listener import listen_socket, queued, steer_away, stop_steering

    first = listen_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    second = listen_socket("127.0.0.1", port, reuse_port=True)

    def spread(n=40) -> tuple[int, int]:
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
        counts = []
        for s in (first, second):
            got = 0
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                got += 1
            counts.append(got)
        for c in clients:
            c.close()
        return tuple(counts)
    try:
        a, b = spread()
        assert a + b == 40 and a > 0 and b > 0, (a, b)
        assert steer_away(first)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        assert queued(first) == 0 and queued(second) == 5
        for c in clients:
            c.close()
        while queued(second):
            second.accept()[0].close()
        assert spread() == (0, 40)
        stop_steering(second)
        a, b = spread()
        assert a > 0 and b > 0, (a, b)
    finally:
        first.close()
        second.close()


@pytest.mark.cluster
def test_a_new_proxy_that_does_not_come_up_leaves_the_old_one_serving(cluster, tmp_path):
    """1. A restart-only setting changes together with an API key file that does not exist: the running
    proxy refuses the reload, so deploy restarts it; the new proxy exits at once. 2. The deploy fails
    saying so and naming the running proxy, which was never signalled: same pid, still answering, still
    on the admin port; no run/proxy.next.pid is left."""
    inventory, deploy, st = cluster
    port, pid = st["proxy"]["port"], st["proxy"]["pid"]
    # --no-doctor: the doctor would refuse the missing key file before anything starts (its own test);
    # here the new proxy itself must exit at start.
    r = inv("deploy", "--host", "t", "--no-doctor", "--set", "proxy.max_body_mb=32", "--set",
            f"proxy.api_keys_file={tmp_path / 'no-such-keys'}", inventory=inventory)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(rf"FAILED: proxy: the new proxy exited \(logs/proxy.log: .*no-such-keys.*\); the running "
                     rf"proxy \(pid {pid}\) keeps the port\.", r.stderr), r.stdout + r.stderr
    assert alive(pid) and http_status(f"http://127.0.0.1:{port}/health") == 200
    after = status_json(inventory)
    assert after["proxy"]["pid"] == pid and after["proxy"]["backends"] is not None
    assert not (deploy / "run" / "proxy.next.pid").exists()


@pytest.mark.cluster
def test_a_proxy_restart_keeps_the_operators_drains(cluster):
    """1. The operator drains instance 2 in the proxy (to keep it out of service). 2. A deploy restarts
    the proxy (a restart-only setting). 3. The new proxy has instance 2 drained too, and says so."""
    inventory, deploy, st = cluster
    admin = st["proxy"]["port"] + 1
    name = f"127.0.0.1:{st['instances'][2]['port']}"
    conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=5)
    conn.request("POST", f"/admin/backends/{name}/drain")
    assert conn.getresponse().status == 200
    r = inv("deploy", "--host", "t", "--set", "proxy.max_body_mb=32", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"keeps {name} drained" in r.stdout, r.stdout
    after = status_json(inventory, "--set", "proxy.max_body_mb=32")
    assert after["proxy"]["pid"] != st["proxy"]["pid"]
    drained = {b["name"]: b["drained"] for b in after["proxy"]["backends"]}
    assert drained[name] is True and sum(drained.values()) == 1, drained
