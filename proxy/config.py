"""The proxy's configuration: a YAML file loaded and validated into a frozen dataclass."""
from __future__ import annotations

import hashlib
import ipaddress
import math
import re
import urllib.parse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .admission import DEFAULT, TENANT_KEYS, TenantConfig
from .body import Limits
from .clients import ClientConfig
from .resume import ResumeConfig
from .routes import Routes, compiled, parse_route
from .routing import POLICIES, RoutingConfig

MIB = 1024 * 1024
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")   # fleet/settings/schema.py has the same


class ConfigError(Exception):
    """A configuration mistake, told in one sentence."""


@dataclass(frozen=True)
class Address:
    """A host and port to listen on."""

    host: str
    port: int
    reuse_port: bool = True  # SO_REUSEPORT, so nginx can take the port over without a gap


@dataclass(frozen=True)
class HealthConfig:
    """Active health checks: GET path on every backend every interval_s."""

    path: str = "/health"
    interval_s: float = 5.0
    timeout_s: float = 3.0


@dataclass(frozen=True)
class ResultsLogConfig:
    """The results log: one JSON line per chat/completions request, rotated at max_mb."""

    path: str = "logs/req_results.log"
    max_mb: float = 50.0
    backups: int = 3

    @property
    def max_bytes(self) -> int:
        """The rotation size in bytes (max_mb may be fractional)."""
        return max(1, int(self.max_mb * MIB))


@dataclass(frozen=True)
class QueueConfig:
    """Where a request waits when every backend's slots are taken: one FIFO, bounded in length and time."""

    max: int = 256          # requests that may wait; 0: none, a request that finds no slot gets 429 at once
    timeout_s: float = 60.0  # the longest a request waits before 503 with Retry-After
    tenant_reserve: int = 1  # slots of a pool kept from a tenant above its share while others are active


@dataclass(frozen=True)
class ShareEntry:
    """One entry host of an active-active group: its name, its weight in the slot split, and its proxy's
    /health URL (None: this proxy itself)."""

    name: str
    weight: int
    health: str | None


@dataclass(frozen=True)
class ShareConfig:
    """Entries behind virtual addresses: this proxy is entries[me]; it learns its peers' prefix routing
    (proxy/share.py), and, when split (active-active), every backend's slots are split by weight among the
    entries whose /health answers 200."""

    me: int = 0
    entries: tuple[ShareEntry, ...] = ()
    split: bool = True


@dataclass(frozen=True)
class OtlpConfig:
    """The export of the proxy's spans over OTLP/HTTP (protobuf); endpoint None: no export."""

    endpoint: str | None = None   # the collector's traces URL, e.g. http://127.0.0.1:4318/v1/traces
    timeout_s: float = 10.0       # one export's bound (its retries included), on the exporter's own thread
    sample_ratio: float = 1.0     # of the traces the proxy starts, the share recorded (flags 01) and exported
    service_name: str = "vllm-fleet-proxy"


@dataclass(frozen=True)
class LogConfig:
    """The proxy's own log: written to path (standard error when None), rotated at max_mb while it runs."""

    path: str | None = None
    max_mb: float = 20.0
    backups: int = 3

    @property
    def max_bytes(self) -> int:
        """The rotation size in bytes (max_mb may be fractional)."""
        return max(1, int(self.max_mb * MIB))


@dataclass(frozen=True)
class ModelPool:
    """One served model (an inventory group): the backends that serve it and the names that reach it.

    name: the served name; aliases and adapters (static LoRA adapters) route here too, and so do the
    names the backends list in their /v1/models (adapters loaded at runtime). slots: per backend.
    """

    name: str
    backends: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    slots: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        """Every name configured to reach this pool."""
        return (self.name, *self.aliases, *self.adapters)


MAX_WORKERS = 1024


