"""Runtime LoRA adapters (issue 18): `inv lora add | remove | list`, the host agent's record
(run/lora_adapters.json) and its restore after a start.

Unit tests drive hostagent/lora.py against a fake engine in this process (vLLM's endpoints and answers:
200 text, 400 "already been loaded", 404 for an unknown unload); the cluster tests deploy a sim host of
two models with `inv` and load, restart, list and remove for real.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import textwrap
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import free_ports, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json

from hostagent import __main__ as agent_main, layout, lora

from fleet.commands import display
from fleet.facts.state import InstanceStatus, ModelStatus, ProxyStatus, RuntimeAdapter, Status

# --- a fake engine: vLLM's runtime LoRA endpoints, in this process ---------------------------------


class FakeEngine:
    """One instance's API server: /health, /v1/models, load and unload as vLLM 0.32 answers them."""

    def __init__(self, name: str):
        self.name, self.loaded, self.requests, self.refuse = name, {}, [], None
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, status, body, ctype="application/json"):
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    return self.answer(200, "", "text/plain")
                ids = [engine.name, *engine.loaded]
                return self.answer(200, {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests.append((self.path, body))
                name = body.get("lora_name")
                if self.path == "/v1/load_lora_adapter":
                    if engine.refuse:
                        return self.answer(400, {"error": {"message": engine.refuse, "type": "BadRequestError",
                                                           "code": 400}})
                    if name in engine.loaded:
                        return self.answer(400, {"error": {"message": f"The lora adapter '{name}' has already "
                                                           "been loaded.", "type": "InvalidUserInput", "code": 400}})
                    engine.loaded[name] = body["lora_path"]
                    return self.answer(200, f"Success: LoRA adapter '{name}' added successfully.", "text/plain")
                if self.path == "/v1/unload_lora_adapter":
                    if name not in engine.loaded:
                        return self.answer(404, {"error": {"message": f"The lora adapter '{name}' cannot be "
                                                           "found.", "type": "NotFoundError", "code": 404}})
                    del engine.loaded[name]
                    return self.answer(200, f"Success: LoRA adapter '{name}' removed successfully.", "text/plain")
                return self.answer(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A hostagent.json of two groups (a: instances 0, 1 with runtime_lora; b: instance 2), each instance a
    fake engine; `running` is every instance but those in host.down."""
    engines = [FakeEngine("a"), FakeEngine("a"), FakeEngine("b")]
    (tmp_path / "run").mkdir()
    cfg = {"host": "h1", "deploy_dir": str(tmp_path), "deployment_id": "h1-x", "admin_port": engines[0].port,
           "instances": [{"index": i, "port": e.port, "address": "127.0.0.1", "backend": f"127.0.0.1:{e.port}",
                          "model": e.name} for i, e in enumerate(engines)],
           "models": [{"name": "a", "instances": [0, 1], "aliases": ["alpha"], "runtime_lora": True,
                       "lora_modules": {"static-a": "/l/s"}},
                      {"name": "b", "instances": [2], "aliases": [], "runtime_lora": False, "lora_modules": {}}]}
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    down: set[int] = set()
    monkeypatch.setattr(lora, "running", lambda cfg, i: i not in down)

    class Host:
        pass
    h = Host()
    h.cfg, h.engines, h.adapter, h.down, h.tmp = cfg, engines, str(adapter), down, tmp_path
    h.lines = []
    yield h
    for e in engines:
        e.close()


def sent(h) -> list:
    """The load and unload calls the engines got."""
    return [r for e in h.engines for r in e.requests]



# --- the record -----------------------------------------------------------------------------------

@pytest.mark.unit
def test_the_record_is_written_whole_and_read_back(tmp_path):
    (tmp_path / "run").mkdir()
    assert lora.read_record(str(tmp_path)) == []
    adapters = [{"model": "a", "name": "x", "path": "/p/x", "added_at": 1}]
    lora.write_record(str(tmp_path), adapters)
    assert lora.read_record(str(tmp_path)) == adapters
    assert os.listdir(tmp_path / "run") == ["lora_adapters.json"]      # the temporary file was renamed
    assert json.loads((tmp_path / layout.LORA_ADAPTERS).read_text()) == {"adapters": adapters}


@pytest.mark.unit
@pytest.mark.parametrize("text, said", [("{not json", "is not valid JSON"), ('{"adapters": [{"name": 1}]}',
                                                                             "is not a record of adapters"),
                                        ("[]", "is not a record of adapters")])
def test_an_unreadable_record_is_one_sentence(tmp_path, text, said):
    (tmp_path / "run").mkdir()
    (tmp_path / layout.LORA_ADAPTERS).write_text(text)
    with pytest.raises(lora.LoraError, match=said):
        lora.read_record(str(tmp_path))
    assert lora.read_record_quiet(str(tmp_path))[0] == []
    assert said in lora.read_record_quiet(str(tmp_path))[1]


# --- the refusals: one sentence, nothing sent -----------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("model, name, path, said", [
    ("c", "x", None, "h1 has no model 'c'; its models are a, b"),
    ("b", "x", None, "model b does not take adapters at runtime; set `runtime_lora: true`"),
    ("a", "a", None, "the name a is already its served name of model a"),
    ("a", "alpha", None, "the name alpha is already an alias of model a"),
    ("a", "static-a", None, "the name static-a is already a static adapter of model a"),
    ("a", "b", None, "the name b is already its served name of model b"),
    ("a", "x", "relative/dir", "the adapter path relative/dir is relative"),
    ("a", "x", "/no/such/adapter", "the adapter path /no/such/adapter does not exist on h1"),
])
def test_add_refuses_in_one_sentence_and_sends_nothing(host, model, name, path, said):
    with pytest.raises(lora.LoraError) as e:
        lora.add(host.cfg, model, name, path or host.adapter, host.lines.append)
    assert said in str(e.value) and str(e.value).count(". ") == 0, str(e.value)
    assert sent(host) == [] and not (host.tmp / layout.LORA_ADAPTERS).exists()


@pytest.mark.unit
def test_a_plain_host_is_refused(host):
    del host.cfg["models"]
    with pytest.raises(lora.LoraError, match="h1 serves one model in the plain form"):
        lora.add(host.cfg, "a", "x", host.adapter)
    with pytest.raises(lora.LoraError, match="plain form"):
        lora.remove(host.cfg, "a", "x")
    assert sent(host) == []


@pytest.mark.unit
def test_a_name_recorded_on_another_model_or_from_another_path_is_refused(host):
    lora.write_record(host.cfg["deploy_dir"], [{"model": "b", "name": "x", "path": host.adapter}])
    with pytest.raises(lora.LoraError, match="already a runtime adapter of model b"):
        lora.add(host.cfg, "a", "x", host.adapter)
    lora.write_record(host.cfg["deploy_dir"], [{"model": "a", "name": "x", "path": "/elsewhere"}])
    with pytest.raises(lora.LoraError, match="recorded from /elsewhere; `lora remove` it first"):
        lora.add(host.cfg, "a", "x", host.adapter)
    assert sent(host) == []


@pytest.mark.unit
def test_remove_refuses_a_static_adapter(host):
    with pytest.raises(lora.LoraError, match="static-a is a static adapter of model a"):
        lora.remove(host.cfg, "a", "static-a")


# --- add, remove, list, restore against the fake engines -----------------------------------------

@pytest.mark.unit
def test_add_loads_on_every_running_instance_and_records(host):
    host.engines[1].loaded["x"] = host.adapter           # already there: counts as loaded
    r = lora.add(host.cfg, "a", "x", host.adapter, host.lines.append)
    assert r["ok"] and r["recorded"] and "error" not in r
    assert [(i["index"], i["status"]) for i in r["instances"]] == [(0, "loaded"), (1, "already")]
    assert host.engines[0].loaded == {"x": host.adapter} and not host.engines[2].requests
    assert [(a["model"], a["name"], a["path"]) for a in lora.read_record(host.cfg["deploy_dir"])] == \
        [("a", "x", host.adapter)]
    assert "instance 0: loaded x" in host.lines
    # the proxy (here: a fake engine on the admin port, which answers 404) learns it at its next round
    assert any("next health round" in line for line in host.lines), host.lines
    again = lora.add(host.cfg, "a", "x", host.adapter)          # a second add: ok, recorded once
    assert again["ok"] and len(lora.read_record(host.cfg["deploy_dir"])) == 1


@pytest.mark.unit
def test_an_instance_not_running_is_skipped_and_gets_it_at_its_start(host):
    host.down.add(1)
    r = lora.add(host.cfg, "a", "x", host.adapter)
    assert r["ok"] and [i["status"] for i in r["instances"]] == ["loaded", "skipped"]
    assert "x" not in host.engines[1].loaded
    host.down.clear()
    steps = lora.restore(host.cfg, 1, host.lines.append)
    assert steps == [{"name": "instance 1 adapters", "status": "changed",
                      "message": "restored x from run/lora_adapters.json"}]
    assert host.engines[1].loaded == {"x": host.adapter}
    assert lora.restore(host.cfg, 1)[0]["status"] == "ok"        # already there: nothing sent again
    assert lora.restore(host.cfg, 2) == []                        # group b has nothing recorded


@pytest.mark.unit
def test_a_partial_failure_is_recorded_and_names_the_failed_instance(host):
    """The policy: loaded on one instance at least -> recorded (a restart of the others restores it), and
    the run fails naming the instances that did not load it, with the engine's reason."""
    host.engines[1].refuse = "Loading lora x failed: No adapter found for /p"
    r = lora.add(host.cfg, "a", "x", host.adapter)
    assert not r["ok"] and r["recorded"]
    assert "x is loaded on instance(s) 0 and recorded, but instance(s) 1 failed" in r["error"]
    assert "400: Loading lora x failed" in r["error"]
    assert lora.read_record(host.cfg["deploy_dir"])[0]["name"] == "x"
    step = lora.restore(host.cfg, 1)[0]
    assert step["status"] == "failed" and "x (" in step["message"] and "No adapter found" in step["message"]


@pytest.mark.unit
def test_loaded_nowhere_is_not_recorded(host):
    host.engines[0].refuse = host.engines[1].refuse = "bad adapter"
    r = lora.add(host.cfg, "a", "x", host.adapter)
    assert not r["ok"] and not r["recorded"] and "x was loaded on no instance of a" in r["error"]
    assert not (host.tmp / layout.LORA_ADAPTERS).exists()
    host.engines[0].refuse = host.engines[1].refuse = None
    host.down.update({0, 1})
    r = lora.add(host.cfg, "a", "x", host.adapter)
    assert not r["ok"] and "no instance of model a is running (instances 0, 1)" in r["error"]
    assert not (host.tmp / layout.LORA_ADAPTERS).exists()


@pytest.mark.unit
def test_remove_unloads_everywhere_and_drops_the_record(host):
    lora.add(host.cfg, "a", "x", host.adapter)
    del host.engines[1].loaded["x"]                               # gone there already: fine
    r = lora.remove(host.cfg, "a", "x", host.lines.append)
    assert r["ok"] and [i["status"] for i in r["instances"]] == ["unloaded", "absent"]
    assert host.engines[0].loaded == {} and lora.read_record(host.cfg["deploy_dir"]) == []
    r = lora.remove(host.cfg, "a", "x")
    assert not r["ok"] and r["error"] == "model a has no runtime adapter x (recorded: none); nothing changed."


@pytest.mark.unit
def test_list_shows_static_and_runtime_adapters_and_where(host):
    host.down.add(1)
    lora.add(host.cfg, "a", "x", host.adapter)
    lines = []
    r = lora.listing(host.cfg, lines.append)
    a = r["models"][0]
    assert a["static"] == ["static-a"] and a["runtime"][0]["loaded_on"] == [0]
    assert a["runtime"][0]["missing_on"] == [1]
    assert lines[0] == f"model a: static static-a; runtime x ({host.adapter}) on instance(s) 0, missing on 1"
    assert lines[1] == "model b: no adapters (runtime_lora is off)"


@pytest.mark.unit
def test_the_host_agent_command_prints_one_result_line(host, tmp_path):
    conf = tmp_path / "hostagent.json"
    conf.write_text(json.dumps(host.cfg))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = agent_main.main(["lora", "add", "--config", str(conf), "--model", "a", "--name", "x",
                                "--path", "/no/such/adapter", "--locked"])
    assert code == 1
    result = json.loads(out.getvalue().splitlines()[-1][len("FLEET_RESULT "):])
    assert result == {"ok": False, "error": "the adapter path /no/such/adapter does not exist on h1; copy the "
                                            "adapter there first."}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = agent_main.main(["lora", "remove", "--config", str(conf), "--model", "a", "--locked"])
    assert code == 1 and "lora remove needs --model MODEL --name NAME (--name missing)" in out.getvalue()


# --- the control plane ----------------------------------------------------------------------------

@pytest.mark.unit
def test_inv_lora_refuses_a_plain_host_and_an_unknown_action(tmp_path):
    path = tmp_path / "hosts.yml"
    path.write_text(textwrap.dedent(f"""\
        hosts:
          t:
            connection: local
            engine: sim
            accelerator: sim
            deploy_dir: {tmp_path / 'deploy'}
        """))
    r = inv("lora", "add", "--host", "t", "--model", "m", "--name", "x", "--path", "/p", inventory=path)
    assert r.returncode == 2 and "t serves one model in the plain form, which takes no runtime adapters; set " \
        "`runtime_lora: true`" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "deploy").exists()
    r = inv("lora", "frob", "--host", "t", inventory=path)
    assert r.returncode == 2 and "error: lora takes add, remove or list (got 'frob')" in r.stderr
    r = inv("lora", "add", "--host", "t", "--model", "m", inventory=path)
    assert r.returncode == 2 and "(--name, --path missing)" in r.stderr


@pytest.mark.unit
def test_status_lists_runtime_adapters_in_the_model_line():
    st = Status(host="h", front="proxy", deploy_dir="/d",
                proxy=ProxyStatus(port=8000, pid=1, state="healthy", backends=[]),
                models=[ModelStatus("a", adapters=["s"], instances=[0], runtime_lora=True,
                                    runtime_adapters=[RuntimeAdapter("x", "/p")])],
                instances=[InstanceStatus(index=0, port=8002, accelerator=0, cards=[0], model="a", pid=10, pgid=10,
                                          state="healthy")])
    assert "model a: instance(s) 0 (adapter s, runtime adapter x)" in display.status_table(st)


# --- a sim host of two models, deployed by inv ---------------------------------------------------

def _get(url: str, timeout: float = 10):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return None, None


class SimHost:
    """Model tiny-a on instances 0 and 1 (a static adapter, runtime_lora), tiny-b on instance 2."""

    def __init__(self, tmp):
        base = free_ports(5)
        self.tmp, self.base, self.ports = tmp, base, [base, base + 1, base + 2]
        self.adapter = tmp / "adapters" / "rt-a"
        self.adapter.mkdir(parents=True)
        (self.adapter / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
        self.deploy = tmp / "deploy"
        self.inventory = tmp / "hosts.yml"
        self.inventory.write_text(textwrap.dedent(f"""\
            hosts:
              t:
                connection: local
                engine: sim
                accelerator: sim
                accelerators: 3
                base_port: {base}
                deploy_dir: {self.deploy}
                stagger_s: 0
                health_timeout_s: 60
                stop_grace_s: 3
                release_timeout_s: 20
                sim: {{load_s: 0.3, prefill_ms: 5, token_ms: 1}}
                models:
                  - {{name: tiny-a, model: /m/a, instances: 2, lora_modules: {{static-a: {tmp / 'adapters'}}},
                      max_lora_rank: 8, runtime_lora: true}}
                  - {{name: tiny-b, model: /m/b}}
                proxy:
                  port: {base + 3}
                  admin_port: {base + 4}
                  health_interval_s: 0.5
                keeper: {{dead_after_s: 2, backoff_base_s: 0.5, backoff_max_s: 2, max_restarts: 5, window_s: 120}}
            """))
        self.dep = deployment_id(self.inventory)

    def inv(self, *args, **kw):
        return inv(*args, "--host", "t", inventory=self.inventory, **kw)

    def models(self, i: int) -> set[str]:
        """The ids instance i's /v1/models lists (empty when it does not answer)."""
        status, body = _get(f"http://127.0.0.1:{self.ports[i]}/v1/models")
        return {m["id"] for m in body["data"]} if status == 200 else set()

    def complete(self, port: int, model: str):
        """(status, body, X-Backend) of a completion sent to port (an instance's, or the proxy's)."""
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read()), r.headers.get("X-Backend")
        except urllib.error.HTTPError as e:
            return e.code, None, e.headers.get("X-Backend")

    def through_proxy(self, model: str, times: int = 4) -> set:
        """The backends the proxy sent `times` completions for model to; fails on an answer but 200."""
        seen = set()
        for _ in range(times):
            status, body, backend = self.complete(self.base + 3, model)
            assert status == 200 and body["model"] == model, (status, body)
            seen.add(backend)
        return seen


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    h = SimHost(tmp_path_factory.mktemp("lora"))
    r = h.inv("deploy")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield h
    finally:
        h.inv("stop")
        kill_tagged(h.dep + "/")


@pytest.mark.cluster
@pytest.mark.xdist_group("lora_deploy")
def test_add_loads_the_adapter_on_every_instance_of_its_model(sim):
    r = sim.inv("lora", "add", "--model", "tiny-a", "--name", "rt-a", "--path", str(sim.adapter))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "instance 0: loaded rt-a" in r.stdout and "instance 1: loaded rt-a" in r.stdout, r.stdout
    assert "t : ok=0 changed=2 skipped=0 failed=0" in r.stdout
    assert "rt-a" in sim.models(0) and "rt-a" in sim.models(1) and "rt-a" not in sim.models(2)
    assert "the proxy re-read the instances' models" in r.stdout, r.stdout
    # routed at once (refresh-models): only to tiny-a's instances
    assert sim.through_proxy("rt-a") <= {f"127.0.0.1:{p}" for p in sim.ports[:2]}
    record = json.loads((sim.deploy / layout.LORA_ADAPTERS).read_text())["adapters"]
    assert [(a["model"], a["name"], a["path"]) for a in record] == [("tiny-a", "rt-a", str(sim.adapter))]


@pytest.mark.cluster
@pytest.mark.xdist_group("lora_deploy")
def test_the_entry_port_refuses_the_adapter_routes(sim):
    """runtime_lora: true, rt-a loaded by `inv lora` (through the instances' own ports): a caller's
    unload of rt-a and load of its own adapter through the entry port are the proxy's 404; nothing changed."""
    for path, body in (("/v1/unload_lora_adapter", {"lora_name": "rt-a"}),
                       ("/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": str(sim.adapter)})):
        req = urllib.request.Request(f"http://127.0.0.1:{sim.base + 3}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 404 and "Routes that reach the engines" in json.loads(e.value.read())["error"]["message"]
    assert all("rt-a" in sim.models(i) and "mine" not in sim.models(i) for i in (0, 1))


@pytest.mark.cluster
@pytest.mark.xdist_group("lora_deploy")
def test_list_and_status_show_the_adapters(sim):
    r = sim.inv("lora", "list")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"model tiny-a: static static-a; runtime rt-a ({sim.adapter}) on instance(s) 0, 1" in r.stdout
    assert "model tiny-b: no adapters (runtime_lora is off)" in r.stdout
    st = status_json(sim.inventory)
    a = st["models"][0]
    assert a["adapters"] == ["static-a"] and a["runtime_adapters"] == [{"name": "rt-a", "path": str(sim.adapter)}]
    r = sim.inv("status")
    assert "model tiny-a: instance(s) 0, 1 (adapter static-a, runtime adapter rt-a)" in r.stdout, r.stdout


@pytest.mark.cluster
@pytest.mark.xdist_group("lora_deploy")
def test_a_restarted_instance_has_the_adapter_before_it_is_enabled(sim):
    """1. inv restart --instance 0; 2. the restore's line comes before the proxy routes to it again;
    3. right after the restart returns, the instance lists the adapter and answers under its name."""
    r = sim.inv("restart", "--instance", "0")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "instance 0: restored adapter(s) rt-a" in out, out
    assert out.index("restored adapter(s) rt-a") < out.index("instance 0: back in the proxy"), out
    assert "rt-a" in sim.models(0)
    status, body, _ = sim.complete(sim.ports[0], "rt-a")
    assert status == 200 and body["model"] == "rt-a"
    assert sim.through_proxy("rt-a")


@pytest.mark.cluster
@pytest.mark.xdist_group("lora_deploy")
def test_the_keepers_restart_restores_the_adapter(sim):
    """1. SIGKILL instance 1's engine; 2. the keeper restarts it (its restart_instance); 3. it comes back
    serving rt-a, with a new pid."""
    before = status_json(sim.inventory)["instances"][1]["pid"]
    os.killpg(before, signal.SIGKILL)

    def back():
        st = status_json(sim.inventory)["instances"][1]
        return st["state"] == "healthy" and st["pid"] not in (None, before) and "rt-a" in sim.models(1)
    # Bounded generously: each poll is an `inv status`, and the keeper waits dead_after_s before it acts.
    wait_until(back, timeout=180, interval=0.3, what="instance 1 restarted by the keeper with rt-a")
    log = (sim.deploy / "logs" / "keeper.log").read_text()
    assert "instance 1: restored adapter(s) rt-a" in log, log[-2000:]


@pytest.mark.cluster
@pytest.mark.xdist_group("lora_deploy")
def test_stop_keeps_the_record_and_deploy_restores_it(sim):
    r = sim.inv("stop", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (sim.deploy / layout.LORA_ADAPTERS).exists()
    r = sim.inv("deploy", "--wait")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "instance 0: restored adapter(s) rt-a" in out and "instance 1: restored adapter(s) rt-a" in out, out
    assert "rt-a" in sim.models(0) and "rt-a" in sim.models(1)
    wait_until(lambda: sim.complete(sim.base + 3, "rt-a")[0] == 200, timeout=30, what="rt-a routed after deploy")


@pytest.mark.cluster
@pytest.mark.xdist_group("lora_deploy")
def test_refusals_send_nothing(sim):
    r = sim.inv("lora", "add", "--model", "tiny-a", "--name", "ghost", "--path", str(sim.tmp / "nowhere"))
    out = r.stdout + r.stderr
    assert r.returncode == 2 and f"the adapter path {sim.tmp / 'nowhere'} does not exist on t" in out, out
    assert "Traceback" not in out and "ghost" not in sim.models(0)
    assert sim.complete(sim.base + 3, "ghost")[0] == 404
    r = sim.inv("lora", "add", "--model", "tiny-b", "--name", "ghost", "--path", str(sim.adapter))
    assert r.returncode == 2 and "set `runtime_lora: true` in its entry" in r.stderr, r.stdout + r.stderr
    r = sim.inv("lora", "add", "--model", "tiny-a", "--name", "static-a", "--path", str(sim.adapter))
    assert r.returncode == 2 and "the name static-a is already a static adapter of model tiny-a" in r.stderr


@pytest.mark.cluster
@pytest.mark.xdist_group("lora_deploy")
def test_remove_unloads_it_everywhere_and_forgets_it(sim):
    r = sim.inv("lora", "remove", "--model", "tiny-a", "--name", "rt-a", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rt-a" not in sim.models(0) | sim.models(1)
    assert json.loads((sim.deploy / layout.LORA_ADAPTERS).read_text()) == {"adapters": []}
    assert sim.complete(sim.ports[0], "rt-a")[0] == 404
    status, _, backend = sim.complete(sim.base + 3, "rt-a")          # the proxy forgot it at once
    assert status == 404 and backend is None
