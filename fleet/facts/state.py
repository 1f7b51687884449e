"""Facts about a host's deployment, read before anything acts: the host variables resolved on the host
(`prepare`), the state probe's answer (`probe`: pid files, ports, /health, the proxy's admin view, the
keeper's record; parsed here once into hostagent.facts' records) and `inv status`, which is that answer put
in the operator's terms (`Status`, a declared record: `wire()` is the `inv status --json` object).

Facts first, then actions: deploy, stop, restart and the swaps read these, compare them with what the
inventory wants, and only then act.
"""
from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from hostagent import facts as found, layout
from hostagent.facts import BootHook, HostFacts, Tagged, VrrpState, parse

from fleet.host import keeper as fleet_keeper, vrrp as fleet_vrrp
from fleet.host.keeper import KeeperStatus
from fleet.plan import launches as launch
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport import agent
from fleet.transport.connection import Transport


def prepare(conn: Transport, hv: HostVars) -> HostVars:
    """Resolve what depends on the host itself: an absolute deploy_dir and the Python to run."""
    hv = hv.at_home(conn.home)
    d = hv.settings.deploy_dir
    if not d.startswith("/"):
        d = conn.home().rstrip("/") + "/" + d
    hv.settings.deploy_dir = d.rstrip("/") or "/"
    if not hv.settings.python:
        # The control node's own interpreter has aiohttp; a remote host's python3 comes from env_setup.
        hv.settings.python = sys.executable if hv.settings.connection == "local" else "python3"
    return hv


def probe(conn: Transport, hv: HostVars, files: list[str] = (), readonly: bool = False,
          boot: bool = False) -> HostFacts:
    """Read the deployment's state on the host (hostagent/probes/state.py). Each instance's `state` is
    hostagent.instances.classify's, the function the keeper uses too."""
    return parse(agent.run_script(conn, hv, "state", spec(hv, files, readonly, boot),
                                  "reading the deployment's state", timeout=60))


def spec(hv: HostVars, files: list[str] = (), readonly: bool = False, boot: bool = False,
         boot_wanted: dict | None = None) -> dict:
    """What the state probe reads: files, paths under deploy_dir whose hash and mode to report; readonly:
    create nothing on the host; boot: read the installed boot hook too (`boot`: {kind, command} or None);
    boot_wanted ({kind, watchdog}): whether installing that hook would change anything (`boot_as_wanted`)."""
    return {"deploy_dir": hv.settings.deploy_dir, "ports": hv.ports, "base_port": hv.settings.base_port,
            "instance_host": hv.instance_host,
            "proxy_port": hv.settings.proxy.port, "admin_port": hv.settings.proxy.admin_port,
            "proxy_address": layout.local_address(hv.settings.proxy.bind), "deployment_id": hv.deployment_id, "health_timeout_s": hv.settings.health_timeout_s,
            "files": list(files), "readonly": readonly, "api_keys_file": hv.settings.proxy.api_keys_file or None,
            "boot": boot, "boot_wanted": boot_wanted, "vrrp": fleet_vrrp.spec(hv)}


# --- `inv status`: the host's state in the operator's terms --------------------------------------

@dataclass
class InstanceStatus:
    """One instance in `inv status`: where it runs, its state, what the keeper did, the launch it runs."""

    index: int = 0
    port: int = 0
    accelerator: int = 0            # its first card
    cards: list[int] = field(default_factory=list)
    model: str = ""                 # its group's name
    pid: int | None = None
    pgid: int | None = None
    state: str = "stopped"          # loading, healthy, dead, stopped, port-taken, crashloop
    restarts: int = 0               # by the keeper
    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    last_restart_reason: str | None = None
    last_restart_at: float | None = None
    last_restart_result: str | None = None
    keeper_state: str | None = None
    crashloop: bool = False         # the keeper gave up on it
    crashloop_log: list[str] = field(default_factory=list)
    launch: str | None = None       # current, stale, unrecorded; None when it does not run
    stale_settings: list[str] = field(default_factory=list)   # how a stale launch differs from the inventory's


@dataclass
class ProxyStatus:
    pid: int | None = None
    port: int = 0
    state: str = "stopped"          # healthy, no-backend, dead, stopped, port-taken
    backends: list[dict[str, Any]] | None = None    # its GET /admin/backends, as it answered


