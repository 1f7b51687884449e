"""keepalived under the deployment's identity, for entry hosts behind virtual addresses (vrrp.addresses).

`vrrp-start` (deploy) starts `vrrp-run` in its own session, tagged `<id>/keepalived`, its record in
run/keepalived.pid; a running one is sent SIGHUP when conf/keepalived.conf changed (`--reload`), which it
passes to keepalived, and vrrp-start returns once keepalived has settled: one advert interval, then until the
interface carries again what it carried before (at most three more; deploy reloads the entries of a group one
at a time, so the addresses always have a holder). `vrrp-run` is keepalived's supervisor: it runs `keepalived
--dont-fork` as its child (VRRP only, its own pid files under run/, its lines in logs/keepalived.log), with a
parent-death signal, so keepalived never outlives it. Whenever keepalived is gone, however it went (SIGTERM
hands the address over at once; SIGKILL leaves it on the interface), the supervisor takes this entry's virtual
addresses off the interface before anything else: a dead keepalived never leaves the address held twice for
longer than that. It starts keepalived again (at most 5 times a minute); SIGTERM stops both. `inv stop` stops
the session by identity like every other part.

keepalived needs CAP_NET_ADMIN and CAP_NET_RAW (root, or file capabilities on the binary); `cannot_run`
says in one sentence what is missing, and deploy then skips it and says so. Standard library only.
"""
from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import time

from hostagent import (  # in the package, or bundled in front by fleet.transport.hostcode
    layout,
    logfiles,
    parts,
    processes,
)

CANDIDATES = ("/usr/sbin/keepalived", "/usr/local/sbin/keepalived")
CAP_NET_ADMIN, CAP_NET_RAW = 12, 13
RESTARTS, RESTART_WINDOW_S, RESTART_WAIT_S = 5, 60.0, 1.0


def binary(vrrp):
    """The keepalived binary: vrrp.keepalived, else found on the PATH or in the usual places; None if none."""
    if vrrp.get("keepalived"):
        return vrrp["keepalived"] if os.access(vrrp["keepalived"], os.X_OK) else None
    found = shutil.which("keepalived")
    return found or next((c for c in CANDIDATES if os.access(c, os.X_OK)), None)


def _bits(mask):
    return {i for i in range(64) if mask >> i & 1}


def own_caps():
    """The capabilities this process holds in effect, as bit numbers (/proc/self/status CapEff)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return _bits(int(line.split()[1], 16))
    except OSError:
        pass
    return set()


def file_caps(path):
    """The capabilities a binary's file grants when it runs (security.capability, permitted set)."""
    try:
        raw = os.getxattr(path, "security.capability")
    except (OSError, AttributeError):
        return set()
    return parse_file_caps(raw)


