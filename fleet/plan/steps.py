"""What a deploy does, decided before anything acts: from the wanted (the settings and the rendered files)
and the found (the state probe's facts), one step per thing with its reason: each file that differs, each
instance, each instance the inventory no longer has, the front (the proxy or nginx), keepalived, the keeper
and the boot hook.
`deploy --check` prints the plan (each step as it would be done, and why); deploy applies it
(fleet/commands/deploy.py), each applied step reporting what came of it. Pure functions: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hostagent import layout
from hostagent.facts import HostFacts, KeyDigests

from fleet.host import boot as fleet_boot, keeper as fleet_keeper, sync, vrrp as fleet_vrrp
from fleet.plan import launches as launch
from fleet.plan.launches import InstanceLaunch
from fleet.render import RenderedFile
from fleet.settings.inventory import HostVars

# What a step does. Nothing: keep (as it is), later (an instance still loading a stale launch: a deploy once
# it is healthy rolls it), skip (switched off), fail (cannot be done: the plan says why). A change: put (a
# file), start, restart (an instance: after its leftovers are stopped; the proxy: beside the old one), roll
# (the host agent's one restart of an instance running a stale launch), reload, stop, remove, install (the
# boot hook).
CHANGES = ("put", "start", "restart", "roll", "reload", "stop", "remove", "install")
ACTIONS = ("keep", "later", "skip", "fail") + CHANGES
# Files whose change nginx must take (a reload): its config and the front's host agent config.
NGINX_FILES = (layout.NGINX_CONF, layout.NGINX_FRONT_CONF)


@dataclass(frozen=True)
class Step:
    """One step of the plan: on what (`name`, as the report names it), what (`action`), why (`reason`), and
    what is said of it (`said`: for a change, what `--check` says it would do; else what deploy reports)."""

    name: str
    action: str
    reason: str = ""
    said: str = ""

    @property
    def changes(self) -> bool:
        """Whether applying it changes the host."""
        return self.action in CHANGES

    def line(self) -> str:
        """The step in one line, as the plan reads: `reload proxy: 1 backend added`."""
        return f"{self.action} {self.name}" + (f": {self.reason}" if self.reason else "")

    def checked(self) -> tuple[str, str]:
        """(status, message) as `--check` reports the step."""
        status = "failed" if self.action == "fail" else "skipped" if self.action == "skip" else \
            "changed" if self.changes else "ok"
        return status, self.said


@dataclass(frozen=True)
class FileStep(Step):
    """A file under deploy_dir: kept, or put (new, content changed, mode changed)."""

    file: RenderedFile | None = field(default=None, compare=False)

    @property
    def path(self) -> str:
        return self.file.path


@dataclass(frozen=True)
class InstanceStep(Step):
    """One instance's step: start, restart (its leftovers stopped first), roll, keep or later."""

    index: int = 0
    port: int = 0
    launch: InstanceLaunch | None = field(default=None, compare=False)   # launch.plan's (a roll needs it)
    kept: str = ""      # what applying it reports when it leaves the instance as it is (keep, later)

    def would(self) -> str:
        """The step as `--check` says it."""
        if self.action == "roll":
            return f"would restart ({self.reason})"
        if self.action == "later":
            return f"runs stale settings ({self.reason}); still loading: a deploy once it is healthy restarts it"
        verb = "restart (dead)" if self.action == "restart" else "start"
        return f"would {verb} on :{self.port}"

    def checked(self) -> tuple[str, str]:
        if self.action == "keep":
            return "ok", self.kept
        return "changed", self.would()


@dataclass(frozen=True)
class FrontStep(Step):
    """The front's step: the proxy's start, reload or restart, or nginx's start or reload (`command`: the
    host agent's, for nginx), or keep."""

    command: str = ""
    keys: str | None = None     # the digest of the key file's keys the front must take, when it has not


