"""The boot hook and `inv remove`: a host that reboots comes back by itself, without root; a removed
deployment leaves nothing behind, and nothing that is not its own is deleted.

The suite runs as root and the hook lives in the user's crontab: these tests set FLEET_BOOT_HOOK back to
auto for their own deploys (conftest turns it off for every other test), assert that the rest of the
crontab is byte-identical before and after, and remove exactly their tagged lines in teardown. They share
one xdist group, so two of them never edit the crontab at once.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import require_tool, wait_until
from fleet_helpers import (
    deployment_id,
    inv,
    kill_tagged,
    session_members,
    status_json,
    stop_by_own_scripts,
    tagged_pids,
    write_inventory,
)
from netns import namespace_pids, netns_fleet  # noqa: F401  (the fixture)

from hostagent import boothook, layout, processes
from hostagent.facts import BootHookFit, parse

from fleet.commands import remove as fleet_remove
from fleet.host import boot as fleet_boot
from fleet.render import environment, render_host

HOOK = {"FLEET_BOOT_HOOK": "auto"}
GROUP = pytest.mark.xdist_group("boot")          # one crontab: these tests run one after the other


def crontab() -> str | None:
    """The user's crontab as `crontab -l` prints it (None: there is none)."""
    r = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def as_cron(command: str, wrap: list[str] = ()) -> subprocess.CompletedProcess:
    """Run a hook's command exactly as cron does: /bin/sh -c, a minimal environment, no terminal."""
    env = ["env", "-i", f"HOME={os.path.expanduser('~')}", "PATH=/usr/bin:/bin", "SHELL=/bin/sh",
           f"LOGNAME={boothook.user()}"]
    return subprocess.run([*wrap, *env, "/bin/sh", "-c", command], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, start_new_session=True)


def watchdog_command(dep: str) -> str:
    """The command of the crontab's every-minute line of deployment dep."""
    line = next(ln for ln in crontab().splitlines() if ln.endswith(boothook.mark(dep)) and ln.startswith("* "))
    return line[len("* * * * * "):-len(boothook.mark(dep))].strip()


def kill_everything(dep: str, deploy_dir: Path) -> int:
    """SIGKILL every process of the deployment at once, as a power cut ends them: those with its tag
    (instances, engines, log writers, proxy, keeper) and the members of every session its pid files
    record (nginx renames itself over its environment, tag included); how many there were."""
    sids = set()
    for pidfile in (deploy_dir / layout.RUN).glob("*.pid"):
        record, _ = processes.read_record_file(str(pidfile))
        if record and record["sid"]:
            sids.add(record["sid"])

    def members() -> set[int]:
        return set(tagged_pids(dep + "/")) | set(session_members(sids))
    killed: set[int] = set()

    def kill_the_rest() -> bool:
        # Again until none is left: a parent killed a moment after its child may have started another
        # (nginx's master forks new workers, the keeper a new instance) on a loaded machine.
        pids = members()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
        return not pids
    wait_until(kill_the_rest, 60, interval=0.2, what="every process of the deployment gone")
    return len(killed)


def health(port: int, host: str = "127.0.0.1") -> int | None:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
            return r.status
    except OSError:
        return None


@pytest.fixture
def hook_cleanup():
    """Deployment ids whose hook lines are removed at the end, pass or fail, and the crontab as it was."""
    require_tool("crontab")
    before = crontab()
    deps: list[str] = []
    yield deps
    for dep in deps:
        boothook.remove(dep)
        kill_tagged(dep + "/")
    assert crontab() == before, "the test left the crontab changed"


# --- unit: the crontab's text, the unit, the doctor's line, the refusals ----------------------------

@pytest.mark.unit
def test_crontab_edit_keeps_every_other_byte_and_matches_only_its_own_deployment():
    """1. a crontab with a user's lines (one without a final newline) and another deployment's hook,
    whose id ends with ours; 2. adding our lines appends them; adding them again changes nothing;
    3. removing them gives back the original bytes, the other deployment's lines untouched."""
    text = "MAILTO=me\n0 3 * * * backup.sh # vllm-fleet boot x\n@reboot /b # vllm-fleet boot xt-1"
    lines = boothook.cron_lines("/d/100%", "t-1", watchdog=True)
    assert lines == ["@reboot /d/100\\%/bin/boot.sh # vllm-fleet boot t-1",
                     "* * * * * /d/100\\%/bin/boot.sh --keeper # vllm-fleet boot t-1"]
    added = boothook.with_lines(text, lines, "t-1")
    assert added == text + "\n" + "\n".join(lines) + "\n"
    assert boothook.with_lines(added, lines, "t-1") == added
    assert boothook.without(added, "t-1") == text + "\n"
    assert boothook.without(text, "t-1") == text
    assert boothook.cron_lines("/d", "t-1", watchdog=False) == ["@reboot /d/bin/boot.sh # vllm-fleet boot t-1"]


