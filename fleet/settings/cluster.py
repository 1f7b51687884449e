"""A cluster across hosts: one entry host whose proxy fronts the instances of several hosts.

The entry host names its members with `fronts: [k100-01, k100-02]`; its proxy's backends are then
every member's instances, addressed `address:port` (a member's `address`, else its `ssh.host`; the
entry's own instances, when it lists itself, stay on 127.0.0.1). An entry host that does not list
itself runs the proxy only. Deploy brings the members' instances up first, then the entry's proxy;
stop goes the other way.

This module works on plain data the inventory hands it (host names, addresses, ports, groups) and on
a host's settings (fleet.settings.schema.HostSettings); it never imports fleet.settings.inventory, which calls it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from fleet.errors import InventoryError
from fleet.settings.schema import HostSettings
from fleet.settings.serving import Group, seqs, slots


class Vars(Protocol):
    """What this module reads of a host: its settings (fleet.settings.inventory.HostVars is one)."""

    settings: HostSettings


H = TypeVar("H", bound=Vars)


class Member(NamedTuple):
    """A host an entry host fronts, as the fronts graph needs it: its name, the address its instances
    are reached at from the entry host, and their ports."""

    name: str
    address: str
    ports: list[int]


class Served(NamedTuple):
    """One backend of a proxy and what it serves: its name, its host, whether that host is plain (one
    group of one name, one card per instance) and the group its instance serves."""

    backend: str
    host: str
    plain: bool
    group: Group


def backend_name(host: str, port: int) -> str:
    """A backend's name, host:port, as X-Backend, the metrics and the admin API show it ([::1]:8002 for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def address(settings: HostSettings) -> str:
    """How other hosts (an entry host's proxy, `inv chat`) reach this host's ports."""
    if settings.address:
        return settings.address
    if settings.connection == "ssh" and settings.ssh is not None and settings.ssh.host:
        return settings.ssh.host
    return "127.0.0.1"


def check_fronts(fronts: dict[str, list[str]], path: str) -> dict[str, set[str]]:
    """Check the fronts graph once (every host -> the hosts it fronts): each member is a host, and no
    entry host fronts another (a cycle named as one); return each fronted host's entry hosts."""
    fronted_by: dict[str, set[str]] = {}
    for entry, members in fronts.items():
        where = f"{path}: hosts.{entry}.fronts"
        for member in members:
            if member not in fronts:
                raise InventoryError(f"{where}: {member!r} is not defined under hosts; add it or drop it here.")
            if member == entry:
                continue
            if fronts[member]:
                chain = _path_back(fronts, member, entry)
                if chain:
                    links = ", ".join(f"{x} fronts {y}" for x, y in zip([entry] + chain, chain + [entry]))
                    raise InventoryError(f"{where}: a cycle: {links}; an entry host fronts instances, "
                                         "not other entry hosts.")
                raise InventoryError(f"{where}: {member!r} is itself an entry host (it has fronts); "
                                     "an entry host fronts instances, not other entry hosts.")
            fronted_by.setdefault(member, set()).add(entry)
    return fronted_by


def front_backends(where: str, members: list[Member]) -> list[tuple[str, str, int]]:
    """The backends of an entry host's proxy: the instances of every host it fronts, in its order, each
    as (name, the host that runs it, its index there); two hosts at one backend name are refused."""
    backends: list[tuple[str, str, int]] = []
    owner: dict[str, str] = {}
    for member in members:
        for i, port in enumerate(member.ports):
            name = backend_name(member.address, port)
            if name in owner:
                raise InventoryError(f"{where}: {owner[name]} and {member.name} both put an instance at {name}; "
                                     "give them different base_port or address.")
            owner[name] = member.name
            backends.append((name, member.name, i))
    return backends


@dataclass
class Pool:
    """One served model's pool in the proxy (conf/proxy.yaml's `models:`): the name it is served by, the
    other names that reach it (aliases, LoRA adapters), the slots it gives each backend (its max_num_seqs +
    the proxy's headroom) and its backends."""

    name: str
    slots: int
    backends: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)


def pools(headroom: int, served: list[Served], where: str) -> list[Pool] | None:
    """The proxy's pools by model (conf/proxy.yaml's `models:`), one per served name over every backend,
    each backend's slots its own group's max_num_seqs + this proxy's headroom; None when the proxy need
    not route by model (every backend serves one plain group of one name). Either way one model has one
    max_num_seqs on every host that serves it: the proxy gives each backend of it the same slots."""
    out: dict[str, Pool] = {}
    route: dict[str, str] = {}
    for backend, host, _, group in served:
        pool = out.setdefault(group.name, Pool(group.name, slots(group.max_num_seqs, headroom)))
        if pool.slots != slots(group.max_num_seqs, headroom):
            raise InventoryError(f"{where}: {host} serves {group.name} with max_num_seqs "
                                 f"{group.max_num_seqs}, another fronted host with {seqs(pool.slots, headroom)}; "
                                 "give the model one max_num_seqs on every host.")
        pool.backends.append(backend)
        pool.aliases += [n for n in group.aliases if n not in pool.aliases]
        pool.adapters += [n for n in group.lora_modules if n not in pool.adapters]
        for n in group.names:
            if route.setdefault(n, group.name) != group.name:
                raise InventoryError(f"{where}: the name {n!r} reaches both {route[n]} and {group.name} "
                                     f"(on {host}); each name must route to one model: rename one.")
    if len(out) <= 1 and all(s.plain for s in served):
        return None
    return list(out.values())


