"""Reading one deployment on its host: each instance's process, /health and state, the proxy, nginx mode's
master and watcher, the keeper and its record. The state probe (`inv status`, every command's facts) and
the live view's sampler (`inv top`) both read through these.

Standard library only, Python 3.6+ (bundled into the probes). A pid file counts only while the process it
names is still the one it recorded (hostagent.processes): a stale file reads as no process, and whoever
holds the port is named.
"""
import hashlib
import json
import os
import time

from hostagent import instances, layout, processes, proxyadmin

HEALTH_TIMEOUT_S = 600.0       # health_timeout_s when the spec gives none (the inventory's default)


def read_pidfile(path, tag):
    """(pid, pgid, mtime, stale): the process the file records, when it still runs and is ours; stale says
    why the file does not count (None when it does, or when there is no file)."""
    proc, rec, why = processes.read_pidfile(path, tag)
    if rec is None:
        return None, None, None, why
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        mtime = None
    if proc is not None:
        return proc.pid, proc.pgid, mtime, None
    return rec["pid"], None, mtime, why if why != "which no longer runs" else None


def alive(pid):
    return processes.alive(pid)


def stranger(port, dep, key):
    """The sentence naming who holds port when it is not the deployment's (else None)."""
    holders = processes.port_holders(port)
    if any(processes.ours_by_tag(h, dep) for h in holders):
        return None                    # its own leftover (a pid file lost): deploy repairs it
    return processes.stranger(port, holders[0] if holders else {}, key)


def health(port, host="127.0.0.1"):
    """The status of GET /health on host:port, None when nothing answers."""
    return instances.health(instances.url({"address": host, "port": port}), timeout=3.0)


def sha256(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def file_mode(path):
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return None


def tagged(prefix):
    """Processes of this user whose environment carries FLEET_TAG=<prefix>..."""
    me, self_pid = os.getuid(), os.getpid()
    return [{"pid": p.pid, "tag": p.tag, "sid": p.sid, "ppid": p.ppid, "cmdline": p.cmdline[:200]}
            for p in processes.snapshot().values()
            if p.uid == me and p.pid != self_pid and p.tag is not None and p.tag.startswith(prefix)]


def instance_facts(d, dep, index, port, readonly, host="127.0.0.1", health_timeout_s=HEALTH_TIMEOUT_S):
    """An instance's facts and state; host is where it listens (its bind address, loopback unless it is
    fronted)."""
    pid, pgid, started, stale = read_pidfile(layout.path(d, layout.instance_pidfile(index)), layout.tag(dep, index))
    is_alive = stale is None and alive(pid)
    taken = not is_alive and instances.listening(port, host)
    status = health(port, host) if is_alive or taken else None
    marker = layout.path(d, layout.instance_ready(index))
    if is_alive and status == 200 and not readonly and not os.path.exists(marker):
        try:
            open(marker, "w").close()
        except OSError:
            pass
    was_ready = os.path.exists(marker)
    age_s = round(time.time() - started, 1) if started else None
    state, reason = instances.classify(is_alive, pid is not None, status, was_ready, age_s, health_timeout_s,
                                       taken)
    return {
        "index": index, "port": port, "pid": pid if is_alive else None, "pgid": pgid if is_alive else None,
        "pidfile": pid is not None, "alive": is_alive, "stale": stale, "recorded_pid": pid,
        "listening": is_alive or taken, "health": status,
        "stranger": stranger(port, dep, "base_port") if taken else None,
        "was_ready": was_ready, "age_s": age_s, "state": state, "reason": reason,
    }


def read_launch(d, index):
    """Instance index's launch record (run/instance_<i>.launch, written by start_cluster.sh), None when
    there is none or it cannot be read."""
    try:
        with open(layout.path(d, layout.instance_launch(index))) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def proxy_facts(d, dep, port, admin_port, address="127.0.0.1"):
    """The proxy's process (run/proxy.pid), its /health on the entry port (at address: where its bind is
    reached from the host itself) and its admin API's view."""
    pid, pgid, started, stale = read_pidfile(layout.path(d, layout.PROXY_PID), layout.tag(dep, "proxy"))
    is_alive = stale is None and alive(pid)
    listening = instances.listening(port, address)
    status = health(port, address) if is_alive or listening else None
    backends = config = None
    if is_alive:
        backends = proxyadmin.get_json(admin_port, "/admin/backends", timeout=3.0)
        config = proxyadmin.get_json(admin_port, "/admin/config", timeout=3.0)
    return {"pid": pid if is_alive else None, "pgid": pgid if is_alive else None, "pidfile": pid is not None,
            "alive": is_alive, "stale": stale, "port": port, "listening": is_alive or listening,
            "health": status, "backends": backends, "config": config,
            "stranger": stranger(port, dep, "proxy.port") if not is_alive and listening else None}


def nginx_facts(d, dep):
    """nginx's master (run/nginx.pid holds its record) and the /health watcher of nginx mode."""
    pid, _, _, stale = read_pidfile(layout.path(d, layout.NGINX_PID), layout.tag(dep, "nginx"))
    wpid, _, _, wstale = read_pidfile(layout.path(d, layout.NGINX_WATCH_PID), layout.tag(dep, "nginx-watch"))
    up, wup = stale is None and alive(pid), wstale is None and alive(wpid)
    return {"pid": pid if up else None, "alive": up, "watcher_pid": wpid if wup else None, "watcher_alive": wup}


def read_mode(d):
    """The front the host runs (run/mode: proxy or nginx), None when unset or unreadable."""
    try:
        with open(layout.path(d, layout.MODE)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def keeper_facts(d, dep, log_tails=True):
    """The keeper (run/keeper.pid) and what it wrote in run/keeper.json; with log_tails, a crash-looping
    instance's log tail."""
    pid, _, _, stale = read_pidfile(layout.path(d, layout.KEEPER_PID), layout.tag(dep, "keeper"))
    up = stale is None and alive(pid)
    try:
        with open(layout.path(d, layout.KEEPER_STATE)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = None
    if log_tails and isinstance(state, dict):
        for index, w in (state.get("instances") or {}).items():
            if isinstance(w, dict) and w.get("crashloop"):
                w["log_tail"] = instances.engine_log_tail(d, int(index))
    return {"pid": pid if up else None, "alive": up, "pidfile": pid is not None, "state": state}
