"""Only the inference API reaches the engines through the entry port (proxy/routes.py, nginx.conf's
$fleet_route): the engines' management (runtime adapters, cache resets, sleep, profiling) answers 404 with
the OpenAI-shaped body at the proxy and in nginx mode, while each instance's own port still serves it;
`proxy.open_routes` opens more. The list is declared twice (fleet/settings/schema.py, proxy/routes.py), held equal here."""
from __future__ import annotations

import json
import re
import socket

import pytest
import yaml
from conftest import require_tool, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory
from proxy_helpers import start_proxy, start_sims
from test_nginx_auth import request
from test_render import k100

from proxy import routes
from proxy.app import NOT_SERVED
from proxy.config import ConfigError, parse_config

from fleet import render
from fleet.errors import InventoryError
from fleet.settings import schema

MANAGEMENT = [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/reset_prefix_cache"),
              ("POST", "/sleep"), ("POST", "/wake_up"), ("POST", "/start_profile"), ("POST", "/stop_profile"),
              ("POST", "/collective_rpc"), ("GET", "/is_sleeping"), ("GET", "/version"), ("POST", "/tokenize"),
              ("GET", "/v1/chat/completions"), ("POST", "/v1/chat/completions/batch"), ("POST", "/v1/nothing"),
              ("POST", "/v1/%6Coad_lora_adapter"), ("POST", "//v1/load_lora_adapter")]


@pytest.mark.unit
def test_the_schema_and_the_proxy_declare_the_same_routes():
    assert schema.INFERENCE_ROUTES == routes.INFERENCE_ROUTES
    assert schema.OPEN_ROUTE.pattern == routes.OPEN_ROUTE.pattern


@pytest.mark.unit
def test_the_list_passes_the_inference_api_and_nothing_else():
    """1. Every inference route with its method passes. 2. Management, another method, an unknown path and
    a path spelled so that the engine's server decodes it to a refused one do not. 3. A path the engine
    decodes to an allowed one passes: the check reads the path as uvicorn routes it."""
    r = routes.Routes.of()
    assert all(r.allows(m, p) for m, p in routes.INFERENCE_ROUTES)
    assert not any(r.allows(m, p) for m, p in MANAGEMENT)
    assert r.allows("POST", "/v1/chat%2Fcompletions?x=1") and not r.allows("POST", "/v1/chat/completions/")


@pytest.mark.unit
def test_open_routes_add_a_method_a_path_or_a_segment_pattern():
    r = routes.Routes.of(("GET /version", "/tokenize", "GET /v1/responses/{response_id}"))
    assert r.allows("GET", "/version") and not r.allows("POST", "/version")
    assert r.allows("POST", "/tokenize") and r.allows("GET", "/tokenize")
    assert r.allows("GET", "/v1/responses/resp_1") and not r.allows("GET", "/v1/responses/a/b")
    assert not r.allows("POST", "/v1/responses/resp_1") and not r.allows("POST", "/sleep")


@pytest.mark.unit
@pytest.mark.parametrize("entry", ["/v1/load_lora_adapter", "POST /sleep", "/collective_rpc", "/health",
                                   "GET /metrics", "/v1/../sleep", "v1/x", "POST  /x", "FETCH /x", "/a b",
                                   "/a;b", '/a"b', "/{x"])
def test_a_route_that_may_not_be_opened_is_refused_in_one_sentence(entry):
    """The schema refuses the engines' management and the entry's own paths, and any entry that is not
    `[METHOD ]/path` (so nothing but URL-safe characters reaches nginx.conf); the proxy refuses the shapes."""
    with pytest.raises(InventoryError) as e:
        k100([f"proxy.open_routes={json.dumps([entry])}"])
    assert str(e.value).startswith("--set: proxy.open_routes: expected a list of routes, each `/path` or "
                                   "`METHOD /path`") and str(e.value).endswith(f"/metrics, got {entry!r}."), str(e.value)
    assert "none of them an engine's management route (docs/proxy.md)" in str(e.value)
    if routes.parse_route(entry) is None:
        with pytest.raises(ConfigError) as c:
            parse_config({"backends": ["a:1"], "open_routes": [entry]})
        assert str(c.value).startswith(f"open_routes: {entry!r} is not `/path` or `METHOD /path`")


@pytest.mark.unit
def test_the_open_routes_render_into_both_fronts():
    """1. conf/proxy.yaml carries open_routes as the proxy reads them (none without the key). 2. nginx.conf's
    map has a case-sensitive regex per route that matches "$request_method $uri" as the proxy's list does."""
    opened = ["GET /version", "/tokenize", "GET /v1/responses/{response_id}"]
    files = {f.path: f.content for f in render.render_host(k100([f"proxy.open_routes={json.dumps(opened)}"]))}
    assert parse_config(yaml.safe_load(files["conf/proxy.yaml"])).open_routes == tuple(opened)
    assert "open_routes" not in {f.path: f.content for f in render.render_host(k100())}["conf/proxy.yaml"]
    keys = re.findall(r'^\s*"(~[^"]+)" 1;$', files["conf/nginx.conf"], re.M)
    regexes = [re.compile(k[1:].replace("\\\\", "\\")) for k in keys]
    proxy_side = routes.Routes.of(tuple(opened))
    for method, path in [*routes.INFERENCE_ROUTES, *MANAGEMENT, ("GET", "/version"), ("PUT", "/tokenize"),
                         ("GET", "/v1/responses/r1"), ("post", "/v1/completions"), ("POST", "/v1/completionsX")]:
        assert any(x.match(f"{method} {path}") for x in regexes) == proxy_side.allows(method, path), (method, path)


