"""A real OpenSSH server on 127.0.0.1 for the SSH tests: its own host key, one authorized client key,
a known_hosts file that trusts it, running as the current user (root in CI) and stopped by pid."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import free_port, require_tool


@dataclass
class Sshd:
    """What a test needs to reach the server: address, port, user, client key and known_hosts."""

    host: str
    port: int
    user: str
    key_file: Path
    known_hosts: Path
    host_pub: str          # the server's public key line, "ssh-ed25519 AAAA..."
    log: Path
    proc: subprocess.Popen

    def ssh_block(self, **extra) -> dict:
        """The inventory's ssh block for this server."""
        return {"host": self.host, "port": self.port, "user": self.user, "key_file": str(self.key_file),
                "known_hosts": str(self.known_hosts), "connect_timeout_s": 10, **extra}


def keygen(path: Path) -> str:
    """Make an ed25519 key pair without passphrase at path; return the public key line."""
    subprocess.run([require_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", "fleet-test",
                    "-f", str(path)], check=True, capture_output=True)
    return path.with_suffix(".pub").read_text().strip()


def _answers_ssh(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.settimeout(2)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def start_sshd(directory: Path, address: str = "127.0.0.1", port: int | None = None,
               client_key: Path | None = None, wrap: list[str] | None = None) -> Sshd:
    """Start `sshd -D -e -f CONFIG` with everything under directory: on a free loopback port by default;
    address and port: where it listens instead; client_key: an authorized key pair already made (else one
    is made in directory); wrap: an argv prefix it runs under (`ip netns exec NS`)."""
    sshd = require_tool("sshd")
    require_tool("ssh-keygen")
    directory.mkdir(parents=True, exist_ok=True)
    host_key = directory / "host_ed25519"
    host_pub = keygen(host_key)
    if client_key is None:
        client_key = directory / "client_ed25519"
        keygen(client_key)
    (directory / "authorized_keys").write_text(client_key.with_suffix(".pub").read_text().strip() + "\n")
    if os.geteuid() == 0:
        # sshd started by root insists on its privilege-separation directory.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
    fixed = port
    for _ in range(5):           # the port is free when picked; another process may take it first
        port = fixed or free_port()
        config = directory / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {address}:{port}",
            f"HostKey {host_key}",
            f"PidFile {directory / 'sshd.pid'}",
            f"AuthorizedKeysFile {directory / 'authorized_keys'}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",
            "PermitUserEnvironment no",
            "MaxStartups 50:30:100",
            "MaxSessions 50",
            "LogLevel ERROR",
            "Subsystem sftp internal-sftp",
            # The hosts' sessions skip the user's ~/.bashrc, as a server's does with Debian's default one
            # (it returns at once when not interactive). bash sources it for a command sent over SSH only
            # when it is the top-level shell; SHLVL=1 makes the session's bash the second level. On this
            # machine root's ~/.bashrc runs `pyenv init` (about 0.1 s of CPU per command) and puts pyenv's
            # shims first on the PATH (every python3 a host agent run starts, another 0.1 s): 27 of the
            # 48 CPU seconds of a five-host deploy-and-stop test (docs/testing.md).
            "SetEnv SHLVL=1",
        ]) + "\n")
        log = directory / "sshd.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([*(wrap or []), sshd, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline and not _answers_ssh(port, address):
            time.sleep(0.05)
        if proc.poll() is None and _answers_ssh(port, address):
            known = directory / "known_hosts"
            known.write_text(f"{address if port == 22 else f'[{address}]:{port}'} {host_pub}\n")
            return Sshd(address, port, user, client_key, known, host_pub, log, proc)
        stop_sshd(proc)
        if fixed:
            break
    pytest.fail(f"sshd did not start; its log:\n{log.read_text()[-2000:]}")


def stop_sshd(proc: subprocess.Popen) -> None:
    """Stop the server by its pid (its session children with it), SIGKILL after a grace period."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """One sshd for the module's tests."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        stop_sshd(server.proc)
