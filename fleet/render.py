"""Rendering: host variables -> the files put on a host. A pure function: no I/O but reading templates."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2

from hostagent import layout

from fleet.errors import TemplateError
from fleet.settings import accelerators, cluster, schema, serving
from fleet.settings.cluster import address, backend_name
from fleet.settings.inventory import HostVars

TEMPLATES = Path(__file__).resolve().parent / "templates"   # package data: shipped in the wheel


@dataclass(frozen=True)
class RenderedFile:
    """One file for the host: its path under deploy_dir, its text, its mode."""

    path: str
    content: str
    mode: int = 0o644


def _refuse(value: str, where: str, why: str, fix: str):
    raise TemplateError(f"{where} cannot hold {value!r}: {why}; {fix}.")


def quote(value) -> str:
    """Quote a value for a POSIX shell line, so it reaches the command as one literal argument."""
    text = str(value)
    if "\x00" in text:
        _refuse(text, "a shell script", "a NUL character ends a shell word early", "remove it from the inventory")
    return shlex.quote(text)


# nginx expands `$name` in some directives (access_log's path among them) and has no escape for '$';
# `include` reads '*', '?' and '[' as a glob.
NGINX_GLOB = re.compile(r"[*?\[]")
NGINX_WORD = re.compile(r"^[A-Za-z0-9_.:/\[\]-]+$")


def nginx_quote(value, include: bool = False) -> str:
    """Quote a value for nginx.conf: double quotes, with backslashes and quotes escaped; a '$' (a
    variable to nginx), a control character or (include) a glob character is refused."""
    text = str(value)
    fix = "choose deploy_dir, nginx.log_dir and nginx.temp_dir without it"
    if "$" in text:
        _refuse(text, "conf/nginx.conf", "nginx reads '$' as a variable there", fix)
    if schema.CONTROL.search(text):
        _refuse(text, "conf/nginx.conf", "it holds a control character", fix)
    if include and NGINX_GLOB.search(text):
        _refuse(text, "conf/nginx.conf", "nginx's include reads '*', '?' and '[' as a pattern", fix)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def nginx_pattern(value) -> str:
    """A map key of nginx.conf's route table: a regex built by nginx_routes from checked routes, whose
    closing '$' is the regex's end of line, not a variable; quoted, with a control character refused."""
    text = str(value)
    if schema.CONTROL.search(text) or '"' in text:
        _refuse(text, "conf/nginx.conf", "a route holds a control character or a quote",
                "name proxy.open_routes with URL characters only")
    return '"' + text.replace("\\", "\\\\") + '"'


def nginx_word(value) -> str:
    """A value nginx reads as one bare word (an address:port, a number), else quoted by nginx_quote."""
    text = str(value)
    return text if NGINX_WORD.match(text) else nginx_quote(text)


def keepalived_script(path) -> str:
    """A script path for keepalived's `script`: keepalived splits the quoted command as a shell would,
    so the path goes single-quoted inside double quotes; it has no escape for those quotes or '\\'."""
    text = str(path)
    if re.search(r"[\"'\\]", text) or schema.CONTROL.search(text):
        _refuse(text, "conf/keepalived.conf", "keepalived has no escape for a quote, an apostrophe, a "
                "backslash or a control character in a script's path", "choose a deploy_dir without them")
    return '"' + shlex.quote(text) + '"'


def keepalived_word(value) -> str:
    """A value keepalived reads as one bare word (a host name, an interface, an address): checked, since
    keepalived.conf has no quoting for these."""
    text = str(value)
    if not re.match(r"^[A-Za-z0-9_.:/%@-]+$", text):
        _refuse(text, "conf/keepalived.conf", "keepalived reads it as more than one word",
                "use a host name, an interface name and addresses")
    return text


