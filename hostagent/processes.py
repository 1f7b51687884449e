"""The deployment's processes: who they are, proven before any signal, and how they are stopped.

A pid file (`run/instance_<i>.pid`, `run/proxy.pid`, `run/nginx.pid`, `run/nginx_watch.pid`, ...) holds one
identity record: `pid=P pgid=G sid=S start=T tag=TAG`, where T is field 22 of /proc/P/stat (clock ticks
since boot; a reused pid has another) and TAG the process's FLEET_TAG. The seed's `P [G]` is still read.

A live process of this user is the deployment's when
  * it is the one a pid file records (same pid, same start time, no other tag), or
  * its environment carries the deployment's FLEET_TAG, or
  * it is in the session (or process group) of a process proven so: instances run under setsid, and
    vLLM's EngineCore and Workers stay in that session after their parent dies, even when setproctitle
    erased their environment. A session whose leader died counts while its members started no earlier
    than the recorded leader (the kernel does not hand out the number again while the session has members).
Never signalled, whatever a file says: pid 0 and 1, this process, its ancestors, and every process in
its own process group or session; and nothing of another user.

Standard library only, Python 3.6+, no import of the rest of the package but `layout` and `files`: the file
also runs alone, `python3 - stop SPEC_JSON [--instance I | --proxy] [--check]` with this file (and those two,
fleet.transport.hostcode) on standard input, so `inv stop` works where deploy never put the code
(bin/stop_cluster.sh runs the deployed copy).
"""
import json
import os
import shutil
import signal
import sys
import time

from hostagent import files, layout  # in the package, or bundled in front by fleet.transport.hostcode

PROTECTED = (0, 1)


class Proc(object):
    """One process as /proc shows it."""

    __slots__ = ("pid", "ppid", "pgid", "sid", "start", "state", "uid", "tag", "cmdline")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    @property
    def alive(self):
        return self.state not in ("Z", "X")

    def show(self, width=80):
        """`pid 123 (VLLM::EngineCore)`: the pid and the command line, cut to width."""
        return "pid %d (%s)" % (self.pid, self.cmdline[:width])


def read_stat(pid):
    """(state, ppid, pgid, sid, start) of pid from /proc/PID/stat; None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            text = f.read().decode("ascii", "replace")
    except (OSError, ValueError):
        return None
    fields = text.rsplit(")", 1)[-1].split()   # the command name may hold spaces and parentheses
    try:
        # fields[0] is field 3 of proc(5): state; 4 ppid; 5 pgrp; 6 session; 22 starttime.
        return fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
    except (IndexError, ValueError):
        return None


def read_tag(pid):
    """The FLEET_TAG value in pid's environment; None when absent or unreadable."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            env = f.read()
    except OSError:
        return None
    key = layout.TAG_VAR.encode() + b"="
    for kv in env.split(b"\0"):
        if kv.startswith(key):
            return kv[len(key):].decode("utf-8", "replace")
    return None


def read_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def read_proc(pid, environ=True):
    """A Proc for pid, or None when it is gone; environ: read its tag (only this user's can be)."""
    st = read_stat(pid)
    if st is None:
        return None
    try:
        uid = os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None
    tag = read_tag(pid) if environ and uid == os.getuid() else None
    return Proc(pid=pid, state=st[0], ppid=st[1], pgid=st[2], sid=st[3], start=st[4], uid=uid, tag=tag,
                cmdline=read_cmdline(pid))


