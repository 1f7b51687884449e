"""Deploy converges a changed setting instance by instance: each instance's launch is recorded at its
start, deploy compares it with the inventory's and rolls the difference through the one restart (drain,
stop, start, /health, enable) under load, with no failed request and never more requests on an engine
than its max_num_seqs. One sim deployment for the module, changed step by step (the tests run in order)."""
from __future__ import annotations

import json
import re
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import free_ports, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory

from fleet import render
from fleet.plan import launches as launch
from fleet.settings import inventory as inv_mod

pytestmark = pytest.mark.xdist_group("converge")


def chat(port: int, stream: bool, model: str = "Test-Model", seen: set | None = None,
         errors: list | None = None) -> bool:
    """One chat request through the proxy; True when it was answered whole (200, and [DONE] when streamed).
    seen: gets the model each answer names; errors: gets what a failed one got."""
    body = {"model": model, "max_tokens": 8, "stream": stream,
            "messages": [{"role": "user", "content": "hello " * 20}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            if seen is not None:
                seen.update(re.findall(r'"model": ?"([^"]+)"', text))
            ok = r.status == 200 and (not stream or "data: [DONE]" in text)
            if not ok and errors is not None:
                errors.append(text[-300:])
            return ok
    except urllib.error.HTTPError as e:
        if errors is not None:
            errors.append(f"{e.code} {e.read()[:300]!r}")
        return False
    except (urllib.error.URLError, OSError) as e:
        if errors is not None:
            errors.append(str(e))
        return False


def sim_stats(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/stats", timeout=5) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


class Load:
    """Clients sending streamed and non-streamed requests through the proxy without pause, and a monitor
    reading every engine's /sim/stats (its max_num_seqs and the most requests it has held at once)."""

    def __init__(self, proxy_port: int, engine_ports: list[int], clients: int = 6, model: str = "Test-Model"):
        self.stop = threading.Event()
        self.model = model
        self.results: list[bool] = []
        self.samples: list[dict] = []
        self.models: set[str] = set()      # the models the answers named
        self.errors: list[str] = []        # what the failed requests got
        self.threads = [threading.Thread(target=self._client, args=(proxy_port, n % 2 == 0))
                        for n in range(clients)]
        self.threads.append(threading.Thread(target=self._monitor, args=(engine_ports,)))

    def _client(self, port, stream):
        while not self.stop.is_set():
            self.results.append(chat(port, stream, self.model, self.models, self.errors))

    def _monitor(self, ports):
        while not self.stop.is_set():
            for p in ports:
                s = sim_stats(p)
                if s:
                    self.samples.append(s)
            # the sims keep their own peak: a read now and then finds it (a drained engine takes no
            # request in its last moments, so no peak is lost with it)
            time.sleep(0.1)

    def __enter__(self):
        for t in self.threads:
            t.start()
        wait_until(lambda: self.results.count(True) >= 6, what="the clients' first answers")
        return self

    def __exit__(self, *exc):
        before = len(self.results)       # the clients go on being answered after the change
        try:
            if exc[0] is None:
                wait_until(lambda: self.results[before:].count(True) >= 6, what="6 answers after the change")
        finally:
            self.stop.set()
            for t in self.threads:
                t.join(timeout=90)

    @property
    def failed(self) -> int:
        return self.results.count(False)


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def deployed(path: Path) -> dict:
    """`inv deploy` of the inventory at path; its proxy's port, its instances' ports, its deploy_dir."""
    r = inv("deploy", "--host", "t", inventory=path)
    assert r.returncode == 0, r.stdout + r.stderr
    st = status_json(path)
    return {"path": path, "proxy": st["proxy"]["port"], "ports": [i["port"] for i in st["instances"]],
            "deploy_dir": Path(st["deploy_dir"])}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two sim instances with max_num_seqs 4 behind the proxy, the keeper running."""
    tmp = tmp_path_factory.mktemp("converge")
    path = write_inventory(tmp, instances=2, max_num_seqs=4, extra="release_timeout_s: 20\n",
                           sim="{load_s: 0.2, prefill_ms: 10, token_ms: 20, output_tokens: 8}")
    dep = deployment_id(path)
    try:
        yield deployed(path)
    finally:
        inv("stop", "--host", "t", inventory=path)
        kill_tagged(dep + "/")


def change(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def converge_under_load(fleet) -> tuple[object, Load, float]:
    with Load(fleet["proxy"], fleet["ports"]) as load:
        t0 = time.monotonic()
        r = inv("deploy", "--host", "t", inventory=fleet["path"], timeout=240)
        took = time.monotonic() - t0
    return r, load, took


def engines(fleet) -> list[dict]:
    """Each instance's engine as it runs: its /sim/stats and its command line."""
    st = status_json(fleet["path"])
    out = []
    for inst in st["instances"]:
        assert inst["state"] == "healthy" and inst["launch"] == "current", inst
        out.append({"stats": sim_stats(inst["port"]), "argv": cmdline(inst["pid"]), "pid": inst["pid"]})
    return out


def assert_never_over(load: Load) -> None:
    over = [s for s in load.samples if s["peak_in_flight"] > s["max_num_seqs"]]
    assert load.samples and not over, over[:3]


@pytest.mark.cluster
def test_recorded_launch_is_the_engines_command_line_and_a_second_deploy_restarts_nothing(fleet):
    """1. The module's deploy recorded each instance's launch beside its pid file; 2. its argv is exactly the
    engine's command line (/proc/PID/cmdline), so the wanted launch and the script agree; 3. `inv deploy
    --check` finds nothing to restart and status marks every instance current; 4. without its record
    (started by an older version) an instance is `unrecorded`: deploy names it and how to restart it, and
    would not restart it."""
    hv = inv_mod.load(fleet["path"]).host_vars("t")
    for inst in status_json(fleet["path"])["instances"]:
        rec = json.loads((fleet["deploy_dir"] / f"run/instance_{inst['index']}.launch").read_text())
        assert rec["overrides"] == {} and rec["launch"]["argv"] == cmdline(inst["pid"])
        assert rec["digest"] == render.launch_digest(rec["launch"])
        assert inst["launch"] == "current" and inst["stale_settings"] == []
    r = inv("deploy", "--host", "t", "--check", inventory=fleet["path"])
    assert r.returncode == 0 and "would restart" not in r.stdout, r.stdout

    record = fleet["deploy_dir"] / "run/instance_0.launch"
    kept = record.read_text()
    record.unlink()                   # as if started by an older version
    try:
        assert status_json(fleet["path"])["instances"][0]["launch"] == "unrecorded"
        r = inv("deploy", "--host", "t", "--check", inventory=fleet["path"])
        assert "its launch is not recorded (started by an older version)" in r.stdout, r.stdout
        assert "`inv restart --host t --instance 0` restarts it" in r.stdout and "would restart" not in r.stdout
    finally:
        record.write_text(kept)


@pytest.mark.cluster
def test_a_smaller_max_num_seqs_is_named_by_check_then_rolled_under_load_without_a_failed_request(fleet):
    """1. max_num_seqs 4 -> 2 in the inventory; 2. `deploy --check` names both instances and the setting;
    3. `inv deploy` under load (streamed and not): the proxy takes 2 slots first, then both instances are
    rolled one at a time: 0 failed requests, no engine ever held more requests than its max_num_seqs, every
    engine runs 2; 4. the keeper, which never acts while deploy holds the run lock, restarted nothing."""
    change(fleet["path"], "max_num_seqs: 4", "max_num_seqs: 2")
    r = inv("deploy", "--host", "t", "--check", inventory=fleet["path"])
    for i in (0, 1):
        assert f"changed: instance {i}: would restart (max_num_seqs 4 -> 2" in r.stdout, r.stdout

    r, load, took = converge_under_load(fleet)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"max_num_seqs 4 -> 2 under load: deploy {took:.1f}s, {len(load.results)} requests, "
          f"{load.failed} failed")
    assert load.failed == 0 and len(load.results) > 20
    assert_never_over(load)
    assert "changed: proxy slots: reloaded with the smaller max_num_seqs before the roll" in r.stdout
    assert r.stdout.index("instance 0: back in the proxy") < r.stdout.index("instance 1: drained")
    for e in engines(fleet):
        assert e["stats"]["max_num_seqs"] == 2 and e["argv"][e["argv"].index("--max-num-seqs") + 1] == "2"
    assert all(i["restarts"] == 0 for i in status_json(fleet["path"])["instances"])


@pytest.mark.cluster
def test_a_larger_max_num_seqs_reaches_the_proxy_only_after_the_engines(fleet):
    """1. max_num_seqs 2 -> 5; 2. `inv deploy` under load: 0 failed requests, no engine ever held more than
    its max_num_seqs (the proxy kept 2 slots until both ran 5); 3. the proxy's config says 5 after."""
    change(fleet["path"], "max_num_seqs: 2", "max_num_seqs: 5")
    r, load, took = converge_under_load(fleet)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"max_num_seqs 2 -> 5 under load: deploy {took:.1f}s, {len(load.results)} requests, "
          f"{load.failed} failed")
    assert load.failed == 0
    assert_never_over(load)
    assert all(e["stats"]["max_num_seqs"] == 5 for e in engines(fleet))
    assert "slots: 5" in (fleet["deploy_dir"] / "conf/proxy.yaml").read_text()


@pytest.mark.cluster
def test_changed_extra_args_left_stale_by_no_restart_then_rolled_under_load(fleet):
    """1. extra_args gains `--seed 7`; 2. `deploy --no-restart` leaves both instances as they run and says
    so, and `inv status` (table and --json) marks them stale with the setting; 3. `inv deploy` under load
    names the change and rolls both: 0 failed requests; 4. both engines' command lines end with it."""
    change(fleet["path"], "    stagger_s: 0\n", "    stagger_s: 0\n    extra_args: [--seed, '7']\n")
    r = inv("deploy", "--host", "t", "--no-restart", inventory=fleet["path"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'left running stale settings (extra_args [] -> ["--seed","7"])' in r.stdout, r.stdout
    r = inv("status", "--host", "t", inventory=fleet["path"])
    assert 'STALE: extra_args [] -> ["--seed","7"]' in r.stdout, r.stdout
    st = status_json(fleet["path"])
    assert [i["launch"] for i in st["instances"]] == ["stale", "stale"]
    assert st["instances"][1]["stale_settings"] == ['extra_args [] -> ["--seed","7"]']

    r, load, _ = converge_under_load(fleet)
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'instance 0: rolling (extra_args [] -> ["--seed","7"]' in r.stdout, r.stdout
    assert load.failed == 0
    assert all(e["argv"][-2:] == ["--seed", "7"] for e in engines(fleet))


@pytest.mark.cluster
def test_a_new_model_with_the_same_served_name_rolls_under_load(fleet):
    """Rolling model upgrade: 1. model /models/Test-Model -> /models/Test-Model-v2, served_model_name kept;
    2. `inv deploy` under load: 0 failed requests (clients keep asking for Test-Model); 3. both engines
    serve the new model under the old name."""
    change(fleet["path"], "model: /models/Test-Model\n",
           "model: /models/Test-Model-v2\n    served_model_name: Test-Model\n")
    r, load, _ = converge_under_load(fleet)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "model /models/Test-Model -> /models/Test-Model-v2" in r.stdout
    assert load.failed == 0
    for e in engines(fleet):
        assert "/models/Test-Model-v2" in e["argv"] and "--served-model-name=Test-Model" in e["argv"]


@pytest.mark.unit
def test_differences_name_each_changed_setting_and_overrides_by_hand(tmp_path):
    """1. A record equal to the wanted launch differs in nothing; 2. one with another max_num_seqs names it;
    3. one started with MAX_SEQS=1 by hand names the override; 4. no record: None (not stale, unknown)."""
    hv = inv_mod.load(write_inventory(tmp_path, instances=2)).host_vars("t")
    want = render.wanted_launches(hv)[0]
    assert launch.differences({"digest": want["digest"], "launch": want["launch"]}, want) == []
    old = dict(want["launch"], max_num_seqs=6)
    assert launch.differences({"digest": render.launch_digest(old), "launch": old}, want) == ["max_num_seqs 6 -> 4"]
    rec = {"digest": want["digest"], "launch": want["launch"], "overrides": {"MAX_SEQS": "1"}}
    assert launch.differences(rec, want) == ["MAX_SEQS=1 set by hand"]
    assert launch.differences(None, want) is None
    assert re.fullmatch(r"[0-9a-f]{16}", want["digest"])


BLUE = """\
models:
  - {name: Test-Model, model: /models/Test-Model, instances: 1, aliases: [chat]}
"""
GREEN = "      - {name: Test-Model-v2, model: /models/Test-Model-v2, instances: 1}\n"


@pytest.mark.cluster
@pytest.mark.xdist_group("converge_blue_green")     # its own deployment: beside the module's, not after it
def test_blue_green_add_the_new_group_move_the_alias_remove_the_old_group_under_load(tmp_path):
    """Blue/green upgrade through three deploys, while clients ask for the alias `chat` (streamed and not):
    1. blue (Test-Model, alias chat) on instance 0; 2. add green (Test-Model-v2) as a second group: its
    instance 1 starts, blue is not restarted; 3. move the alias to green: green rolls first, the proxy
    takes the new config, then blue rolls; answers now name Test-Model-v2; 4. remove blue: instance 0
    rolls to green (drained until the proxy routes green to it), instance 1 is out of the proxy, then
    stopped once idle. 0 failed requests in every step; at the end one instance, green, and nothing of
    instance 1 left running."""
    path = write_inventory(tmp_path, instances=2, max_num_seqs=4, extra="release_timeout_s: 20\n" + BLUE,
                           sim="{load_s: 0.2, prefill_ms: 10, token_ms: 20, output_tokens: 8}")
    dep = deployment_id(path)
    try:
        fl = deployed(path)
        blue_pid = status_json(path)["instances"][0]["pid"]

        def step(what: str):
            with Load(fl["proxy"], fl["ports"], clients=4, model="chat") as load:
                r = inv("deploy", "--host", "t", inventory=path, timeout=240)
            assert r.returncode == 0, r.stdout + r.stderr
            print(f"blue/green, {what}: {len(load.results)} requests, {load.failed} failed")
            assert load.failed == 0, (what, load.errors, r.stdout)
            return r, load

        path.write_text(path.read_text() + GREEN)                                   # 1. add green
        r, load = step("add green")
        st = status_json(path)
        assert [i["model"] for i in st["instances"]] == ["Test-Model", "Test-Model-v2"]
        assert st["instances"][0]["pid"] == blue_pid and load.models == {"Test-Model"}

        change(path, "instances: 1, aliases: [chat]}", "instances: 1}")          # 2. move the alias
        change(path, "Test-Model-v2, instances: 1}", "Test-Model-v2, instances: 1, aliases: [chat]}")
        r, load = step("move the alias")
        assert r.stdout.index("instance 1: rolling") < r.stdout.index("instance 0: rolling"), r.stdout
        assert "Test-Model-v2" in load.models
        seen: set[str] = set()
        assert all(chat(fl["proxy"], False, "chat", seen) for _ in range(4)) and seen == {"Test-Model-v2"}

        change(path, "      - {name: Test-Model, model: /models/Test-Model, instances: 1}\n", "")  # 3. remove blue
        r, load = step("remove blue")
        assert "instance 1: no request left" in r.stdout and "changed: instance 1: removed" in r.stdout, r.stdout
        st = status_json(path)
        assert [(i["model"], i["state"], i["launch"]) for i in st["instances"]] == \
            [("Test-Model-v2", "healthy", "current")]
        assert [t for t in st["tagged"] if t["tag"] == f"{dep}/1"] == []
    finally:
        inv("stop", "--host", "t", inventory=path)
        kill_tagged(dep + "/")


@pytest.mark.cluster
def test_a_member_behind_an_entry_leaves_the_entry_proxy_before_it_restarts_and_its_smaller_slots_come_first(tmp_path):
    """1. An entry host fronting a member of two sim instances (max_num_seqs 3), both local, deployed; the
    entry's proxy gives each backend 3 slots (the member's max_num_seqs, not the entry's own 4);
    2. the member's max_num_seqs 3 -> 1; `deploy --check` of both hosts says the entry's proxy would take
    fewer slots first; 3. `inv deploy` of both hosts under load through the entry: the entry's proxy takes
    1 slot before the member rolls (its step leads the entry's lines), 0 failed requests, and no engine ever
    held more requests than its max_num_seqs; 4. `inv restart --rolling` of the member under load: each
    instance is drained in the entry's proxy too before it stops: 0 failed requests; 5. `inv stop --instance
    0` of the member under load: drained in the entry's proxy first, 0 failed, then handed back to the
    entry's health check (not left drained)."""
    path = write_inventory(tmp_path, instances=2, max_num_seqs=3,
                           sim="{load_s: 0.2, prefill_ms: 10, token_ms: 20, output_tokens: 8}")
    entry_port = free_ports(2)
    entry_admin = entry_port + 1
    path.write_text(path.read_text() + textwrap.indent(textwrap.dedent(f"""\
          entry:
            connection: local
            engine: sim
            accelerator: sim
            model: /models/Test-Model
            fronts: [t]
            deploy_dir: {tmp_path / 'entry'}
            proxy: {{port: {entry_port}, admin_port: {entry_admin}, health_interval_s: 0.5}}
        """), "  "))
    deps = [deployment_id(path), deployment_id(path, "entry")]
    try:
        r = inv("deploy", "--host", "t,entry", inventory=path, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "slots: 3" in (tmp_path / "entry/conf/proxy.yaml").read_text()
        ports = [i["port"] for i in status_json(path)["instances"]]

        change(path, "max_num_seqs: 3", "max_num_seqs: 1")
        r = inv("deploy", "--host", "t,entry", "--check", inventory=path)
        assert "changed: proxy slots: would take fewer slots before the members roll (Test-Model 3 -> 1)" \
            in r.stdout, r.stdout
        with Load(entry_port, ports) as load:
            r = inv("deploy", "--host", "t,entry", inventory=path, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        print(f"member max_num_seqs 3 -> 1 behind an entry: {len(load.results)} requests, {load.failed} failed")
        lowered = r.stdout.index("proxy slots: reloaded with fewer slots before the members roll")
        assert lowered < r.stdout.index("instance 0: rolling"), r.stdout
        assert load.failed == 0, load.errors[:3]
        assert_never_over(load)
        assert "slots: 1" in (tmp_path / "entry/conf/proxy.yaml").read_text()

        with Load(entry_port, ports) as load:
            r = inv("restart", "--host", "t", "--rolling", inventory=path, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        print(f"member rolling restart behind an entry: {len(load.results)} requests, {load.failed} failed")
        for i in (0, 1):
            assert f"instance {i}: draining 127.0.0.1:{ports[i]} in entry host entry's proxy" in r.stdout, r.stdout
        assert load.failed == 0, load.errors[:3]

        with Load(entry_port, ports) as load:
            r = inv("stop", "--host", "t", "--instance", "0", inventory=path, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        print(f"member's instance stopped behind an entry: {len(load.results)} requests, {load.failed} failed")
        assert f"instance 0: draining 127.0.0.1:{ports[0]} in entry host entry's proxy" in r.stdout, r.stdout
        assert load.failed == 0, load.errors[:3]
        entry_backends = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{entry_admin}/admin/backends", timeout=5).read())
        stopped = next(b for b in entry_backends if b["name"] == f"127.0.0.1:{ports[0]}")
        assert not stopped["drained"], stopped      # the entry's health check keeps it out, not a drain
    finally:
        inv("stop", "--host", "t,entry", inventory=path)
        for dep in deps:
            kill_tagged(dep + "/")