def yaml_scalar(value) -> str:
    """A value in YAML's flow style, JSON-shaped like tojson's (keys sorted), every character kept: a string is
    double-quoted with escapes for quotes, backslashes and anything outside printable ASCII (a
    character beyond U+FFFF as \\U........, since YAML reads a JSON surrogate pair as two characters)."""
    if isinstance(value, str):
        return '"' + "".join(_yaml_char(c) for c in value) + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_scalar(str(k))}: {yaml_scalar(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
    return json.dumps(value)


def _yaml_char(c: str) -> str:
    if c in '"\\':
        return "\\" + c
    if " " <= c <= "~":
        return c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


MIB = 1024 * 1024
# How long a backend's /health may take before the front calls it down: the proxy's health.timeout_s and
# nginx mode's watcher alike, so both fronts call the same backend healthy.
BACKEND_HEALTH_TIMEOUT_S = 3


# nginx mode's bound on client connections when proxy.client.max_connections is auto (nginx cannot read the
# host's file limit at render time); its worker_connections are twice the bound (a client and its upstream
# each), and its worker_rlimit_nofile that plus room for its logs and listeners.
NGINX_AUTO_CONNECTIONS = 4096
NGINX_FILES_RESERVE = 64


def nginx_connections(client: schema.ClientSettings) -> dict:
    """nginx mode's connection settings from proxy.client: limit_conn's bound, worker_connections and
    worker_rlimit_nofile."""
    bound = client.max_connections
    bound = NGINX_AUTO_CONNECTIONS if bound in ("auto", 0) else bound
    return {"limit": bound, "worker_connections": 2 * bound,
            "nofile": 2 * bound + NGINX_FILES_RESERVE}


def nginx_size(mib: float) -> str:
    """A size in MiB as nginx reads it, exactly: the byte count the proxy enforces (int(mib * MiB)), written
    in m or k when that divides it, else in bytes (0.5 -> `512k`; `| int` gave `0m`, which is no limit)."""
    n = int(mib * MIB)
    if n % MIB == 0:
        return f"{n // MIB}m"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def nginx_time(seconds: float) -> str:
    """Seconds as an nginx time, to the millisecond (0.5 -> `500ms`; `| int` gave `0s`)."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def nginx_routes(open_routes: list[str]) -> list[str]:
    """The keys of nginx.conf's map of "$request_method $uri" to the routes that reach the engines: the
    inference API and open_routes, each a case-sensitive regex (a map's plain strings ignore case)."""
    keys = []
    for method, path in [*schema.INFERENCE_ROUTES, *(_route(r) for r in open_routes)]:
        pattern = "".join("[^/]+" if part.startswith("{") else re.escape(part)
                          for part in re.split(r"(\{\w+\})", path))
        keys.append(f"~^{method or '[A-Z]+'} {pattern}$")
    return keys


def _route(entry: str) -> tuple[str | None, str]:
    """An open route as (method or None: every method, path)."""
    method, _, path = entry.rpartition(" ")
    return method or None, path


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    """The one Jinja environment: a missing variable is an error, files keep their last newline. Made once:
    it keeps its compiled templates (compiling them all took 0.4 s, for every host rendered)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["quote"] = quote
    env.filters["shjoin"] = lambda argv: " ".join(quote(a) for a in argv)
    env.filters["oneline"] = lambda text: " ".join(str(text).split())   # safe inside a # comment
    env.filters["nginx_quote"] = nginx_quote
    env.filters["nginx_word"] = nginx_word
    env.filters["nginx_pattern"] = nginx_pattern
    env.filters["keepalived_script"] = keepalived_script
    env.filters["keepalived_word"] = keepalived_word
    env.filters["yaml"] = yaml_scalar
    env.filters["nginx_size"] = nginx_size
    env.filters["nginx_time"] = nginx_time
    env.filters["basename"] = posixpath.basename      # a layout path's file name, put in another directory
    return env


# Rendered file -> (template, mode). The order is the order files are put on the host.
FILES = {
    layout.START_CLUSTER: ("start_cluster.sh.j2", 0o755),
    layout.START_PROXY: ("start_proxy.sh.j2", 0o755),
    layout.STOP_CLUSTER: ("stop_cluster.sh.j2", 0o755),
    layout.BOOT: ("boot.sh.j2", 0o755),
    layout.PROXY_CONF: ("proxy.yaml.j2", 0o644),
    layout.NGINX_CONF: ("nginx.conf.j2", 0o644),
    layout.NGINX_FRONT_CONF: ("nginx_front.json.j2", 0o644),
    layout.HOSTAGENT_CONF: ("hostagent.json.j2", 0o644),
    layout.PROMETHEUS_CONF: ("prometheus.yml.j2", 0o644),
}
# Rendered only on an entry host behind virtual addresses (vrrp.addresses).
VRRP_FILES = {
    layout.KEEPALIVED_CONF: ("keepalived.conf.j2", 0o644),
    layout.CHECK_FRONT: ("check_front.sh.j2", 0o755),
}


def engine_argv(hv: HostVars, model: str | None = None) -> list[str]:
    """The engine command before its per-instance flags: `vllm serve MODEL` or the sim's equivalent
    (model: a group's, else the host's)."""
    v = hv.settings
    model = model or v.model
    if v.engine == "sim":
        sim = v.sim
        argv = [v.python, "-m", "fleet.sim", "serve", model,
                "--sim-load-s", _num(sim.load_s), "--sim-prefill-ms", _num(sim.prefill_ms),
                "--sim-token-ms", _num(sim.token_ms), "--sim-output-tokens", str(sim.output_tokens)]
        # Rendered only when set, so inventories without them render as before.
        if sim.overhead_ms is not None:
            argv += ["--sim-overhead-ms", _num(sim.overhead_ms)]
        if sim.kv_blocks is not None:
            argv += ["--sim-kv-blocks", str(sim.kv_blocks)]
        if sim.instant:
            argv.append("--sim-instant")
        return argv + [PROMPT_DETAILS, *_tracing_args(v)]
    return [v.vllm_bin or "vllm", "serve", model, PROMPT_DETAILS, *_tracing_args(v)]


# Every answer's usage says how many prompt tokens the engine found in its prefix cache
# (prompt_tokens_details.cached_tokens): the proxy's prefix policy learns from it what the engine evicted.
# vLLM has had the flag since 0.6 (0.11 and 0.32 alike, entrypoints' cli_args); the sim takes it too.
PROMPT_DETAILS = "--enable-prompt-tokens-details"


def _tracing_args(v: schema.HostSettings) -> list[str]:
    """vLLM's span export, when the inventory sets it (the sim accepts and ignores the flag)."""
    url = v.otlp_traces_endpoint
    return ["--otlp-traces-endpoint", url] if url else []


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


# --- the launch of each instance (fleet/plan/launches.py compares it with the recorded one) ------------------

# The settings a difference is named by, in the order a report names them; argv holds them all, so a
# difference elsewhere (the engine's own command, the sim's timings) reads as "engine command".
NAMED = ("model", "served_names", "max_num_seqs", "max_model_len", "enforce_eager", "gpu_memory_utilization",
         "extra_args", "engine_flags", "cards", "env", "env_setup", "bind", "port")


def describe_launch(hv: HostVars, i: int) -> dict:
    """Instance i's launch as start_cluster.sh runs it (without its overrides): the same argv, in the same
    order, as the script builds (tests/test_converge.py reads it back from the engine's command line)."""
    v = hv.settings
    g = hv.group_of(i)
    port = hv.ports[i]
    cpu = v.accelerator == "cpu"
    if hv.plain:
        flags = ["--host", v.bind, "--port", str(port), "--max-num-seqs", str(g.max_num_seqs),
                 "--max-model-len", str(g.max_model_len)]
        if not cpu:
            flags += ["--gpu-memory-utilization", _num(g.gpu_memory_utilization)]
        flags.append(f"--served-model-name={g.name}")
        if g.enforce_eager:
            flags.append("--enforce-eager")
        extra_env = {}
    else:
        flags = ["--served-model-name", *g.served_names, "--host", v.bind, "--port", str(port),
                 "--max-num-seqs", str(g.max_num_seqs), "--max-model-len", str(g.max_model_len)]
        if not cpu:
            flags += ["--gpu-memory-utilization", _num(g.gpu_memory_utilization)]
        if g.enforce_eager:
            flags.append("--enforce-eager")
        flags += g.engine_flags()
        extra_env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if g.runtime_lora else {}
    engine = engine_argv(hv, g.model)
    if cpu:
        env = {"VLLM_CPU_KVCACHE_SPACE": _num(v.cpu_kvcache_gib),
               "cpus_per_instance": str(v.cpus_per_instance)}
    else:
        cards = ",".join(map(str, hv.cards[i])) if not hv.plain else str(i)
        env = {accelerators.kind(v.accelerator).visibility_var: cards}
    env.update(extra_env)
    return {"model": g.model, "served_names": list(g.served_names), "max_num_seqs": g.max_num_seqs,
            "max_model_len": g.max_model_len, "enforce_eager": g.enforce_eager,
            "gpu_memory_utilization": None if cpu else g.gpu_memory_utilization,
            "extra_args": list(g.extra_args), "engine_flags": g.engine_flags(), "cards": list(hv.cards[i]),
            "env": env, "env_setup": v.env_setup or "", "bind": v.bind, "port": port, "group": g.name,
            "argv": engine + flags + list(g.extra_args)}


def launch_digest(description: dict) -> str:
    """The launch's digest: a hash of its canonical JSON."""
    return hashlib.sha256(encode_launch(description).encode()).hexdigest()[:16]


def encode_launch(description: dict) -> str:
    """The canonical one-line JSON of a description (as rendered into start_cluster.sh)."""
    return json.dumps(description, sort_keys=True, separators=(",", ":"))


def wanted_launches(hv: HostVars) -> list[dict]:
    """Each instance's wanted launch: {"digest", "launch"}."""
    return [{"digest": launch_digest(d), "launch": d}
            for d in (describe_launch(hv, i) for i in range(hv.settings.instances))]


def stop_spec(hv: HostVars) -> dict:
    """What hostagent/processes.py needs to stop the deployment (bin/stop_cluster.sh and `inv stop`)."""
    v = hv.settings
    return {"deploy_dir": v.deploy_dir, "deployment_id": hv.deployment_id, "instances": v.instances,
            "base_port": v.base_port, "proxy_port": v.proxy.port, "grace_s": v.stop_grace_s}


def _reach(hv: HostVars, bind: str, port: int) -> str:
    """host:port where a port bound to `bind` on hv is scraped: the bind address, or for a wildcard the
    host's address (fleet.settings.cluster.address: how other hosts reach it)."""
    return backend_name(address(hv.settings) if layout.local_address(bind) != bind else bind, port)


def scrape_targets(hv: HostVars) -> dict[str, list[dict]]:
    """conf/prometheus.yml's targets by job: every proxy, engine instance and keeper of the host, and on an
    entry host of every host it fronts; each {"target": host:port, "labels": {...}}."""
    jobs: dict[str, list[dict]] = {"vllm-fleet-proxy": [], "vllm-fleet-engine": [], "vllm-fleet-keeper": []}
    for h in [hv, *hv.front_members]:          # an entry host that fronts only others has no instance
        jobs["vllm-fleet-proxy"].append({"target": _reach(h, h.settings.proxy.bind, h.settings.proxy.port),
                                         "labels": {"host": h.name, "instance": "proxy"}})
        for i, port in enumerate(h.ports):
            jobs["vllm-fleet-engine"].append({"target": _reach(h, h.settings.bind, port), "labels": {
                "host": h.name, "instance": str(i), "card": ",".join(map(str, h.cards[i])),
                "model": h.group_of(i).name}})
        if h.settings.keeper.enabled:
            jobs["vllm-fleet-keeper"].append({"target": _reach(h, h.settings.bind, h.settings.keeper.metrics_port),
                                              "labels": {"host": h.name, "instance": "keeper"}})
    return jobs


def vrrp_instances(hv: HostVars) -> list[dict]:
    """This entry's VRRP instances, one per virtual address: address k is mastered by entry k mod n of the
    group (inventory order); the others follow it by priority in the group's order after it."""
    n = len(hv.vrrp_group)
    out = []
    for k, vip in enumerate(hv.settings.vrrp.addresses):
        master = k % n
        out.append({"name": f"fleet_{hv.settings.vrrp.router_id + k}", "address": vip,
                    "router_id": hv.settings.vrrp.router_id + k, "master": hv.vrrp_group[master].name,
                    "priority": cluster.vrrp_priority((hv.vrrp_rank - master) % n)})
    return out


def share(hv: HostVars) -> dict | None:
    """conf/proxy.yaml's `share` (entries behind virtual addresses): this entry's place in the group and each
    entry's weight and /health, which the proxy polls to learn which of its peers serve and what their prefix
    routing sent where; `split` (active-active: several virtual addresses) splits the slots."""
    if not hv.vrrp_group:
        return None
    return {"me": hv.vrrp_rank, "split": len(hv.settings.vrrp.addresses) >= 2, "entries": [
        {"name": p.name, "weight": p.weight,
         "health": None if p.name == hv.name else f"http://{backend_name(p.address, p.proxy_port)}/health"}
        for p in hv.vrrp_group]}


def hash_seed(hv: HostVars) -> int | None:
    """The PYTHONHASHSEED every proxy of a virtual-address group starts with, so that their prefix block
    hashes agree (proxy/share.py): derived from the group's addresses and entries, the same on each."""
    if not hv.vrrp_group:
        return None
    key = ",".join([*hv.settings.vrrp.addresses, *(p.name for p in hv.vrrp_group)])
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


def context(hv: HostVars) -> dict:
    """The template variables: the host's own plus what is derived from them."""
    v = hv.settings
    return {
        **v.model_dump(),     # the templates read the settings as plain data: rendering is a pure function of them
        "host": hv.name,
        "inventory_path": hv.inventory_path,
        "deployment_id": hv.deployment_id,
        # Paths under deploy_dir: spelled once, in hostagent.layout (`layout.PROXY_PID`, `at(layout.LOGS)`).
        "layout": layout,
        "at": lambda rel: f"{v.deploy_dir}/{rel}",
        "start_overrides": layout.START_OVERRIDES,
        "ports": hv.ports,
        "backends": hv.backends,
        # This host's own instances as its proxy names them and where they answer (an entry host's
        # `backends` are every fronted host's; the host agent drains and probes only its own).
        "instance_backends": [backend_name(hv.instance_host, p) for p in hv.ports],
        "instance_host": hv.instance_host,
        "engine_argv": engine_argv(hv),
        "stop_spec": stop_spec(hv),
        "visibility_var": accelerators.kind(v.accelerator).visibility_var,
        "num": _num,
        "card_files": [[f for card in hv.cards[i] for f in accelerators.card_files(v.accelerator, v.deploy_dir, card)]
                       for i in range(v.instances)],
        # What the host serves (fleet.settings.serving): plain, or the models form with its groups and pools.
        "plain": hv.plain,
        "groups": hv.groups,
        "group_of": [hv.group_of(i) for i in range(v.instances)],
        "group_argv": [engine_argv(hv, g.model) for g in hv.groups],
        "cards": hv.cards,
        "pools": hv.pools,
        # Plain: the slots the proxy gives each backend (what it serves runs max_num_seqs, plus headroom).
        "backend_health_timeout_s": BACKEND_HEALTH_TIMEOUT_S,
        "nginx_connections": nginx_connections(v.proxy.client),
        "proxy_slots": hv.proxy_slots,
        "proxy_engine_cores": engine_cores(hv),
        "scrape_targets": scrape_targets(hv),
        "smi_candidates": accelerators.kind(v.accelerator).smi_candidates,
        # Each instance's launch and its digest: start_cluster.sh records them (fleet.plan.launches).
        "launches": [{"digest": w["digest"], "json": encode_launch(w["launch"])} for w in wanted_launches(hv)],
        # Behind virtual addresses (keepalived): the group, this entry in it, its VRRP instances.
        "vrrp_group": hv.vrrp_group,
        "vrrp_self": next((p for p in hv.vrrp_group if p.name == hv.name), None),
        "vrrp_instances": vrrp_instances(hv) if hv.vrrp_group else [],
        "vrrp_version": 2 if float(v.vrrp.advert_interval_s).is_integer() else 3,
        "vrrp_preempt": (v.vrrp.preempt if v.vrrp.preempt is not None
                         else len(v.vrrp.addresses) > 1),
        "front_local": layout.local_address(v.proxy.bind),
        "share": share(hv),
        "hash_seed": hash_seed(hv),
        "engine_routes": nginx_routes(v.proxy.open_routes),
    }


def offline(hv: HostVars, home: str, python: str = "python3") -> HostVars:
    """hv as `inv render` writes it without contacting the host: `~` in deploy_dir and the model paths
    becomes home, a relative deploy_dir goes under it, and python defaults to python (deploy resolves them
    on the host, the same way: fleet.facts.state.prepare)."""
    hv = hv.at_home(lambda: home)
    if not hv.settings.deploy_dir.startswith("/"):
        hv.settings.deploy_dir = home.rstrip("/") + "/" + hv.settings.deploy_dir
    hv.settings.python = hv.settings.python or python
    return hv


def needs_home(hv: HostVars) -> bool:
    """Whether hv's paths depend on the host's home (`~`, or a relative deploy_dir): what render cannot know
    of a host it does not contact."""
    paths = [hv.settings.model, *(g.model for g in hv.groups), *(p for g in hv.groups for p in g.lora_modules.values())]
    return not hv.settings.deploy_dir.startswith("/") or any(p == "~" or p.startswith("~/")
                                                             for p in (hv.settings.deploy_dir, *paths))


ENGINE_CORES = 2        # what one engine instance's processes keep busy (its API server, its EngineCore)
ALL_CORES = 4096        # a CPU host whose engines split every core (cpus_per_instance 0): none left


def engine_cores(hv: HostVars) -> int:
    """The cores this host's engines need, which proxy.workers `auto` leaves them."""
    v = hv.settings
    if v.accelerator == "cpu":
        return v.cpus_per_instance * v.instances if v.cpus_per_instance else ALL_CORES
    return ENGINE_CORES * v.instances


def proxy_config(hv: HostVars, slots: dict[str, int] | None = None,
                 keep: dict[str, str | None] | None = None) -> str:
    """conf/proxy.yaml for a step of a roll: slots caps a group's max_num_seqs (group name -> value);
    keep adds backends the inventory no longer has (name -> the group whose pool keeps it, None on a
    host without pools), so that they leave the proxy only once drained."""
    ctx = context(hv)
    slots, keep = slots or {}, keep or {}
    headroom = hv.settings.proxy.queue.headroom
    if not hv.pools and slots:      # plain: one model, whatever its group is named
        ctx["proxy_slots"] = min(ctx["proxy_slots"], serving.slots(min(slots.values()), headroom))
    ctx["backends"] = list(hv.backends) + [b for b in keep if b not in hv.backends]
    if hv.pools:
        ctx["pools"] = [dataclasses.replace(
            pool, slots=min(pool.slots, serving.slots(slots[pool.name], headroom)) if pool.name in slots else pool.slots,
            backends=list(pool.backends) + [b for b, g in keep.items() if g == pool.name]) for pool in hv.pools]
    return environment().get_template(FILES[layout.PROXY_CONF][0]).render(ctx)


def render_host(hv: HostVars) -> list[RenderedFile]:
    """Every file the host needs, rendered from its variables (deploy_dir and python already resolved)."""
    env = environment()
    ctx = context(hv)
    files = []
    for path, (template, mode) in {**FILES, **(VRRP_FILES if hv.vrrp_group else {})}.items():
        try:
            content = env.get_template(template).render(ctx)
        except jinja2.UndefinedError as e:
            raise TemplateError(f"fleet/templates/{template}: {e.message}; the template uses a variable "
                                "the inventory does not define.") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"fleet/templates/{template}: {e}.") from None
        files.append(RenderedFile(path, content, mode))
    return files
