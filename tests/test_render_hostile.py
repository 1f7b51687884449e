"""Inventory values never become code: every string field the schema has, set to hostile values, is
either refused in one sentence or rendered so that it stays one literal value in every file it lands in.

The fields are found by walking fleet.settings.schema (a new string field is covered without editing this file);
each payload below is tried in each of them. A value the schema refuses is refused at load with the
inventory's sentence, one nginx.conf or keepalived.conf cannot hold is refused at render with one; all
the accepted ones of a payload are then rendered together, for a plain entry host behind a virtual
address (keepalived.conf, check_front.sh) and a models host, and checked: `bash -n` and shellcheck on
the scripts, `nginx -t` on nginx.conf, `keepalived -t` on keepalived.conf, YAML and JSON configs read
back with every value whole, and the start, stop and check scripts run with stubs in place of setsid,
ss and python3: no marker file appears, and each value reaches its command as one whole argument.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import types
import typing
from pathlib import Path

import pytest
import yaml
from conftest import require_tool

from fleet import render
from fleet.errors import FleetError, InventoryError
from fleet.settings import inventory, schema

# env_setup is shell code by design (docs/inventory.md): the one string field not checked here.
SHELL_BY_DESIGN = {("env_setup",)}

# {t}: the field's tag (unique per field: each value can be found again wherever it lands);
# {m}: the marker file a value that ran as code would create; {s}: the sandbox (an absolute path is there).
PAYLOADS = {
    "command substitution": "x{t}$(touch {m})",
    "backticks": "x{t}`touch {m}`",
    "semicolon and comment": "x{t};touch {m};#",
    "single quotes": "x{t}' ; touch {m} ; '",
    "double quotes": 'x{t}" ; touch {m} ; "',
    "newline": "x{t}\ntouch {m}\n",
    "braces, globs, backslash, dollar": "x{t}{{}}#!*?[a]\\$HOME",
    "path with blanks": "{s}/x{t} y/`touch {m}` z",
    "dashes and equals": "--x{t}=`touch {m}`",
    "non-ASCII": "x{t}\u00fc\U0001F600\u2028",
    "zone id": "fe80::1%{t}",
    "zone id injection": "::1%{t}$(touch {m})",
    "zone id with a newline": "::1%{t}\ntouch {m}",
    "URL": "http://h{t}/`touch {m}`$(touch {m})",
}


# --- the schema's string fields --------------------------------------------------------------------

def string_kinds(annotation) -> list[str]:
    """How a field holds free text: `str`, `list` (of strings), `key` / `value` (of a mapping)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is str:
        return ["str"]
    if origin is typing.Annotated:
        return string_kinds(args[0])
    if origin in (typing.Union, types.UnionType):
        return [k for a in args for k in string_kinds(a)]
    if origin is list:
        return ["list"] if string_kinds(args[0]) == ["str"] else []
    if origin is dict:
        return ((["key"] if string_kinds(args[0]) == ["str"] else [])
                + (["value"] if string_kinds(args[1]) == ["str"] else []))
    return []


def string_fields(model=schema.HostSettings, at: tuple = ()):
    """(key path, kind) of every string the schema lets an inventory set; `models` items as models.0."""
    for name, info in model.model_fields.items():
        for kind in string_kinds(info.annotation):
            yield at + (name,), kind
        sub = schema.section_of(info.annotation)
        if sub is not None:
            yield from string_fields(sub, at + ((name, 0) if name == "models" else (name,)))


FIELDS = [(path, kind) for path, kind in string_fields() if path not in SHELL_BY_DESIGN]


def dotted(path) -> str:
    return ".".join(str(p) for p in path)


# --- the inventory ---------------------------------------------------------------------------------

def interface() -> str:
    """An interface this machine has, so that `keepalived -t` goes on to check the track script (it stops
    at a missing one); loopback when there is no other (keepalived ignores it for VRRP, and goes on)."""
    names = sorted(p.name for p in Path("/sys/class/net").iterdir()) if Path("/sys/class/net").is_dir() else []
    return next((n for n in names if n != "lo" and schema.INTERFACE.match(n)), "lo")