def snapshot():
    """pid -> Proc of every process now; the environment is read only for this user's."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = read_proc(int(name))
            if p is not None:
                procs[p.pid] = p
    return procs


def alive(pid):
    """True when pid runs (a zombie does not count)."""
    if not pid or pid < 0:
        return False
    st = read_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


# --- identity records (the pid file contract) ---------------------------------------------------

class RecordError(ValueError):
    """A pid file that cannot be read; the message says what is wrong with it."""


FIELDS = ("pid", "pgid", "sid", "start", "tag")


def parse_record(data):
    """The record in a pid file's content (bytes or text): dict with pid, pgid, sid, start, tag
    (None when not recorded). `pid=P pgid=G sid=S start=T tag=TAG`, or the seed's `P [G]`."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise RecordError("holds bytes that are not UTF-8 text")
    words = data.split()
    if not words:
        raise RecordError("is empty")
    rec = dict.fromkeys(FIELDS)
    try:
        if "=" in words[0]:
            for w in words:
                key, sep, value = w.partition("=")
                if not sep:
                    raise ValueError(w)
                if key == "tag":
                    rec["tag"] = value
                elif key in FIELDS:
                    rec[key] = int(value)
                # other keys: written by a later version; ignored
            if rec["pid"] is None:
                raise ValueError("no pid")
        else:
            if len(words) > 2:
                raise ValueError(data)
            rec["pid"] = int(words[0])
            rec["pgid"] = int(words[1]) if len(words) > 1 else None
    except ValueError:
        shown = data.strip().replace("\n", " ")
        raise RecordError("does not hold a pid record (%r)" % (shown[:40] + ("..." if len(shown) > 40 else "")))
    return rec


def format_record(pid, pgid, sid, start, tag):
    """The one line a pid file holds."""
    line = "pid=%d pgid=%d sid=%d start=%d" % (pid, pgid, sid, start)
    return line + (" tag=%s" % tag if tag else "") + "\n"


def record_of(pid, tag=None):
    """The record of a live process (its tag from its environment unless given); None when gone."""
    st = read_stat(pid)
    if st is None:
        return None
    return format_record(pid, st[2], st[3], st[4], tag if tag is not None else read_tag(pid))


def write_record(path, pid, tag=None):
    """Write pid's record to path atomically; False when the process is already gone."""
    line = record_of(pid, tag)
    if line is None:
        return False
    files.write_atomic(path, line)
    return True


def read_record_file(path):
    """(record, None), (None, why) for a file that cannot be read, or (None, None) when there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, "cannot be opened (%s)" % (e.strerror or e)
    try:
        return parse_record(data), None
    except RecordError as e:
        return None, str(e)


def check_record(rec, tag, proc):
    """Why the live process `proc` is not the one `rec` records for `tag`; None when it is.

    proc: the Proc now running under rec's pid (None when none runs)."""
    pid = rec["pid"]
    if pid in PROTECTED or pid < 0:
        return "which is never signalled"
    if proc is None or not proc.alive:
        return "which no longer runs"
    if proc.uid != os.getuid():
        return "which is another user's"
    if rec["start"] is not None and proc.start != rec["start"]:
        return "started at another time"
    if proc.tag is not None and proc.tag != tag:
        return "which carries another tag (%s)" % proc.tag
    if rec["start"] is None and proc.tag != tag:
        return "which does not carry the deployment's tag"
    return None


def read_pidfile(path, tag):
    """The one reader of a pid file of the deployment's part `tag`, identity checked: (proc, record, why).
    proc: the live process it records while that still is the one (start time, tag), else None; record:
    what the file holds (None: no file, or unreadable); why: why the file does not count (None when it
    does, or when there is no file)."""
    rec, why = read_record_file(path)
    if rec is None:
        return None, None, why
    proc = read_proc(rec["pid"]) if rec["pid"] > 0 else None
    why = check_record(rec, tag, proc)
    return (proc if why is None else None), rec, why


def verified(path, tag):
    """The live process a pid file records, when it is still that process; else None: a stale file is
    never acted on."""
    return read_pidfile(path, tag)[0]


def recorded_session(path):
    """The session a pid file records (`sid=S`; the seed's `P [G]`: its leader's pid), whether or not its
    process still runs: its engine children stay in it, renamed or orphaned. None without a record."""
    rec, _ = read_record_file(path)
    if rec is None:
        return None
    return rec["sid"] if rec["sid"] is not None else rec["pid"]