@dataclass(frozen=True)
class Workers:
    """How many processes serve the entry port (proxy/workers.py): count, or "auto": the host's cores less
    engine_cores (what its engines' processes need), at least 1."""

    count: int | str = 1
    engine_cores: int = 0

    def resolve(self, cores: int | None) -> int:
        """The number of workers on a host of `cores` cores."""
        if self.count != "auto":
            return int(self.count)
        return max(1, min(MAX_WORKERS, (cores or 1) - self.engine_cores))


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy needs to run."""

    backends: tuple[str, ...]
    listen: Address = Address("0.0.0.0", 8000)
    admin: Address = Address("127.0.0.1", 8001)
    health: HealthConfig = HealthConfig()
    timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    max_body_mb: float = 64.0
    results_log: ResultsLogConfig = ResultsLogConfig()
    log: LogConfig = LogConfig()
    retries: int = 2              # other backends tried when the connection failed or 502/503 came first
    max_fails: int = 3            # consecutive 5xx answers that take a backend out until its next good /health
    shutdown_timeout_s: float = 30.0
    fix_numeric_user: bool = True  # the seed's incident: vLLM answers 400 to a numeric `user`
    api_keys_file: str | None = None
    slots: int = 0                # per backend: max_num_seqs + proxy.queue.headroom; 0: no limit, no queue
    queue: QueueConfig = QueueConfig()
    models: tuple[ModelPool, ...] = ()  # empty: one pool of every backend, the body's model is not read
    routing: RoutingConfig = RoutingConfig()
    otlp: OtlpConfig = OtlpConfig()
    tenants: dict = field(default_factory=dict)   # name -> TenantConfig; `default` is there without it
    share: ShareConfig | None = None  # active-active entries: this proxy's share of every backend's slots
    open_routes: tuple[str, ...] = ()  # engine routes passed on beside the inference API (proxy/routes.py)
    limits: Limits = Limits()     # what one request body may expand into (proxy/body.py)

    @property
    def routes(self) -> Routes:
        """The routes of the engines the public port passes on."""
        return compiled(self.open_routes)
    client: ClientConfig = ClientConfig()  # the client sockets' deadlines and bound (proxy/clients.py)
    resume: ResumeConfig = ResumeConfig()  # a stream cut by its instance, finished on another (proxy/resume.py)
    workers: Workers = Workers()  # processes on the entry port, sharing every backend's slots (proxy/workers.py)

    @property
    def max_body_bytes(self) -> int:
        """The request body limit in bytes."""
        return int(self.max_body_mb * MIB)


TOP_KEYS = ("listen", "admin", "backends", "health", "timeout_s", "connect_timeout_s",
            "max_body_mb", "results_log", "log", "retries", "max_fails", "shutdown_timeout_s",
            "fix_numeric_user", "api_keys_file", "slots", "queue", "models", "routing", "otlp", "tenants",
            "share", "open_routes", "limits", "client", "resume", "workers")
LIMIT_KEYS = tuple(f.name for f in fields(Limits))
MAX_JSON_DEPTH = 512              # fleet/settings/schema.py has the same
CLIENT_KEYS = tuple(f.name for f in fields(ClientConfig))
RESUME_KEYS = tuple(f.name for f in fields(ResumeConfig))
ROUTING_KEYS = tuple(f.name for f in fields(RoutingConfig))
POOL_KEYS = ("name", "aliases", "adapters", "slots", "backends")


def load_config(path: str | Path) -> ProxyConfig:
    """Read and validate the YAML config file at path."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}.") from None
    return parse_config(data, source=str(path))


def load_api_keys(path: str | None, tenants=(DEFAULT,)) -> dict[bytes, str] | None:
    """The client API keys in path and the tenant of each, or None when auth is off. A line is `KEY` (the
    tenant `default`) or `KEY TENANT`, TENANT one of tenants (the config's); # comments and blank lines
    skipped. No error names a key, only its line."""
    if path is None:
        return None
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read api_keys_file {path}: {e.strerror or e}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"api_keys_file {path} is not UTF-8 text.") from None
    keys: dict[bytes, str] = {}
    for n, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 2:
            raise ConfigError(f"api_keys_file {path} line {n} has more than a key and a tenant; write `KEY` "
                              "or `KEY TENANT`.")
        key, tenant = words[0].encode(), (words[1] if len(words) == 2 else DEFAULT)
        if tenant not in tenants:
            raise ConfigError(f"api_keys_file {path} line {n} names the tenant {tenant!r}, which proxy.tenants "
                              f"does not define (it has {', '.join(sorted(tenants))}); add it there or fix the line.")
        if keys.get(key, tenant) != tenant:
            raise ConfigError(f"api_keys_file {path} line {n} gives a key listed before to another tenant; "
                              "give each key one tenant.")
        keys[key] = tenant
    if not keys:
        raise ConfigError(f"api_keys_file {path} holds no key; put one key per line, or drop the setting.")
    return keys