def base(sandbox: Path) -> dict:
    """e1 and e2: entries sharing a virtual address (e1 is rendered), fronting m2, a plain vLLM host; m1: a
    local models host.
    API keys, tenants, adapters and both OTLP settings are set, so every template's optional part renders."""
    entry = {"engine": "vllm", "accelerator": "nvidia", "accelerators": 2, "instances": 2, "model": "/models/m",
             "vrrp": {"addresses": ["10.9.0.100/24"], "interface": interface()}, "fronts": ["m2"],
             "proxy": {"api_keys_file": "/keys/api_keys", "tenants": {"team": {"weight": 2}},
                       "otlp": {"endpoint": "http://collector:4318/v1/traces"}},
             "otlp_traces_endpoint": "http://collector:4317", "lora_modules": {"ad": "/adapters/ad"}}
    return {"defaults": {"stagger_s": 0, "python": "python3"}, "hosts": {
        "e1": {**copy.deepcopy(entry), "ssh": {"host": "10.9.0.1"}, "address": "10.9.0.1",
               "deploy_dir": str(sandbox / "e1")},
        "e2": {**copy.deepcopy(entry), "ssh": {"host": "10.9.0.2"}, "address": "10.9.0.2",
               "deploy_dir": str(sandbox / "e2")},
        "m2": {"engine": "vllm", "accelerator": "nvidia", "accelerators": 2, "instances": 2, "model": "/models/m",
               "ssh": {"host": "10.9.0.10"}, "address": "10.9.0.10", "deploy_dir": str(sandbox / "m2")},
        "m1": {"connection": "local", "engine": "vllm", "accelerator": "nvidia", "accelerators": 2,
               "base_port": 18102, "deploy_dir": str(sandbox / "m1"), "runtime_lora": True,
               "proxy": {"port": 18100, "admin_port": 18101}, "keeper": {"metrics_port": 18199},
               "models": [{"name": "vision", "model": "/models/v", "aliases": ["see"],
                           "lora_modules": {"ad": "/adapters/ad"}, "extra_args": ["--dtype", "bfloat16"]},
                          {"name": "text", "model": "/models/t"}]}}}


def put(data: dict, path: tuple, kind: str, value: str) -> None:
    """Set one string field of the inventory: a host's keys on e1, m1 and m2, a model group's on m1's first."""
    hosts = ["m1"] if path[0] == "models" else ["e1", "m1", "m2"]
    for host in hosts:
        node = data["hosts"][host]
        for key in path[:-1]:
            node = node[key] if isinstance(key, int) else node.setdefault(key, {})
        node[path[-1]] = {"str": value, "list": [value],
                          "key": {value: {} if path[-1] == "tenants" else "/adapters/x"},
                          "value": {"other-" + dotted(path): value}}[kind]


def field_layer(path: tuple, kind: str, value: str) -> dict:
    """The field alone, as one host layer."""
    data = {"hosts": {"m1": {"models": [{}]}, "e1": {}, "m2": {}}}
    put(data, path, kind, value)
    return data["hosts"]["m1"]


def render_all(data: dict, sandbox: Path, name: str) -> dict:
    """Load the inventory and render e1, m1 and m2 as `inv render` does, with the sandbox for the hosts'
    home (`~` and a relative deploy_dir are there): {host: ({path: file}, host vars)}."""
    path = sandbox / f"{name}.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=False))
    inv = inventory.load(path)
    out = {}
    for host in ("e1", "m1", "m2"):
        hv = render.offline(inv.host_vars(host), str(sandbox))
        out[host] = ({f.path: f for f in render.render_host(hv)}, hv)
    return out


def one_sentence(message: str, path: tuple) -> None:
    assert "\n" not in message and message.endswith("."), message
    assert "Traceback" not in message
    assert (str(path[-1]) in message if "cannot hold" not in message else message.startswith("conf/")), message


