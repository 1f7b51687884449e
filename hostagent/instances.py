"""One instance, as status and the keeper both see it: /health, its recorded process, what still holds its
card, its log, the wait for /health, and `classify`, the one state machine that names its state.

Standard library only, Python 3.6+ (the state probe bundles it and runs with whatever python3 the host has).
"""
import os
import socket
import time

from hostagent import httpcall, layout, processes

# `inv status --json` states: an instance's state is one of these (the control node adds `crashloop`
# from the keeper's record).
STATES = ("loading", "healthy", "dead", "stopped", "port-taken")
# Why an instance is dead, as the keeper counts its restarts (it adds "stalled", from its stall probe).
REASONS = ("exited", "unhealthy", "start-timeout")


class Cancelled(Exception):
    """A wait was asked to stop (the keeper got SIGTERM): nothing more is started."""


def classify(alive, pidfile, health, was_ready, age_s, health_timeout_s, listening=False):
    """(state, reason) of one instance from what was read of it:

    alive: the process its pid file records runs and is still that one; pidfile: the pid file exists;
    health: the status of GET /health (None: no answer); was_ready: it answered 200 since this start
    (the run/instance_<i>.ready marker); age_s: seconds since its pid file was written (None: unknown);
    listening: something answers on its port (read when it is not alive).

    state is one of STATES; reason, why it is dead (one of REASONS), else None:
    - alive: healthy on 200; dead ("unhealthy") when it was healthy once since its start (an engine that
      died under its API server); dead ("start-timeout") when it never was, health_timeout_s after its
      start; else loading. An instance still loading is never dead.
    - not alive: port-taken when something else holds its port, dead ("exited") when its pid file is
      there, stopped when it is not (the operator stopped it).
    """
    if alive:
        if health == 200:
            return "healthy", None
        if was_ready:
            return "dead", "unhealthy"
        if (age_s or 0) > health_timeout_s:
            return "dead", "start-timeout"
        return "loading", None
    reason = "exited" if pidfile else None
    if listening:
        return "port-taken", reason
    return ("dead" if pidfile else "stopped"), reason


# --- facts ----------------------------------------------------------------------------------------

def url(inst):
    """Where an instance answers: its bind address (loopback unless another host fronts it) and port."""
    return httpcall.base_url(inst.get("address") or "127.0.0.1", inst["port"])


def health(base_url, timeout=2.0):
    """The status of GET /health on an instance (base_url as `url` makes it), None when nothing answers."""
    return httpcall.get(base_url + "/health", timeout).status     # None too for a stranger speaking no HTTP


def listening(port, host="127.0.0.1"):
    """Whether something accepts connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def recorded_pid(deploy_dir, deployment_id, i):
    """The pid instance i's pid file records, while that very process (start time, tag) runs."""
    p = processes.verified(layout.path(deploy_dir, layout.instance_pidfile(i)), layout.tag(deployment_id, i))
    return p.pid if p else None


def recorded_session(deploy_dir, i):
    """The session instance i's pid file records (its engine children stay in it, renamed or orphaned)."""
    return processes.recorded_session(layout.path(deploy_dir, layout.instance_pidfile(i)))


def members(tag, sid):
    """This user's live processes carrying FLEET_TAG=tag, or in the recorded session sid."""
    me = os.getuid()
    return sorted(p.pid for p in processes.snapshot().values()
                  if p.alive and p.uid == me and (p.tag == tag or (sid and p.sid == sid)))


def card_holders(files):
    """The live processes (those this user may look into) holding one of files open."""
    wanted = {os.path.realpath(f) for f in files if os.path.exists(f)}
    if not wanted:
        return []
    found = []
    for pid in sorted(processes.snapshot()):
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink("/proc/%d/fd/%s" % (pid, fd)) in wanted:
                    if processes.alive(pid):
                        found.append(pid)
                    break
            except OSError:
                continue
    return found


def leftovers(cfg, i, sid):
    """What still keeps instance i's card: its device files' holders, and its processes (by tag, or in
    the session sid its pid file recorded before the stop)."""
    inst = cfg["instances"][i]
    return sorted(set(card_holders(inst["card_files"])) | set(members(layout.tag(cfg["deployment_id"], i), sid)))


def log_tail(path, n=10):
    """The last n lines of a text file (read from its last 64 KiB), [] when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            return [line.decode("utf-8", "replace") for line in f.read().splitlines()[-n:]]
    except OSError:
        return []


def log_line(path, n=5):
    """The last n lines of a log on one line, for a one-sentence error."""
    return " | ".join(line.strip() for line in log_tail(path, n)) or "(no log)"


def engine_log_tail(deploy_dir, i, n=10):
    """The last n lines of instance i's engine log."""
    return log_tail(layout.path(deploy_dir, layout.instance_log(i)), n)


# --- the wait for /health -------------------------------------------------------------------------

def sleep(seconds, cancelled=lambda: False):
    """Sleep, asking cancelled() every 50 ms; Cancelled when it says True."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cancelled():
            raise Cancelled()
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def wait_healthy(cfg, indexes, say=print, cancelled=lambda: False):
    """Wait until each started instance of indexes answers /health 200, at most health_timeout_s, with a
    line as each comes up. One step per instance (name, status, message), in the order they settled:
    changed when healthy, failed when it exited or timed out (with its engine log's last lines)."""
    t0 = time.monotonic()
    waiting = list(indexes)
    steps = []
    while waiting:
        elapsed = time.monotonic() - t0
        for i in list(waiting):
            port = cfg["instances"][i]["port"]
            pid = recorded_pid(cfg["deploy_dir"], cfg["deployment_id"], i)
            if pid and health(url(cfg["instances"][i])) == 200:
                say("instance %d: healthy on :%d after %.1fs" % (i, port, elapsed))
                steps.append({"name": "instance %d" % i, "status": "changed",
                              "message": "started, pid %d, healthy on :%d" % (pid, port)})
            elif not pid or elapsed > cfg["health_timeout_s"]:
                why = "exited" if not pid else "not healthy after %gs" % cfg["health_timeout_s"]
                tail = "\n".join("    " + line for line in engine_log_tail(cfg["deploy_dir"], i, 15)) or "    (empty)"
                steps.append({"name": "instance %d" % i, "status": "failed",
                              "message": "%s on :%d; last lines of %s:\n%s" % (why, port, layout.instance_log(i),
                                                                                tail)})
            else:
                continue
            waiting.remove(i)
        if waiting:
            sleep(0.2, cancelled)
    return steps
