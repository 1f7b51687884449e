"""Transport: run commands and move files on a host, the same way for local and SSH hosts.

Lifecycle code takes a Transport and never asks which kind it has.
"""
from __future__ import annotations

import logging
import os
import queue
import shlex
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

from fleet.errors import InterruptedRun, RemoteError, UnreachableError
from fleet.settings.schema import SSHSettings


class Interrupt:
    """Ctrl-C, as every transport of this process sees it. Level 1: no new command starts on any host
    (a command under way finishes, so no step is cut in the middle); level 2: the commands under way are
    cut too (a local child is killed by its pid, an SSH channel is closed), for a read-only run or a
    second Ctrl-C. The run lock's holder is never cut here: it ends when its run lets it go."""

    def __init__(self):
        self.level = 0
        self._lock = threading.Lock()
        self._procs: set = set()

    def check(self, host: str, level: int = 1) -> None:
        """Raise InterruptedRun when the run was interrupted at this level or above."""
        if self.level >= level:
            raise InterruptedRun(f"{host}: interrupted (Ctrl-C)")

    def raise_to(self, level: int) -> None:
        with self._lock:
            self.level = max(self.level, level)
            procs = list(self._procs) if self.level >= 2 else []
        for proc in procs:
            try:
                proc.kill()      # our own child, by its pid (Popen does nothing once it was reaped)
            except OSError:
                pass

    def track(self, proc) -> None:
        with self._lock:
            self._procs.add(proc)
            cut = self.level >= 2
        if cut:
            proc.kill()

    def untrack(self, proc) -> None:
        with self._lock:
            self._procs.discard(proc)


INTERRUPT = Interrupt()


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
    """One host: run a command, put a file with its mode, read a file, test existence.

    round_trips counts the exchanges with the host (a command run or started, a file put or read): what a
    command costs per host, which the tests hold to (tests/test_round_trips.py)."""

    host: str
    round_trips: int = 0

    def _trip(self) -> None:
        self.round_trips += 1

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

    def start(self, command: str) -> "Running":
        """Start a bash command line whose standard input stays open until Running.close(): for a
        process on the host that must live exactly as long as this run (the run lock's holder)."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        return self.run(f"test -e {shlex.quote(path)}").ok

    def close(self) -> None:
        pass


class Running:
    """A command started by Transport.start: its output lines as they come, and close()."""

    def __init__(self, host: str, lines, close_input, wait, stderr):
        self.host = host
        self._lines: queue.Queue = queue.Queue()
        self._close_input, self._wait, self._stderr = close_input, wait, stderr
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()

    def _pump(self, lines) -> None:
        try:
            for line in lines:
                self._lines.put(line.rstrip("\n") if isinstance(line, str) else
                                line.decode("utf-8", "replace").rstrip("\n"))
        except (OSError, ValueError, EOFError):
            pass
        self._lines.put(None)

    def readline(self, timeout: float | None = None) -> str | None:
        """The next line of standard output; None once the command's output has ended. Ctrl-C ends the
        wait (InterruptedRun)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            INTERRUPT.check(self.host)
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if left <= 0:
                raise RemoteError(f"{self.host}: no answer within {timeout:g}s from a command on the host.")
            try:
                return self._lines.get(timeout=left)
            except queue.Empty:
                continue

    def stderr(self) -> str:
        return self._stderr()

    def close(self, timeout: float = 10) -> int | None:
        """Close its standard input and wait for it to end; its exit status (None if unknown)."""
        try:
            self._close_input()
        except (OSError, ValueError, EOFError):
            pass
        return self._wait(timeout)