@dataclass
class Plan:
    """A deploy's steps, in the order deploy applies them."""

    files: list[FileStep]
    instances: list[InstanceStep]
    retired: list[Step]
    front: list[Step]           # the key file's failed step, if any, then the front's
    keepalived: Step | None     # None unless the host is an entry behind virtual addresses
    keeper: Step | None         # None on a host without instances (an entry)
    boot_hook: Step

    def steps(self) -> list[Step]:
        return [*self.files, *self.instances, *self.retired, *self.front,
                *(s for s in (self.keepalived, self.keeper) if s), self.boot_hook]

    def lines(self) -> list[str]:
        """The plan as `--check` shows it first: one line per step that changes something or cannot be done
        (`reload proxy: 1 backend added`), or that nothing changes."""
        out = [s.line() for s in self.steps() if s.changes or s.action == "fail"]
        return out or ["nothing to change"]

    @property
    def changed_files(self) -> set[str]:
        """The paths under deploy_dir that the files' steps put."""
        return {f.path for f in self.files if f.changes}


def make(hv: HostVars, found: HostFacts, files: list[RenderedFile], restart: bool = True) -> Plan:
    """The whole plan (see instances for restart)."""
    file_steps = [FileStep(f"file {f.path}", "put" if why else "keep", why or "", f"would put ({why})" if why else "",
                           file=f) for f, why in sync.changes(files, found)]
    changed = {f.path for f in file_steps if f.changes}
    return Plan(file_steps, instances(hv, found, restart), retired(hv, found), front(hv, found, changed),
                keepalived(hv, found, changed), keeper(hv, found, changed) if hv.settings.instances else None,
                boot_hook(hv, found))


def instances(hv: HostVars, found: HostFacts, restart: bool = True) -> list[InstanceStep]:
    """Each instance's step, in instance order. restart: roll a healthy instance whose launch is stale (False:
    keep it, and say so)."""
    leftovers = {t.part for t in found.tagged}     # processes left behind: stopped before the start
    entries = {p.index: p for p in launch.plan(hv, found)}
    out = []
    for f in found.instances:
        p = entries[f.index]
        if f.state in ("healthy", "loading"):
            out.append(_running(hv, f, p, restart))
        elif f.state == "port-taken" or (f.state == "dead" and f.alive) or str(f.index) in leftovers:
            # port-taken: strangers were refused before; this holder carries the instance's tag, its pid
            # file lost or stale. It is stopped (tag and session) and the instance started again.
            out.append(_instance(f.index, "restart", f.state, f.port, p))
        else:
            out.append(_instance(f.index, "start", f.state, f.port, p))
    return out


def _running(hv: HostVars, f, p: InstanceLaunch, restart: bool) -> InstanceStep:
    here = f"already {f.state} on :{f.port}, pid {f.pid}"
    changes = ", ".join(p.changes or [])
    if p.stale and f.state == "healthy" and restart:
        return _instance(f.index, "roll", changes, f.port, p)
    if p.stale:
        left = f"{here}; left running stale settings ({changes}): `inv deploy --host {hv.name}` restarts it"
        if f.state == "loading":
            return _instance(f.index, "later", changes, f.port, p, kept=left + " once it is healthy")
        return _instance(f.index, "keep", changes, f.port, p, kept=left)
    if p.unrecorded:
        return _instance(f.index, "keep", "unrecorded", f.port, p, kept=(
            f"{here}; its launch is not recorded (started by an older version), so deploy cannot tell whether "
            f"it runs the current settings: `inv restart --host {hv.name} --instance {f.index}` restarts it "
            "with them, and records them"))
    return _instance(f.index, "keep", "current", f.port, p, kept=here)


def _instance(index: int, action: str, reason: str, port: int, p: InstanceLaunch, kept: str = "") -> InstanceStep:
    return InstanceStep(f"instance {index}", action, reason, index=index, port=port, launch=p, kept=kept)


def retired(hv: HostVars, found: HostFacts) -> list[Step]:
    """Each running instance the inventory no longer has: drained, out of the proxy, then stopped."""
    return [Step(f"instance {f.index}", "remove", "the inventory no longer has it",
                 "would remove (the inventory no longer has it): drained, out of the proxy, then stopped; "
                 f"pid {f.pid} on :{f.port}") for f in found.retired or []]


def keeper(hv: HostVars, found: HostFacts, changed: set[str]) -> Step:
    """The keeper: started when it does not run, restarted when its code or configuration changed, stopped
    when keeper.enabled is false."""
    k = found.keeper
    if not hv.settings.keeper.enabled:
        if k.alive:
            return Step("keeper", "stop", "keeper.enabled is false",
                        f"would stop pid {k.pid} (keeper.enabled is false)")
        return Step("keeper", "skip", "keeper.enabled is false", "keeper.enabled is false")
    stale = any(f in fleet_keeper.KEEPER_FILES or f.startswith(layout.HOSTAGENT_CODE + "/") for f in changed)
    if k.alive and not stale:
        return Step("keeper", "keep", "running", f"already running, pid {k.pid}")
    verb = "restart" if k.alive else "start"
    why = "its code or configuration changed" if k.alive else "not running"
    return Step("keeper", verb, why, f"would {verb} the keeper ({why})")


