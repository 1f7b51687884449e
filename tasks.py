"""The vllm-fleet command line: `inv deploy --host k100-01`, `inv status --host local --json`, ...

Each task settles its arguments, calls one library function and prints what comes back.
No logic of its own lives here.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from invoke import Exit, task

from fleet import display, inventory, lifecycle, render, runner
from fleet.client import chat as chat_request
from fleet.errors import FleetError

HERE = Path(__file__).resolve().parent

HOST_HELP = "a host, a comma list of hosts, a group, or all"
COMMON_HELP = {
    "host": HOST_HELP,
    "inventory": "inventory file (default: $FLEET_INVENTORY, else inventory/hosts.yml)",
    "set": "override an inventory key for this run, key=value, dotted for nested keys (repeatable)",
    "forks": "how many hosts to work on at once (default 5)",
}


def _help(*keys, **extra):
    """The help of the common arguments a task takes, plus its own."""
    return {**{k: COMMON_HELP[k] for k in keys}, **extra}


def _inventory(path):
    """Load the inventory; the default path also works from any directory below the project."""
    if not path and not os.environ.get("FLEET_INVENTORY") and not Path(inventory.DEFAULT_INVENTORY).exists():
        path = HERE / inventory.DEFAULT_INVENTORY
    return inventory.load(path)


def _run(host, inv_path, overrides, action, forks=5, stream=None, quiet=False):
    """Run an action on the selected hosts, print failures and recap lines, exit with the contract's code."""
    if not host:
        raise Exit("--host is required: name a host, a comma list, a group or all "
                   "(for example --host local).", code=2)
    out = stream or sys.stdout
    try:
        inv = _inventory(inv_path)
        reports = runner.run_hosts(inv, host, action, overrides, forks=forks, stream=out)
    except FleetError as e:
        raise Exit(f"error: {e}", code=2)
    for r in reports:
        for line in display.failures(r):
            print(line, file=sys.stderr)
    if not quiet:
        print(file=out)
    for r in reports:
        print(r.recap(), file=out if not quiet else sys.stderr)
    code = runner.exit_code(reports)
    return reports, code


def _finish(code):
    if code:
        raise Exit(code=code)


@task(help=_help("host", "inventory", "set", "forks", check="show what would change, change nothing",
                 diff="show a unified diff of every rendered file against the host's copy"),
      iterable=["set"])
def deploy(c, host="", check=False, diff=False, set_=None, inventory_="", forks=5):
    """Render, put changed files, start the instances (staggered) and the proxy, wait for /health."""
    def action(conn, hv, emit):
        report = lifecycle.deploy(conn, hv, emit, check=check, diff=diff)
        if report.status and not check:
            emit(display.status_table(report.status))
        return report
    _finish(_run(host, inventory_, set_, action, forks)[1])


@task(help=_help("host", "inventory", "set", "forks",
                 json="print a JSON list, one object per host, and nothing else on stdout"),
      iterable=["set"])
def status(c, host="", json_=False, set_=None, inventory_="", forks=5):
    """Show each instance's port, accelerator, pid and state, and the proxy's."""
    stream = sys.stderr if json_ else sys.stdout

    def action(conn, hv, emit):
        report = lifecycle.status(conn, hv, emit)
        if not json_:
            emit(display.status_table(report.status))
        return report
    reports, code = _run(host, inventory_, set_, action, forks, stream=stream, quiet=json_)
    if json_:
        print(json.dumps([r.status for r in reports if r.status is not None], indent=2))
    _finish(code)


@task(help=_help("host", "inventory", "set", "forks",
                 instance="stop only this instance (its process group and its tag)",
                 check="list what would be stopped, stop nothing"),
      iterable=["set"], auto_shortflags=False)   # -i would be ambiguous: --instance and --inventory
def stop(c, host="", instance=None, check=False, set_=None, inventory_="", forks=5):
    """Stop the proxy and every instance by process group, then every process still carrying the tag."""
    index = None
    if instance is not None:
        try:
            index = int(instance)
        except ValueError:
            raise Exit(f"--instance takes an instance number, got {instance!r}.", code=2)

    def action(conn, hv, emit):
        return lifecycle.stop(conn, hv, emit, instance=index, check=check)
    _finish(_run(host, inventory_, set_, action, forks)[1])


@task(help=_help("host", "inventory", "set", out="directory to write the rendered files into"), iterable=["set"], name="render")
def render_(c, host="", out="", set_=None, inventory_=""):
    """Write what deploy would put on a host into a local directory (no host contacted)."""
    if not host or not out:
        raise Exit("render needs --host H and --out DIR.", code=2)
    try:
        inv = _inventory(inventory_)
        names = inv.select(host)
        for name in names:
            hv = inv.host_vars(name, set_)
            if hv["deploy_dir"].startswith("~"):
                hv.vars["deploy_dir"] = "/home/" + ((hv["ssh"] or {}).get("user") or os.environ.get(
                    "USER", "user")) + hv["deploy_dir"][1:]
            hv.vars["python"] = hv["python"] or "python3"
            target = Path(out) / name if len(names) > 1 else Path(out)
            for f in render.render_host(hv):
                path = target / f.path
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f.content)
                path.chmod(f.mode)
                print(f"wrote {path}")
    except FleetError as e:
        raise Exit(f"error: {e}", code=2)
    except OSError as e:
        raise Exit(f"error: cannot write into {out} ({e.strerror}); choose another --out.", code=2)


@task(help=_help("inventory", host="the host whose entry port to send to", prompt="the user message",
                 max_tokens="max_tokens of the request"))
def chat(c, host="local", prompt="Describe a sunrise over the sea in one sentence.", max_tokens=64,
         inventory_=""):
    """Send one chat completion through the host's entry port and print the answer and its backend."""
    try:
        inv = _inventory(inventory_)
        hv = inv.host_vars(inv.select(host)[0])
        r = chat_request(hv, prompt, max_tokens=int(max_tokens))
    except FleetError as e:
        raise Exit(f"error: {e}", code=2)
    print(f"answer ({r['completion_tokens']} tokens, finish_reason={r['finish_reason']}, "
          f"{r['latency_s']}s, X-Backend: {r['backend']}, X-Request-Id: {r['request_id']}):")
    print(f"  {r['answer']}")


@task(help=_help("host", "inventory", "set", "forks"), iterable=["set"], name="swap-to-nginx")
def swap_to_nginx(c, host="", set_=None, inventory_="", forks=5):
    """Put nginx on the entry port in place of the aiohttp proxy, with the /health watcher."""
    from fleet import front

    def action(conn, hv, emit):
        report = front.swap_to_nginx(conn, hv, emit)
        emit(display.status_table(report.status))
        return report
    _finish(_run(host, inventory_, set_, action, forks)[1])


@task(help=_help("host", "inventory", "set", "forks"), iterable=["set"], name="swap-to-proxy")
def swap_to_proxy(c, host="", set_=None, inventory_="", forks=5):
    """Give the entry port back to the aiohttp proxy: nginx quits gracefully, the watcher stops."""
    from fleet import front

    def action(conn, hv, emit):
        report = front.swap_to_proxy(conn, hv, emit)
        emit(display.status_table(report.status))
        return report
    _finish(_run(host, inventory_, set_, action, forks)[1])
