"""The inventory: a YAML file of defaults, groups and hosts -> validated per-host variables.

Variables resolve in this order, later wins: built-in defaults < `defaults:` < each group the host is in
(in file order) < the host's own keys < `--set key=value` from the command line. Every layer is checked
against SCHEMA on its own, so an error names the file and the exact key path where the bad value lives.
"""
from __future__ import annotations

import copy
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import InventoryError

DEFAULT_INVENTORY = "inventory/hosts.yml"
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class Port:
    """Schema marker: an integer TCP port (1-65535)."""


class Str:
    """Schema marker: a string, optionally one of a set of choices."""

    def __init__(self, *choices: str):
        self.choices = choices


class StrList:
    """Schema marker: a list of strings."""


class Mapping(dict):
    """Schema marker: a nested mapping whose keys are checked in turn (`proxy`, `ssh`...)."""


# Key -> type. bool, int, float are checked as such (True is not an integer here); None allowed via OPTIONAL.
SCHEMA: dict[str, Any] = {
    "connection": Str("local", "ssh"),
    "ssh": Mapping(host=Str(), port=Port, user=Str(), key_file=Str(),
                   accept_new_host_key=bool, connect_timeout_s=float, known_hosts=Str()),
    "engine": Str("vllm", "sim"),
    "accelerator": Str("dcu", "rocm", "nvidia", "sim"),
    "accelerators": int,
    "instances": int,
    "base_port": Port,
    "model": Str(),
    "served_model_name": Str(),
    "max_num_seqs": int,
    "max_model_len": int,
    "enforce_eager": bool,
    "gpu_memory_utilization": float,
    "extra_args": StrList,
    "env_setup": Str(),
    "python": Str(),
    "vllm_bin": Str(),
    "deploy_dir": Str(),
    "stagger_s": float,
    "health_timeout_s": float,
    "stop_grace_s": float,
    "release_timeout_s": float,
    "release_threshold_mib": float,
    "drain_timeout_s": float,
    "smi": Str(),
    "sim": Mapping(load_s=float, prefill_ms=float, token_ms=float, output_tokens=int, instant=bool),
    "address": Str(),
    "fronts": StrList,
    "proxy": Mapping(
        port=Port, admin_port=Port, bind=Str(), health_interval_s=float, timeout_s=float,
        connect_timeout_s=float, max_body_mb=float, retries=int, max_fails=int, shutdown_timeout_s=float,
        fix_numeric_user=bool, api_keys_file=Str(),
        results_log=Mapping(max_mb=float, backups=int),
        queue=Mapping(max=int, timeout_s=float, headroom=int),
    ),
    "nginx": Mapping(bin=Str(), user=Str(), log_dir=Str(), temp_dir=Str(), worker_processes=Str(),
                     max_fails=int, fail_timeout_s=float, keepalive=int),
}

# Keys that may be null (meaning "work it out": the host's python3, the model path as served name...).
OPTIONAL = {"address", "connection", "python", "served_model_name", "ssh", "vllm_bin", "smi"}

BUILTIN_DEFAULTS: dict[str, Any] = {
    "connection": None,
    "engine": "vllm",
    "accelerator": "dcu",
    "accelerators": 8,
    "instances": 8,
    "base_port": 8002,
    "model": "",
    "served_model_name": None,
    "max_num_seqs": 4,
    "max_model_len": 8192,
    "enforce_eager": False,
    "gpu_memory_utilization": 0.9,
    "extra_args": [],
    "env_setup": "",
    "python": None,
    "vllm_bin": None,
    "deploy_dir": "~/vllm-fleet",
    "stagger_s": 5.0,
    "health_timeout_s": 600.0,
    "stop_grace_s": 10.0,
    "release_timeout_s": 60.0,
    "release_threshold_mib": 1024.0,
    "drain_timeout_s": 60.0,
    "smi": None,
    "ssh": None,
    "address": None,
    "fronts": [],
    "sim": {"load_s": 3.0, "prefill_ms": 100.0, "token_ms": 10.0, "output_tokens": 200, "instant": False},
    "proxy": {
        "port": 8000, "admin_port": 8001, "bind": "0.0.0.0", "health_interval_s": 5.0,
        "timeout_s": 300.0, "connect_timeout_s": 5.0, "max_body_mb": 64.0,
        "retries": 2, "max_fails": 3, "shutdown_timeout_s": 30.0, "fix_numeric_user": True,
        "api_keys_file": "",
        "results_log": {"max_mb": 50.0, "backups": 3},
        # A backend takes max_num_seqs + headroom at once; the rest wait in the proxy's one queue.
        "queue": {"max": 256, "timeout_s": 60.0, "headroom": 0},
    },
    # nginx mode (`inv swap-to-nginx`); empty strings mean: found on the host / under deploy_dir.
    "nginx": {"bin": "", "user": "", "log_dir": "", "temp_dir": "", "worker_processes": "auto",
              "max_fails": 1, "fail_timeout_s": 5.0, "keepalive": 64},
}


