"""Remote hosts over SSH, against a real OpenSSH server on loopback: deploy, status and stop of sim
clusters; --check and --diff; many hosts with one unreachable; host keys; a cluster across hosts.

Each "host" is its own deploy_dir reached through the same sshd, with its own ports.
"""
from __future__ import annotations

import hashlib
import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, free_port, free_ports
from fleet_helpers import inv, stop_by_own_scripts, tagged_pids
from sshd import keygen, sshd  # noqa: F401  (the module-scoped fixture)

pytestmark = pytest.mark.ssh

SIM = {"load_s": 0.3, "prefill_ms": 5, "token_ms": 1, "output_tokens": 8}


def ssh_host(server, tmp_path: Path, name: str, instances: int = 2, **extra) -> dict:
    """An inventory host on the test sshd: a sim cluster in tmp_path/name with free ports."""
    base = free_ports(instances + 2)
    host = {"ssh": server.ssh_block(), "engine": "sim", "accelerator": "sim", "accelerators": instances,
            "instances": instances, "base_port": base, "model": "/models/Test-Model",
            "python": PYTHON, "deploy_dir": str(tmp_path / name), "stagger_s": 0, "health_timeout_s": 60,
            "stop_grace_s": 3, "sim": SIM,
            "proxy": {"port": base + instances, "admin_port": base + instances + 1, "health_interval_s": 0.3}}
    for key, value in extra.items():
        if key in ("proxy", "sim"):
            host[key] = {**host[key], **value}
        else:
            host[key] = value
    return host


def write(tmp_path: Path, hosts: dict, groups: dict | None = None) -> Path:
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"hosts": hosts, **({"groups": groups} if groups else {})}))
    return path


def recap(output: str, host: str) -> dict:
    m = re.search(rf"^{re.escape(host)} : ok=(\d+) changed=(\d+) skipped=(\d+) failed=(\d+) "
                  r"unreachable=(\d+)$", output, re.M)
    assert m, output
    return dict(zip(["ok", "changed", "skipped", "failed", "unreachable"], map(int, m.groups())))


def dep_id(inventory: Path, host: str) -> str:
    from fleet.settings import inventory as inv_mod
    return inv_mod.load(inventory).host_vars(host).deployment_id


def status(inventory: Path, host: str) -> dict:
    r = inv("status", "--host", host, "--json", inventory=inventory)
    return json.loads(r.stdout)[0]


def tree(d: Path) -> dict:
    """Every file under d with its content hash, mode and mtime; what the running processes themselves
    write (logs, the sim cards' usage files) only by name."""
    out = {}
    for p in sorted(d.rglob("*")) if d.exists() else []:
        rel = str(p.relative_to(d))
        if rel.split("/")[0] in ("logs", "sim-dev"):
            out[rel] = "present"
            continue
        st = p.lstat()
        out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir",
                    st.st_mode, st.st_mtime_ns)
    return out