# --- who must never be signalled ----------------------------------------------------------------

class Guard(object):
    """This process, its ancestors, and its own process group and session: never signalled."""

    def __init__(self):
        self.pids = set(PROTECTED) | {os.getpid()}
        pid = os.getppid()
        while pid > 1 and pid not in self.pids:
            self.pids.add(pid)
            st = read_stat(pid)
            if st is None:
                break
            pid = st[1]
        self.pgid = os.getpgid(0)
        self.sid = os.getsid(0)

    def spares(self, proc):
        return (proc.pid in self.pids or proc.pgid in PROTECTED or proc.sid in PROTECTED
                or proc.pgid == self.pgid or proc.sid == self.sid)


# --- listeners ----------------------------------------------------------------------------------

def listeners(ports):
    """port -> list of (pid or None, uid) holding a listening TCP socket on it (pid None: the socket's
    owner is another user, whose file descriptors cannot be read)."""
    ports = set(ports)
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != "0A":          # 0A: LISTEN
                continue
            port = int(parts[1].rsplit(":", 1)[1], 16)
            if port in ports:
                inodes[parts[9]] = (port, int(parts[7]))
    found = {}
    if not inodes:
        return found
    seen = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir("/proc/%s/fd" % name)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink("/proc/%s/fd/%s" % (name, fd))
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                port, uid = inodes[link[8:-1]]
                if (port, int(name)) not in seen:
                    seen.add((port, int(name)))
                    found.setdefault(port, []).append((int(name), uid))
                seen.add(link[8:-1])
    for inode, (port, uid) in inodes.items():
        if inode not in seen:
            found.setdefault(port, []).append((None, uid))
    return found


def port_holders(port):
    """Who listens on port: [{"pid", "cmdline", "user", "tag"}] (pid None: another user's process, whose
    file descriptors cannot be read)."""
    out = []
    for pid, uid in listeners([port]).get(port, []):
        p = read_proc(pid) if pid else None
        out.append({"pid": pid, "cmdline": p.cmdline[:100] if p else "", "user": user_name(uid),
                    "tag": p.tag if p else None})
    return out


def stranger(port, holder, key):
    """The sentence for a port held by a process that is not the deployment's. holder: a port_holders
    record ({} when none is visible); key: the inventory key that moves the port."""
    if holder.get("pid"):
        who = "pid %d (%s)" % (holder["pid"], holder["cmdline"])
    elif holder.get("user"):
        who = "a process of user %s" % holder["user"]
    else:
        who = "a process you cannot see"
    return "port %d is held by %s, which is not this deployment's; stop it yourself or change %s" % (port, who, key)


def ours_by_tag(holder, deployment_id):
    """Whether a port holder carries a tag of the deployment (its own leftover, not a stranger)."""
    return bool(holder) and (holder.get("tag") or "").startswith(layout.tag_prefix(deployment_id))


def user_name(uid):
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


# --- the deployment's members -------------------------------------------------------------------

class Target(object):
    """One thing of the deployment: a name (`instance 2`), its pid file, its tag, a port to name."""

    def __init__(self, name, pidfile, tag, port=None, fix=None):
        self.name, self.pidfile, self.tag, self.port, self.fix = name, pidfile, tag, port, fix
        self.record = None        # the pid file's record, when readable
        self.sessions = {}        # sid -> earliest start a member may have (None: any)
        self.groups = set()


