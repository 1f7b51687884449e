"""The one "restart instance i", run on the host: `inv restart` calls it through the transport
(`python -m hostagent restart`), the keeper calls it in-process. Steps, each bounded in time:

1. drain the backend in the proxy (admin API on 127.0.0.1:admin_port) and wait for its in-flight
   requests, at most drain_timeout_s (no proxy answering: no drain);
2. stop the instance by identity (bin/stop_cluster.sh --instance I: its recorded process group, session
   and tag; orphaned engine children included);
3. wait until its card is released: no process of the instance left (its tag, or the session its pid
   file recorded) and no process holding the card's own device files where they are known in advance
   (/dev/nvidiaN, the sim's renderD(128+i); the kernel's view, /proc/PID/fd, what fuser reads). dcu and
   rocm find card i's render node from sysfs in the control node's probe only, and cpu has no device
   file: there the instance's processes are the whole check;
4. start it (ONLY=I STAGGER_S=0 bin/start_cluster.sh) and wait for /health 200, at most health_timeout_s;
   then load its group's recorded runtime LoRA adapters (run/lora_adapters.json, hostagent/lora.py): a
   failed restore is a failed step, and the instance is still enabled (it serves its model and static
   adapters);
5. enable it in the proxy and wait until the proxy's own health check routes to it again.

A failure after the drain enables the backend again when the stop went through (the proxy's health check
then keeps a dead instance out), so "drained" stays what the operator asked for; a stop that failed leaves
it drained, since the old process may still answer.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from typing import Callable

from . import drain, httpcall, instances, layout, lora, proxyadmin

Say = Callable[[str], None]


Cancelled = instances.Cancelled


def backends(cfg: dict) -> dict[str, dict] | None:
    """Backend name -> its admin record, or None when the proxy does not answer."""
    return proxyadmin.backends(cfg["admin_port"])


def _script(cfg: dict, name: str, args: list[str], env: dict | None, say: Say) -> subprocess.CompletedProcess:
    """Run bin/NAME with its standard output relayed line by line; its standard error kept for a failure."""
    path = layout.path(cfg["deploy_dir"], name)
    # The keeper's own tag stays its own; start_cluster.sh's overrides are a person's, never a restart's.
    full_env = {k: v for k, v in os.environ.items() if k != layout.TAG_VAR and k not in layout.START_OVERRIDES}
    full_env.update(env or {})
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([path, *args], cwd=cfg["deploy_dir"], env=full_env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=err, text=True)
        for line in p.stdout:
            say(line.rstrip("\n"))
        p.wait()
        err.seek(0)
        return subprocess.CompletedProcess(p.args, p.returncode, "", err.read()[-2000:])


class Steps(list):
    """The steps of a restart, as the control node's report takes them: name, status, message."""

    def add(self, name: str, status: str, message: str = "") -> bool:
        self.append({"name": name, "status": status, "message": message})
        return status != "failed"


def restart_instance(cfg: dict, i: int, say: Say = print, cancelled: Callable[[], bool] = lambda: False,
                     drain: bool = True, enable: bool = True) -> Steps:
    """Restart instance i (steps in the module's docstring); the steps, the last failed when it failed.

    cancelled is asked between steps and while waiting: when it says True, Cancelled is raised before
    anything more is started. drain False skips the proxy (nothing is drained or enabled). enable False
    leaves it drained once healthy: deploy enables it after the proxy has taken the config that routes
    the instance's new names to it.
    """
    inst = cfg["instances"][i]
    name, what = inst["backend"], f"instance {i}"
    steps = Steps()
    proxy_up = drain and backends(cfg) is not None
    if drain and not proxy_up:
        say(f"{what}: the proxy does not answer on its admin port; restarting without drain")
        steps.add(f"{what} drain", "skipped", "the proxy does not answer on its admin port")
    drained = proxy_up and _drain(cfg, what, name, steps, say, cancelled)
    if proxy_up and not drained:
        return steps
    if cancelled():
        raise Cancelled()

    sid = instances.recorded_session(cfg["deploy_dir"], i)
    r = _script(cfg, layout.STOP_CLUSTER, ["--instance", str(i)], None, say)
    if r.returncode != 0:
        steps.add(f"{what} stop", "failed", f"stop_cluster.sh --instance {i} exited {r.returncode} "
                  f"({r.stderr.strip()[-200:]}); "
                  + ("left drained; " if drained else "") + f"see `inv stop --host {cfg['host']} "
                  f"--instance {i} --check`")
        return steps
    steps.add(f"{what} stop", "changed", "stopped by identity (process group, session, tag)")

    if not _wait_released(cfg, i, sid, steps, say, cancelled):
        return _give_back(cfg, i, name, drained, steps, say)
    if cancelled():
        raise Cancelled()
    r = _script(cfg, layout.START_CLUSTER, [], {"ONLY": str(i), "STAGGER_S": "0"}, say)
    if r.returncode != 0:
        steps.add(what, "failed", f"start_cluster.sh exited {r.returncode}: {r.stderr.strip()[-300:]}")
        return _give_back(cfg, i, name, drained, steps, say)
    if not _wait_healthy(cfg, i, steps, say, cancelled):
        return _give_back(cfg, i, name, drained, steps, say)
    restored = lora.restore(cfg, i, say)    # before the proxy routes to it: no request for an adapter misses it
    steps += restored
    if any(s["status"] == "changed" for s in restored):
        lora.refresh_proxy(cfg, say)
    if drained and enable:
        _enable(cfg, what, name, steps, say, cancelled)
    elif drained:
        say(f"instance {i}: healthy, left drained until the proxy takes the new config")
        steps.add(f"instance {i} enable", "skipped", "left drained until the proxy takes the new config")
    return steps