def _path_back(fronts: dict[str, list[str]], start: str, goal: str) -> list[str]:
    """The hosts from start along `fronts` back to goal ([start, ..., last before goal]), or [] if none."""
    todo, seen = [[start]], {start}
    while todo:
        path = todo.pop()
        for nxt in fronts.get(path[-1], []):
            if nxt == goal:
                return path
            if nxt not in seen and nxt in fronts:
                seen.add(nxt)
                todo.append(path + [nxt])
    return []


def phases(host_vars: list[H], order: str | None) -> list[list[H]]:
    """Hosts in the batches a run takes them: `entry-last` (deploy: members' instances before the
    entry proxies), `entry-first` (stop: the entry proxies before what they front), else one batch."""
    if order not in ("entry-last", "entry-first"):
        return [host_vars]
    entries = [hv for hv in host_vars if hv.settings.fronts]
    members = [hv for hv in host_vars if not hv.settings.fronts]
    batches = [members, entries] if order == "entry-last" else [entries, members]
    return [b for b in batches if b]


# --- entries behind virtual addresses (VRRP, keepalived): docs/entry-ha.md ---------------------------

class Peer(NamedTuple):
    """One entry host of a VRRP group as its peers see it: its name, the address its adverts come from
    (and its proxy is reached at), its slot weight and its proxy's port."""

    name: str
    address: str
    weight: int
    proxy_port: int


# The settings every entry of a group must agree on (the interface, the binary and the weight are each
# host's own).
VRRP_SHARED = ("router_id", "advert_interval_s", "preempt", "unicast")


def vrrp_groups(entries: dict[str, HostSettings], path: str) -> dict[str, list[Peer]]:
    """Check the entry hosts that set vrrp.addresses (name -> its variables, in inventory order) and return
    each one's group, in that order: the hosts with the same addresses. Refused in one sentence: an address
    claimed by two groups, a group of one, a group whose entries front different hosts or disagree on a
    VRRP setting, a member that is also an entry, an entry whose address is outside the addresses' network."""
    import ipaddress

    by_list: dict[tuple[str, ...], list[str]] = {}
    for name, s in entries.items():
        by_list.setdefault(tuple(s.vrrp.addresses), []).append(name)
    owner: dict[str, tuple[str, ...]] = {}
    for key, names in by_list.items():
        for vip in key:
            addr = str(ipaddress.IPv4Interface(vip).ip)
            if addr in owner and owner[addr] != key:
                raise InventoryError(f"{path}: the virtual address {addr} is claimed by two groups of entry hosts "
                                     f"({', '.join(by_list[owner[addr]])} and {', '.join(names)}); give each "
                                     "group its own addresses, or the same vrrp.addresses list.")
            owner[addr] = key
    out: dict[str, list[Peer]] = {}
    for key, names in by_list.items():
        first = entries[names[0]]
        where = f"{path}: hosts.{names[0]}.vrrp"
        if len(names) < 2:
            raise InventoryError(f"{where}.addresses: {', '.join(key)} needs two or more entry hosts with the "
                                 "same vrrp.addresses; add the backup entry, or drop the addresses.")
        if len(set(key)) != len(key):
            raise InventoryError(f"{where}.addresses: an address is listed twice; list each once.")
        for n in names:
            s = entries[n]
            w = f"{path}: hosts.{n}"
            if not s.fronts:
                raise InventoryError(f"{w}.vrrp.addresses: {n} fronts no host; virtual addresses are for "
                                     "entry hosts (set fronts, or drop vrrp.addresses).")
            both = sorted(set(s.fronts) & set(names))
            if both:
                raise InventoryError(f"{w}.fronts: {both[0]} is both an entry behind {', '.join(key)} and a "
                                     "member these entries front; run its instances on a member host, or "
                                     "take it out of the group.")
            if set(s.fronts) != set(first.fronts):
                raise InventoryError(f"{w}.fronts: {n} and {names[0]} share {', '.join(key)} but front different "
                                     "hosts; entries behind one address front the same hosts.")
            for k in VRRP_SHARED:
                if getattr(s.vrrp, k) != getattr(first.vrrp, k):
                    raise InventoryError(f"{w}.vrrp.{k}: {getattr(s.vrrp, k)!r} differs from {names[0]}'s "
                                         f"{getattr(first.vrrp, k)!r}; the entries of one group share it.")
            if not s.vrrp.interface:
                raise InventoryError(f"{w}.vrrp.interface: the entry's network interface that carries "
                                     f"{', '.join(key)} is required; set it (`eth0`).")
            if first.vrrp.router_id + len(key) - 1 > 255:
                raise InventoryError(f"{w}.vrrp.router_id: {len(key)} addresses from router id "
                                     f"{first.vrrp.router_id} pass 255; lower it.")
            own = address(s)
            try:
                ip = ipaddress.IPv4Address(own)
            except ValueError:
                raise InventoryError(f"{w}.address: {own!r} is not an IPv4 address; an entry behind a virtual "
                                     "address needs its own (its peers send it VRRP adverts): set address.") from None
            for vip in key:
                net = ipaddress.IPv4Interface(vip).network
                if ip not in net:
                    raise InventoryError(f"{w}.vrrp.addresses: {vip} is outside the network of {n}'s address "
                                         f"{own} ({net} does not hold it); use an address of that network, or "
                                         "fix the prefix length.")
        peers = [Peer(n, address(entries[n]), entries[n].vrrp.slot_weight, entries[n].proxy.port) for n in names]
        if len({p.address for p in peers}) != len(peers):
            raise InventoryError(f"{where}: two entries of the group have one address; give each its own.")
        for n in names:
            out[n] = peers
    return out


def vrrp_priority(rank: int) -> int:
    """The VRRP priority of the entry `rank` places after an address's master (0: its master)."""
    return max(1, 150 - 10 * rank)

