"""The keeper's decisions (hostagent/keeper_decisions.py) and the loop that carries them out, on plain data
and fakes: no process, no sleep. The end-to-end tests in test_keeper.py prove the wiring on a real cluster."""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from conftest import wait_until
from hostagent import instances, keeper
from hostagent.keeper_decisions import (Crashloop, Log, MarkReady, Observed, Probe, Restart, Watch, begin_restart,
                                        decide, end_restart, lock_refused, probe_result)

pytestmark = pytest.mark.unit

K = {"dead_after_s": 3, "backoff_base_s": 1, "backoff_max_s": 4, "max_restarts": 3, "window_s": 120,
     "stall_probe": False, "probe_interval_s": 0.5, "probe_timeout_s": 1, "probe_failures": 2}
HEALTH_TIMEOUT_S = 60
START = ("pid=100 pgid=100 sid=100 start=5 tag=d/0", 1)


def up(**kw) -> Observed:
    """A running instance of the start START, healthy unless told otherwise."""
    return Observed(**{"identity": START, "alive": True, "health": 200, "age_s": 10.0, **kw})


def run(w: Watch, rounds, k=K, t0=0.0, step=0.5, busy=False):
    """Drive decide over observations, one round each `step` seconds; (last watch, every action)."""
    actions = []
    for n, obs in enumerate(rounds):
        w, acts = decide(w, obs, t0 + n * step, 1000.0 + n * step, k, HEALTH_TIMEOUT_S, busy)
        actions += acts
    return w, actions


