"""One run at a time per deployment: an exclusive flock on `deploy_dir/run/fleet.lock`, on the host.

deploy, stop, restart and both swaps hold it for the whole run; the keeper (on the host) tries it and
does nothing while a run holds it. The holder writes who it is into the file (pid, what, since), so a
second run can name it. The kernel drops a flock when its holder dies: a lock left by a dead run is
simply taken, never obeyed forever.

From the control node the lock is held by a small process on the host (`hold`, started through the
transport) that keeps it while its standard input stays open: when the run ends, or dies, or its SSH
connection drops, the input closes and the lock goes with the process.

    python3 lock.py hold DEPLOY_DIR --what "inv deploy" [--wait]
prints `FLEET_LOCK {"state": "locked" | "held" | "waiting", "holder": {...}}` lines, then holds the lock
until its standard input closes. Standard library only, Python 3.6+, runs alone (its one import, `layout`,
bundled in front of it by fleet.transport.hostcode, or found beside it).

On the host, in Python:
    held = try_hold(deploy_dir, "keeper")     # None while a run holds it
    if held:
        with held: ...
"""
import errno
import fcntl
import json
import os
import signal
import sys
import time

from hostagent import layout  # in the package, or bundled in front by fleet.transport.hostcode


def lock_path(deploy_dir):
    return layout.path(deploy_dir, layout.LOCK)


class Held(object):
    """The lock, held by this process until release() (or the end of a `with` block, or exit)."""

    def __init__(self, fd, path):
        self.fd, self.path = fd, path

    def release(self):
        if self.fd is not None:
            os.close(self.fd)          # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _open(deploy_dir):
    path = lock_path(deploy_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # O_CLOEXEC (Python's default): a process started while the lock is held never inherits it.
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), path


def _record(fd, what):
    """Write the holder's identity into the locked file (only the holder writes it)."""
    info = {"pid": os.getpid(), "what": what, "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "since_epoch": round(time.time(), 3)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return info


def _try(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def try_hold(deploy_dir, what="keeper"):
    """Take the lock now, or return None at once when another process holds it."""
    fd, path = _open(deploy_dir)
    if not _try(fd):
        os.close(fd)
        return None
    _record(fd, what)
    return Held(fd, path)


def hold(deploy_dir, what, wait=False, on_wait=None, poll_s=0.05):
    """Take the lock; when held by another: None at once, or (wait) block until it is free.
    on_wait(holder) is called once when the wait begins."""
    fd, path = _open(deploy_dir)
    if _try(fd):
        _record(fd, what)
        return Held(fd, path)
    if not wait:
        os.close(fd)
        return None
    if on_wait:
        on_wait(holder(deploy_dir))
    fcntl.flock(fd, fcntl.LOCK_EX)     # blocks; the kernel hands it over when the holder ends
    _record(fd, what)
    return Held(fd, path)


def holder(deploy_dir):
    """Who holds the lock now ({"pid", "what", "since"}), or None when nobody does."""
    path = lock_path(deploy_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _try(fd):                   # free: whatever the file says is a past run's
            return None
        for _ in range(20):            # the new holder writes its line right after taking the lock
            try:
                text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
                info = json.loads(text)
                if isinstance(info, dict):
                    return info
            except ValueError:
                pass
            time.sleep(0.01)
        return {"pid": None, "what": "unknown", "since": "unknown"}
    finally:
        os.close(fd)


def describe(info):
    """`inv deploy (pid 123) since 2026-12-03 12:01:02 UTC`."""
    if not info:
        return "another run"
    pid = " (pid %s)" % info["pid"] if info.get("pid") else ""
    return "%s%s since %s" % (info.get("what") or "another run", pid, info.get("since") or "unknown")


def _say(state, info):
    print("FLEET_LOCK " + json.dumps({"state": state, "holder": info}), flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 2 or argv[0] != "hold":
        print("usage: lock.py hold DEPLOY_DIR --what WHAT [--wait]", file=sys.stderr)
        return 64
    deploy_dir, rest = argv[1], argv[2:]
    # A Ctrl-C at the operator's terminal reaches this holder too when the run is local: it ends when its
    # run closes its input (the run decides when the lock goes), never on the run's own interrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wait = "--wait" in rest
    what = rest[rest.index("--what") + 1] if "--what" in rest[:-1] else "a run"
    try:
        held = hold(deploy_dir, what, wait, on_wait=lambda info: _say("waiting", info))
    except OSError as e:
        print("cannot lock %s (%s)" % (lock_path(deploy_dir), e.strerror or e), file=sys.stderr)
        return 2
    if held is None:
        _say("held", holder(deploy_dir))
        return 1
    _say("locked", {"pid": os.getpid(), "what": what})
    # Hold until the run closes our standard input (or dies, and the pipe or the SSH channel closes).
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    held.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