class LocalTransport(Transport):
    """This machine, as the current user."""

    def __init__(self, host: str = "local"):
        self.host = host

    def run(self, command, *, stdin=None, timeout=None, on_line=None) -> Result:
        self._trip()
        INTERRUPT.check(self.host)
        # The deploying process's own FLEET_TAG (if any) must not leak into what it starts.
        env = {k: v for k, v in os.environ.items() if k != "FLEET_TAG"}
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE if stdin is not None else
                                subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        INTERRUPT.track(proc)
        try:
            result = self._finish(proc, command, stdin, timeout, on_line)
        finally:
            INTERRUPT.untrack(proc)
        INTERRUPT.check(self.host, level=2)   # a command cut by Ctrl-C: its output means nothing
        return result

    def _finish(self, proc, command, stdin, timeout, on_line) -> Result:
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

    def start(self, command) -> Running:
        self._trip()
        INTERRUPT.check(self.host)
        env = {k: v for k, v in os.environ.items() if k != "FLEET_TAG"}
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

        def wait(timeout):
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()
        return Running(self.host, proc.stdout, proc.stdin.close, wait,
                       lambda: proc.stderr.read() if proc.poll() is not None else "")

    def put(self, path, content, mode) -> None:
        self._trip()
        INTERRUPT.check(self.host)
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
        self._trip()
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
    """A host reached over SSH: Fabric opens the connection (~/.ssh/config honoured: HostName, Port,
    User, IdentityFile, ProxyJump, UserKnownHostsFile), commands run on plain paramiko channels.

    Host keys are checked against known_hosts (ssh.known_hosts, else ~/.ssh/known_hosts); an unknown
    key is accepted and recorded only with ssh.accept_new_host_key; a changed key is always refused.
    """

    def __init__(self, host: str, ssh: SSHSettings):
        self.host = host
        self.ssh = ssh
        self._conn = None

    @property
    def conn(self):
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    @property
    def address(self) -> str:
        return f"{self.ssh.host}:{self.ssh.port or 22}"

    def _known_hosts(self, conn) -> str:
        """The known_hosts file to check against and record into."""
        if self.ssh.known_hosts:
            return os.path.expanduser(self.ssh.known_hosts)
        configured = (conn.ssh_config.get("userknownhostsfile") or "").split()
        return os.path.expanduser(configured[0] if configured else "~/.ssh/known_hosts")

    def _connect(self):
        import paramiko
        from fabric import Config, Connection

        _silence_paramiko()
        kwargs = {}
        if self.ssh.key_file:
            key = os.path.expanduser(self.ssh.key_file)
            if not os.path.isfile(key):
                raise UnreachableError(f"{self.host}: ssh.key_file {key} does not exist; fix the path in "
                                       "the inventory.")
            kwargs["key_filename"] = key
        conn = Connection(self.ssh.host, user=self.ssh.user, port=self.ssh.port,
                          connect_timeout=int(max(1, float(self.ssh.connect_timeout_s or 10))),
                          connect_kwargs=kwargs, config=Config(overrides={"load_ssh_configs": True}))
        client = conn.client
        known = self._known_hosts(conn)
        client.load_system_host_keys()
        if os.path.exists(known):
            try:
                client.load_host_keys(known)
            except (OSError, paramiko.SSHException) as e:
                raise UnreachableError(f"{self.host}: cannot read {known} ({e}); fix or remove it.") from None
        # A new host key is accepted only when the inventory says so; a changed one never (paramiko
        # raises BadHostKeyException before it asks the policy).
        accept = bool(self.ssh.accept_new_host_key)
        recorder = _RecordNewKey()
        client.set_missing_host_key_policy(recorder if accept else paramiko.RejectPolicy())
        where = f"{conn.host}:{conn.port}"
        try:
            conn.open()
        except paramiko.BadHostKeyException:
            raise UnreachableError(
                f"{self.host}: the SSH host key of {where} has CHANGED since it was recorded in {known}; "
                f"refusing to connect. If the host was reinstalled, remove the old key (ssh-keygen -f {known} "
                f"-R '[{conn.host}]:{conn.port}') and retry; otherwise someone may be in the middle.") from None
        except paramiko.AuthenticationException as e:
            raise UnreachableError(f"{self.host}: SSH login as {conn.user} to {where} was refused ({e}); "
                                   "check ssh.user and ssh.key_file.") from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise UnreachableError(
                    f"{self.host}: the SSH host key of {where} is not in {known}; ssh to it once to check and "
                    "record its key, or set ssh.accept_new_host_key: true in the inventory.") from None
            raise UnreachableError(f"{self.host}: SSH to {where} failed ({e}).") from None
        except OSError as e:
            raise UnreachableError(f"{self.host}: cannot reach {where} ({e.strerror or e}); check the address "
                                   "and that sshd runs there.") from None
        if recorder.line:
            # Appended, never rewritten: the user's file keeps its comments, markers and hashed names.
            try:
                os.makedirs(os.path.dirname(known) or ".", mode=0o700, exist_ok=True)
                with open(known, "a") as f:
                    f.write(recorder.line)
            except OSError as e:
                raise RemoteError(f"{self.host}: cannot record the host key in {known} ({e.strerror}).") \
                    from None
        return conn

    def run(self, command, *, stdin=None, timeout=None, on_line=None) -> Result:
        import select

        import paramiko

        self._trip()
        INTERRUPT.check(self.host)
        transport = self.conn.transport
        try:
            chan = transport.open_session(timeout=30)
            chan.exec_command(f"bash -c {shlex.quote(command)}")
            if stdin is not None:
                chan.sendall(stdin.encode())
            chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise RemoteError(f"{self.host}: lost the SSH connection to {self.address} ({e}).") from None
        out, err, pending = bytearray(), bytearray(), b""
        deadline = None if timeout is None else time.monotonic() + timeout
        exited_at = None
        try:
            while True:
                INTERRUPT.check(self.host, level=2)   # Ctrl-C cuts the command: its channel closes below
                select.select([chan], [], [], 0.02)
                while chan.recv_ready():
                    data = chan.recv(65536)
                    out += data
                    if on_line:
                        pending += data
                        *lines, pending = pending.split(b"\n")
                        for line in lines:
                            on_line(line.decode("utf-8", "replace"))
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                if chan.exit_status_ready():
                    exited_at = exited_at or time.monotonic()
                    # Output may trail the exit status; a background child holding stdout may never
                    # send EOF, so wait for it briefly only.
                    if (chan.eof_received or time.monotonic() - exited_at > 2) and not chan.recv_ready() \
                            and not chan.recv_stderr_ready():
                        break
                elif not transport.is_active():
                    raise RemoteError(f"{self.host}: lost the SSH connection to {self.address} while running "
                                      f"{command[:80]}.")
                if deadline is not None and time.monotonic() > deadline:
                    raise RemoteError(f"{self.host}: command timed out after {timeout}s: {command[:80]}")
            if on_line and pending:
                on_line(pending.decode("utf-8", "replace"))
            return Result(chan.recv_exit_status(), out.decode("utf-8", "replace"),
                          err.decode("utf-8", "replace"))
        finally:
            chan.close()

    def start(self, command) -> Running:
        import paramiko
        self._trip()
        INTERRUPT.check(self.host)
        try:
            chan = self.conn.transport.open_session(timeout=30)
            chan.exec_command(f"bash -c {shlex.quote(command)}")
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise RemoteError(f"{self.host}: lost the SSH connection to {self.address} ({e}).") from None

        def wait(timeout):
            deadline = time.monotonic() + timeout
            while not chan.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.02)
            status = chan.recv_exit_status() if chan.exit_status_ready() else None
            chan.close()
            return status

        def stderr():
            return chan.recv_stderr(65536).decode("utf-8", "replace") if chan.recv_stderr_ready() else ""
        return Running(self.host, chan.makefile("r"), chan.shutdown_write, wait, stderr)

    def _sftp(self):
        import paramiko
        try:
            return self.conn.sftp()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise RemoteError(f"{self.host}: the SFTP subsystem of {self.address} is not available ({e}); "
                              "enable it in the host's sshd_config (Subsystem sftp).") from None

    def put(self, path, content, mode) -> None:
        import io

        import paramiko
        self._trip()
        INTERRUPT.check(self.host)
        directory = os.path.dirname(path)
        tmp = f"{directory}/.fleet-{os.getpid()}-{os.path.basename(path)}"
        sftp = self._sftp()
        try:
            try:
                sftp.putfo(io.BytesIO(content), tmp)
            except FileNotFoundError:      # the directory is new: create it and its parents
                self._makedirs(sftp, directory)
                sftp.putfo(io.BytesIO(content), tmp)
            sftp.chmod(tmp, mode)
            sftp.posix_rename(tmp, path)
        except (OSError, paramiko.SSHException) as e:
            self.run(f"rm -f {shlex.quote(tmp)}")
            raise RemoteError(f"{self.host}: cannot write {path} ({e}); check deploy_dir and its permissions.") \
                from None

    @staticmethod
    def _makedirs(sftp, directory: str) -> None:
        """mkdir -p over SFTP (no shell round trip)."""
        missing = []
        while directory not in ("", "/"):
            try:
                sftp.stat(directory)
                break
            except FileNotFoundError:
                missing.append(directory)
                directory = os.path.dirname(directory)
        for d in reversed(missing):
            sftp.mkdir(d)

    def read(self, path) -> bytes | None:
        import io

        import paramiko
        self._trip()
        buf = io.BytesIO()
        try:
            self._sftp().getfo(path, buf)
        except FileNotFoundError:
            return None
        except (OSError, paramiko.SSHException) as e:
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
            self._conn = None


class _RecordNewKey:
    """Missing-host-key policy for ssh.accept_new_host_key: accept an unknown key and remember its
    known_hosts line (paramiko only gets here when no key at all is recorded for the host)."""

    line = ""

    def missing_host_key(self, client, hostname, key):
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.line = f"{hostname} {key.get_name()} {key.get_base64()}\n"


def _silence_paramiko() -> None:
    """Keep paramiko's own log off the terminal. Its transport thread logs a failed banner read (a port
    that is not sshd, a closed connection) as an ERROR with two tracebacks, which Python's last-resort
    handler prints on stderr; the exception it then raises is what the user is told, in one line."""
    log = logging.getLogger("paramiko")
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())
    log.propagate = False


def connect(hv) -> Transport:
    """The transport the inventory asks for."""
    if hv.settings.connection == "ssh":
        return SSHTransport(hv.name, hv.settings.ssh)
    return LocalTransport(hv.name)
