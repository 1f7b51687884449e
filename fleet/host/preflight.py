"""What a step needs on the host, checked before the step changes anything.

One read-only shell script, run on the host after env_setup, finds every missing tool, the engine binary
and a Python with the proxy's modules; the step then fails that host with one sentence naming them all.
A deploy's run lock holder runs it first, in the same round trip, and exits before it takes the lock (so
before anything is created) when something is missing (fleet/host/runlock.py); `deploy --check`, which takes no
lock, has the deploy probe run it beside the doctor's facts and the state (fleet/facts/survey.py).
"""
from __future__ import annotations

import shlex

from fleet.errors import RemoteError
from fleet.settings.inventory import HostVars

# Tool -> the Debian package that brings it. Used by the scripts deploy puts (ss, setsid, ps) and by
# stop's check that the cards were given back (fuser): a cluster that cannot be stopped cleanly is
# not deployed.
TOOLS = {"ss": "iproute2", "setsid": "util-linux", "ps": "procps", "fuser": "psmisc"}
STEP_TOOLS = {"deploy": ("ss", "setsid", "ps", "fuser")}

# What the proxy (and the sim engine) import besides the standard library.
PROXY_MODULES = ("aiohttp", "yaml", "prometheus_client")
MODULE_PACKAGES = {"yaml": "pyyaml", "prometheus_client": "prometheus-client"}
# What the proxy's span export imports (proxy/otlp.py), checked only when proxy.otlp.endpoint is set.
OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
OTEL_INSTALL = "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"

_FIND_MODULES = ("import importlib.util, sys\n"
                 "def absent(m):\n"
                 "    try:\n"
                 "        return importlib.util.find_spec(m) is None\n"
                 "    except ImportError:\n"   # a dotted name whose parent package is not there
                 "        return True\n"
                 "print(' '.join(m for m in sys.argv[1:] if absent(m)))")


def proxy_modules(hv: HostVars) -> tuple[str, ...]:
    """The modules the host's proxy imports, with this inventory's settings."""
    return PROXY_MODULES + (OTEL_MODULES if hv.settings.proxy.otlp.endpoint else ())


def script(hv: HostVars, step: str) -> str:
    """The check's shell code: one `missing KIND NAME...` line per thing that is not there."""
    python = shlex.quote(hv.settings.python or "python3")
    lines = [f"for t in {' '.join(STEP_TOOLS[step])}; do",
             '    command -v "$t" >/dev/null 2>&1 || echo "missing tool $t"',
             "done",
             f"if command -v {python} >/dev/null 2>&1; then",
             f"    m=$({python} -c {shlex.quote(_FIND_MODULES)} {' '.join(proxy_modules(hv))} 2>/dev/null) "
             "|| m=unusable",
             '    if [ -n "$m" ]; then echo "missing modules $m"; fi',
             "else",
             "    echo missing python",
             "fi"]
    if hv.settings.engine == "vllm":
        engine = shlex.quote(hv.settings.vllm_bin or "vllm")
        lines.append(f"command -v {engine} >/dev/null 2>&1 || echo missing engine")
    return "\n".join(lines)


# The line the run lock's holder prints for each thing missing, before it exits (status NEEDS_EXIT) without
# taking the lock, so a host that lacks something is left as it was: nothing created under deploy_dir.
NEEDS = "FLEET_NEEDS "
NEEDS_EXIT = 3


def prelude(hv: HostVars, step: str) -> str:
    """The shell lines the run lock's holder runs first (after env_setup): script's, each `missing` line
    said as NEEDS, and the exit before the lock when one is."""
    return (f"fleet_needs=$({{\n{script(hv, step)}\n}} </dev/null)\n"
            'if [ -n "$fleet_needs" ]; then printf "%s\\n" "$fleet_needs" | while IFS= read -r l; do '
            f'echo "{NEEDS}$l"; done; exit {NEEDS_EXIT}; fi\n')


def judge(hv: HostVars, step: str, lines: list[str]) -> None:
    """Raise RemoteError naming everything the host lacks for step, from the lines script printed there
    (run by the deploy probe, hostagent/probes/deploy.py, after env_setup); return when nothing is missing."""
    missing = []
    python = hv.settings.python or "python3"
    for line in lines:
        if not line.startswith("missing "):
            continue
        kind, _, what = line[len("missing "):].partition(" ")
        if kind == "tool":
            missing.append(f"{what} (install {TOOLS.get(what, what)})")
        elif kind == "python":
            missing.append(f"the Python {python} (set python, or make env_setup put it on PATH)")
        elif kind == "modules" and what == "unusable":
            missing.append(f"a working {python} (it fails to start)")
        elif kind == "modules" and any(m in OTEL_MODULES for m in what.split()):
            missing.append(f"the OpenTelemetry SDK in {python}, which proxy.otlp.endpoint needs ({OTEL_INSTALL} "
                           "into that Python, or unset proxy.otlp.endpoint)")
            rest = [m for m in what.split() if m not in OTEL_MODULES]
            if rest:
                pkgs = " ".join(MODULE_PACKAGES.get(m, m) for m in rest)
                missing.append(f"the modules {', '.join(rest)} in {python} (pip install {pkgs} there, or "
                               "set python to the vLLM environment's Python)")
        elif kind == "modules":
            pkgs = " ".join(MODULE_PACKAGES.get(m, m) for m in what.split())
            missing.append(f"the modules {', '.join(what.split())} in {python} (pip install {pkgs} there, or "
                           "set python to the vLLM environment's Python)")
        elif kind == "engine":
            missing.append(f"the engine binary {hv.settings.vllm_bin or 'vllm'} after env_setup (set vllm_bin, or "
                           "fix env_setup)")
    if missing:
        raise RemoteError(f"{hv.name}: the host lacks what {step} needs: " + "; ".join(missing) + ".")
