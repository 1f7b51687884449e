"""The memory of each `cpu` instance, read from /proc on the host: where there is no smi, this stands in
for one. Run there as `python3 -c SOURCE SPEC_JSON` (bundled with the host agent modules it imports by
fleet.transport.hostcode.probe); it prints what `rocm-smi --json` prints (one "card" per instance, MiB), so
fleet.host.smi reads it with the same parser and `inv stop` shows the same table.

SPEC: {"deploy_dir": ..., "deployment_id": ..., "instances": N}. An instance's processes are this user's
processes that carry its FLEET_TAG (start_cluster.sh exports SPT_NOENV=1, so vLLM's renamed EngineCore
and Worker keep it) or belong to its session (the instance leads one; the pid file names its leader).
"Used" is the sum of their resident memory: 0 exactly when none of them is left. Standard library only.
"""
import json
import os
import sys

from hostagent import layout, processes


def meminfo_mib(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def process(pid):
    """(tag, session, rss MiB) of one of this user's live processes, or None."""
    d = "/proc/%d" % pid
    try:
        if os.stat(d).st_uid != os.getuid():
            return None
        with open(d + "/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return None
        tag, key = None, layout.TAG_VAR.encode() + b"="
        with open(d + "/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(key):
                    tag = kv[len(key):].decode("utf-8", "replace")
                    break
        rss = 0.0
        with open(d + "/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024.0
        return tag, int(fields[3]), rss
    except (OSError, ValueError, IndexError):
        return None


def main():
    spec = json.loads(sys.argv[1])
    n, dep = spec["instances"], spec["deployment_id"]
    sessions = {}
    for i in range(n):
        sid = processes.recorded_session(layout.path(spec["deploy_dir"], layout.instance_pidfile(i)))
        if sid:
            sessions[sid] = i
    used = [0.0] * n
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        found = process(int(name))
        if found is None:
            continue
        tag, sid, rss = found
        index = layout.tag_instance(tag, dep)
        if index is None:
            index = sessions.get(sid)
        if index is not None and index < n:
            used[index] += rss
    total = meminfo_mib("MemTotal")
    json.dump({"card%d" % i: {"vram Total Memory (MiB)": round(total), "vram Total Used Memory (MiB)": round(u, 1)}
               for i, u in enumerate(used)}, sys.stdout)


if __name__ == "__main__":
    main()
