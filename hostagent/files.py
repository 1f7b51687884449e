"""The host agent's one atomic write: a file is replaced whole or not at all, never seen half written.

Standard library only, Python 3.6+ (bundled with the modules that import it, fleet.transport.hostcode).
"""
import os


def write_atomic(path, text, mode=None):
    """Replace path with text: a temporary file beside it, then a rename. mode: the new file's permissions,
    set before it appears (default: what the umask gives)."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    if mode is None:
        with open(tmp, "w") as f:
            f.write(text)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)   # born with mode: never readable wider
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)          # whatever the umask took away
    os.replace(tmp, path)


def write_if_changed(path, text, mode=None):
    """write_atomic when path's text differs (its directory made if missing); True when it changed."""
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomic(path, text, mode)
    return True