def keepalived(hv: HostVars, found: HostFacts, changed: set[str]) -> Step | None:
    """An entry behind virtual addresses: keepalived's supervisor started unless it runs; a running one
    re-reads a changed config (a reload). None on any other host."""
    if not hv.vrrp_group:
        return None
    addresses = ", ".join(hv.settings.vrrp.addresses)
    pid = found.vrrp.pid if found.vrrp else None
    if any(f in fleet_vrrp.FILES for f in changed):
        why = "its config changed"
        return Step("keepalived", "reload" if pid else "start", why,
                    f"would {'reload' if pid else 'start'} keepalived for {addresses} ({why})")
    if pid:
        return Step("keepalived", "keep", "running", f"already running, supervisor pid {pid}")
    return Step("keepalived", "start", "not running", f"would start keepalived for {addresses} (not running)")


def boot_hook(hv: HostVars, found: HostFacts) -> Step:
    """The boot hook (fleet.host.boot.wanted): installed unless the one deploy installs is there as it would be
    (the state probe's `boot_as_wanted`); with boot_hook off, one left installed is removed."""
    kind, installed = fleet_boot.wanted(hv), found.boot
    if kind == "off":
        if installed:
            return Step("boot hook", "remove", "boot_hook is off",
                        f"would remove the {installed.kind} hook (boot_hook is off)")
        return Step("boot hook", "keep", "boot_hook is off",
                    "boot_hook is off: nothing brings the deployment back after a reboot")
    if installed and found.boot_as_wanted:
        return Step("boot hook", "keep", "installed", f"{installed.kind}: {installed.command}")
    why = "not installed" if not installed else "it differs from the one deploy installs"
    return Step("boot hook", "install", why, f"would install the boot hook ({kind}; {why})")


# --- the front ---------------------------------------------------------------------------------

def nginx_refusal(hv: HostVars) -> str | None:
    """Why nginx cannot be this host's front, or None: nginx does not read the body, so it cannot route
    by the request's `model`, which a host serving several models, aliases or adapters needs; and it has
    no shared queue to serve tenants fairly from (a per-key `limit_req` would keep a rate and silently drop
    the weights, the slot caps and the token budgets, so a host with tenants is refused rather than mapped)."""
    if hv.settings.proxy.tenants:
        names = ", ".join(hv.settings.proxy.tenants)
        return (f"{hv.name}: nginx cannot be the front here: it cannot share the slots fairly among the tenants "
                f"{names} nor keep their limits; keep the proxy as the front, or drop `proxy.tenants` to use nginx.")
    if hv.pools is None:
        return None
    names = ", ".join(p.name for p in hv.pools)
    return (f"{hv.name}: nginx cannot be the front here: it does not read the request body, so it cannot "
            f"route by `model` to the pools of {names} (aliases and adapters included); keep the proxy "
            "as the front, or serve one model per host to use nginx.")


def keys_to_take(hv: HostVars, found: HostFacts, against: str) -> tuple[str | None, str | None]:
    """(the digest of the key file's keys when the running front does not have them yet, else None; the
    key file's error, else None). against: `running` (the proxy's /admin/config) or `nginx_digest` (nginx's
    map)."""
    if not hv.settings.proxy.api_keys_file:
        return None, None
    keys = found.api_keys or KeyDigests()
    if keys.error:
        return None, keys.error
    running = found.proxy.said("api_keys_digest") if against == "running" else keys.nginx_digest
    return (keys.digest if keys.digest and running != keys.digest else None), None


def front(hv: HostVars, found: HostFacts, changed: set[str]) -> list[Step]:
    """The front's step (the proxy's, or nginx's in nginx mode), after a failed `api keys` step when the key
    file cannot be used (the front then keeps the keys it has)."""
    nginx = found.mode == "nginx"
    digest, error = keys_to_take(hv, found, "nginx_digest" if nginx else "running")
    steps: list[Step] = []
    if error and (nginx or found.proxy.alive):
        steps.append(Step("api keys", "fail", "the key file cannot be used",
                          f"{error} The front keeps the keys it had."))
    return steps + [_nginx(hv, found, changed, digest) if nginx else _proxy(hv, found, changed, digest)]


