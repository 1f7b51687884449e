"""Who holds the accelerator's device files, read on the host: run there as `python3 - SPEC_JSON` with this
file on standard input, it prints one JSON object. Standard library and `fuser` (psmisc), Python 3.6+.

SPEC: {"globs": [...], "spare_tags": ["<exact FLEET_TAG>", ...], "kill": false,
"grace_s": 10}. Each holder is classed:
  self        the process running this, or one of its ancestors: never touched
  other-user  another user's process: never touched, only reported
  spared      a process of this deployment that must live on (another instance during `--instance I`)
  yours       the deploying user's process: killed when "kill" is true (SIGTERM, grace, SIGKILL)
"""
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time


def ancestors():
    """This process and every ancestor up to pid 1."""
    found, pid = set(), os.getpid()
    while pid > 0 and pid not in found:
        found.add(pid)
        try:
            with open("/proc/%d/status" % pid) as f:
                pid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            break
    return found


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def info(pid):
    """uid, user, tag (None when unreadable or absent) and command line of a process."""
    uid = os.stat("/proc/%d" % pid).st_uid
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    tag = None
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"FLEET_TAG="):
                    tag = kv[len("FLEET_TAG="):].decode("utf-8", "replace")
                    break
    except OSError:
        pass
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    return uid, user, tag, cmd[:160]


def holders(spec, fuser):
    """pid -> holder record, from `fuser FILE` on each existing device file."""
    files = sorted({p for g in spec["globs"] for p in glob.glob(g)})
    by_pid = {}
    for path in files:
        r = subprocess.run([fuser, path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           universal_newlines=True)
        for word in r.stdout.split():
            digits = "".join(ch for ch in word if ch.isdigit())
            if digits:
                by_pid.setdefault(int(digits), set()).add(path)
    me, mine = os.getuid(), ancestors()
    out = {}
    for pid, paths in sorted(by_pid.items()):
        try:
            uid, user, tag, cmd = info(pid)
        except OSError:
            continue                      # gone meanwhile
        if pid in mine:
            klass = "self"
        elif uid != me:
            klass = "other-user"
        elif tag is not None and tag in spec.get("spare_tags", []):
            klass = "spared"
        else:
            klass = "yours"
        out[pid] = {"pid": pid, "user": user, "uid": uid, "tag": tag, "cmdline": cmd, "class": klass,
                    "files": sorted(paths)}
    return files, out


def kill(pids, grace_s):
    """SIGTERM, wait up to grace_s, SIGKILL what is left, wait up to 5 s; the pids still alive."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            if alive(pid):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + wait
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [p for p in pids if alive(p)]
        if not pids:
            break
    return pids


def main():
    spec = json.loads(sys.argv[1])
    fuser = shutil.which("fuser") or next((p for p in ("/usr/sbin/fuser", "/sbin/fuser", "/bin/fuser")
                                           if os.path.exists(p)), None)
    if fuser is None:
        json.dump({"error": "fuser is not found on the host; install psmisc"}, sys.stdout)
        return
    files, found = holders(spec, fuser)
    result = {"files": files, "holders": list(found.values()), "killed": [], "survivors": []}
    if spec.get("kill"):
        targets = [h["pid"] for h in found.values() if h["class"] == "yours"]
        left = kill(targets, float(spec.get("grace_s", 10)))
        result["killed"] = [p for p in targets if p not in left]
        result["survivors"] = left
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
