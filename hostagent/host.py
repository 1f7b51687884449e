"""Facts and actions on the host: the nginx command line, pid files, /health checks, the watcher."""
from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from . import apikeys, instances, layout, processes, upstream

# Where nginx lives when it is not on PATH (a user's PATH often lacks the sbin directories).
NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx", "/sbin/nginx")


class FrontError(Exception):
    """A failure to report as one sentence that says what to do."""


def load_config(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise FrontError(f"cannot read {path} ({e.strerror}); run `inv deploy` first.") from None
    except ValueError:
        raise FrontError(f"{path} is not valid JSON; run `inv deploy` to render it again.") from None


def find_nginx(cfg: dict) -> str:
    """The nginx binary: nginx.bin from the inventory, else PATH, else the usual sbin directories."""
    if cfg.get("nginx_bin"):
        if os.access(cfg["nginx_bin"], os.X_OK):
            return cfg["nginx_bin"]
        raise FrontError(f"nginx.bin is {cfg['nginx_bin']}, which is not an executable; fix nginx.bin.")
    found = shutil.which("nginx") or next((p for p in NGINX_CANDIDATES if os.access(p, os.X_OK)), None)
    if not found:
        raise FrontError("nginx is not found on the host (PATH, " + ", ".join(NGINX_CANDIDATES) +
                         "); install it (apt-get install nginx) or set nginx.bin.")
    return found


def worker_user(cfg: dict) -> str | None:
    """`user U G` for nginx's workers when the master runs as root: the deploy_dir's owner by default,
    so the workers can write the temp files under deploy_dir (an unprivileged `nobody` cannot enter a
    home directory). None when not root: nginx then runs everything as the current user."""
    if os.geteuid() != 0:
        return None
    if cfg.get("nginx_user"):
        return cfg["nginx_user"]
    st = os.stat(cfg["deploy_dir"])
    try:
        return f"{pwd.getpwuid(st.st_uid).pw_name} {grp.getgrgid(st.st_gid).gr_name}"
    except KeyError:
        return f"{st.st_uid} {st.st_gid}"


def nginx_argv(cfg: dict, nginx: str) -> list[str]:
    """The one nginx command line: start, `-t` and `-s` all use it, so they see the same config."""
    argv = [nginx, "-p", cfg["deploy_dir"].rstrip("/") + "/", "-e", cfg["error_log"], "-c", cfg["conf"]]
    user = worker_user(cfg)
    if user:
        argv += ["-g", f"user {user};"]
    return argv


def read_pid(path: str) -> tuple[int | None, int | None]:
    """(pid, pgid) from a pid file's record; (None, None) when absent or unreadable."""
    rec, _ = processes.read_record_file(path)
    if rec is None:
        return None, None
    return rec["pid"], rec["pgid"] or rec["pid"]


alive = processes.alive


def ours(cfg: dict, pidfile: str, what: str):
    """The live process the pid file records (a layout path), when it still is the deployment's `what`
    (its record's start time and tag); None otherwise: a stale pid file is never acted on."""
    return processes.verified(at(cfg, pidfile), layout.tag(cfg["deployment_id"], what))


def at(cfg: dict, rel: str) -> str:
    """A layout path (hostagent.layout) under the deployment's deploy_dir."""
    return layout.path(cfg["deploy_dir"], rel)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def nginx_pid(cfg: dict) -> int | None:
    p = processes.verified(cfg["pid_file"], layout.tag(cfg["deployment_id"], "nginx"))
    return p.pid if p else None


def proxy_pid(cfg: dict) -> tuple[int | None, int | None]:
    p = ours(cfg, layout.PROXY_PID, "proxy")
    return (p.pid, p.pgid) if p else (None, None)


def check_health(cfg: dict) -> set[str]:
    """The backends whose /health does not answer 200 right now."""
    timeout = max(0.2, min(2.0, float(cfg["interval_s"])))

    def ok(backend: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{backend}{cfg['health_path']}", timeout=timeout) as r:
                return r.status == 200
        except (OSError, ValueError):       # HTTPError (503), refused, timeout
            return False
    with ThreadPoolExecutor(max_workers=min(16, len(cfg["backends"]))) as pool:
        verdicts = list(pool.map(ok, cfg["backends"]))
    return {b for b, good in zip(cfg["backends"], verdicts) if not good}


def write_upstream(cfg: dict, down: set[str]) -> bool:
    """Rewrite the upstream include file; True when its text changed."""
    text = upstream.render(cfg["backends"], down, cfg["max_fails"], cfg["fail_timeout_s"])
    return upstream.write(cfg["upstream_file"], text)


def write_keys(cfg: dict) -> bool:
    """nginx mode with proxy.api_keys_file: (re)write the keys' map nginx includes; True when it changed.
    apikeys.KeysError (one sentence, no key in it) when the key file cannot be used."""
    if not cfg.get("api_keys_file"):
        return False
    # A relative path is the proxy's: it runs in deploy_dir.
    keys_file = os.path.join(cfg["deploy_dir"], os.path.expanduser(cfg["api_keys_file"]))
    return apikeys.write(cfg["keys_conf"], keys_file)


def local_addr(cfg: dict) -> str:
    return "127.0.0.1" if cfg["bind"] in ("0.0.0.0", "", "*") else cfg["bind"]


def front_answer(cfg: dict, timeout: float = 1.0) -> str | None:
    """Who answers on the entry port: "nginx" (its X-Front header), "proxy", or None when nothing does."""
    try:
        with urllib.request.urlopen(f"http://{local_addr(cfg)}:{cfg['port']}/health", timeout=timeout) as r:
            headers = r.headers
    except urllib.error.HTTPError as e:
        headers = e.headers
    except (OSError, ValueError):
        return None
    return "nginx" if headers.get("X-Front") == "nginx" else "proxy"


def proxy_answer(cfg: dict, timeout: float = 1.0) -> tuple[int | None, int | None]:
    """(status, pid) of the proxy answering GET /health on the entry port, on a new connection (with
    two proxies on the port, the kernel picks one per connection); (None, None) when none answers."""
    try:
        with urllib.request.urlopen(f"http://{local_addr(cfg)}:{cfg['port']}/health", timeout=timeout) as r:
            status, body = r.status, r.read(4096)
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read(4096)
    except (OSError, ValueError):
        return None, None
    try:
        return status, int(json.loads(body)["pid"])
    except (ValueError, KeyError, TypeError):
        return status, None


def can_share_port(cfg: dict) -> bool:
    """Whether a listener with SO_REUSEPORT could join the entry port now (bind only, never listen: a
    probe that listened would be handed some of the clients' connections and reset them)."""
    return port_free(cfg, reuse_port=True)


def bind_listener(cfg: dict, backlog: int = 511) -> socket.socket | None:
    """A listening socket on the entry port for nginx to inherit, or None while the port is taken.

    SO_REUSEPORT is set so that a later listener which also sets it (a proxy with reuse_port) can join
    the port before nginx leaves it."""
    family = socket.AF_INET6 if ":" in cfg["bind"] else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((cfg["bind"] or "0.0.0.0", cfg["port"]))
        s.listen(backlog)
        # nginx takes an inherited socket as it is: a blocking one would leave a worker that lost the
        # race for a connection stuck in accept() (and every request of that worker with it).
        s.setblocking(False)
        return s
    except PermissionError:
        s.close()
        raise FrontError(f"binding port {cfg['port']} is not permitted for this user (ports below 1024 "
                         "need root); run as root or change proxy.port.") from None
    except OSError:
        s.close()
        return None


def port_free(cfg: dict, reuse_port: bool = False) -> bool:
    """Whether a listener could bind the entry port now: a plain one, or one setting SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in cfg["bind"] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((cfg["bind"] or "0.0.0.0", cfg["port"]))
            return True
        except OSError:
            return False


def tagged_env(cfg: dict, what: str) -> dict:
    return {**os.environ, layout.TAG_VAR: layout.tag(cfg["deployment_id"], what)}


def signal_group(pgid: int | None, pid: int, sig) -> None:
    """Signal pid's process group when pid leads it (never group 0 or 1, nor this process's own),
    else pid alone."""
    if pgid == pid and pgid not in processes.PROTECTED and pgid != os.getpgid(0):
        os.killpg(pgid, sig)
    elif pid not in processes.PROTECTED:
        os.kill(pid, sig)


def stop_group(pgid: int | None, pid: int | None, grace_s: float, sig=signal.SIGTERM) -> bool:
    """Signal a process group (see signal_group), wait up to grace_s for pid to go, then SIGKILL the group.
    True when it went within the grace period."""
    if not pgid or not alive(pid):
        return True
    try:
        signal_group(pgid, pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if alive(pid):
        try:
            signal_group(pgid, pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return False
    return True


def start_watcher(cfg: dict, config_path: str, nginx: str) -> int:
    """Start the /health watcher in its own session, tagged; its pid goes to run/nginx_watch.pid."""
    stop_watcher(cfg)
    log = open(os.path.join(cfg["log_dir"], "nginx_watch.log"), "a")     # nginx.log_dir, logs/ by default
    p = subprocess.Popen([sys.executable, "-m", "hostagent", "watch", "--config", config_path,
                          "--nginx", nginx], cwd=cfg["deploy_dir"], env=tagged_env(cfg, "nginx-watch"),
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    log.close()
    processes.write_record(at(cfg, layout.NGINX_WATCH_PID), p.pid, layout.tag(cfg["deployment_id"], "nginx-watch"))
    return p.pid


def stop_watcher(cfg: dict) -> bool:
    """Stop the watcher if it runs; True when one was stopped."""
    path = at(cfg, layout.NGINX_WATCH_PID)
    p = ours(cfg, layout.NGINX_WATCH_PID, "nginx-watch")
    was = p is not None
    if was:
        stop_group(p.pgid, p.pid, 3)
    try:
        os.remove(path)
    except OSError:
        pass
    return was


def log_line(path: str, n: int = 5) -> str:
    """The last n lines of a log on one line, for a one-sentence error."""
    return " | ".join(line.strip() for line in instances.log_tail(path, n)) or "(no log)"
