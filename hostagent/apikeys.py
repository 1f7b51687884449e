"""nginx mode's API keys: the proxy's `api_keys_file` turned into an nginx `map` that nginx includes.

The keys never reach nginx.conf (which the control node renders and may show in a diff): this module
writes them on the host into `run/nginx_keys.conf`, readable by the deployment's user alone (mode 0600;
nginx's master reads its configuration as root or as that user). The /health watcher (or the keeper)
rewrites it when the key file changes, then reloads nginx. Nothing here ever logs or prints a key.

The file is one `map` from the `Authorization` header to `$fleet_authorized`: each key a case-sensitive
regular expression (nginx's plain map strings match ignoring case, which would weaken a key), the scheme
`Bearer` in any case followed by blanks, as the proxy accepts it. Every character of a key but letters
and digits is written as `\\xHH`, so nothing in a key is read by nginx's parser or by PCRE as syntax.

The state probe imports this module (the key file's digest), so it stays Python 3.6 like the probes.
"""
import hashlib
import os

from . import files

DEFAULT = "default"                 # the tenant of a key written alone (proxy/admission.py's)
VARIABLE = "$fleet_authorized"
DIGEST_LINE = "# keys digest: "     # then apikeys.digest of the keys in the map: what a deploy compares
SHORT_KEY = 16                      # a key shorter than this is within reach of guessing (doctor warns)


class KeysError(Exception):
    """The key file cannot serve as nginx's: one sentence saying what to do."""


def read_keys(path: str) -> list:
    """The keys of path, one per line (# comments and blank lines skipped; a line's tenant, `KEY TENANT`,
    left out: nginx mode shares no slots by tenant), as the proxy reads them; KeysError when nginx cannot
    check one of them."""
    keys = [k for k, _ in _in_order(path)]
    for n, k in enumerate(keys, 1):
        if not all(0x21 <= ord(c) <= 0x7E for c in k):
            # A Bearer token is printable ASCII without blanks (RFC 6750); nginx compares bytes.
            raise KeysError("api_keys_file %s: key %d has a character nginx mode cannot check (blanks, "
                            "control or non-ASCII characters); use printable ASCII keys." % (path, n))
    return sorted(set(keys))


def load(path: str) -> list:
    """The lines of path as the proxy reads them, `KEY` (tenant default) or `KEY TENANT`, sorted, each
    once; KeysError (one sentence, no key in it) when there is none or the file cannot be read."""
    return sorted(set(k if t is None or t == DEFAULT else k + " " + t for k, t in _in_order(path)))


def _in_order(path: str) -> list:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeysError("api_keys_file %s is not UTF-8 text." % path) from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 2:
            raise KeysError("api_keys_file %s line %d has more than a key and a tenant; write `KEY` or "
                            "`KEY TENANT`." % (path, n))
        keys.append((words[0], words[1] if len(words) > 1 else None))
    if not keys:
        raise KeysError("api_keys_file %s holds no key; put one key per line, or drop the setting." % path)
    return keys


def inspect(path: str, tenants=()) -> dict:
    """What the doctor judges of the key file, no key in it: {"error"} (one sentence) when the proxy could
    not read it; else how many keys, how many shorter than SHORT_KEY (short_under), the tenants its lines
    name that neither tenants (proxy.tenants) nor DEFAULT is, and the file's permission bits."""
    out = {"error": None, "keys": 0, "short": 0, "short_under": SHORT_KEY, "undefined": [], "mode": None}
    try:
        out["mode"] = os.stat(path).st_mode & 0o777
        lines = _in_order(path)
    except (OSError, KeysError) as e:
        out["error"] = str(e) if isinstance(e, KeysError) else str(_unreadable(path, e))
        return out
    out["keys"] = len({k for k, _ in lines})
    out["short"] = len({k for k, _ in lines if len(k) < SHORT_KEY})
    out["undefined"] = sorted({t for _, t in lines if t is not None and t != DEFAULT and t not in tenants})
    return out


def _unreadable(path: str, e: OSError) -> KeysError:
    return KeysError("cannot read api_keys_file %s: %s; fix the file or proxy.api_keys_file."
                     % (path, e.strerror or e))


def digest(keys: list) -> str:
    """The keys' fingerprint (keys: load's lines, `KEY` or `KEY TENANT`), as the proxy reports the digest
    of those it runs with (proxy.config's keys_digest: the first 16 hex digits of the SHA-256 of the lines
    sorted, one per line)."""
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:16]


def file_digest(path: str) -> dict:
    """What a deploy compares with the running front's keys: {"digest"} of the key file's keys, or
    {"error"} (one sentence) when it cannot be used."""
    try:
        return {"digest": digest(load(path)), "error": None}
    except KeysError as e:
        return {"digest": None, "error": str(e)}


def conf_digest(path: str) -> "str | None":
    """The digest of the keys in nginx's map (run/nginx_keys.conf), as render wrote it; None without one."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(DIGEST_LINE):
                    return line[len(DIGEST_LINE):].strip() or None
    except OSError:
        return None
    return None


def pattern(key: str) -> str:
    """The nginx map source (a quoted regular expression) that matches `Bearer KEY` and nothing else."""
    escaped = "".join(c if c.isascii() and c.isalnum() else "\\x%02x" % ord(c) for c in key)
    return '"~^(?i:bearer)[ \\t]+%s[ \\t]*\\z"' % escaped


def render(keys: list, keys_digest: "str | None" = None) -> str:
    """The text of run/nginx_keys.conf: the map nginx.conf includes inside `http {}`; keys_digest: the key
    file's (its tenants counted), digest(keys) when not given."""
    lines = ["# Written by hostagent from proxy.api_keys_file: readable by the deployment's user only.",
             DIGEST_LINE + (keys_digest or digest(keys)),
             "map $http_authorization %s {" % VARIABLE, "    default 0;"]
    lines += ["    %s 1;" % pattern(k) for k in keys]
    return "\n".join(lines + ["}"]) + "\n"


def write(path: str, keys_file: str) -> bool:
    """Write path (mode 0600, atomically) from keys_file when its text differs; True when it changed.
    KeysError when keys_file cannot be used: the file in place is then left as it was."""
    return files.write_if_changed(path, render(read_keys(keys_file), digest(load(keys_file))), mode=0o600)
