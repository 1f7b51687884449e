"""The inventory's schema: every key a host can set, its type, its bounds and its default, declared once.

Each model below is one mapping of the inventory (`HostSettings` a host's keys, `ProxySettings` its
`proxy:` block...). A field's description is the phrase an error puts after "expected"; the loader
(fleet.inventory) turns pydantic's errors into one sentence naming the file and the key path. A new
nested block (say `keeper:`) is a new `Section` subclass plus one field on `HostSettings`.

Durations are finite seconds; "0 turns it off" where a field says so, otherwise they are above 0.
Everything that reaches a shell line is quoted there; everything that reaches nginx.conf is checked
here (numbers, `auto`, addresses, user names) or quoted by the template.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from . import accelerators

MAX_INSTANCES = 256          # instances and accelerators per host; checked before any port list is built
WEEK_S = 7 * 24 * 3600.0     # the longest duration any key takes (asyncio and sleep both cope with it)
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A DNS name, or an ssh config alias (which may hold '_'): letters, digits, '-', '_' in dot-separated labels.
DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")
USER_GROUP = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*( [A-Za-z_][A-Za-z0-9_.-]*)?$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _fails(check):
    """An AfterValidator from a predicate; the error message comes from the field's description."""
    def validate(value):
        if not check(value):
            raise ValueError("invalid")
        return value
    return AfterValidator(validate)


def is_address(value: str) -> bool:
    """An IP address (v4 or v6) or a DNS name: what nginx's `listen`, aiohttp and `vllm --host` take."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(DNS_NAME.match(value))


def _as_text(value):
    """extra_args items: numbers are fine (`--max-loras 2` written as a YAML list of a string and a number)."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _int(lo: int, hi: int, what: str = "an integer"):
    return Annotated[int, Field(ge=lo, le=hi, description=f"{what} from {lo} to {hi}")]


def _seconds(off: bool = False):
    """Finite seconds up to a week; above 0, or 0 and more when 0 turns the thing off."""
    if off:
        return Annotated[float, Field(ge=0, le=WEEK_S, allow_inf_nan=False,
                                      description="a finite number of seconds from 0 (off) to 604800")]
    return Annotated[float, Field(gt=0, le=WEEK_S, allow_inf_nan=False,
                                  description="a finite number of seconds above 0, at most 604800")]


def _number(lo: float, hi: float, what: str, low_open: bool = False):
    bound = {"gt": lo} if low_open else {"ge": lo}
    return Annotated[float, Field(**bound, le=hi, allow_inf_nan=False, description=what)]


Flag = Annotated[bool, Field(description="true or false")]
Port = Annotated[int, Field(ge=1, le=65535, description="a port number (1-65535)")]
Text = Annotated[str, Field(description="a string")]
Path = Annotated[str, _fails(lambda v: not CONTROL.search(v)),
                 Field(description="a path (a string without control characters)")]
Address = Annotated[str, _fails(is_address), Field(description="an IP address or a host name")]
MiB = _number(0.001, 1048576, "a size in MiB from 0.001 to 1048576")
Strings = Annotated[list[Annotated[str, BeforeValidator(_as_text)]], Field(max_length=1024,
                                                                            description="a list of strings")]
HostNames = Annotated[list[Annotated[str, _fails(HOST_NAME.match)]], Field(max_length=MAX_INSTANCES,
                                                                            description="a list of host names")]
WorkerProcesses = Annotated[Literal["auto"] | Annotated[int, Field(ge=1, le=1024)],
                            Field(description="auto or a number of worker processes from 1 to 1024")]
NginxUser = Annotated[str, _fails(lambda v: v == "" or USER_GROUP.match(v)),
                      Field(description="a user name, optionally followed by a group name")]
AcceleratorKind = Annotated[str, _fails(lambda v: v in accelerators.KINDS),
                            Field(description="one of " + ", ".join(accelerators.KINDS))]


class Section(BaseModel):
    """A mapping of the inventory: unknown keys refused, no type coercion (`'yes'` is not true)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


class SSHSettings(Section):
    """null (or absent) leaves a key to ~/.ssh/config, then to ssh's own default (port 22, your user)."""

    host: Address | None = None
    port: Port | None = None
    user: Text | None = None
    key_file: Path | None = None
    accept_new_host_key: Flag = False
    connect_timeout_s: _seconds() = 10.0
    known_hosts: Path | None = None


class SimSettings(Section):
    load_s: _seconds(off=True) = 3.0
    prefill_ms: _number(0, 3.6e6, "a number of milliseconds from 0 to 3600000") = 100.0
    token_ms: _number(0, 3.6e6, "a number of milliseconds from 0 to 3600000") = 10.0
    output_tokens: _int(1, 1_000_000) = 200
    instant: Flag = False


class ResultsLogSettings(Section):
    max_mb: MiB = 50.0
    backups: _int(1, 100) = 3


class LogSettings(Section):
    """logs/proxy.log, rotated by size while the proxy runs."""

    max_mb: MiB = 20.0
    backups: _int(1, 100) = 3