def kinds(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def messages(actions):
    return [a.message for a in actions if isinstance(a, Log)]


def dead_until_restart(w: Watch, now: float, wall: float, k=K, **kw):
    """Decide on a dead ("exited") instance until a Restart comes; (watch, wait before the restart)."""
    obs = up(alive=False, health=None, **kw)
    w, acts = decide(w, obs, now, wall, k, HEALTH_TIMEOUT_S)
    assert not kinds(acts, Restart) or k["backoff_base_s"] == 0
    wait = w.restart_at - now
    w, acts = decide(w, obs, now + wait, wall + wait, k, HEALTH_TIMEOUT_S)
    assert kinds(acts, Restart) == [Restart(w.index, "exited")], acts
    return w, wait


# --- the states, shared with inv status ------------------------------------------------------------

@pytest.mark.parametrize("facts, expected", [
    ({"alive": True, "pidfile": True, "health": 200, "was_ready": False, "age_s": 1}, ("healthy", None)),
    ({"alive": True, "pidfile": True, "health": 503, "was_ready": False, "age_s": 1}, ("loading", None)),
    ({"alive": True, "pidfile": True, "health": None, "was_ready": False, "age_s": 59}, ("loading", None)),
    ({"alive": True, "pidfile": True, "health": 503, "was_ready": False, "age_s": 61}, ("dead", "start-timeout")),
    ({"alive": True, "pidfile": True, "health": 503, "was_ready": True, "age_s": 1}, ("dead", "unhealthy")),
    ({"alive": False, "pidfile": True, "health": None, "was_ready": True, "age_s": 1}, ("dead", "exited")),
    ({"alive": False, "pidfile": False, "health": None, "was_ready": False, "age_s": None}, ("stopped", None)),
    ({"alive": False, "pidfile": False, "health": 200, "was_ready": False, "age_s": None, "listening": True},
     ("port-taken", None)),
    ({"alive": False, "pidfile": True, "health": 200, "was_ready": False, "age_s": 3, "listening": True},
     ("port-taken", "exited")),
])
def test_classify_names_the_status_states(facts, expected):
    """The one classification: inv status's states (loading, healthy, dead, stopped, port-taken) and why
    an instance is dead, as the keeper counts it."""
    assert instances.classify(health_timeout_s=HEALTH_TIMEOUT_S, **facts) == expected
    assert expected[0] in instances.STATES


def test_status_and_keeper_agree_on_a_slow_start():
    """An instance loading for longer than health_timeout_s: status says dead, the keeper restarts it for
    start-timeout; before that, both say loading (never start-timeout beside loading)."""
    w, acts = run(Watch(0), [up(health=503, age_s=59.0)])
    assert w.state == "loading" and not acts
    assert instances.classify(True, True, 503, False, 59.0, HEALTH_TIMEOUT_S)[0] == "loading"
    w, acts = run(w, [up(health=503, age_s=61.0)])
    assert w.dead_reason == "start-timeout" and w.state.startswith("dead (start-timeout)")
    assert instances.classify(True, True, 503, False, 61.0, HEALTH_TIMEOUT_S) == ("dead", "start-timeout")


def test_a_loading_instance_is_never_dead():
    """/health 503 or no answer for as long as health_timeout_s allows: loading, no restart."""
    rounds = [up(health=h, age_s=a) for a in range(0, 60, 2) for h in (503, None)]
    w, acts = run(Watch(0), rounds, step=2)
    assert w.state == "loading" and w.dead_reason is None and not kinds(acts, Restart)


# --- dead: exited, unhealthy, stalled ------------------------------------------------------------

def test_an_exited_instance_is_restarted_after_its_backoff():
    """Gone: dead ("exited") at once, restart 1 after backoff_base_s, said in the log; not before."""
    obs = up(alive=False, health=None)
    w, acts = decide(Watch(0, identity=START), obs, 10.0, 1000.0, K, HEALTH_TIMEOUT_S)
    assert w.state == "dead (exited), restart in 1s" and w.restart_at == 11.0
    assert messages(acts) == ["instance 0: dead (exited); restart 1 in 1s"] and not kinds(acts, Restart)
    w, acts = decide(w, obs, 10.9, 1000.9, K, HEALTH_TIMEOUT_S)
    assert not acts
    w, acts = decide(w, obs, 11.0, 1001.0, K, HEALTH_TIMEOUT_S)
    assert acts == [Restart(0, "exited")] and w.state == "restarting"


def test_unhealthy_only_after_dead_after_s():
    """Healthy once, then /health fails: "unhealthy" while under dead_after_s (3 s), dead after it; a
    200 in between starts the count again."""
    w, acts = run(Watch(0), [up()])
    assert acts == [MarkReady(0)] and w.healthy_once
    w, acts = run(w, [up(health=None)] * 6, t0=1.0)          # 1.0 .. 3.5: 2.5 s unhealthy
    assert w.state == "unhealthy" and not acts
    w, acts = run(w, [up()], t0=4.0)                          # healthy again: the count starts over
    assert w.unhealthy_since is None and w.state == "healthy"
    w, acts = run(w, [up(health=503)] * 7, t0=5.0)            # 5.0 .. 8.0: 3 s unhealthy
    assert w.dead_reason == "unhealthy"
    assert messages(acts) == ["instance 0: dead (unhealthy); restart 1 in 1s"]


def test_a_ready_marker_makes_a_503_a_death_after_a_keeper_restart():
    """The keeper restarted (no memory): run/instance_<i>.ready says the start was healthy once, so a 503 is
    unhealthy (dead after dead_after_s), not loading."""
    w, _ = run(Watch(0), [up(health=503, ready=True)])
    assert w.healthy_once and w.state == "unhealthy"


def test_stalled_after_probe_failures_timeouts_and_busy_is_not_stalled():
    """With the stall probe on: a probe every probe_interval_s while healthy; probe_failures timeouts in a
    row (no token generated) make it dead ("stalled"); a timeout while tokens flowed is "busy" and resets
    the count; an HTTP error is an answer."""
    k = {**K, "stall_probe": True}
    w, acts = decide(Watch(0), up(), 0.0, 1000.0, k, HEALTH_TIMEOUT_S)
    assert kinds(acts, Probe) == [Probe(0)] and w.next_probe == 0.5
    w, acts = decide(w, up(probing=True), 0.6, 1000.6, k, HEALTH_TIMEOUT_S)
    assert not kinds(acts, Probe), "one probe at a time"
    w, acts = decide(w, up(probe=("timeout", 5.0, 5.0)), 0.7, 1000.7, k, HEALTH_TIMEOUT_S)
    assert w.probe_failures == 1 and "stall probe timed out (1/2)" in messages(acts)[0]
    w, acts = decide(w, up(probe=("timeout", 5.0, 9.0)), 1.2, 1001.2, k, HEALTH_TIMEOUT_S)   # busy
    assert w.probe_failures == 0 and w.probes == {"timeout": 1, "busy": 1} and w.dead_reason is None
    for n, outcome in enumerate([("timeout", None, None), ("error", None, None)]):
        w, acts = decide(w, up(probe=outcome), 2.0 + n, 1002.0 + n, k, HEALTH_TIMEOUT_S)
    assert w.probe_failures == 1 and w.dead_reason is None, "an error answer neither counts nor resets"
    w, acts = decide(w, up(probe=("timeout", 9.0, 9.0)), 6.0, 1006.0, k, HEALTH_TIMEOUT_S)
    assert w.dead_reason == "stalled" and "stall probe timed out (2/2)" in messages(acts)[0]
    assert w.probes == {"timeout": 3, "busy": 1, "error": 1}


def test_a_probe_timeout_with_tokens_generated_meanwhile_is_busy_not_stalled():
    """A probe that timed out while the engine's generated-token counter moved is "busy"; one whose
    counter stood still, or is unknown, is "timeout"; answers are "ok" or "error" whatever the counter."""
    assert probe_result("ok", None, None) == "ok" and probe_result("error", 1.0, None) == "error"
    assert probe_result("timeout", 1.0, 2.0) == "busy"
    assert probe_result("timeout", 1.0, 1.0) == probe_result("timeout", None, 2.0) == "timeout"


# --- backoff, window, crash loop ---------------------------------------------------------------------

def test_backoff_grows_and_is_capped_then_crashloop_after_max_restarts():
    """Each death within window_s waits backoff_base_s * 2^k (k: restarts in the window), at most
    backoff_max_s; dead again after max_restarts: crashloop, said once, and no restart after it."""
    k = {**K, "backoff_base_s": 0.3, "backoff_max_s": 1, "max_restarts": 4}
    w, now, wall, waits = Watch(0, identity=START), 0.0, 1000.0, []
    for n in range(4):
        w, wait = dead_until_restart(w, now, wall, k)
        waits.append(round(wait, 3))
        w = begin_restart(w, wall + wait)
        start = (f"pid={200 + n}", n + 2)          # what the restart started
        w = end_restart(w, "ok", start, now + wait + 1, k)
        now, wall = now + wait + 2, wall + wait + 2
    assert waits == [0.3, 0.6, 1, 1], waits               # 0.3, 0.6, 1.2 capped at 1, 2.4 capped
    assert w.restarts == 4 and w.by_reason == {"exited": 4} and len(w.recent) == 4
    obs = Observed(identity=start, alive=False)
    w, acts = decide(w, obs, now, wall, k, HEALTH_TIMEOUT_S)
    assert acts == [Crashloop(0, "exited", 4)] and w.crashloop and w.state == "crashloop"
    assert w.crashloop_identity == start
    w, acts = run(w, [obs] * 20, k, t0=now, step=1)
    assert not acts and w.state == "crashloop" and w.restarts == 4


def test_restarts_older_than_the_window_do_not_count():
    """Only restarts within window_s count for the backoff and the crash loop."""
    w = Watch(0, identity=START, recent=[1.0, 2.0, 3.0], restarts=3)       # max_restarts is 3
    w, acts = decide(w, up(alive=False, health=None), 0.0, 1000.0, K, HEALTH_TIMEOUT_S)   # all > 120 s ago
    assert not kinds(acts, Crashloop) and w.recent == [] and w.restart_at == 1.0
    w = Watch(0, identity=START, recent=[990.0, 995.0, 999.0], restarts=3)
    w, acts = decide(w, up(alive=False, health=None), 0.0, 1000.0, K, HEALTH_TIMEOUT_S)
    assert acts == [Crashloop(0, "exited", 3)]


def test_a_new_pid_file_clears_crashloop():
    """Someone else started it (inv restart, inv deploy: another pid file): crashloop cleared, the window
    starts empty; the same pid file read again changes nothing."""
    w = Watch(0, identity=START, crashloop=True, crashloop_identity=list(START), recent=[999.0] * 3, restarts=3)
    w, acts = decide(w, up(alive=False), 0.0, 1000.0, K, HEALTH_TIMEOUT_S)
    assert w.crashloop and w.state == "crashloop" and not acts
    w, acts = decide(w, up(identity=("pid=300", 9)), 1.0, 1001.0, K, HEALTH_TIMEOUT_S)
    assert not w.crashloop and w.recent == [] and w.state == "healthy" and w.restarts == 3
    assert "crashloop cleared" in messages(acts)[0]


def test_a_restored_watch_keeps_its_crashloop_across_a_keeper_restart():
    """run/keeper.json carries the crash loop: a new keeper does not restart it while its pid file is the one
    that crash-looped."""
    w = Watch.restore(0, json.loads(json.dumps(Watch(0, crashloop=True, crashloop_identity=list(START),
                                                     restarts=3, recent=[999.0] * 3).record(0.0))))
    w, acts = decide(w, up(alive=False), 0.0, 1000.0, K, HEALTH_TIMEOUT_S)
    assert w.crashloop and w.state == "crashloop" and not acts


# --- left alone -----------------------------------------------------------------------------------

def test_a_drained_dead_instance_is_left_alone():
    """The operator drained it: dead or not, the keeper does not restart it."""
    w, acts = run(Watch(0, identity=START), [up(alive=False, health=None, drained=True)] * 20, step=1)
    assert w.state == "dead (exited), drained by the operator: left alone" and not acts and w.restarts == 0
    w, _ = run(w, [up(drained=True)])
    assert w.state == "healthy, drained"


def test_a_stopped_instance_is_left_alone():
    """No pid file (inv stop --instance): stopped, whatever was known of it."""
    w = Watch(0, identity=START, dead_reason="exited", restart_at=5.0)
    w, acts = run(w, [Observed(identity=None)] * 10, step=1)
    assert w.state == "stopped" and w.dead_reason is None and w.restart_at is None and not acts


def test_one_restart_at_a_time():
    """While another instance is being restarted, a due restart waits."""
    w = Watch(0, identity=START)
    w, _ = decide(w, up(alive=False), 0.0, 1000.0, K, HEALTH_TIMEOUT_S)
    w, acts = decide(w, up(alive=False), 5.0, 1005.0, K, HEALTH_TIMEOUT_S, busy=True)
    assert not kinds(acts, Restart)
    w, acts = decide(w, up(alive=False), 5.5, 1005.5, K, HEALTH_TIMEOUT_S)
    assert kinds(acts, Restart)


def test_a_refused_lock_counts_no_restart():
    """The restart found the run lock held: nothing counted, the state says why, and the next round asks
    for the restart again."""
    w = Watch(0, identity=START)
    w, _ = decide(w, up(alive=False), 0.0, 1000.0, K, HEALTH_TIMEOUT_S)
    w, acts = decide(w, up(alive=False), 1.0, 1001.0, K, HEALTH_TIMEOUT_S)
    assert acts == [Restart(0, "exited")]
    w = lock_refused(w)
    assert w.restarts == 0 and w.recent == [] and "waiting: the run lock is held" in w.state
    w, acts = decide(w, up(alive=False), 1.5, 1001.5, K, HEALTH_TIMEOUT_S)
    assert acts == [Restart(0, "exited")]


def test_recovered_before_its_restart():
    w, _ = decide(Watch(0, identity=START), up(alive=False), 0.0, 1000.0, K, HEALTH_TIMEOUT_S)
    w, acts = decide(w, up(), 0.5, 1000.5, K, HEALTH_TIMEOUT_S)
    assert w.dead_reason is None and w.restart_at is None and "recovered before its restart" in messages(acts)[0]


# --- the loop, on fakes -------------------------------------------------------------------------------

class FakeKeeper(keeper.Keeper):
    """The real loop with the host replaced: observations from a table, a lock that may be held, a restart
    that records its call, a clock the test moves."""

    def __init__(self, tmp_path, n=2, k=K):
        (tmp_path / "run").mkdir(exist_ok=True)
        self.t = 0.0
        cfg = {"deploy_dir": str(tmp_path), "deployment_id": "d", "keeper": k, "health_interval_s": 0.5,
               "health_timeout_s": HEALTH_TIMEOUT_S, "stop_grace_s": 1, "admin_port": 1,
               "instances": [{"index": i, "port": 9000 + i, "backend": f"127.0.0.1:{9000 + i}"} for i in range(n)]}
        super().__init__(cfg, _clock=lambda: self.t, _wall=lambda: 1000.0 + self.t)
        self.seen = {i: up() for i in range(n)}
        self.lock_free, self.restarted, self.drained = True, [], {}

    def observe(self, i):
        return Observed(**vars(self.seen[i]))

    def backends(self):
        return {f"127.0.0.1:{9000 + i}": {"drained": d} for i, d in self.drained.items()}

    def try_lock(self, what):
        class Held:
            def release(self):
                pass
        return Held() if self.lock_free else None

    def restart(self, i):
        self.restarted.append(i)
        return [{"name": f"instance {i}", "status": "changed", "message": "started"}]

    def tick(self, seconds=0.5):
        self.t += seconds
        self.round()
        if self.worker is not None:
            self.worker.join(5)


def test_the_loop_restarts_a_dead_instance_once(tmp_path):
    """The keeper's loop carries out decide's actions: the restart runs under the lock, is counted, and its
    result recorded; keeper.json and keeper.prom say so."""
    kp = FakeKeeper(tmp_path)
    kp.tick()
    kp.seen[1] = up(alive=False, health=None)
    for _ in range(4):
        kp.tick()
    assert kp.restarted == [1]
    w = kp.watches[1]
    assert w.restarts == 1 and w.by_reason == {"exited": 1} and w.last_result == "ok" and kp.restarting is None
    kp.write_state()
    saved = json.loads((tmp_path / "run" / "keeper.json").read_text())
    assert saved["instances"]["1"]["restarts"] == 1 and saved["instances"]["0"]["state"] == "healthy"
    assert 'instance="1",reason="exited"} 1' in (tmp_path / "run" / "keeper.prom").read_text()
    assert (tmp_path / "run" / "instance_0.ready").exists()


def test_the_lock_held_means_no_action(tmp_path):
    """Another run holds the deployment's lock (deploy, stop, restart, swap): the due restart is not done,
    not counted, the state says why, keeper.json says lock_held; once the lock is free it is done."""
    kp = FakeKeeper(tmp_path)
    kp.seen[0] = up(alive=False, health=None)
    kp.lock_free = False
    for _ in range(10):
        kp.tick()
    w = kp.watches[0]
    assert kp.restarted == [] and w.restarts == 0 and w.recent == []
    assert w.state == "dead (exited), waiting: the run lock is held (deploy, stop, restart or swap)"
    assert kp.lock_held_by_other
    kp.lock_free = True
    kp.tick()
    assert kp.restarted == [0] and kp.watches[0].restarts == 1


def test_the_loop_leaves_a_drained_instance_alone(tmp_path):
    """Drained in the proxy (its admin API) and dead: no restart, however long."""
    kp = FakeKeeper(tmp_path)
    kp.drained = {1: True}
    kp.seen[1] = up(alive=False, health=None)
    for _ in range(20):
        kp.tick()
    assert kp.restarted == [] and "drained by the operator" in kp.watches[1].state


def test_the_loop_sends_stall_probes_and_restarts_a_stalled_instance(tmp_path):
    """With the stall probe on, the loop probes in the background, feeds the outcome back to decide, and
    restarts for "stalled" after probe_failures timeouts."""
    kp = FakeKeeper(tmp_path, n=1, k={**K, "stall_probe": True})
    kp.probe = lambda i: ("timeout", 3.0, 3.0)
    while not kp.restarted and kp.t < 10:
        kp.tick()
        wait_until(lambda: not kp.probing, 5, interval=0.001, what="the background stall probe to end")
    assert kp.restarted == [0] and kp.watches[0].by_reason == {"stalled": 1}, kp.watches[0]
    assert kp.watches[0].probes == {"timeout": 2}


# --- GET /metrics -------------------------------------------------------------------------------------

def _get(url: str) -> tuple[int, str] | None:
    """Status and text of GET url; None when nothing answers."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except urllib.error.URLError:
        return None


def test_the_keeper_serves_its_metrics_over_http_while_it_runs(tmp_path):
    """1. The keeper runs with keeper.metrics_port free: GET /metrics answers what run/keeper.prom holds
    (restarts, crash loop, probes, the last restart's time, health, up), another path 404.
    2. Stopped: the port answers nothing, and run/keeper.prom says fleet_keeper_up 0."""
    from conftest import free_port
    port = free_port()
    kp = FakeKeeper(tmp_path, k={**K, "metrics_port": port, "metrics_address": "127.0.0.1"})
    runner = threading.Thread(target=kp.run, daemon=True)
    runner.start()
    url = f"http://127.0.0.1:{port}/metrics"
    status, text = wait_until(lambda: (r := _get(url)) and "fleet_keeper_instance_healthy" in r[1] and
                              'instance_healthy{deployment="d",instance="1"} 1' in r[1] and r,
                              timeout=10, what="the keeper's /metrics with both instances healthy")
    assert status == 200 and 'fleet_keeper_up{deployment="d"} 1' in text
    assert 'fleet_keeper_last_restart_timestamp_seconds{deployment="d",instance="0"} 0.0' in text
    assert text == (tmp_path / "run" / "keeper.prom").read_text()
    assert _get(f"http://127.0.0.1:{port}/other")[0] == 404
    kp.stop.set()
    runner.join(10)
    assert not runner.is_alive() and _get(url) is None
    assert 'fleet_keeper_up{deployment="d"} 0' in (tmp_path / "run" / "keeper.prom").read_text()


def test_a_taken_metrics_port_is_one_log_line_and_the_keeper_goes_on(tmp_path, caplog):
    """keeper.metrics_port is taken by another process: the keeper logs one line and keeps watching
    (keeper.json and keeper.prom written, the instances seen healthy)."""
    import socket
    from conftest import free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        kp = FakeKeeper(tmp_path, k={**K, "metrics_port": port, "metrics_address": "127.0.0.1"})
        runner = threading.Thread(target=kp.run, daemon=True)
        with caplog.at_level("WARNING", logger="hostagent.keeper"):
            runner.start()
            wait_until(lambda: (tmp_path / "run" / "keeper.json").exists(), timeout=10, what="keeper.json")
        kp.stop.set()
        runner.join(10)
    lines = [r.getMessage() for r in caplog.records if "metrics over HTTP" in r.getMessage()]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], lines
    assert json.loads((tmp_path / "run" / "keeper.json").read_text())["instances"]["0"]["state"] == "healthy"


# --- the stall probe against a server -------------------------------------------------------------

class _Engine(http.server.BaseHTTPRequestHandler):
    """A stand-in engine: /v1/completions hangs for `hang_s`; /metrics counts generated tokens, moving
    while `busy`."""
    hang_s, busy, tokens = 0.0, False, 0

    def do_GET(self):
        if self.busy:
            type(self).tokens += 10
        body = f"vllm:generation_tokens_total{{model_name=\"m\"}} {self.tokens}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.hang_s)
        body = b'{"choices": []}'
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:             # the probe gave up waiting (a timeout): nobody reads the answer
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("hang_s, busy, expected", [(0.0, False, "ok"), (0.5, False, "timeout"),
                                                    (0.5, True, "busy")])
def test_the_stall_probe_tells_a_stall_from_a_busy_engine(hang_s, busy, expected):
    """A 1-token completion marked as the keeper's: answered (ok); timed out with no token generated
    (timeout); timed out while the engine's token counter moved (busy, not a stall)."""
    handler = type("Engine", (_Engine,), {"hang_s": hang_s, "busy": busy, "tokens": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        # A hang is longer than the timeout, whatever the machine's load; an answer has time to come.
        cfg = {"served_model_name": "m", "keeper": {"probe_timeout_s": 0.2 if hang_s else 30.0}}
        outcome = keeper.probe(cfg, f"http://127.0.0.1:{server.server_address[1]}")
        assert probe_result(*outcome) == expected, outcome
    finally:
        server.shutdown()
        server.server_close()
