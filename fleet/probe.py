"""Facts about one deployment, read on the host itself: run there as `python3 - SPEC_JSON` with this
file on standard input, it prints one JSON object. Standard library only, Python 3.6+, no side effects
but one: an instance seen healthy gets a `run/instance_<i>.ready` marker, so a later 503 reads as dead,
not as loading.
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


def read_pidfile(path):
    try:
        with open(path) as f:
            parts = f.read().split()
        pid = int(parts[0])
        pgid = int(parts[1]) if len(parts) > 1 else pid
        return pid, pgid, os.path.getmtime(path)
    except (OSError, ValueError, IndexError):
        return None, None, None


def alive(pid):
    """True when pid runs (a zombie does not count)."""
    if not pid:
        return False
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def listening(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def http_get(port, path, timeout=3.0):
    """(status, body) of GET 127.0.0.1:port/path; status None when nothing answers."""
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=timeout) as r:
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
    me = os.getuid()
    found = []
    needle = ("FLEET_TAG=" + prefix).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            if os.stat("/proc/" + name).st_uid != me:
                continue
            with open("/proc/%s/environ" % name, "rb") as f:
                env = f.read().split(b"\0")
            tag = next((e for e in env if e.startswith(needle)), None)
            if tag is None:
                continue
            with open("/proc/%s/cmdline" % name, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            found.append({"pid": int(name), "tag": tag.decode()[len("FLEET_TAG="):], "cmdline": cmd[:200]})
        except OSError:
            continue
    return found


def instance_facts(d, index, port, readonly):
    pid, pgid, started = read_pidfile(os.path.join(d, "run", "instance_%d.pid" % index))
    is_alive = alive(pid)
    status = http_get(port, "/health")[0] if is_alive or listening(port) else None
    marker = os.path.join(d, "run", "instance_%d.ready" % index)
    if is_alive and status == 200 and not readonly and not os.path.exists(marker):
        try:
            open(marker, "w").close()
        except OSError:
            pass
    return {
        "index": index, "port": port, "pid": pid if is_alive else None, "pgid": pgid if is_alive else None,
        "pidfile": pid is not None, "alive": is_alive,
        "listening": is_alive or listening(port), "health": status,
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


def proxy_facts(d, port, admin_port):
    pid, pgid, started = read_pidfile(os.path.join(d, "run", "proxy.pid"))
    is_alive = alive(pid)
    status, _ = http_get(port, "/health") if is_alive or listening(port) else (None, "")
    backends = config = None
    if is_alive:
        backends = admin_json(admin_port, "/admin/backends")
        config = admin_json(admin_port, "/admin/config")
    return {"pid": pid if is_alive else None, "pgid": pgid if is_alive else None, "pidfile": pid is not None,
            "alive": is_alive, "port": port, "listening": is_alive or listening(port), "health": status,
            "backends": backends, "config": config}


def nginx_facts(d):
    """nginx's master (run/nginx.pid holds its pid) and the /health watcher of nginx mode."""
    pid = read_pidfile(os.path.join(d, "run", "nginx.pid"))[0]
    wpid = read_pidfile(os.path.join(d, "run", "nginx_watch.pid"))[0]
    return {"pid": pid if alive(pid) else None, "alive": alive(pid),
            "watcher_pid": wpid if alive(wpid) else None, "watcher_alive": alive(wpid)}


def tail(path, n=10):
    """The last n lines of a text file, [] when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            return [line.decode("utf-8", "replace") for line in f.read().splitlines()[-n:]]
    except OSError:
        return []


def keeper_facts(d):
    """The keeper (run/keeper.pid) and what it wrote in run/keeper.json; a crash-looping instance's log tail."""
    pid = read_pidfile(os.path.join(d, "run", "keeper.pid"))[0]
    try:
        with open(os.path.join(d, "run", "keeper.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = None
    if isinstance(state, dict):
        for index, w in (state.get("instances") or {}).items():
            if isinstance(w, dict) and w.get("crashloop"):
                w["log_tail"] = tail(os.path.join(d, "logs", "vllm_%s.log" % index))
    return {"pid": pid if alive(pid) else None, "alive": alive(pid), "pidfile": pid is not None,
            "state": state}


def main():
    spec = json.loads(sys.argv[1])
    d = spec["deploy_dir"]
    with ThreadPoolExecutor(max_workers=16) as pool:
        inst = [pool.submit(instance_facts, d, i, p, spec.get("readonly", False)) for i, p in enumerate(spec["ports"])]
        prox = pool.submit(proxy_facts, d, spec["proxy_port"], spec["admin_port"])
        files = {rel: pool.submit(sha256, os.path.join(d, rel)) for rel in spec.get("files", [])}
        out = {
            "uid": os.getuid(),
            "deploy_dir_exists": os.path.isdir(d),
            "instances": [f.result() for f in inst],
            "proxy": prox.result(),
            "nginx": nginx_facts(d),
            "keeper": keeper_facts(d),
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