@dataclass
class Inventory:
    """A loaded, checked inventory: where it came from, its groups and each host's own layers."""

    path: str
    defaults: dict
    groups: dict[str, dict]          # group -> {"hosts": [...], vars...}
    hosts: dict[str, dict]           # host -> its own keys

    def select(self, pattern: str) -> list[str]:
        """Host names for `--host`: a host, a group, `all`, or a comma list of those."""
        names: list[str] = []
        for part in (p.strip() for p in pattern.split(",")):
            if not part:
                continue
            if part == "all":
                found = list(self.hosts)
            elif part in self.hosts:
                found = [part]
            elif part in self.groups:
                found = list(self.groups[part].get("hosts", []))
            else:
                known = ", ".join(sorted(self.hosts) + sorted(self.groups))
                raise InventoryError(f"{self.path}: no host or group named {part!r} (known: {known}).")
            names += [n for n in found if n not in names]
        if not names:
            raise InventoryError(f"{self.path}: --host {pattern!r} selects no host.")
        return names

    def host_vars(self, name: str, overrides: list[str] | tuple[str, ...] = ()) -> "HostVars":
        """The resolved, validated variables of one host, `--set` overrides applied last."""
        merged = copy.deepcopy(BUILTIN_DEFAULTS)
        _merge(merged, self.defaults)
        for gname, group in self.groups.items():
            if name in group.get("hosts", []):
                _merge(merged, {k: v for k, v in group.items() if k != "hosts"})
        _merge(merged, self.hosts[name])
        _merge(merged, parse_overrides(overrides))
        if merged["connection"] is None:          # not said anywhere: an ssh block means ssh
            merged["connection"] = "ssh" if merged.get("ssh") else "local"
        hv = HostVars.build(name, merged, self.path)
        if hv["fronts"]:
            from .cluster import front_backends   # an entry host's backends are its members' instances
            hv.front_backends = front_backends(self, hv, overrides)
        return hv


