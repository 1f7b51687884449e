"""A member's instance out of its entry hosts' proxies while it restarts. An entry host's proxy sends
requests straight to its members' engines and counts them itself: a member's own drain empties only its
own proxy's share. So around each restart of a fronted instance (a deploy's roll, `inv restart`), every
entry host whose `fronts` name the member drains the instance's backend in its proxy and waits for its
requests in flight (`python -m hostagent drain-member` on the entry), and enables it once it is back.
"""
from __future__ import annotations

import shlex
from contextlib import contextmanager
from typing import Iterator

from fleet.errors import FleetError
from fleet.facts import state as facts
from fleet.report import Emit, Report
from fleet.settings.inventory import HostVars
from fleet.transport import agent
from fleet.transport.connection import connect


@contextmanager
def drained(hv: HostVars, indexes: list[int], report: Report, emit: Emit, stopped: bool = False) -> Iterator[None]:
    """Member hv's instances (indexes) out of every entry host's proxy for the block (steps into report),
    then given back: waited for until healthy there, or (stopped: the block stopped them) handed to that
    proxy's health check at once. An entry that cannot be reached, or whose proxy does not run, is said
    and passed over."""
    held = []
    try:
        for entry in hv.entry_hosts():
            names = [f.backend for f in entry.fronted or [] if f.host.name == hv.name and f.index in indexes]
            if not names:
                continue
            try:
                conn = connect(entry)
                prepared = facts.prepare(conn, entry)
            except FleetError as e:
                report.add(f"entry {entry.name}", "skipped", f"not reached ({e}); its proxy may still send "
                           f"requests to {', '.join(names)} while they are out")
                continue
            if facts.probe(conn, prepared, readonly=True).proxy.state != "healthy":
                conn.close()
                continue      # no proxy running there (not deployed yet, stopped, or nginx): nothing to drain
            held.append((conn, prepared, names))
            for backend in names:
                index = next(f.index for f in entry.fronted if f.backend == backend)
                emit(f"instance {index}: draining {backend} in entry host {entry.name}'s proxy")
                agent.steps(conn, prepared, f"drain-member --backend {shlex.quote(backend)}", report, emit)
        yield
    finally:
        for conn, prepared, names in held:
            try:
                for backend in names:
                    agent.steps(conn, prepared, f"enable-member --backend {shlex.quote(backend)}"
                                + (" --stopped" if stopped else ""), report, emit)
            finally:
                conn.close()
