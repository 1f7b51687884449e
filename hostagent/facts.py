"""The probes' answers as declared records: what hostagent/probes/state.py (holders.py, who holds the
device files; doctor.py, what `inv doctor` judges) read on the host, and what the control plane
(fleet/facts/state.py, fleet/host/release.py, fleet/facts/doctor.py) parses once from the JSON the probe
prints. Shared by both sides, like hostagent/layout.py: the type says what a fact holds.

Standard library only, Python 3.7+ (dataclasses; no `X | None` at runtime): it is bundled into the probe
and runs with the host's Python. The records stay plain data: `asdict` is the wire form, `parse` (and
`parse_holders`, `parse_doctor`) its one reader. The proxy's admin answers (`config`, `backends`), the keeper's record (`state`) and an instance's
launch record are the proxy's, the keeper's and start_cluster.sh's own JSON, carried as they are.
"""
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional


@dataclass
class Instance:
    """One instance: its process (run/instance_<i>.pid, identity-checked), /health and state
    (hostagent.instances.classify's: the keeper's own classification)."""

    index: int = 0
    port: int = 0
    pid: Optional[int] = None            # the running process (None when not alive)
    pgid: Optional[int] = None
    pidfile: bool = False
    alive: bool = False
    stale: Optional[str] = None          # why the pid file does not count (None when it does)
    recorded_pid: Optional[int] = None   # what the pid file names, alive or not
    listening: bool = False
    health: Optional[int] = None         # the status of GET /health (None: no answer)
    stranger: Optional[str] = None       # who holds its port when that is not the deployment
    was_ready: bool = False
    age_s: Optional[float] = None
    state: str = "stopped"
    reason: Optional[str] = None
    launch: Optional[Dict[str, Any]] = None   # its launch record (retired instances only)


@dataclass
class Proxy:
    """The proxy's process (run/proxy.pid), /health on the entry port and its admin API's view."""

    port: int = 0
    pid: Optional[int] = None
    pgid: Optional[int] = None
    pidfile: bool = False
    alive: bool = False
    stale: Optional[str] = None
    listening: bool = False
    health: Optional[int] = None
    backends: Optional[List[Dict[str, Any]]] = None    # GET /admin/backends
    config: Optional[Dict[str, Any]] = None            # GET /admin/config
    stranger: Optional[str] = None

    @property
    def state(self) -> str:
        """healthy, no-backend (up but no healthy backend), dead, stopped or port-taken."""
        if self.alive:
            if self.health == 200:
                return "healthy"
            return "no-backend" if self.health == 503 else "dead"
        if self.listening:
            return "port-taken"
        return "dead" if self.pidfile else "stopped"

    def said(self, key: str, default: Any = None) -> Any:
        """One key of the running proxy's GET /admin/config (default when it gave none)."""
        value = (self.config or {}).get(key)
        return default if value is None else value


@dataclass
class Nginx:
    """nginx mode's master (run/nginx.pid) and its /health watcher."""

    pid: Optional[int] = None
    alive: bool = False
    watcher_pid: Optional[int] = None
    watcher_alive: bool = False


@dataclass
class Keeper:
    """The keeper's process (run/keeper.pid) and its record (run/keeper.json, as it wrote it)."""

    pid: Optional[int] = None
    alive: bool = False
    pidfile: bool = False
    state: Optional[Dict[str, Any]] = None


@dataclass
class BootHook:
    """The deployment's installed boot hook (hostagent.boothook.show): `cron` or `systemd`, and what it runs."""

    kind: str
    command: Optional[str] = None


@dataclass
class VrrpState:
    """An entry behind virtual addresses (hostagent.vrrp.state): keepalived's supervisor and keepalived
    (their pids, None when not running), the interface and addresses, those this entry holds now, why
    keepalived cannot run here (None when it can), and its binary."""

    pid: Optional[int] = None
    keepalived_pid: Optional[int] = None
    interface: str = ""
    addresses: List[str] = field(default_factory=list)
    holds: List[str] = field(default_factory=list)
    missing: Optional[str] = None
    binary: Optional[str] = None


@dataclass
class KeyDigests:
    """proxy.api_keys_file seen on the host by the state probe: the digest of its keys (never the keys) or why it cannot be
    used (one sentence), and the digest of nginx's map of them (run/nginx_keys.conf; None without one)."""

    digest: Optional[str] = None
    error: Optional[str] = None
    nginx_digest: Optional[str] = None


@dataclass
class Tagged:
    """A process of this user whose environment carries the deployment's FLEET_TAG."""

    pid: int
    tag: str
    sid: Optional[int] = None
    ppid: Optional[int] = None
    cmdline: str = ""

    @property
    def part(self) -> str:
        """What the tag names: an instance index, `proxy`, `keeper`, ..."""
        return self.tag.rpartition("/")[2]


