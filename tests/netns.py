"""A test fleet in network namespaces: N "hosts", each a network namespace with its own address on a
private bridge and its own sshd, reached by the toolkit over SSH by address, as separate servers are.

What it makes, all of it named with one random token and removed at teardown, whatever the test did:

- a bridge `vfb<token>` in the host's network namespace, with 10.213.X.1/24 (X free on this machine), so
  the test process (the control node) reaches the hosts;
- per host i: a namespace `vfleet-<token>-<i>` holding `lo` and `eth0` (10.213.X.<10+i>/24), the peer of
  a veth `vfv<token><i>` on the bridge; and an sshd listening on 10.213.X.<10+i>:22 in that namespace,
  with its own host key, and one authorized client key for the whole fleet.

Nothing else of the machine is touched: no route but the bridge's own prefix, no firewall rule, no
other interface. Filesystem and processes are the machine's own (only the network is separate), so a
host's deploy_dir is a directory of the test's and its processes are visible to the test by pid.

Teardown: the processes the fixture started (the sshds, by their recorded pids, with their process
groups), then any process still inside one of the fleet's namespaces (nothing enters them but what the
test started there, so they are the test's; the test's own cleanup should have stopped them by tag
first), then the namespaces, the veths and the bridge. Root only: without root, `ip` or `sshd` the
tests skip with the reason (in CI, CI=true, they fail instead).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import require_tool
from sshd import Sshd, keygen, start_sshd, stop_sshd

SUBNET = "10.213"           # 10.213.X.0/24, X picked free on this machine
LOCK = Path("/run/vllm-fleet-netns.lock")   # two test runs never pick the same X at once


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


@dataclass
class NetnsHost:
    """One host of the fleet: its namespace, address and sshd."""

    index: int
    netns: str
    address: str
    veth: str            # the bridge's side of its link (the namespace's side is eth0)
    sshd: Sshd | None = None

    def exec_argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside the host's namespace."""
        return subprocess.run(self.exec_argv(*argv), capture_output=True, text=True, check=check)

    def link(self, up: bool) -> None:
        """Take the host's network link down (or up) from inside its namespace, as a failed NIC would."""
        self.run("ip", "link", "set", "eth0", "up" if up else "down")

    def listening(self) -> list[str]:
        """The TCP addresses listened on inside the namespace (`ss -ltnH`): `10.213.5.11:8002`..."""
        out = self.run("ss", "-ltnH").stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]


@dataclass
class NetnsFleet:
    """The fleet: its hosts, the client key and known_hosts that reach them, and what it started."""

    token: str
    prefix: str                   # "10.213.X"
    bridge: str
    directory: Path
    client_key: Path
    known_hosts: Path
    hosts: list[NetnsHost] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)   # every process the fixture started

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def gateway(self) -> str:
        """The control node's address on the bridge."""
        return f"{self.prefix}.1"

    def ssh_block(self, host: NetnsHost, **extra) -> dict:
        return {"host": host.address, "port": 22, "user": "root", "key_file": str(self.client_key),
                "known_hosts": str(self.known_hosts), "connect_timeout_s": 10, **extra}

    def stop_sshd(self, host: NetnsHost) -> None:
        """Stop the host's sshd (its port is then closed: a connection is refused)."""
        if host.sshd is not None:
            stop_sshd(host.sshd.proc)

    def start_sshd(self, host: NetnsHost) -> None:
        """Start the host's sshd (again), on the same address and port with a new host key."""
        host.sshd = start_sshd(self.directory / f"sshd-{host.index}", address=host.address, port=22,
                               client_key=self.client_key, wrap=host.exec_argv())
        self.procs.append(host.sshd.proc)
        self.known_hosts.write_text("".join(
            h.sshd.known_hosts.read_text() for h in self.hosts if h.sshd is not None))


def _pick_prefix() -> str:
    """A 10.213.X prefix that no address or route of this machine uses (called under LOCK)."""
    used = _ip("-o", "addr").stdout + _ip("route").stdout
    for x in secrets.SystemRandom().sample(range(1, 255), 254):
        prefix = f"{SUBNET}.{x}"
        if f" {prefix}." not in used and f"\n{prefix}." not in "\n" + used:
            return prefix
    raise RuntimeError(f"no free {SUBNET}.X.0/24 on this machine")


