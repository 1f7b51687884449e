"""The proxy's own log (logs/proxy.log): rotated by size while the proxy runs, one line per malformed request."""
from __future__ import annotations

import logging
import logging.handlers
import os
import sys

from aiohttp.http_exceptions import HttpProcessingError

from .config import LogConfig

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DETAIL_CHARS = 200


class RotatingLog(logging.handlers.RotatingFileHandler):
    """A size-rotated log file that also takes the process's standard output and error, so what is printed
    outside logging (a crash, a warning from a library) lands in the same bounded file, and follows it
    across each rotation."""

    def __init__(self, config: LogConfig):
        os.makedirs(os.path.dirname(os.path.abspath(config.path)), exist_ok=True)
        super().__init__(config.path, maxBytes=config.max_bytes, backupCount=config.backups,
                         encoding="utf-8", errors="backslashreplace")
        self._take_std_streams()

    def doRollover(self) -> None:
        super().doRollover()
        self._take_std_streams()

    def _take_std_streams(self) -> None:
        if self.stream is None:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd in (1, 2):
            os.dup2(self.stream.fileno(), fd)


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


def setup(config: LogConfig) -> None:
    """Log to config.path, rotated by size, when a path is given (the deployed proxy); else to standard
    error (by hand, in tests). Either way a malformed request is one line."""
    handler: logging.Handler = RotatingLog(config) if config.path else logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("aiohttp.server").addFilter(OneLineBadRequests())
