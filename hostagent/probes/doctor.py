"""What `inv doctor` needs to know, read on the host: run there (after env_setup) as `python3 - SPEC_JSON`
with this file on standard input (bundled with the host agent modules it imports: fleet.transport.hostcode.probe),
it prints one JSON object, hostagent.facts' `DoctorFacts`. Standard library only, Python 3.7+, no side
effects. The control node turns these facts into ok/warn/fail lines (fleet/facts/doctor.py).
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict

from hostagent import apikeys, boothook, instances, processes, vrrp
from hostagent.facts import (
    BootHookFit,
    Disk,
    DoctorFacts,
    Engine,
    KeepalivedFit,
    KeyFile,
    Memory,
    Model,
    Port,
    PortHolder,
    Smi,
    Tools,
    record,
)


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


def script_python(path):
    """The Python a console script (pip's `vllm`) runs with, from its #! line alone: a path, `env NAME`
    looked up on PATH, or the one pip's sh wrapper execs when the path is too long for a #! line; None
    when the file is no Python script."""
    try:
        with open(path, "rb") as f:
            head = f.read(1024).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    words = head[0][2:].split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
        return shutil.which(words[0]) if words else None
    if words and os.path.basename(words[0]) == "sh" and len(head) > 1:
        m = re.match(r"""'''exec' "?([^"\s]+)"?""", head[1])
        return m.group(1) if m else None
    return words[0] if words and "python" in os.path.basename(words[0]) else None


def site_dirs(python):
    """Where a Python's packages are, from its path alone (running it costs a second under load): a venv's
    own site-packages (pyvenv.cfg beside bin/) and its base's when it includes them; otherwise the
    installation's (conda, /usr, /usr/local) and the user's ~/.local."""
    prefix = os.path.dirname(os.path.dirname(python))
    prefixes, cfg = [prefix], {}
    try:
        with open(os.path.join(prefix, "pyvenv.cfg")) as f:
            cfg = dict((k.strip(), v.strip()) for k, _, v in (line.partition("=") for line in f) if k.strip())
    except OSError:
        pass
    version = ".".join(cfg.get("version", cfg.get("version_info", "")).split(".")[:2]) or None
    if cfg:
        if cfg.get("include-system-site-packages", "").lower() == "true" and cfg.get("home"):
            prefixes.append(os.path.dirname(cfg["home"].rstrip("/")))
    else:
        real = os.path.dirname(os.path.dirname(os.path.realpath(python)))
        prefixes += [real] if real != prefix else []
        prefixes.append(os.path.expanduser("~/.local"))
    m = re.search(r"python(\d+\.\d+)$", os.path.basename(python))
    version = version or (m.group(1) if m else None)
    out = []
    for p in prefixes:
        for pattern in ("lib/python3*/site-packages", "lib64/python3*/site-packages", "lib/python3*/dist-packages",
                        "local/lib/python3*/dist-packages"):
            for d in sorted(glob.glob(os.path.join(p, pattern))):
                if version is None or "/python3/" in d or "/python%s/" % version in d:
                    out.append(d)
    return out


def dist_version(dirs, name):
    """(version, metadata file) of the installed distribution `name` in the first of dirs that has it."""
    want = re.sub(r"[-_.]+", "-", name).lower()
    for d in dirs:
        for meta in sorted(glob.glob(os.path.join(d, name + "-*.dist-info", "METADATA")) +
                           glob.glob(os.path.join(d, name + "-*.egg-info", "PKG-INFO"))):
            fields = {}
            try:
                with open(meta, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        if not line.strip():
                            break
                        key, _, value = line.partition(":")
                        fields.setdefault(key.strip().lower(), value.strip())
            except OSError:
                continue
            if re.sub(r"[-_.]+", "-", fields.get("name", "")).lower() == want and fields.get("version"):
                return fields["version"], meta
    return None, None


def engine_facts(spec):
    """Is the engine there, and which version. vLLM: the `vllm` command found after env_setup (or
    vllm_bin) and executable, the Python of its #! line there and executable, and the version of the
    distribution `vllm` read from that Python's package metadata, without importing vLLM (10 s of CPU
    idle, minutes beside busy engines). With `deep`, or when no metadata is found, it runs `vllm
    --version` too. The sim: its Python imports aiohttp."""
    cmd, out = spec["cmd"], Engine()
    if spec["kind"] == "sim":
        out.exit, out.output = run(cmd, 180)
        out.ran = True
        return out
    path = shutil.which(os.path.expanduser(cmd[0]))
    out.path = path
    if path is None:
        bare = os.path.expanduser(cmd[0])
        out.exit, out.output = (126, "not executable") if os.path.isfile(bare) else (None, "not found")
        return out
    python = script_python(path)
    out.python = python
    if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        out.exit, out.output = 127, "its Python %s is missing or not executable" % python
        return out
    out.version, out.metadata = dist_version(site_dirs(python), "vllm") if python else (None, None)
    out.exit, out.output = 0, ""
    if spec["deep"] or not out.version:
        out.exit, out.output = run(cmd, 180)
        out.ran = True
    return out


# What a model directory holds for vLLM: its config, and its weights in one of these formats.
MODEL_CONFIGS = ("config.json", "params.json")        # Hugging Face's, or Mistral's own format
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MODEL_ENTRIES_READ = 10000       # a directory's own entries read at most (not its tree: /tmp is no model)


def model_facts(path):
    """What a model path holds, from the directory's own entries (never its subdirectories): whether it
    exists, the bytes and count of its weight files, whether it has a config (a single file: its size)."""
    path = os.path.expanduser(path)
    out = Model(exists=os.path.exists(path))
    if os.path.isfile(path):
        out.bytes, out.files, out.config, out.weights = os.path.getsize(path), 1, True, 1
    if not os.path.isdir(path):
        return out
    try:
        with os.scandir(path) as entries:
            for n, entry in enumerate(entries):
                if n >= MODEL_ENTRIES_READ:
                    break
                out.config = out.config or entry.name in MODEL_CONFIGS
                if entry.name.endswith(WEIGHTS) and entry.is_file():
                    out.weights += 1
                    out.bytes += entry.stat().st_size
                out.files += 1
    except OSError:
        pass
    return out


def key_file_facts(spec):
    """The API key file as the proxy will read it (relative to deploy_dir), or None without one."""
    if not spec.get("api_keys_file"):
        return None
    path = os.path.join(os.path.expanduser(spec["deploy_dir"]), os.path.expanduser(spec["api_keys_file"]))
    return record(KeyFile, apikeys.inspect(path, spec["tenants"]))


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
        out.append(Port(port=port, what=item["what"], listening=busy, ours=ours,
                        holders=[record(PortHolder, h) for h in holders], stranger=None if tagged else stranger))
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
    out = Memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemTotal":
                    out.total = int(rest.split()[0]) * 1024
                elif key == "MemAvailable":
                    out.available = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def cores():
    """The cores this user's processes may run on (the cpuset), or the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def read(spec):
    """What the doctor judges, for the deployment spec names (asdict is its wire form)."""
    engine = engine_facts(spec["engine"])
    engine.output = engine.output[-300:]
    smi_code, smi_out = run(spec["smi_cmd"], 60, shell=True) if spec["smi_cmd"] else (None, "")
    where, free = disk(spec["deploy_dir"])
    return DoctorFacts(
        engine=engine,
        model=model_facts(spec["model"]) if spec["check_model"] else Model(),
        api_keys=key_file_facts(spec),
        ports=port_facts(spec),
        smi=Smi(exit=smi_code, output=smi_out),
        tools=Tools(fuser=which("fuser"), ss=which("ss")),
        disk=Disk(dir=where, free=free, unwritable=unwritable(spec["deploy_dir"])),
        memory=memory(),
        cores=cores(),
        sim_devices=os.path.isdir(os.path.join(spec["deploy_dir"], "sim-dev")),
        boot=record(BootHookFit, boothook.detect()),
        # an entry behind virtual addresses: keepalived's binary, capabilities and interface
        vrrp=KeepalivedFit(missing=vrrp.cannot_run(spec["vrrp"]), binary=vrrp.binary(spec["vrrp"]))
        if spec.get("vrrp") else None,
    )


def main():
    json.dump(asdict(read(json.loads(sys.argv[1]))), sys.stdout)


if __name__ == "__main__":
    main()
