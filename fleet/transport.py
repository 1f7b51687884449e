"""Transport: run commands and move files on a host, the same way for local and SSH hosts.

Lifecycle code takes a Transport and never asks which kind it has.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable

from .errors import RemoteError, UnreachableError


@dataclass
class Result:
    """What a command left behind."""

    exited: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exited == 0


class Transport:
    """One host: run a command, put a file with its mode, read a file, test existence."""

    host: str

    def run(self, command: str, *, stdin: str | None = None, timeout: float | None = None,
            on_line: Callable[[str], None] | None = None) -> Result:
        """Run a bash command line; on_line gets each line of standard output as it arrives."""
        raise NotImplementedError

    def put(self, path: str, content: bytes, mode: int) -> None:
        """Write a whole file atomically (temporary file, then rename), with its mode."""
        raise NotImplementedError

    def read(self, path: str) -> bytes | None:
        """The file's content, or None when it does not exist."""
        raise NotImplementedError

    def home(self) -> str:
        """The home directory of the user the commands run as."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        return self.run(f"test -e {shlex.quote(path)}").ok

    def close(self) -> None:
        pass


class LocalTransport(Transport):
    """This machine, as the current user."""

    def __init__(self, host: str = "local"):
        self.host = host

    def run(self, command, *, stdin=None, timeout=None, on_line=None) -> Result:
        # The deploying process's own FLEET_TAG (if any) must not leak into what it starts.
        env = {k: v for k, v in os.environ.items() if k != "FLEET_TAG"}
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE if stdin is not None else
                                subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        if on_line is None:
            try:
                out, err = proc.communicate(stdin, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise RemoteError(f"{self.host}: command timed out after {timeout}s: {command[:80]}")
            return Result(proc.returncode, out, err)
        if stdin is not None:
            proc.stdin.write(stdin)
            proc.stdin.close()
        lines = []
        for line in proc.stdout:
            lines.append(line)
            on_line(line.rstrip("\n"))
        err = proc.stderr.read()
        proc.wait()
        return Result(proc.returncode, "".join(lines), err)

    def put(self, path, content, mode) -> None:
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".fleet-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(content)
                os.chmod(tmp, mode)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            raise RemoteError(f"{self.host}: cannot write {path} ({e.strerror}); "
                              "check deploy_dir and its permissions.") from None

    def read(self, path) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RemoteError(f"{self.host}: cannot read {path} ({e.strerror}).") from None

    def home(self) -> str:
        return os.path.expanduser("~")


class SSHTransport(Transport):
    """A host reached over SSH with Fabric; ~/.ssh/config is honoured, host keys are checked."""

    def __init__(self, host: str, ssh: dict):
        self.host = host
        self.ssh = ssh
        self._conn = None

    @property
    def conn(self):
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def _connect(self):
        import paramiko
        from fabric import Config, Connection

        kwargs = {"timeout": float(self.ssh.get("connect_timeout_s") or 10)}
        if self.ssh.get("key_file"):
            kwargs["key_filename"] = os.path.expanduser(self.ssh["key_file"])
        config = Config(overrides={"load_ssh_configs": True})
        conn = Connection(self.ssh["host"], user=self.ssh.get("user"), port=self.ssh.get("port"),
                          connect_kwargs=kwargs, config=config)
        client = conn.client
        client.load_system_host_keys()
        known = os.path.expanduser("~/.ssh/known_hosts")
        if os.path.exists(known):
            client.load_host_keys(known)
        # A new host key is accepted only when the inventory says so; a changed one never.
        client.set_missing_host_key_policy(
            paramiko.AutoAddPolicy() if self.ssh.get("accept_new_host_key") else paramiko.RejectPolicy())
        try:
            conn.open()
        except paramiko.BadHostKeyException:
            raise UnreachableError(
                f"{self.host}: the SSH host key of {self.ssh['host']} has CHANGED since it was recorded in "
                "known_hosts; if the host was reinstalled, remove the old key with ssh-keygen -R and retry."
            ) from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise UnreachableError(
                    f"{self.host}: {self.ssh['host']} is not in known_hosts; ssh to it once to check and "
                    "record its key, or set ssh.accept_new_host_key: true in the inventory.") from None
            raise UnreachableError(f"{self.host}: SSH to {self.ssh['host']} failed ({e}).") from None
        except OSError as e:
            raise UnreachableError(f"{self.host}: cannot reach {self.ssh['host']}:{self.ssh.get('port') or 22} "
                                   f"({e.strerror or e}); check the address and that sshd runs.") from None
        if self.ssh.get("accept_new_host_key") and os.path.isdir(os.path.dirname(known)):
            try:
                client.save_host_keys(known)
            except OSError:
                pass
        return conn

    def run(self, command, *, stdin=None, timeout=None, on_line=None) -> Result:
        import io

        class Lines(io.StringIO):
            def __init__(self, cb):
                super().__init__()
                self.cb, self.buf = cb, ""

            def write(self, s):
                self.buf += s
                while "\n" in self.buf:
                    line, self.buf = self.buf.split("\n", 1)
                    self.cb(line)
                return super().write(s)

        out = Lines(on_line) if on_line else io.StringIO()
        err = io.StringIO()
        try:
            r = self.conn.run(f"bash -c {shlex.quote(command)}", warn=True, hide=True, timeout=timeout,
                              in_stream=io.StringIO(stdin) if stdin is not None else False,
                              out_stream=out, err_stream=err)
        except UnreachableError:
            raise
        except Exception as e:  # invoke's CommandTimedOut, paramiko's transport errors
            raise RemoteError(f"{self.host}: command failed over SSH ({type(e).__name__}: {e}).") from None
        return Result(r.exited, out.getvalue(), err.getvalue())

    def put(self, path, content, mode) -> None:
        import io
        directory = os.path.dirname(path)
        self.run(f"mkdir -p {shlex.quote(directory)}")
        tmp = f"{directory}/.fleet-{os.getpid()}-{os.path.basename(path)}"
        try:
            sftp = self.conn.sftp()
            sftp.putfo(io.BytesIO(content), tmp)
            sftp.chmod(tmp, mode)
            sftp.posix_rename(tmp, path)
        except OSError as e:
            self.run(f"rm -f {shlex.quote(tmp)}")
            raise RemoteError(f"{self.host}: cannot write {path} ({e}); check deploy_dir and its permissions.") \
                from None

    def read(self, path) -> bytes | None:
        import io
        buf = io.BytesIO()
        try:
            self.conn.sftp().getfo(path, buf)
        except FileNotFoundError:
            return None
        except OSError as e:
            if getattr(e, "errno", None) == 2:
                return None
            raise RemoteError(f"{self.host}: cannot read {path} ({e}).") from None
        return buf.getvalue()

    def home(self) -> str:
        r = self.run('printf %s "$HOME"')
        if not r.ok or not r.stdout.startswith("/"):
            raise RemoteError(f"{self.host}: cannot find the remote home directory.")
        return r.stdout

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def connect(hv) -> Transport:
    """The transport the inventory asks for."""
    if hv["connection"] == "ssh":
        return SSHTransport(hv.name, hv["ssh"])
    return LocalTransport(hv.name)
