"""The inventory's schema: every key a host can set, its type, its bounds and its default, declared once.

Each model below is one mapping of the inventory (`HostSettings` a host's keys, `ProxySettings` its
`proxy:` block...). A field's description is the phrase an error puts after "expected"; its `doc()`
text is what the reference (docs/inventory.md, written by fleet.settings.schema_doc) says about it. The loader
(fleet.settings.inventory) turns pydantic's errors into one sentence naming the file and the key path. A new
nested block (say `keeper:`) is a new `Section` subclass plus one field on `HostSettings`.

Durations are finite seconds; "0 turns it off" where a field says so, otherwise they are above 0.
Values are checked, then quoted: each string is checked here for what it is (an address, an interface
name, a served name, a path without control characters) and quoted by the template for the file it lands
in (fleet.render's filters: `quote` for shell, `nginx_quote`, `keepalived_script`, `yaml` and `tojson`).
"""
from __future__ import annotations

import ipaddress
import re
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from fleet.settings import accelerators

MAX_INSTANCES = 256          # instances and accelerators per host; checked before any port list is built
WEEK_S = 7 * 24 * 3600.0     # the longest duration any key takes (asyncio and sleep both cope with it)
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A DNS name, or an ssh config alias (which may hold '_'): letters, digits, '-', '_' in dot-separated labels.
DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")
USER_GROUP = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*( [A-Za-z_][A-Za-z0-9_.-]*)?$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# A served name, alias or adapter name: what a request's `model` says; no blank, no control character,
# no '=' (the `--lora-modules name=path` form splits there) and no leading '-' (an engine would read an
# option: the names follow `--served-model-name` as arguments of their own).
SERVED_NAME = re.compile(r"^(?!-)[^\s=\x00-\x1f\x7f]{1,200}$")
# A network interface name as Linux takes it (at most 15 bytes, no '/', ':' or blank), narrowed to the
# characters real names use; an IPv6 zone id (`fe80::1%eth0`) is one.
INTERFACE = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.-]{1,15}$")


def _fails(check):
    """An AfterValidator from a predicate; the error message comes from the field's description."""
    def validate(value):
        if not check(value):
            raise ValueError("invalid")
        return value
    return AfterValidator(validate)


def is_address(value: str, zone: bool = True) -> bool:
    """An IP address (v4 or v6) or a DNS name: what nginx's `listen`, aiohttp and `vllm --host` take. An
    IPv6 address may name its zone (`fe80::1%eth0`) when `zone`: an interface name, nothing else (Python's
    ipaddress takes any text after the '%', a newline and `$(...)` included)."""
    ip, percent, zone_id = value.partition("%")
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return not percent and bool(DNS_NAME.match(value))
    return not percent or (zone and parsed.version == 6 and bool(INTERFACE.match(zone_id)))


def is_otlp_url(value: str) -> bool:
    """An http(s) URL with a host (an OTLP collector's endpoint), or empty (off)."""
    if value == "":
        return True
    try:
        url = urllib.parse.urlsplit(value)
        url.port   # a port that is not a number raises
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname) and not re.search(r"\s", value)


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


def doc(default, text: str):
    """A field's default and its reference text, the description in docs/inventory.md
    (fleet.settings.schema_doc). Kept apart from `description`, which is the phrase an error puts after
    "expected" and the type in the reference."""
    return Field(default, json_schema_extra={"doc": text})


def _number(lo: float, hi: float, what: str, low_open: bool = False):
    bound = {"gt": lo} if low_open else {"ge": lo}
    return Annotated[float, Field(**bound, le=hi, allow_inf_nan=False, description=what)]


Flag = Annotated[bool, Field(description="true or false")]
Port = Annotated[int, Field(ge=1, le=65535, description="a port number (1-65535)")]
Text = Annotated[str, Field(description="a string")]
# No leading '-': a path is a command's argument (`mkdir -p`, `vllm serve MODEL`), never its option.
Path = Annotated[str, _fails(lambda v: not CONTROL.search(v) and not v.startswith("-")),
                 Field(description="a path (a string without control characters, not beginning with '-')")]
Address = Annotated[str, _fails(is_address),
                    Field(description="an IP address (IPv6 may end in %INTERFACE) or a host name")]
# nginx's `listen` takes no zone id (`[fe80::1%eth0]:8000` is an invalid IPv6 address to it).
EntryAddress = Annotated[str, _fails(lambda v: is_address(v, zone=False)),
                         Field(description="an IP address or a host name (no %zone: nginx's listen takes none)")]
MiB = _number(0.001, 1048576, "a size in MiB from 0.001 to 1048576")
Strings = Annotated[list[Annotated[str, BeforeValidator(_as_text)]], Field(max_length=1024,
                                                                            description="a list of strings")]
HostNames = Annotated[list[Annotated[str, _fails(HOST_NAME.match)]], Field(max_length=MAX_INSTANCES,
                                                                            description="a list of host names")]
ServedName = Annotated[str, _fails(SERVED_NAME.match),
                      Field(description="a name without blanks, control characters or '=', not beginning "
                                        "with '-' (at most 200 characters)")]
ServedNames = Annotated[list[ServedName], Field(max_length=1024, description="a list of names")]
Adapters = Annotated[dict[ServedName, Path], Field(max_length=1024,
                                                   description="a mapping of adapter names to paths")]
# A login name (`inv render` makes /home/USER of it): letters, digits, '.', '_', '-', and '@' after the first.
UserName = Annotated[str, _fails(re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.@-]{0,255}$").match),
                     Field(description="a user name (letters, digits, '.', '_', '-', '@')")]
CardsPerInstance = Annotated[int, Field(ge=1, le=64, description="an integer from 1 to 64")]
WorkerProcesses = Annotated[Literal["auto"] | Annotated[int, Field(ge=1, le=1024)],
                            Field(description="auto or a number of worker processes from 1 to 1024")]
NginxUser = Annotated[str, _fails(lambda v: v == "" or USER_GROUP.match(v)),
                      Field(description="a user name, optionally followed by a group name")]
OtlpUrl = Annotated[str, _fails(is_otlp_url),
                    Field(description="an http:// or https:// URL (or empty: off)")]