def _kill(pids) -> None:
    """SIGTERM, then SIGKILL, each pid (and the process group it leads) of the given ones."""
    pids = [p for p in pids if p > 1]
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        for pid in pids:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _cannot(reason: str) -> None:
    """Skip the test, saying why; in CI (CI=true), where the fleet must be made, fail it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI runs as root on a machine that can make network namespaces")
    pytest.skip(reason)


def require_netns() -> None:
    """Skip (fail in CI) unless this process can make network namespaces: root, `ip` and `sshd`."""
    if os.geteuid() != 0:
        _cannot("the network-namespace fleet needs root (it makes namespaces, a bridge and veths)")
    require_tool("ip")
    require_tool("sshd")
    require_tool("ss")


def build(directory: Path, n: int) -> NetnsFleet:
    """Make the bridge, n namespaces with their links and sshds. On any error, what was made is removed."""
    require_netns()
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(3)
    client_key = directory / "client_ed25519"
    keygen(client_key)
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    fleet = None
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            prefix = _pick_prefix()
            fleet = NetnsFleet(token, prefix, f"vfb{token}", directory, client_key, directory / "known_hosts")
            try:
                _ip("link", "add", fleet.bridge, "type", "bridge")
            except RuntimeError as e:     # root without CAP_NET_ADMIN (an unprivileged container)
                fleet = None
                _cannot(f"cannot make a bridge here ({e})")
            _ip("addr", "add", f"{fleet.gateway}/24", "dev", fleet.bridge)
            _ip("link", "set", fleet.bridge, "up")
        except BaseException:
            if fleet is not None:
                teardown(fleet)
            raise
    try:
        for i in range(n):
            host = NetnsHost(i, f"vfleet-{token}-{i}", f"{prefix}.{10 + i}", f"vfv{token}{i}")
            fleet.hosts.append(host)
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", f"vfp{token}{i}")
            _ip("link", "set", f"vfp{token}{i}", "netns", host.netns)
            _ip("link", "set", host.veth, "master", fleet.bridge)
            _ip("link", "set", host.veth, "up")
            ns = ["-n", host.netns]
            _ip(*ns, "link", "set", f"vfp{token}{i}", "name", "eth0")
            _ip(*ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip(*ns, "link", "set", "lo", "up")
            _ip(*ns, "link", "set", "eth0", "up")
        for host in fleet.hosts:
            fleet.start_sshd(host)
    except BaseException:
        teardown(fleet)
        raise
    return fleet


def namespace_pids(fleet: NetnsFleet) -> list[int]:
    """The processes inside the fleet's namespaces now."""
    pids: list[int] = []
    for host in fleet.hosts:
        r = _ip("netns", "pids", host.netns, check=False)
        pids += [int(p) for p in r.stdout.split() if p.isdigit()]
    return pids


def teardown(fleet: NetnsFleet) -> list[int]:
    """Remove everything the fleet made; return the pids that were still inside its namespaces after the
    fixture's own were stopped (the test's cleanup left them), which it then killed."""
    _kill(fleet.pids)
    for proc in fleet.procs:      # reap them: no zombie of this process is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    leftovers = namespace_pids(fleet)
    _kill(leftovers)
    for host in fleet.hosts:
        _ip("link", "del", host.veth, check=False)   # takes its peer (eth0 in the namespace) with it
        _ip("netns", "del", host.netns, check=False)
    _ip("link", "del", fleet.bridge, check=False)
    return leftovers


def made_by(fleet: NetnsFleet) -> list[str]:
    """What of the fleet still exists on the machine (empty after teardown): links, namespaces."""
    links = _ip("-o", "link").stdout
    netns = _ip("netns", "list").stdout
    return ([name for name in [fleet.bridge, *(h.veth for h in fleet.hosts)] if f" {name}:" in links
             or f" {name}@" in links]
            + [h.netns for h in fleet.hosts if h.netns in netns.split()])


@pytest.fixture
def netns_fleet(tmp_path_factory, request):
    """A factory: netns_fleet(n) builds a fleet of n hosts (once per test); it is torn down at the end of
    the test, pass or fail (a finalizer, so also when the test's body or another fixture raised)."""
    made: list[NetnsFleet] = []

    def make(n: int) -> NetnsFleet:
        fleet = build(tmp_path_factory.mktemp("netns"), n)
        made.append(fleet)
        return fleet

    def finish():
        for fleet in made:
            leftovers = teardown(fleet)
            if leftovers:
                print(f"netns fleet {fleet.token}: killed {len(leftovers)} processes the test left "
                      f"in its namespaces: {leftovers}")
    request.addfinalizer(finish)
    return make


__all__ = ["NetnsFleet", "NetnsHost", "build", "made_by", "netns_fleet", "require_netns", "teardown"]