def keys_digest(keys: dict[bytes, str] | None) -> str | None:
    """A short fingerprint of the API keys and their tenants (None: auth off): the first 16 hex digits of
    the SHA-256 of the lines `KEY` (tenant default) or `KEY TENANT`, sorted, one per line. /admin/config
    reports the running one; the host agent computes the same from the key file (hostagent.apikeys.digest),
    so a deploy knows whether the proxy runs the file's keys."""
    if keys is None:
        return None
    lines = sorted(k if t == DEFAULT else k + b" " + t.encode() for k, t in keys.items())
    return hashlib.sha256(b"\n".join(lines)).hexdigest()[:16]


def parse_config(data: Any, source: str = "config") -> ProxyConfig:
    """Validate already-parsed YAML data into a ProxyConfig."""
    if data is None:
        raise ConfigError(f"{source} is empty; it needs at least 'backends'.")
    top = _mapping(data, source, TOP_KEYS, prefix="")
    if "backends" not in top:
        raise ConfigError(f"{source}: 'backends' is required (a list of host:port).")
    defaults = ProxyConfig(backends=())
    health = _mapping(top.get("health", {}), "health", ("path", "interval_s", "timeout_s"))
    results = _mapping(top.get("results_log", {}), "results_log", ("path", "max_mb", "backups"))
    queue = _mapping(top.get("queue", {}), "queue", ("max", "timeout_s", "tenant_reserve"))
    own_log = _mapping(top.get("log", {}), "log", ("path", "max_mb", "backups"))
    admin = _address(top.get("admin", {}), "admin", defaults.admin)
    if not _is_loopback(admin.host):
        raise ConfigError(f"admin.host must be a loopback address, not {admin.host!r}.")
    listen = _address(top.get("listen", {}), "listen", defaults.listen)
    if listen.port == admin.port:
        raise ConfigError(f"listen and admin cannot share port {admin.port}.")
    backends = _backends(top["backends"])
    return ProxyConfig(
        backends=backends,
        listen=listen,
        admin=admin,
        health=HealthConfig(
            path=_health_path(health.get("path", defaults.health.path)),
            interval_s=_positive(health, "interval_s", defaults.health.interval_s, "health."),
            timeout_s=_positive(health, "timeout_s", defaults.health.timeout_s, "health."),
        ),
        timeout_s=_positive(top, "timeout_s", defaults.timeout_s),
        connect_timeout_s=_positive(top, "connect_timeout_s", defaults.connect_timeout_s),
        max_body_mb=_positive(top, "max_body_mb", defaults.max_body_mb),
        results_log=ResultsLogConfig(
            path=_text(results.get("path", defaults.results_log.path), "results_log.path"),
            max_mb=_positive(results, "max_mb", defaults.results_log.max_mb, "results_log."),
            backups=_backups(results.get("backups", defaults.results_log.backups), "results_log"),
        ),
        log=LogConfig(
            path=_optional_text(own_log.get("path"), "log.path"),
            max_mb=_positive(own_log, "max_mb", defaults.log.max_mb, "log."),
            backups=_backups(own_log.get("backups", defaults.log.backups), "log"),
        ),
        retries=_count(top, "retries", defaults.retries, minimum=0),
        max_fails=_count(top, "max_fails", defaults.max_fails, minimum=1),
        shutdown_timeout_s=_positive(top, "shutdown_timeout_s", defaults.shutdown_timeout_s),
        fix_numeric_user=_flag(top, "fix_numeric_user", defaults.fix_numeric_user),
        api_keys_file=_optional_text(top.get("api_keys_file"), "api_keys_file"),
        slots=_count(top, "slots", defaults.slots, minimum=0),
        queue=QueueConfig(max=_count(queue, "max", defaults.queue.max, minimum=0, prefix="queue."),
                          timeout_s=_positive(queue, "timeout_s", defaults.queue.timeout_s, "queue."),
                          tenant_reserve=_count(queue, "tenant_reserve", defaults.queue.tenant_reserve, minimum=0,
                                                prefix="queue.")),
        models=_models(top.get("models"), backends),
        routing=_routing(top.get("routing", {})),
        otlp=_otlp(top.get("otlp", {})),
        tenants=_tenants(top.get("tenants")),
        share=_share(top.get("share")),
        open_routes=_open_routes(top.get("open_routes")),
        limits=_limits(top.get("limits", {})),
        client=_client(top.get("client", {})),
        resume=_resume(top.get("resume", {})),
        workers=_workers(top.get("workers", 1), top.get("tenants")),
    )