@dataclass
class NginxStatus:
    pid: int | None = None
    port: int = 0
    state: str = "stopped"          # running or stopped
    watcher_pid: int | None = None


@dataclass
class RuntimeAdapter:
    name: str
    path: str


@dataclass
class ModelStatus:
    """A serving group of the models form: its names, instances and adapters."""

    name: str
    aliases: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    runtime_lora: bool = False
    runtime_adapters: list[RuntimeAdapter] = field(default_factory=list)   # recorded on the host


@dataclass
class Status:
    """One host in `inv status`; `wire()` is its `inv status --json` object (docs: DESIGN.md's contract)."""

    host: str = ""
    deployment_id: str = ""
    deploy_dir: str = ""
    front: str | None = None        # what answers the entry port: proxy, nginx, or None
    mode: str = "proxy"             # the front the host is set to run (run/mode)
    proxy: ProxyStatus = field(default_factory=ProxyStatus)
    models: list[ModelStatus] | None = None     # the models form's groups (None on a plain host)
    nginx: NginxStatus = field(default_factory=NginxStatus)
    keeper: KeeperStatus | None = None
    instances: list[InstanceStatus] = field(default_factory=list)
    tagged: list[Tagged] = field(default_factory=list)
    boot: BootHook | None = None                # the installed boot hook (None: none)
    vrrp: VrrpState | None = None               # behind virtual addresses
    boot_read: bool = False                     # the probe was asked for the boot hook

    def wire(self) -> dict[str, Any]:
        """The `inv status --json` object: `boot` only when it was read, `vrrp` only on an entry."""
        out = dataclasses.asdict(self)
        if not self.boot_read:
            out.pop("boot")
        if not self.vrrp:
            out.pop("vrrp")
        out.pop("boot_read")
        return out


def status_of(hv: HostVars, facts: HostFacts) -> Status:
    """One host's `inv status`, from the state probe's facts."""
    keeper = fleet_keeper.status(hv, facts)
    instances = [InstanceStatus(f.index, f.port, hv.cards[f.index][0], list(hv.cards[f.index]),
                                hv.group_of(f.index).name, f.pid, f.pgid, f.state,
                                **fleet_keeper.instance_fields(keeper, f.index))
                 for f in facts.instances]
    plan = {p.index: p for p in launch.plan(hv, facts)}
    for inst in instances:
        if inst.crashloop and inst.state in ("dead", "stopped"):
            inst.state = "crashloop"
        # The launch it runs against the inventory's: current, stale (stale_settings says how), unrecorded
        # (started by an older version); None when it does not run.
        p = plan[inst.index]
        inst.launch = (None if not p.running else "unrecorded" if p.unrecorded
                       else "stale" if p.stale else "current")
        inst.stale_settings = p.changes if p.stale else []
    p = facts.proxy
    proxy = ProxyStatus(p.pid, p.port, p.state, p.backends)
    mode = facts.front
    n = facts.nginx
    nginx = NginxStatus(n.pid, p.port, "running" if n.alive else "stopped",
                        n.watcher_pid or (keeper.pid if hv.settings.keeper.enabled else None))
    if n.alive and not p.alive:
        proxy.state = "stopped"           # the port is nginx's, not taken by a stranger
    front = None
    if mode == "proxy" and proxy.state in ("healthy", "no-backend"):
        front = "proxy"
    elif mode == "nginx" and n.alive:
        front = "nginx"
    models = None if hv.plain else [ModelStatus(g.name, list(g.aliases), sorted(g.lora_modules), list(g.indexes),
                                                g.runtime_lora, runtime_adapters(facts, g.name)) for g in hv.groups]
    return Status(hv.name, hv.deployment_id, hv.settings.deploy_dir, front, mode, proxy, models, nginx, keeper,
                  instances, list(facts.tagged), facts.boot if facts.asked_boot else None, facts.vrrp or None,
                  facts.asked_boot)


def runtime_adapters(facts: HostFacts, model: str) -> list[RuntimeAdapter]:
    """The runtime LoRA adapters recorded on the host for group model (run/lora_adapters.json): name, path."""
    return [RuntimeAdapter(a["name"], a["path"]) for a in facts.lora_adapters if a.get("model") == model]