def _check_front(entry: int, instance: int, adapter, key: str | None = None, model: str = "m",
                 opened=()) -> None:
    """What must hold on either front: the management routes (but those opened) answer the entry's own 404,
    no backend named; the adapter routes do exist on the instance's own port; the inference API passes."""
    for method, path in [r for r in MANAGEMENT if r[1] not in opened]:
        status, headers, body = request(entry, path, key, method, {"lora_name": "x", "lora_path": str(adapter)})
        assert status == 404 and body == {"error": {"message": NOT_SERVED, "type": "NotFoundError", "code": 404}}, \
            (method, path, status, body)
        assert "x-backend" not in headers, (path, headers)
    load = {"lora_name": "via-instance", "lora_path": str(adapter)}
    assert request(instance, "/v1/load_lora_adapter", None, "POST", load)[0] == 200
    assert request(instance, "/v1/unload_lora_adapter", None, "POST", {"lora_name": "via-instance"})[0] == 200
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert request(entry, "/v1/chat/completions", key, "POST", chat)[0] == 200
    assert request(entry, "/v1/models", key)[0] == 200


def _adapter(tmp_path):
    adapter = tmp_path / "adapters" / "a"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    return adapter


@pytest.mark.process
def test_the_proxy_refuses_the_engines_management_and_opens_what_open_routes_says(procs, tmp_path, monkeypatch):
    """1. Two sims with runtime adapter loading on; the proxy before them. 2. Every management route (and
    anything off the list) is the proxy's 404, while the instance's own port loads and unloads adapters.
    3. open_routes [GET /version] by a reload (no restart): GET /version reaches a sim, POST /version not."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    sims = start_sims(procs, tmp_path, 2, extra=("--enable-lora",))
    port, admin = start_proxy(procs, tmp_path, sims)
    _check_front(port, sims[0], _adapter(tmp_path))
    conf = yaml.safe_load((tmp_path / "proxy.yaml").read_text())
    (tmp_path / "proxy.yaml").write_text(yaml.safe_dump({**conf, "open_routes": ["GET /version"]}))
    assert request(admin, "/admin/reload", method="POST")[0] == 200
    status, headers, body = request(port, "/version")
    assert status == 200 and headers["x-backend"] in {f"127.0.0.1:{p}" for p in sims} and "version" in body
    assert request(port, "/version", method="POST")[0] == 404
    # An absolute-form target (RFC 9112 3.2.2) is judged by the path it is sent to, as nginx does.
    assert _absolute(port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}) == 404
    assert _absolute(port, "/v1/chat/completions",
                     {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}) == 200


def _absolute(port: int, path: str, body: dict) -> int:
    """The status of a POST whose request line names the absolute URL `http://entry<path>`."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST http://entry{path} HTTP/1.1\r\nHost: entry\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        head = s.recv(65536).split(b"\r\n", 1)[0]
    return int(head.split()[1])


@pytest.mark.nginx
@pytest.mark.cluster
def test_both_fronts_refuse_the_engines_management_with_runtime_adapters_on(tmp_path):
    """1. A plain sim host whose engines load adapters at runtime (VLLM_ALLOW_RUNTIME_LORA_UPDATING and
    --enable-lora, as an operator may set by hand: nginx fronts only plain hosts), API keys on, deployed.
    2. The proxy: the management routes are its 404 with a valid key, the instances serve them.
    3. swap-to-nginx: the same, in the same words; open_routes' GET /version passes nginx too."""
    require_tool("nginx")
    keys = tmp_path / "keys"
    keys.write_text("sk-routes-1\n")
    inventory = write_inventory(tmp_path, instances=2, extra=f"""\
        extra_args: [--enable-lora]
        env_setup: export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
        """)
    inventory.write_text(inventory.read_text().replace(
        "  health_interval_s: 0.5", f"  health_interval_s: 0.5\n      api_keys_file: {keys}\n"
        "      open_routes: [GET /version]"))
    dep = deployment_id(inventory)
    adapter = _adapter(tmp_path)
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        st = status_json(inventory)
        entry, instance = st["proxy"]["port"], st["instances"][0]["port"]
        for front in ("proxy", "nginx"):
            if front == "nginx":
                r = inv("swap-to-nginx", "--host", "t", inventory=inventory)
                assert r.returncode == 0, r.stdout + r.stderr
                wait_until(lambda: request(entry, "/health")[1].get("x-front") == "nginx", what="nginx on the port")
            _check_front(entry, instance, adapter, "sk-routes-1", "Test-Model", opened=("/version",))
            assert request(entry, "/v1/models")[0] == 401, front
            assert request(entry, "/version", "sk-routes-1")[0] == 200, front
            assert request(entry, "/version", "sk-routes-1", "POST")[0] == 404, front
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(dep + "/")