def _proxy(hv: HostVars, found: HostFacts, changed: set[str], keys: str | None) -> FrontStep:
    """The proxy: started, or reloaded (only its config or keys changed, and it answers), or restarted beside
    the old one (its code or start script changed, or a setting a reload cannot change is owed), or kept."""
    p = found.proxy
    port = hv.settings.proxy.port
    keys = keys if p.alive else None
    if p.state == "port-taken":
        return FrontStep("proxy", "fail", "port taken", f"port {port} is taken by a process that is not this "
                         "deployment's proxy; free it or change proxy.port")
    owed = bool(p.said("pending_restart"))      # a setting an earlier reload could not change
    # A changed start script (its environment: a group's PYTHONHASHSEED) takes effect only by a restart.
    relaunch = any(f == layout.START_PROXY or f.startswith(layout.PROXY_CODE + "/") for f in changed)
    conf = layout.PROXY_CONF in changed
    running = p.state in ("healthy", "no-backend")
    if running and not (owed or relaunch or conf or keys):
        return FrontStep("proxy", "keep", "running", f"already running on :{p.port}, pid {p.pid}")
    if running and p.backends is not None and not owed and not relaunch:
        why = "; ".join(w for w in ("the key file changed" if keys else "",
                                    _config_change(hv, p) if conf else "") if w)
        return FrontStep("proxy", "reload", why, f"would reload pid {p.pid} with the new config ({why})", keys=keys)
    if running:
        why = ("its code or start script changed" if relaunch else "a setting a reload cannot change is owed"
               if owed else "its admin API does not answer")
        return FrontStep("proxy", "restart", why, f"would restart on :{port} ({why})")
    return FrontStep("proxy", "start", p.state, f"would start on :{port} ({p.state})")


def _config_change(hv: HostVars, p) -> str:
    """What the new conf/proxy.yaml changes for the running proxy, said briefly (`1 backend(s) added`,
    `slots 8 -> 6`), from what it reports of its config; `its config changed` for the rest."""
    had = p.said("backends")
    if not isinstance(had, list):
        return "its config changed"
    added = [b for b in hv.backends if b not in had]
    removed = [b for b in had if b not in hv.backends]
    said = [f"{len(added)} backend(s) added" if added else "",
            f"{len(removed)} backend(s) removed" if removed else ""]
    slots = p.said("slots")
    if hv.pools is None and isinstance(slots, int) and slots != hv.proxy_slots:
        said.append(f"slots {slots} -> {hv.proxy_slots}")
    return ", ".join(w for w in said if w) or "its config changed"


def _nginx(hv: HostVars, found: HostFacts, changed: set[str], keys: str | None) -> FrontStep:
    """nginx mode: nginx stays the front, started when it is down, reloaded when its configuration, its host
    agent or the key file changed; the proxy is not started."""
    refusal = nginx_refusal(hv)
    if refusal:
        return FrontStep("front", "fail", "nginx cannot serve this inventory",
                         f"{refusal} `inv swap-to-proxy --host {hv.name}` makes the proxy the front.")
    n = found.nginx
    port = hv.settings.proxy.port
    stale = any(f in NGINX_FILES or f.startswith(layout.HOSTAGENT_CODE + "/") for f in changed)
    stale = stale or (keys is not None and bool(n.alive))
    # keeper.enabled: the keeper does the /health watching (one agent); else the watcher does.
    watching = found.keeper.alive if hv.settings.keeper.enabled else n.watcher_alive
    if n.alive and watching and not stale:
        return FrontStep("front", "keep", "running", f"nginx already running on :{port}, pid {n.pid}")
    verb = "reload" if n.alive else "start"
    why = ("its config changed" if stale and keys is None else "the key file changed" if stale
           else "its /health watcher does not run" if n.alive else "not running")
    said = f"would {verb} nginx on :{port}" + (" (the key file changed)" if keys else "")
    return FrontStep("front", verb, why, said, command="reload" if stale else "to-nginx", keys=keys)