class Case:
    """One payload: the value each field got, the fields that refused it (and why), the rendering."""

    def __init__(self, payload: str, sandbox: Path):
        self.marker_dir = sandbox / "pwned"
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        self.values = {path: (kind, PAYLOADS[payload].format(t=f"q{i:02d}q", m=self.marker_dir / f"m{i:02d}",
                                                             s=sandbox))
                       for i, (path, kind) in enumerate(FIELDS)}
        self.refused: dict[tuple, str] = {}
        for path, (kind, value) in self.values.items():
            try:
                inventory.check_layer(field_layer(path, kind, value), "hosts.yml", "hosts.m1")
            except InventoryError as e:
                self.refused[path] = str(e)
        self.sandbox = sandbox
        self.files = self._render()

    def accepted(self):
        return {p: v for p, v in self.values.items() if p not in self.refused}

    def _inventory(self, fields) -> dict:
        data = base(self.sandbox)
        for path, (kind, value) in fields.items():
            put(data, path, kind, value)
        return data

    def _render(self) -> dict:
        """Everything accepted at once; a value refused at load (a rule across keys) or at render (what
        nginx.conf or keepalived.conf cannot hold) is found alone, its sentence kept, and left out."""
        try:
            return render_all(self._inventory(self.accepted()), self.sandbox, "all")
        except FleetError:
            pass
        for path, field in self.accepted().items():
            try:
                render_all(self._inventory({path: field}), self.sandbox, "one")
            except FleetError as e:
                self.refused[path] = str(e)
        return render_all(self._inventory(self.accepted()), self.sandbox, "all")

    def tagged(self):
        """(tag, value) of every accepted value."""
        return [(re.search(r"q\d\dq", v).group(0), v) for _, v in self.accepted().values()]

    def assert_whole(self, strings, where: str) -> None:
        """Every string that holds a value's tag holds the whole value: nothing cut, split or changed."""
        for tag, value in self.tagged():
            for s in strings:
                if tag in s:
                    assert value in s, f"{where}: {value!r} arrived as {s!r}"


@pytest.fixture(scope="module", params=list(PAYLOADS))
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp("hostile"))


# --- refusals --------------------------------------------------------------------------------------

@pytest.mark.unit
def test_every_string_field_is_walked():
    """The walk finds the fields of nested sections, lists and mappings (a new one is covered as it comes)."""
    found = {dotted(p) for p, _ in FIELDS}
    assert {"bind", "proxy.bind", "address", "ssh.host", "served_model_name", "models.0.name", "deploy_dir",
            "extra_args", "lora_modules", "proxy.tenants", "vrrp.interface", "nginx.log_dir"} <= found


@pytest.mark.unit
def test_a_refused_value_is_refused_in_one_sentence_naming_its_key(case):
    """Each field either takes the payload or refuses it with one sentence naming the key (or, at render,
    the file that cannot hold it), never a traceback."""
    for path, message in case.refused.items():
        one_sentence(message, path)


@pytest.mark.unit
@pytest.mark.parametrize("key", ["bind", "address", "ssh.host", "proxy.bind"])
def test_an_address_takes_an_interface_name_as_zone_id_and_nothing_else(tmp_path, key):
    """The issue's case: `bind: "::1%$(touch pwned)"` passed the schema. A zone id is an interface name;
    proxy.bind (nginx's listen) takes none."""
    path = tuple(key.split("."))
    for value in ("::1%$(touch pwned)", "::1%eth0\nx", "fe80::1%eth0;x", "fe80::1%a-very-long-name0",
                  "10.0.0.1%eth0"):
        with pytest.raises(InventoryError, match=re.escape(key.split(".")[-1]) + ": expected an IP address"):
            inventory.check_layer(field_layer(path, "str", value), "hosts.yml", "hosts.m1")
    layer = field_layer(path, "str", "fe80::1%eth0.100")
    if key == "proxy.bind":
        with pytest.raises(InventoryError, match="no %zone"):
            inventory.check_layer(layer, "hosts.yml", "hosts.m1")
    else:
        inventory.check_layer(layer, "hosts.yml", "hosts.m1")


@pytest.mark.unit
def test_the_engines_bind_default_is_quoted_and_its_override_still_wins(tmp_path):
    data = base(tmp_path)
    data["hosts"]["m1"]["bind"] = "fe80::1%eth0"
    script = render_all(data, tmp_path, "bind")["m1"][0]["bin/start_cluster.sh"].content
    assert "BIND=${BIND:-fe80::1%eth0}\n" in script


