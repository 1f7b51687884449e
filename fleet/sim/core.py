"""The engine child: a spawned process that holds the card's device files, as vLLM's EngineCore holds VRAM.

Like vLLM's, it renames itself `VLLM::EngineCore` with the setproctitle package and starts a worker that
renames itself `VLLM::Worker`. setproctitle reuses the memory /proc/PID/environ shows for the longer
title, so FLEET_TAG vanishes from both unless SPT_NOENV is set in their environment (vLLM does the same;
start_cluster.sh exports SPT_NOENV=1). Both stay in the server's process group and session.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fleet.sim import devices

log = logging.getLogger("fleet.sim")

ENGINE_TITLE = "VLLM::EngineCore"
WORKER_TITLE = "VLLM::Worker"


def set_title(title: str) -> None:
    """Rename this process as vLLM does; without the setproctitle package, say so and keep the name."""
    try:
        import setproctitle
    except ImportError:
        log.warning("setproctitle is not installed: %s keeps its command line (vLLM's would not)", title)
        return
    setproctitle.setproctitle(title)


def worker_main(parent: int) -> None:
    """The worker: renamed, it lives while its engine core does (vLLM's workers watch their parent too),
    and ends on SIGTERM or SIGINT."""
    set_title(WORKER_TITLE)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    while os.getppid() == parent:
        time.sleep(0.2)


def start_worker() -> subprocess.Popen:
    """Start the worker beside this engine core: same environment, same process group and session."""
    root = str(Path(__file__).resolve().parent.parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", f"from fleet.sim.core import worker_main; "
                             f"worker_main({os.getpid()})"], env=env, stdin=subprocess.DEVNULL)

# What ends the child cleanly. Nothing else is handled, on purpose: like an orphaned EngineCore it
# must outlive a SIGKILL of its parent and never notice a pipe closing.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def engine_core_main(dev_dir: str, cards: list[int], ready) -> None:
    """Child entry point: open kfd and its cards' renderD files (one per tensor parallel rank), report
    ready, hold them until SIGTERM/SIGINT."""
    set_title(ENGINE_TITLE)
    worker = start_worker()   # before the mask: a child inherits blocked signals across exec
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    held = [open(p, "rb") for p in devices.ensure_card(dev_dir, cards)]
    ready.send(os.getpid())
    ready.close()
    signal.sigwait(_STOP_SIGNALS)
    worker.terminate()
    for f in held:
        f.close()
    try:
        worker.wait(5)
    except subprocess.TimeoutExpired:
        worker.kill()


class EngineCore:
    """The server's handle on its engine child: start it, learn when it died, stop it."""

    def __init__(self, dev_dir, cards: list[int], on_death=None):
        self.dev_dir = str(dev_dir)
        self.on_death = on_death          # called once when the child dies other than by shutdown()
        self.cards = list(cards)
        self.process = None
        self.dead = False
        self._stopping = False
        self._ready = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def alive(self) -> bool:
        return self.process is not None and not self.dead

    def start(self) -> None:
        """Spawn the child (spawn, not fork: no port in its command line, which it then renames)."""
        ctx = multiprocessing.get_context("spawn")
        self._ready, child_end = ctx.Pipe(duplex=False)
        # daemon: an orderly exit of the server always takes the child along; only a SIGKILL orphans it.
        self.process = ctx.Process(target=engine_core_main, args=(self.dev_dir, self.cards, child_end),
                                   name="EngineCore_0", daemon=True)
        self.process.start()
        child_end.close()
        asyncio.get_running_loop().add_reader(self.process.sentinel, self._exited)
        log.info("engine core started, pid %d, cards %s", self.process.pid, ",".join(map(str, self.cards)))

    async def wait_ready(self) -> bool:
        """Wait until the child holds its device files; False when it died first."""
        try:
            await asyncio.to_thread(self._ready.recv)
            return True
        except (EOFError, OSError):
            return False
        finally:
            self._ready.close()

    def _exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(0)  # reap it: a zombie would still look alive to a pid check
        if not self.dead:
            log.error("engine core (pid %d) died, exit code %s", self.process.pid, self.process.exitcode)
        self.dead = True
        if self.on_death and not self._stopping:
            self.on_death()

    def kill(self) -> None:
        """Engine death on demand: SIGKILL the child, as a crash would end it."""
        self.dead = True
        if self.process and self.process.exitcode is None:
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop watching the child, then stop it (the waiting happens off the event loop)."""
        if self.process is None or self._stopping:
            return
        self._stopping = True
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        await asyncio.to_thread(self.stop, grace_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate the child, wait up to grace_s, then kill it."""
        p = self.process
        if p is None or p.exitcode is not None:
            return
        self.dead = True
        p.terminate()
        p.join(grace_s)
        if p.exitcode is None:
            p.kill()
            p.join(2)
        log.info("engine core (pid %d) stopped", p.pid)
