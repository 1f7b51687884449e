"""The deployment's log files, readable by its user alone: they hold engine output, callers' `user` values
and the keeper's and nginx's records. Each is created 0600 whatever the umask (a new file after a rotation
too), a directory made for them 0700, and a file left looser (by an earlier version, or by hand) is
tightened when its writer starts, which says so in a log line.

Standard library only, Python 3.6+ (bundled with the modules that import it, fleet.transport.hostcode).
"""
import logging.handlers
import os
import stat

MODE = 0o600
DIR_MODE = 0o700


def open_fd(path):
    """A descriptor appending to path, the file created 0600 (and made so, when it was looser). A symlink
    at path is refused (OSError ELOOP): appending and chmod through it would reach whatever it names, a
    system file when the agent runs as root; only a plain file of this user's is tightened."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, MODE)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.fchmod(fd, MODE)
    return fd


def open_append(path, say=False):
    """A text file object appending to path (created 0600); say: a file tightened gets a line saying so."""
    notes = tighten(path) if say else []
    f = os.fdopen(open_fd(path), "a")
    for note in notes:
        f.write("%s\n" % note)
    f.flush()
    return f


def make_dir(path):
    """A directory for logs, made 0700 when it is missing (one that exists keeps its mode)."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)


def tighten(path, backups=0):
    """Make path and its rotated copies (path.1 ... path.backups) 0600 where group or others could read
    them; one sentence per file changed, to log. Symlinks are left alone (not ours to chmod through)."""
    notes = []
    for p in [path] + ["%s.%d" % (path, k) for k in range(1, backups + 1)]:
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                os.chmod(p, MODE)
                notes.append("%s was mode %04o, readable beyond its user: now %04o"
                             % (p, stat.S_IMODE(st.st_mode), MODE))
        except OSError:
            continue
    return notes


class RotatingFileHandler(logging.handlers.RotatingFileHandler):
    """logging's size-rotated file, whose every file (the first, and each one after a rotation) is 0600."""

    def _open(self):
        return os.fdopen(open_fd(self.baseFilename), "a", encoding=self.encoding)
