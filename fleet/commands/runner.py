"""Running one action (deploy, stop, status, ...) on many hosts: in parallel, bounded, one host's failure isolated."""
from __future__ import annotations

import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Callable

from fleet.errors import FleetError, InterruptedRun, UnreachableError
from fleet.report import Report
from fleet.settings import cluster
from fleet.settings.inventory import HostVars, Inventory
from fleet.transport.connection import INTERRUPT, Transport, connect

Action = Callable[[Transport, HostVars, Callable[[str], None]], Report]

_print_lock = threading.Lock()


def line_printer(host: str, prefix: bool, stream=None, readonly: bool = False):
    """An emit function printing each line whole, prefixed with the host when several run at once.
    When the output is closed (`| head`), printing stops; a read-only run stops too (nobody reads it),
    a run that changes hosts goes on to its end rather than stop half-way."""
    def emit(line: str) -> None:
        out = stream or sys.stdout
        with _print_lock:
            try:
                print(f"{host} | {line}" if prefix else line, file=out, flush=True)
            except BrokenPipeError:
                output_closed(out)
                if readonly:
                    INTERRUPT.raise_to(2)
    return emit


def output_closed(stream) -> None:
    """The reader of stream went away: send what is still printed to /dev/null (no traceback at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def interrupted() -> bool:
    """Whether Ctrl-C stopped this run."""
    return INTERRUPT.level > 0


def interrupted_help(host: str = "H") -> str:
    """What to do after a Ctrl-C stopped a run that changes hosts."""
    return (f"what had started keeps running: `inv status --host {host}` shows where each host stands, and "
            "running the command again finishes what it left")


def run_hosts(inv: Inventory, pattern: str, action: Action, overrides=(), forks: int = 5,
              stream=None, order: str | None = None, readonly: bool = False,
              entry_first: Action | None = None) -> list[Report]:
    """Resolve --host, then run action on each host, at most `forks` at once; reports come back in
    inventory order. order "entry-last" (deploy) or "entry-first" (stop) runs the entry hosts of a
    cluster across hosts after, or before, the others (see fleet.settings.cluster). entry_first, with "entry-last":
    a step each entry host takes before the others run (deploy: a smaller max_num_seqs reaches the entry's
    proxy before its members roll); its steps lead the host's report, and a failed one skips every host's
    action (a member rolled after it would be given more requests than it runs).

    Ctrl-C: a read-only run (readonly) stops at once, cutting its commands; a run that changes hosts
    starts no new command after the first Ctrl-C (each host finishes the command under way, so no step
    is cut in the middle) and cuts them at the second; a third leaves at once."""
    names = inv.select(pattern)
    host_vars = [inv.host_vars(n, overrides) for n in names]   # every host validated before any runs
    many = len(names) > 1

    def one(hv: HostVars, action: Action = action) -> Report:
        if interrupted():
            report = Report(hv.name)
            report.add("run", "skipped", "not started: the run was interrupted (Ctrl-C)")
            return report
        emit = line_printer(hv.name, many, stream, readonly)
        conn = connect(hv)
        try:
            return action(conn, hv, emit)
        except UnreachableError as e:
            return Report(hv.name, unreachable=str(e))
        except FleetError as e:
            report = Report(hv.name)
            message = str(e)   # the failure line names the host already: not twice
            message = message[len(hv.name) + 2:] if message.startswith(f"{hv.name}: ") else message
            if interrupted() and not isinstance(e, InterruptedRun):
                message += " (after Ctrl-C)"
            report.add("run", "failed", message)
            return report
        except Exception as e:   # a bug or an unforeseen remote failure: this host fails, the others go on
            report = Report(hv.name)
            if interrupted():    # a command cut by Ctrl-C can fail in any way: that is the interrupt's
                report.add("run", "failed", f"interrupted (Ctrl-C) ({type(e).__name__}: {e})")
            else:
                report.add("run", "failed", f"unexpected error ({type(e).__name__}: {e}); please report it.")
            return report
        finally:
            try:
                conn.close()
            except Exception:
                pass

    def run_batch(batch: list[HostVars], act: Action) -> list[Report]:
        with ThreadPoolExecutor(max_workers=max(1, forks)) as pool:
            futures = [pool.submit(one, hv, act) for hv in batch]
            # Python runs a signal's handler in the main thread only when that thread runs: the
            # kernel may hand SIGINT to a host's thread, so the main one must not sleep in one wait.
            while wait(futures, timeout=0.2).not_done:
                pass
            return [future.result() for future in futures]

    reports: dict[str, Report] = {}
    early: dict[str, Report] = {}
    with _ctrl_c_raises_the_interrupt(readonly):
        batches = cluster.phases(host_vars, order)
        if entry_first is not None and order == "entry-last" and len(batches) == 2:
            early = {r.host: r for r in run_batch(batches[1], entry_first)}
        for batch in batches if not any(r.failed for r in early.values()) else []:
            for hv, report in zip(batch, run_batch(batch, action)):
                reports[hv.name] = report
        for hv in host_vars:
            if hv.name not in reports and hv.name not in early:
                reports[hv.name] = Report(hv.name)
                reports[hv.name].add("run", "skipped", "not started: an entry host's first step failed (above)")
    for name, first in early.items():
        if name in reports:
            first.steps += reports[name].steps
            first.unreachable, first.status = reports[name].unreachable, reports[name].status
            first.data, first.warnings = reports[name].data, first.warnings + reports[name].warnings
        reports[name] = first
    return [reports[hv.name] for hv in host_vars]


@contextmanager
def _ctrl_c_raises_the_interrupt(readonly: bool):
    """While the hosts run, SIGINT raises the interrupt a level (see run_hosts) instead of throwing
    KeyboardInterrupt into whatever the main thread was doing (waiting for the hosts' threads, which
    would then run on to their end unseen)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN:     # started with Ctrl-C ignored (nohup &)
        yield
        return

    def on_sigint(signum, frame):
        if INTERRUPT.level >= 2:
            print(f"interrupted again: leaving at once; {interrupted_help()}.", file=sys.stderr, flush=True)
            os._exit(130)
        level = 2 if readonly or INTERRUPT.level == 1 else 1
        INTERRUPT.raise_to(level)
        if level == 1:
            print("interrupted: no host starts another command; Ctrl-C again cuts those under way.",
                  file=sys.stderr, flush=True)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def exit_code(reports: list[Report], interrupted_is_failure: bool = True) -> int:
    """0 when every host succeeded, 4 when one was unreachable, else 2 when one failed; 130 after Ctrl-C."""
    if interrupted_is_failure and interrupted():
        return 130
    if any(r.unreachable for r in reports):
        return 4
    if any(r.failed for r in reports):
        return 2
    return 0
