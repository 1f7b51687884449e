"""The proxy's own log (logs/proxy.log): rotated by size while the proxy runs, one line per malformed request.
Both its logs (this one and the results log, which holds callers' `user` values and answer snippets) are
the deployment user's alone: each file is created 0600 whatever the umask, rotated ones too, and one left
looser is tightened at the proxy's start, with a line saying so."""
from __future__ import annotations

import logging
import logging.handlers
import os
import stat
import sys

from aiohttp.http_exceptions import HttpProcessingError

from .config import LogConfig

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DETAIL_CHARS = 200
MODE, DIR_MODE = 0o600, 0o700


def open_private(path: str, **text) -> object:
    """path opened to append text, the file created 0600 (made so, when it was looser); text: open()'s
    encoding and errors."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, MODE)  # a symlink: ELOOP
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.fchmod(fd, MODE)
    return os.fdopen(fd, "a", **text)


def tighten(path: str, backups: int) -> list[str]:
    """path and its rotated copies made 0600 where group or others could read them: a sentence per file
    changed, to log (a symlink is left alone: not ours to chmod through)."""
    notes = []
    for p in [path] + [f"{path}.{k}" for k in range(1, backups + 1)]:
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                os.chmod(p, MODE)
                notes.append(f"{p} was mode {stat.S_IMODE(st.st_mode):04o}, readable beyond its user: now {MODE:04o}")
        except OSError:
            continue
    return notes


class RotatingLog(logging.handlers.RotatingFileHandler):
    """A size-rotated log file that also takes the process's standard output and error, so what is printed
    outside logging (a crash, a warning from a library) lands in the same bounded file, and follows it
    across each rotation."""

    def __init__(self, config: LogConfig):
        os.makedirs(os.path.dirname(os.path.abspath(config.path)), mode=DIR_MODE, exist_ok=True)
        super().__init__(config.path, maxBytes=config.max_bytes, backupCount=config.backups,
                         encoding="utf-8", errors="backslashreplace")
        self._take_std_streams()

    def _open(self):
        return open_private(self.baseFilename, encoding=self.encoding, errors=self.errors)

    def doRollover(self) -> None:
        super().doRollover()
        self._take_std_streams()

    def _take_std_streams(self) -> None:
        if self.stream is not None:
            take_std_streams(self.stream)


def take_std_streams(log) -> None:
    """Point this process's standard output and error at the open log file."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for fd in (1, 2):
        os.dup2(log.fileno(), fd)


class OneLineBadRequests(logging.Filter):
    """aiohttp logs a request it cannot parse with a traceback (~730 bytes, from whoever connects);
    here it becomes one line: who sent it and what was wrong, cut to DETAIL_CHARS."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            detail = " ".join(str(exc.message or exc).split())[:DETAIL_CHARS]
            record.args = (record.getMessage(), exc.code, detail)
            record.msg = "%s (%d): %s"
            record.exc_info = None
            record.exc_text = None
        return True


class SharedLog(logging.handlers.WatchedFileHandler):
    """The log of a process that writes it beside another one that rotates it (proxy.workers > 1): appended
    to, opened again once the path names a new file; standard output and error follow it too."""

    def __init__(self, config: LogConfig):
        os.makedirs(os.path.dirname(os.path.abspath(config.path)), mode=DIR_MODE, exist_ok=True)
        super().__init__(config.path, encoding="utf-8", errors="backslashreplace")

    def _open(self):
        stream = open_private(self.baseFilename, encoding=self.encoding, errors=self.errors)
        take_std_streams(stream)     # a crash's traceback follows the file as worker 0 rotates it
        return stream


def setup(config: LogConfig, rotate: bool = True) -> None:
    """Log to config.path, rotated by size, when a path is given (the deployed proxy); else to standard
    error (by hand, in tests). Either way a malformed request is one line. rotate False: another process
    (worker 0 of several) rotates the file; this one only follows it."""
    notes = tighten(config.path, config.backups) if config.path and rotate else []
    handler: logging.Handler = ((RotatingLog if rotate else SharedLog)(config) if config.path
                                else logging.StreamHandler())
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("aiohttp.server").addFilter(OneLineBadRequests())
    for note in notes:
        logging.getLogger("proxy.logfile").warning("%s", note)
