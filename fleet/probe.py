"""Facts about one deployment, read on the host itself: run there as `python3 - SPEC_JSON` with this
file on standard input, bundled with hostagent/processes.py (fleet.hostcode), it prints one JSON object.
Standard library only, Python 3.6+, no side effects but one: an instance seen healthy gets a
`run/instance_<i>.ready` marker, so a later 503 reads as dead, not as loading.

A pid file counts only while the process it names is still the one it recorded (hostagent.processes):
a stale file reads as no process, and whoever holds the port is named.
"""
import hashlib
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from hostagent import processes


def read_pidfile(path, tag):
    """(pid, pgid, mtime, stale): the process the file records, when it still runs and is ours; stale says
    why the file does not count (None when it does, or when there is no file)."""
    rec, why = processes.read_record_file(path)
    if rec is None:
        return None, None, None, why
    proc = processes.read_proc(rec["pid"]) if rec["pid"] > 0 else None
    why = processes.check_record(rec, tag, proc)
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        mtime = None
    if why is None:
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


def listening(port, host="127.0.0.1"):
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def http_get(port, path, timeout=3.0, host="127.0.0.1"):
    """(status, body) of GET host:port/path; status None when nothing answers."""
    url = "http://%s:%d%s" % ("[%s]" % host if ":" in host else host, port, path)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(65536).decode("utf-8", "replace")
    except Exception:
        return None, ""


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
    return [{"pid": p.pid, "tag": p.tag, "sid": p.sid, "cmdline": p.cmdline[:200]}
            for p in processes.snapshot().values()
            if p.uid == me and p.pid != self_pid and p.tag is not None and p.tag.startswith(prefix)]


def instance_facts(d, dep, index, port, readonly, host="127.0.0.1"):
    """An instance's facts; host is where it listens (its bind address, loopback unless it is fronted)."""
    pid, pgid, started, stale = read_pidfile(os.path.join(d, "run", "instance_%d.pid" % index), "%s/%d" % (dep, index))
    is_alive = stale is None and alive(pid)
    status = http_get(port, "/health", host=host)[0] if is_alive or listening(port, host) else None
    marker = os.path.join(d, "run", "instance_%d.ready" % index)
    if is_alive and status == 200 and not readonly and not os.path.exists(marker):
        try:
            open(marker, "w").close()
        except OSError:
            pass
    return {
        "index": index, "port": port, "pid": pid if is_alive else None, "pgid": pgid if is_alive else None,
        "pidfile": pid is not None, "alive": is_alive, "stale": stale, "recorded_pid": pid,
        "listening": is_alive or listening(port, host), "health": status,
        "stranger": stranger(port, dep, "base_port") if not is_alive and listening(port, host) else None,
        "was_ready": os.path.exists(marker),
        "age_s": round(time.time() - started, 1) if started else None,
    }


def admin_json(admin_port, path):
    """The proxy admin API's JSON answer at path, or None."""
    code, body = http_get(admin_port, path)
    if code != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def proxy_facts(d, dep, port, admin_port):
    pid, pgid, started, stale = read_pidfile(os.path.join(d, "run", "proxy.pid"), dep + "/proxy")
    is_alive = stale is None and alive(pid)
    status, _ = http_get(port, "/health") if is_alive or listening(port) else (None, "")
    backends = config = None
    if is_alive:
        backends = admin_json(admin_port, "/admin/backends")
        config = admin_json(admin_port, "/admin/config")
    return {"pid": pid if is_alive else None, "pgid": pgid if is_alive else None, "pidfile": pid is not None,
            "alive": is_alive, "stale": stale, "port": port, "listening": is_alive or listening(port),
            "health": status, "backends": backends, "config": config,
            "stranger": stranger(port, dep, "proxy.port") if not is_alive and listening(port) else None}


def nginx_facts(d, dep):
    """nginx's master (run/nginx.pid holds its record) and the /health watcher of nginx mode."""
    pid, _, _, stale = read_pidfile(os.path.join(d, "run", "nginx.pid"), dep + "/nginx")
    wpid, _, _, wstale = read_pidfile(os.path.join(d, "run", "nginx_watch.pid"), dep + "/nginx-watch")
    up, wup = stale is None and alive(pid), wstale is None and alive(wpid)
    return {"pid": pid if up else None, "alive": up, "watcher_pid": wpid if wup else None, "watcher_alive": wup}


def tail(path, n=10):
    """The last n lines of a text file, [] when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            return [line.decode("utf-8", "replace") for line in f.read().splitlines()[-n:]]
    except OSError:
        return []


def keeper_facts(d, dep):
    """The keeper (run/keeper.pid) and what it wrote in run/keeper.json; a crash-looping instance's log tail."""
    pid, _, _, stale = read_pidfile(os.path.join(d, "run", "keeper.pid"), dep + "/keeper")
    up = stale is None and alive(pid)
    try:
        with open(os.path.join(d, "run", "keeper.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = None
    if isinstance(state, dict):
        for index, w in (state.get("instances") or {}).items():
            if isinstance(w, dict) and w.get("crashloop"):
                w["log_tail"] = tail(os.path.join(d, "logs", "vllm_%s.log" % index))
    return {"pid": pid if up else None, "alive": up, "pidfile": pid is not None, "state": state}


def main():
    spec = json.loads(sys.argv[1])
    d = spec["deploy_dir"]
    with ThreadPoolExecutor(max_workers=16) as pool:
        dep = spec["deployment_id"]
        host = spec.get("instance_host", "127.0.0.1")
        inst = [pool.submit(instance_facts, d, dep, i, p, spec.get("readonly", False), host)
                for i, p in enumerate(spec["ports"])]
        prox = pool.submit(proxy_facts, d, dep, spec["proxy_port"], spec["admin_port"])
        files = {rel: pool.submit(sha256, os.path.join(d, rel)) for rel in spec.get("files", [])}
        out = {
            "uid": os.getuid(),
            "deploy_dir_exists": os.path.isdir(d),
            "instances": [f.result() for f in inst],
            "proxy": prox.result(),
            "nginx": nginx_facts(d, dep),
            "keeper": keeper_facts(d, dep),
            "files": {rel: f.result() for rel, f in files.items()},
            "file_modes": {rel: file_mode(os.path.join(d, rel)) for rel in spec.get("files", [])},
            "tagged": tagged(spec["deployment_id"] + "/"),
        }
    try:
        with open(os.path.join(d, "run", "mode")) as f:
            out["mode"] = f.read().strip() or None
    except OSError:
        out["mode"] = None
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