def targets(spec, only=None, proxy_only=False, everything=False, keeper_only=False):
    """The targets of a stop. only: one instance index; proxy_only: the proxy alone; keeper_only: the
    keeper alone; everything: all targets whatever is asked (to tell the deployment's port holders from
    strangers)."""
    d, dep = spec["deploy_dir"], spec["deployment_id"]

    def target(name, pidfile, what, port=None, fix=None):
        return Target(name, layout.path(d, pidfile), layout.tag(dep, what), port, fix)
    keeper = target("keeper", layout.KEEPER_PID, "keeper")
    if keeper_only:
        return [keeper]
    fronts = [keeper,
              target("proxy", layout.PROXY_PID, "proxy", spec.get("proxy_port"), "proxy.port"),
              target("nginx watcher", layout.NGINX_WATCH_PID, "nginx-watch"),
              target("nginx", layout.NGINX_PID, "nginx"),
              target("keepalived", layout.KEEPALIVED_PID, "keepalived")]
    insts = [target("instance %d" % i, layout.instance_pidfile(i), i, spec["base_port"] + i, "base_port")
             for i in range(spec["instances"])]
    try:
        extra = sorted(i for i in map(layout.pidfile_instance, os.listdir(layout.path(d, layout.RUN)))
                       if i is not None)
    except OSError:
        extra = []
    insts += [target("instance %d" % i, layout.instance_pidfile(i), i)
              for i in extra if i >= spec["instances"]]      # from an earlier, larger deploy
    if everything or (only is None and not proxy_only):
        return fronts + insts
    if proxy_only:
        return fronts[1:2]
    return [t for t in insts if t.name == "instance %d" % only]


class Finding(object):
    """Where a stop stands: what each target's pid file says, and which processes are the deployment's."""

    def __init__(self):
        self.lines = []            # what to say, in order
        self.members = {}          # pid -> (target, how identified)
        self.stale = []            # pid files to remove: not ours, or unreadable
        self.spared = {}           # pid -> why a would-be member is not signalled
        self.targets = []          # the targets, with those found by a tag of the deployment alone


def identify(spec, tlist, procs, guard, say_files=True, any_tag=False):
    """Which live processes are the deployment's, for each target in tlist (see the module's doc).
    any_tag: a process carrying any tag of the deployment counts (a whole stop), not only the targets'."""
    me = os.getuid()
    dep = spec["deployment_id"]
    found = Finding()
    by_tag = {t.tag: t for t in tlist}

    def add(proc, target, how):
        if proc.pid in found.members or proc.pid in found.spared or not proc.alive or proc.uid != me:
            return
        if guard.spares(proc):
            found.spared[proc.pid] = (target, how)
            return
        found.members[proc.pid] = (target, how)

    for t in tlist:
        rec, why = read_record_file(t.pidfile)
        rel = os.path.relpath(t.pidfile, spec["deploy_dir"])
        if why:
            if say_files:
                found.lines.append("%s: %s %s: not read; its processes are looked for by tag" % (t.name, rel, why))
            found.stale.append(t.pidfile)
            continue
        if rec is None:
            continue
        t.record = rec
        proc = procs.get(rec["pid"]) if rec["pid"] > 0 else None
        why = check_record(rec, t.tag, proc)
        if why is None:
            add(proc, t, "pid file record of %s" % t.name)
            # Its session and group are the deployment's only when it leads them (setsid at start).
            if proc.sid == proc.pid:
                t.sessions[proc.sid] = None
            if proc.pgid == proc.pid:
                t.groups.add(proc.pgid)
        elif why == "which no longer runs":
            # The leader is gone; its session may live on (orphaned EngineCore and Workers).
            if rec["sid"] is not None and rec["start"] is not None and rec["sid"] == rec["pid"]:
                t.sessions[rec["sid"]] = rec["start"]
        else:
            if say_files:
                found.lines.append("%s: pid file names pid %d, %s: not ours, not touched" % (t.name, rec["pid"], why))
            found.stale.append(t.pidfile)

    # By tag: exact tags of the targets; a tagged process that leads its session brings the session.
    for p in procs.values():
        if p.uid != me or p.tag is None or not p.alive:
            continue
        t = by_tag.get(p.tag)
        if t is None and any_tag and p.tag.startswith(layout.tag_prefix(dep)):
            t = by_tag[p.tag] = Target("tag %s" % p.tag, None, p.tag)
            tlist = tlist + [t]
        if t is None:
            continue
        add(p, t, "%s=%s" % (layout.TAG_VAR, p.tag))
        if p.sid == p.pid and p.sid not in t.sessions:
            t.sessions[p.sid] = None
    # By session, then by process group, of what is proven ours.
    for t in tlist:
        for sid, since in t.sessions.items():
            if sid in PROTECTED:
                continue
            for p in procs.values():
                if p.sid == sid and p.uid == me and (since is None or p.start >= since):
                    if p.tag is not None and not p.tag.startswith(layout.tag_prefix(dep)):
                        continue        # another deployment's, or a user's tagged process: not by session
                    add(p, t, "session %d of %s" % (sid, t.name))
        for g in t.groups:
            if g in PROTECTED:
                continue
            for p in procs.values():
                if p.pgid == g and p.uid == me:
                    add(p, t, "process group %d of %s" % (g, t.name))
    found.targets = tlist
    return found


