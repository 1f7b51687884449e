"""Running one lifecycle action on many hosts: in parallel, bounded, one host's failure isolated."""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from . import cluster
from .errors import FleetError, UnreachableError
from .inventory import HostVars, Inventory
from .lifecycle import Report
from .transport import Transport, connect

Action = Callable[[Transport, HostVars, Callable[[str], None]], Report]

_print_lock = threading.Lock()


def line_printer(host: str, prefix: bool, stream=None):
    """An emit function printing each line whole, prefixed with the host when several run at once."""
    def emit(line: str) -> None:
        with _print_lock:
            print(f"{host} | {line}" if prefix else line, file=stream or sys.stdout, flush=True)
    return emit


def run_hosts(inv: Inventory, pattern: str, action: Action, overrides=(), forks: int = 5,
              stream=None, order: str | None = None) -> list[Report]:
    """Resolve --host, then run action on each host, at most `forks` at once; reports come back in
    inventory order. order "entry-last" (deploy) or "entry-first" (stop) runs the entry hosts of a
    cluster across hosts after, or before, the others (see fleet.cluster)."""
    names = inv.select(pattern)
    host_vars = [inv.host_vars(n, overrides) for n in names]   # every host validated before any runs
    many = len(names) > 1

    def one(hv: HostVars) -> Report:
        emit = line_printer(hv.name, many, stream)
        conn = connect(hv)
        try:
            return action(conn, hv, emit)
        except UnreachableError as e:
            return Report(hv.name, unreachable=str(e))
        except FleetError as e:
            report = Report(hv.name)
            message = str(e)   # the failure line names the host already: not twice
            report.add("run", "failed", message[len(hv.name) + 2:] if message.startswith(f"{hv.name}: ") else message)
            return report
        except Exception as e:   # a bug or an unforeseen remote failure: this host fails, the others go on
            report = Report(hv.name)
            report.add("run", "failed", f"unexpected error ({type(e).__name__}: {e}); please report it.")
            return report
        finally:
            try:
                conn.close()
            except Exception:
                pass

    reports: dict[str, Report] = {}
    for batch in cluster.phases(host_vars, order):
        with ThreadPoolExecutor(max_workers=max(1, forks)) as pool:
            for hv, report in zip(batch, pool.map(one, batch)):
                reports[hv.name] = report
    return [reports[hv.name] for hv in host_vars]


def exit_code(reports: list[Report]) -> int:
    """0 when every host succeeded, 4 when one was unreachable, else 2 when one failed."""
    if any(r.unreachable for r in reports):
        return 4
    if any(r.failed for r in reports):
        return 2
    return 0