def _merge(into: dict, layer: dict) -> None:
    """Deep-merge layer into `into`: mappings merge key by key, everything else replaces."""
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def load(path: str | os.PathLike | None = None) -> Inventory:
    """Read and check an inventory file (default: $FLEET_INVENTORY, else inventory/hosts.yml)."""
    path = str(path or os.environ.get("FLEET_INVENTORY") or DEFAULT_INVENTORY)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InventoryError(f"{path}: cannot read the inventory (it is not UTF-8 text).") from None
    except FileNotFoundError:
        raise InventoryError(f"{path}: no such inventory file; pass -i FILE or set FLEET_INVENTORY.") from None
    except OSError as e:
        raise InventoryError(f"{path}: cannot read the inventory ({e.strerror}).") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise InventoryError(f"{path}: not valid YAML{where}; fix the syntax there.") from None
    if not isinstance(data, dict):
        raise InventoryError(f"{path}: expected a mapping with defaults, groups and hosts at the top.")
    unknown = set(data) - {"defaults", "groups", "hosts"}
    if unknown:
        raise InventoryError(f"{path}: {sorted(unknown)[0]}: unknown top-level key; "
                             "use defaults, groups and hosts.")
    defaults = _mapping(data.get("defaults"), path, "defaults")
    groups = _mapping(data.get("groups"), path, "groups")
    hosts = _mapping(data.get("hosts"), path, "hosts")
    if not hosts:
        raise InventoryError(f"{path}: hosts: no host defined; add at least one under hosts.")
    check_layer(defaults, path, "defaults")
    for hname, hvars in list(hosts.items()):
        if not isinstance(hname, str) or not HOST_NAME.match(hname):
            raise InventoryError(f"{path}: hosts.{hname}: a host name takes letters, digits, '.', '_' "
                                 "and '-' only; rename it.")
        hosts[hname] = hvars = _mapping(hvars, path, f"hosts.{hname}")
        check_layer(hvars, path, f"hosts.{hname}")
    for gname, group in list(groups.items()):
        groups[gname] = group = _mapping(group, path, f"groups.{gname}")
        members = group.get("hosts", [])
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise InventoryError(f"{path}: groups.{gname}.hosts: expected a list of host names.")
        for m in members:
            if m not in hosts:
                raise InventoryError(f"{path}: groups.{gname}.hosts: {m!r} is not defined under hosts.")
        if gname in hosts:
            raise InventoryError(f"{path}: groups.{gname}: a group cannot have the name of a host.")
        check_layer({k: v for k, v in group.items() if k != "hosts"}, path, f"groups.{gname}")
    inv = Inventory(path, defaults, groups, hosts)
    for hname in hosts:          # cross-key checks (port clashes, instances > accelerators) before anything runs
        inv.host_vars(hname)
    return inv


def _mapping(value, path, where) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InventoryError(f"{path}: {where}: expected a mapping, got {_show(value)}.")
    return value


def _show(value) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "a mapping"
    return str(value)


def check_layer(layer: dict, path: str, where: str, schema: dict = SCHEMA) -> None:
    """Check one layer's keys and types against the schema; raise naming `path: where.key`."""
    for key, value in layer.items():
        at = f"{where}.{key}" if where else key
        if key not in schema:
            raise InventoryError(f"{path}: {at}: unknown key; see the inventory reference in README.md.")
        spec = schema[key]
        if value is None and (key in OPTIONAL):
            continue
        _check_value(value, spec, path, at)


def _check_value(value, spec, path, at):
    def bad(expected):
        raise InventoryError(f"{path}: {at}: expected {expected}, got {_show(value)}.")

    if isinstance(spec, Mapping):
        if not isinstance(value, dict):
            bad("a mapping")
        check_layer(value, path, at, spec)
    elif spec is bool:
        if not isinstance(value, bool):
            bad("true or false")
    elif spec is int:
        if isinstance(value, bool) or not isinstance(value, int):
            bad("an integer")
        if value < 0:
            bad("a non-negative integer")
    elif spec is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad("a number")
        if value < 0:
            bad("a non-negative number")
    elif spec is Port:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            bad("a port number (1-65535)")
    elif spec is StrList:
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                                  for v in value):
            bad("a list of strings")
    elif isinstance(spec, Str):
        if not isinstance(value, str):
            bad("a string")
        if spec.choices and value not in spec.choices:
            bad("one of " + ", ".join(spec.choices))


def parse_overrides(overrides) -> dict:
    """`--set key=value` pairs -> a nested layer; values are read as YAML (`6` -> 6, `true` -> True)."""
    layer: dict = {}
    for item in overrides or ():
        if "=" not in item:
            raise InventoryError(f"--set {item}: expected key=value (for example --set max_num_seqs=6).")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        node = layer
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise InventoryError(f"--set {key}: {p} is set twice, once as a value and once as a mapping.")
        node[parts[-1]] = value
    check_layer(layer, "--set", "")
    return layer


