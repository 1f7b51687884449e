"""What `inv doctor` needs to know, read on the host: run there (after env_setup) as `python3 - SPEC_JSON`
with this file on standard input (bundled with the host agent modules it imports: fleet.hostcode.probe),
it prints one JSON object. Standard library only, Python 3.6+, no side effects. The control node turns
these facts into ok/warn/fail lines (fleet/doctor.py).
"""
import json
import os
import shutil
import subprocess
import sys

from hostagent import boothook, instances, processes


def which(name):
    return shutil.which(name) or next((p for p in ("/usr/sbin/" + name, "/sbin/" + name) if os.path.exists(p)),
                                      None)


def run(argv, timeout, shell=False):
    """(exit code or None when not found, last output line)."""
    try:
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                           universal_newlines=True, shell=shell, executable="/bin/bash" if shell else None)
        lines = r.stdout.strip().splitlines()
        return r.returncode, r.stdout if shell else (lines[-1] if lines else "")
    except FileNotFoundError:
        return None, "not found"
    except PermissionError:
        return 126, "not executable"
    except subprocess.TimeoutExpired:
        return 124, "no answer within %ds" % timeout


def model_size(path):
    """(exists, bytes, files) of a model path (a directory of weights or one file)."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        return False, 0, 0
    if os.path.isfile(path):
        return True, os.path.getsize(path), 1
    total = count = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
                count += 1
            except OSError:
                pass
    return True, total, count


def pidfile_pid(path, tag):
    """The pid a pid file records, while that process runs and still is the deployment's."""
    p = processes.verified(path, tag)
    return p.pid if p else None


def port_facts(spec):
    out = []
    for item in spec["ports"]:
        port = item["port"]
        ours = next((pid for pid in (pidfile_pid(os.path.join(spec["deploy_dir"], f), tag)
                                     for f, tag in item["pidfiles"]) if pid), None)
        busy = instances.listening(port, item.get("host", "127.0.0.1"))
        holders = processes.port_holders(port) if busy else []
        tagged = any(processes.ours_by_tag(h, spec["deployment_id"]) for h in holders)
        stranger = processes.stranger(port, holders[0] if holders else {}, item["key"]) if busy else None
        out.append({"port": port, "what": item["what"], "listening": busy, "ours": ours,
                    "holders": holders, "stranger": None if tagged else stranger})
    return out


def disk(path):
    """(directory checked, free bytes) for the nearest existing directory of path."""
    d = os.path.expanduser(path)
    while d and not os.path.isdir(d):
        d = os.path.dirname(d.rstrip("/")) or "/"
    st = os.statvfs(d)
    return d, st.f_bavail * st.f_frsize


def unwritable(path):
    """Why deploy could not create or write deploy_dir (its nearest existing part is a file, or a
    directory this user may not write), or None."""
    d = os.path.expanduser(path)
    while d and not os.path.lexists(d):
        d = os.path.dirname(d.rstrip("/")) or "/"
    if not os.path.isdir(d):
        return "%s is not a directory" % d
    if not os.access(d, os.W_OK | os.X_OK):
        return "%s is not writable by this user" % d
    return None


def memory():
    """MemTotal and MemAvailable in bytes (accelerator cpu: the instances live in RAM)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def cores():
    """The cores this user's processes may run on (the cpuset), or the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def main():
    spec = json.loads(sys.argv[1])
    engine_code, engine_out = run(spec["engine_cmd"], 180)
    exists, size, files = model_size(spec["model"]) if spec["check_model"] else (None, 0, 0)
    smi_code, smi_out = run(spec["smi_cmd"], 60, shell=True)
    where, free = disk(spec["deploy_dir"])
    json.dump({
        "engine": {"exit": engine_code, "output": engine_out[-300:]},
        "model": {"exists": exists, "bytes": size, "files": files},
        "ports": port_facts(spec),
        "smi": {"exit": smi_code, "output": smi_out},
        "tools": {name: which(name) for name in ("fuser", "ss")},
        "disk": {"dir": where, "free": free, "unwritable": unwritable(spec["deploy_dir"])},
        "memory": memory(),
        "cores": cores(),
        "sim_devices": os.path.isdir(os.path.join(spec["deploy_dir"], "sim-dev")),
        "boot": boothook.detect(),
    }, sys.stdout)


if __name__ == "__main__":
    main()
