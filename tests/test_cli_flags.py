"""The command line as Invoke and Ansible users expect it: -h is help on every task, one meaning per short
flag, whole numbers typed INT, --version, `vars` saying where each value came from, --set wherever the
inventory is read, every user error one `error: ` sentence on stderr with exit 2, and no paramiko traceback
before an UNREACHABLE line. In-process through invoke's Program where no signal or exit code is at stake
(or where SystemExit carries it), real processes for the rest."""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from conftest import PYTHON, ROOT, free_port, free_ports
from fleet_helpers import inv
from invoke import Collection

import fleet.cli
from fleet.settings import inventory as inv_mod

pytestmark = pytest.mark.process

SHORT = {"-H": "host", "-i": "inventory", "-e": "set", "-f": "forks", "-n": "lines", "-v": "verbose"}


def run_cli(argv, capsys, program=None):
    """Run `vllm-fleet ARGV` in this process; returns (exit code, stdout, stderr)."""
    program = program or fleet.cli.program()
    try:
        program.run(["vllm-fleet", *argv])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def run_proc(argv, cwd=ROOT, env=None, timeout=60):
    """A real process (a console script or `python -m invoke`), FLEET_TAG and FLEET_INVENTORY cleared."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("FLEET_TAG", "FLEET_INVENTORY")}, **(env or {})}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def console_script() -> list[str]:
    """How to run the `vllm-fleet` console script: the installed one, else its entry point by hand."""
    script = Path(sys.executable).parent / "vllm-fleet"
    if script.exists():
        return [str(script)]
    return [PYTHON, "-c", "import sys; sys.argv[0] = 'vllm-fleet'; from fleet.cli import main; main()"]


@pytest.fixture
def inventory_file(tmp_path):
    """A local sim host `t` in two groups (file order a, b), with a key from every layer."""
    path = tmp_path / "hosts.yml"
    base = free_ports(4)      # one run: separate picks could land on the same port
    path.write_text(textwrap.dedent(f"""\
        defaults:
          max_model_len: 4096
          stagger_s: 1
          proxy: {{port: {base + 2}, admin_port: {base + 3}}}
        groups:
          a: {{hosts: [t], max_num_seqs: 3, stop_grace_s: 4}}
          b: {{hosts: [t], max_num_seqs: 5}}
        hosts:
          t:
            connection: local
            engine: sim
            accelerator: sim
            accelerators: 2
            instances: 2
            base_port: {base}
            model: /models/Some-Model
            deploy_dir: {tmp_path / 'deploy'}
            sim: {{load_s: 0.5}}
        """))
    return path


def one_error_line(err: str) -> str:
    """The only line of stderr, which must be a user error."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_inv_and_the_console_script_run_the_same_tasks():
    from_checkout = Collection.from_module(importlib.import_module("tasks"))
    from_package = Collection.from_module(fleet.cli)
    assert sorted(from_checkout.task_names) == sorted(from_package.task_names) == sorted(fleet.cli.ns.task_names)
    for name in from_package.task_names:
        assert from_checkout[name].body is from_package[name].body is fleet.cli.ns[name].body
    assert {"deploy", "status", "stop", "restart", "render", "chat", "logs", "trace", "doctor", "bench",
            "swap-to-nginx", "swap-to-proxy", "vars", "version"} <= set(from_package.task_names)


def test_version_comes_from_the_package_metadata():
    expected = importlib.metadata.version("vllm-fleet")
    assert fleet.cli.VERSION == expected
    for argv in ([*console_script(), "--version"], [PYTHON, "-m", "invoke", "version"]):
        r = run_proc(argv)
        assert r.returncode == 0 and r.stdout == f"vllm-fleet {expected}\n", (argv, r.stdout, r.stderr)