# --- the rendered files ----------------------------------------------------------------------------

def scripts(case):
    return {f"{host}/{path}": f.content for host, (files, _) in case.files.items()
            for path, f in files.items() if path.endswith(".sh")}


@pytest.mark.unit
def test_scripts_parse_and_are_shellcheck_clean(case, tmp_path):
    shellcheck = require_tool("shellcheck")
    paths = []
    for name, text in scripts(case).items():
        p = tmp_path / name.replace("/", "-")
        p.write_text(text)
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, f"{name}: {r.stderr}"
        paths.append(str(p))
    r = subprocess.run([shellcheck, "-S", "warning", *paths], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.unit
def test_yaml_and_json_configs_read_back_every_value_whole(case):
    """proxy.yaml and prometheus.yml (YAML), hostagent.json and nginx_front.json (JSON): each value that
    lands there is read back whole (a character beyond U+FFFF as well: YAML reads a JSON surrogate pair
    as two characters)."""
    for host, (files, _) in case.files.items():
        for path, f in files.items():
            if path.endswith((".yaml", ".yml")):
                data = yaml.safe_load(f.content)
            elif path.endswith(".json"):
                data = json.loads(f.content)
            else:
                continue
            case.assert_whole(list(strings_in(data)), f"{host}:{path}")


def strings_in(data):
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict):
        for k, v in data.items():
            yield from strings_in(k)
            yield from strings_in(v)
    elif isinstance(data, list):
        for v in data:
            yield from strings_in(v)