def drain_retired(cfg: dict, i: int, port: int, backend: str, say: Say = print) -> Steps:
    """Drain instance i, which the inventory no longer has (its group removed, fewer instances), before
    deploy drops it from the proxy and stops it: drain its backend in the proxy when the proxy has it,
    then wait until its engine holds no request (its /metrics: vllm:num_requests_running and _waiting),
    at most drain_timeout_s in all."""
    steps = Steps()
    known = backends(cfg)
    if known is not None and backend in known:
        _drain(cfg, f"instance {i}", backend, steps, say, lambda: False)
    address = cfg["instances"][0]["address"] if cfg["instances"] else "127.0.0.1"
    url = httpcall.base_url(address, port)
    t0 = time.monotonic()
    while True:
        busy = drain.engine_requests(url)
        if not busy:
            say(f"instance {i}: no request left on :{port}")
            return steps
        if time.monotonic() - t0 > cfg["drain_timeout_s"]:
            say(f"instance {i}: {busy} request(s) still on :{port} after {cfg['drain_timeout_s']:g}s; "
                "stopping anyway")
            steps.add(f"instance {i} drain", "changed", f"{busy} request(s) cut after drain_timeout_s")
            return steps
        time.sleep(0.1)


def drain_member(cfg: dict, backend: str, say: Say = print) -> Steps:
    """On an entry host, before a member restarts the instance this host's proxy names backend: drain it
    here and wait for its requests in flight (drain_timeout_s); skipped when the proxy does not answer or
    does not route to it."""
    steps = Steps()
    known = backends(cfg)
    if known is None or backend not in known:
        why = ("the proxy does not answer on its admin port" if known is None
               else f"the proxy has no backend {backend}")
        steps.add(f"entry proxy {backend} drain", "skipped", f"{why}: nothing to drain")
        return steps
    _drain(cfg, f"entry proxy {backend}", backend, steps, say, lambda: False)
    return steps


def enable_member(cfg: dict, backend: str, say: Say = print, stopped: bool = False) -> Steps:
    """On an entry host, after a member restarted it: enable backend again and wait until this proxy's
    health check routes to it (skipped as drain_member is). stopped: the member stopped it; enabled
    without a wait, this proxy's health check keeps it out until it runs again."""
    steps = Steps()
    known = backends(cfg)
    if known is None or backend not in known:
        steps.add(f"entry proxy {backend} enable", "skipped", "the proxy does not answer on its admin port" if known is None
                  else f"the proxy has no backend {backend}")
        return steps
    if not stopped:
        _enable(cfg, f"entry proxy {backend}", backend, steps, say, lambda: False)
        return steps
    status, body = proxyadmin.enable(cfg["admin_port"], backend)
    steps.add(f"entry proxy {backend} enable", "ok" if status == 200 else "failed",
              "enabled again; the proxy's health check keeps it out while it is stopped" if status == 200 else
              f"the proxy refused to enable it ({status}: {str(body)[:100]}); POST /admin/backends/{backend}/enable "
              "on the entry's admin port once it runs again")
    return steps


def restart_all(cfg: dict, say: Say = print) -> Steps:
    """Every instance in turn, never more than one out; stops at the first that fails."""
    steps = Steps()
    n = len(cfg["instances"])
    for i in range(n):
        steps += restart_instance(cfg, i, say)
        if steps and steps[-1]["status"] == "failed":
            if i < n - 1:
                steps.add("rolling", "failed", f"stopped after instance {i}; instances {i + 1}-{n - 1} "
                          "were not restarted")
            break
    return steps


def drain_for_stop(cfg: dict, i: int, say: Say = print) -> dict:
    """`inv stop --instance I`'s first step: drain instance i's backend in the proxy and wait for its
    requests in flight (drain_timeout_s). {"steps", "enable_after"}: enable_after when the drain was
    this stop's (the operator had not drained it before), so that once the instance is stopped the
    proxy's health check, not a drain, keeps it out, and a later start brings it back by itself."""
    name = cfg["instances"][i]["backend"]
    steps = Steps()
    known = backends(cfg)
    if known is None or name not in known:
        why = ("the proxy does not answer on its admin port" if known is None
               else f"the proxy has no backend {name}")
        say(f"instance {i}: {why}; stopping it without drain")
        steps.add(f"instance {i} drain", "skipped", f"{why}: stopped at once")
        return {"steps": steps, "enable_after": False}
    was_drained = bool(known[name].get("drained"))
    drained = _drain(cfg, f"instance {i}", name, steps, say, lambda: False)
    return {"steps": steps, "enable_after": drained and not was_drained}