def status(conn: Transport, hv: HostVars, emit: Emit = lambda line: None) -> Report:
    """Read the host's state; ok unless an instance or the proxy is not serving."""
    hv = prepare(conn, hv)
    report = Report(hv.name)
    facts = probe(conn, hv, boot=True)
    report.status = st = status_of(hv, facts)
    loud = {name: (status, message) for name, status, message in keeper_lines(st)}
    for inst, f in zip(st.instances, facts.instances):
        name = f"instance {inst.index}"
        status, message = loud.pop(name, ("ok" if inst.state in ("healthy", "loading", "stopped") else
                                          "failed", _state_and_remedy(hv, inst.state, f, inst.index)))
        if inst.launch == "stale":
            message += (f"; runs stale settings ({', '.join(inst.stale_settings)}): `inv deploy --host "
                        f"{hv.name}` restarts it with the inventory's")
        report.add(name, status, message)
    for name, (status, message) in loud.items():
        report.add(name, status, message)
    b = st.boot
    report.add("boot hook", "ok", f"{b.kind}: {b.command}" if b else
               "none: after a reboot nothing starts the deployment (`inv deploy` installs the hook, `inv stop` "
               "removes it)")
    for name, status, message in fleet_vrrp.status_lines(st.host, st.vrrp):
        report.add(name, status, message)
    if facts.lora_record_error:
        report.add("runtime adapters", "failed", facts.lora_record_error)
    # The entry port is what clients use: a front that should run and does not is a failure.
    if st.mode != "nginx":
        report.add("proxy", "failed" if st.proxy.state in ("dead", "port-taken") else "ok",
                   _state_and_remedy(hv, st.proxy.state, facts.proxy))
    return report


def keeper_lines(st: Status) -> list[tuple[str, str, str]]:
    """(step name, status, message) for `inv status` from what the keeper did: a crash-looping instance
    fails loudly, and so does a keeper that died."""
    out = []
    for inst in st.instances:
        if inst.crashloop:
            tail = "\n".join("    " + line for line in inst.crashloop_log) or "    (empty)"
            out.append((f"instance {inst.index}", "failed",
                        f"CRASHLOOP: the keeper restarted it {inst.restarts} time(s) "
                        f"(last: {inst.last_restart_reason}) and gave up; fix the cause, then "
                        f"`inv restart --host {st.host} --instance {inst.index}`. Last lines of "
                        f"{layout.instance_log(inst.index)}:\n{tail}"))
    if st.keeper and st.keeper.state == "dead":
        watchdog = ("the boot hook's watchdog starts it within a minute (logs/boot.log says so), or "
                    if st.boot else "")
        out.append(("keeper", "failed", "the keeper is not running (run/keeper.pid is stale): dead instances "
                    f"are not restarted; {watchdog}`inv deploy --host {st.host}` starts it; see logs/keeper.log"))
    return out


def _state_and_remedy(hv: HostVars, state: str, f: found.Instance | found.Proxy, index: int | None = None) -> str:
    """A failed state in status, with where to look and what brings it back (the proxy: index None)."""
    h = hv.name
    if state == "port-taken" and f.stranger:
        return f"port-taken: {f.stranger}"
    if state != "dead":
        return state
    if index is None:
        return f"dead: `inv logs --host {h}` shows why; `inv deploy --host {h}` starts it again"
    return (f"dead: `inv logs --host {h} --instance {index}` shows why; `inv restart --host {h} --instance "
            f"{index}` starts it again")


def foreign_ports(hv: HostVars, facts: HostFacts) -> list[tuple[int, str]]:
    """(port, sentence) for each instance or proxy port held by a process that is not the deployment's."""
    st = status_of(hv, facts)
    taken: list[found.Instance | found.Proxy] = [
        f for f, inst in zip(facts.instances, st.instances) if inst.state == "port-taken"]
    if st.proxy.state == "port-taken":
        taken.append(facts.proxy)
    return [(f.port, f.stranger) for f in taken if f.stranger]


def tagged(facts: HostFacts, hv: HostVars, instance: int) -> list[found.Tagged]:
    """The processes carrying instance's tag in a probe's facts."""
    return facts.tagged_instance(layout.tag(hv.deployment_id, instance))


def log_tail(conn: Transport, hv: HostVars, rel: str, n: int = 15) -> str:
    """The last n lines of a log under deploy_dir, indented for a report step."""
    r = conn.run(f"tail -n {n} {shlex.quote(hv.settings.deploy_dir + '/' + rel)} 2>/dev/null")
    return "\n".join("    " + line for line in r.stdout.splitlines()) or "    (empty)"