@pytest.mark.nginx
def test_nginx_conf_passes_nginx_t_with_every_path_where_the_watcher_config_says(case, tmp_path, monkeypatch):
    """nginx -t, with the files nginx.conf includes and the directories it writes to made where
    nginx_front.json (the same values, as JSON) says they are: a path nginx read otherwise fails it."""
    nginx = require_tool("nginx")
    files, _ = case.files["e1"]
    front = json.loads(files["conf/nginx_front.json"].content)
    monkeypatch.chdir(tmp_path)             # a relative path is nginx's prefix's, tmp_path
    for d in (front["log_dir"], front["temp_dir"]):
        Path(d).mkdir(parents=True, exist_ok=True)
    for conf in (front["upstream_file"], front["keys_conf"]):
        Path(conf).parent.mkdir(parents=True, exist_ok=True)
    Path(front["upstream_file"]).write_text("server 127.0.0.1:9;\n")
    Path(front["keys_conf"]).write_text('map $http_authorization $fleet_authorized {\n    default 0;\n}\n')
    conf = tmp_path / "nginx.conf"
    conf.write_text(files["conf/nginx.conf"].content)
    r = subprocess.run([nginx, "-t", "-p", f"{tmp_path}/", "-e", front["error_log"], "-c", str(conf)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert Path(front["access_log"]).exists()
    assert list(case.marker_dir.iterdir()) == []


@pytest.mark.unit
def test_keepalived_conf_passes_keepalived_t_and_finds_its_script(case, tmp_path):
    """keepalived -t: the track script, made where the deploy puts it, is found (keepalived splits its
    command as a shell would); nothing else is said but a word on the interface and on script security."""
    keepalived = require_tool("keepalived")
    files, hv = case.files["e1"]
    script = Path(hv.settings.deploy_dir) / "bin" / "check_front.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(files["bin/check_front.sh"].content)
    script.chmod(0o755)
    conf = tmp_path / "keepalived.conf"
    conf.write_text(files["conf/keepalived.conf"].content)
    r = subprocess.run([keepalived, "-t", "-f", str(conf), "-l"], capture_output=True, text=True, timeout=30)
    out = (r.stdout + r.stderr).splitlines()
    assert [line for line in out if "interface" not in line and "SECURITY VIOLATION" not in line] == [], out
    assert list(case.marker_dir.iterdir()) == []


# --- running the scripts ---------------------------------------------------------------------------

STUB = """#!/bin/bash
# Records its argv (NUL-separated) instead of running anything.
[ "$(basename "$0")" = python3 ] && [ "${1-}" = -c ] && exit 0
[ "$(basename "$0")" = ss ] && exit 0
f=$(mktemp "$ARGV_DIR/call.XXXXXX")
printf '%s\\0' "$(basename "$0")" "$@" >"$f"
"""


def run_script(text: str, sandbox: Path, env: dict) -> subprocess.CompletedProcess:
    """Run a rendered script in sandbox with stubs first on the PATH."""
    stubs = sandbox / "stubs"
    if not stubs.exists():
        stubs.mkdir()
        for name in ("setsid", "ss", "python3"):
            (stubs / name).write_text(STUB)
            (stubs / name).chmod(0o755)
    (sandbox / "argv").mkdir(exist_ok=True)
    script = sandbox / "script.sh"
    script.write_text(text)
    return subprocess.run(["bash", str(script)], cwd=sandbox, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(sandbox),
                               "ARGV_DIR": str(sandbox / "argv"), **env})


def decoded(arg: str) -> list[str]:
    """An argument's strings: stop_cluster.sh passes its spec as one JSON argument."""
    try:
        return list(strings_in(json.loads(arg))) if arg.startswith("{") else [arg]
    except ValueError:
        return [arg]


def calls(sandbox: Path) -> list[list[str]]:
    out = [p.read_bytes().decode().split("\0")[:-1] for p in sorted((sandbox / "argv").iterdir())]
    for p in (sandbox / "argv").iterdir():
        p.unlink()
    return out


@pytest.mark.process
def test_the_scripts_run_no_value_and_pass_each_as_one_argument(case, tmp_path):
    """start_cluster.sh, start_proxy.sh, stop_cluster.sh and check_front.sh run with stubs for setsid, ss
    and python3: no marker file appears, and every value reaches the (stubbed) command whole."""
    for host, (files, hv) in case.files.items():
        for path in ("bin/start_cluster.sh", "bin/start_proxy.sh", "bin/stop_cluster.sh", "bin/check_front.sh"):
            if path not in files:
                continue
            r = run_script(files[path].content, tmp_path, {})
            argv = calls(tmp_path)
            assert list(case.marker_dir.iterdir()) == [], f"{host}:{path} ran a value: {r.stdout}{r.stderr}"
            if path == "bin/check_front.sh" or (path == "bin/start_cluster.sh" and not hv.settings.instances):
                continue                    # an entry host runs no instance
            assert argv, f"{host}:{path} ran nothing: {r.stdout}{r.stderr}"
            case.assert_whole([s for call in argv for a in call for s in decoded(a)], f"{host}:{path}")
            if path == "bin/start_cluster.sh":
                assert sum("--host" in call for call in argv) == hv.settings.instances, r.stdout + r.stderr
                assert all(call[call.index("--host") + 1] == hv.settings.bind for call in argv if "--host" in call)


@pytest.mark.process
def test_start_cluster_overrides_still_win_over_the_quoted_defaults(tmp_path):
    """N, BASE_PORT, MAX_LEN, MAX_SEQS, EAGER and BIND set in the environment reach the engine's command."""
    data = base(tmp_path)
    data["hosts"]["m2"]["bind"] = "fe80::1%eth0"
    files, _ = render_all(data, tmp_path, "overrides")["m2"]
    r = run_script(files["bin/start_cluster.sh"].content, tmp_path,
                   {"N": "1", "BASE_PORT": "19000", "MAX_LEN": "77", "MAX_SEQS": "3", "EAGER": "1",
                    "BIND": "127.0.0.2"})
    engines = [c for c in calls(tmp_path) if "--host" in c]
    assert len(engines) == 1, r.stdout + r.stderr
    argv = engines[0]
    for flag, value in (("--host", "127.0.0.2"), ("--port", "19000"), ("--max-model-len", "77"),
                        ("--max-num-seqs", "3")):
        assert argv[argv.index(flag) + 1] == value
    assert "--enforce-eager" in argv
    run_script(files["bin/start_cluster.sh"].content, tmp_path, {"N": "1"})
    argv = [c for c in calls(tmp_path) if "--host" in c][0]
    assert argv[argv.index("--host") + 1] == "fe80::1%eth0"
