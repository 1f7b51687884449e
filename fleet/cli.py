"""The vllm-fleet command line: `vllm-fleet deploy --host k100-01` (the console script), or
`inv deploy --host k100-01` from a checkout (its tasks.py exposes this module's `ns`).

Each task settles its arguments, calls one library function and prints what comes back.
No logic of its own lives here.

One meaning per short flag on every task: -H --host, -i --inventory, -e --set (as Ansible's -e),
-f --forks (as Ansible's), -n the lines of `logs`, -v deploy's --verbose; -h is help, nothing else. Every other option is long only.
A user error is one sentence on standard error beginning `error: `, and exit 2.
"""
from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import json
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import yaml
from invoke import Collection, Exit, ParseError, Program, Task, task
from invoke.completion.complete import print_completion_script
from invoke.parser import Argument, ParserContext

from fleet import render
from fleet.commands import (
    bench as bench_mod,
    deploy as fleet_deploy,
    display,
    front,
    logs as fleet_logs,
    lora as lora_mod,
    remove as fleet_remove,
    restart as restart_mod,
    runner,
    stop as fleet_stop,
    top as top_mod,
)
from fleet.errors import FleetError
from fleet.facts import doctor as doctor_mod, state as facts
from fleet.host import sync
from fleet.settings import inventory
from fleet.transport.client import api_key as key_to_send, chat as chat_request

NAME = "vllm-fleet"
# The checkout this module runs from, when it runs from one (an installed wheel has none).
CHECKOUT = Path(__file__).resolve().parent.parent

HOST_HELP = "a host, a comma list of hosts, a group, or all"
HOST_REQUIRED = "--host is required: name a host, a comma list, a group or all (for example --host local)."
COMMON_HELP = {
    "host": HOST_HELP,
    "inventory": "inventory file (default: $FLEET_INVENTORY, else inventory/hosts.yml in the current directory)",
    "set": "KEY=VALUE: override an inventory key for this run, dotted for nested keys (repeatable)",
    "forks": "how many hosts to work on at once (default 5)",
    "wait": "when another run holds the deployment's lock, wait for it to end instead of failing at once",
    "api_key": "the API key to send when the entry port wants one (default: $OPENAI_API_KEY, which keeps it out "
               "of the process list); never printed",
}
# The only short flags, each with one meaning on every task (invoke's automatic ones are off).
SHORT_FLAGS = {"host": "H", "inventory_": "i", "set_": "e", "forks": "f", "lines": "n", "verbose": "v"}
# Options that take a whole number: shown as INT in help, checked with a one-sentence error.
WHOLE_NUMBERS = {"forks", "lines", "instance", "max_tokens", "requests"}
HELP_FLAGS = ("--help", "-h")
# What an option's value is, in help where invoke would say STRING or show a switch (vllm-fleet's help;
# `inv` prints invoke's own, where the help text says it).
METAVARS = {"set_": "KEY=VALUE", "ident": "ID", "action": "ACTION"}
# invoke's core options, what each sets in invoke's config, and the value that means "not given". The
# tool runs its commands through subprocess and paramiko, never through invoke's run(): none of them
# would do anything, so vllm-fleet does not offer them and a task refuses them under `inv`.
UNHONOURED = (("--dry", ("run", "dry"), False), ("--warn-only", ("run", "warn"), False),
              ("--echo", ("run", "echo"), False), ("--pty", ("run", "pty"), False),
              ("--hide", ("run", "hide"), None), ("--command-timeout", ("timeouts", "command"), None),
              ("--prompt-for-sudo-password", ("sudo", "password"), None), ("--no-dedupe", ("tasks", "dedupe"), True))
# The core options vllm-fleet offers: help, the task list, version and shell completion.
CORE_OPTIONS = {"help", "list", "list-depth", "list-format", "version", "complete", "print-completion-script"}


def _version() -> str:
    """vllm-fleet's version: the installed distribution's, else (a checkout not installed) pyproject's."""
    try:
        return importlib.metadata.version(NAME)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        found = re.search(r'^version\s*=\s*"([^"]+)"', (CHECKOUT / "pyproject.toml").read_text(), re.M)
    except OSError:
        found = None
    return found.group(1) if found else "unknown"


VERSION = _version()


