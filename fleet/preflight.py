"""What a step needs on the host, checked before the step changes anything.

One read-only command after the host's env_setup finds every missing tool, the engine binary and a
Python with the proxy's modules; the step then fails that host with one sentence naming them all.
"""
from __future__ import annotations

import shlex

from .errors import RemoteError
from .inventory import HostVars
from .transport import Transport

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


def check(conn: Transport, hv: HostVars, step: str = "deploy") -> None:
    """Raise RemoteError naming everything the host lacks for step; return when nothing is missing."""
    setup = hv.settings.env_setup or ":"
    r = conn.run(f"{{ {setup}\n}} </dev/null >&2 || echo \"failed env_setup $?\"\n" + script(hv, step),
                 timeout=120)
    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
    if not r.ok:
        raise RemoteError(f"{hv.name}: the check of what {step} needs failed ({last}); run env_setup by hand "
                          "on the host and fix it.")
    missing = []
    python = hv.settings.python or "python3"
    for line in r.stdout.splitlines():
        if line.startswith("failed env_setup "):
            raise RemoteError(f"{hv.name}: env_setup exited {line.split()[-1]} on the host ({last}); fix "
                              "env_setup in the inventory.")
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