def test_version_falls_back_to_pyproject_in_a_checkout_that_is_not_installed(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert fleet.cli._version() == _pyproject_version()


def _pyproject_version() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    raise AssertionError("pyproject.toml has no version")


def test_minus_h_and_help_print_each_tasks_help(capsys):
    # -h was --host on seven tasks (`inv deploy -h` was an error); `trace --help` answered "--host is
    # required", the positional id swallowing --help.
    for name in fleet.cli.ns.task_names:
        for flag in ("-h", "--help"):
            code, out, err = run_cli([name, flag], capsys)
            assert code == 0 and err == "", (name, flag, err)
            assert out.startswith(f"Usage: vllm-fleet [--core-opts] {name} "), (name, flag, out)
    for argv in (["trace", "--host", "t", "--help"], ["trace", "-H", "t", "-h"], ["trace", "some-id", "-h"]):
        code, out, err = run_cli(argv, capsys)
        assert code == 0 and err == "" and "Show every results-log line of one request" in out, (argv, out, err)


def test_inv_deploy_minus_h_and_inv_trace_help_from_the_checkout():
    for args in (["deploy", "-h"], ["trace", "--help"]):
        r = run_proc([PYTHON, "-m", "invoke", *args])
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        assert r.stdout.startswith(f"Usage: inv[oke] [--core-opts] {args[0]} [--options]"), (args, r.stdout)
        assert "--host=STRING" in r.stdout and "-H" in r.stdout


def test_short_flags_have_one_meaning_on_every_task():
    seen = {}
    for name in fleet.cli.ns.task_names:
        args = fleet.cli.ns[name].get_arguments()
        for arg in args:
            shorts = [n for n in arg.names if len(n) == 1]
            longs = [n for n in arg.names if len(n) > 1]
            for s in shorts:
                flag = "-" + s
                assert flag in SHORT, (name, arg.names)
                assert longs == [SHORT[flag]] or (flag == "-n" and longs == ["lines"]), (name, arg.names)
                seen.setdefault(flag, set()).add(name)
            if arg.name in ("host", "inventory_", "set_", "forks", "lines"):
                assert shorts, (name, arg.name)        # the common options always have their short flag
    assert seen["-n"] == {"logs"} and seen["-v"] == {"deploy"}
    assert "h" not in {n for t in fleet.cli.ns.task_names for a in fleet.cli.ns[t].get_arguments() for n in a.names}
    # The program's own flags leave -e and -f to --set and --forks (invoke's are --echo and --config).
    core = {n for a in fleet.cli.program().core_args() for n in a.names}
    assert not core & {"e", "f", "H", "i", "n"} and {"h", "V"} <= core


def test_whole_number_options_are_typed_int_in_help(capsys):
    for name, flags in {"deploy": ["-f INT, --forks=INT"], "logs": ["-n INT, --lines=INT", "--instance=INT"],
                        "stop": ["--instance=INT"], "restart": ["--instance=INT"], "chat": ["--max-tokens=INT"],
                        "bench": ["--requests=INT"], "status": ["-e KEY=VALUE, --set=KEY=VALUE"]}.items():
        code, out, err = run_cli([name, "--help"], capsys)
        for flag in flags:
            assert flag in out, (name, flag, out)
        assert "=STRING" not in "".join(line for line in out.splitlines()
                                        if any(w in line for w in ("--forks", "--lines", "--instance", "--requests",
                                                                   "--max-tokens"))), out


def test_every_task_that_reads_the_inventory_takes_set():
    for name in fleet.cli.ns.task_names:
        names = {n for a in fleet.cli.ns[name].get_arguments() for n in a.names}
        if name != "version":
            assert {"set", "e", "inventory", "i"} <= names, (name, names)


def test_chat_applies_set(inventory_file, capsys):
    # chat had no --set: here it moves the entry port to one where nothing listens, and chat says so.
    port = free_port()
    code, out, err = run_cli(["chat", "-H", "t", "-i", str(inventory_file), "-e", f"proxy.port={port}"], capsys)
    assert code == 2 and f":{port}" in one_error_line(err), err


@pytest.mark.parametrize("argv, message", [
    (["status"], "error: --host is required: name a host, a comma list, a group or all (for example --host local)."),
    (["status", "-H", "t", "-f", "many"], "error: --forks takes a whole number of at least 1, got 'many'."),
    (["status", "-H", "t", "--forks", "0"], "error: --forks takes a whole number of at least 1, got '0'."),
    (["logs", "-H", "t", "-n", "x"], "error: -n takes a whole number of at least 1, got 'x'."),
    (["stop", "-H", "t", "--instance", "two"], "error: --instance takes an instance number, got 'two'."),
    (["chat", "-H", "t", "--max-tokens", "lots"], "error: --max-tokens takes a whole number of at least 1, got 'lots'."),
    (["restart", "-H", "t"], "error: restart needs either --instance I or --rolling."),
    (["render", "-H", "t"], "error: render needs --host H and --out DIR."),
    (["status", "-H", "nope"], "no host or group named 'nope' (known: t, a, b)."),
    (["status", "-H", "t", "-e", "max_num_seqs"], "error: --set max_num_seqs: expected key=value"),
    (["status", "-H", "t", "--bogus"],
     "error: no idea what '--bogus' is; `vllm-fleet status --help` lists its options."),
    (["status", "-H"], "error: --host needs a value; `vllm-fleet status --help` lists its options."),
    (["nosuch"], "error: no idea what 'nosuch' is; `vllm-fleet --list` lists the tasks."),
    (["trace"], "error: 'trace' did not receive required positional arguments: 'ident'"),
])
def test_every_user_error_is_one_error_sentence_and_exit_2(argv, message, inventory_file, capsys, monkeypatch):
    monkeypatch.setenv("FLEET_INVENTORY", str(inventory_file))
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == "", (argv, code, out, err)
    assert message in one_error_line(err), (argv, err)


def test_minus_i_given_a_number_is_one_error_sentence(capsys):
    code, out, err = run_cli(["stop", "-H", "t", "-i", "3"], capsys)
    assert code == 2 and one_error_line(err) == (
        "error: -i is --inventory, the inventory file (got '3'); for instance 3, write --instance 3.")


def test_errors_from_inv_and_the_console_script_are_the_same(inventory_file):
    for argv in ([PYTHON, "-m", "invoke"], console_script()):
        r = run_proc([*argv, "status", "-H", "t", "-i", str(inventory_file), "--forks", "x"])
        assert r.returncode == 2 and r.stdout == "", (argv, r.stdout, r.stderr)
        assert r.stderr == "error: --forks takes a whole number of at least 1, got 'x'.\n", (argv, r.stderr)


INVOKES_OWN_MISTAKES = [
    (["stauts", "-H", "t"], "no idea what 'stauts' is (did you mean status?); `{b} --list` lists the tasks."),
    (["status", "--hots", "t"], "no idea what '--hots' is (did you mean --host?); `{b} status --help` lists its options."),
    (["render", "-H", "t", "--out"], "--out needs a value; `{b} render --help` lists its options."),
    (["--lsit"], "no idea what '--lsit' is (did you mean --list?); `{b} --list` lists the tasks."),
    (["--help", "stauts"], "no idea what 'stauts' is (did you mean status?); `{b} --list` lists the tasks."),
]


@pytest.mark.parametrize("argv, message", INVOKES_OWN_MISTAKES)
def test_inv_says_what_invoke_itself_catches_as_the_console_script_does(argv, message, capsys):
    """Invoke parses the task names and options after it imported tasks.py: the same sentence, exit 2."""
    r = inv(*argv)
    assert r.returncode == 2 and r.stdout == "", r
    assert one_error_line(r.stderr) == "error: " + message.format(b="inv"), r.stderr
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and one_error_line(err) == "error: " + message.format(b="vllm-fleet"), err


def test_a_real_inv_process_says_an_unknown_task_in_one_sentence_exit_2():
    r = run_proc([PYTHON, "-m", "invoke", "stauts", "--host", "local"])
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr == "error: no idea what 'stauts' is (did you mean status?); `inv --list` lists the tasks.\n"


def test_another_projects_collection_keeps_invokes_own_messages(tmp_path):
    """The guard installed by tasks.py changes only a program running this toolkit's tasks."""
    importlib.import_module("tasks")
    from invoke import Program, task as plain_task

    @plain_task
    def hello(c):
        pass
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(io.StringIO()) as err:
        Program(namespace=Collection(hello)).run(["inv", "helo"])
    assert e.value.code == 1 and err.getvalue() == "No idea what 'helo' is!\n"


def test_the_default_inventory_is_the_current_directorys(tmp_path, inventory_file, capsys, monkeypatch):
    monkeypatch.delenv("FLEET_INVENTORY", raising=False)
    monkeypatch.setattr(fleet.cli, "CHECKOUT", tmp_path / "no-checkout")    # as from an installed wheel
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["vars", "-H", "t"], capsys)
    assert code == 2 and one_error_line(err) == (
        f"error: no inventory: there is no inventory/hosts.yml in {tmp_path}; pass -i FILE or set FLEET_INVENTORY.")
    (tmp_path / "inventory").mkdir()
    (tmp_path / "inventory" / "hosts.yml").write_text(inventory_file.read_text())
    code, out, err = run_cli(["vars", "-H", "t"], capsys)
    assert code == 0 and out.startswith("# t (inventory/hosts.yml)\n"), out + err
    monkeypatch.setenv("FLEET_INVENTORY", str(inventory_file))
    code, out, err = run_cli(["vars", "-H", "t"], capsys)
    assert code == 0 and out.startswith(f"# t ({inventory_file})\n"), out + err