@dataclass
class HostFacts:
    """One deployment's state on its host, as one probe read it."""

    uid: int = -1
    deploy_dir_exists: bool = False
    proxy: Proxy = field(default_factory=lambda: Proxy(port=0))
    instances: List[Instance] = field(default_factory=list)
    launches: List[Optional[Dict[str, Any]]] = field(default_factory=list)   # run/instance_<i>.launch
    retired: List[Instance] = field(default_factory=list)    # running past the inventory's instances
    nginx: Nginx = field(default_factory=Nginx)
    keeper: Keeper = field(default_factory=Keeper)
    files: Dict[str, Optional[str]] = field(default_factory=dict)        # path -> sha256 (None: absent)
    file_modes: Dict[str, Optional[int]] = field(default_factory=dict)
    tagged: List[Tagged] = field(default_factory=list)
    lora_adapters: List[Dict[str, Any]] = field(default_factory=list)   # run/lora_adapters.json
    lora_record_error: Optional[str] = None
    mode: Optional[str] = None                  # run/mode: proxy or nginx (None: unset)
    api_keys: Optional[KeyDigests] = None       # the key file's digests (with proxy.api_keys_file)
    vrrp: Optional[VrrpState] = None            # behind virtual addresses
    boot: Optional[BootHook] = None             # asked for: the installed boot hook (None: none)
    boot_as_wanted: Optional[bool] = None       # asked for by deploy: installing the hook would change nothing
    proxy_conf_head: str = ""                   # conf/proxy.yaml's first line: the inventory it was rendered from
    keepalived_recorded: bool = False           # run/keepalived.pid is not empty (an earlier deploy's keepalived)
    asked_boot: bool = False

    @property
    def front(self) -> str:
        """The front the host runs: proxy unless run/mode says nginx."""
        return self.mode or "proxy"

    def proxy_healthy(self) -> bool:
        """The proxy is the front and answers /health 200."""
        return self.front != "nginx" and self.proxy.state == "healthy"

    def tagged_instance(self, tag: str) -> List[Tagged]:
        """The processes carrying exactly this tag."""
        return [t for t in self.tagged if t.tag == tag]


@dataclass
class Holder:
    """A process holding one of the accelerators' device files (hostagent/probes/holders.py). kind:
    `self` (the probe, its ancestors, its session: never touched), `other-user` (only reported), `spared`
    (another instance of this deployment during `--instance I`), `yours` (killed with --force)."""

    pid: int
    kind: str
    user: str = ""
    uid: int = -1
    tag: Optional[str] = None
    cmdline: str = ""
    files: List[str] = field(default_factory=list)
    start: Optional[int] = None

    def shown(self) -> str:
        """`pid 123 (user alice, tag d/0: vllm serve ...)`."""
        tag = ", tag " + self.tag if self.tag else ""
        return "pid {} (user {}{}: {})".format(self.pid, self.user, tag, self.cmdline[:70])


@dataclass
class Holders:
    """The holders probe's answer: the device files found and who holds them; with kill, the pids killed
    and those alive after SIGKILL; error, why the holders could not be listed (then nothing else)."""

    files: List[str] = field(default_factory=list)
    holders: List[Holder] = field(default_factory=list)
    killed: List[int] = field(default_factory=list)
    survivors: List[int] = field(default_factory=list)
    error: Optional[str] = None

    def of_kind(self, *kinds: str) -> List[Holder]:
        return [h for h in self.holders if h.kind in kinds]


# --- the doctor's probe (hostagent/probes/doctor.py) --------------------------------------------

@dataclass
class Engine:
    """The engine's command as found after env_setup: vLLM's `vllm` (its path, the Python of its #! line,
    the version of the distribution `vllm` from that Python's package metadata), or the sim's Python."""

    ran: bool = False                # the probe ran the command (the sim; `--deep`; no metadata found)
    exit: Optional[int] = None       # 0 when found (and it ran well); None: not found; 126, 127: not executable
    output: str = ""                 # its output's end, or why it failed
    path: Optional[str] = None
    python: Optional[str] = None
    version: Optional[str] = None
    metadata: Optional[str] = None   # the METADATA (or PKG-INFO) file the version comes from


@dataclass
class Model:
    """What the model path holds, from the directory's own entries (a single file: its size)."""

    exists: Optional[bool] = None    # None: not checked (engine sim: the model is only a name)
    bytes: int = 0                   # the weight files' bytes
    files: int = 0
    config: bool = False             # config.json or params.json
    weights: int = 0                 # weight files (.safetensors, .bin, .pt, .pth, .gguf)


@dataclass
class KeyFile:
    """The API key file as the proxy will read it (hostagent.apikeys.inspect), no key in it."""

    error: Optional[str] = None      # why the proxy could not read it (then nothing else is known)
    keys: int = 0
    short: int = 0                   # keys shorter than short_under characters
    short_under: int = 0
    undefined: List[str] = field(default_factory=list)   # tenants its lines name that the inventory does not define
    mode: Optional[int] = None       # the file's permission bits


