"""The proxy's admin API (loopback-only on the host), called through the transport from the host itself."""
from __future__ import annotations

import json
import shlex
import sys

from .errors import RemoteError
from .inventory import HostVars
from .transport import Transport

# Run on the host: METHOD URL -> prints {"status": ..., "body": ...}. Standard library only.
_CALL = """
import json, sys, urllib.error, urllib.request
method, url = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        status, body = r.status, r.read().decode("utf-8", "replace")
except urllib.error.HTTPError as e:
    status, body = e.code, e.read().decode("utf-8", "replace")
except Exception as e:
    status, body = None, str(e)
print(json.dumps({"status": status, "body": body}))
"""


def call(conn: Transport, hv: HostVars, method: str, path: str):
    """(status, parsed JSON body or text) of an admin call; status None when the proxy does not answer."""
    python = sys.executable if hv["connection"] == "local" else "python3"
    url = f"http://127.0.0.1:{hv['proxy']['admin_port']}{path}"
    r = conn.run(f"{shlex.quote(python)} -c {shlex.quote(_CALL)} {method} {shlex.quote(url)}", timeout=30)
    if not r.ok:
        raise RemoteError(f"{hv.name}: calling the proxy's admin API failed: {r.stderr.strip()[-200:]}")
    out = json.loads(r.stdout)
    try:
        return out["status"], json.loads(out["body"])
    except ValueError:
        return out["status"], out["body"]


def backends(conn: Transport, hv: HostVars) -> list[dict] | None:
    """The proxy's view of its backends, or None when it does not answer."""
    status, body = call(conn, hv, "GET", "/admin/backends")
    return body if status == 200 else None


def set_drained(conn: Transport, hv: HostVars, backend: str, drained: bool) -> bool:
    """Drain (no new requests) or enable one backend; False when the proxy does not answer."""
    status, _ = call(conn, hv, "POST", f"/admin/backends/{backend}/{'drain' if drained else 'enable'}")
    return status == 200
