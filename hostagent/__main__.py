"""`python -m hostagent COMMAND --config FILE [...]`, run in deploy_dir.

nginx front (--config conf/nginx_front.json): check (preflight), to-nginx, to-proxy, reload, watch.
Instances (--config conf/hostagent.json): restart --instance I | --rolling; keeper (runs it here),
keeper-start (in its own session, a running one stopped first), keeper-stop; drain-instance --instance I
and enable-instance --instance I (before and after `inv stop --instance I`); wait-healthy --instances 0,1
(after a start: each instance's /health 200, at most health_timeout_s, one step per instance);
drain-retired --instance I --port P --backend NAME --locked (deploy: an instance the inventory no longer
has, drained in the proxy, then until its engine holds no request; deploy then stops it).
On an entry host: drain-member --backend NAME and enable-member --backend NAME [--stopped] (around a
member's restart or stop of the instance this host's proxy names NAME).
Runtime LoRA adapters (--config conf/hostagent.json): lora add --model GROUP --name N --path P,
lora remove --model GROUP --name N, lora list (hostagent/lora.py; add and remove take the run lock
unless --locked).
Proxy front (--config conf/nginx_front.json): restart-proxy [--healthy] (a zero-gap restart of the
proxy), drain --timeout-s T (stop's first step: the front stops taking requests, finishes those in flight).
wait-proxy --timeout-s T (--config conf/nginx_front.json): after start_proxy.sh, until the proxy answers /health
200 or exits (T at most). reload-proxy [--drain] (--config conf/hostagent.json): the running proxy re-reads its config through its
synchronous `POST /admin/reload`; --drain then waits here for the backends it removed (drain_timeout_s).
Entries behind virtual addresses (--config conf/hostagent.json, hostagent/vrrp.py): vrrp-start [--reload]
(deploy: keepalived's supervisor started unless it runs), vrrp-run (the supervisor itself), vrrp-stop (stop's
first step: the address moves to a peer before the front drains), vrrp-state.
Each command but watch, keeper and vrrp-run prints progress lines, then one line `FLEET_RESULT {json}`; the exit
status is 0 on success, 1 on a failure said in that line.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from . import (config, drain, handover, instances, keeper, layout, lock, lora, observe, proxyadmin, restart, vrrp,
               watch)
from .errors import HostAgentError, LockHeld, UsageError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hostagent", description=__doc__)
    parser.add_argument("command", choices=["check", "to-nginx", "to-proxy", "reload", "watch", "restart",
                                            "keeper", "keeper-start", "keeper-stop", "restart-proxy", "drain",
                                            "drain-instance", "enable-instance", "wait-healthy", "lora",
                                            "drain-retired", "drain-member", "enable-member", "reload-proxy", "wait-proxy",
                                            "vrrp-start",
                                            "vrrp-run", "vrrp-state", "vrrp-stop"])
    parser.add_argument("action", nargs="?", choices=["add", "remove", "list"], help="lora: what to do")
    parser.add_argument("--config", required=True)
    parser.add_argument("--nginx", default=None, help="the nginx binary (default: found as check does)")
    parser.add_argument("--instance", type=int, default=None, help="restart, drain-instance, enable-instance: the instance")
    parser.add_argument("--instances", default=None, help="wait-healthy: the instances, a comma list")
    parser.add_argument("--rolling", action="store_true", help="restart: every instance in turn")
    parser.add_argument("--no-enable", action="store_true",
                        help="restart --instance I: leave it drained (deploy enables it once the proxy has the "
                             "new config)")
    parser.add_argument("--port", type=int, default=None, help="drain-retired: the instance's port")
    parser.add_argument("--backend", default=None,
                        help="drain-retired, drain-member, enable-member: the instance's backend in the proxy")
    parser.add_argument("--stopped", action="store_true",
                        help="enable-member: the member stopped the instance; enable it without waiting for it")
    parser.add_argument("--locked", action="store_true",
                        help="restart, lora add/remove: the caller holds the run lock (inv restart, inv lora); "
                             "else it is taken here")
    parser.add_argument("--model", default=None, help="lora: the group (its served name)")
    parser.add_argument("--name", default=None, help="lora add/remove: the adapter's name")
    parser.add_argument("--path", default=None, help="lora add: the adapter's directory on the host")
    parser.add_argument("--healthy", action="store_true",
                        help="restart-proxy: the new proxy must answer 200 on /health before the old one leaves")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="drain: how long requests in flight get")
    parser.add_argument("--drain", action="store_true",
                        help="reload-proxy: wait (up to drain_timeout_s) for the requests on the backends it removed")
    parser.add_argument("--reload", action="store_true",
                        help="vrrp-start: a running keepalived re-reads conf/keepalived.conf (it changed)")
    args = parser.parse_args(argv)
    if (args.command == "lora") != (args.action is not None):
        parser.error("lora needs add, remove or list" if args.command == "lora"
                     else f"{args.command} takes no second word (only lora does)")

    def say(line: str) -> None:
        print(line, flush=True)
    try:
        cfg = config.load_config(args.config)
        if args.command == "watch":
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
            watch.run(cfg)
            return 0
        if args.command == "keeper":
            return keeper.main(cfg)
        if args.command.startswith("vrrp-"):
            if "vrrp" not in cfg:
                raise UsageError("this host has no vrrp.addresses in the inventory: no keepalived to run.")
            if args.command == "vrrp-run":
                return vrrp.run(cfg, say)
            result = (vrrp.start(cfg, args.config, args.reload, say) if args.command == "vrrp-start"
                      else vrrp.stop(cfg, say) if args.command == "vrrp-stop" else vrrp.state(cfg))
            print("FLEET_RESULT " + json.dumps({"ok": True, **result}), flush=True)
            return 0
        if args.command in ("keeper-start", "keeper-stop"):
            if args.command == "keeper-stop":
                result = {"stopped": keeper.stop(cfg)}
            else:
                result = {"pid": keeper.start(cfg, args.config)}
            print("FLEET_RESULT " + json.dumps({"ok": True, **result}), flush=True)
            return 0
        if args.command == "restart":
            return _restart(cfg, args, say)
        if args.command in ("drain-instance", "enable-instance"):
            return _one_instance(cfg, args, say)
        if args.command == "drain-retired":
            return _drain_retired(cfg, args, say)
        if args.command in ("drain-member", "enable-member"):
            if not args.backend:
                raise UsageError(f"{args.command} needs --backend HOST:PORT.")
            steps = (restart.drain_member(cfg, args.backend, say) if args.command == "drain-member" else
                     restart.enable_member(cfg, args.backend, say, stopped=args.stopped))
            ok = not any(s["status"] == "failed" for s in steps)
            print("FLEET_RESULT " + json.dumps({"ok": ok, "steps": steps}), flush=True)
            return 0 if ok else 1
        if args.command == "wait-proxy":
            print("FLEET_RESULT " + json.dumps({"ok": True, **_wait_proxy(cfg, args.timeout_s)}), flush=True)
            return 0
        if args.command == "reload-proxy":
            result = proxyadmin.reload(cfg["admin_port"], float(cfg["drain_timeout_s"]) if args.drain else 0.0)
            print("FLEET_RESULT " + json.dumps({"ok": True, **result}), flush=True)
            return 0
        if args.command == "wait-healthy":
            return _wait_healthy(cfg, args, say)
        if args.command == "lora":
            return _lora(cfg, args, say)
        if args.command == "check":
            result = handover.preflight(cfg, args.nginx)
        elif args.command == "to-nginx":
            result = handover.to_nginx(cfg, args.config, args.nginx, say)
        elif args.command == "to-proxy":
            result = handover.to_proxy(cfg, args.config, args.nginx, say)
        elif args.command == "restart-proxy":
            result = handover.restart_proxy(cfg, args.healthy, say)
        elif args.command == "drain":
            result = drain.drain(cfg, args.timeout_s, say)
        else:
            result = handover.reload(cfg, args.config, args.nginx, say)
        print("FLEET_RESULT " + json.dumps({"ok": True, **result}), flush=True)
        return 0
    except HostAgentError as e:
        print("FLEET_RESULT " + json.dumps({"ok": False, "error": str(e)}), flush=True)
        return 1


def _instance(cfg: dict, args) -> int:
    """--instance, checked against the config."""
    n = len(cfg["instances"])
    if args.instance is None or not 0 <= args.instance < n:
        raise UsageError(f"{args.command} needs --instance I, one of 0-{n - 1}.")
    return args.instance


def _one_instance(cfg: dict, args, say) -> int:
    """drain-instance or enable-instance: the steps go back in the FLEET_RESULT line."""
    i = _instance(cfg, args)
    result = (restart.drain_for_stop(cfg, i, say) if args.command == "drain-instance"
              else restart.enable_after_stop(cfg, i, say))
    ok = not any(s["status"] == "failed" for s in result["steps"])
    print("FLEET_RESULT " + json.dumps({"ok": ok, **result}), flush=True)
    return 0 if ok else 1


def _wait_proxy(cfg: dict, timeout_s: float) -> dict:
    """Poll the proxy just started (its pid file's process, identity-checked, and /health on the entry port)
    until it answers 200, exits, or timeout_s passes: its facts then ({"pid", "alive", "health", ...})."""
    address = layout.local_address(cfg["bind"])
    deadline = time.monotonic() + timeout_s
    while True:
        f = observe.proxy_facts(cfg["deploy_dir"], cfg["deployment_id"], cfg["port"], cfg["admin_port"], address)
        if (f["alive"] and f["health"] == 200) or not f["alive"] or time.monotonic() > deadline:
            return f
        time.sleep(0.1)


def _wait_healthy(cfg: dict, args, say) -> int:
    """wait-healthy --instances 0,1: the steps go back in the FLEET_RESULT line."""
    n = len(cfg["instances"])
    try:
        indexes = [int(i) for i in (args.instances or "").split(",") if i.strip()]
    except ValueError:
        indexes = [-1]
    if not indexes or not all(0 <= i < n for i in indexes):
        raise UsageError(f"wait-healthy needs --instances I,J,... among 0-{n - 1}.")
    steps = instances.wait_healthy(cfg, indexes, say)
    for step in list(steps):            # a started instance gets its group's recorded adapters back
        if step["status"] == "changed":
            steps += lora.restore(cfg, int(step["name"].split()[-1]), say)
    ok = not any(s["status"] == "failed" for s in steps)
    print("FLEET_RESULT " + json.dumps({"ok": ok, "steps": steps}), flush=True)
    return 0 if ok else 1


def _hold(cfg: dict, args, what: str):
    """The run lock, taken here unless the caller holds it (--locked): one run at a time, as for inv."""
    if args.locked:
        return None
    held = lock.try_hold(cfg["deploy_dir"], what)
    if held is None:
        who = lock.holder(cfg["deploy_dir"]) or {}
        raise LockHeld(f"{who.get('what') or 'another run'} holds the run lock "
                              f"(since {who.get('since') or 'an unknown time'}); retry when it is done.")
    return held


def _lora(cfg: dict, args, say) -> int:
    """lora add | remove | list: per-instance lines, then the FLEET_RESULT line (hostagent/lora.py)."""
    if args.action == "list":
        result = lora.listing(cfg, say)
    else:
        needed = ["--model", "--name"] + (["--path"] if args.action == "add" else [])
        missing = [flag for flag in needed if not getattr(args, flag[2:])]
        if missing:
            raise UsageError(f"lora {args.action} needs {' '.join(f + ' ' + f[2:].upper() for f in needed)} "
                                  f"({', '.join(missing)} missing).")
        held = _hold(cfg, args, f"python -m hostagent lora {args.action}")
        try:
            result = (lora.add(cfg, args.model, args.name, args.path, say) if args.action == "add"
                      else lora.remove(cfg, args.model, args.name, say))
        finally:
            if held is not None:
                held.release()
    print("FLEET_RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def _restart(cfg: dict, args, say) -> int:
    """restart --instance I or --rolling: the steps go back in the FLEET_RESULT line."""
    n = len(cfg["instances"])
    if (args.instance is None) == (not args.rolling):
        raise UsageError("restart needs either --instance I or --rolling.")
    if args.instance is not None and not 0 <= args.instance < n:
        raise UsageError(f"there is no instance {args.instance}; instances are 0-{n - 1}.")
    held = _hold(cfg, args, "python -m hostagent restart")
    try:
        steps = (restart.restart_all(cfg, say) if args.rolling else
                 restart.restart_instance(cfg, args.instance, say, enable=not args.no_enable))
    finally:
        if held is not None:
            held.release()
    ok = not any(s["status"] == "failed" for s in steps)
    print("FLEET_RESULT " + json.dumps({"ok": ok, "steps": steps}), flush=True)
    return 0 if ok else 1


def _drain_retired(cfg: dict, args, say) -> int:
    """drain-retired --instance I --port P --backend NAME --locked: an instance the inventory no longer has."""
    if args.instance is None or args.port is None or not args.backend or args.instance < len(cfg["instances"]):
        raise UsageError("drain-retired needs --instance I --port P --backend NAME, I past the configured "
                         "instances.")
    if not args.locked:
        raise UsageError("drain-retired runs inside deploy, which holds the run lock: pass --locked.")
    steps = restart.drain_retired(cfg, args.instance, args.port, args.backend, say)
    ok = not any(s["status"] == "failed" for s in steps)
    print("FLEET_RESULT " + json.dumps({"ok": ok, "steps": steps}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