class _WholeNumber(Argument):
    """An INT option that keeps a value int() refuses, so the task says what is wrong in one sentence
    (invoke's own cast would end in a traceback)."""

    def set_value(self, value, cast=True):
        try:
            super().set_value(value, cast)
        except ValueError:
            self.raw_value = self._value = value


class FleetTask(Task):
    """A task with the toolkit's flags: the short flags of SHORT_FLAGS only, whole numbers typed INT
    (with the task's own sentence for a bad one), --set repeatable."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        if name in SHORT_FLAGS:
            opts["names"].append(SHORT_FLAGS[name])
        if name in WHOLE_NUMBERS:
            opts["kind"] = int
        return opts

    def __call__(self, *args, **kwargs):
        if args:
            _refuse_unhonoured(args[0])
        try:
            return super().__call__(*args, **kwargs)
        except BrokenPipeError:       # `| head`: the reader left before the end; no traceback for that
            runner.output_closed(sys.stdout)

    def get_arguments(self, ignore_unknown_help=None):
        helps = dict(self.help)          # invoke pops them: a second parse (trace's help) would have none
        try:
            found = super().get_arguments(ignore_unknown_help)
        finally:
            self.help = helps
        args = []
        for arg in found:
            text = arg.help or ""
            if arg.positional:          # invoke's help shows it as an option: say it is the first word too
                text = f"positional (the first word after {self.name}): {text}"
            shown = _shown_default(arg.default)
            if shown and "default" not in text:
                text += f" (default: {shown})"
            kw = dict(names=arg.names, default=arg.default, help=text, positional=arg.positional,
                      optional=arg.optional, attr_name=arg.attr_name)
            if arg.name == "set_":      # repeatable; invoke's help shows a list as a switch: its help says KEY=VALUE
                arg = Argument(kind=list, **{**kw, "default": []})
            elif arg.kind is int:
                arg = _WholeNumber(kind=int, **kw)
            else:
                arg.help = text
            args.append(arg)
        return args


def _shown_default(value) -> str:
    """A default as help shows it; empty when there is nothing to say (no value, off, an empty list)."""
    if value is None or value is False or value == "" or value == []:
        return ""
    if value is True:
        return "on"
    return str(value)


def _refuse_unhonoured(c) -> None:
    """Under `inv`, refuse invoke's options the tool does not honour (their values reach the task's
    config from the command line; a config file's do not count: they may be meant for other projects)."""
    given = getattr(c.config, "_overrides", None) or {}
    found = [flag for flag, (section, key), unset in UNHONOURED
             if (given.get(section) or {}).get(key, unset) != unset]
    if getattr(c.config, "_runtime_path", None):      # -f/--config FILE (or INVOKE_RUNTIME_CONFIG)
        found.append("--config")
    if found:
        raise _error(f"{' and '.join(found)}: invoke's own option{'s' if len(found) > 1 else ''}, which vllm-fleet "
                     "does not honour (it runs its commands itself, not through invoke); drop "
                     f"{'them' if len(found) > 1 else 'it'} (deploy --check shows what a deploy would change).")


def command(*args, **kwargs):
    """invoke's @task with the toolkit's flags (see FleetTask)."""
    return task(*args, klass=FleetTask, auto_shortflags=False, **kwargs)


def _help(*keys, **extra):
    """The help of the common arguments a task takes, plus its own."""
    return {**{k: COMMON_HELP[k] for k in keys}, **extra}


def _error(message: str) -> Exit:
    """A user error, as every one is shown: one sentence on standard error beginning `error: `, exit 2."""
    return Exit(message if message.startswith("error: ") else f"error: {message}", code=2)


def _default_inventory() -> Path:
    """inventory/hosts.yml in the current directory; from a checkout, also its own (inv run below it)."""
    here = Path(inventory.DEFAULT_INVENTORY)
    if here.exists():
        return here
    checkout = CHECKOUT / inventory.DEFAULT_INVENTORY
    if (CHECKOUT / "tasks.py").exists() and checkout.exists():
        # Not the file help promises: say which one this run reads (stderr: --json keeps stdout clean).
        print(f"inventory: {checkout} (the checkout's; there is no {inventory.DEFAULT_INVENTORY} in "
              f"{Path.cwd()})", file=sys.stderr)
        return checkout
    raise _error(f"no inventory: there is no {inventory.DEFAULT_INVENTORY} in {Path.cwd()}; "
                 "pass -i FILE or set FLEET_INVENTORY.")


