"""The deployment's run lock, deploy_dir/run/fleet.lock, taken with flock: one run at a time.

TODO(issue 11): replaced by issue 11's lock module when it lands; the keeper and `hostagent restart`
only need these three calls.
"""
from __future__ import annotations

import fcntl
import os
import time


class RunLock:
    """flock on run/fleet.lock: try without waiting, wait up to a time, release."""

    def __init__(self, deploy_dir: str):
        self.path = os.path.join(deploy_dir, "run", "fleet.lock")
        self.fd: int | None = None

    def try_take(self) -> bool:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def take(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.try_take():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