def enable_after_stop(cfg: dict, i: int, say: Say = print) -> dict:
    """Give a stopped instance's backend back to the proxy's health check (see drain_for_stop)."""
    name = cfg["instances"][i]["backend"]
    steps = Steps()
    status, body = proxyadmin.enable(cfg["admin_port"], name)
    if status != 200:
        steps.add(f"instance {i} enable", "failed", f"the proxy refused to enable {name} ({status}: "
                  f"{str(body)[:100]}); it stays drained: POST /admin/backends/{name}/enable on the admin "
                  "port once the instance runs again")
    else:
        steps.add(f"instance {i} enable", "ok", f"{name} enabled again; the proxy's health check keeps "
                  "it out while it is stopped")
    return {"steps": steps}


def _drain(cfg, what, name, steps, say, cancelled) -> bool:
    """Drain backend name in the proxy and wait for its requests in flight (drain_timeout_s); what names
    it in the steps and lines (`instance 2`)."""
    status, body = proxyadmin.drain(cfg["admin_port"], name)
    if status != 200:
        return steps.add(f"{what} drain", "failed", f"the proxy refused to drain {name} "
                         f"({status}: {str(body)[:100]})")
    t0 = time.monotonic()
    while True:
        left = ((backends(cfg) or {}).get(name) or {}).get("in_flight", 0)
        if not left:
            say(f"{what}: drained {name} in {time.monotonic() - t0:.1f}s")
            return steps.add(f"{what} drain", "changed", f"drained {name}")
        if time.monotonic() - t0 > cfg["drain_timeout_s"]:
            say(f"{what}: {left} request(s) still in flight after {cfg['drain_timeout_s']:g}s; "
                "stopping anyway")
            return steps.add(f"{what} drain", "changed", f"drained {name}; {left} request(s) in flight "
                             "were cut after drain_timeout_s")
        instances.sleep(0.1, cancelled)


def _wait_released(cfg, i, sid, steps, say, cancelled) -> bool:
    t0 = time.monotonic()
    said = False
    while True:
        left = instances.leftovers(cfg, i, sid)
        if not left:
            if said:
                say(f"instance {i}: card released after {time.monotonic() - t0:.1f}s")
            return steps.add(f"instance {i} release", "ok", "no process holds the card or carries the "
                             "instance's tag")
        if time.monotonic() - t0 > cfg["release_timeout_s"]:
            return steps.add(f"instance {i} release", "failed", f"still held after {cfg['release_timeout_s']:g}s "
                             f"by pid(s) {', '.join(map(str, left))}; `inv stop --host {cfg['host']} --instance "
                             f"{i} --force` kills the ones that are yours")
        if not said:
            say(f"instance {i}: waiting up to {cfg['release_timeout_s']:g}s for its card "
                f"(held by pid(s) {', '.join(map(str, left))})")
            said = True
        instances.sleep(0.1, cancelled)


def _wait_healthy(cfg, i, steps, say, cancelled) -> bool:
    done = instances.wait_healthy(cfg, [i], say, cancelled)[0]
    return steps.add(done["name"], done["status"], done["message"])


def _give_back(cfg, i, name, drained, steps, say) -> Steps:
    """After a failed start: enable the backend again, so that drained means the operator's drain only."""
    if drained:
        proxyadmin.enable(cfg["admin_port"], name)
        say(f"instance {i}: enabled in the proxy again; its health check keeps it out while it is down")
    return steps


def _enable(cfg, what, name, steps, say, cancelled) -> bool:
    """Enable the backend and wait until the proxy's own /health check sees it healthy again."""
    status, body = proxyadmin.enable(cfg["admin_port"], name)
    if status != 200:
        return steps.add(f"{what} enable", "failed", f"the proxy refused to enable {name} ({status}: "
                         f"{str(body)[:100]}); enable it by hand: POST /admin/backends/{name}/enable on the "
                         "admin port")
    limit = max(10.0, 4 * cfg["health_interval_s"] + 5)
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        b = (backends(cfg) or {}).get(name, {})
        if b.get("healthy") and not b.get("drained"):
            say(f"{what}: back in the proxy after {time.monotonic() - t0:.1f}s")
            return steps.add(f"{what} enable", "changed", f"{name} enabled and healthy in the proxy")
        instances.sleep(0.1, cancelled)
    return steps.add(f"{what} enable", "failed", f"{name} enabled but the proxy has not seen it healthy "
                     f"after {limit:g}s; see logs/proxy.log")