def _workers(value: Any, tenants: Any) -> Workers:
    """workers: a number of processes, or {count: N or auto, engine_cores: C} (auto: the host's cores less
    C, at least 1). Not beside tenants: each worker would admit a tenant's limits in full."""
    m = value if isinstance(value, dict) else {"count": value}
    m = _mapping(m, "workers", ("count", "engine_cores"))
    count = m.get("count", 1)
    if count != "auto" and (isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_WORKERS):
        raise ConfigError(f"workers must be a whole number from 1 to {MAX_WORKERS}, or auto; not {count!r}.")
    if count != 1 and tenants:
        raise ConfigError("workers above 1 do not split the tenants' limits yet: keep workers 1 with tenants.")
    return Workers(count, _count(m, "engine_cores", 0, minimum=0, prefix="workers."))


def _open_routes(value: Any) -> tuple[str, ...]:
    """open_routes: a list of `[METHOD ]/path` (a `{name}` segment matches any one segment)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError("open_routes must be a list of routes, each `/path` or `METHOD /path`.")
    for entry in value:
        if parse_route(entry) is None:
            raise ConfigError(f"open_routes: {entry!r} is not `/path` or `METHOD /path` (GET, POST, PUT, PATCH, "
                              "DELETE; segments of letters, digits, '.', '_', '~', '-', or `{name}`).")
    return tuple(value)


def _limits(value: Any) -> Limits:
    """The `limits` mapping: whole numbers of at least 1 (proxy/body.py Limits, its defaults)."""
    m = _mapping(value, "limits", LIMIT_KEYS)
    defaults = Limits()
    limits = Limits(**{k: _count(m, k, getattr(defaults, k), minimum=1, prefix="limits.") for k in LIMIT_KEYS})
    if limits.max_json_depth > MAX_JSON_DEPTH:   # deeper, Python's own parse and dump would give up first
        raise ConfigError(f"limits.max_json_depth must be at most {MAX_JSON_DEPTH}, not {limits.max_json_depth}.")
    return limits


def _client(value: Any) -> ClientConfig:
    """The client section: the client sockets' deadlines, and max_connections (0 or `auto`: derived)."""
    m = _mapping(value, "client", CLIENT_KEYS)
    d = ClientConfig()
    bound = m.get("max_connections", d.max_connections)
    return ClientConfig(**{k: _positive(m, k, getattr(d, k), "client.") for k in CLIENT_KEYS if k.endswith("_s")},
                        max_connections=_count({"max_connections": 0 if bound == "auto" else bound},
                                               "max_connections", 0, minimum=0, prefix="client."))


def _resume(value: Any) -> ResumeConfig:
    """The resume section: enabled, and max_attempts and stall_s within the bounds ResumeConfig declares."""
    m = _mapping(value, "resume", RESUME_KEYS)
    d = ResumeConfig()
    return ResumeConfig(enabled=_flag(m, "enabled", d.enabled, "resume."), **{
        f.name: _bounded(m, f.name, getattr(d, f.name), *f.metadata["bounds"], prefix="resume.")
        for f in fields(ResumeConfig) if "bounds" in f.metadata})


def _share(value: Any) -> ShareConfig | None:
    """The `share` mapping: {me, entries: [{name, weight, health}], split}, health null for entries[me] only."""
    if value is None:
        return None
    m = _mapping(value, "share", ("me", "entries", "split"))
    entries = m.get("entries")
    if not isinstance(entries, list) or len(entries) < 2:
        raise ConfigError("share.entries must be a list of two or more {name, weight, health}.")
    me = _count(m, "me", 0, minimum=0, prefix="share.")
    out = []
    for i, e in enumerate(entries):
        e = _mapping(e, f"share.entries[{i}]", ("name", "weight", "health"))
        health = _optional_text(e.get("health"), f"share.entries[{i}].health")
        if (health is None) != (i == me):
            raise ConfigError(f"share.entries[{i}].health must be " + ("null: it is this proxy (share.me)."
                              if i == me else "the peer proxy's /health URL."))
        out.append(ShareEntry(_text(e.get("name"), f"share.entries[{i}].name"),
                              _count(e, "weight", 1, minimum=1, prefix=f"share.entries[{i}]."), health))
    if me >= len(out):
        raise ConfigError(f"share.me must be below {len(out)}, the number of entries, not {me}.")
    return ShareConfig(me, tuple(out), _flag(m, "split", True, prefix="share."))