def _inventory(path):
    """Load the inventory: -i FILE, else $FLEET_INVENTORY, else the default (see _default_inventory); one
    already loaded is taken as it is."""
    if isinstance(path, inventory.Inventory):
        return path
    if path and str(path).isdigit() and not Path(path).exists():
        raise _error(f"-i is --inventory, the inventory file (got {path!r}); for instance {path}, write "
                     f"--instance {path}.")
    if not path and not os.environ.get("FLEET_INVENTORY"):
        path = _default_inventory()
    return inventory.load(path)


def _run(host, inv_path, overrides, action, forks=5, stream=None, quiet=False, order=None, readonly=False,
         ctrl_c_ends=False, entry_first=None):
    """Run an action on the selected hosts, print failures and recap lines, exit with the contract's code.
    readonly: the action changes nothing on a host, so Ctrl-C (or a closed output) stops it at once;
    ctrl_c_ends: Ctrl-C is how the action ends (logs --follow), not an interruption."""
    if not host:
        raise _error(HOST_REQUIRED)
    out = stream or sys.stdout
    try:
        inv = _inventory(inv_path)
        reports = runner.run_hosts(inv, host, action, overrides, forks=_number(forks, '--forks', minimum=1),
                                   stream=out, order=order, readonly=readonly, entry_first=entry_first)
    except FleetError as e:
        raise _error(str(e))
    try:
        for r in reports:
            for line in display.failures(r):
                print(line, file=sys.stderr)
            for line in display.skips(r):
                print(line, file=sys.stderr if quiet else out)
        if not quiet:
            print(file=out)
        for line in (w for r in reports for w in display.warnings(r)):     # right above the recap lines
            print(line, file=out if not quiet else sys.stderr)
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