def is_virtual_address(value: str) -> bool:
    """An IPv4 address with its prefix length (`10.9.0.100/24`): a VRRP virtual address."""
    try:
        ipaddress.IPv4Interface(value)
    except ValueError:
        return False
    return "/" in value


VirtualAddresses = Annotated[list[Annotated[str, _fails(is_virtual_address)]],
                             Field(max_length=16, description="a list of IPv4 addresses with their prefix "
                                                              "length (10.9.0.100/24)")]
Interface = Annotated[str, _fails(lambda v: v == "" or INTERFACE.match(v)),
                      Field(description="a network interface name (at most 15 letters, digits, '.', '-', '_')")]
AcceleratorKind = Annotated[str, _fails(lambda v: v in accelerators.KINDS),
                            Field(description="one of " + ", ".join(accelerators.KINDS))]


# The engines' routes the entry port passes on, on both fronts (proxy/routes.py has the same list;
# tests/test_routes.py holds them equal): docs/proxy.md says why each is here.
INFERENCE_ROUTES = (
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
    ("POST", "/v1/responses"), ("POST", "/v1/embeddings"), ("POST", "/v1/score"), ("POST", "/v1/rerank"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"))
# vLLM 0.32's management routes: through the entry they would act on whichever instance the pick chose, for
# any key holder; they are the operator's, on the instances' own ports (runtime adapters: `inv lora`).
ENGINE_MANAGEMENT = (
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/reset_prefix_cache", "/reset_mm_cache",
    "/reset_encoder_cache", "/sleep", "/wake_up", "/release_kv_cache_memory", "/collective_rpc",
    "/start_profile", "/stop_profile", "/pause", "/resume", "/abort_requests", "/inference/v1/abort_requests",
    "/scale_elastic_ep", "/fault_tolerance/apply", "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
    "/update_weights", "/finish_weight_update", "/update_weight_version")
ENTRY_OWN = ("/health", "/metrics", "/peer/prefixes")     # answered by the entry itself
# `[METHOD ]/path`, segments literal or `{name}` (proxy/routes.py's OPEN_ROUTE).
OPEN_ROUTE = re.compile(r"^(?:(GET|POST|PUT|PATCH|DELETE) )?((?:/(?:[A-Za-z0-9._~-]+|\{[A-Za-z_]\w*\}))+)$")


def is_open_route(value: str) -> bool:
    """A route proxy.open_routes may open: `[METHOD ]/path`, no dot segment, not the engines' management
    and not a path the entry answers itself."""
    m = OPEN_ROUTE.match(value)
    return bool(m) and not any(s in (".", "..") for s in m.group(2).split("/")) and \
        m.group(2) not in ENGINE_MANAGEMENT + ENTRY_OWN


OpenRoutes = Annotated[list[Annotated[str, _fails(is_open_route)]], Field(
    max_length=256, description="a list of routes, each `/path` or `METHOD /path` (a `{name}` segment takes any "
    "one segment), none of them an engine's management route (docs/proxy.md) nor /health or /metrics")]


class Section(BaseModel):
    """A mapping of the inventory: unknown keys refused, no type coercion (`'yes'` is not true)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


class SSHSettings(Section):
    """null (or absent) leaves a key to ~/.ssh/config, then to ssh's own default (port 22, your user)."""

    host: Address | None = doc(None,
        "The SSH address: an IP address, a host name, or a `Host` alias of `~/.ssh/config` (whose "
        "HostName, Port, User, IdentityFile, ProxyJump and UserKnownHostsFile are then used; "
        "inventory keys win over them).")
    port: Port | None = doc(None,
        "The SSH port. Unset: `~/.ssh/config`'s Port, else 22.")
    user: UserName | None = doc(None,
        "The login user. Unset: `~/.ssh/config`'s User, else your own user name.")
    key_file: Path | None = doc(None,
        "The private key file. Unset: `~/.ssh/config`'s IdentityFile, else ssh's own default.")
    accept_new_host_key: Flag = doc(False,
        "Accept an unknown host key and record it in `ssh.known_hosts`; a key that differs from the "
        "recorded one is always refused.")
    connect_timeout_s: _seconds() = doc(10.0,
        "The SSH connect timeout.")
    known_hosts: Path | None = doc(None,
        "The known_hosts file host keys are checked against (and recorded into). Unset: "
        "`~/.ssh/config`'s UserKnownHostsFile, else `~/.ssh/known_hosts`.")


class SimSettings(Section):
    load_s: _seconds(off=True) = doc(3.0,
        "How long the sim engine 'loads weights' (`/health` 503 meanwhile); 0 turns it off.")
    overhead_ms: _number(0, 3.6e6, "a number of milliseconds from 0 to 3600000") | None = doc(None,
        "The sim engine's fixed time to first token, before prefill. Unset: the sim's default, 20 "
        "(vLLM 0.32's CPU build answers a short prompt's first chunk in 17-30 ms).")
    prefill_ms: _number(0, 3.6e6, "a number of milliseconds from 0 to 3600000") = doc(100.0,
        "The sim engine's prefill time per 1,000 prompt tokens not found in its prefix cache (an "
        "image counts 256 tokens).")
    kv_blocks: _int(1, 100_000_000) | None = doc(None,
        "The sim engine's prefix cache, in blocks of 16 tokens (`--block-size` in `extra_args` changes "
        "that, as vLLM's); least recently used blocks no running request holds are evicted. Unset: the sim's default, 16384 (262,144 tokens, an 8B model's "
        "KV cache on a 64 GB card).")
    token_ms: _number(0, 3.6e6, "a number of milliseconds from 0 to 3600000") = doc(10.0,
        "The sim engine's time per output token.")
    output_tokens: _int(1, 1_000_000) = doc(200,
        "The sim engine's natural answer length in tokens (`max_tokens` cuts it short with "
        "finish_reason `length`).")
    instant: Flag = doc(False,
        "No load, prefill or token time: for benchmarks of the proxy alone.")


class ResultsLogSettings(Section):
    max_mb: MiB = doc(50.0,
        "Size at which `logs/req_results.log` rotates; `logs/keeper.log` rotates at the same size.")
    backups: _int(1, 100) = doc(3,
        "Rotated files kept of the results log (and of the keeper's log).")


class LogSettings(Section):
    """logs/proxy.log, rotated by size while the proxy runs."""

    max_mb: MiB = doc(20.0,
        "Size at which `logs/proxy.log` rotates while the proxy runs (its standard output and error "
        "land there too); a change restarts the proxy at the next deploy.")
    backups: _int(1, 100) = doc(3,
        "Rotated files of `logs/proxy.log` kept; a change restarts the proxy at the next deploy.")


class EngineLogSettings(Section):
    """logs/vllm_<i>.log, rotated by size while the engine runs (hostagent/logwriter.py)."""

    max_mb: MiB = doc(100.0,
        "Size at which an instance's `logs/vllm_<i>.log` rotates while the engine runs (its standard "
        "output and error go through a rotating writer); at most `(backups + 1) x max_mb` per instance.")
    backups: _int(1, 100) = doc(3,
        "Rotated files of each engine log kept (`vllm_<i>.log.1` ...); a start rotates too, so `.1` holds "
        "the previous run's last output.")


class QueueSettings(Section):
    """The proxy's admission queue (issue 14)."""

    max: _int(0, 1_000_000) = doc(256,
        "Requests that may wait in the proxy's queue when every backend's slots are taken; beyond it,"
        " 429 with `Retry-After: 1`. 0: no queue, such a request gets 429 at once.")
    timeout_s: _seconds() = doc(60.0,
        "The longest a request waits in the queue; then 503 with `Retry-After: 5`.")
    headroom: _int(0, 65536) = doc(0,
        "Requests a backend gets beyond its `max_num_seqs` (its slots are `max_num_seqs + headroom`):"
        " a little headroom keeps the engine's own scheduler fed between two requests. An entry host "
        "(`fronts`) gives each backend its member's `max_num_seqs` plus the entry's own headroom.")
    tenant_reserve: _int(0, 65536) = doc(1,
        "With `proxy.tenants`: slots of each model's pool a tenant holding more than its weighted share "
        "may not take (the last ones free) while another tenant has been active there within 5 s, so a "
        "request of a tenant that is not flooding finds a slot free instead of waiting for one to end; "
        "at most this many slots stand idle for it. 0: none (fully work-conserving).")


# The proxy's routing policies (proxy/routing/: its POLICIES registry); nginx mode does least_conn alone.
# tests/test_routing_contract.py holds these names and RoutingSettings' bounds and defaults equal to the proxy's.
POLICIES = ("least_conn", "prefix")
NGINX_POLICY = "least_conn"


class RoutingSettings(Section):
    """How the proxy picks a backend (issue 19); docs/proxy.md has the rules, docs/PERFORMANCE.md the figures.
    conf/proxy.yaml's `routing` is these keys as they are."""

    policy: Annotated[Literal[POLICIES], Field(description=" or ".join(POLICIES))] = doc(
        "prefix",
        "`least_conn`: the backend with the fewest requests in flight. `prefix`: where the request's prompt "
        "prefix was sent before (its KV cache is likely there), unless that is too loaded; the proxy then "
        "reads the body before it picks. nginx mode has no body-aware routing.")
    min_match_tokens: _int(0, 10_000_000) = doc(256,
        "prefix: the prefill (in tokens, about 4 bytes of text each) a backend's match must save over "
        "the least loaded backend's to win; shorter, the request goes by load.")
    min_match_ratio: _number(0, 1, "a number from 0 to 1") = doc(0.5,
        "prefix: the share of the prompt a match must cover to win (a new conversation that shares only "
        "a system prompt goes by load).")
    balance_abs: _int(0, 65536) = doc(1,
        "prefix: the prefix's backend is passed over for the least loaded one when it has more than "
        "this many requests in flight more than it ...")
    balance_rel: _number(1, 1000, "a number from 1 to 1000") = doc(1.5,
        "... and more than this many times as many.")
    max_blocks: _int(1, 100_000_000) = doc(262144,
        "prefix: the prompt blocks (64 bytes each) the proxy remembers per model, least recently used "
        "dropped first; about 780 bytes of memory each. Where the backends' engines publish their KV "
        "caches' sizes and those hold more blocks in all, as many as they hold, up to 4 times this "
        "(each backend's share trimmed to its cache): at the default, up to some 800 MB per model and "
        "per worker process.")
    lookahead: _int(0, 1024) = doc(16,
        "prefix: how many queued requests a freed slot may look past for one whose prefix is on that "
        "backend; no request is passed over more than this many times. 0: strict FIFO.")
    spread_after: _int(0, 65536) = doc(3,
        "prefix: when a request matches only a prefix that other prompts share and leave (a long system "
        "prompt, a group's context), a backend holding it takes the request until this many prompts "
        "per 1,000 tokens of the shared part (at least this many) branched off it there; then the least "
        "loaded backend, holder or not, so conversations spread even at low load, while a long shared "
        "part, costly to copy, keeps more of its branches. 0: always the least loaded.")
    home_wait_s: _number(0, 60, "a number of seconds from 0 to 60") = doc(1.0,
        "prefix: how long at most a request whose home backend (where its prefix is) has no free slot "
        "waits for one there while other backends have free slots, rather than go cold at once; also "
        "bounded by the prefill its match saves at the engine's measured prefill rate. 0: never waits.")
    prefill_ms: _number(0, 100_000, "a number of milliseconds from 0 to 100000") = doc(100.0,
        "prefix: the engines' prefill time per 1,000 prompt tokens assumed until their streamed answers "
        "measure it (the predicted time to first token, docs/proxy.md), which bounds `home_wait_s`: a "
        "request never waits for home longer than going cold would cost.")


# A tenant's name, as a key file's `KEY TENANT` line writes it (proxy/config.py has the same pattern).
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TenantName = Annotated[str, _fails(TENANT_NAME.match),
                       Field(description="a tenant name (letters, digits, '.', '_', '-'; at most 64)")]


def _limit(lo: int, hi: int):
    return Annotated[int | None, Field(ge=lo, le=hi, description=f"an integer from {lo} to {hi}, or null")]


class TenantSettings(Section):
    """One tenant of the proxy (`proxy.tenants.NAME`); tests/test_tenants.py holds these keys, defaults
    and bounds equal to the proxy's (proxy/admission.py's TenantConfig)."""

    weight: _int(1, 1000) = doc(1,
        "The tenant's share of the slots against the other tenants' when they all wait: weights 3 and 1 "
        "serve about 75% and 25% of the tokens. A tenant with nothing waiting leaves its share to the others.")
    max_in_flight: _limit(1, 1_000_000) = doc(None,
        "The most slots the tenant holds at once across the proxy; its further requests wait (past "
        "`max_queued`: 429). Null: no limit but the fleet's.")
    max_queued: _limit(0, 1_000_000) = doc(None,
        "The most requests of the tenant that may wait for a slot; beyond, 429 with `Retry-After` naming "
        "the limit. Null: only `proxy.queue.max` bounds them.")
    requests_per_minute: _limit(1, 1_000_000_000) = doc(None,
        "A token bucket of requests per minute (a full minute's burst); empty: 429 with `Retry-After`. In an "
        "active-active entry pair each entry admits its weighted share, the whole once alone (docs/entry-ha.md).")
    tokens_per_minute: _limit(1, 1_000_000_000_000) = doc(None,
        "A token bucket of tokens per minute: a request takes its prompt's tokens as the proxy reckons them "
        "at admission (with `routing.policy: least_conn`, its body's bytes / 4), corrected by its answer's "
        "`usage` when it ends; below 1: 429 with `Retry-After`. Split between active-active entries as "
        "`requests_per_minute` is.")


class LimitsSettings(Section):
    """What one request body may expand into at the proxy (docs/proxy.md, "Hostile and careless callers")."""

    max_json_values: _int(1, 100_000_000) = doc(50_000,
        "JSON values (objects, arrays and the items after each comma) a body may hold, counted before it is "
        "parsed; beyond, 400. Bounds the proxy's parse (one C call that holds the GIL: a few ms at the bound) "
        "and its memory (8 MB of `{}` would be 4 million dicts); a long multimodal chat with tools holds a "
        "few thousand. A completion prompt sent as token ids counts one per token: raise it for those.")
    max_json_depth: _int(1, 512) = doc(128,
        "How deep a body's JSON may nest; beyond, 400 (deeper than any request schema or tool needs; "
        "100,000 levels used to crash the parse).")
    max_messages: _int(1, 10_000_000) = doc(8192,
        "Messages in one chat request; beyond, 400.")
    max_content_parts: _int(1, 10_000_000) = doc(4096,
        "Content parts (text, images) in one message; beyond, 400. Thousands of images in a message are "
        "far past what MiniCPM-V or any engine's context takes.")
    max_prompt_blocks: _int(1, 10_000_000) = doc(8192,
        "Prefix-routing blocks (64 bytes of prompt text each, 512 KiB at the default: about 130,000 "
        "tokens) in one prompt; beyond, 400. Bounds the hashing per request and what one request adds to "
        "the prefix index.")
    inline_kb: _int(1, 1_048_576) = doc(64,
        "Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones in a "
        "worker thread, so a large body never stalls other requests' streams or `/health`.")


class OtlpSettings(Section):
    """The proxy's export of its spans (OpenTelemetry, OTLP/HTTP protobuf)."""

    endpoint: OtlpUrl = doc("",
        "The collector's OTLP/HTTP traces URL (`http://collector:4318/v1/traces`): the proxy exports a span "
        "per request and one per attempt at a backend, batched off the request's path; a collector that is "
        "down costs the requests nothing (its spans are dropped and counted). Needs the OpenTelemetry SDK "
        "in the proxy's Python (`pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http`), "
        "which deploy checks. Empty: no export (the proxy still reads and forwards `traceparent`).")
    timeout_s: _seconds() = doc(10.0,
        "The longest one export of a batch of spans may take, its retries included (on the exporter's own "
        "thread, never a request's).")
    sample_ratio: _number(0, 1, "a number from 0 to 1") = doc(1.0,
        "Of the traces the proxy starts (a request without `traceparent`), the share it records and exports:"
        " the others go to the engines with flags `00`, so they record none either. A client's `traceparent`"
        " keeps its own decision. Exporting costs CPU in the proxy's process (docs/PERFORMANCE.md); below 1"
        " the cost shrinks in proportion.")


MaxConnections = Annotated[Literal["auto"] | Annotated[int, Field(ge=0, le=10_000_000)],
                          Field(description="auto, 0 (auto) or a number of connections up to 10000000")]


class ClientSettings(Section):
    """The entry port's client sockets: a deadline on each, and a bound on how many are open (issue 37)."""

    header_timeout_s: _seconds() = doc(10.0,
        "A request head (its line and headers) not complete this long after its first byte (a new "
        "connection: after the accept) closes the connection. A real client sends its head in one write; "
        "a few KB take well under a second on the slowest link. nginx mode's `client_header_timeout`.")
    body_timeout_s: _seconds() = doc(30.0,
        "A request body from which no byte came for this long (while the proxy was ready to read it) "
        "closes the connection, and the request is logged 408. Only the gap between bytes counts, not "
        "the whole upload: a 64 MiB base64 body over a slow link is fine, and 30 s outlasts TCP's "
        "retransmission back-off on a lossy one. nginx mode's `client_body_timeout`.")
    keepalive_timeout_s: _seconds() = doc(75.0,
        "A kept-alive connection idle this long is closed (aiohttp's default is an hour). nginx's own "
        "default; above the idle expiry of the common clients (httpx, the openai client: 5 s), so the "
        "client, not the entry, closes first. Idle connections are shed first at `max_connections` "
        "anyway. nginx mode's `keepalive_timeout`.")
    send_timeout_s: _seconds() = doc(30.0,
        "A client that takes nothing of its answer for this long (no byte acknowledged while bytes wait "
        "for it) loses it: the upstream request is aborted, its slot freed, and the results log says "
        "498. Only the client's silence counts, never the engine's (a queue wait of up to "
        "`proxy.queue.timeout_s`, a long prefill, SSE tokens 20-100 ms apart). nginx mode's "
        "`send_timeout` (there: between two writes that wait for the client).")
    max_connections: MaxConnections = doc("auto",
        "Client connections open at once. `auto` (or 0): the open-file limit (raised to its hard value "
        "at start) less room for the upstream connections (a slot's each) and the proxy's files. At the "
        "bound a new connection is still served: the oldest idle one (kept alive, or its head not "
        "complete) is closed instead; with none idle, the new one gets 503. nginx mode: `limit_conn` on "
        "requests in progress, `worker_connections` twice it, `worker_rlimit_nofile` (`auto`: 4096).")


class ResumeSettings(Section):
    """A stream its instance breaks off, finished on another (proxy/resume.py; issue 38). The proxy only:
    nginx mode cannot."""

    enabled: Flag = doc(True,
        "When the instance serving a stream fails after its first chunk (its connection closed or reset "
        "before `data: [DONE]`, an engine error event, no bytes for `stall_s`, taken out by its health "
        "check), the rest of the answer is asked of another healthy instance of the pool (chat: vLLM's "
        "`continue_final_message` on the text so far; completions: the prompt plus it; the token budget "
        "less the tokens sent) and relayed into the same client stream: one `id`, one `[DONE]`, the usage "
        "of the whole answer. Never for n > 1, logprobs, `response_format` or guided decoding, a tool call "
        "or reasoning under way: those end as before, the cause in the results log.")
    max_attempts: _int(1, 8) = doc(1,
        "Continuations one stream may have; one more failure ends it as a broken stream.")
    stall_s: _number(0.1, 3600, "seconds from 0.1 to 3600") = doc(30.0,
        "A resumable stream from which no byte came for this long is taken from its instance and "
        "continued elsewhere. Well above the gaps between tokens an engine under load leaves (a long "
        "prefill of another request, seconds on a CPU engine); below `timeout_s`.")


ProxyWorkers = Annotated[Literal["auto"] | Annotated[int, Field(ge=1, le=1024)],
                        Field(description="auto or a number of processes from 1 to 1024")]


class ProxySettings(Section):
    port: Port = doc(8000,
        "The entry port (nginx mode listens on it too).")
    admin_port: Port = doc(8001,
        "The proxy's admin listener, bound to 127.0.0.1 only.")
    bind: EntryAddress = doc("0.0.0.0",
        "The entry port's address (nginx mode's too). The demo host `local` sets 127.0.0.1; beyond "
        "loopback, set `proxy.api_keys_file` too.")
    health_interval_s: _seconds() = doc(5.0,
        "The period of the proxy's active `/health` checks, of nginx mode's watcher, and of the "
        "keeper's rounds (at most 5 s for the keeper).")
    timeout_s: _seconds() = doc(300.0,
        "Upstream timeout of a request (nginx mode: its read and send timeouts).")
    connect_timeout_s: _seconds() = doc(5.0,
        "Upstream connect timeout (nginx mode's too).")
    max_body_mb: MiB = doc(64.0,
        "Request body limit (base64 images are large), 413 beyond; nginx mode's "
        "`client_max_body_size`.")
    retries: _int(0, 16) = doc(2,
        "Other backends tried when the connection failed, or a 502/503 came back, before any byte "
        "reached the client; never after.")
    max_fails: _int(1, 1000) = doc(3,
        "Consecutive 5xx answers that take a backend out until its next good `/health`; a 4xx never "
        "counts, and a connect error or timeout takes it out at once.")
    shutdown_timeout_s: _seconds() = doc(30.0,
        "How long requests in flight may finish on SIGTERM, and for the old proxy at a zero-gap "
        "restart.")
    workers: ProxyWorkers = doc(1,
        "Processes serving the entry port (proxy mode). Above 1, the proxy is a supervisor and that many "
        "workers accepting on the port, each owning a part of every engine's slots and lending idle ones to "
        "a worker whose requests wait (docs/proxy.md, \"Several workers\"): never more requests on an engine "
        "than its slots; with prefix routing each tells the others where it sent each prompt, so a "
        "conversation finds its home whichever worker takes it. `auto`: the host's cores less those its engines need (2 an instance; on a CPU host "
        "`cpus_per_instance` each, all of them when it is 0), at least 1. Changed by a restart, not a reload. "
        "Not yet with `proxy.tenants` (refused: the workers do not split a tenant's limits).")
    fix_numeric_user: Flag = doc(True,
        "Turn a numeric `user` into a string before vLLM sees it (vLLM answers 400 otherwise); "
        "recorded as a fixup in the results log.")
    api_keys_file: Path = doc("",
        "A file of client API keys on the host, one per line; then `/v1/*` needs `Authorization: Bearer "
        "KEY` (401 otherwise) at the proxy and in nginx mode alike, while `/health` and `/metrics` stay "
        "open. Empty: no key needed (`inv deploy`, beside its recap, and `inv doctor` warn when the entry port "
        "listens beyond loopback).")
    results_log: ResultsLogSettings = doc(ResultsLogSettings(),
        "Rotation of the results log, `logs/req_results.log`.")
    log: LogSettings = doc(LogSettings(),
        "Rotation of the proxy's own log, `logs/proxy.log`.")
    queue: QueueSettings = doc(QueueSettings(),
        "The proxy's admission queue.")
    routing: RoutingSettings = doc(RoutingSettings(),
        "How the proxy picks a backend: least connections, or prefix-aware.")
    otlp: OtlpSettings = doc(OtlpSettings(),
        "The proxy's OpenTelemetry spans.")
    limits: LimitsSettings = doc(LimitsSettings(),
        "What one request body may expand into at the proxy: past a limit, a 400 naming it.")
    client: ClientSettings = doc(ClientSettings(),
        "The entry port's client sockets: deadlines and the bound on open connections (docs/proxy.md, "
        "\"Hostile and careless callers\").")
    resume: ResumeSettings = doc(ResumeSettings(),
        "A stream cut by its instance's failure, finished on another instance in the same client stream "
        "(docs/proxy.md, \"A stream survives its instance\").")
    tenants: Annotated[dict[TenantName, TenantSettings], Field(max_length=1024,
                       description="a mapping of tenant names to their settings")] = doc({},
        "The tenants API keys name (`proxy.api_keys_file` lines `KEY TENANT`; a key alone is `default`'s), "
        "each `NAME: {weight, max_in_flight, max_queued, requests_per_minute, tokens_per_minute}`, every "
        "setting optional. Inside each model's pool the next free slot goes to the waiting tenant furthest "
        "behind its weighted share of tokens; a tenant's own requests keep their order. Empty: one tenant, "
        "`default`, first come first served as before. A key file naming a tenant not defined here is refused. "
        "nginx mode cannot share slots by tenant: `swap-to-nginx` refuses a host with tenants.")
    open_routes: OpenRoutes = doc([],
        "Engine routes the entry port passes on beside the inference API (docs/proxy.md, \"Routes that reach "
        "the engines\"), on both fronts, each `/path` (every method) or `METHOD /path`; e.g. `/tokenize`, "
        "`/detokenize`, `/pooling`, `/classify`, `GET /v1/responses/{id}`. The engines' management routes "
        "(adapters, cache resets, sleep, profiling, `/collective_rpc`) are refused: they stay the operator's, "
        "on each instance's own port.")


class NginxSettings(Section):
    """nginx mode (`inv swap-to-nginx`); empty strings mean: found on the host / under deploy_dir."""

    bin: Path = doc("",
        "The nginx binary of nginx mode. Empty: found on the PATH, then at `/usr/sbin/nginx`, "
        "`/usr/local/sbin/nginx`, `/usr/local/nginx/sbin/nginx`.")
    user: NginxUser = doc("",
        'The `user` of nginx\'s workers when nginx runs as root (`-g "user U G;"`), ignored otherwise.'
        " Empty: the owner of deploy_dir.")
    log_dir: Path = doc("",
        "Where nginx writes its logs. Empty: `deploy_dir/logs`.")
    temp_dir: Path = doc("",
        "Where nginx writes request-body temp files. Empty: `deploy_dir/run/nginx`.")
    worker_processes: WorkerProcesses = doc("auto",
        "nginx's worker processes.")
    max_fails: _int(0, 1000) = doc(1,
        "Passive checks: a backend with this many connect errors or timeouts is out for "
        "`nginx.fail_timeout_s`; 0 turns them off.")
    # nginx's `server ... fail_timeout=` takes whole seconds only (`500ms` is refused there).
    fail_timeout_s: Annotated[float, _fails(lambda v: v == int(v)),
                              Field(ge=1, le=WEEK_S, allow_inf_nan=False,
                                    description="a whole number of seconds from 1 to 604800")] = doc(5.0,
        "How long a backend failed by the passive checks stays out (whole seconds: nginx takes no "
        "fraction there).")
    keepalive: _int(1, 65536) = doc(64,
        "Idle keep-alive connections to the backends kept per nginx worker.")
    send_buffer_kb: _int(0, 65536) = doc(16,
        "nginx mode: the kernel's send buffer of each client connection (`listen ... sndbuf=`; the kernel "
        "doubles it). nginx's `send_timeout` runs only once nothing more fits there, so a client that stops "
        "reading keeps its stream (and its engine slot) until this buffer is full, then "
        "`proxy.client.send_timeout_s`; and each chunk nginx still receives from the engine restarts that "
        "timeout, so the cut comes on time only once the engine's side has filled too (2 ms a token: about a "
        "second; 20 ms a token: not within minutes, see docs/nginx.md). A connection carries at most about "
        "twice this per round trip (16: 640 KB/s at 50 ms), plenty for token streams. 0: the kernel's "
        "autotuning (up to 4 MB).")


class KeeperSettings(Section):
    """The keeper (hostagent/keeper.py): restarts dead or stalled instances with backoff."""

    enabled: Flag = doc(True,
        "Run the keeper beside the proxy; false: deploy stops it.")
    dead_after_s: _seconds() = doc(30.0,
        "How long `/health` may fail, after the instance had been healthy, before it is dead.")
    max_restarts: _int(1, 1000) = doc(5,
        "Restarts of one instance within `keeper.window_s` after which its next death is a "
        "`crashloop`: no more restarts.")
    window_s: _seconds() = doc(1800.0,
        "The window `keeper.max_restarts` counts restarts in.")
    backoff_base_s: _seconds(off=True) = doc(10.0,
        "The wait before an instance's first restart; restart k+1 waits base x 2^k (10 s, 20 s, 40 s "
        "...).")
    backoff_max_s: _seconds(off=True) = doc(300.0,
        "The longest wait before a restart.")
    stall_probe: Flag | None = doc(None,
        "Send a 1-token completion to each healthy instance every `keeper.probe_interval_s`. Unset: "
        "on for engine `vllm`, off for `sim`.")
    probe_interval_s: _seconds() = doc(30.0,
        "The stall probe's period.")
    probe_timeout_s: _seconds() = doc(20.0,
        "The stall probe's timeout.")
    probe_failures: _int(1, 1000) = doc(3,
        "Stall-probe timeouts in a row, with `/health` 200 and no token generated meanwhile, that "
        "count as dead (`stalled`).")
    metrics_port: Port | None = doc(None,
        "The port of the keeper's `GET /metrics` (what `run/keeper.prom` holds, plus the cards' memory "
        "and use), bound to the engines' address (`bind`); Prometheus' `vllm-fleet-keeper` job scrapes it "
        "(docs/OBSERVABILITY.md). Unset: the port after the highest of `proxy.port`, `proxy.admin_port` "
        "and the instances' ports (8010 with the defaults and 8 instances).")


class VrrpSettings(Section):
    """Entry hosts behind virtual addresses (keepalived, VRRP): docs/entry-ha.md."""

    addresses: VirtualAddresses = doc([],
        "The virtual addresses (`10.9.0.100/24`) that two or more entry hosts fronting the same hosts "
        "share: the entries with the same list form one group. One address: active-passive (its holder "
        "serves, the others stand by). Several: active-active, entry k of the group (in inventory order) "
        "masters address k mod n, and the entries split every instance's slots (`vrrp.slot_weight`). "
        "Empty: no virtual address.")
    interface: Interface = doc("",
        "The entry's network interface that carries the virtual addresses (`eth0`); required with "
        "`vrrp.addresses`.")
    router_id: _int(1, 255) = doc(51,
        "The VRRP virtual router id of the first address; address k takes `router_id + k`. Unique on "
        "the network segment.")
    advert_interval_s: _number(0.01, 40, "a number of seconds from 0.01 to 40") = doc(1.0,
        "VRRP's advert interval: a backup declares its master dead after about 3 intervals (3.6 s at 1 s).")
    preempt: Flag | None = doc(None,
        "An entry that comes back takes its own address back from the peer that held it meanwhile (one more "
        "move); false: an address stays where it is until its holder fails. Unset: true with several "
        "addresses (each goes back to its own master, so both entries serve again), false with one.")
    preempt_delay_s: _int(0, 1000) = doc(5,
        "With `vrrp.preempt`: how long an entry that (re)started waits before it takes its address back, so "
        "an address that just moved stays put for that long (keepalived's `preempt_delay`).")
    unicast: Flag = doc(True,
        "Send VRRP adverts to the other entries' `address` (many networks drop multicast); false: "
        "multicast 224.0.0.18.")
    keepalived: Path = doc("",
        "The keepalived binary. Empty: found on the PATH, then `/usr/sbin/keepalived`, "
        "`/usr/local/sbin/keepalived`.")
    slot_weight: _int(1, 1000) = doc(1,
        "Active-active: this entry's weight in the split of every instance's slots among the entries that "
        "serve (equal by default); an entry whose peers' `/health` fails takes all of them until they return.")


class ModelGroup(Section):
    """One entry of `models:`: a served model and the instances that serve it. A key left unset takes the
    host's value (the key of the same name at the host's level)."""

    name: ServedName | None = doc(None,
        "The served name clients put in `model` (`--served-model-name`). Unset: the model path's last "
        "part.")
    model: Path | None = doc(None,
        "The model path. Unset: the host's `model`.")
    instances: _int(1, MAX_INSTANCES) = doc(1,
        "Instances of this model; they take the next `instances x tensor_parallel_size` cards.")
    tensor_parallel_size: CardsPerInstance | None = doc(None,
        "Cards per instance (`--tensor-parallel-size`). Unset: the host's.")
    max_num_seqs: _int(1, 65536) | None = doc(None,
        "`--max-num-seqs` of this model's instances; also its slots in the proxy. Unset: the host's.")
    max_model_len: _int(1, 100_000_000) | None = doc(None,
        "`--max-model-len`. Unset: the host's.")
    gpu_memory_utilization: _number(0, 1, "a fraction in (0, 1]", low_open=True) | None = doc(None,
        "`--gpu-memory-utilization`. Unset: the host's.")
    enforce_eager: Flag | None = doc(None,
        "Add `--enforce-eager`. Unset: the host's.")
    extra_args: Strings | None = doc(None,
        "More `vllm serve` arguments of this model's instances. Unset: the host's.")
    aliases: ServedNames | None = doc(None,
        "Other names that route to this model. Unset: the host's.")
    lora_modules: Adapters | None = doc(None,
        "Static LoRA adapters, name: path on the host. Unset: the host's.")
    max_loras: _int(1, 1024) | None = doc(None,
        "`--max-loras`. Unset: the host's.")
    max_lora_rank: _int(1, 4096) | None = doc(None,
        "`--max-lora-rank`. Unset: the host's.")
    runtime_lora: Flag | None = doc(None,
        "Allow `inv lora add` on this model. Unset: the host's.")


class HostSettings(Section):
    """Every key of a host (and of `defaults:` and a group, which set the same keys for many hosts)."""

    # null: ssh when an ssh block is given
    connection: Annotated[Literal["local", "ssh"] | None, Field(description="local or ssh")] = doc(None,
        "How the control node reaches the host: `local`, or `ssh` (Fabric/paramiko). Unset: `ssh` "
        "when an `ssh` block is given, else `local`.")
    ssh: SSHSettings | None = doc(None,
        "The host's SSH settings (the `ssh.*` keys); with it, the host is reached over SSH.")
    engine: Annotated[Literal["vllm", "sim"], Field(description="vllm or sim")] = doc("vllm",
        "`vllm`, or `sim`: the simulated engine (`python -m fleet.sim`).")
    accelerator: AcceleratorKind | None = doc(None,
        "`dcu` (Hygon), `rocm`, `nvidia`, `cpu` (vLLM's CPU build: no card, each instance on its own "
        "cores) or `sim` (the simulated engine's fake cards). Required for engine `vllm` (a wrong kind "
        "puts every instance on one card); unset with engine `sim`: `sim`.")
    accelerators: _int(0, MAX_INSTANCES) = doc(8,
        "Cards on the host; `instances` may not exceed it (not used by `cpu`).")
    instances: _int(0, MAX_INSTANCES) = doc(8,
        "Instances to run, one per card: instance i on card i (with `models`, each group says its own "
        "and this is their sum).")
    tensor_parallel_size: CardsPerInstance = doc(1,
        "Cards per instance (`--tensor-parallel-size`): instance i then holds cards [i x T, (i+1) x T), "
        "all of them in its `HIP_VISIBLE_DEVICES`/`CUDA_VISIBLE_DEVICES`. Not for `cpu`.")
    base_port: Port = doc(8002,
        "Instance i listens on `base_port + i`.")
    bind: Address | None = doc(None,
        "The address the engines listen on (`--host`); set it (`0.0.0.0`) only to reach instances "
        "directly, which bypasses the proxy and its API keys. Unset: 127.0.0.1, or the host's "
        "`address` when another host's proxy fronts it.")
    model: Path = doc("",
        "The model path, required for engine `vllm`; a leading `~/` is the host user's home.")
    served_model_name: ServedName | None = doc(None,
        "The model's name in the API (`--served-model-name`). Unset: the model path's last part.")
    max_num_seqs: _int(1, 65536) = doc(4,
        "`--max-num-seqs` of each instance: the sequences it runs at once.")
    max_model_len: _int(1, 100_000_000) = doc(8192,
        "`--max-model-len`.")
    aliases: ServedNames = doc([],
        "Other names that route to the model (the proxy maps them to the served name).")
    lora_modules: Adapters = doc({},
        "Static LoRA adapters, `name: path` on the host: `--enable-lora --lora-modules name=path ...`; a "
        "request naming an adapter is routed to the model's instances.")
    max_loras: _int(1, 1024) | None = doc(None,
        "`--max-loras`: adapters in one batch. Unset: vLLM's default.")
    max_lora_rank: _int(1, 4096) | None = doc(None,
        "`--max-lora-rank`. Unset: vLLM's default.")
    runtime_lora: Flag = doc(False,
        "Allow adapters loaded at runtime (`inv lora add`): the engines start with `--enable-lora` and "
        "`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`.")
    models: Annotated[list[ModelGroup], Field(min_length=1, max_length=MAX_INSTANCES,
                                              description="a list of model groups")] | None = doc(None,
        "Several models on one host: a list of groups (keys below), each served under its own name on its"
        " own instances and cards, in order. Unset: one model from the keys of this level.")
    enforce_eager: Flag = doc(False,
        "Add `--enforce-eager`.")
    gpu_memory_utilization: _number(0, 1, "a fraction in (0, 1]", low_open=True) = doc(0.9,
        "The fraction of each card the engine may take, `--gpu-memory-utilization` (not passed for "
        "`cpu`).")
    cpus_per_instance: _int(0, 4096) = doc(0,
        "Accelerator `cpu`: cores per instance, C; instance i gets cores [i x C, (i+1) x C) of those "
        "the host lets it use (its cpuset), through `VLLM_CPU_OMP_THREADS_BIND`. 0 splits the host's "
        "cores evenly; more than the host has is refused in one sentence, by `inv doctor` and by "
        "`start_cluster.sh` (exit 3).")
    cpu_kvcache_gib: _number(0, 65536, "a size in GiB above 0, at most 65536", low_open=True) = doc(4.0,
        "Accelerator `cpu`: each instance's KV cache in GiB, `VLLM_CPU_KVCACHE_SPACE` (vLLM 0.32 "
        "reads whole GiB).")
    extra_args: Strings = doc([],
        "More `vllm serve` arguments, each passed as one literal argument after the toolkit's own "
        "(numbers are taken as text). The served name goes as `--served-model-name=NAME`, which takes"
        " exactly one value, so no extra argument can become another served name.")
    otlp_traces_endpoint: OtlpUrl = doc("",
        "The engines' OpenTelemetry collector: vLLM's `--otlp-traces-endpoint URL` (the sim accepts and "
        "ignores it). vLLM reads the proxy's `traceparent`, so its span is the child of the proxy's attempt: "
        "one trace across proxy and engine. vLLM sends over gRPC (`http://collector:4317`) unless "
        "`env_setup` exports `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` (then "
        "`http://collector:4318/v1/traces`). Empty: no engine spans.")
    env_setup: Text = doc("",
        "Shell code run before the engine and the proxy start (source the DTK env, activate a conda "
        "env); the one value that is shell by design.")
    python: Path | None = doc(None,
        "The host's Python with aiohttp, yaml and prometheus_client, which runs the proxy and the sim"
        " engine: a path, or a name on the PATH that `env_setup` leaves. Unset: `python3`; on a local"
        " host, the toolkit's own Python.")
    vllm_bin: Path | None = doc(None,
        "The engine binary. Unset: `vllm`.")
    deploy_dir: Annotated[Path, Field(min_length=1)] = doc("~/vllm-fleet",
        "Where everything lives on the host.")
    stagger_s: _seconds(off=True) = doc(5.0,
        "Seconds between instance starts (8 x 17 GB reads at once saturate a disk); 0 turns the wait "
        "off.")
    health_timeout_s: _seconds() = doc(600.0,
        "How long an instance may load before it counts as dead.")
    stop_grace_s: _seconds() = doc(10.0,
        "The grace between SIGTERM and SIGKILL when stopping a process.")
    release_timeout_s: _seconds(off=True) = doc(60.0,
        "How long a stop waits for the cards' memory to be given back, polling the smi; 0 turns the "
        "wait off.")
    release_threshold_mib: _number(0, 1e9, "a number of MiB from 0 to 1000000000") = doc(1024.0,
        "A card counts as released at or under this much used memory (an idle K100_AI shows 2-3 MiB).")
    drain_timeout_s: _seconds(off=True) = doc(60.0,
        "How long a stop waits for the front's requests in flight, a restart for a drained "
        "instance's, and a deploy for the requests on the backends of a host that left the entry host's "
        "`fronts`; 0 turns the wait off.")
    smi: Path | None = doc(None,
        "The smi binary; its arguments follow from its name (`hy-smi --showmeminfo vram --showuse`, "
        "`rocm-smi ... --json`, `nvidia-smi --query-"
        "gpu=index,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits`). Unset: "
        "`/opt/hyhal/bin/hy-smi`, `/opt/dtk/bin/rocm-smi`, `/opt/rocm/bin/rocm-smi`, then the PATH; "
        "nvidia: `nvidia-smi`; sim: `python -m fleet.sim smi`.")
    boot_hook: Annotated[Literal["auto", "cron", "systemd", "off"],
                         Field(description="auto, cron, systemd or off")] = doc("auto",
        "What brings the deployment back after the host reboots, installed by deploy and removed by stop: "
        "`cron` (an `@reboot` line and a keeper watchdog in the user's crontab), `systemd` (a user unit; "
        "needs lingering), `auto` (systemd where lingering is on, else cron), `off` (nothing). The "
        "environment variable `FLEET_BOOT_HOOK` overrides it.")
    engine_log: EngineLogSettings = doc(EngineLogSettings(),
        "Rotation of the engine logs, `logs/vllm_<i>.log`.")
    sim: SimSettings = doc(SimSettings(),
        "The simulated engine's timing model (engine `sim`).")
    address: Address | None = doc(None,
        "How other hosts (an entry host's proxy) and `inv chat` reach this host's ports. Unset: "
        "`ssh.host`, or 127.0.0.1 for a local host.")
    fronts: HostNames = doc([],
        "Makes this host an entry host: its proxy fronts the instances of these hosts, itself "
        "included only when listed.")
    proxy: ProxySettings = doc(ProxySettings(),
        "The aiohttp proxy on the entry port.")
    nginx: NginxSettings = doc(NginxSettings(),
        "nginx mode (`inv swap-to-nginx`).")
    keeper: KeeperSettings = doc(KeeperSettings(),
        "The keeper, which restarts dead or stalled instances.")
    vrrp: VrrpSettings = doc(VrrpSettings(),
        "Virtual addresses shared by entry hosts (keepalived): no single entry (docs/entry-ha.md).")


def section_of(annotation) -> type[BaseModel] | None:
    """The Section model a field holds, if it holds one: `SSHSettings | None` -> SSHSettings, and a list
    of them (`models`) -> ModelGroup."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = section_of(arg)
        if found is not None:
            return found
    return None


def defaults() -> dict[str, Any]:
    """The built-in defaults as plain data."""
    return HostSettings().model_dump()
