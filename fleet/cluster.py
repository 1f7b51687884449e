"""A cluster across hosts: one entry host whose proxy fronts the instances of several hosts.

The entry host names its members with `fronts: [k100-01, k100-02]`; its proxy's backends are then
every member's instances, addressed `address:port` (a member's `address`, else its `ssh.host`; the
entry's own instances, when it lists itself, stay on 127.0.0.1). An entry host that does not list
itself runs the proxy only. Deploy brings the members' instances up first, then the entry's proxy;
stop goes the other way.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import InventoryError

if TYPE_CHECKING:
    from .inventory import HostVars, Inventory


def backend_name(host: str, port: int) -> str:
    """A backend's name, host:port, as X-Backend, the metrics and the admin API show it ([::1]:8002 for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def address(hv: "HostVars") -> str:
    """How other hosts (an entry host's proxy, `inv chat`) reach this host's ports."""
    if hv["address"]:
        return hv["address"]
    if hv["connection"] == "ssh":
        return hv["ssh"]["host"]
    return "127.0.0.1"


def front_backends(inv: "Inventory", entry: "HostVars", overrides=()) -> list[tuple[str, "HostVars", int]]:
    """The backends of an entry host's proxy: the instances of every host it fronts, in its order, each
    as (name, the host that runs it, its index there)."""
    where = f"{inv.path}: hosts.{entry.name}.fronts"
    backends: list[tuple[str, "HostVars", int]] = []
    owner: dict[str, str] = {}
    for member in entry["fronts"]:
        if member not in inv.hosts:
            raise InventoryError(f"{where}: {member!r} is not defined under hosts; add it or drop it here.")
        if member == entry.name:
            mv = entry
            names = [backend_name(entry.instance_host, p) for p in entry.ports]
        else:
            # Read the member's fronts from its layers before building it: building an entry host builds
            # its members, so a cycle (a fronts b, b fronts a) would never end.
            if inv.fronts_of(member, overrides):
                chain = _path_back(inv, member, entry.name, overrides)
                if chain:
                    links = ", ".join(f"{x} fronts {y}" for x, y in zip([entry.name] + chain, chain + [entry.name]))
                    raise InventoryError(f"{where}: a cycle: {links}; an entry host fronts instances, "
                                         "not other entry hosts.")
                raise InventoryError(f"{where}: {member!r} is itself an entry host (it has fronts); "
                                     "an entry host fronts instances, not other entry hosts.")
            mv = inv.host_vars(member, overrides)
            names = [backend_name(address(mv), p) for p in mv.ports]
        for i, name in enumerate(names):
            if name in owner:
                raise InventoryError(f"{where}: {owner[name]} and {member} both put an instance at {name}; "
                                     "give them different base_port or address.")
            owner[name] = member
            backends.append((name, mv, i))
    return backends


def pools(hv: "HostVars", backends: list[tuple[str, "HostVars", int]], where: str) -> list[dict] | None:
    """The proxy's pools by model (conf/proxy.yaml's `models:`), one per served name over every backend,
    each backend's slots its own group's max_num_seqs + this proxy's headroom; None when the proxy need
    not route by model (every backend serves one plain group of one name)."""
    served = [(backend, member, member.group_of(i)) for backend, member, i in backends]
    if len({g.name for _, _, g in served}) <= 1 and all(member.plain for _, member, _ in served):
        return None
    headroom = hv["proxy"]["queue"]["headroom"]
    out: dict[str, dict] = {}
    route: dict[str, str] = {}
    for backend, member, group in served:
        pool = out.setdefault(group.name, {"name": group.name, "aliases": [], "adapters": [],
                                           "slots": group.max_num_seqs + headroom, "backends": []})
        if pool["slots"] != group.max_num_seqs + headroom:
            raise InventoryError(f"{where}: {member.name} serves {group.name} with max_num_seqs "
                                 f"{group.max_num_seqs}, another fronted host with {pool['slots'] - headroom}; "
                                 "give the model one max_num_seqs on every host.")
        pool["backends"].append(backend)
        for key, names_ in (("aliases", group.aliases), ("adapters", list(group.lora_modules))):
            pool[key] += [n for n in names_ if n not in pool[key]]
        for n in group.names:
            if route.setdefault(n, group.name) != group.name:
                raise InventoryError(f"{where}: the name {n!r} reaches both {route[n]} and {group.name} "
                                     f"(on {member.name}); each name must route to one model: rename one.")
    return list(out.values())


def _path_back(inv: "Inventory", start: str, goal: str, overrides) -> list[str]:
    """The hosts from start along `fronts` back to goal ([start, ..., last before goal]), or [] if none."""
    todo, seen = [[start]], {start}
    while todo:
        path = todo.pop()
        for nxt in inv.fronts_of(path[-1], overrides):
            if nxt == goal:
                return path
            if nxt not in seen and nxt in inv.hosts:
                seen.add(nxt)
                todo.append(path + [nxt])
    return []


def phases(host_vars: list["HostVars"], order: str | None) -> list[list["HostVars"]]:
    """Hosts in the batches a run takes them: `entry-last` (deploy: members' instances before the
    entry proxies), `entry-first` (stop: the entry proxies before what they front), else one batch."""
    if order not in ("entry-last", "entry-first"):
        return [host_vars]
    entries = [hv for hv in host_vars if hv["fronts"]]
    members = [hv for hv in host_vars if not hv["fronts"]]
    batches = [members, entries] if order == "entry-last" else [entries, members]
    return [b for b in batches if b]