def chat(port: int):
    body = json.dumps({"model": "Test-Model", "max_tokens": 4, "user": "ssh-test",
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.headers["X-Backend"]


@pytest.fixture
def cleanup():
    """Stop what the test deployed, then a sweep by tag (never by name): the hosts' files are this machine's,
    so each host's own stop script runs here, all at once (fleet_helpers.stop_by_own_scripts); `inv stop`
    over SSH is test_deploy_status_stop_over_ssh's own subject."""
    deployed: list[tuple[Path, str]] = []
    yield deployed
    by_inventory: dict[Path, list[str]] = {}
    for inventory, host in deployed:
        by_inventory.setdefault(inventory, []).append(host)
    for inventory, hosts in by_inventory.items():
        stop_by_own_scripts(inventory, hosts)


@pytest.mark.cluster
def test_deploy_status_stop_over_ssh(sshd, tmp_path, cleanup):
    """1. deploy a 2-instance sim cluster through SSH: files land in deploy_dir with their modes, the
    instances and the proxy (run by the host's python) come up; 2. a second deploy changes nothing;
    3. status reads it back; 4. a request goes through; 5. stop leaves no tagged process."""
    inventory = write(tmp_path, {"r1": ssh_host(sshd, tmp_path, "r1")})
    cleanup.append((inventory, "r1"))
    first = inv("deploy", "--host", "r1", inventory=inventory)
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"^instance 1: healthy on :\d+ after [\d.]+s$", first.stdout, re.M), first.stdout
    assert recap(first.stdout, "r1")["changed"] >= 5
    d = tmp_path / "r1"
    assert (d / "bin/start_cluster.sh").stat().st_mode & 0o777 == 0o755
    assert (d / "conf/proxy.yaml").stat().st_mode & 0o777 == 0o644
    assert (d / "proxy/__main__.py").exists() and (d / "lib/fleet/sim/server.py").exists()

    second = inv("deploy", "--host", "r1", inventory=inventory)
    assert second.returncode == 0, second.stdout + second.stderr
    assert recap(second.stdout, "r1")["changed"] == 0, second.stdout

    st = status(inventory, "r1")
    assert st["front"] == "proxy" and [i["state"] for i in st["instances"]] == ["healthy", "healthy"]
    proxy_pid = st["proxy"]["pid"]
    assert Path(f"/proc/{proxy_pid}/exe").resolve() == Path(PYTHON).resolve()
    code, backend = chat(st["proxy"]["port"])
    assert code == 200 and backend in {f"127.0.0.1:{i['port']}" for i in st["instances"]}

    # A file whose mode was changed on the host is put back with its mode, and only that file.
    (d / "bin/stop_cluster.sh").chmod(0o644)
    third = inv("deploy", "--host", "r1", inventory=inventory)
    assert third.returncode == 0 and recap(third.stdout, "r1")["changed"] == 1, third.stdout
    assert "put (mode 0644 -> 0755)" in third.stdout
    assert (d / "bin/stop_cluster.sh").stat().st_mode & 0o777 == 0o755

    dep = dep_id(inventory, "r1")
    assert len(tagged_pids(dep + "/")) >= 5
    stop = inv("stop", "--host", "r1", inventory=inventory)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert tagged_pids(dep + "/") == []
    assert {i["state"] for i in status(inventory, "r1")["instances"]} == {"stopped"}


@pytest.mark.cluster
def test_check_and_diff_change_nothing(sshd, tmp_path, cleanup):
    """1. deploy, then stop instance 1 and edit conf/proxy.yaml on the host; 2. deploy --check --diff
    with a changed setting: it lists the files it would put (with their diffs), the instance it would
    start and the one it would roll to the new setting, and the host's file tree and processes are exactly as before; 3. a host never deployed stays
    untouched by --check; 4. deploy --diff then puts the files back and shows the edited line."""
    inventory = write(tmp_path, {"c1": ssh_host(sshd, tmp_path, "c1"),
                                 "fresh": ssh_host(sshd, tmp_path, "fresh")})
    cleanup.append((inventory, "c1"))
    assert inv("deploy", "--host", "c1", inventory=inventory).returncode == 0
    assert inv("stop", "--host", "c1", "--instance", "1", inventory=inventory).returncode == 0
    d = tmp_path / "c1"
    conf = d / "conf/proxy.yaml"
    conf.write_text(conf.read_text() + "# edited by hand on the host\n")
    dep = dep_id(inventory, "c1")
    before_tree, before_procs = tree(d), sorted(tagged_pids(dep + "/"))

    r = inv("deploy", "--host", "c1,fresh", "--check", "--diff", "--set", "max_num_seqs=3",
            inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "c1 | changed: file bin/start_cluster.sh: would put (content changed)" in out
    assert "c1 | changed: file conf/proxy.yaml: would put (content changed)" in out
    assert re.search(r"^c1 \| changed: instance 1: would start on :\d+$", out, re.M), out
    # The running instance 0 was started with max_num_seqs 4: deploy would roll it to 3.
    assert re.search(r"^c1 \| changed: instance 0: would restart \(max_num_seqs 4 -> 3\)", out, re.M), out
    # Only its config changed: the running proxy would re-read it (the host agent's reload-proxy), not restart.
    assert re.search(r"^c1 \| changed: proxy: would reload pid \d+", out, re.M), out
    # The plan first, a line per change with its reason.
    plan = [ln.removeprefix("c1 | plan: ") for ln in out.splitlines() if ln.startswith("c1 | plan: ")]
    assert "put file bin/start_cluster.sh: content changed" in plan and "put file conf/proxy.yaml: content changed" \
        in plan, plan
    assert plan[-4:] == ["roll instance 0: max_num_seqs 4 -> 3", "start instance 1: stopped",
                         "reload proxy: slots 4 -> 3", "restart keeper: its code or configuration changed"], plan
    assert "c1 | --- c1:bin/start_cluster.sh" in out and "c1 | +++ rendered:bin/start_cluster.sh" in out
    assert re.search(r'^c1 \| -MAX_SEQS="\$\{MAX_SEQS:-4\}"$', out, re.M), out
    assert re.search(r'^c1 \| \+MAX_SEQS="\$\{MAX_SEQS:-3\}"$', out, re.M), out
    assert "c1 | -# edited by hand on the host" in out
    assert "fresh | --- /dev/null" in out and "fresh | changed: instance 0: would start" in out
    assert tree(d) == before_tree
    assert sorted(tagged_pids(dep + "/")) == before_procs
    assert not (tmp_path / "fresh").exists()
    assert tagged_pids(dep_id(inventory, "fresh") + "/") == []

    r = inv("deploy", "--host", "c1", "--diff", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-# edited by hand on the host" in r.stdout and "bin/start_cluster.sh" not in r.stdout
    assert "# edited" not in conf.read_text()
    assert [i["state"] for i in status(inventory, "c1")["instances"]] == ["healthy", "healthy"]


@pytest.mark.cluster
def test_one_host_unreachable_the_other_deploys(sshd, tmp_path, cleanup):
    """1. two hosts, the second's SSH port closed; 2. the first deploys, the second is reported
    unreachable in one sentence and its recap says so; 3. exit code 4."""
    closed = ssh_host(sshd, tmp_path, "down")
    closed["ssh"]["port"] = free_port()
    inventory = write(tmp_path, {"up": ssh_host(sshd, tmp_path, "up"), "down": closed},
                      groups={"pair": {"hosts": ["up", "down"]}})
    cleanup.append((inventory, "up"))
    r = inv("deploy", "--host", "pair", "--forks", "2", inventory=inventory)
    assert r.returncode == 4, r.stdout + r.stderr
    assert recap(r.stdout, "up")["failed"] == 0 and recap(r.stdout, "up")["unreachable"] == 0
    assert recap(r.stdout, "down")["unreachable"] == 1
    assert re.search(rf"^down: UNREACHABLE: down: cannot reach 127\.0\.0\.1:{closed['ssh']['port']} .*; "
                     "check the address and that sshd runs there\\.$", r.stderr, re.M), r.stderr
    assert "Traceback" not in r.stderr
    assert [i["state"] for i in status(inventory, "up")["instances"]] == ["healthy", "healthy"]


def test_host_keys(sshd, tmp_path):
    """1. a known_hosts holding another key for the server: refused as CHANGED (accept_new_host_key or
    not), exit 4, nothing written;
    2. no entry and no accept_new_host_key: refused, naming the way out; 3. accept_new_host_key records
    the key; 4. ~/.ssh/config is honoured: a Host alias gives HostName, Port, User, IdentityFile."""
    other = tmp_path / "other_key"
    other_pub = keygen(other)
    changed = tmp_path / "changed_known_hosts"
    changed.write_text(f"[127.0.0.1]:{sshd.port} {other_pub}\n")
    empty = tmp_path / "new_known_hosts"
    empty.write_text("# the user's own file: comments stay\n")
    hosts = {"changed": ssh_host(sshd, tmp_path, "changed", ssh={**sshd.ssh_block(), "known_hosts": str(changed),
                                                              "accept_new_host_key": True}),
             "unknown": ssh_host(sshd, tmp_path, "unknown", ssh={**sshd.ssh_block(), "known_hosts": str(empty)})}
    inventory = write(tmp_path, hosts)
    r = inv("status", "--host", "changed,unknown", inventory=inventory)
    assert r.returncode == 4, r.stdout + r.stderr
    assert re.search(rf"^changed: UNREACHABLE: changed: the SSH host key of 127\.0\.0\.1:{sshd.port} has "
                     "CHANGED since it was recorded in .*; refusing to connect\\.", r.stderr, re.M), r.stderr
    assert re.search(r"^unknown: UNREACHABLE: .* is not in .*new_known_hosts; ssh to it once .* or set "
                     r"ssh\.accept_new_host_key: true", r.stderr, re.M), r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "changed").exists()
    assert empty.read_text() == "# the user's own file: comments stay\n"
    assert changed.read_text() == f"[127.0.0.1]:{sshd.port} {other_pub}\n"

    hosts["unknown"]["ssh"]["accept_new_host_key"] = True
    write(tmp_path, hosts)
    r = inv("status", "--host", "unknown", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert empty.read_text() == ("# the user's own file: comments stay\n"
                                 f"[127.0.0.1]:{sshd.port} {' '.join(sshd.host_pub.split()[:2])}\n")
    r = inv("status", "--host", "unknown", inventory=inventory)     # recorded once, then simply known
    assert r.returncode == 0 and empty.read_text().count(sshd.host_pub.split()[1]) == 1

    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh/config").write_text(
        f"Host fleet-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  IdentityFile {sshd.key_file}\n  UserKnownHostsFile {sshd.known_hosts}\n")
    inventory = write(tmp_path, {"alias": ssh_host(sshd, tmp_path, "alias", ssh={"host": "fleet-alias"})})
    r = inv("status", "--host", "alias", "--json", inventory=inventory, env={"HOME": str(home)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)[0]["deploy_dir"] == str(tmp_path / "alias")


def test_missing_tools_fail_the_host_in_one_sentence(sshd, tmp_path):
    """A host whose PATH (after env_setup) has no ss, fuser, setsid or vllm, and whose python lacks
    aiohttp, fails before anything is written or started, naming each missing thing."""
    bare = tmp_path / "bin"
    bare.mkdir()
    python = bare / "python3"
    python.write_text(f"#!/bin/sh\nexec {PYTHON} -S \"$@\"\n")   # -S: no site-packages, so no aiohttp
    python.chmod(0o755)
    host = ssh_host(sshd, tmp_path, "bare", engine="vllm", accelerator="dcu", python=str(python),
                    env_setup=f"export PATH={bare}")
    inventory = write(tmp_path, {"bare": host})
    r = inv("deploy", "--host", "bare", inventory=inventory)
    assert r.returncode == 2, r.stdout + r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("bare: FAILED"))
    for what in ("ss (install iproute2)", "fuser (install psmisc)", "setsid (install util-linux)",
                 "the modules aiohttp, yaml, prometheus_client in", "the engine binary vllm"):
        assert what in line, line
    assert line.count(".") >= 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "bare").exists()


@pytest.mark.cluster
def test_entry_host_fronts_two_hosts(sshd, tmp_path, cleanup):
    """1. hosts a and b over SSH; a's proxy fronts both (fronts: [a, b]); 2. deploy --host all brings
    b's instances up, then a's with its proxy; 3. requests through a's entry port reach instances of
    both hosts (X-Backend); 4. the entry's status lists the four backends healthy."""
    b = ssh_host(sshd, tmp_path, "b")
    a = ssh_host(sshd, tmp_path, "a", fronts=["a", "b"])
    inventory = write(tmp_path, {"a": a, "b": b})
    cleanup.extend([(inventory, "a"), (inventory, "b")])
    r = inv("deploy", "--host", "all", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    # b (a member) was done before a (the entry) started anything.
    assert r.stdout.index("b | instance 1: healthy") < r.stdout.index("a | instance 0: started")
    want_a = {f"127.0.0.1:{a['base_port'] + i}" for i in range(2)}
    want_b = {f"127.0.0.1:{b['base_port'] + i}" for i in range(2)}
    port = a["proxy"]["port"]
    seen = {chat(port)[1] for _ in range(16)}
    assert seen & want_a and seen & want_b, seen
    st = status(inventory, "a")
    assert {x["name"] for x in st["proxy"]["backends"] if x["healthy"]} == want_a | want_b
    conf = yaml.safe_load((tmp_path / "a/conf/proxy.yaml").read_text())
    assert set(conf["backends"]) == want_a | want_b
    # 5. inv top on the entry host shows its whole fleet, each host sampled over SSH.
    r = inv("top", "--host", "a", "--once", inventory=inventory, process=True, env={"COLUMNS": "160"})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if re.match(r"[ab]/\d ", line)}
    assert sorted(rows) == ["a/0", "a/1", "b/0", "b/1"], r.stdout
    assert all(c[1] == "healthy" and re.fullmatch(r"\d+/\d+", c[2]) for c in rows.values()), r.stdout
    hosts = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines() if re.match(r"[ab] ", line)}
    assert hosts == {"a": "proxy", "b": "proxy"}, r.stdout    # b runs its own proxy beside a's
