"""Who holds the accelerator's device files, read on the host: run there as `python3 - SPEC_JSON` with this
file on standard input (bundled with the host agent modules it imports: fleet.transport.hostcode.probe), it prints
one JSON object, hostagent.facts' `Holders`. Standard library and `fuser` (psmisc), Python 3.7+.

SPEC: {"globs": [...], "render_cards": [card index, ...], "sysfs": "/sys", "dev_dri": "/dev/dri", "spare_tags": ["<exact
FLEET_TAG>", ...], "kill": false, "grace_s": 10}. render_cards adds the render node of each of those cards
(DCU, ROCm), found from sysfs rather than assumed to be renderD(128+i). Each holder's kind:
  self        the process running this, one of its ancestors, or in its own session or process group:
              never touched
  other-user  another user's process: never touched, only reported
  spared      a process of this deployment that must live on (another instance during `--instance I`)
  yours       the deploying user's process: killed when "kill" is true (SIGTERM, grace, SIGKILL)
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from dataclasses import asdict

from hostagent import processes
from hostagent.facts import Holder, Holders

# PCI vendors of the cards whose render nodes an engine holds: AMD, and Hygon (Chengdu Haiguang) DCU.
GPU_VENDORS = ("0x1002", "0x1d94")


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def render_nodes(sysfs="/sys", dev_dri="/dev/dri"):
    """The render nodes of the accelerators, card 0 first, from sysfs: the order of the GPU nodes of the
    KFD topology (the order HIP numbers the cards in, so HIP_VISIBLE_DEVICES=i is the i-th), else the
    kernel's order of AMD and Hygon render nodes (a BMC's graphics device has another vendor).
    [] when sysfs shows neither."""
    nodes = os.path.join(sysfs, "class", "kfd", "kfd", "topology", "nodes")
    minors = []
    try:
        names = sorted((n for n in os.listdir(nodes) if n.isdigit()), key=int)
    except OSError:
        names = []
    for n in names:
        props = {}
        for line in (_read(os.path.join(nodes, n, "properties")) or "").splitlines():
            key, _, value = line.partition(" ")
            props[key] = value.strip()
        try:
            minor, simd = int(props.get("drm_render_minor", "0")), int(props.get("simd_count", "0"))
        except ValueError:
            continue
        if minor > 0 and simd > 0:           # a CPU node has no SIMDs and no render node
            minors.append(minor)
    if not minors:
        drm = os.path.join(sysfs, "class", "drm")
        try:
            names = os.listdir(drm)
        except OSError:
            names = []
        for name in names:
            if name.startswith("renderD") and name[len("renderD"):].isdigit():
                vendor = (_read(os.path.join(drm, name, "device", "vendor")) or "").strip().lower()
                if vendor in GPU_VENDORS:
                    minors.append(int(name[len("renderD"):]))
        minors.sort()
    return [os.path.join(dev_dri, "renderD%d" % m) for m in minors]


def card_render_files(cards, sysfs="/sys", dev_dri="/dev/dri"):
    """The render node of each card index in cards; renderD(128+i) only when sysfs lists no card at all."""
    nodes = render_nodes(sysfs, dev_dri)
    if not nodes:
        return [os.path.join(dev_dri, "renderD%d" % (128 + i)) for i in cards]
    return [nodes[i] for i in cards if 0 <= i < len(nodes)]


def holders(spec, fuser):
    """(the device files found, pid -> Holder), from `fuser FILE` on each existing device file."""
    wanted = [p for g in spec["globs"] for p in glob.glob(g)]
    wanted += card_render_files(spec.get("render_cards") or [], spec.get("sysfs") or "/sys",
                                spec.get("dev_dri") or "/dev/dri")
    files = sorted({p for p in wanted if os.path.exists(p)})
    by_pid = {}
    for path in files:
        r = subprocess.run([fuser, path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           universal_newlines=True)
        for word in r.stdout.split():
            digits = "".join(ch for ch in word if ch.isdigit())
            if digits:
                by_pid.setdefault(int(digits), set()).add(path)
    me, guard = os.getuid(), processes.Guard()
    out = {}
    for pid, paths in sorted(by_pid.items()):
        p = processes.read_proc(pid)
        if p is None:
            continue                      # gone meanwhile
        if guard.spares(p):
            kind = "self"
        elif p.uid != me:
            kind = "other-user"
        elif p.tag is not None and p.tag in spec.get("spare_tags", []):
            kind = "spared"
        else:
            kind = "yours"
        out[pid] = Holder(pid=pid, kind=kind, user=processes.user_name(p.uid), uid=p.uid, tag=p.tag,
                          cmdline=p.cmdline[:160], files=sorted(paths), start=p.start)
    return files, out


def kill(found, grace_s):
    """SIGTERM, wait up to grace_s, SIGKILL what is left, wait up to 5 s; the pids still alive. found:
    the holders to kill; a pid is signalled only while it runs with the start time it was found with."""
    starts = {h.pid: h.start for h in found}

    def same(pid):
        st = processes.read_stat(pid)
        return st is not None and st[0] not in ("Z", "X") and st[4] == starts[pid]
    pids = list(starts)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            if same(pid):
                processes._signal(os.kill, pid, sig)
        deadline = time.monotonic() + wait
        while any(same(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [p for p in pids if same(p)]
        if not pids:
            break
    return pids


def main():
    spec = json.loads(sys.argv[1])
    fuser = shutil.which("fuser") or next((p for p in ("/usr/sbin/fuser", "/sbin/fuser", "/bin/fuser")
                                           if os.path.exists(p)), None)
    if fuser is None:
        json.dump(asdict(Holders(error="fuser is not found on the host; install psmisc")), sys.stdout)
        return
    files, found = holders(spec, fuser)
    result = Holders(files=files, holders=list(found.values()))
    if spec.get("kill"):
        doomed = result.of_kind("yours")
        left = kill(doomed, float(spec.get("grace_s", 10)))
        result.killed = [h.pid for h in doomed if h.pid not in left]
        result.survivors = left
    json.dump(asdict(result), sys.stdout)


if __name__ == "__main__":
    main()