def _number(value, flag: str, minimum: int = 0) -> int:
    """A whole-number option, or one sentence saying what is wrong."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or n < minimum:
        raise _error(f"{flag} takes a whole number of at least {minimum}, got {str(value)!r}.")
    return n


def _instance_number(instance):
    """--instance as an int, or None when not given."""
    if instance is None:
        return None
    try:
        return int(instance)
    except ValueError:
        raise _error(f"--instance takes an instance number, got {instance!r}.")


@command(help=_help("host", "inventory", "set", "forks", "wait", check="show what would change, change nothing",
                    diff="show a unified diff of every rendered file against the host's copy",
                    doctor="run the doctor's checks first and stop on a failure (default; --no-doctor skips)",
                    restart="restart each instance whose launch differs from the inventory's, one at a time "
                            "(default; --no-restart leaves them running their previous settings, and says which)",
                    verbose="list each new file put (else one line counts them)"))
def deploy(c, host="", check=False, diff=False, set_=None, inventory_="", forks=5, doctor=True, wait=False,
           restart=True, verbose=False):
    """Render, put changed files, start and roll the instances, start the proxy, wait for /health.

    The instances start staggered; those whose launch changed roll one at a time."""
    def action(conn, hv, emit):
        report = fleet_deploy.deploy(conn, hv, emit, check=check, diff=diff, doctor=doctor, wait=wait,
                                     restart=restart, verbose=verbose)
        if report.status and not check:
            emit(display.status_table(report.status))
        return report
    def entry_first(conn, hv, emit):
        return fleet_deploy.entry_slots_first(conn, hv, emit, check=check, wait=wait)
    _finish(_run(host, inventory_, set_, action, forks, order="entry-last", readonly=check,
                 entry_first=entry_first)[1])


@command(help=_help("host", "inventory", "set", "forks",
                    json="print a JSON list, one object per host, and nothing else on stdout"))
def status(c, host="", json_=False, set_=None, inventory_="", forks=5):
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
            print(json.dumps([r.status.wire() for r in reports if r.status is not None], indent=2), flush=True)
        except BrokenPipeError:
            runner.output_closed(sys.stdout)
    _finish(code)


@command(help=_help("host", "inventory", "set", "forks", "wait",
                    instance="stop only this instance: drained in the proxy first, then stopped by its record, "
                             "session and tag",
                    check="list what would be stopped, stop nothing",
                    force="also kill your processes still holding the accelerator's device files",
                    now="skip the drain: stop the front (or the instance) at once, cutting requests in flight"))
def stop(c, host="", instance=None, check=False, force=False, now=False, set_=None, inventory_="", forks=5,
         wait=False):
    """Drain the front, then stop the proxy and every instance, each process proven the deployment's.

    The drain waits up to drain_timeout_s; a process is the deployment's by its pid file record, tag or
    session."""
    index = _instance_number(instance)

    def action(conn, hv, emit):
        return fleet_stop.stop(conn, hv, emit, instance=index, check=check, force=force, wait=wait, now=now)
    _finish(_run(host, inventory_, set_, action, forks, order="entry-first", readonly=check)[1])


@command(help=_help("host", "inventory", "set", "forks", "wait",
                    check="show what would be stopped and deleted, change nothing"))
def remove(c, host="", check=False, set_=None, inventory_="", forks=5, wait=False):
    """Stop the deployment, remove its boot hook, then delete its deploy_dir (proven the deployment's first).

    Refused for a deploy_dir that records another deployment's id or none, that holds files deploy did not
    put there, or while anything of the deployment still runs after the stop."""
    def action(conn, hv, emit):
        return fleet_remove.remove(conn, hv, emit, check=check, wait=wait)
    _finish(_run(host, inventory_, set_, action, forks, order="entry-first", readonly=check)[1])


@command(help=_help("host", "inventory", "set", out="directory to write the rendered files into"), name="render")
def render_(c, host="", out="", set_=None, inventory_=""):
    """Write what deploy would put on a host into a local directory (no host contacted).

    A local host's files are deploy's exactly; an SSH host's home, when its paths use it, is a placeholder
    (said on standard error)."""
    if not host or not out:
        raise _error("render needs --host H and --out DIR.")
    try:
        inv = _inventory(inventory_)
        names = inv.select(host)
        for name in names:
            hv, placeholder = _render_vars(inv.host_vars(name, set_))
            target = Path(out) / name if len(names) > 1 else Path(out)
            files = sync.host_files(hv)
            # A path in the way (a file where a directory must go) fails before anything is written.
            dirs = sorted({(target / f.path).parent for f in files})
            for d in dirs:
                for a in (d, *d.parents):
                    if a.exists() and not a.is_dir():
                        raise _error(f"{a} is a file, and render needs a directory there; choose another --out.")
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
            for f in files:
                path = target / f.path
                path.write_text(f.content)
                path.chmod(f.mode)
                try:
                    print(f"wrote {path}")
                except BrokenPipeError:      # `| head`: the files are still all written
                    runner.output_closed(sys.stdout)
            if placeholder:
                print(f"{name}: {placeholder}", file=sys.stderr)
    except FleetError as e:
        raise _error(str(e))
    except OSError as e:
        where = e.filename or out
        raise _error(f"cannot write {where} ({e.strerror}); choose another --out.")


def _render_vars(hv):
    """A host's variables as deploy resolves them, without contacting it: a local host's home and Python
    are this machine's (deploy's exactly); an SSH host's home is a placeholder, said (None when unused)."""
    if hv.settings.connection == "local":
        return render.offline(hv, os.path.expanduser("~"), sys.executable), None
    user = (hv.settings.ssh and hv.settings.ssh.user) or os.environ.get("USER", "user")
    home = f"/home/{user}"
    said = None
    if render.needs_home(hv):
        said = (f"{home} stands for the home of {user} on the host, which render does not contact; deploy "
                "writes the host's own (an absolute deploy_dir and model paths render exactly).")
    return render.offline(hv, home), said


@command(help=_help("inventory", "set", "api_key", host="the host whose entry port to send to", prompt="the user message",
                    max_tokens="max_tokens of the request",
                    model="the model to ask (a served name, alias or adapter; default: the host's first)"))
def chat(c, host="local", prompt="Describe a sunrise over the sea in one sentence.", max_tokens=64, set_=None,
         inventory_="", model="", api_key=""):
    """Send one chat completion through the host's entry port and print the answer and its backend."""
    tokens = _number(max_tokens, "--max-tokens", minimum=1)
    try:
        inv = _inventory(inventory_)
        hv = inv.host_vars(inv.select(host)[0], set_)
        r = chat_request(hv, prompt, max_tokens=tokens, model=model, key=key_to_send(api_key))
    except FleetError as e:
        raise _error(str(e))
    print(f"answer ({r['completion_tokens']} tokens, finish_reason={r['finish_reason']}, "
          f"{r['latency_s']}s, X-Backend: {r['backend']}, X-Request-Id: {r['request_id']}):")
    print(f"  {r['answer']}")


