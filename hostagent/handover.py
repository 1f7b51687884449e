"""Preflight, start, reload, and the port handover proxy <-> nginx, run on the host for precise timing.

The proxy's listener sets SO_REUSEPORT (`listen.reuse_port`, on by default), and so does the socket this
module binds and hands to nginx through nginx's own inherited-sockets variable (`NGINX=fd;`, the
mechanism of nginx's binary upgrade). So each front starts beside the other, and the old one leaves
(proxy: SIGTERM, it closes its listener and drains; nginx: SIGQUIT, the same) only once the new one
answers on the port: no moment without a listener.

Without SO_REUSEPORT on the proxy (an older proxy, `reuse_port: false`) the handover stops the proxy,
binds the port the moment it is free (polled every millisecond) and hands that socket to nginx; the way
back starts the proxy in a launcher that imports first and waits for the port. Then the port refuses
connections for the few milliseconds between one listener's close and the other's bind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

from . import (apikeys, config, entryport, files, instances, keeper, layout, logfiles, nginx_front, parts, processes,
               proxyadmin)
from .errors import FrontError


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def preflight(cfg: dict, nginx: str | None = None) -> dict:
    """nginx found, its directories there, the upstream file written, `nginx -t` passing, the port usable."""
    nginx = nginx or nginx_front.find_nginx(cfg)
    for d in (cfg["temp_dir"], config.at(cfg, layout.RUN)):
        os.makedirs(d, exist_ok=True)
    logfiles.make_dir(cfg["log_dir"])
    private_logs(cfg)                     # before `nginx -t`, which opens (and would create) them
    if not os.path.exists(cfg["upstream_file"]):
        nginx_front.write_upstream(cfg, nginx_front.check_health(cfg))
    try:
        nginx_front.write_keys(cfg)           # the API keys, before nginx -t reads the map that holds them
    except apikeys.KeysError as e:
        raise FrontError(str(e)) from None
    r = subprocess.run(nginx_front.nginx_argv(cfg, nginx) + ["-t", "-q"], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        why = " ".join(line for line in r.stderr.splitlines() if "emerg" in line or "failed" in line)
        raise FrontError(f"nginx -t rejects {cfg['conf']}: {why or r.stderr.strip()[-300:]}; "
                         "fix the inventory (or the template) and deploy again.")
    if not nginx_front.nginx_pid(cfg) and not parts.proxy_pid(cfg)[0] and not entryport.port_free(cfg):
        raise FrontError(_stranger(cfg) + ".")
    return {"nginx": nginx, "version": _version(nginx)}


def private_logs(cfg: dict) -> None:
    """nginx's error and access logs made 0600 before nginx opens them (it keeps a file's mode; a file it
    creates is 0644), a looser one tightened with a line in its error log saying so."""
    logs = [(cfg["error_log"], 0)] + ([(cfg["access_log"], int(cfg["access_log_backups"]))]
                                      if cfg.get("access_log") else [])
    notes = [note for path, backups in logs for note in logfiles.tighten(path, backups)]
    for path, _ in logs:
        os.close(logfiles.open_fd(path))
    if notes:
        with logfiles.open_append(cfg["error_log"]) as f:
            f.write("".join(f"{time.strftime('%Y/%m/%d %H:%M:%S')} [notice] vllm-fleet: {n}\n" for n in notes))


def _stranger(cfg: dict) -> str:
    """The sentence naming who holds the entry port, which is neither this deployment's proxy nor nginx."""
    holders = processes.port_holders(cfg["port"])
    return processes.stranger(cfg["port"], holders[0] if holders else {}, "proxy.port")


def _version(nginx: str) -> str:
    r = subprocess.run([nginx, "-v"], capture_output=True, text=True, timeout=10)
    return r.stderr.strip().split("/")[-1]


