"""The one way to run host code: a script sent on standard input, or the host agent deployed in deploy_dir.

Host code is standard library only (hostagent/), so any Python 3.7 or newer runs it. One rule picks the
interpreter: on the local host, the control node's own; on a remote host, `python3` from the login PATH
when it is 3.7 or newer, else the inventory's `python` after `env_setup` (a host whose system Python is
older, or whose only Python is the vLLM environment's).
A script sent on stdin (the state probe, the holders probe, the doctor's probe, the lock holder) works
where nothing is deployed yet; `host_command` runs the deployed agent (`python -m hostagent COMMAND`).
"""
from __future__ import annotations

import base64
import json
import shlex
import sys
import zlib

from hostagent import layout

from fleet.errors import AgentError, RemoteError
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport import hostcode
from fleet.transport.connection import Transport

AGENT_CONFIG = layout.HOSTAGENT_CONF    # the keeper, restart, drain-instance, wait-healthy: the instances
FRONT_CONFIG = layout.NGINX_FRONT_CONF  # the front's commands: swaps, restart-proxy, drain


# The login PATH's python3 runs host code when it is recent enough (CentOS 7's is 3.6).
PYTHON3_RECENT = "python3 -c 'import sys; sys.exit(sys.version_info < (3, 7))'"


# The line with_env_setup prints (to stderr) when env_setup fails, before it exits with its status.
ENV_SETUP_FAILED = "env_setup failed (exit "


def with_env_setup(hv: HostVars, command: str) -> str:
    """A shell line running command after the host's env_setup, whose output goes to stderr so that
    it cannot mix with what command prints, and which cannot read command's standard input. A failing
    env_setup stops the line with its exit status: command never runs in a half-made environment."""
    setup = hv.settings.env_setup or ":"
    return (f"{{ {setup}\n}} </dev/null >&2 || {{ rc=$?; echo \"{ENV_SETUP_FAILED}$rc); fix env_setup in the "
            f"inventory.\" >&2; exit $rc; }}\n{command}")


def env_setup_failure(hv: HostVars, stderr: str) -> str | None:
    """The sentence for a run that env_setup stopped (its status and last lines: stderr), or None."""
    lines = stderr.strip().splitlines()
    at = next((k for k, ln in enumerate(lines) if ln.startswith(ENV_SETUP_FAILED)), None)
    if at is None:
        return None
    rc = lines[at][len(ENV_SETUP_FAILED):].split(")")[0]
    said = " | ".join(ln.strip() for ln in lines[max(0, at - 3):at] if ln.strip()) or "no output"
    return (f"{hv.name}: env_setup exited {rc} on the host (its last lines: {said[-300:]}); fix env_setup in "
            "the inventory.")


def python_command(hv: HostVars, args: str, env_setup: bool = False, prelude: str = "") -> str:
    """The shell line running host code (`python ARGS`) by the one interpreter rule. env_setup: run the
    host's env_setup first in any case (the doctor's probe looks for the engine on its PATH). prelude: shell
    lines run after env_setup, before the Python (the run lock's holder: the check of what deploy needs)."""
    env_setup = env_setup or bool(prelude)
    if hv.settings.connection == "local":
        line = prelude + f"exec {shlex.quote(sys.executable)} {args}"
        return with_env_setup(hv, line) if env_setup and hv.settings.env_setup else line
    fallback = f"exec {shlex.quote(hv.settings.python or 'python3')} {args}"
    first = f"if {PYTHON3_RECENT} >/dev/null 2>&1; then exec python3 {args}; fi\n"
    if env_setup:
        return with_env_setup(hv, prelude + first + fallback)
    return first + with_env_setup(hv, fallback)


def _last_error(r) -> str:
    return (r.stderr.strip().splitlines() or ["no output"])[-1]


