"""nginx mode on the host: the nginx binary and its one command line, its master's record, the upstream
and keys files it includes, and the /health watcher (hostagent/watch.py) started and stopped."""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from . import apikeys, httpcall, layout, logfiles, processes, upstream
from .config import at
from .errors import FrontError
from .parts import ours, stop_group, tagged_env

# Where nginx lives when it is not on PATH (a user's PATH often lacks the sbin directories).
NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx", "/sbin/nginx")


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


def nginx_pid(cfg: dict) -> int | None:
    """nginx's master, from its record (run/nginx.pid), while it still is the deployment's."""
    p = processes.verified(cfg["pid_file"], layout.tag(cfg["deployment_id"], "nginx"))
    return p.pid if p else None


def workers(master: int) -> set[int]:
    """The live children of nginx's master (its workers, and while they run its cache processes)."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = processes.read_stat(int(name))
            if st is not None and st[1] == master and st[0] not in ("Z", "X"):
                found.add(int(name))
    return found


def check_health(cfg: dict) -> set[str]:
    """The backends whose /health does not answer 200 right now (within health_timeout_s, the proxy's own:
    a busy engine's /health may be slow, and a backend marked down for it is one request path fewer; the
    only one's mark turns every request into nginx's 502)."""
    timeout = float(cfg["health_timeout_s"])

    def ok(backend: str) -> bool:
        return httpcall.get(f"http://{backend}{cfg['health_path']}", timeout).status == 200
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


def start_watcher(cfg: dict, config_path: str, nginx: str) -> int:
    """Start the /health watcher in its own session, tagged; its pid goes to run/nginx_watch.pid."""
    stop_watcher(cfg)
    # nginx.log_dir, logs/ by default
    log = logfiles.open_append(os.path.join(cfg["log_dir"], os.path.basename(layout.NGINX_WATCH_LOG)), say=True)
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