def test_explain_names_the_layer_each_value_came_from(inventory_file):
    inv = inv_mod.load(inventory_file)
    found = inv.explain("t", ["max_model_len=2048", "proxy.timeout_s=30"])
    assert found["max_model_len"] == (2048, "--set")
    assert found["proxy.timeout_s"] == (30.0, "--set")
    assert found["stagger_s"] == (1.0, "defaults")
    assert found["max_num_seqs"] == (5, "group b")            # groups in file order: b after a
    assert found["stop_grace_s"] == (4.0, "group a")
    assert found["model"] == ("/models/Some-Model", "host")
    assert found["sim.load_s"] == (0.5, "host") and found["sim.token_ms"][1] == "default"
    assert found["drain_timeout_s"][1] == "default"
    assert found["served_model_name"] == ("Some-Model", "derived")     # from model
    assert found["bind"] == ("127.0.0.1", "derived")
    assert found["proxy.results_log.backups"][1] == "default"          # nested keys dotted
    # The values are the host's resolved variables, every one of them.
    hv = inv.host_vars("t", ["max_model_len=2048", "proxy.timeout_s=30"])
    assert {k: v for k, (v, _) in found.items()} == inv_mod._dotted(hv.settings.model_dump())


def test_vars_prints_each_key_its_value_and_origin(inventory_file, capsys):
    code, out, err = run_cli(["vars", "-H", "t", "-i", str(inventory_file), "-e", "max_model_len=2048",
                              "--set", "extra_args=[--a, --b]"], capsys)
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0] == f"# t ({inventory_file})"
    rows = {line.split(":", 1)[0]: line for line in lines[1:]}
    for key, value, origin in [("max_model_len", "2048", "--set"), ("extra_args", "[--a, --b]", "--set"),
                               ("max_num_seqs", "5", "group b"), ("stagger_s", "1.0", "defaults"),
                               ("engine", "sim", "host"), ("proxy.retries", "2", "default"),
                               ("served_model_name", "Some-Model", "derived"), ("ssh", "null", "default")]:
        left, right = rows[key].split("  # ")
        assert left.rstrip() == f"{key}: {value}" and right == origin, rows[key]
    code, out, err = run_cli(["vars", "-H", "t", "-i", str(inventory_file), "--json"], capsys)
    data = json.loads(out)
    assert [d["host"] for d in data] == ["t"]
    assert data[0]["vars"]["max_num_seqs"] == {"value": 5, "origin": "group b"}
    assert data[0]["vars"]["proxy.port"]["origin"] == "defaults"


