"""The engine log's writer: an instance's standard output and error, piped in, written to
logs/vllm_<i>.log and rotated by size while the engine runs (`engine_log.max_mb` x `engine_log.backups`).

    python -m hostagent.logwriter PATH --max-bytes B --backups K [--rotate-first]

It reads what comes through the pipe and writes it at once (so `inv logs --follow` sees each line as the
engine prints it), and rotates after a write that brought the file to B bytes or more: PATH.K-1 -> PATH.K
... PATH -> PATH.1, then a new PATH. Every byte read is written before a rotation, so nothing is lost; a
file ends at a read's end, and the engine writes whole lines. --rotate-first keeps the previous run's log
as PATH.1 when the instance starts. It exits when the pipe closes: when the engine and every child that
holds its output are gone. Until then it ignores SIGTERM, SIGINT and SIGHUP, so it records the engine's
last words during a stop (a writer gone first would kill the engine with SIGPIPE at its next line). A
write that fails (a full disk) drops that data, says so once on the next good write, and goes on.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from hostagent import logfiles

CHUNK = 65536


def rotate(path: str, backups: int) -> None:
    """PATH.K-1 -> PATH.K ... PATH.1 -> PATH.2, PATH -> PATH.1 (the oldest beyond K is overwritten)."""
    for k in range(backups - 1, 0, -1):
        if os.path.exists("%s.%d" % (path, k)):
            os.replace("%s.%d" % (path, k), "%s.%d" % (path, k + 1))
    if os.path.exists(path):
        os.replace(path, path + ".1")


def _open(path: str) -> int:
    return logfiles.open_fd(path)         # 0600: the engine's output is the deployment user's alone


def run(source: int, path: str, max_bytes: int, backups: int, rotate_first: bool = False) -> None:
    """Copy source to path until end of file, rotating by size."""
    notes = logfiles.tighten(path, backups)
    if rotate_first and os.path.exists(path) and os.path.getsize(path) > 0:
        rotate(path, backups)
    fd = _open(path)
    for note in notes:
        os.write(fd, ("[hostagent.logwriter: %s]\n" % note).encode())
    size = os.fstat(fd).st_size
    dropped = 0
    while True:
        try:
            data = os.read(source, CHUNK)
        except InterruptedError:
            continue
        if not data:
            break
        try:
            if dropped:
                note = ("[hostagent.logwriter: %d bytes of output lost: the log could not be written]\n"
                        % dropped).encode()
                os.write(fd, note)
                size += len(note)
                dropped = 0
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            size += len(data)
            if size >= max_bytes:
                os.close(fd)
                rotate(path, backups)
                fd = _open(path)
                size = 0
        except OSError:
            dropped += len(data)
            try:                  # the file may be gone (deploy_dir cleaned): open it again next time
                os.close(fd)
            except OSError:
                pass
            try:
                fd = _open(path)
                size = os.fstat(fd).st_size
            except OSError:
                pass
    try:
        os.close(fd)
    except OSError:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hostagent.logwriter")
    p.add_argument("path")
    p.add_argument("--max-bytes", type=int, required=True)
    p.add_argument("--backups", type=int, required=True)
    p.add_argument("--rotate-first", action="store_true")
    args = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    run(sys.stdin.fileno(), args.path, max(1, args.max_bytes), max(1, args.backups), args.rotate_first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
