"""The boot hook: what brings a deployment back after the host reboots, without root.

Two kinds, the first the host allows:
- `systemd`: a systemd user unit, where lingering is on for the user (`loginctl show-user USER` says
  Linger=yes) and `systemctl --user` answers. The unit runs `bin/boot.sh --watch`: the boot, then the
  keeper's watchdog every minute; Restart= brings the unit itself back.
- `cron`: two lines in the user's crontab, each ending with a comment that names the deployment (so they
  are found and removed exactly, and no other line of the crontab is touched): `@reboot bin/boot.sh`, and
  every minute `bin/boot.sh --keeper`, the watchdog (a no-op while the keeper lives).

Run on the host as a script sent on standard input (`python - COMMAND ...`; fleet.transport.agent.run_module), so
it works where nothing is deployed (a stop removes the hook even then); the probes import it too.
Commands, each printing one JSON line:
    detect                                  which kind the host allows, or what is missing
    install DEPLOY_DIR DEPLOYMENT_ID KIND WATCHDOG   (KIND auto, cron or systemd; WATCHDOG 1 or 0)
    remove DEPLOYMENT_ID                    every hook of the deployment, whatever its kind
    show DEPLOYMENT_ID                      the installed hook: {"kind", "command"}, or null
Standard library only, Python 3.6+.
"""
import fcntl
import json
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys

from hostagent import layout

MARK = "# vllm-fleet boot "              # a crontab line of ours ends with MARK + deployment id
SBIN = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
CRON_DAEMONS = ("cron", "crond", "cronie", "busybox-crond")


class BootHookError(Exception):
    """A hook that could not be read, written or removed: one sentence."""


def _which(name):
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", "")] + list(SBIN)))


def _run(argv, stdin=None, timeout=15):
    """(exit code, stdout, stderr); exit None when the command is not found or hangs."""
    try:
        r = subprocess.run(argv, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           universal_newlines=True, timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, "", str(e)


def user():
    return pwd.getpwuid(os.getuid()).pw_name


def mark(deployment_id):
    return MARK + deployment_id


def boot_command(deploy_dir, mode=""):
    """The shell command the hook runs: bin/boot.sh, quoted (mode: --keeper, --watch)."""
    return shlex.quote(layout.path(deploy_dir, layout.BOOT)) + (" " + mode if mode else "")


def unit_name(deployment_id):
    return "vllm-fleet-%s.service" % re.sub(r"[^A-Za-z0-9_.-]", "_", deployment_id)


def unit_path(deployment_id):
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "systemd", "user", unit_name(deployment_id))


def unit_text(deploy_dir, deployment_id):
    """The systemd user unit: the boot, then the keeper's watchdog in the foreground. KillMode=process:
    stopping or restarting the unit ends the watch loop only, never the instances it started."""
    script = layout.path(deploy_dir, layout.BOOT).replace("%", "%%").replace("\\", "\\\\").replace('"', '\\"')
    return ("[Unit]\nDescription=vllm-fleet deployment %s\n\n"
            "[Service]\nType=simple\nExecStart=\"%s\" --watch\nRestart=always\nRestartSec=10\n"
            "KillMode=process\n\n[Install]\nWantedBy=default.target\n" % (deployment_id, script))


def cron_lines(deploy_dir, deployment_id, watchdog):
    """Our crontab lines (`%` is a newline to cron, hence escaped)."""
    cmd = boot_command(deploy_dir).replace("%", "\\%")
    lines = ["@reboot %s %s" % (cmd, mark(deployment_id))]
    if watchdog:
        lines.append("* * * * * %s --keeper %s" % (cmd, mark(deployment_id)))
    return lines


def ours(line, deployment_id):
    return line.rstrip().endswith(mark(deployment_id))


def without(text, deployment_id):
    """The crontab text without the deployment's lines, every other byte kept."""
    return "".join(line for line in text.splitlines(True) if not ours(line, deployment_id))


def with_lines(text, lines, deployment_id):
    """The crontab text with the deployment's lines replaced by `lines` (appended at the end)."""
    rest = without(text, deployment_id)
    if rest and not rest.endswith("\n"):
        rest += "\n"
    return rest + "".join(line + "\n" for line in lines)


# --- the host's means -----------------------------------------------------------------------------