def foreign_holders(spec, tlist, found, procs):
    """One sentence per port of tlist held by a process that is not the deployment's."""
    ports = {t.port: t for t in tlist if t.port}
    lines = []
    for port, holders in sorted(listeners(ports).items()):
        for pid, uid in holders:
            if pid is not None and pid in found.members:
                continue
            if pid is not None and (pid in found.spared or pid in procs and procs[pid].tag is not None
                                    and procs[pid].tag.startswith(layout.tag_prefix(spec["deployment_id"]))):
                continue
            p = procs.get(pid) if pid is not None else None
            holder = {"pid": pid, "cmdline": p.cmdline[:100] if p else "?", "user": user_name(uid)}
            lines.append(stranger(port, holder, ports[port].fix or "the port"))
    return lines


# --- stopping -----------------------------------------------------------------------------------

def _signal(kill, pid, sig):
    if pid in PROTECTED or pid < 0:       # a group or every process: never, whatever the caller holds
        raise ValueError("refusing to signal pid %d" % pid)
    try:
        kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop(spec, only=None, proxy_only=False, check=False, kill=os.kill, say=print, grace_s=None,
         keeper_only=False):
    """Stop the deployment's processes (all, instance `only`, the proxy alone or the keeper alone): SIGTERM
    to each member, up to grace_s for them to go, SIGKILL to what is left. kill(pid, sig) sends the
    signals (replaceable in tests). Returns the pids of the deployment still alive at the end (empty:
    done). A whole stop stops the keeper first, alone: once it is gone nothing restarts what the stop
    takes down (a restart it had begun is cancelled; what it started already is the deployment's)."""
    grace_s = float(spec.get("grace_s", 10) if grace_s is None else grace_s)
    whole = only is None and not proxy_only and not keeper_only
    if whole and not check:
        stop(spec, check=False, kill=kill, say=say, grace_s=grace_s, keeper_only=True)
    guard = Guard()
    tlist = targets(spec, only, proxy_only, keeper_only=keeper_only)
    procs = snapshot()
    found = identify(spec, tlist, procs, guard, any_tag=whole)
    # Every part of the deployment, so that a port held by another part of it is not a stranger's.
    allf = found if whole else identify(spec, targets(spec, everything=True), procs, guard, False, True)
    for line in found.lines:
        say(line)
    for pid, (t, how) in sorted(found.spared.items()):
        say("%s: %s: %s, but in this stop's own session, process group or ancestry: not touched"
            % (t.name, procs[pid].show(), how))
    for line in foreign_holders(spec, tlist, allf, procs):
        say(line)
    members = dict(found.members)
    for t in found.targets:
        if t.record is not None and not any(v[0] is t for v in list(members.values()) +
                                            list(found.spared.values())) and t.pidfile not in found.stale:
            say("%s: pid %d no longer runs, and nothing of it is left" % (t.name, t.record["pid"]))
    for pid, (t, how) in sorted(members.items(), key=lambda kv: (kv[1][0].name, kv[0])):
        say("%s: %s %s: %s" % (t.name, "would stop" if check else "stopping", procs[pid].show(), how))
    if check:
        return sorted(members)
    # Kept with its start time: a pid that dies during the grace period and is reused is left alone.
    starts = {pid: procs[pid].start for pid in members}
    for pid in members:
        _signal(kill, pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    next_scan = time.monotonic() + 0.5
    live = _still(starts)
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        if time.monotonic() >= next_scan:
            # Children forked meanwhile (a session's new member) are the deployment's too.
            next_scan = time.monotonic() + 0.5
            again = identify(spec, targets(spec, only, proxy_only, keeper_only=keeper_only), snapshot(), guard,
                             False, whole)
            for pid, (t, how) in again.members.items():
                p = read_proc(pid)
                if pid not in starts and p is not None:
                    say("%s: stopping %s: %s" % (t.name, p.show(), how))
                    starts[pid] = p.start
                    members[pid] = (t, how)
                    _signal(kill, pid, signal.SIGTERM)
        live = _still(starts)
    for pid in live:
        if _signal(kill, pid, signal.SIGKILL):
            say("%s: pid %d killed (SIGKILL after %gs)" % (members[pid][0].name, pid, grace_s))
    deadline = time.monotonic() + 5
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = _still({p: starts[p] for p in live})
    for t in found.targets:
        n = sum(1 for pid, v in members.items() if v[0].name == t.name and pid not in live)
        if n:
            say("%s: stopped %d process%s" % (t.name, n, "" if n == 1 else "es"))
    _remove_files(tlist, found, keep={members[p][0].name for p in live})
    if whole and not live:
        # The engines' IPC sockets (each engine's own, left behind by one killed): gone with the last engine.
        shutil.rmtree(layout.path(spec["deploy_dir"], layout.IPC_DIR), ignore_errors=True)
    return sorted(live)


def _still(starts):
    """The pids of starts still running as the same process (same start time)."""
    out = []
    for pid, start in starts.items():
        st = read_stat(pid)
        if st is not None and st[0] not in ("Z", "X") and st[4] == start:
            out.append(pid)
    return out


def _remove_files(tlist, found, keep=()):
    """Remove the pid files (and ready markers) of the targets stopped, and the stale ones."""
    for t in tlist:
        if t.name in keep or t.pidfile is None:
            continue
        for path in (t.pidfile, t.pidfile[:-len(".pid")] + ".ready"):
            try:
                os.remove(path)
            except OSError:
                pass
    for path in found.stale:
        try:
            os.remove(path)
        except OSError:
            pass


def main(argv=None):
    """`processes.py stop SPEC_JSON [--instance I | --proxy] [--check]`: exit 0 when nothing of the
    deployment is left running, 1 when something is, 64 on a usage error."""
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: stop_cluster.sh [--instance I | --proxy | --keeper] [--check]"
    if len(argv) < 2 or argv[0] != "stop":
        print(usage, file=sys.stderr)
        return 64
    spec = json.loads(argv[1])
    only, proxy_only, keeper_only, check = None, False, False, False
    rest = argv[2:]
    while rest:
        a = rest.pop(0)
        if a == "--instance" and rest and rest[0].isdigit():
            only = int(rest.pop(0))
        elif a == "--proxy":
            proxy_only = True
        elif a == "--keeper":
            keeper_only = True
        elif a == "--check":
            check = True
        else:
            print(usage, file=sys.stderr)
            return 64
    if (only is not None) + proxy_only + keeper_only > 1:
        print(usage, file=sys.stderr)
        return 64
    say = lambda line: print(line, flush=True)     # noqa: E731
    grace = os.environ.get("GRACE_S")
    try:
        grace_s = float(grace) if grace else None
    except ValueError:
        print("GRACE_S must be a number of seconds, got %r" % grace, file=sys.stderr)
        return 64
    left = stop(spec, only, proxy_only, check, say=say, grace_s=grace_s, keeper_only=keeper_only)
    if left and not check:
        say("left running: " + ", ".join(str(p) for p in left))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
