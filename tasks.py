"""The vllm-fleet command line: `inv deploy --host k100-01`, `inv status --host local --json`, ...

Each task settles its arguments, calls one library function and prints what comes back.
No logic of its own lives here.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from invoke import Exit, Task, task

from fleet import deploy as fleet_deploy
from fleet import display, facts, inventory, runner, sync
from fleet import stop as fleet_stop
from fleet import logs as fleet_logs
from fleet.client import chat as chat_request
from fleet.errors import FleetError

HERE = Path(__file__).resolve().parent

HOST_HELP = "a host, a comma list of hosts, a group, or all"
COMMON_HELP = {
    "host": HOST_HELP,
    "inventory": "inventory file (default: $FLEET_INVENTORY, else inventory/hosts.yml)",
    "set": "override an inventory key for this run, key=value, dotted for nested keys (repeatable)",
    "forks": "how many hosts to work on at once (default 5)",
    "wait": "when another run holds the deployment's lock, wait for it to end instead of failing at once",
}


class _MinusIInventory(Task):
    """A task with no automatic short flags (--instance and --inventory would both want -i) whose
    --inventory still answers to -i, as on every other command: --instance has no short flag."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        if name == "inventory_":
            opts["names"].append("i")
        return opts


def _help(*keys, **extra):
    """The help of the common arguments a task takes, plus its own."""
    return {**{k: COMMON_HELP[k] for k in keys}, **extra}


def _inventory(path):
    """Load the inventory; the default path also works from any directory below the project."""
    if path and str(path).isdigit() and not Path(path).exists():
        raise Exit(f"-i is --inventory, the inventory file (got {path!r}); for instance {path}, write "
                   f"--instance {path}.", code=2)
    if not path and not os.environ.get("FLEET_INVENTORY") and not Path(inventory.DEFAULT_INVENTORY).exists():
        path = HERE / inventory.DEFAULT_INVENTORY
    return inventory.load(path)


def _run(host, inv_path, overrides, action, forks=5, stream=None, quiet=False, order=None, readonly=False,
         ctrl_c_ends=False):
    """Run an action on the selected hosts, print failures and recap lines, exit with the contract's code.
    readonly: the action changes nothing on a host, so Ctrl-C (or a closed output) stops it at once;
    ctrl_c_ends: Ctrl-C is how the action ends (logs --follow), not an interruption."""
    if not host:
        raise Exit("--host is required: name a host, a comma list, a group or all "
                   "(for example --host local).", code=2)
    out = stream or sys.stdout
    try:
        inv = _inventory(inv_path)
        reports = runner.run_hosts(inv, host, action, overrides, forks=_number(forks, '--forks', minimum=1),
                                   stream=out, order=order, readonly=readonly)
    except FleetError as e:
        raise Exit(f"error: {e}", code=2)
    try:
        for r in reports:
            for line in display.failures(r):
                print(line, file=sys.stderr)
            for line in display.skips(r):
                print(line, file=sys.stderr if quiet else out)
        if not quiet:
            print(file=out)
        for r in reports:
            print(r.recap(), file=out if not quiet else sys.stderr)
        if runner.interrupted() and not ctrl_c_ends:
            print("interrupted (Ctrl-C)" + ("." if readonly else f": {runner.interrupted_help(host)}."), file=sys.stderr)
        out.flush()
    except BrokenPipeError:
        runner.output_closed(out)
    code = runner.exit_code(reports, interrupted_is_failure=not ctrl_c_ends)
    return reports, code


def _then_table(step):
    """An action running step(conn, hv, emit), then printing the host's status table."""
    def action(conn, hv, emit):
        report = step(conn, hv, emit)
        emit(display.status_table(report.status))
        return report
    return action


def _finish(code):
    if code:
        raise Exit(code=code)


@task(help=_help("host", "inventory", "set", "forks", "wait", check="show what would change, change nothing",
                 diff="show a unified diff of every rendered file against the host's copy",
                 doctor="run `inv doctor`'s checks first and stop on a failure (default; --no-doctor skips)"),
      iterable=["set_"])
def deploy(c, host="", check=False, diff=False, set_=None, inventory_="", forks="5", doctor=True, wait=False):
    """Render, put changed files, start the instances (staggered) and the proxy, wait for /health."""
    def action(conn, hv, emit):
        report = fleet_deploy.deploy(conn, hv, emit, check=check, diff=diff, doctor=doctor, wait=wait)
        if report.status and not check:
            emit(display.status_table(report.status))
        return report
    _finish(_run(host, inventory_, set_, action, forks, order="entry-last", readonly=check)[1])


@task(help=_help("host", "inventory", "set", "forks",
                 json="print a JSON list, one object per host, and nothing else on stdout"),
      iterable=["set_"])