def _wait(predicate, timeout: float, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def _spawn_nginx(cfg: dict, nginx: str, sock) -> int:
    """Start nginx on an already listening socket; nginx does not daemonize when it inherits sockets,
    so it gets its own session here and the pid it writes is this child's."""
    fd = sock.fileno()
    os.set_inheritable(fd, True)
    env = {**parts.tagged_env(cfg, "nginx"), "NGINX": f"{fd};"}
    err = logfiles.open_append(cfg["error_log"])
    try:
        p = subprocess.Popen(nginx_front.nginx_argv(cfg, nginx), env=env, pass_fds=(fd,), cwd=cfg["deploy_dir"],
                             stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True)
    finally:
        err.close()
    # nginx writes its own pid file (run/nginx.master.pid, a bare pid); run/nginx.pid is the record
    # the toolkit checks before it signals nginx. nginx's setproctitle erases its environment's tag,
    # so the record's start time is what proves it is ours.
    processes.write_record(cfg["pid_file"], p.pid, layout.tag(cfg["deployment_id"], "nginx"))
    return p.pid


def _start_proxy(cfg: dict, wait_free: str | None = None, beside_s: float | None = None,
                 drained: list[str] = ()) -> None:
    env = None
    if wait_free:
        env = {**os.environ, "WAIT_FREE": wait_free}
    elif beside_s is not None:
        env = {**os.environ, "BESIDE_S": f"{beside_s:g}", "FLEET_PROXY_DRAINED": ",".join(drained)}
    r = subprocess.run([config.at(cfg, layout.START_PROXY)], capture_output=True,
                       text=True, timeout=60, env=env)
    if r.returncode != 0:
        raise FrontError(f"{layout.START_PROXY} failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")


def _finish_proxy(cfg: dict, pid: int, pgid: int) -> bool:
    """Wait for the stopped proxy to finish its in-flight requests, then clear its pid file."""
    clean = parts.stop_group(pgid, pid, float(cfg["proxy_drain_s"]), sig=0) if parts.alive(pid) else True
    try:
        os.remove(config.at(cfg, layout.PROXY_PID))
    except OSError:
        pass
    return clean


def to_nginx(cfg: dict, config_path: str, nginx: str | None = None, say=print) -> dict:
    """Put nginx on the entry port (taking it over from the proxy when it runs) and start the watcher."""
    pre = preflight(cfg, nginx)
    nginx = pre["nginx"]
    result = {"nginx": nginx, "nginx_version": pre["version"], "changed": False}
    running = nginx_front.nginx_pid(cfg)
    if running:
        result["pid"] = running
        say(f"nginx: already running, pid {running}")
    else:
        nginx_front.write_upstream(cfg, nginx_front.check_health(cfg))
        proxy_pid, proxy_pgid = parts.proxy_pid(cfg)
        sock = entryport.bind_listener(cfg)
        overlap = sock is not None and proxy_pid is not None
        t_term = t_last_taken = None
        if sock is None:
            if not proxy_pid:
                raise FrontError(_stranger(cfg) + ".")
            say(f"proxy: SIGTERM to pid {proxy_pid}: it stops accepting and drains its in-flight requests")
            t_term = time.monotonic()
            parts.signal_group(proxy_pgid, proxy_pid, signal.SIGTERM)
            deadline = t_term + 15
            while sock is None and time.monotonic() < deadline:
                t_last_taken = time.monotonic()
                sock = entryport.bind_listener(cfg)
                if sock is None:
                    time.sleep(0.001)
            if sock is None:
                raise FrontError(f"the proxy (pid {proxy_pid}) did not release port {cfg['port']} within 15 s; "
                                 f"look at {layout.PROXY_LOG}, then retry.")
        t_bound = time.monotonic()
        pid = _spawn_nginx(cfg, nginx, sock)
        sock.close()
        answered = _wait(lambda: not parts.alive(pid) or entryport.front_answer(cfg) == "nginx", 15)
        if not parts.alive(pid) or not answered:
            if parts.alive(pid):
                parts.stop_group(pid, pid, 3)
            if proxy_pid and not overlap:
                _start_proxy(cfg)
                say("proxy: started again, nginx did not come up")
            raise FrontError("nginx did not start: " + instances.log_line(cfg["error_log"]) +
                             "; the proxy keeps the port. Fix what the error log says and retry.")
        t_ready = time.monotonic()
        if overlap:
            say(f"proxy: listener shares the port (SO_REUSEPORT); nginx answers, SIGTERM to pid {proxy_pid}")
            parts.signal_group(proxy_pgid, proxy_pid, signal.SIGTERM)
        result.update(changed=True, pid=pid, overlap=overlap,
                      gap_ms=0.0 if overlap or t_last_taken is None else ms(t_bound - t_last_taken),
                      release_ms=ms(t_bound - t_term) if t_term else None,
                      ready_ms=ms(t_ready - t_bound))
        say(f"nginx: pid {pid} answers on :{cfg['port']}; port refused connections for at most "
            f"{result['gap_ms']} ms, queued ones waited {result['ready_ms']} ms for nginx's workers")
        if proxy_pid:
            result["proxy_drained"] = _finish_proxy(cfg, proxy_pid, proxy_pgid)
            say(f"proxy: pid {proxy_pid} " + ("finished its in-flight requests and exited" if
                result["proxy_drained"] else "was killed after proxy_drain_s"))
    files.write_atomic(config.at(cfg, layout.MODE), "nginx\n")
    if cfg.get("keeper_watches"):
        _keeper_watches(cfg, result, say)
    elif not parts.ours(cfg, layout.NGINX_WATCH_PID, "nginx-watch"):
        result["watcher_pid"] = nginx_front.start_watcher(cfg, config_path, nginx)
        result["changed"] = True
        say(f"watcher: pid {result['watcher_pid']} polls {cfg['health_path']} of {len(cfg['backends'])} "
            f"backends every {cfg['interval_s']}s, log {layout.NGINX_WATCH_LOG}")
    return result


def _keeper_watches(cfg: dict, result: dict, say) -> None:
    """keeper.enabled: the keeper does the /health watching (one agent, not two); started if it is not
    running, and a watcher left from before is stopped."""
    if nginx_front.stop_watcher(cfg):
        say("watcher: stopped, the keeper watches /health now")
    running = parts.ours(cfg, layout.KEEPER_PID, "keeper")     # identity-checked: a reused pid is no keeper
    pid = running.pid if running else None
    if pid is None:
        pid = keeper.start(config.load_config(config.at(cfg, layout.HOSTAGENT_CONF)), layout.HOSTAGENT_CONF)
        result["changed"] = True
    result["watcher_pid"] = pid
    say(f"keeper: pid {pid} polls {cfg['health_path']} of {len(cfg['backends'])} backends every "
        f"{cfg['interval_s']}s for nginx, log {layout.KEEPER_LOG}")


def to_proxy(cfg: dict, config_path: str, nginx: str | None = None, say=print) -> dict:
    """Give the entry port back to the aiohttp proxy.

    The proxy is started first in a launcher that imports its libraries and then waits for the port;
    only then does nginx get SIGQUIT (it closes its listener at once and finishes in-flight requests),
    so the port refuses connections only for the proxy's last steps of start-up, not all of it."""
    result = {"changed": False}
    pid = nginx_front.nginx_pid(cfg)
    if pid and not parts.proxy_pid(cfg)[0] and entryport.can_share_port(cfg):
        # nginx's listener and the proxy's both set SO_REUSEPORT: the proxy starts beside nginx, and
        # nginx leaves only once the proxy answers on the port. No moment without a listener.
        _start_proxy(cfg)
        proxy_pid = parts.proxy_pid(cfg)[0]
        if not _wait(lambda: not parts.alive(proxy_pid) or entryport.front_answer(cfg) == "proxy", 30, 0.01) \
                or not parts.alive(proxy_pid):
            ppid, ppgid = parts.proxy_pid(cfg)
            if ppid:
                parts.stop_group(ppgid, ppid, 3)
            raise FrontError(f"the proxy did not start beside nginx (see {layout.PROXY_LOG}); nginx keeps the port.")
        if nginx_front.stop_watcher(cfg):
            say("watcher: stopped")
        say(f"proxy: pid {proxy_pid} shares the port (SO_REUSEPORT) and answers; SIGQUIT to nginx pid {pid}: "
            "it closes its listener and finishes its in-flight requests")
        os.kill(pid, signal.SIGQUIT)
        result.update(changed=True, overlap=True, gap_ms=0.0, release_ms=0.0)
        say(f"proxy: answers on :{cfg['port']}; port refused connections for at most 0.0 ms")
    elif pid and not parts.proxy_pid(cfg)[0]:
        ready = config.at(cfg, layout.PROXY_WAITING)
        if os.path.exists(ready):
            os.remove(ready)
        _start_proxy(cfg, wait_free=f"{cfg['bind']}:{cfg['port']}")
        proxy_pid = parts.proxy_pid(cfg)[0]
        if not _wait(lambda: os.path.exists(ready) or not parts.alive(proxy_pid), 60, 0.01) \
                or not parts.alive(proxy_pid):
            raise FrontError(f"the proxy did not start (see {layout.PROXY_LOG}); nginx keeps the port.")
        say(f"proxy: pid {proxy_pid} imported, waits for the port; SIGQUIT to nginx pid {pid}: it closes "
            "its listener and finishes its in-flight requests")
        if nginx_front.stop_watcher(cfg):
            say("watcher: stopped")
        t_quit = time.monotonic()
        os.kill(pid, signal.SIGQUIT)
        t_refused = None
        deadline = t_quit + 30
        while True:
            who = entryport.front_answer(cfg, timeout=2)
            if who == "proxy" or time.monotonic() > deadline:
                break
            if who is None and t_refused is None:
                t_refused = time.monotonic()
            time.sleep(0.001)
        t_ready = time.monotonic()
        if who != "proxy":
            say("proxy: did not answer; giving the port back to nginx")
            ppid, ppgid = parts.proxy_pid(cfg)
            if ppid:
                parts.stop_group(ppgid, ppid, 3)
            _wait(lambda: not parts.alive(pid), 15, 0.05)
            to_nginx(cfg, config_path, nginx, say)
            raise FrontError(f"the proxy did not answer on the entry port within 30 s (see {layout.PROXY_LOG}); "
                             "nginx is the front again.")
        result.update(changed=True, release_ms=ms((t_refused or t_ready) - t_quit),
                      gap_ms=ms(t_ready - t_refused) if t_refused else 0.0)
        say(f"proxy: answers on :{cfg['port']}; port refused connections for at most {result['gap_ms']} ms")
        os.remove(ready)
    elif not parts.proxy_pid(cfg)[0]:
        _start_proxy(cfg)
        result["changed"] = True
        if not _wait(lambda: entryport.front_answer(cfg) == "proxy", 30, 0.01):
            raise FrontError(f"the proxy did not answer on the entry port within 30 s; see {layout.PROXY_LOG}.")
    if nginx_front.stop_watcher(cfg):
        result["changed"] = True
        say("watcher: stopped")
    files.write_atomic(config.at(cfg, layout.MODE), "proxy\n")
    if pid:
        gone = _wait(lambda: not parts.alive(pid), 10, 0.05)
        say(f"nginx: pid {pid} " + ("exited" if gone else "still finishes long requests; it exits when they end"))
    return result


def reload(cfg: dict, config_path: str, nginx: str | None = None, say=print) -> dict:
    """After a deploy changed nginx's files: `nginx -t`, rewrite the upstream file, SIGHUP, new watcher."""
    pid = nginx_front.nginx_pid(cfg)
    if not pid:
        return to_nginx(cfg, config_path, nginx, say)
    if cfg.get("keeper_watches"):
        # The running keeper still holds the backends of before: one more round of it would write them back
        # (a host taken out of the fleet would get requests again). It starts again below, on the new list.
        keeper.stop(config.load_config(config.at(cfg, layout.HOSTAGENT_CONF)))
    pre = preflight(cfg, nginx)      # the keys' map rewritten from the key file, then nginx -t
    # A backend joining is written `down` until its /health answers 200: no request reaches it before.
    nginx_front.write_upstream(cfg, nginx_front.check_health(cfg))
    old_workers = nginx_front.workers(pid)
    os.kill(pid, signal.SIGHUP)
    say(f"nginx: pid {pid} reloaded its configuration")
    files.write_atomic(config.at(cfg, layout.MODE), "nginx\n")
    result = {"changed": True, "pid": pid, "nginx": pre["nginx"], "keys_digest": apikeys.conf_digest(cfg["keys_conf"])
              if cfg.get("api_keys_file") else None}
    # The old workers finish the requests they hold (to a backend that left too) and exit: that is the
    # drain of a removed backend. Wait for it, bounded, so a host taken out can be stopped right after.
    t0 = time.monotonic()
    bound = float(cfg.get("drain_timeout_s", 60))     # 0: do not wait
    left = _wait(lambda: not (old_workers & nginx_front.workers(pid)), bound, 0.05)
    result["old_workers"] = len(old_workers)
    result["drain_ms"] = ms(time.monotonic() - t0)
    result["still_draining"] = 0 if left else len(old_workers & nginx_front.workers(pid))
    say(f"nginx: its {len(old_workers)} old worker(s) " + (f"finished their requests in {result['drain_ms']} ms"
        if left else f"still hold requests after {bound:g}s (drain_timeout_s); they exit when those end"))
    if cfg.get("keeper_watches"):
        _keeper_watches(cfg, result, say)
    else:
        result["watcher_pid"] = nginx_front.start_watcher(cfg, config_path, pre["nginx"])
    return result


def restart_proxy(cfg: dict, need_healthy: bool, say=print) -> dict:
    """Replace the running proxy (new code, a restart-only setting) without a moment the port refuses.

    1. The new proxy starts beside the old on the same port (SO_REUSEPORT), its pid in
       run/proxy.next.pid; it waits for the admin port, which the old one keeps while it drains.
    2. It is confirmed: it answers GET /health on the entry port itself (its pid in the answer), with
       200 when need_healthy (the old one had a healthy backend). If not, it is stopped and the old one
       serves on, untouched.
    3. The old one gets POST /admin/drain-and-exit: it steers new connections to the new one, lets its
       accept queue empty, stops listening and finishes its requests within shutdown_timeout_s.
       (An old proxy without that call gets SIGTERM, to the group recorded in run/proxy.pid.)
    4. run/proxy.next.pid becomes run/proxy.pid, and the new one answers on the admin port.
    """
    old_pid, old_pgid = parts.proxy_pid(cfg)
    if not old_pid:
        raise FrontError("no proxy runs; `inv deploy` starts one.")
    if not entryport.can_share_port(cfg):
        return _restart_with_gap(cfg, old_pid, old_pgid, say)
    next_file = config.at(cfg, layout.PROXY_NEXT_PID)
    drain_s = float(cfg["proxy_shutdown_s"])
    drained = [name for name, b in (proxyadmin.backends(cfg["admin_port"], timeout=2) or {}).items()
               if b.get("drained")]
    if drained:
        say(f"proxy: the new one keeps {', '.join(drained)} drained, as the operator left them")
    running = proxyadmin.get_json(cfg["admin_port"], "/admin/config", timeout=2)
    old_host = running["listen"][0] if isinstance(running, dict) and running.get("listen") else None
    # A changed bind (127.0.0.1 -> 0.0.0.0): the new one is asked where the old one does not listen.
    address = entryport.address_of_new(cfg, old_host)
    _start_proxy(cfg, beside_s=drain_s + 30, drained=drained)
    new = parts.ours(cfg, layout.PROXY_NEXT_PID, "proxy")
    new_pid, new_pgid = (new.pid, new.pgid) if new else (None, None)
    t0 = time.monotonic()

    def confirmed():
        if not parts.alive(new_pid):
            return "exited"
        status, pid = entryport.proxy_answer(cfg, address=address)
        return pid == new_pid and (status == 200 or not need_healthy)
    verdict = _wait(confirmed, 30, 0.02)
    if verdict is not True:
        if parts.alive(new_pid):
            parts.stop_group(new_pgid, new_pid, 3)
        try:
            os.remove(next_file)
        except OSError:
            pass
        why = "exited" if verdict == "exited" else \
            "did not answer 200 on /health within 30 s" if need_healthy else "did not answer within 30 s"
        raise FrontError(f"the new proxy {why} ({layout.PROXY_LOG}: {instances.log_line(_proxy_log(cfg))}); "
                         f"the running proxy (pid {old_pid}) keeps the port.")
    say(f"proxy: new pid {new_pid} answers on :{cfg['port']} beside pid {old_pid} after "
        f"{time.monotonic() - t0:.1f}s; pid {old_pid} stops accepting and drains (up to {drain_s:g}s)")
    status, answer = proxyadmin.call(cfg["admin_port"], "POST", "/admin/drain-and-exit",
                                     {"timeout_s": drain_s, "pid": old_pid}, timeout=drain_s + 15)
    result = {"changed": True, "pid": new_pid, "old_pid": old_pid, "overlap": True}
    if status == 200 and isinstance(answer, dict) and answer.get("pid") == old_pid:
        result.update(drained=answer["in_flight_at_start"], waited_s=answer["waited_s"], cut=answer["cut"])
        gone = _wait(lambda: not parts.alive(old_pid), 10, 0.02)
    else:
        say(f"proxy: pid {old_pid} does not take the drain call on admin port {cfg['admin_port']} ({status}); "
            "SIGTERM: it stops listening and drains")
        parts.signal_group(old_pgid, old_pid, signal.SIGTERM)
        gone = _wait(lambda: not parts.alive(old_pid), drain_s + 10, 0.05)
    if not gone:
        parts.stop_group(old_pgid, old_pid, 3)
    os.replace(next_file, config.at(cfg, layout.PROXY_PID))
    for c in result.get("cut", []):
        say(f"proxy: request {c['request_id']} (trace {c['trace_id']}) on {c['backend']} was cut: still in "
            f"flight after {drain_s:g}s")
    say(f"proxy: pid {old_pid} " + (f"finished {result['drained']} request(s) in flight in {result['waited_s']}s "
                                    "and exited" if "drained" in result else "exited"))

    def on_admin():
        answer = proxyadmin.get_json(cfg["admin_port"], "/admin/config", timeout=1)
        return isinstance(answer, dict) and answer.get("pid") == new_pid
    result["admin"] = bool(_wait(on_admin, 10, 0.05))
    if not result["admin"]:
        say(f"proxy: pid {new_pid} serves, but does not answer on admin port {cfg['admin_port']}; "
            f"see {layout.PROXY_LOG}")
    return result


def _proxy_log(cfg: dict) -> str:
    return config.at(cfg, layout.PROXY_LOG)


def _restart_with_gap(cfg: dict, old_pid: int, old_pgid: int, say) -> dict:
    """The running proxy's listener does not share its port (listen.reuse_port off): stop it, then start
    the new one the moment the port is free; the port refuses connections in between."""
    say(f"proxy: pid {old_pid} does not share its port (SO_REUSEPORT off); stopping it first")
    parts.stop_group(old_pgid, old_pid, float(cfg["proxy_shutdown_s"]) + 5)
    t_gone = time.monotonic()
    _start_proxy(cfg)
    new_pid = parts.proxy_pid(cfg)[0]
    if not _wait(lambda: entryport.proxy_answer(cfg)[1] == new_pid or not parts.alive(new_pid), 30, 0.01) \
            or not parts.alive(new_pid):
        raise FrontError(f"the new proxy did not start: {instances.log_line(_proxy_log(cfg))}")
    gap = ms(time.monotonic() - t_gone)
    say(f"proxy: pid {new_pid} answers; the port refused connections for about {gap} ms")
    return {"changed": True, "pid": new_pid, "old_pid": old_pid, "overlap": False, "gap_ms": gap}
