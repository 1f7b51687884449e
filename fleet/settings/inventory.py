"""The inventory: a YAML file of defaults, groups and hosts -> validated per-host variables.

Variables resolve in this order, later wins: built-in defaults < `defaults:` < each group the host is in
(in file order) < the host's own keys < `--set key=value` from the command line. Every layer is checked
against the schema (fleet.settings.schema) on its own, so an error names the file and the exact key path where the
bad value lives; the merged result is checked again, then the checks that span keys (ports, instances
against accelerators) and hosts (`fronts`, ports shared on one machine) run, all before anything is built.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from hostagent import layout

from fleet.errors import InventoryError
from fleet.settings import cluster, schema, schema_doc, serving

DEFAULT_INVENTORY = "inventory/hosts.yml"
HOST_NAME = schema.HOST_NAME
# The built-in defaults, every key of fleet.settings.schema.HostSettings (the lowest layer of every host).
BUILTIN_DEFAULTS: dict[str, Any] = schema.defaults()


@dataclass
class Inventory:
    """A loaded, checked inventory: where it came from, its groups and each host's own layers.

    What every host's variables need is indexed once, not asked of every host again: the groups each host
    is in, the `--set` layer, and which hosts are fronted by another (so building all N hosts stays
    linear in N; issue 21)."""

    path: str
    defaults: dict
    groups: dict[str, dict]          # group -> {"hosts": [...], vars...}
    hosts: dict[str, dict]           # host -> its own keys
    # Indexes, built on first use: host -> its groups' layers in file order; --set -> its parsed layer;
    # --set -> the hosts some other host fronts.
    _group_layers: dict[str, list[tuple[str, dict]]] | None = field(default=None, init=False, repr=False,
                                                                 compare=False)
    _overrides: dict[tuple, dict] = field(default_factory=dict, init=False, repr=False, compare=False)
    _fronted: dict[tuple, dict[str, set[str]]] = field(default_factory=dict, init=False, repr=False,
                                                       compare=False)
    _vrrp: dict[tuple, dict[str, list[cluster.Peer]]] = field(default_factory=dict, init=False, repr=False,
                                                              compare=False)

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
            seen = set(names)
            for n in found:
                if n not in seen:
                    seen.add(n)
                    names.append(n)
        if not names:
            raise InventoryError(f"{self.path}: --host {pattern!r} selects no host.")
        return names

    def groups_of(self, name: str) -> list[str]:
        """The groups a host is in, in file order."""
        return [g for g, _ in self._groups_index().get(name, [])]

    def _groups_index(self) -> dict[str, list[tuple[str, dict]]]:
        if self._group_layers is None:
            index: dict[str, list[tuple[str, dict]]] = {}
            for gname, group in self.groups.items():
                layer = {k: v for k, v in group.items() if k != "hosts"}
                for member in dict.fromkeys(group.get("hosts", [])):    # a host listed twice: once
                    index.setdefault(member, []).append((gname, layer))
            self._group_layers = index
        return self._group_layers

    def _set_layer(self, overrides) -> dict:
        """The `--set` layer, parsed and checked once per distinct --set."""
        key = tuple(overrides or ())
        if key not in self._overrides:
            self._overrides[key] = parse_overrides(key)
        return self._overrides[key]

    def layers(self, name: str, overrides: list[str] | tuple[str, ...] = ()) -> list[dict]:
        """The layers of one host, lowest first: defaults, its groups in file order, its own keys, --set."""
        return ([self.defaults] + [layer for _, layer in self._groups_index().get(name, [])]
                + [self.hosts[name], self._set_layer(overrides)])

    def fronts_of(self, name: str, overrides=()) -> list[str]:
        """The hosts a host fronts, read from its layers alone (no HostVars built: cycles stay cheap)."""
        found: list[str] = []
        for layer in self.layers(name, overrides):
            if "fronts" in layer:
                found = layer["fronts"] or []
        return list(found)

    def fronts_graph(self, overrides=()) -> dict[str, set[str]]:
        """Each fronted host -> the entry hosts that front it: every host's fronts read and checked
        (fleet.settings.cluster.check_fronts) once per --set, the first time at load."""
        key = tuple(overrides or ())
        if key not in self._fronted:
            self._fronted[key] = cluster.check_fronts({h: self.fronts_of(h, key) for h in self.hosts}, self.path)
        return self._fronted[key]

    def fronted_by(self, name: str, overrides=()) -> set[str]:
        """The other hosts whose `fronts` name this host."""
        return self.fronts_graph(overrides).get(name, set())

    def merged(self, name: str, overrides=()) -> dict:
        """A host's layers merged over the built-in defaults (not yet checked across keys)."""
        merged = _copy(BUILTIN_DEFAULTS)
        for layer in self.layers(name, overrides):
            _merge(merged, layer)
        if merged["connection"] is None:          # not said anywhere: an ssh block means ssh
            merged["connection"] = "ssh" if merged.get("ssh") else "local"
        return merged

    def vrrp_graph(self, overrides=()) -> dict[str, list[cluster.Peer]]:
        """Each entry host behind virtual addresses -> its VRRP group in inventory order, checked
        (fleet.settings.cluster.vrrp_groups) once per --set."""
        key = tuple(overrides or ())
        if key not in self._vrrp:
            entries = {h: m for h in self.hosts
                       if (m := check_layer(self.merged(h, key), self.path, f"hosts.{h}")).vrrp.addresses}
            self._vrrp[key] = cluster.vrrp_groups(entries, self.path) if entries else {}
        return self._vrrp[key]

    def host_vars(self, name: str, overrides: list[str] | tuple[str, ...] = ()) -> "HostVars":
        """The resolved, validated variables of one host, `--set` overrides applied last."""
        merged = self.merged(name, overrides)
        graph = self.fronts_graph(overrides)      # checked first, whatever this host's bind: --set may change it
        fronted = merged["bind"] is None and bool(graph.get(name))
        try:
            hv = HostVars.build(name, merged, self.path)
        except InventoryError as e:
            if not overrides:
                raise
            # A rule across keys names the file's key path; the value may be --set's, so say it took part.
            raise InventoryError(f"{str(e).rstrip('.')} (with --set {' '.join(overrides)}).") from None
        entries = sorted(e for e in graph.get(name, ()) if e != name)
        hv.entry_hosts = lambda: [self.host_vars(e, overrides) for e in entries]
        if fronted:                              # another host's proxy reaches these instances
            hv.settings.bind = cluster.address(hv.settings)
        where = f"{self.path}: hosts.{name}"
        if hv.settings.fronts:
            # an entry host's backends are its members' instances (the graph was checked: a member fronts
            # nothing but maybe itself, so building it never comes back here)
            members = {hv.name: hv}
            for m in hv.settings.fronts:
                if m not in members:
                    members[m] = self.host_vars(m, overrides)
            served = cluster.front_backends(f"{where}.fronts", [
                cluster.Member(m, hv.instance_host if m == name else cluster.address(members[m].settings), members[m].ports)
                for m in hv.settings.fronts])
            hv.fronted = [Fronted(backend, members[m], i) for backend, m, i in served]
            hv.front_members = [mv for mv in members.values() if mv is not hv]
        own = hv.fronted if hv.fronted is not None else [Fronted(b, hv, i) for i, b in enumerate(hv.backends)]
        hv.pools = cluster.pools(hv.settings.proxy.queue.headroom, [
            cluster.Served(f.backend, f.host.name, f.host.plain, f.host.group_of(f.index)) for f in own], where)
        hv.served_max_num_seqs = own[0].host.group_of(own[0].index).max_num_seqs if own else hv.settings.max_num_seqs
        hv.vrrp_group = self.vrrp_graph(overrides).get(name, [])
        if len(hv.settings.vrrp.addresses) > 1:
            _check_split(hv, where)
        if not hv.settings.served_model_name and own:    # an entry host without a model: its members' first
            hv.settings.served_model_name = own[0].host.group_of(own[0].index).name
        return hv

    def explain(self, name: str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, tuple[Any, str]]:
        """Each resolved variable of a host, nested keys dotted (`proxy.port`), with where its value came
        from: `default` (built in), `defaults`, `group NAME`, `host`, `--set`, or `derived` when a rule
        computed it from other keys (served_model_name from model, connection from ssh, ...)."""
        resolved = self.host_vars(name, overrides).settings.model_dump()
        groups = self.groups_of(name)
        origins: dict[str, str] = {}
        merged = _copy(BUILTIN_DEFAULTS)
        for origin, layer in zip(["defaults", *(f"group {g}" for g in groups), "host", "--set"],
                                 self.layers(name, overrides)):
            _merge(merged, layer)
            origins.update(dict.fromkeys(_dotted(layer), origin))
        layered = _dotted(check_layer(merged, self.path, f"hosts.{name}").model_dump())
        return {key: (value, "derived" if key in layered and layered[key] != value
                      else origins.get(key, "default"))
                for key, value in _dotted(resolved).items()}