def _mapping(value: Any, where: str, allowed: tuple[str, ...], prefix: str | None = None) -> dict:
    """value as a dict whose keys are all in allowed; prefix names its keys in errors."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, not {type(value).__name__}.")
    prefix = f"{where}." if prefix is None else prefix
    for key in value:
        if key not in allowed:
            raise ConfigError(f"unknown config key '{prefix}{key}' (known: {', '.join(allowed)}).")
    return value


def _address(value: Any, where: str, default: Address) -> Address:
    """A {host, port, reuse_port} mapping with defaults."""
    m = _mapping(value, where, ("host", "port", "reuse_port"))
    host = _text(m.get("host", default.host), f"{where}.host")
    return Address(host=host, port=_port(m.get("port", default.port), f"{where}.port"),
                   reuse_port=_flag(m, "reuse_port", default.reuse_port, f"{where}."))


def _backends(value: Any) -> tuple[str, ...]:
    """A non-empty list of distinct host:port names."""
    if not isinstance(value, list) or not value:
        raise ConfigError("backends must be a non-empty list of host:port.")
    names: list[str] = []
    for item in value:
        host, _, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        if not host or "/" in item:
            raise ConfigError(f"backend {item!r} must be written host:port.")
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            raise ConfigError(f"backend {item!r}: write an IPv6 address in brackets, as [::1]:8000.")
        _port(port, f"backend {item!r}", from_text=True)
        if item in names:
            raise ConfigError(f"backend {item} is listed twice.")
        names.append(item)
    return tuple(names)


def _routing(value: Any) -> RoutingConfig:
    """The routing section: a known policy, and every other key within the bounds RoutingConfig declares."""
    m = _mapping(value, "routing", ROUTING_KEYS)
    d = RoutingConfig()
    policy = m.get("policy", d.policy)
    if policy not in POLICIES:
        raise ConfigError(f"routing.policy must be one of {', '.join(POLICIES)}, not {policy!r}.")
    return RoutingConfig(policy=policy, **{
        f.name: _bounded(m, f.name, getattr(d, f.name), *f.metadata["bounds"], prefix="routing.")
        for f in fields(RoutingConfig) if "bounds" in f.metadata})


def _tenants(value: Any) -> dict[str, TenantConfig]:
    """The tenants section: name -> its settings, each within the bounds TenantConfig declares."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"tenants must be a mapping of tenant names to their settings, not {type(value).__name__}.")
    out = {}
    for name, settings in value.items():
        if not isinstance(name, str) or not TENANT_NAME.match(name):
            raise ConfigError(f"tenant name {name!r} must be letters, digits, '.', '_' or '-' (at most 64).")
        where = f"tenants.{name}"
        m = _mapping(settings, where, TENANT_KEYS)
        out[name] = TenantConfig(**{
            f.name: (None if m.get(f.name) is None and f.default is None
                     else _bounded(m, f.name, f.default or 0, *f.metadata["bounds"], prefix=f"{where}."))
            for f in fields(TenantConfig)})
    return out


def _otlp(value: Any) -> OtlpConfig:
    """The otlp section: an http(s) URL or nothing (no export), the export's timeout, the service name."""
    m = _mapping(value, "otlp", ("endpoint", "timeout_s", "service_name", "sample_ratio"))
    d = OtlpConfig()
    endpoint = _optional_text(m.get("endpoint"), "otlp.endpoint")
    if endpoint is not None:
        try:
            url = urllib.parse.urlsplit(endpoint)
            url.port   # raises ValueError on a port that is not a number
        except ValueError:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"otlp.endpoint must be an http:// or https:// URL of the collector's traces "
                              f"endpoint (such as http://127.0.0.1:4318/v1/traces), not {endpoint!r}.")
    return OtlpConfig(endpoint=endpoint, timeout_s=_positive(m, "timeout_s", d.timeout_s, "otlp."),
                      service_name=_text(m.get("service_name", d.service_name), "otlp.service_name"),
                      sample_ratio=_ratio(m, "sample_ratio", d.sample_ratio, "otlp."))


def _ratio(m: dict, key: str, default: float, prefix: str) -> float:
    """m[key] (or default) as a number from 0 to 1."""
    value = m.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{prefix}{key} must be a number from 0 to 1, not {value!r}.")
    return float(value)