@command(help=_help("host", "inventory", "set",
                    instance="show instance I's engine log (logs/vllm_I.log)",
                    proxy="show the proxy's log (the default)",
                    results="show the results log (one JSON line per request)",
                    keeper="show the keeper's log (logs/keeper.log: what it found dead and restarted)",
                    lines="how many lines (default 50)",
                    follow="keep printing as the file grows (Ctrl-C to end)"))
def logs(c, host="", instance=None, proxy=False, results=False, keeper=False, lines=50, follow=False, set_=None,
         inventory_=""):
    """Tail the right log file on the right host."""
    index = _instance_number(instance)
    count = _number(lines, "-n", minimum=1)

    def action(conn, hv, emit):
        return fleet_logs.tail(conn, hv, emit, lines=count, follow=follow, instance=index,
                               proxy=proxy, results=results, keeper=keeper)
    _finish(_run(host, inventory_, set_, action, forks=1, readonly=True, ctrl_c_ends=follow)[1])


@command(help=_help("inventory", "set",
                    host="the host to watch (an entry host: its whole fleet; a comma list or group: each)",
                    interval="seconds between frames (default 1)",
                    once="sample twice, print one frame and exit (for scripts)"))
def top(c, host="", interval="1", once=False, set_=None, inventory_=""):
    """A live view of the instances, the proxy, the keeper and the cards; q or Ctrl-C quits."""
    if not host:
        raise _error(HOST_REQUIRED)
    try:
        every = float(interval)
    except ValueError:
        every = float("nan")
    if not 0.2 <= every <= 3600:
        raise _error(f"--interval takes seconds from 0.2 to 3600, got {interval!r}.")
    try:
        code = top_mod.run(_inventory(inventory_), host, set_ or (), interval=every, once=once)
    except FleetError as e:
        raise _error(str(e))
    _finish(code)


@command(help=_help("host", "inventory", "set", ident="a trace id (the request's `user`), a W3C trace id (X-Trace-Id) or an X-Request-Id"))
def trace(c, ident, host="", set_=None, inventory_=""):
    """Show every results-log line of one request, across the rotated files, oldest first."""
    if ident in HELP_FLAGS:
        # invoke's parser hands the first word after `trace` to the id, whatever it is; the console script
        # sees it while parsing (FleetProgram.parse_tasks), `inv` only here.
        FleetProgram(namespace=ns, binary="inv[oke]").run(["inv", "--help", "trace"], exit=False)
        return
    if not ident:
        raise _error("trace needs the id to look for: trace ID --host H.")

    def action(conn, hv, emit):
        return fleet_logs.trace(conn, hv, emit, ident)
    _finish(_run(host, inventory_, set_, action, forks=1, readonly=True)[1])


@command(help=_help("host", "inventory", "set", "forks", "wait",
                    instance="restart only this instance",
                    rolling="restart every instance in turn, never more than one out of service"))
def restart(c, host="", instance=None, rolling=False, set_=None, inventory_="", forks=5, wait=False):
    """Drain, stop, wait for the card, start, wait for /health, enable: one instance or all in turn."""
    if (instance is None) == (not rolling):
        raise _error("restart needs either --instance I or --rolling.")
    index = _instance_number(instance)

    def action(conn, hv, emit):
        return restart_mod.restart(conn, hv, emit, instance=index, rolling=rolling, wait=wait)
    _finish(_run(host, inventory_, set_, _then_table(action), forks)[1])


LORA_ACTIONS = ("add", "remove", "list")


@command(help=_help("host", "inventory", "set", "forks", "wait",
                    action="add, remove or list",
                    model="add, remove: the model group (its served name in the host's models:)",
                    name="add, remove: the adapter's name, which requests then give as their model",
                    path="add: the adapter's directory on the host (absolute)"))