@pytest.mark.unit
def test_systemd_unit_runs_the_watch_loop_and_restarts_without_killing_the_instances(tmp_path, monkeypatch):
    """1. the unit's ExecStart is bin/boot.sh --watch (the boot, then the watchdog), Restart=always, and
    KillMode=process (a restart of the unit ends the loop, never the instances); 2. `show` reads the
    installed unit back as {kind, command} for a deploy_dir with a space, a quote and a percent sign."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    d = '/srv/my "fleet" 100%'
    text = boothook.unit_text(d, "h-1")
    assert "Restart=always" in text and "KillMode=process" in text and "WantedBy=default.target" in text
    path = Path(boothook.unit_path("h-1"))
    assert path == tmp_path / "systemd" / "user" / "vllm-fleet-h-1.service"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert boothook.show("h-1") == {"kind": "systemd", "command": boothook.boot_command(d, "--watch")}


@pytest.mark.unit
@pytest.mark.parametrize("wanted, facts, status, says", [
    ("auto", {"kind": "cron", "user": "u", "missing": ""}, "ok", "cron: an @reboot line"),
    ("auto", {"kind": "cron", "user": "u", "missing": "cron is not running"}, "warn", "cron is not running"),
    ("auto", {"kind": "systemd", "user": "u", "missing": ""}, "ok", "systemd user unit"),
    ("auto", {"kind": None, "user": "u", "missing": "there is no crontab command"}, "warn", "no crontab"),
    ("systemd", {"kind": "cron", "user": "u", "missing": ""}, "warn", "no systemd user manager"),
    ("off", {"kind": "cron", "user": "u", "missing": ""}, "ok", "boot_hook is off"),
])
def test_doctor_names_the_hook_it_will_use_or_what_is_missing_as_a_warning(monkeypatch, wanted, facts, status,
                                                                           says):
    """The doctor's boot hook line: which kind deploy installs, or what is missing in one sentence; never
    a failure (the deployment serves without it: only a reboot would need a person)."""
    monkeypatch.delenv("FLEET_BOOT_HOOK", raising=False)

    got = fleet_boot.doctor_check(BootHookFit(**facts), SimpleNamespace(settings=SimpleNamespace(boot_hook=wanted)))
    assert got[0] == status and says in got[1], got


@pytest.mark.unit
def test_remove_counts_every_live_part_and_tagged_process_as_still_running():
    """What `inv remove` refuses on: instances, proxy, nginx, keeper, and any process with the tag."""
    found = {"instances": [{"index": 0, "alive": False}, {"index": 1, "alive": True}],
             "proxy": {"alive": False}, "nginx": {"alive": True}, "keeper": {"alive": False},
             "tagged": [{"pid": 7, "tag": "t-1/1"}, {"pid": 9, "tag": "t-1/log-0"}]}
    assert fleet_remove.running(parse(found)) == ["instance 1", "nginx", "1 process(es) with its tag (pid 9)"]
    assert fleet_remove.running(parse({**found, "instances": [], "nginx": {}, "tagged": []})) == []


@pytest.mark.unit
def test_boot_script_renders_for_local_and_ssh_hosts_and_parses(tmp_path):
    """1. the example inventory's hosts (local; k100-01 over SSH with env_setup) render bin/boot.sh;
    2. bash parses it; 3. the SSH host's runs the host agent by deploy's interpreter rule (python3 when
    recent, else the inventory's python after env_setup), the local one with its resolved python."""
    from fleet.settings import inventory
    inv_ = inventory.load(Path(__file__).resolve().parent.parent / "inventory" / "hosts.yml")
    for name in ("local", "k100-01"):
        hv = inv_.host_vars(name)
        hv.settings.deploy_dir, hv.settings.python = "/srv/fleet", hv.settings.python or "python3"
        text = next(f.content for f in render_host(hv) if f.path == layout.BOOT)
        script = tmp_path / f"{name}.sh"
        script.write_text(text)
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert ("exec python3 -m hostagent" in text) == (name == "k100-01")
    assert environment().get_template("boot.sh.j2")


def fake_tools(bin_dir: Path, linger: bool) -> Path:
    """Stand-ins for crontab, loginctl and systemctl in bin_dir: the crontab is a file, systemctl logs its
    arguments (and answers for the user manager), loginctl says whether lingering is on."""
    bin_dir.mkdir()
    tab, calls = bin_dir / "tab", bin_dir / "systemctl.log"
    scripts = {
        "crontab": f"""case "$1" in -l) [ -f {tab} ] && exec cat {tab}; echo "no crontab for $USER" >&2; exit 1 ;;
                   -) cat > {tab} ;; -r) rm -f {tab} ;; esac""",
        "loginctl": f'echo "Linger={"yes" if linger else "no"}"',
        "systemctl": f'echo "$*" >> {calls}',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return tab


@pytest.mark.process
@pytest.mark.parametrize("linger", [True, False])
def test_install_picks_systemd_where_lingering_is_on_else_cron_and_remove_leaves_nothing(tmp_path, monkeypatch,
                                                                                        linger):
    """On stand-in tools (the real crontab and user manager untouched): 1. with lingering, install writes
    the user unit and enables it (`systemctl --user enable --now`); without, it adds the two crontab lines
    after the user's own; 2. a second install changes nothing, and `as_wanted` (deploy's plan: keep it) says
    so, where before the install and for another deploy_dir it does not; 3. `show` names the kind and command;
    4. remove leaves the user's crontab as it was and no unit."""
    tab = fake_tools(tmp_path / "bin", linger)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    tab.write_text("MAILTO=me\n")
    assert boothook.as_wanted("/srv/fleet", "h-1", "auto", watchdog=True) is False     # deploy would install it
    got = boothook.install("/srv/fleet", "h-1", "auto", watchdog=True)
    kind = "systemd" if linger else "cron"
    assert got["kind"] == kind and got["changed"], got
    assert boothook.install("/srv/fleet", "h-1", "auto", watchdog=True)["changed"] is False
    # As installed: deploy's plan keeps it (no install); without the keeper's watchdog, cron's differs.
    assert boothook.as_wanted("/srv/fleet", "h-1", "auto", watchdog=True) is True
    assert boothook.as_wanted("/srv/fleet", "h-1", "auto", watchdog=False) is linger
    assert boothook.as_wanted("/srv/other", "h-1", "auto", watchdog=True) is False
    assert boothook.show("h-1")["kind"] == kind
    if linger:
        assert "--user enable --now vllm-fleet-h-1.service" in (tmp_path / "bin" / "systemctl.log").read_text()
        assert tab.read_text() == "MAILTO=me\n"
    else:
        assert tab.read_text() == "MAILTO=me\n" + "".join(
            line + "\n" for line in boothook.cron_lines("/srv/fleet", "h-1", True))
    assert boothook.remove("h-1") == {"removed": [kind]}
    assert tab.read_text() == "MAILTO=me\n" and not Path(boothook.unit_path("h-1")).exists()
    assert boothook.show("h-1") is None


@pytest.mark.process
@pytest.mark.parametrize("squatter", ["held", "symlink"])
def test_a_crontab_lock_made_first_in_tmp_neither_blocks_an_install_nor_is_followed(tmp_path, monkeypatch, squatter):
    """The lock used to be /tmp/vllm-fleet-crontab-<uid>.lock, a name any local user can make first.
    1. The old name is taken: a file of another user (uid 65534 when the suite is root) locked by its
       holder for good, or a symlink to a file of ours.
    2. install and remove (stand-in crontab) finish at once: the lock is ~/.cache/vllm-fleet/crontab.lock,
       mode 0600, and the symlink's target is untouched.
    3. That lock made a symlink in turn: install refuses with one sentence and follows nothing."""
    import fcntl
    import tempfile
    import threading
    tab = fake_tools(tmp_path / "bin", linger=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    old = Path(tempfile.gettempdir(), f"vllm-fleet-crontab-{os.getuid()}.lock")
    target = tmp_path / "precious"
    target.write_text("keep\n")
    holder = None
    if squatter == "held":
        old.write_text("")
        old.chmod(0o600)
        if os.getuid() == 0:
            os.chown(old, 65534, 65534)
        holder = os.open(old, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_EX)
    else:
        old.symlink_to(target)
    try:
        done = []
        t = threading.Thread(target=lambda: done.append((boothook.install("/srv/fleet", "h-1", "cron", True),
                                                         boothook.remove("h-1"))), daemon=True)
        t.start()
        t.join(timeout=20)
        assert done, "the install waited on the lock in /tmp"
        assert done[0][0]["changed"] and done[0][1] == {"removed": ["cron"]}
    finally:
        if holder is not None:
            os.close(holder)
    assert target.read_text() == "keep\n" and not tab.exists()
    lock = Path(boothook.crontab_lock_path())
    assert lock.parent.parent.parent == tmp_path / "home" and lock.stat().st_mode & 0o777 == 0o600
    lock.unlink()
    lock.symlink_to(target)
    with pytest.raises(boothook.BootHookError, match=r"^cannot take the crontab lock .*crontab\.lock"):
        boothook.install("/srv/fleet", "h-1", "cron", True)
    assert target.read_text() == "keep\n" and not tab.exists()


# --- the local host ---------------------------------------------------------------------------------

@pytest.mark.cluster
def test_a_second_deploy_with_its_hook_installed_as_wanted_spends_no_round_trip_on_it(tmp_path, monkeypatch):
    """On stand-in tools (the real crontab untouched): 1. a deploy with boot_hook cron installs the hook;
    2. a second deploy, nothing changed, plans the hook kept (the state probe found it as wanted) and spends
    two round trips in all, the run lock and the first read, as tests/test_round_trips.py's SSH host does."""
    from fleet.commands import deploy as fleet_deploy
    from fleet.settings import inventory as inv_mod
    from fleet.transport import connection as transport
    tab = fake_tools(tmp_path / "bin", linger=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv(fleet_boot.ENV, "cron")
    path = write_inventory(tmp_path, instances=1)
    try:
        first = inv("deploy", "--host", "t", inventory=path)
        assert first.returncode == 0 and "@reboot" in tab.read_text(), first.stdout + first.stderr
        hv = inv_mod.load(path).host_vars("t")
        conn = transport.connect(hv)
        report = fleet_deploy.deploy(conn, hv)
        hook = next(s for s in report.steps if s.name == "boot hook")
        assert (hook.status, hook.message.split(":")[0]) == ("ok", "cron"), hook
        assert report.count("changed") == 0 and conn.round_trips == 2, (conn.round_trips, report.steps)
    finally:
        stop_by_own_scripts(path, ["t"])


@GROUP
@pytest.mark.cluster
def test_killed_deployment_comes_back_from_the_hook_run_as_cron_runs_it(tmp_path, hook_cleanup):
    """1. `inv doctor` names the hook deploy will install (cron); deploy a local sim cluster of 2
    instances with the boot hook on: `inv status --json` names it under `boot` (cron, bin/boot.sh) and
    the crontab gained exactly its two tagged lines;
    2. the watchdog line, run as cron would, is a no-op while the keeper lives;
    3. every process of the deployment is killed at once (SIGKILL by its tag);
    4. `boot.command` run as cron runs it (env -i, /bin/sh -c, minimal PATH, no terminal) brings the
    proxy and both instances back healthy, and the keeper running, within 120 s;
    5. the keeper alone is killed: the watchdog line starts it again;
    6. `inv stop`: `boot` is None and the crontab is byte-identical to before the deploy."""
    inventory = write_inventory(tmp_path, instances=2)
    dep = deployment_id(inventory)
    hook_cleanup.append(dep)
    before = crontab()
    r = inv("doctor", "--host", "t", inventory=inventory, env=HOOK)
    assert "boot hook: cron" in r.stdout, r.stdout
    r = inv("deploy", "--host", "t", inventory=inventory, env=HOOK)
    assert r.returncode == 0, r.stdout + r.stderr
    st = status_json(inventory)
    script = str(tmp_path / "deploy" / layout.BOOT)
    assert st["boot"] == {"kind": "cron", "command": shlex.quote(script)}
    assert f"boot    cron: {shlex.quote(script)}" in inv("status", "--host", "t", inventory=inventory).stdout
    ours = [ln for ln in crontab().splitlines() if ln.endswith(boothook.mark(dep))]
    assert len(ours) == 2 and boothook.without(crontab(), dep) == (before or "")

    keeper = st["keeper"]["pid"]
    log = tmp_path / "deploy" / layout.BOOT_LOG
    as_cron(watchdog_command(dep))
    assert status_json(inventory)["keeper"]["pid"] == keeper and not log.exists()

    assert kill_everything(dep, tmp_path / "deploy") >= 6
    t0 = time.monotonic()
    r = as_cron(st["boot"]["command"])
    assert r.returncode == 0, r.stderr
    ports = [st["proxy"]["port"]] + [i["port"] for i in st["instances"]]
    wait_until(lambda: all(health(p) == 200 for p in ports), 120, interval=0.2,
               what="the proxy and both instances healthy after the boot hook")
    took = time.monotonic() - t0
    print(f"boot hook to healthy (local, 2 sim instances): {took:.1f}s")
    back = status_json(inventory)
    assert back["keeper"]["state"] == "running" and back["proxy"]["state"] == "healthy"
    assert [i["state"] for i in back["instances"]] == ["healthy", "healthy"]
    assert "boot: done" in log.read_text()

    os.kill(back["keeper"]["pid"], signal.SIGKILL)
    wait_until(lambda: status_json(inventory)["keeper"]["state"] == "dead", 10, what="the keeper dead")
    as_cron(watchdog_command(dep))
    again = status_json(inventory)["keeper"]
    assert again["state"] == "running" and again["pid"] != back["keeper"]["pid"]

    r = inv("stop", "--host", "t", inventory=inventory, env=HOOK)
    assert r.returncode == 0, r.stdout + r.stderr
    assert status_json(inventory)["boot"] is None
    assert crontab() == before


@GROUP
@pytest.mark.cluster
def test_remove_stops_unhooks_and_deletes_only_a_proven_deploy_dir(tmp_path, hook_cleanup):
    """1. deploy a local sim cluster of 1 instance with the boot hook; 2. `inv remove --check` names the
    deploy_dir and what would stop, and changes nothing; 3. `inv remove` stops it, removes the hook and
    deletes deploy_dir; 4. a deploy_dir recording another deployment's id, one recording none, and one
    holding a file deploy did not put there are refused in one sentence, nothing deleted."""
    inventory = write_inventory(tmp_path, instances=1)
    dep = deployment_id(inventory)
    hook_cleanup.append(dep)
    d = tmp_path / "deploy"
    assert inv("deploy", "--host", "t", inventory=inventory, env=HOOK).returncode == 0
    assert any(ln.endswith(boothook.mark(dep)) for ln in crontab().splitlines())

    r = inv("remove", "--host", "t", "--check", inventory=inventory, env=HOOK)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"would delete {d}" in r.stdout and "would remove the cron hook" in r.stdout, r.stdout
    assert status_json(inventory)["instances"][0]["state"] == "healthy" and d.exists()

    r = inv("remove", "--host", "t", inventory=inventory, env=HOOK)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not d.exists() and tagged_pids(dep + "/") == []
    assert not any(ln.endswith(boothook.mark(dep)) for ln in (crontab() or "").splitlines())

    (d / "conf").mkdir(parents=True)
    (d / "conf" / "hostagent.json").write_text(json.dumps({"deployment_id": "other-12345678"}))
    r = inv("remove", "--host", "t", inventory=inventory)
    assert r.returncode == 2 and "is the deployment other-12345678's" in r.stderr, r.stdout + r.stderr
    (d / "conf" / "hostagent.json").unlink()
    r = inv("remove", "--host", "t", inventory=inventory)
    assert r.returncode == 2 and "records no deployment id" in r.stderr, r.stdout + r.stderr
    (d / "conf" / "hostagent.json").write_text(json.dumps({"deployment_id": dep}))
    (d / "notes.txt").write_text("mine")
    r = inv("remove", "--host", "t", inventory=inventory)
    assert r.returncode == 2 and "holds what deploy did not put there (notes.txt)" in r.stderr, r.stderr
    assert (d / "notes.txt").exists() and "Traceback" not in r.stderr


@GROUP
@pytest.mark.cluster
@pytest.mark.nginx
def test_host_that_had_nginx_in_front_comes_back_with_nginx(tmp_path, hook_cleanup):
    """1. deploy a local sim cluster of 1 instance with the boot hook, then `inv swap-to-nginx`;
    2. every process of the deployment is killed at once (nginx's master and workers by their recorded
    session); 3. the hook's command, run as cron runs it, starts the instance, then nginx (run/mode says
    nginx: not the proxy), then the keeper, which watches nginx's backends: the entry port answers
    /health 200 from nginx; 4. `inv stop` removes the hook."""
    require_tool("nginx")
    inventory = write_inventory(tmp_path, instances=1)
    dep = deployment_id(inventory)
    hook_cleanup.append(dep)
    before = crontab()
    r = inv("deploy", "--host", "t", inventory=inventory, env=HOOK)
    assert r.returncode == 0, r.stdout + r.stderr
    r = inv("swap-to-nginx", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    st = status_json(inventory)
    assert st["front"] == "nginx" and st["boot"]["kind"] == "cron", st

    kill_everything(dep, tmp_path / "deploy")
    t0 = time.monotonic()
    r = as_cron(st["boot"]["command"])
    assert r.returncode == 0, r.stderr
    wait_until(lambda: health(st["proxy"]["port"]) == 200, 120, interval=0.2,
               what="nginx's /health 200 after the boot hook")
    print(f"boot hook to healthy (local, nginx front, 1 sim instance): {time.monotonic() - t0:.1f}s")
    back, said = status_json(inventory), (tmp_path / "deploy" / layout.BOOT_LOG).read_text()
    assert back["front"] == "nginx" and back["proxy"]["state"] == "stopped", (back["proxy"], said)
    assert back["keeper"]["state"] == "running" and back["instances"][0]["state"] == "healthy", (back, said)

    assert inv("stop", "--host", "t", inventory=inventory).returncode == 0
    assert crontab() == before


# --- a host in a network namespace, over SSH ------------------------------------------------------

@pytest.mark.netns
@pytest.mark.ssh
@pytest.mark.cluster
@GROUP
@pytest.mark.timeout(300)
def test_host_in_a_namespace_comes_back_from_its_hook_over_ssh(netns_fleet, tmp_path, hook_cleanup):
    """1. one host in its own network namespace, reached over SSH; deploy a sim cluster of 2 instances
    there with the boot hook on; 2. every process of its deployment is killed at once; 3. the hook's
    command (`boot.command` from `inv status --json`) run inside the namespace as cron runs it brings
    its proxy, both instances and the keeper back; 4. `inv stop` removes the hook: `boot` is None, the
    crontab is as before, and nothing of the deployment is left in the namespace."""
    from test_netns_fleet import member
    fleet = netns_fleet(1)
    host = fleet.hosts[0]
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"hosts": {"n1": member(fleet, 0, tmp_path, instances=2)}}))
    dep = deployment_id(inventory, "n1")
    hook_cleanup.append(dep)
    before = crontab()
    r = inv("deploy", "--host", "n1", inventory=inventory, env=HOOK)
    assert r.returncode == 0, r.stdout + r.stderr
    st = status_json(inventory, host="n1")
    assert st["boot"]["kind"] == "cron", st["boot"]

    kill_everything(dep, tmp_path / "h0")
    t0 = time.monotonic()
    r = as_cron(st["boot"]["command"], wrap=host.exec_argv())
    assert r.returncode == 0, r.stderr

    def healthy():
        now = status_json(inventory, host="n1")
        return now["proxy"]["state"] == "healthy" and all(i["state"] == "healthy" for i in now["instances"]) \
            and now["keeper"]["state"] == "running"
    wait_until(healthy, 120, interval=0.2, what="the namespace host's proxy, instances and keeper back")
    print(f"boot hook to healthy (namespace host over SSH, 2 sim instances): {time.monotonic() - t0:.1f}s")

    r = inv("stop", "--host", "n1", inventory=inventory, env=HOOK)
    assert r.returncode == 0, r.stdout + r.stderr
    assert status_json(inventory, host="n1")["boot"] is None
    assert crontab() == before and tagged_pids(dep + "/") == []
    # Only the fixture's sshds are left in the namespace (an SSH session's own sshd ends as it closes).
    wait_until(lambda: set(namespace_pids(fleet)) <= set(fleet.pids), 10, what="only the sshds left")