def _dotted(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping flattened to dotted keys ({"proxy": {"port": 1}} -> {"proxy.port": 1});
    an empty mapping stays a value."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _merge(into: dict, layer: dict) -> None:
    """Deep-merge layer into `into`: mappings merge key by key, everything else replaces."""
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = _copy(value)


_ATOMS = (str, int, float, bool, type(None))


def _copy(value):
    """A deep copy of YAML data: mappings and lists copied, scalars shared (copy.deepcopy's generality,
    and its cost, is not needed: the loader refused cycles and bounded the aliases)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value if isinstance(value, _ATOMS) else copy.deepcopy(value)


# The most an inventory may hold, checked before anything is built from it, so a hostile or mistaken
# file is refused in a sentence instead of keeping the control node busy (issue 21): its size in bytes,
# and its values (YAML nodes) with every alias expanded: nine levels of nine aliases are 9^9 values
# written in ten lines. A 5,000-host inventory of 8 instances each is about 400 KiB and 50,000 values.
MAX_BYTES = 16 * 1024 * 1024
MAX_VALUES = 1_000_000


class DuplicateKey(yaml.YAMLError):
    """A mapping of the inventory names one key twice."""

    def __init__(self, where: str, first: int, again: int):
        super().__init__(where)
        self.where, self.first, self.again = where, first, again


class TooManyValues(yaml.YAMLError):
    """The document holds more than MAX_VALUES values once its aliases are expanded (or an alias
    that contains itself, which never ends)."""


# libyaml's parser when PyYAML has it (ten times the pure-Python one's speed), else the pure-Python one.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class StrictLoader(_SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (plain YAML keeps the last) and a
    document that expands past MAX_VALUES values."""

    def construct_document(self, node):
        _check_size(node)
        _no_duplicates(node, "", set())
        return super().construct_document(node)


def _check_size(root) -> None:
    """Count the values of the document as its aliases expand them, each distinct node once (an alias
    is the node it names: its count is reused, not walked again), so a bomb is refused at the cost of
    the nodes written, not of their expansion."""
    counts: dict[int, int] = {}
    todo: list[tuple[Any, bool]] = [(root, False)]
    on_path: set[int] = set()
    while todo:
        node, children_done = todo.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            kids = _children(node)
            counts[key] = total = 1 + sum(counts[id(k)] for k in kids)
            if total > MAX_VALUES:
                raise TooManyValues()
            continue
        if key in counts:
            continue
        if key in on_path:                        # an alias inside the node it names: endless
            raise TooManyValues()
        on_path.add(key)
        todo.append((node, True))
        todo.extend((k, False) for k in _children(node) if id(k) not in counts)


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _no_duplicates(node, where: str, checked: set[int]) -> None:
    # A node an alias names again was checked at its first place (an error there would have stopped us).
    if id(node) in checked:
        return
    checked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            at = f"{where}.{key}" if where else str(key)
            if key is not None and key != "<<":
                if key in seen:
                    raise DuplicateKey(at, seen[key] + 1, key_node.start_mark.line + 1)
                seen[key] = key_node.start_mark.line
            _no_duplicates(value_node, at, checked)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _no_duplicates(item, where, checked)


def yaml_problem(e: yaml.YAMLError, text: str) -> str:
    """A YAML syntax error as one sentence: the line, the parser's own words and what to do."""
    mark = getattr(e, "problem_mark", None)
    words = "; ".join(w for w in (getattr(e, "context", None), getattr(e, "problem", None)) if w)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
    hint = "fix the syntax there"
    lines = text.splitlines()
    if mark and mark.line < len(lines) and "\t" in lines[mark.line][:mark.column + 1]:
        hint = "YAML indents with spaces only: replace the tab with spaces"
    return f"not valid YAML at {where} ({words or 'a syntax error'}); {hint}."


def load(path: str | os.PathLike | None = None) -> Inventory:
    """Read and check an inventory file (default: $FLEET_INVENTORY, else inventory/hosts.yml)."""
    path = str(path or os.environ.get("FLEET_INVENTORY") or DEFAULT_INVENTORY)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise InventoryError(f"{path}: the inventory is larger than {MAX_BYTES // 2**20} MiB, more than "
                                 "this toolkit reads; split it into several inventories.")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InventoryError(f"{path}: cannot read the inventory (it is not UTF-8 text).") from None
    except FileNotFoundError:
        raise InventoryError(f"{path}: no such inventory file; pass -i FILE or set FLEET_INVENTORY.") from None
    except OSError as e:
        raise InventoryError(f"{path}: cannot read the inventory ({e.strerror}).") from None
    try:
        data = yaml.load(text, Loader=StrictLoader) or {}
    except DuplicateKey as e:
        raise InventoryError(f"{path}: {e.where}: given twice (lines {e.first} and {e.again}); "
                             "keep one of them.") from None
    except TooManyValues:
        raise InventoryError(f"{path}: its aliases expand to more than {MAX_VALUES:,} values (or an alias "
                             "holds itself), more than this toolkit reads; write the values out "
                             "instead of nesting aliases.") from None
    except RecursionError:
        raise InventoryError(f"{path}: its values are nested deeper than this toolkit reads; "
                             "flatten them.") from None
    except yaml.YAMLError as e:
        raise InventoryError(f"{path}: {yaml_problem(e, text)}") from None
    if not isinstance(data, dict):
        raise InventoryError(f"{path}: expected a mapping with defaults, groups and hosts at the top.")
    unknown = set(data) - {"defaults", "groups", "hosts"}
    if unknown:
        key = sorted(map(str, unknown))[0]
        raise InventoryError(f"{path}: {key}: unknown top-level key"
                             f"{_did_you_mean(key, ['defaults', 'groups', 'hosts'])}; use defaults, groups and hosts.")
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
    # The fronts graph, then cross-key checks (port clashes, instances > accelerators, an entry host's
    # backends) and cross-host ones (ports shared on one machine) before anything runs.
    inv.fronts_graph()
    inv.vrrp_graph()
    check_shared_machines(inv, [inv.host_vars(hname) for hname in hosts])
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


def check_layer(layer: dict, path: str, where: str) -> schema.HostSettings:
    """Check one layer's keys, types and bounds against the schema; raise naming `path: where.key`."""
    try:
        return schema.HostSettings.model_validate(layer)
    except ValidationError as e:
        raise InventoryError(_sentence(e.errors()[0], path, where)) from None


def _sentence(error: dict, path: str, where: str) -> str:
    """One pydantic error as the inventory's sentence: `path: where.key.path: expected ..., got ...`."""
    model: type[BaseModel] | None = schema.HostSettings
    keys: list[str] = []
    info = None
    for i, seg in enumerate(error["loc"]):
        if isinstance(seg, int):                 # a list item: the list's key names it
            continue
        if model is not None and seg in model.model_fields:
            info = model.model_fields[seg]
            keys.append(seg)
            model = schema.section_of(info.annotation)
        elif error["type"] == "extra_forbidden" and i == len(error["loc"]) - 1:
            keys.append(str(seg))
        # anything else is the tag of a union's member (`literal['auto']`, `constrained-int`)
    at = ".".join(([where] if where else []) + keys)
    if error["type"] == "extra_forbidden":
        known = list(model.model_fields) if model is not None else []
        if where.startswith("groups.") and len(keys) == 1:
            known.append("hosts")                # a group's own key, besides the host keys it sets
        return f"{path}: {at}: unknown key{_did_you_mean(keys[-1], known)}; docs/inventory.md lists every key."
    if model is not None and info is not None and error["type"] in ("model_type", "dict_type"):
        expected = "a mapping"
    else:
        expected = schema_doc.type_phrase(info.annotation, info) if info is not None else "another value"
    return f"{path}: {at}: expected {expected}, got {_show(error['input'])}."


def _did_you_mean(key: str, known) -> str:
    """` (did you mean KEY?)` with the closest known key, or nothing when none is close."""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def parse_overrides(overrides) -> dict:
    """`--set key=value` pairs -> a nested layer; values are read as YAML (`6` -> 6, `true` -> True)."""
    layer: dict = {}
    for item in overrides or ():
        if "=" not in item or not item.split("=", 1)[0].strip():
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


def local_address(bind: str) -> str:
    """Where the host itself reaches a port bound to `bind`: hostagent.layout's one rule."""
    return layout.local_address(bind)


class Fronted(NamedTuple):
    """One backend of an entry host's proxy: its name, the host that runs it and its index there."""

    backend: str
    host: "HostVars"
    index: int


@dataclass
class ServedModel:
    """A model clients can ask for through a host's entry port: the name they send, its instances (on an
    entry host, across the fronted hosts) and their max_num_seqs."""

    name: str
    instances: int
    max_num_seqs: int


@dataclass
class HostVars:
    """One host's resolved variables plus what follows from them (ports, backends, deployment id)."""

    name: str
    settings: schema.HostSettings      # checked, with the rules across keys applied (HostVars.build)
    inventory_path: str = ""
    deployment_id: str = ""
    ports: list[int] = field(default_factory=list)
    # On an entry host (`fronts`): its proxy's backends, each with the host that runs it and its index there.
    fronted: list[Fronted] | None = None
    front_members: list["HostVars"] = field(default_factory=list)   # an entry host's members, itself aside
    groups: list[serving.Group] = field(default_factory=list)   # what it serves (fleet.settings.serving)
    cards: list[tuple[int, ...]] = field(default_factory=list)  # instance i's cards
    plain: bool = True                         # one group on one card per instance: no model routing
    # The proxy's pools by model, on an entry host across its members (fleet.settings.cluster.pools); None: plain.
    pools: list[cluster.Pool] | None = None
    # Plain (pools None): the max_num_seqs of what the proxy serves, the slots it gives each backend less its
    # headroom; on an entry host its members' (one value on every member: fleet.settings.cluster.pools), not its own.
    served_max_num_seqs: int = 0
    # The other hosts whose proxies route to this host's instances (their `fronts` name it), resolved when
    # asked: a member's restart drains its instance in them too (fleet.commands.entries).
    entry_hosts: Callable[[], list["HostVars"]] = lambda: []
    # Behind virtual addresses (vrrp.addresses): the entry hosts of its group, itself included, in order.
    vrrp_group: list[cluster.Peer] = field(default_factory=list)

    @property
    def vrrp_rank(self) -> int:
        """This entry's place in its VRRP group (0: the first address's master)."""
        return [p.name for p in self.vrrp_group].index(self.name)

    def at_home(self, home: Callable[[], str]) -> "HostVars":
        """A copy with `~` made the host's home (home(), asked only when needed) in deploy_dir and the model
        paths: the host's, each group's and its adapters'. The engine gets a path as one quoted argument,
        which no shell expands."""
        known: list[str] = []

        def expand(path: str) -> str:
            if path != "~" and not path.startswith("~/"):
                return path
            known[:] = known or [home().rstrip("/")]
            return known[0] + path[1:]
        hv = copy.copy(self)
        hv.settings = self.settings.model_copy(deep=True)
        hv.settings.deploy_dir = expand(hv.settings.deploy_dir)
        hv.settings.model = expand(hv.settings.model)
        hv.groups = [dataclasses.replace(g, model=expand(g.model),
                                         lora_modules={k: expand(v) for k, v in g.lora_modules.items()})
                     for g in self.groups]
        return hv

    @classmethod
    def build(cls, name: str, merged: dict, path: str) -> "HostVars":
        """Check the merged layers (types and bounds first, then the rules that span keys)."""
        v = check_layer(merged, path, f"hosts.{name}")
        where = f"{path}: hosts.{name}"
        if v.connection is None:
            v.connection = "ssh" if v.ssh else "local"
        if v.connection == "ssh" and not (v.ssh and v.ssh.host):
            raise InventoryError(f"{where}.ssh.host: connection is ssh but no ssh.host is given; add it.")
        entry_only = bool(v.fronts) and name not in v.fronts
        if entry_only:
            v.instances = 0                    # an entry host that fronts others only runs the proxy
        elif v.instances < 1 and v.models is None:
            raise InventoryError(f"{where}.instances: expected at least 1 instance, got {v.instances}.")
        if v.proxy.workers != 1 and v.proxy.tenants:
            raise InventoryError(f"{where}.proxy.workers: several workers do not split the tenants' limits yet "
                                 "(each would admit all of them; docs/proxy.md, \"Several workers\"): keep "
                                 "proxy.workers 1 on a host with proxy.tenants.")
        if v.cpu_kvcache_gib != int(v.cpu_kvcache_gib):
            raise InventoryError(f"{where}.cpu_kvcache_gib: expected a whole number of GiB above 0 (vLLM reads "
                                 f"VLLM_CPU_KVCACHE_SPACE as an integer), got {v.cpu_kvcache_gib}.")
        if v.accelerator is None:
            if v.engine == "vllm" and not entry_only:
                raise InventoryError(f"{where}.accelerator: engine vllm needs the host's accelerator kind; set "
                                     "accelerator: dcu (Hygon), rocm, nvidia or cpu.")
            # sim: its own fake cards; an entry host that only runs the proxy uses no card at all.
            v.accelerator = "sim" if v.engine == "sim" else "dcu"
        if v.accelerator == "sim" and v.engine != "sim":
            raise InventoryError(f"{where}.accelerator: the sim accelerator only runs the sim engine; "
                                 "set engine: sim.")
        groups = [] if entry_only else serving.groups_of(v, where)
        if groups:
            v.instances = sum(g.instances for g in groups)
        if len(groups) == 1:                      # the host-level keys say what its one group serves
            g = groups[0]
            v.model, v.served_model_name, v.max_num_seqs = g.model, g.name, g.max_num_seqs
            v.max_model_len, v.gpu_memory_utilization = g.max_model_len, g.gpu_memory_utilization
            v.enforce_eager, v.extra_args = g.enforce_eager, list(g.extra_args)
        elif not v.model and v.engine == "sim":
            v.model = "sim-model"
        cards = serving.assign_cards(groups, v.accelerators, v.accelerator, where)
        last = v.base_port + v.instances - 1        # instances is bounded: this list stays small
        if last > 65535:
            raise InventoryError(f"{where}.base_port: instances would need ports up to {last}, "
                                 "past 65535; lower base_port.")
        ports = [v.base_port + i for i in range(v.instances)]
        proxy = v.proxy
        for key, port in (("port", proxy.port), ("admin_port", proxy.admin_port)):
            if port in ports:
                raise InventoryError(
                    f"{where}.proxy.{key}: {port} clashes with instance "
                    f"{ports.index(port)} (ports {ports[0]}-{ports[-1]}); move one of them.")
        if proxy.port == proxy.admin_port:
            raise InventoryError(f"{where}.proxy.admin_port: {proxy.admin_port} is also proxy.port; "
                                 "give the admin listener its own port.")
        own = {p: f"instance {i}" for i, p in enumerate(ports)}
        own.update({proxy.port: "proxy.port", proxy.admin_port: "proxy.admin_port"})
        metrics_port = v.keeper.metrics_port
        if metrics_port is None:                  # the port after the host's own: never one of them
            metrics_port = v.keeper.metrics_port = max(own) + 1
            if metrics_port > 65535:
                raise InventoryError(f"{where}.keeper.metrics_port: the port after the host's own ports is past "
                                     "65535; set keeper.metrics_port.")
        elif metrics_port in own:
            raise InventoryError(f"{where}.keeper.metrics_port: {metrics_port} is also the port of "
                                 f"{own[metrics_port]}; give the keeper's metrics a port of their own.")
        if v.keeper.backoff_base_s > v.keeper.backoff_max_s:
            raise InventoryError(f"{where}.keeper.backoff_base_s: {v.keeper.backoff_base_s:g} is above "
                                 f"keeper.backoff_max_s ({v.keeper.backoff_max_s:g}); lower one or raise the other.")
        if not v.served_model_name:           # several groups and no host-level model: the first's
            v.served_model_name = (os.path.basename(v.model.rstrip("/")) or v.model
                                      or (groups[0].name if groups else ""))
        # A plain host (one group, one card per instance, no alias, no adapter) renders as before groups.
        plain = not groups or serving.is_plain(groups)
        if v.bind is None:                     # an instance serves its own host's proxy alone
            v.bind = "127.0.0.1"               # (Inventory.host_vars widens it when another host fronts it)
        # The deployed files' headers name the inventory by its absolute path: a later deploy from another
        # file (fleet/plan/drift.py) is told apart whatever directory either ran in.
        hv = cls(name=name, settings=v, inventory_path=os.path.abspath(path) if path else path, ports=ports,
                 groups=groups, cards=cards, plain=plain)
        hv.deployment_id = deployment_id(name, v.deploy_dir)
        return hv

    def served_models(self) -> list[ServedModel]:
        """What clients can ask for through this host's entry port, one per model."""
        if self.pools is None:
            return [ServedModel(self.settings.served_model_name, len(self.backends),
                                self.served_max_num_seqs or self.settings.max_num_seqs)]
        headroom = self.settings.proxy.queue.headroom
        return [ServedModel(p.name, len(p.backends), serving.seqs(p.slots, headroom)) for p in self.pools]

    def served_model(self, name: str = "") -> ServedModel:
        """One of served_models() by name (a served name, alias or adapter, which it then carries); the
        first when name is empty."""
        models = self.served_models()
        if not name:
            return models[0]
        for m, p in zip(models, self.pools or [cluster.Pool(models[0].name, 0)]):
            if name in (m.name, *p.aliases, *p.adapters):
                return dataclasses.replace(m, name=name)
        raise InventoryError(f"{self.name} serves no model {name!r}; it serves "
                             f"{', '.join(m.name for m in models)}.")

    def group_of(self, index: int) -> serving.Group:
        """The group instance `index` serves."""
        return next(g for g in self.groups if index in g.indexes)

    @property
    def proxy_slots(self) -> int:
        """Plain (pools None): the slots the proxy gives each backend, for what it serves (fleet.settings.serving.slots)."""
        return serving.slots(self.served_max_num_seqs or self.settings.max_num_seqs,
                             self.settings.proxy.queue.headroom)

    @property
    def backends(self) -> list[str]:
        """The proxy's backends, named host:port as in X-Backend and the admin API."""
        if self.fronted is not None:
            return [f.backend for f in self.fronted]
        return [cluster.backend_name(self.instance_host, p) for p in self.ports]

    @property
    def instance_host(self) -> str:
        """Where an instance is reached on its own host (probes, doctor): its bind address, loopback for
        a wildcard."""
        return local_address(self.settings.bind)

    def claimed_ports(self) -> list[tuple[int, str, str]]:
        """Every TCP port this host listens on: (port, the key that sets it, what listens there)."""
        out = [(p, "base_port", f"instance {i}") for i, p in enumerate(self.ports)]
        out += [(self.settings.proxy.port, "proxy.port", "proxy"),
                (self.settings.proxy.admin_port, "proxy.admin_port", "proxy admin")]
        if self.settings.keeper.enabled:
            out.append((self.settings.keeper.metrics_port, "keeper.metrics_port", "keeper metrics"))
        return out


def _check_split(hv: HostVars, where: str) -> None:
    """Active-active: every entry's share of every instance's slots is at least one, else requests to it
    would only wait."""
    total = sum(p.weight for p in hv.vrrp_group)
    least = min(hv.vrrp_group, key=lambda p: p.weight)
    slots = min([p.slots for p in hv.pools or []] or
                [hv.proxy_slots])
    if slots * least.weight // total < 1:
        raise InventoryError(f"{where}.vrrp.slot_weight: {least.name}'s share of an instance's {slots} slot(s) "
                             f"(weight {least.weight} of {total}) is less than one; raise max_num_seqs, or give "
                             "the entries closer weights.")


def machine(hv: HostVars) -> str:
    """Which machine a host runs on, as far as the inventory tells: local (also ssh to loopback), or the
    ssh target."""
    if hv.settings.connection == "local":
        return "local"
    host = hv.settings.ssh.host
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return "local"
    return f"{host}:{hv.settings.ssh.port or 22}"


def check_shared_machines(inv: Inventory, hosts: list[HostVars]) -> None:
    """Two hosts on one machine (both local, or the same ssh target) must not listen on the same port."""
    taken: dict[tuple[str, int], tuple[str, str]] = {}
    for hv in hosts:
        where = machine(hv)
        for port, key, what in hv.claimed_ports():
            other = taken.get((where, port))
            if other and other[0] != hv.name:
                on = "this machine" if where == "local" else f"the machine {where}"
                raise InventoryError(
                    f"{inv.path}: hosts.{hv.name}.{key}: port {port} ({what}) is also the port of {other[0]}'s "
                    f"{other[1]} on {on}; give each host on one machine its own ports.")
            taken[(where, port)] = (hv.name, what)


def deployment_id(host: str, deploy_dir: str) -> str:
    """The FLEET_TAG prefix: the host name plus a short hash of its deploy_dir, so two deployments
    on one machine (tests, a staging copy) never find each other's processes."""
    digest = hashlib.sha1(deploy_dir.encode()).hexdigest()[:8]
    return f"{host}-{digest}"