def _models(value: Any, backends: tuple[str, ...]) -> tuple[ModelPool, ...]:
    """The pools of the models form: every backend in exactly one, every name reaching one pool."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise ConfigError("models must be a non-empty list of {name, backends, aliases, adapters, slots}.")
    pools: list[ModelPool] = []
    owner: dict[str, str] = {}     # backend -> its pool
    named: dict[str, str] = {}     # name, alias or adapter -> its pool
    for n, item in enumerate(value):
        m = _mapping(item, f"models[{n}]", POOL_KEYS)
        name = _text(m.get("name"), f"models[{n}].name")
        where = f"model {name!r}"
        members = m.get("backends")
        if not isinstance(members, list) or not members:
            raise ConfigError(f"{where}: backends must be a non-empty list of the backends that serve it.")
        for b in members:
            if b not in backends:
                raise ConfigError(f"{where}: backend {b!r} is not in 'backends'; list it there too.")
            if b in owner:
                raise ConfigError(f"backend {b} is in two models, {owner[b]!r} and {name!r}; an instance "
                                  "serves one model.")
            owner[b] = name
        pool = ModelPool(name=name, backends=tuple(members), aliases=_names(m, "aliases", where),
                         adapters=_names(m, "adapters", where),
                         slots=_count(m, "slots", 0, minimum=0, prefix=f"{where}: "))
        for label in pool.names:
            if named.get(label, name) != name:
                raise ConfigError(f"the name {label!r} reaches two models, {named[label]!r} and {name!r}; "
                                  "give each name to one model.")
            named[label] = name
        pools.append(pool)
    orphans = [b for b in backends if b not in owner]
    if orphans:
        raise ConfigError(f"backend(s) {', '.join(orphans)} serve no model; put each in one of models[].backends.")
    return tuple(pools)


def _names(m: dict, key: str, where: str) -> tuple[str, ...]:
    """A list of non-empty strings (absent: empty)."""
    value = m.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ConfigError(f"{where}: {key} must be a list of names, not {value!r}.")
    return tuple(value)


def _port(value: Any, where: str, from_text: bool = False) -> int:
    """A TCP port number in 1..65535."""
    if from_text and isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"{where} must be a port number from 1 to 65535, not {value!r}.")
    return value


def _positive(m: dict, key: str, default: float, prefix: str = "") -> float:
    """m[key] (or default) as a finite number greater than zero."""
    value = m.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{prefix}{key} must be a finite number greater than 0, not {value!r}.")
    return float(value)


def _bounded(m: dict, key: str, default: int | float, lo: float, hi: float, prefix: str) -> int | float:
    """m[key] (or default) from lo to hi: a whole number when the default is one."""
    value = m.get(key, default)
    whole = isinstance(default, int)
    if (isinstance(value, bool) or not isinstance(value, int if whole else (int, float))
            or not lo <= value <= hi):
        what = "a whole number" if whole else "a number"
        raise ConfigError(f"{prefix}{key} must be {what} from {lo} to {hi}, not {value!r}.")
    return value if whole else float(value)


def _count(m: dict, key: str, default: int, minimum: int, prefix: str = "") -> int:
    """m[key] (or default) as a whole number of at least minimum."""
    value = m.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{prefix}{key} must be a whole number of at least {minimum}, not {value!r}.")
    return value


def _flag(m: dict, key: str, default: bool, prefix: str = "") -> bool:
    """m[key] (or default) as true or false."""
    value = m.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{prefix}{key} must be true or false, not {value!r}.")
    return value


def _optional_text(value: Any, where: str) -> str | None:
    """A non-empty string, or None when absent, null or empty."""
    return None if value in (None, "") else _text(value, where)


def _backups(value: Any, where: str) -> int:
    """The number of rotated log files kept (at least 1, or rotation would truncate)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}.backups must be a whole number of at least 1, not {value!r}.")
    return value


def _text(value: Any, where: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} must be a non-empty string, not {value!r}.")
    return value


def _health_path(value: Any) -> str:
    """An absolute URL path."""
    path = _text(value, "health.path")
    if not path.startswith("/"):
        raise ConfigError(f"health.path must start with '/', not {path!r}.")
    return path


def _is_loopback(host: str) -> bool:
    """Whether host names the loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