def run_script(conn: Transport, hv: HostVars, name: str, spec: dict, what: str, timeout: float = 120,
               env_setup: bool = False) -> dict:
    """Run hostagent/probes/NAME.py on the host (`python - SPEC_JSON`, the source on stdin with the host
    agent modules it imports) and return the JSON it prints last."""
    r = conn.run(python_command(hv, f"- {shlex.quote(json.dumps(spec))}", env_setup),
                 stdin=hostcode.probe(name), timeout=timeout)
    if not r.ok:
        failed_setup = env_setup_failure(hv, r.stderr)
        if failed_setup:
            raise RemoteError(failed_setup)
        if r.exited == 127:
            raise RemoteError(f"{hv.name}: no python3 on the host's PATH, nor {hv.settings.python or 'python3'} "
                              "after env_setup; install Python 3 there or set python.")
        raise RemoteError(f"{hv.name}: {what} failed (exit {r.exited}): {_last_error(r)}")
    try:
        return json.loads((r.stdout.strip().splitlines() or [""])[-1])
    except ValueError:
        raise RemoteError(f"{hv.name}: {what} printed something that is not JSON; check the host's shell "
                          "startup files and env_setup for output.") from None


def run_module(conn: Transport, hv: HostVars, name: str, args: str, emit: Emit | None = None,
               timeout: float | None = None):
    """Run hostagent/NAME.py as a script sent on stdin (`python - ARGS`); the finished run back."""
    return conn.run(python_command(hv, f"- {args}"), stdin=hostcode.script(name), on_line=emit,
                    timeout=timeout)


def start_module(conn: Transport, hv: HostVars, name: str, args: str, prelude: str = ""):
    """Start hostagent/NAME.py as `python -c SOURCE ARGS` and return the running command: its standard
    input stays open for the caller (the run lock's holder keeps the lock while it does). prelude: shell
    lines run first, after env_setup (python_command's).

    The source goes compressed: a bundled script runs to 64 KB, and over SSH the command line holds it
    twice (python3, then the fallback interpreter) inside one quoted `bash -c` argument, which the kernel
    refuses past 128 KiB ("Argument list too long")."""
    packed = base64.b64encode(zlib.compress(hostcode.script(name).encode("utf-8"), 9)).decode("ascii")
    loader = f"import base64,zlib;exec(zlib.decompress(base64.b64decode('{packed}')))"
    return conn.start(python_command(hv, f"-c {shlex.quote(loader)} {args}", prelude=prelude))


def host_command(conn: Transport, hv: HostVars, command: str, emit: Emit,
                 config: str = AGENT_CONFIG, raise_failed: bool = True, timeout: float | None = 300) -> dict:
    """Run the deployed host agent, `python -m hostagent COMMAND --config CONFIG` in deploy_dir; its
    FLEET_RESULT line as a dict (a failure said there raises AgentError unless raise_failed is False)."""
    line = (f"cd {shlex.quote(hv.settings.deploy_dir)} || exit 1\n"
            + python_command(hv, f"-m hostagent {command} --config {shlex.quote(config)}"))
    results = []

    def on_line(text: str) -> None:
        if text.startswith("FLEET_RESULT "):
            results.append(text[len("FLEET_RESULT "):])
        else:
            emit(f"{hv.name}: {text}")
    r = conn.run(line, on_line=on_line, timeout=timeout)
    try:
        result = json.loads(results[-1])
    except (IndexError, ValueError):
        raise RemoteError(f"{hv.name}: hostagent {command.split()[0]} failed (exit {r.exited}): "
                          f"{_last_error(r)}") from None
    if not result["ok"] and raise_failed:
        raise AgentError(f"{hv.name}: {result['error']}")
    return result


def steps(conn: Transport, hv: HostVars, command: str, report: Report, emit: Emit,
          timeout: float | None = None) -> dict:
    """Run a host agent command that answers with steps (restart, wait-healthy, drain-instance, ...), relay
    its progress lines without the host's name, and add its steps to report; its FLEET_RESULT back."""
    result = host_command(conn, hv, command, lambda line: emit(line.split(": ", 1)[-1]), raise_failed=False,
                          timeout=timeout)
    for step in result.get("steps") or [{"name": command.split()[0], "status": "failed",
                                         "message": result.get("error", "the host agent gave no steps")}]:
        report.add(step["name"], step["status"], step["message"])
    return result
