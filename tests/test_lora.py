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
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fleet import display
from fleet_helpers import inv
from hostagent import __main__ as agent_main
from hostagent import layout, lora

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


pytestmark = pytest.mark.unit


# --- the record -----------------------------------------------------------------------------------

def test_the_record_is_written_whole_and_read_back(tmp_path):
    (tmp_path / "run").mkdir()
    assert lora.read_record(str(tmp_path)) == []
    adapters = [{"model": "a", "name": "x", "path": "/p/x", "added_at": 1}]
    lora.write_record(str(tmp_path), adapters)
    assert lora.read_record(str(tmp_path)) == adapters
    assert os.listdir(tmp_path / "run") == ["lora_adapters.json"]      # the temporary file was renamed
    assert json.loads((tmp_path / layout.LORA_ADAPTERS).read_text()) == {"adapters": adapters}


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


def test_a_plain_host_is_refused(host):
    del host.cfg["models"]
    with pytest.raises(lora.LoraError, match="h1 serves one model in the plain form"):
        lora.add(host.cfg, "a", "x", host.adapter)
    with pytest.raises(lora.LoraError, match="plain form"):
        lora.remove(host.cfg, "a", "x")
    assert sent(host) == []


def test_a_name_recorded_on_another_model_or_from_another_path_is_refused(host):
    lora.write_record(host.cfg["deploy_dir"], [{"model": "b", "name": "x", "path": host.adapter}])
    with pytest.raises(lora.LoraError, match="already a runtime adapter of model b"):
        lora.add(host.cfg, "a", "x", host.adapter)
    lora.write_record(host.cfg["deploy_dir"], [{"model": "a", "name": "x", "path": "/elsewhere"}])
    with pytest.raises(lora.LoraError, match="recorded from /elsewhere; `lora remove` it first"):
        lora.add(host.cfg, "a", "x", host.adapter)
    assert sent(host) == []


def test_remove_refuses_a_static_adapter(host):
    with pytest.raises(lora.LoraError, match="static-a is a static adapter of model a"):
        lora.remove(host.cfg, "a", "static-a")


# --- add, remove, list, restore against the fake engines -----------------------------------------

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


def test_remove_unloads_everywhere_and_drops_the_record(host):
    lora.add(host.cfg, "a", "x", host.adapter)
    del host.engines[1].loaded["x"]                               # gone there already: fine
    r = lora.remove(host.cfg, "a", "x", host.lines.append)
    assert r["ok"] and [i["status"] for i in r["instances"]] == ["unloaded", "absent"]
    assert host.engines[0].loaded == {} and lora.read_record(host.cfg["deploy_dir"]) == []
    r = lora.remove(host.cfg, "a", "x")
    assert not r["ok"] and r["error"] == "model a has no runtime adapter x (recorded: none); nothing changed."


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


def test_status_lists_runtime_adapters_in_the_model_line():
    st = {"host": "h", "front": "proxy", "deploy_dir": "/d",
          "proxy": {"port": 8000, "pid": 1, "state": "healthy", "backends": []},
          "models": [{"name": "a", "aliases": [], "adapters": ["s"], "instances": [0], "runtime_lora": True,
                      "runtime_adapters": [{"name": "x", "path": "/p"}]}],
          "instances": [{"index": 0, "port": 8002, "accelerator": 0, "cards": [0], "model": "a", "pid": 10,
                         "pgid": 10, "state": "healthy"}]}
    assert "model a: instance(s) 0 (adapter s, runtime adapter x)" in display.status_table(st)