def lora(c, action, host="", model="", name="", path="", set_=None, inventory_="", forks=5, wait=False):
    """Runtime LoRA adapters: add one to a model's running instances, remove one, or list them.

    An added adapter is recorded, so a restart loads it again."""
    if action in HELP_FLAGS:        # as trace's id: invoke hands the first word to the action
        FleetProgram(namespace=ns, binary="inv[oke]").run(["inv", "--help", "lora"], exit=False)
        return
    if action not in LORA_ACTIONS:
        raise _error(f"lora takes add, remove or list (got {action!r}): lora add --host H --model GROUP "
                     "--name N --path P.")
    needed = {"add": ("model", "name", "path"), "remove": ("model", "name"), "list": ()}[action]
    given = {"model": model, "name": name, "path": path}
    missing = [f"--{k}" for k in needed if not given[k]]
    if missing:
        raise _error(f"lora {action} needs {' '.join(f'--{k} {k.upper()}' for k in needed)} "
                     f"({', '.join(missing)} missing).")

    def action_(conn, hv, emit):
        if action == "add":
            return lora_mod.add(conn, hv, emit, model, name, path, wait)
        if action == "remove":
            return lora_mod.remove(conn, hv, emit, model, name, wait)
        return lora_mod.listing(conn, hv, emit)
    _finish(_run(host, inventory_, set_, action_, forks, readonly=action == "list")[1])


@command(help=_help("host", "inventory", "set", "forks",
                    deep="also run `vllm --version` (it imports vLLM: seconds idle, minutes beside busy engines)"))
def doctor(c, host="", set_=None, inventory_="", forks=5, deep=False):
    """Check the host before a deploy: engine, model path, ports, free memory per card, tools, log room."""

    def action(conn, hv, emit):
        return doctor_mod.doctor(conn, hv, emit, deep=deep)
    _finish(_run(host, inventory_, set_, action, forks, readonly=True)[1])


@command(help=_help("host", "inventory", "set", "api_key",
                    scenario="comma list of short, detailed, thinking (default: all three)",
                    concurrency="comma list of concurrency levels (default 8,16,32,48,64)",
                    requests="requests per level (default 0: one per concurrent client, a single wave)",
                    image="an image file to send (default: a generated PNG); none: text only, for a "
                          "text-only model",
                    out="directory for bench.json, report.md and chart.svg "
                        "(default bench-results/HOST-YYYYmmdd-HHMMSS; with several models, one "
                        "directory per model under it)",
                    model="the model to load (default: every model the host serves, in turn, one table each)"))
def bench(c, host="", inventory_="", set_=None, scenario="short,detailed,thinking",
          concurrency="8,16,32,48,64", requests=0, image="", out="", model="", api_key=""):
    """Load-test a host through its entry port: a concurrency sweep per scenario, tables, JSON, Markdown, SVG."""
    try:
        scenarios = bench_mod.parse_scenarios(scenario)
        levels = bench_mod.parse_concurrency(concurrency)
        n = _number(requests, "--requests", minimum=0)
        loaded = _inventory(inventory_) if host else None       # loaded once: the run below takes it
        many = bool(host) and len(loaded.select(host)) > 1
    except FleetError as e:
        raise _error(str(e))

    def action(conn, hv, emit):
        target = (Path(out) / hv.name if many else Path(out)) if out else None
        return bench_mod.run_host(conn, hv, emit, scenarios, levels, n, image or None, target, model=model,
                                  key=key_to_send(api_key))
    _finish(_run(host, loaded, set_, action, forks=1, readonly=True)[1])


@command(help=_help("host", "inventory", "set", "forks", "wait"), name="swap-to-nginx")
def swap_to_nginx(c, host="", set_=None, inventory_="", forks=5, wait=False):
    """Put nginx on the entry port in place of the aiohttp proxy, with the /health watcher."""
    _finish(_run(host, inventory_, set_, _then_table(
        lambda conn, hv, emit: front.swap_to_nginx(conn, hv, emit, wait)), forks)[1])


@command(help=_help("host", "inventory", "set", "forks", "wait"), name="swap-to-proxy")
def swap_to_proxy(c, host="", set_=None, inventory_="", forks=5, wait=False):
    """Give the entry port back to the aiohttp proxy: nginx quits gracefully, the watcher stops."""
    _finish(_run(host, inventory_, set_, _then_table(
        lambda conn, hv, emit: front.swap_to_proxy(conn, hv, emit, wait)), forks)[1])