def parse_file_caps(raw):
    """The permitted set of a security.capability value (struct vfs_cap_data, v2 or v3: little-endian
    words magic, permitted low, inheritable low, permitted high, inheritable high[, rootid])."""
    words = struct.unpack("<%dI" % (len(raw) // 4), raw[:len(raw) // 4 * 4])
    if len(words) < 2:
        return set()
    return _bits(words[1] | (words[3] << 32 if len(words) > 3 else 0))


def cannot_run(vrrp):
    """Why keepalived cannot run here, in one sentence; None when it can (binary, capabilities, interface)."""
    kbin = binary(vrrp)
    if kbin is None:
        return ("keepalived is not installed (%s); install it (`apt-get install keepalived`) or set "
                "vrrp.keepalived" % (vrrp.get("keepalived") or "not on the PATH nor in /usr/sbin"))
    need = {CAP_NET_ADMIN, CAP_NET_RAW}
    if not need <= own_caps() | file_caps(kbin):
        return ("keepalived needs CAP_NET_ADMIN and CAP_NET_RAW to move the address, and this user (uid %d) has "
                "neither root nor file capabilities on %s; as root: `setcap cap_net_admin,cap_net_raw+ep %s`, "
                "then `inv deploy`" % (os.getuid(), kbin, kbin))
    if not os.path.isdir("/sys/class/net/%s" % vrrp["interface"]):
        return ("the interface %s does not exist on this host; set vrrp.interface to the one that carries %s"
                % (vrrp["interface"], ", ".join(vrrp["addresses"])))
    return None


def held(vrrp):
    """The virtual addresses of vrrp that its interface carries now (`ip -o -4 addr show dev IF`)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", vrrp["interface"]], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, universal_newlines=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    on = set()
    for line in out.splitlines():
        words = line.split()
        if "inet" in words:
            on.add(words[words.index("inet") + 1].split("/")[0])
    return [a for a in vrrp["addresses"] if a.split("/")[0] in on]


def take_off(vrrp, say):
    """Take this entry's virtual addresses off its interface (what a keepalived that died left there)."""
    for a in held(vrrp):
        r = subprocess.run(["ip", "addr", "del", a, "dev", vrrp["interface"]], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, universal_newlines=True)
        say("keepalived: %s taken off %s (no keepalived of this deployment holds it)%s"
            % (a, vrrp["interface"], "" if r.returncode == 0 else ": failed, " + r.stderr.strip()))


def ours(cfg):
    """The running supervisor (vrrp-run) of this deployment, identity-checked; None when none runs."""
    return processes.verified(layout.path(cfg["deploy_dir"], layout.KEEPALIVED_PID),
                              layout.tag(cfg["deployment_id"], "keepalived"))


def state(cfg):
    """What status shows (the state probe's `vrrp`): the supervisor's pid, keepalived's, the addresses this
    entry holds, and why keepalived cannot run here (None when it can). cfg: deploy_dir, deployment_id, vrrp."""
    vrrp = cfg["vrrp"]
    sup = ours(cfg)
    main = _bare_pid(layout.path(cfg["deploy_dir"], layout.KEEPALIVED_MAIN_PID)) if sup else None
    return {"pid": sup.pid if sup else None, "keepalived_pid": main, "interface": vrrp["interface"],
            "addresses": vrrp["addresses"], "holds": held(vrrp), "missing": cannot_run(vrrp),
            "binary": binary(vrrp)}


def _bare_pid(path):
    try:
        with open(path) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if processes.alive(pid) else None


def start(cfg, config_path, reload, say):
    """Start the supervisor (and keepalived) unless it runs; a running one re-reads its config when reload."""
    vrrp = cfg["vrrp"]
    missing = cannot_run(vrrp)
    if missing:
        return {"action": "missing", "missing": missing}
    sup = ours(cfg)
    if sup is not None:
        if reload:
            before = held(vrrp)
            os.kill(sup.pid, signal.SIGHUP)
            advert = float(vrrp.get("advert_interval_s", 1.0))
            time.sleep(advert)
            deadline = time.monotonic() + 3 * advert + 1
            while not before <= held(vrrp) and time.monotonic() < deadline:
                time.sleep(0.05)
            return {"action": "reloaded", "pid": sup.pid, "settled": before <= held(vrrp)}
        return {"action": "running", "pid": sup.pid}
    take_off(vrrp, say)
    d = cfg["deploy_dir"]
    out = logfiles.open_append(layout.path(d, layout.KEEPALIVED_LOG), say=True)
    env = dict(os.environ, **{layout.TAG_VAR: layout.tag(cfg["deployment_id"], "keepalived")})
    p = subprocess.Popen([sys.executable, "-m", "hostagent", "vrrp-run", "--config", config_path], cwd=d, env=env,
                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    main = layout.path(d, layout.KEEPALIVED_MAIN_PID)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and p.poll() is None and not (ours(cfg) and _bare_pid(main)):
        time.sleep(0.02)
    if p.poll() is not None or not _bare_pid(main):
        return {"action": "failed", "missing": "keepalived did not start: " + _last_line(layout.path(d, layout.KEEPALIVED_LOG))}
    return {"action": "started", "pid": p.pid}


def stop(cfg, say):
    """Stop the supervisor and keepalived (SIGTERM to its group: keepalived hands the address over at once),
    grace, SIGKILL; the addresses left on the interface are taken off. Its pid, or None when none ran."""
    sup = ours(cfg)
    if sup is not None:
        parts.stop_group(sup.pgid, sup.pid, float(cfg.get("stop_grace_s", 10)) + 5)
        say("keepalived: stopped its supervisor, pid %d" % sup.pid)
    take_off(cfg["vrrp"], say)
    return {"action": "stopped" if sup else "not-running", "pid": sup.pid if sup else None}


def _last_line(path):
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.readlines()[-20:] if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "nothing in %s" % os.path.basename(path)


def _die_with_parent():
    """In keepalived's child before exec: SIGTERM when its supervisor dies (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run(cfg, say):
    """`vrrp-run`: keepalived as a child, supervised (see the module's doc). Returns the exit status."""
    vrrp, d = cfg["vrrp"], cfg["deploy_dir"]
    processes.write_record(layout.path(d, layout.KEEPALIVED_PID), os.getpid(),
                           layout.tag(cfg["deployment_id"], "keepalived"))
    flags = {"stop": False, "reload": False}

    def on_stop(signum, frame):
        flags["stop"] = True

    def on_reload(signum, frame):
        flags["reload"] = True
    signal.signal(signal.SIGTERM, on_stop)      # inv stop, the stop's grace: keepalived hands over, then exit
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_reload)     # deploy changed conf/keepalived.conf: keepalived re-reads it
    argv = [binary(vrrp), "--dont-fork", "--log-console", "--log-detail", "--no-syslog", "--vrrp",
            "-f", layout.path(d, layout.KEEPALIVED_CONF), "-p", layout.path(d, layout.KEEPALIVED_MAIN_PID),
            "-r", layout.path(d, layout.KEEPALIVED_VRRP_PID)]
    starts = []
    code = 0
    while not flags["stop"]:
        take_off(vrrp, say)
        starts = [t for t in starts if time.monotonic() - t < RESTART_WINDOW_S] + [time.monotonic()]
        child = subprocess.Popen(argv, cwd=d, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        say("keepalived: started pid %d (%s on %s)" % (child.pid, ", ".join(vrrp["addresses"]), vrrp["interface"]))
        while child.poll() is None:
            if flags["reload"]:
                flags["reload"] = False
                child.send_signal(signal.SIGHUP)
                say("keepalived: reloading conf/keepalived.conf")
            if flags["stop"]:
                child.terminate()
                try:
                    child.wait(float(cfg.get("stop_grace_s", 10)))
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                break
            time.sleep(0.05)
        take_off(vrrp, say)
        if flags["stop"]:
            say("keepalived: stopped (exit %s)" % child.returncode)
            break
        say("keepalived: pid %d exited (%s)" % (child.pid, child.returncode))
        if len(starts) >= RESTARTS:
            say("keepalived: %d starts within %gs; giving up: see the lines above, then `inv deploy`"
                % (len(starts), RESTART_WINDOW_S))
            code = 1
            break
        time.sleep(RESTART_WAIT_S)
    try:
        os.remove(layout.path(d, layout.KEEPALIVED_PID))
    except OSError:
        pass
    return code