def cron_running():
    """Whether a cron daemon runs on the host (any user's: only read, never signalled)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/comm" % pid) as f:
                    if f.read().strip() in CRON_DAEMONS:
                        return True
            except OSError:
                continue
    return False


def systemd_user():
    """'' when a systemd user unit outlives logouts and reboots here, else why not."""
    name = user()
    loginctl, systemctl = _which("loginctl"), _which("systemctl")
    if not (loginctl and systemctl):
        return "no loginctl/systemctl"
    code, out, _ = _run([loginctl, "show-user", name, "--property=Linger"], timeout=5)
    if code != 0 or out.strip() != "Linger=yes":
        return "lingering is off for %s" % name
    code, _, err = _run([systemctl, "--user", "show-environment"], timeout=5)
    if code != 0:
        return "systemctl --user does not answer (%s)" % (err.strip().splitlines() or ["no output"])[-1]
    return ""


def detect():
    """{"kind": "systemd" | "cron" | None, "user", "missing": what keeps the hook from working, or ""}."""
    name = user()
    no_systemd = systemd_user()
    if not no_systemd:
        return {"kind": "systemd", "user": name, "missing": ""}
    if _which("crontab"):
        missing = "" if cron_running() else (
            "cron is not running on this host, so the @reboot line waits until it does: ask the admin to "
            "enable the cron service, or for `loginctl enable-linger %s` (a systemd user unit)" % name)
        return {"kind": "cron", "user": name, "missing": missing}
    return {"kind": None, "user": name, "missing": (
        "there is no crontab command, and no systemd user unit can be had (%s): nothing brings the "
        "deployment back after a reboot; install cron, or ask the admin for `loginctl enable-linger %s`"
        % (no_systemd, name))}


# --- the crontab ----------------------------------------------------------------------------------

def crontab_lock_path():
    """~/.cache/vllm-fleet/crontab.lock: in the user's own home, not /tmp, where another local user could
    make the name first and block (or, as a symlink, redirect) every install."""
    return os.path.join(os.path.expanduser("~"), ".cache", "vllm-fleet", "crontab.lock")


class _CrontabLock:
    """One edit of the user's crontab at a time (crontab -l, then crontab -: deploys of several hosts
    on one machine would otherwise lose each other's lines)."""

    def __enter__(self):
        path = crontab_lock_path()
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            # O_NOFOLLOW: a symlink there is refused, never followed; the owner is checked on the open file.
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise BootHookError("cannot take the crontab lock %s (%s): it must be a plain file of yours "
                                "in a directory you can write" % (path, e.strerror or e))
        st = os.fstat(self.fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            raise BootHookError("the crontab lock %s is not a plain file of yours: remove it and retry" % path)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def read_crontab():
    """The user's crontab text ('' when there is none)."""
    crontab = _which("crontab")
    if not crontab:
        return ""
    code, out, err = _run([crontab, "-l"])
    if code == 0:
        return out
    if "no crontab" in err.lower():
        return ""
    raise BootHookError("`crontab -l` failed: %s" % (err.strip().splitlines() or ["exit %s" % code])[-1])


def write_crontab(text):
    crontab = _which("crontab")
    argv = [crontab, "-r"] if not text.strip() else [crontab, "-"]
    code, _, err = _run(argv, stdin=None if not text.strip() else text)
    if code != 0:
        raise BootHookError("`%s` failed: %s" % (" ".join(argv[-2:]),
                                                   (err.strip().splitlines() or ["exit %s" % code])[-1]))


def _cron_install(deploy_dir, deployment_id, watchdog):
    with _CrontabLock():
        text = read_crontab()
        new = with_lines(text, cron_lines(deploy_dir, deployment_id, watchdog), deployment_id)
        if new != text:
            write_crontab(new)
    return new != text


def _cron_remove(deployment_id):
    if not _which("crontab"):
        return False
    with _CrontabLock():
        text = read_crontab()
        new = without(text, deployment_id)
        if new != text:
            write_crontab(new)
    return new != text


# --- systemd --------------------------------------------------------------------------------------

def _systemctl(*args):
    code, out, err = _run([_which("systemctl") or "systemctl", "--user"] + list(args), timeout=30)
    if code != 0:
        raise BootHookError("`systemctl --user %s` failed: %s" % (" ".join(args),
                                                                   (err.strip().splitlines() or [""])[-1]))
    return out


def _systemd_install(deploy_dir, deployment_id):
    path, text = unit_path(deployment_id), unit_text(deploy_dir, deployment_id)
    try:
        with open(path) as f:
            same = f.read() == text
    except OSError:
        same = False
    if not same:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        _systemctl("daemon-reload")
    _systemctl("enable", "--now", unit_name(deployment_id))
    return not same


def _systemd_remove(deployment_id):
    path = unit_path(deployment_id)
    if not os.path.exists(path):
        return False
    if _which("systemctl"):
        _run([_which("systemctl"), "--user", "disable", "--now", unit_name(deployment_id)], timeout=30)
    os.remove(path)
    if _which("systemctl"):
        _run([_which("systemctl"), "--user", "daemon-reload"], timeout=30)
    return True


# --- the commands ---------------------------------------------------------------------------------

def install(deploy_dir, deployment_id, kind="auto", watchdog=True):
    """Install the deployment's hook (the other kind's removed); {"kind", "command", "changed", "missing"}."""
    found = detect()
    if kind == "auto":
        kind = found["kind"]
    if kind is None:
        return {"kind": None, "command": None, "changed": False, "missing": found["missing"]}
    if kind == "systemd":
        if found["kind"] != "systemd":
            raise BootHookError("boot_hook is systemd, but %s here; set boot_hook to auto or cron"
                                % systemd_user())
        changed = _systemd_install(deploy_dir, deployment_id) | _cron_remove(deployment_id)
        return {"kind": kind, "command": boot_command(deploy_dir, "--watch"), "changed": changed, "missing": ""}
    if not _which("crontab"):
        raise BootHookError("boot_hook is cron, but there is no crontab command here; install cron, or set "
                            "boot_hook to auto")
    changed = _cron_install(deploy_dir, deployment_id, watchdog) | _systemd_remove(deployment_id)
    return {"kind": "cron", "command": boot_command(deploy_dir), "changed": changed,
            "missing": "" if cron_running() else found["missing"]}


def as_wanted(deploy_dir, deployment_id, kind="auto", watchdog=True):
    """Whether install(...) would change nothing: the deployment's hook is there as install puts it (the
    unit's text, enabled and active; or the crontab's lines) and the other kind's is not. Reads only."""
    try:
        if kind == "auto":
            kind = detect()["kind"]
        if kind == "systemd":
            try:
                with open(unit_path(deployment_id)) as f:
                    same = f.read() == unit_text(deploy_dir, deployment_id)
            except OSError:
                return False
            systemctl = _which("systemctl") or "systemctl"
            on = all(_run([systemctl, "--user", verb, unit_name(deployment_id)], timeout=30)[0] == 0
                     for verb in ("is-enabled", "is-active"))
            return same and on and not any(ours(line, deployment_id) for line in read_crontab().splitlines())
        if kind != "cron" or not _which("crontab"):
            return False
        text = read_crontab()
        lines = cron_lines(deploy_dir, deployment_id, watchdog)
        return with_lines(text, lines, deployment_id) == text and not os.path.exists(unit_path(deployment_id))
    except BootHookError:
        return False


def remove(deployment_id):
    """Remove every hook of the deployment; {"removed": [kinds]}."""
    removed = [k for k, gone in (("cron", _cron_remove(deployment_id)), ("systemd", _systemd_remove(deployment_id)))
               if gone]
    return {"removed": removed}


def show(deployment_id):
    """The installed hook, {"kind", "command"}, or None."""
    if os.path.exists(unit_path(deployment_id)):
        with open(unit_path(deployment_id)) as f:
            m = re.search(r'^ExecStart="(.*)" --watch$', f.read(), re.M)
        script = m.group(1).replace('\\"', '"').replace("\\\\", "\\").replace("%%", "%") if m else None
        return {"kind": "systemd", "command": shlex.quote(script) + " --watch" if script else None}
    try:
        text = read_crontab()
    except BootHookError:
        return None
    for line in text.splitlines():
        if ours(line, deployment_id) and line.startswith("@reboot "):
            command = line[len("@reboot "):].rstrip()[:-len(mark(deployment_id))].strip()
            return {"kind": "cron", "command": command.replace("\\%", "%")}
    return None


def main(argv):
    try:
        if argv[:1] == ["detect"]:
            out = detect()
        elif argv[:1] == ["install"] and len(argv) == 5:
            out = install(argv[1], argv[2], argv[3], argv[4] == "1")
        elif argv[:1] == ["remove"] and len(argv) == 2:
            out = remove(argv[1])
        elif argv[:1] == ["show"] and len(argv) == 2:
            out = {"boot": show(argv[1])}
        else:
            print(json.dumps({"ok": False, "error": "usage: boothook detect | install DEPLOY_DIR ID KIND 0|1 "
                              "| remove ID | show ID"}))
            return 2
    except BootHookError as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        return 1
    print(json.dumps(dict(out, ok=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
