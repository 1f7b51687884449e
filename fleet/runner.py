"""Running one lifecycle action on many hosts: in parallel, bounded, one host's failure isolated."""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

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
              stream=None) -> list[Report]:
    """Resolve --host, then run action on each host; reports come back in inventory order."""
    names = inv.select(pattern)
    host_vars = [inv.host_vars(n, overrides) for n in names]   # every host validated before any runs
    many = len(names) > 1

    def one(hv: HostVars) -> Report:
        emit = line_printer(hv.name, many, stream)
        conn = connect(hv)
        try:
            return action(conn, hv, emit)
        except UnreachableError as e:
            report = Report(hv.name, unreachable=str(e))
            return report
        except FleetError as e:
            report = Report(hv.name)
            report.add("run", "failed", str(e))
            return report
        finally:
            conn.close()

    with ThreadPoolExecutor(max_workers=max(1, forks)) as pool:
        return list(pool.map(one, host_vars))


def exit_code(reports: list[Report]) -> int:
    """0 when every host succeeded, 4 when one was unreachable, else 2 when one failed."""
    if any(r.unreachable for r in reports):
        return 4
    if any(r.failed for r in reports):
        return 2
    return 0
