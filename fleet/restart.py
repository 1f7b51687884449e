"""Restarts without failing a request: drain the instance in the proxy, wait for its in-flight requests,
stop it (group and tag), wait for its card to be released, start it, wait for /health, enable it, and
wait until the proxy routes to it again. Rolling: every instance in turn, never more than one out.
"""
from __future__ import annotations

import shlex
import time

from . import lifecycle, release, runlock
from .errors import FleetError
from .inventory import HostVars
from .lifecycle import Emit, Report

# The proxy's admin listener is loopback-only: it is called on the host. SPEC: {"port", "method", "path"}.
ADMIN_CLIENT = '''
import json, sys, urllib.request, urllib.error
spec = json.loads(sys.argv[1])
req = urllib.request.Request("http://127.0.0.1:%d%s" % (spec["port"], spec["path"]), method=spec["method"],
                             data=b"" if spec["method"] == "POST" else None)
try:
    with urllib.request.urlopen(req, timeout=5) as r:
        out = {"status": r.status, "body": r.read().decode("utf-8", "replace")}
except urllib.error.HTTPError as e:
    out = {"status": e.code, "body": e.read().decode("utf-8", "replace")}
except OSError as e:
    out = {"status": None, "body": str(e)}
json.dump(out, sys.stdout)
'''


def admin(conn, hv: HostVars, method: str, path: str) -> tuple[int | None, str]:
    """Call the proxy's admin API on the host: (status, body); status None when nothing answers."""
    out = release.run_script(conn, hv, ADMIN_CLIENT, {"port": hv["proxy"]["admin_port"], "method": method,
                                                      "path": path}, "calling the proxy's admin API")
    return out["status"], out["body"]


def backends(conn, hv: HostVars) -> dict[str, dict] | None:
    """Backend name -> its admin record, or None when the proxy does not answer."""
    import json
    status, body = admin(conn, hv, "GET", "/admin/backends")
    if status != 200:
        return None
    return {b["name"]: b for b in json.loads(body)}


def restart(conn, hv: HostVars, emit: Emit = lambda line: None, instance: int | None = None,
            rolling: bool = False, wait: bool = False) -> Report:
    """Restart one instance, or every instance in turn (rolling); stops at the first that fails.
    wait: when another run holds the deployment's lock, wait for it instead of failing at once."""
    hv = lifecycle.prepare(conn, hv)
    if (instance is None) == (not rolling):
        raise FleetError("restart needs either --instance I or --rolling.")
    if instance is not None and not 0 <= instance < hv["instances"]:
        raise FleetError(f"{hv.name}: there is no instance {instance}; instances are 0-{hv['instances'] - 1}.")
    with runlock.held(conn, hv, "restart", emit, wait):
        return _restart(conn, hv, emit, instance)


def _restart(conn, hv: HostVars, emit: Emit, instance: int | None) -> Report:
    report = Report(hv.name)
    files = lifecycle.host_files(hv)
    facts = lifecycle.probe(conn, hv, [f.path for f in files], readonly=True)
    if not facts["files"].get("bin/start_cluster.sh"):
        raise FleetError(f"{hv.name} is not deployed under {hv['deploy_dir']}; run "
                         f"`inv deploy --host {hv.name}` first.")
    # The instance starts with the current inventory: put what changed (the proxy keeps running as is).
    lifecycle._put_files(conn, hv, files, facts, report, emit, check=False, diff=False)
    proxy_up = backends(conn, hv) is not None
    if not proxy_up:
        report.add("proxy", "skipped", "the proxy does not answer on its admin port: restarting without drain")
        emit("proxy: not answering on the admin port; instances restart without drain")
    for i in [instance] if instance is not None else range(hv["instances"]):
        if not _restart_one(conn, hv, i, report, emit, proxy_up):
            if instance is None and i < hv["instances"] - 1:
                report.add("rolling", "failed", f"stopped after instance {i}; instances "
                           f"{i + 1}-{hv['instances'] - 1} were not restarted")
            break
    report.status = lifecycle.status_of(hv, lifecycle.probe(conn, hv))
    return report


def _restart_one(conn, hv: HostVars, i: int, report: Report, emit: Emit, proxy_up: bool) -> bool:
    name = hv.backends[i]
    if proxy_up:
        _drain(conn, hv, i, name, report, emit)
    sub = lifecycle.stop(conn, hv, emit, instance=i)
    for step in sub.steps:
        report.steps.append(lifecycle.Step(f"instance {i} {step.name}" if not step.name.startswith("instance")
                                           else step.name + " stop", step.status, step.message))
    if sub.failed:
        emit(f"instance {i}: stop failed; left drained and not restarted")
        return False
    bin_dir = shlex.quote(f"{hv['deploy_dir']}/bin")
    r = conn.run(f"ONLY={i} STAGGER_S=0 {bin_dir}/start_cluster.sh", on_line=emit)
    if not r.ok:
        report.add(f"instance {i}", "failed", f"start_cluster.sh failed (exit {r.exited}): {r.stderr.strip()[-300:]}")
        return False
    lifecycle._wait_healthy(conn, hv, [i], report, emit)
    if report.steps[-1].status == "failed":
        return False
    if proxy_up:
        return _enable(conn, hv, i, name, report, emit)
    return True


def _drain(conn, hv, i, name, report, emit) -> None:
    status, body = admin(conn, hv, "POST", f"/admin/backends/{name}/drain")
    if status != 200:
        report.add(f"instance {i} drain", "failed", f"the proxy refused to drain {name} ({status}: {body[:100]})")
        return
    t0 = time.monotonic()
    while True:
        b = (backends(conn, hv) or {}).get(name, {})
        left = b.get("in_flight", 0)
        if not left:
            emit(f"instance {i}: drained {name} in {time.monotonic() - t0:.1f}s")
            report.add(f"instance {i} drain", "changed", f"drained {name}")
            return
        if time.monotonic() - t0 > hv["drain_timeout_s"]:
            emit(f"instance {i}: {left} request(s) still in flight after {hv['drain_timeout_s']:g}s; stopping anyway")
            report.add(f"instance {i} drain", "changed", f"drained {name}; {left} request(s) in flight were cut "
                       "after drain_timeout_s")
            return
        time.sleep(0.1)


def _enable(conn, hv, i, name, report, emit) -> bool:
    """Enable the backend and wait until the proxy's own /health check sees it healthy again."""
    status, body = admin(conn, hv, "POST", f"/admin/backends/{name}/enable")
    if status != 200:
        report.add(f"instance {i} enable", "failed", f"the proxy refused to enable {name} ({status}: {body[:100]}); "
                   f"enable it by hand: POST /admin/backends/{name}/enable on the admin port")
        return False
    limit = max(10.0, 4 * hv["proxy"]["health_interval_s"] + 5)
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        b = (backends(conn, hv) or {}).get(name, {})
        if b.get("healthy") and not b.get("drained"):
            emit(f"instance {i}: back in the proxy after {time.monotonic() - t0:.1f}s")
            report.add(f"instance {i} enable", "changed", f"{name} enabled and healthy in the proxy")
            return True
        time.sleep(0.1)
    report.add(f"instance {i} enable", "failed", f"{name} enabled but the proxy has not seen it healthy after "
               f"{limit:g}s; see logs/proxy.log")
    return False