@dataclass
class PortHolder:
    """A process listening on a port (hostagent.processes.port_holders); pid None: another user's."""

    pid: Optional[int] = None
    cmdline: str = ""
    user: str = ""
    tag: Optional[str] = None


@dataclass
class Port:
    """One port the deployment needs: free, ours (a verified pid file's process), or whose."""

    port: int = 0
    what: str = ""                   # `instance 0`, `proxy`, `proxy admin`, `keeper metrics`
    listening: bool = False
    ours: Optional[int] = None       # the deployment's pid listening there
    holders: List[PortHolder] = field(default_factory=list)
    stranger: Optional[str] = None   # the sentence for a holder that is not the deployment's


@dataclass
class Smi:
    """The smi command's run: its exit code (127: none found; None: not run) and output."""

    exit: Optional[int] = None
    output: str = ""


@dataclass
class Tools:
    """The host tools the deployment uses, where found (None: missing)."""

    fuser: Optional[str] = None
    ss: Optional[str] = None


@dataclass
class Disk:
    """Room for the logs: the nearest existing directory of deploy_dir and its free bytes."""

    dir: str = ""
    free: int = 0
    unwritable: Optional[str] = None   # why deploy could not create or write deploy_dir


@dataclass
class Memory:
    """/proc/meminfo's MemTotal and MemAvailable, in bytes (None: not read)."""

    total: Optional[int] = None
    available: Optional[int] = None


@dataclass
class BootHookFit:
    """Which boot hook this host can have (hostagent.boothook.detect): systemd, cron or None, and what
    keeps it from working ("" when nothing does)."""

    kind: Optional[str] = None
    user: str = ""
    missing: str = ""


@dataclass
class KeepalivedFit:
    """Whether keepalived can run here (an entry behind virtual addresses): what is missing, its binary."""

    missing: Optional[str] = None
    binary: Optional[str] = None


@dataclass
class DoctorFacts:
    """The doctor's probe's answer: what `inv doctor` (and deploy's doctor) judges."""

    engine: Engine = field(default_factory=Engine)
    model: Model = field(default_factory=Model)
    api_keys: Optional[KeyFile] = None       # None without proxy.api_keys_file
    ports: List[Port] = field(default_factory=list)
    smi: Smi = field(default_factory=Smi)
    tools: Tools = field(default_factory=Tools)
    disk: Disk = field(default_factory=Disk)
    memory: Memory = field(default_factory=Memory)
    cores: int = 0                           # the cores this user's processes may run on
    sim_devices: bool = False                # deploy_dir/sim-dev exists
    boot: BootHookFit = field(default_factory=BootHookFit)
    vrrp: Optional[KeepalivedFit] = None     # None: no virtual addresses


def record(cls, data: Dict[str, Any]):
    """A record of cls from its wire form, keys it does not declare left out (an older or newer probe)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def parse(data: Dict[str, Any]) -> HostFacts:
    """The one reader of the state probe's JSON."""
    out = record(HostFacts, data)
    out.proxy = record(Proxy, data.get("proxy") or {})
    out.instances = [record(Instance, i) for i in data.get("instances") or []]
    out.retired = [record(Instance, i) for i in data.get("retired") or []]
    out.nginx = record(Nginx, data.get("nginx") or {})
    out.keeper = record(Keeper, data.get("keeper") or {})
    out.tagged = [record(Tagged, t) for t in data.get("tagged") or []]
    out.lora_adapters = data.get("lora_adapters") or []
    out.api_keys = record(KeyDigests, data["api_keys"]) if data.get("api_keys") else None
    out.vrrp = record(VrrpState, data["vrrp"]) if data.get("vrrp") else None
    out.boot = record(BootHook, data["boot"]) if data.get("boot") else None
    out.asked_boot = "boot" in data
    return out


def parse_holders(data: Dict[str, Any]) -> Holders:
    """The one reader of the holders probe's JSON."""
    out = record(Holders, data)
    out.holders = [record(Holder, h) for h in data.get("holders") or []]
    return out


def parse_doctor(data: Dict[str, Any]) -> DoctorFacts:
    """The one reader of the doctor's probe's JSON."""
    out = record(DoctorFacts, data)
    for name, cls in (("engine", Engine), ("model", Model), ("smi", Smi), ("tools", Tools), ("disk", Disk),
                      ("memory", Memory), ("boot", BootHookFit)):
        setattr(out, name, record(cls, data.get(name) or {}))
    out.api_keys = record(KeyFile, data["api_keys"]) if data.get("api_keys") else None
    out.vrrp = record(KeepalivedFit, data["vrrp"]) if data.get("vrrp") else None
    out.ports = [record(Port, p) for p in data.get("ports") or []]
    for p in out.ports:
        p.holders = [record(PortHolder, h) for h in p.holders or []]
    return out


def wire(facts: HostFacts) -> Dict[str, Any]:
    """The JSON-ready form the probe prints (parse's inverse)."""
    out = asdict(facts)
    if not facts.asked_boot:
        out.pop("boot")
    out.pop("asked_boot")
    return out