class FakeSshd:
    """A TCP server on a free loopback port that is not sshd: each connection gets garbage, or nothing,
    and is closed, so the SSH banner read fails."""

    def __init__(self, reply: bytes):
        self.sock = socket.create_server(("127.0.0.1", 0))     # bound at once: no port to race for
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.05)     # closing a socket does not wake accept(): the loop looks at `done`
        self.reply = reply
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            with conn:
                if self.reply:
                    conn.sendall(self.reply)

    def close(self):
        self.done.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.mark.parametrize("reply", [b"HTTP/1.1 400 Bad Request\r\n\r\nnot ssh\r\n", b""], ids=["garbage", "closed"])
def test_a_failed_ssh_banner_is_one_unreachable_line_without_paramikos_traceback(tmp_path, reply):
    """1. A "sshd" accepts the connection and answers garbage (or closes at once).
    2. `inv status` on that host: paramiko fails to read the banner and logs it with two tracebacks.
    3. The user sees the one UNREACHABLE line, exit 4, and no traceback."""
    server = FakeSshd(reply)
    try:
        path = tmp_path / "hosts.yml"
        path.write_text(textwrap.dedent(f"""\
            hosts:
              s:
                ssh: {{host: 127.0.0.1, port: {server.port}, user: nobody, known_hosts: {tmp_path / 'known_hosts'},
                       connect_timeout_s: 5}}
                engine: sim
                accelerator: sim
                accelerators: 1
                instances: 1
                deploy_dir: /tmp/never-made
            """))
        r = run_proc([PYTHON, "-m", "invoke", "status", "-H", "s", "-i", str(path)], env={"HOME": str(tmp_path)})
    finally:
        server.close()
    assert r.returncode == 4, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr, r.stderr
    unreachable = [line for line in r.stderr.splitlines() if "UNREACHABLE" in line]
    assert r.stderr.splitlines() == unreachable and len(unreachable) == 1, r.stderr
    assert unreachable[0].startswith(f"s: UNREACHABLE: s: SSH to 127.0.0.1:{server.port} failed ("), r.stderr