def _show(value) -> str:
    """A value as the inventory would spell it (YAML, one line)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True).strip()
    return text[:-len("\n...")] if text.endswith("\n...") else text


@command(help=_help("host", "inventory", "set", json="print a JSON list, one object per host, and nothing else"),
         name="vars")
def vars_(c, host="", set_=None, inventory_="", json_=False):
    """Print a host's resolved variables, each with where it came from (like ansible-inventory --host).

    Origins, lowest first: default (the built-in default), defaults (the inventory's defaults block),
    group NAME, host (the host's own keys), --set; derived: computed from other keys (served_model_name
    from model, connection from ssh, ...)."""
    if not host:
        raise _error(HOST_REQUIRED)
    try:
        inv = _inventory(inventory_)
        explained = {name: inv.explain(name, set_) for name in inv.select(host)}
    except FleetError as e:
        raise _error(str(e))
    if json_:
        print(json.dumps([{"host": name, "inventory": inv.path,
                           "vars": {k: {"value": v, "origin": o} for k, (v, o) in found.items()}}
                          for name, found in explained.items()], indent=2))
        return
    for i, (name, found) in enumerate(explained.items()):
        rows = [(f"{k}: {_show(v)}", o) for k, (v, o) in found.items()]
        width = min(60, max(len(left) for left, _ in rows))
        print(("\n" if i else "") + f"# {name} ({inv.path})")
        for left, origin in rows:
            print(f"{left:<{width}}  # {origin}")


@command
def version(c):
    """Print vllm-fleet's version (`inv --version` is invoke's own)."""
    print(f"{NAME} {VERSION}")


class FleetContext(ParserContext):
    """A task's options as vllm-fleet's help shows them: a value named for what it is (METAVARS: `-e
    KEY=VALUE`, where invoke shows --set as a switch) and a positional argument by its name."""

    def help_for(self, flag):
        names, text = super().help_for(flag)
        arg = self.flags[flag]
        metavar = METAVARS.get(arg.name)
        if metavar:
            longs = [n for n in arg.names if len(n) > 1]
            shorts = [n for n in arg.names if len(n) == 1]
            spelled = [f"-{n} {metavar}" for n in shorts] + [f"--{n}={metavar}" for n in longs]
            names = ", ".join([metavar] * arg.positional + spelled)
        return names, text


class FleetCollection(Collection):
    """The tasks, parsed with FleetContext (vllm-fleet's; `inv` loads tasks.py into invoke's own Collection)."""

    def to_contexts(self, ignore_unknown_help=None):
        return [FleetContext(name=c.name, aliases=c.aliases, args=c.args.values())
                for c in super().to_contexts(ignore_unknown_help)]


ns = FleetCollection(deploy, status, stop, remove, restart, render_, chat, logs, trace, top, doctor, bench, swap_to_nginx,
                     swap_to_proxy, vars_, lora, version)


class FleetProgram(Program):
    """invoke's Program with the toolkit's error format: a word it cannot parse is one `error: ` line, exit 2
    (invoke's own says it on standard error and exits 1), and only the core options the tool honours (help,
    the task list, version, completion): none of invoke's run() options (--dry, --warn-only, --echo...),
    which would do nothing here, and no core flag taking a task's short flag (invoke's -e is --echo)."""

    def core_args(self):
        args = [arg for arg in super().core_args() if arg.name in CORE_OPTIONS]
        for arg in args:
            arg.names = tuple(n for n in arg.names if n not in SHORT_FLAGS.values())
        return args

    def parse_core(self, argv):
        # invoke's own reads --write-pyc and --debug, which this program does not offer.
        with _parse_errors():
            self.normalize_argv(argv)
            self.parse_core_args()
        if self.args.version.value:
            self.print_version()
            raise Exit
        if self.args["print-completion-script"].value:
            print_completion_script(shell=self.args["print-completion-script"].value, names=self.binary_names)
            raise Exit

    def update_config(self, merge=True):
        """Nothing to update: invoke's run() options are not offered and the tasks read no invoke config."""

    def parse_tasks(self):
        with _parse_errors():
            super().parse_tasks()
        for context in self.tasks:       # `trace --help`: the parser took --help for the id (see trace)
            if context.name == "trace" and context.args.ident.value in HELP_FLAGS:
                self.args.help.value = "trace"
            if context.name == "lora" and context.args.action.value in HELP_FLAGS:
                self.args.help.value = "lora"

    def parse_cleanup(self):
        with _parse_errors():
            super().parse_cleanup()

    def print_task_help(self, name):
        context = self.parser.contexts[name]
        if not context.positional_args:
            return super().print_task_help(name)
        # invoke's, with the positional arguments in the usage line (`trace [--options] ID`).
        positional = " ".join(METAVARS[a.name] for a in context.positional_args)
        print(f"Usage: {self.binary} [--core-opts] {name} [--options] {positional} [other tasks here ...]\n")
        print("Docstring:")
        for line in inspect.getdoc(self.collection[name]).splitlines():
            print(self.leading_indent + line if line.strip() else "")
        print("\nOptions:")
        self.print_columns(context.help_tuples())