class QueueSettings(Section):
    """The proxy's admission queue (issue 14)."""

    max: _int(0, 1_000_000) = 256                  # 0: no queue, answer at once
    timeout_s: _seconds() = 60.0
    headroom: _int(0, 65536) = 0                   # in-flight per backend beyond max_num_seqs


class ProxySettings(Section):
    port: Port = 8000
    admin_port: Port = 8001
    bind: Address = "0.0.0.0"
    health_interval_s: _seconds() = 5.0
    timeout_s: _seconds() = 300.0
    connect_timeout_s: _seconds() = 5.0
    max_body_mb: MiB = 64.0
    retries: _int(0, 16) = 2
    max_fails: _int(1, 1000) = 3
    shutdown_timeout_s: _seconds() = 30.0
    fix_numeric_user: Flag = True
    api_keys_file: Path = ""
    results_log: ResultsLogSettings = ResultsLogSettings()
    log: LogSettings = LogSettings()
    queue: QueueSettings = QueueSettings()


class NginxSettings(Section):
    """nginx mode (`inv swap-to-nginx`); empty strings mean: found on the host / under deploy_dir."""

    bin: Path = ""
    user: NginxUser = ""
    log_dir: Path = ""
    temp_dir: Path = ""
    worker_processes: WorkerProcesses = "auto"
    max_fails: _int(0, 1000) = 1                   # 0: nginx never marks a backend failed by itself
    # nginx's `server ... fail_timeout=` takes whole seconds only (`500ms` is refused there).
    fail_timeout_s: Annotated[float, _fails(lambda v: v == int(v)),
                              Field(ge=1, le=WEEK_S, allow_inf_nan=False,
                                    description="a whole number of seconds from 1 to 604800")] = 5.0
    keepalive: _int(1, 65536) = 64


class KeeperSettings(Section):
    """The keeper (hostagent/keeper.py): restarts dead or stalled instances with backoff."""

    enabled: Flag = True
    dead_after_s: _seconds() = 30.0                # /health failing this long, after healthy once: dead
    max_restarts: _int(1, 1000) = 5                # this many within window_s, then dead again: crashloop
    window_s: _seconds() = 1800.0
    backoff_base_s: _seconds(off=True) = 10.0      # wait before restart k+1: base x 2^k, at most max
    backoff_max_s: _seconds(off=True) = 300.0
    stall_probe: Flag | None = None                # null: on for engine vllm, off for sim
    probe_interval_s: _seconds() = 30.0
    probe_timeout_s: _seconds() = 20.0
    probe_failures: _int(1, 1000) = 3


class HostSettings(Section):
    """Every key of a host (and of `defaults:` and a group, which set the same keys for many hosts)."""

    # null: ssh when an ssh block is given
    connection: Annotated[Literal["local", "ssh"] | None, Field(description="local or ssh")] = None
    ssh: SSHSettings | None = None
    engine: Annotated[Literal["vllm", "sim"], Field(description="vllm or sim")] = "vllm"
    accelerator: AcceleratorKind = "dcu"
    accelerators: _int(0, MAX_INSTANCES) = 8
    instances: _int(0, MAX_INSTANCES) = 8
    base_port: Port = 8002
    bind: Address | None = None                           # null: derived (see fleet.inventory.engine_bind)
    model: Text = ""
    served_model_name: Text | None = None                 # null: the model path's last part
    max_num_seqs: _int(1, 65536) = 4
    max_model_len: _int(1, 100_000_000) = 8192
    enforce_eager: Flag = False
    gpu_memory_utilization: _number(0, 1, "a fraction in (0, 1]", low_open=True) = 0.9
    cpus_per_instance: _int(0, 4096) = 0                  # cpu accelerator: 0 splits the host's cores evenly
    cpu_kvcache_gib: _number(0, 65536, "a size in GiB above 0, at most 65536", low_open=True) = 4.0
    extra_args: Strings = []
    env_setup: Text = ""
    python: Path | None = None
    vllm_bin: Path | None = None
    deploy_dir: Annotated[Path, Field(min_length=1)] = "~/vllm-fleet"
    stagger_s: _seconds(off=True) = 5.0
    health_timeout_s: _seconds() = 600.0
    stop_grace_s: _seconds() = 10.0
    release_timeout_s: _seconds(off=True) = 60.0
    release_threshold_mib: _number(0, 1e9, "a number of MiB from 0 to 1000000000") = 1024.0
    drain_timeout_s: _seconds(off=True) = 60.0
    smi: Path | None = None
    sim: SimSettings = SimSettings()
    address: Address | None = None                        # how other hosts reach this one
    fronts: HostNames = []
    proxy: ProxySettings = ProxySettings()
    nginx: NginxSettings = NginxSettings()
    keeper: KeeperSettings = KeeperSettings()


def defaults() -> dict[str, Any]:
    """The built-in defaults as plain data."""
    return HostSettings().model_dump()