def status(c, host="", json_=False, set_=None, inventory_="", forks="5"):
    """Show each instance's port, accelerator, pid and state, and the proxy's."""
    stream = sys.stderr if json_ else sys.stdout

    def action(conn, hv, emit):
        report = facts.status(conn, hv, emit)
        if not json_:
            emit(display.status_table(report.status))
        return report
    reports, code = _run(host, inventory_, set_, action, forks, stream=stream, quiet=json_, readonly=True)
    if json_:
        try:
            print(json.dumps([r.status for r in reports if r.status is not None], indent=2), flush=True)
        except BrokenPipeError:
            runner.output_closed(sys.stdout)
    _finish(code)


@task(help=_help("host", "inventory", "set", "forks", "wait",
                 instance="stop only this instance: drained in the proxy first, then stopped by its record, session and tag",
                 check="list what would be stopped, stop nothing",
                 force="also kill your processes still holding the accelerator's device files",
                 now="skip the drain: stop the front (or the instance) at once, cutting requests in flight"),
      iterable=["set_"], auto_shortflags=False, klass=_MinusIInventory)
def stop(c, host="", instance=None, check=False, force=False, now=False, set_=None, inventory_="", forks="5",
         wait=False):
    """Drain the front, then stop the proxy and every instance, each process proven the deployment's.

    The drain waits up to drain_timeout_s; a process is the deployment's by its pid file record, tag or
    session."""
    index = _instance_number(instance)

    def action(conn, hv, emit):
        return fleet_stop.stop(conn, hv, emit, instance=index, check=check, force=force, wait=wait, now=now)
    _finish(_run(host, inventory_, set_, action, forks, order="entry-first", readonly=check)[1])


@task(help=_help("host", "inventory", "set", out="directory to write the rendered files into"), iterable=["set_"], name="render")
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
            files = sync.host_files(hv)
            # A path in the way (a file where a directory must go) fails before anything is written.
            dirs = sorted({(target / f.path).parent for f in files})
            for d in dirs:
                for a in (d, *d.parents):
                    if a.exists() and not a.is_dir():
                        raise Exit(f"error: {a} is a file, and render needs a directory there; "
                                   "choose another --out.", code=2)
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
            for f in files:
                path = target / f.path
                path.write_text(f.content)
                path.chmod(f.mode)
                print(f"wrote {path}")
    except FleetError as e:
        raise Exit(f"error: {e}", code=2)
    except OSError as e:
        where = e.filename or out
        raise Exit(f"error: cannot write {where} ({e.strerror}); choose another --out.", code=2)


@task(help=_help("inventory", host="the host whose entry port to send to", prompt="the user message",
                 max_tokens="max_tokens of the request"))
def chat(c, host="local", prompt="Describe a sunrise over the sea in one sentence.", max_tokens="64",
         inventory_=""):
    """Send one chat completion through the host's entry port and print the answer and its backend."""
    try:
        inv = _inventory(inventory_)
        hv = inv.host_vars(inv.select(host)[0])
        r = chat_request(hv, prompt, max_tokens=_number(max_tokens, '--max-tokens', minimum=1))
    except FleetError as e:
        raise Exit(f"error: {e}", code=2)
    print(f"answer ({r['completion_tokens']} tokens, finish_reason={r['finish_reason']}, "
          f"{r['latency_s']}s, X-Backend: {r['backend']}, X-Request-Id: {r['request_id']}):")
    print(f"  {r['answer']}")


@task(help=_help("host", "inventory", "set",
                 instance="show instance I's engine log (logs/vllm_I.log)", proxy="show the proxy's log (the default)",
                 results="show the results log (one JSON line per request)",
                 keeper="show the keeper's log (logs/keeper.log: what it found dead and restarted)",
                 n="how many lines (default 50)",
                 follow="keep printing as the file grows (Ctrl-C to end)"),
      iterable=["set_"], auto_shortflags=False, klass=_MinusIInventory)
def logs(c, host="", instance=None, proxy=False, results=False, keeper=False, n="50", follow=False, set_=None,
         inventory_=""):
    """Tail the right log file on the right host."""
    index = _instance_number(instance)
    lines = _number(n, "-n", minimum=1)

    def action(conn, hv, emit):
        return fleet_logs.tail(conn, hv, emit, lines=lines, follow=follow, instance=index,
                               proxy=proxy, results=results, keeper=keeper)
    _finish(_run(host, inventory_, set_, action, forks=1, readonly=True, ctrl_c_ends=follow)[1])


@task(help=_help("host", "inventory", "set", ident="a trace id (the request's `user`) or an X-Request-Id"),
      iterable=["set_"], auto_shortflags=False, klass=_MinusIInventory)