# invoke's core options vllm-fleet does not offer, each spelling (--dry, -R...): named when given.
NOT_OFFERED = {f"-{n}" if len(n) == 1 else f"--{n}" for arg in Program.core_args(Program())
               if arg.name not in CORE_OPTIONS for n in arg.names if n not in SHORT_FLAGS.values()}


@contextmanager
def _parse_errors(binary: str = NAME, core_names=None):
    """Turn invoke's ParseError into the toolkit's user error (see _error): an option of invoke's the tool
    does not offer is named as such, an unknown word gets the closest task or option name. binary: the
    command the user typed (vllm-fleet or inv), named in what to do; core_names: that program's core flags."""
    try:
        yield
    except ParseError as e:
        message = str(e).rstrip("!.")
        context = getattr(e, "context", None)
        task = getattr(context, "name", None) if context is not None else None
        unknown = re.match(r"No idea what '(.*)' is$", message)
        if unknown and binary == NAME and unknown.group(1).split("=")[0] in NOT_OFFERED:
            raise _error(f"{unknown.group(1)} is one of invoke's own options, which vllm-fleet does not offer "
                         "(it runs its commands itself, not through invoke); drop it.") from None
        missing = re.match(r"Flag <\w+: ([\w-]+)", message)
        if missing:                     # invoke names the Argument object: name the flag instead
            message = f"--{missing.group(1).strip('_').replace('_', '-')} needs a value"
        message = message[:1].lower() + message[1:]
        if unknown:
            word = unknown.group(1)
            names = list(context.flags) if task else (
                (core_names or _flag_names(program().core_args())) if word.startswith("-") else list(ns.task_names))
            bare = {n.lstrip("-"): n for n in names}       # the dashes alone would make --bogus near --host
            close = difflib.get_close_matches(word.lstrip("-"), list(bare), n=1)
            if close:
                message += f" (did you mean {bare[close[0]]}?)"
        if task:
            message += f"; `{binary} {task} --help` lists its options"
        else:
            message += f"; `{binary} --list` lists the tasks"
        raise _error(message + ".") from None


def _flag_names(core_args) -> list:
    """Core arguments' flags as typed (--list, -l)."""
    return [f"--{n}" if len(n) > 1 else f"-{n}" for a in core_args for n in a.names]


def guard_inv() -> None:
    """Give `inv`'s parse errors the console script's form (one `error: ` sentence, the closest name, exit 2).

    `inv` is invoke's own Program, which has parsed its core options and imported tasks.py (this is called
    from there) before it parses the task names and their options: the last two steps, parse_tasks and
    parse_cleanup, are looked up on the class when they run, so wrapping them there reaches the running
    program. Only a program whose collection holds this toolkit's tasks is changed (another project's
    collection in the same process keeps invoke's messages), and vllm-fleet's own program has its own."""
    if getattr(Program, "_fleet_guarded", False):
        return

    def guarded(step):
        def run(self, *args, **kwargs):
            ours = not isinstance(self, FleetProgram) and any(
                isinstance(t, FleetTask) for t in getattr(self.collection, "tasks", {}).values())
            if not ours:
                return step(self, *args, **kwargs)
            with _parse_errors("inv", _flag_names(self.core_args())):
                return step(self, *args, **kwargs)
        return run
    Program.parse_tasks = guarded(Program.parse_tasks)
    Program.parse_cleanup = guarded(Program.parse_cleanup)
    Program._fleet_guarded = True


def program() -> FleetProgram:
    """The vllm-fleet program (the console script's)."""
    return FleetProgram(namespace=ns, version=VERSION, name=NAME, binary=NAME, binary_names=[NAME])


def main() -> None:
    """The `vllm-fleet` console script."""
    try:
        program().run()
    except BrokenPipeError:          # `vllm-fleet deploy -h | head`: the reader left; no traceback for that
        runner.output_closed(sys.stdout)