def test_render_into_a_closed_output_writes_every_file_and_says_no_error(tmp_path, inventory_file):
    # `render ... | head -1` said "error: cannot write OUT (Broken pipe); choose another --out".
    out = tmp_path / "out"
    proc = subprocess.Popen([PYTHON, "-m", "invoke", "render", "-H", "t", "--out", str(out), "-i", str(inventory_file)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()          # the reader is gone before the first line
    try:
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and err == "", (proc.returncode, err)
    from fleet.host import sync
    hv = inv_mod.load(inventory_file).host_vars("t")
    hv.settings.python = "python3"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        sorted(f.path for f in sync.host_files(hv))


# invoke's core options for invoke's run(), which the tool never calls (it runs commands through
# subprocess and paramiko): `vllm-fleet --dry deploy` deployed.
INVOKE_RUN_OPTIONS = ["--dry", "--warn-only", "--prompt-for-sudo-password", "--echo", "--pty", "--hide",
                      "--command-timeout", "--config", "--write-pyc", "--debug"]


def test_the_console_scripts_help_lists_the_tasks_and_no_option_the_tool_does_not_honour(capsys):
    code, out, err = run_cli(["--help"], capsys)
    assert code == 0 and err == "", err
    core, tasks = out.split("Subcommands:")
    for option in INVOKE_RUN_OPTIONS:
        assert option not in out, (option, out)
    for option in ("--help", "--list", "--version", "--print-completion-script"):
        assert option in core, (option, core)
    for name in fleet.cli.ns.task_names:
        assert f"\n  {name} " in tasks, (name, tasks)


@pytest.mark.parametrize("argv, flag", [(["--dry", "deploy"], "--dry"), (["-w", "status"], "-w"),
                                        (["--prompt-for-sudo-password", "stop"], "--prompt-for-sudo-password"),
                                        (["--echo", "status"], "--echo"), (["-R", "deploy"], "-R")])
def test_the_console_script_refuses_an_invoke_option_it_does_not_honour(argv, flag, inventory_file, capsys):
    code, out, err = run_cli([*argv, "-H", "t", "-i", str(inventory_file)], capsys)
    assert code == 2 and out == "", (out, err)
    assert one_error_line(err) == (f"error: {flag} is one of invoke's own options, which vllm-fleet does not offer "
                                   "(it runs its commands itself, not through invoke); drop it.")
    assert not (inventory_file.parent / "deploy").exists()          # nothing was deployed


@pytest.mark.parametrize("options, named", [(["--dry"], "--dry: invoke's own option"),
                                            (["--warn-only", "--echo"], "--warn-only and --echo: invoke's own options"),
                                            (["--prompt-for-sudo-password"], "--prompt-for-sudo-password: invoke's")])
def test_inv_refuses_an_invoke_option_the_tool_does_not_honour_before_the_task_runs(options, named, inventory_file,
                                                                                     monkeypatch):
    """`inv --dry deploy` deployed: invoke's options reach the task's config, and the task refuses them in
    one sentence before it does anything (invoke's own Program offers them: it cannot be told not to)."""
    from fleet_helpers import inv
    monkeypatch.setattr("getpass.getpass", lambda prompt="": "secret")   # the sudo prompt asks first
    r = inv(*options, "deploy", "--host", "t", inventory=inventory_file)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert one_error_line(r.stderr).startswith(f"error: {named}"), r.stderr
    assert r.stderr.rstrip().endswith("which vllm-fleet does not honour (it runs its commands itself, not through "
                                      "invoke); drop " + ("them" if len(options) > 1 else "it")
                                      + " (deploy --check shows what a deploy would change).")
    assert not (inventory_file.parent / "deploy").exists()


def test_help_shows_set_taking_key_value_and_the_positional_arguments(capsys):
    for name, usage, shown in [("trace", "trace [--options] ID [other tasks here ...]", "ID, --ident=ID"),
                               ("lora", "lora [--options] ACTION [other tasks here ...]", "ACTION, --action=ACTION"),
                               ("deploy", "deploy [--options] [other tasks here ...]", "-e KEY=VALUE, --set=KEY=VALUE")]:
        code, out, err = run_cli([name, "-h"], capsys)
        assert code == 0 and out.startswith(f"Usage: vllm-fleet [--core-opts] {usage}\n"), out
        assert shown in out and "-e, --set" not in out, out
    code, out, err = run_cli(["trace", "-h"], capsys)
    assert "positional (the first word after trace): a trace id" in " ".join(out.split())


def test_help_shows_every_options_default(capsys):
    code, out, err = run_cli(["chat", "-h"], capsys)
    text = " ".join(out.split())
    for shown in ("max_tokens of the request (default: 64)", "whose entry port to send to (default: local)",
                  "the user message (default: Describe a sunrise over the sea in one sentence.)"):
        assert shown in text, (shown, out)
    for name in fleet.cli.ns.task_names:        # every task, every option with a default worth saying
        for arg in fleet.cli.ns[name].get_arguments():
            if arg.default not in (None, "", False, []):
                assert "default" in arg.help, (name, arg.name, arg.help)


@pytest.mark.parametrize("argv, message", [
    (["deplyo", "-H", "t"], "error: no idea what 'deplyo' is (did you mean deploy?); `vllm-fleet --list` lists the tasks."),
    (["status", "--hots", "t"],
     "error: no idea what '--hots' is (did you mean --host?); `vllm-fleet status --help` lists its options."),
    (["--lsit"], "error: no idea what '--lsit' is (did you mean --list?); `vllm-fleet --list` lists the tasks."),
    (["status", "-H", "t", "-e", "max_num_seq=3"],
     "--set: max_num_seq: unknown key (did you mean max_num_seqs?); docs/inventory.md lists every key."),
])
def test_an_unknown_task_option_or_key_gets_the_closest_name(argv, message, inventory_file, capsys, monkeypatch):
    monkeypatch.setenv("FLEET_INVENTORY", str(inventory_file))
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == "" and message in one_error_line(err), (argv, err)


def test_a_yaml_syntax_error_is_one_sentence_naming_the_problem_and_the_line(tmp_path, capsys):
    path = tmp_path / "hosts.yml"
    path.write_text("hosts:\n\tt: {}\n")
    code, out, err = run_cli(["vars", "-H", "t", "-i", str(path)], capsys)
    assert code == 2 and one_error_line(err).replace(" '\\t' ", " ") == (
        f"error: {path}: not valid YAML at line 2, column 1 (while scanning for the next token; found character "
        "that cannot start any token); YAML indents with spaces only: replace the tab with spaces.")


def test_the_checkouts_inventory_is_named_when_used_from_another_directory(tmp_path, inventory_file, capsys,
                                                                          monkeypatch):
    """1. From a directory without inventory/hosts.yml, a checkout's own file is used: stderr names it
    (stdout stays the command's); 2. the current directory's file, -i FILE or FLEET_INVENTORY: nothing said."""
    monkeypatch.delenv("FLEET_INVENTORY", raising=False)
    checkout = tmp_path / "checkout"
    (checkout / "inventory").mkdir(parents=True)
    (checkout / "tasks.py").write_text("")
    (checkout / "inventory" / "hosts.yml").write_text(inventory_file.read_text())
    monkeypatch.setattr(fleet.cli, "CHECKOUT", checkout)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run_cli(["vars", "-H", "t", "--json"], capsys)
    assert code == 0 and json.loads(out)[0]["host"] == "t", out + err
    assert err == (f"inventory: {checkout / 'inventory' / 'hosts.yml'} (the checkout's; there is no "
                   f"inventory/hosts.yml in {elsewhere})\n")
    code, out, err = run_cli(["bench", "-H", "t"], capsys)       # bench reads the file once: said once
    assert err.count("inventory: ") == 1 and "t : ok=" in out, out + err     # (nothing deployed to bench)
    for argv, env in ((["-i", str(inventory_file)], None), ([], str(inventory_file))):
        if env:
            monkeypatch.setenv("FLEET_INVENTORY", env)
        code, out, err = run_cli(["vars", "-H", "t", *argv], capsys)
        assert code == 0 and err == "", err
    monkeypatch.delenv("FLEET_INVENTORY")
    monkeypatch.chdir(checkout)
    code, out, err = run_cli(["vars", "-H", "t"], capsys)
    assert code == 0 and err == "" and out.startswith("# t (inventory/hosts.yml)\n"), out + err


def test_help_into_a_closed_pipe_ends_without_a_traceback():
    r = run_proc(["bash", "-c", f"{' '.join(map(shlex.quote, console_script()))} deploy -h | head -1"])
    assert r.returncode == 0 and r.stdout.startswith("Usage: vllm-fleet") and r.stderr == "", r.stderr


def test_the_task_list_shows_each_tasks_whole_first_sentence(capsys):
    """`inv --list` shows a docstring's first line: each is a whole sentence (deploy and lora were cut)."""
    for name in fleet.cli.ns.task_names:
        first, *rest = inspect.getdoc(fleet.cli.ns[name]).splitlines()
        assert first.endswith(".") and (not rest or rest[0] == ""), (name, first)
    code, out, _ = run_cli(["--list"], capsys)
    assert code == 0 and "start and roll the instances, start the proxy, wait for /health." in " ".join(out.split())