def trace(c, ident, host="", set_=None, inventory_=""):
    """Show every results-log line of one request, across the rotated files, oldest first."""
    if not ident:
        raise Exit("trace needs the id to look for: inv trace ID --host H.", code=2)

    def action(conn, hv, emit):
        return fleet_logs.trace(conn, hv, emit, ident)
    _finish(_run(host, inventory_, set_, action, forks=1, readonly=True)[1])


def _number(value, flag: str, minimum: int = 0) -> int:
    """A whole-number option (invoke hands them over as text), or one sentence saying what is wrong."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or n < minimum:
        raise Exit(f"{flag} takes a whole number of at least {minimum}, got {value!r}.", code=2)
    return n


def _instance_number(instance):
    """--instance as an int, or None when not given."""
    if instance is None:
        return None
    try:
        return int(instance)
    except ValueError:
        raise Exit(f"--instance takes an instance number, got {instance!r}.", code=2)


@task(help=_help("host", "inventory", "set", "forks", "wait",
                 instance="restart only this instance",
                 rolling="restart every instance in turn, never more than one out of service"),
      iterable=["set_"], auto_shortflags=False, klass=_MinusIInventory)
def restart(c, host="", instance=None, rolling=False, set_=None, inventory_="", forks="5", wait=False):
    """Drain, stop, wait for the card, start, wait for /health, enable: one instance or all in turn."""
    from fleet import restart as restart_mod
    if (instance is None) == (not rolling):
        raise Exit("restart needs either --instance I or --rolling.", code=2)
    index = _instance_number(instance)

    def action(conn, hv, emit):
        return restart_mod.restart(conn, hv, emit, instance=index, rolling=rolling, wait=wait)
    _finish(_run(host, inventory_, set_, _then_table(action), forks)[1])


@task(help=_help("host", "inventory", "set", "forks"), iterable=["set_"])
def doctor(c, host="", set_=None, inventory_="", forks="5"):
    """Check the host before a deploy: engine, model path, ports, free memory per card, tools, log room."""
    from fleet import doctor as doctor_mod

    def action(conn, hv, emit):
        return doctor_mod.doctor(conn, hv, emit)
    _finish(_run(host, inventory_, set_, action, forks, readonly=True)[1])


@task(help=_help("host", "inventory", "set",
                 scenario="comma list of short, detailed, thinking (default: all three)",
                 concurrency="comma list of concurrency levels (default 8,16,32,48,64)",
                 requests="requests per level (default: one per concurrent client, a single wave)",
                 image="an image file to send (default: a generated PNG); none: text only, for a "
                       "text-only model",
                 out="directory for bench.json, report.md and chart.svg "
                     "(default bench-results/HOST-YYYYmmdd-HHMMSS)"),
      iterable=["set_"])
def bench(c, host="", inventory_="", set_=None, scenario="short,detailed,thinking",
          concurrency="8,16,32,48,64", requests="0", image="", out=""):
    """Load-test a host through its entry port: a concurrency sweep per scenario, tables, JSON, Markdown, SVG."""
    from fleet import bench as bench_mod
    try:
        scenarios = bench_mod.parse_scenarios(scenario)
        levels = bench_mod.parse_concurrency(concurrency)
        n = _number(requests, "--requests", minimum=0)
        many = bool(host) and len(_inventory(inventory_).select(host)) > 1
    except FleetError as e:
        raise Exit(f"error: {e}", code=2)

    def action(conn, hv, emit):
        target = (Path(out) / hv.name if many else Path(out)) if out else None
        return bench_mod.run_host(conn, hv, emit, scenarios, levels, n, image or None, target)
    _finish(_run(host, inventory_, set_, action, forks=1, readonly=True)[1])


@task(help=_help("host", "inventory", "set", "forks", "wait"), iterable=["set_"],
      name="swap-to-nginx")
def swap_to_nginx(c, host="", set_=None, inventory_="", forks="5", wait=False):
    """Put nginx on the entry port in place of the aiohttp proxy, with the /health watcher."""
    from fleet import front
    _finish(_run(host, inventory_, set_, _then_table(
        lambda conn, hv, emit: front.swap_to_nginx(conn, hv, emit, wait)), forks)[1])


@task(help=_help("host", "inventory", "set", "forks", "wait"), iterable=["set_"],
      name="swap-to-proxy")
def swap_to_proxy(c, host="", set_=None, inventory_="", forks="5", wait=False):
    """Give the entry port back to the aiohttp proxy: nginx quits gracefully, the watcher stops."""
    from fleet import front
    _finish(_run(host, inventory_, set_, _then_table(
        lambda conn, hv, emit: front.swap_to_proxy(conn, hv, emit, wait)), forks)[1])