@dataclass
class HostVars:
    """One host's resolved variables plus what follows from them (ports, backends, deployment id)."""

    name: str
    vars: dict
    inventory_path: str = ""
    deployment_id: str = ""
    ports: list[int] = field(default_factory=list)
    front_backends: list[str] | None = None    # set on an entry host (`fronts`): its members' instances

    def __getitem__(self, key):
        return self.vars[key]

    @classmethod
    def build(cls, name: str, merged: dict, path: str) -> "HostVars":
        check_layer(merged, path, f"hosts.{name}")
        v = merged
        where = f"{path}: hosts.{name}"
        if v["connection"] == "ssh" and not (v.get("ssh") or {}).get("host"):
            raise InventoryError(f"{where}.ssh.host: connection is ssh but no ssh.host is given; add it.")
        if v["fronts"] and name not in v["fronts"]:
            v["instances"] = 0                    # an entry host that fronts others only runs the proxy
        elif v["instances"] < 1:
            raise InventoryError(f"{where}.instances: expected at least 1 instance, got {v['instances']}.")
        if v["instances"] > v["accelerators"]:
            raise InventoryError(
                f"{where}.instances: {v['instances']} instances but the host has {v['accelerators']} "
                "accelerators (one instance per card); lower instances or raise accelerators.")
        if v["max_num_seqs"] < 1:
            raise InventoryError(f"{where}.max_num_seqs: expected at least 1, got {v['max_num_seqs']}.")
        if not 0 < v["gpu_memory_utilization"] <= 1:
            raise InventoryError(f"{where}.gpu_memory_utilization: expected a fraction in (0, 1], "
                                 f"got {v['gpu_memory_utilization']}.")
        if v["engine"] == "vllm" and not v["model"]:
            raise InventoryError(f"{where}.model: the vllm engine needs a model path; set model.")
        if v["engine"] == "sim" and not v["model"]:
            v["model"] = "sim-model"
        if v["accelerator"] == "sim" and v["engine"] != "sim":
            raise InventoryError(f"{where}.accelerator: the sim accelerator only runs the sim engine; "
                                 "set engine: sim.")
        ports = [v["base_port"] + i for i in range(v["instances"])]
        if ports and ports[-1] > 65535:
            raise InventoryError(f"{where}.base_port: instances would need ports up to {ports[-1]}, "
                                 "past 65535; lower base_port.")
        proxy = v["proxy"]
        for key in ("port", "admin_port"):
            if proxy[key] in ports:
                raise InventoryError(
                    f"{where}.proxy.{key}: {proxy[key]} clashes with instance "
                    f"{ports.index(proxy[key])} (ports {ports[0]}-{ports[-1]}); move one of them.")
        if proxy["port"] == proxy["admin_port"]:
            raise InventoryError(f"{where}.proxy.admin_port: {proxy['admin_port']} is also proxy.port; "
                                 "give the admin listener its own port.")
        if proxy["max_body_mb"] <= 0 or proxy["timeout_s"] <= 0:
            raise InventoryError(f"{where}.proxy: max_body_mb and timeout_s must be above 0.")
        if not 0 < proxy["queue"]["timeout_s"] < float("inf"):
            raise InventoryError(f"{where}.proxy.queue.timeout_s: expected a finite number above 0, "
                                 f"got {proxy['queue']['timeout_s']}.")
        if proxy["retries"] < 0 or proxy["max_fails"] < 1 or proxy["shutdown_timeout_s"] <= 0:
            raise InventoryError(f"{where}.proxy: retries must be 0 or more, max_fails 1 or more and "
                                 "shutdown_timeout_s above 0.")
        if not v["served_model_name"]:
            v["served_model_name"] = os.path.basename(v["model"].rstrip("/")) or v["model"]
        v["extra_args"] = [str(a) for a in v["extra_args"]]
        hv = cls(name=name, vars=v, inventory_path=path, ports=ports)
        hv.deployment_id = deployment_id(name, v["deploy_dir"])
        return hv

    @property
    def backends(self) -> list[str]:
        """The proxy's backends, named host:port as in X-Backend and the admin API."""
        if self.front_backends is not None:
            return list(self.front_backends)
        return [f"127.0.0.1:{p}" for p in self.ports]


def deployment_id(host: str, deploy_dir: str) -> str:
    """The FLEET_TAG prefix: the host name plus a short hash of its deploy_dir, so two deployments
    on one machine (tests, a staging copy) never find each other's processes."""
    digest = hashlib.sha1(deploy_dir.encode()).hexdigest()[:8]
    return f"{host}-{digest}"
