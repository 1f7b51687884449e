"""Installable: the built wheel, installed into a fresh venv outside the checkout, is a working toolkit:
the `vllm-fleet` console script renders k100-01 byte-identical to the golden files, from the templates,
host agent and proxy shipped inside the wheel."""
from __future__ import annotations

import shutil
import subprocess
import sys
import venv

import pytest
from conftest import ROOT

pytestmark = pytest.mark.process

GOLDEN = ROOT / "tests" / "golden" / "k100-01"


def run(argv, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, argv))} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def test_the_wheel_installed_elsewhere_renders_k100_as_the_golden_files(tmp_path):
    """1. Build the wheel from a copy of the checkout (so no build output lands in it); 2. install it
    into a new venv; 3. from a directory that is no checkout, render k100-01 with the console script;
    4. every golden file matches byte for byte, and the host agent and proxy code deploy would put are
    the wheel's own."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info",
                                                            "build", "dist", "bench-results"))
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist), str(src)])
    wheel = next(dist.glob("vllm_fleet-*.whl"))

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)])

    work = tmp_path / "elsewhere"
    (work / "inventory").mkdir(parents=True)
    shutil.copy(ROOT / "inventory" / "hosts.yml", work / "inventory" / "hosts.yml")
    out = work / "out"
    run([str(env_dir / "bin" / "vllm-fleet"), "render", "--host", "k100-01", "--out", str(out),
         "--inventory", "inventory/hosts.yml"], cwd=work)
    for golden in sorted(p for p in GOLDEN.rglob("*") if p.is_file()):
        rel = golden.relative_to(GOLDEN)
        # The headers name the inventory by its absolute path (the goldens by the checkout's relative one).
        rendered = (out / rel).read_text().replace(f"{work}/inventory/hosts.yml", "inventory/hosts.yml")
        assert rendered == golden.read_text(), f"{rel} differs from tests/golden"

    # The code deploy puts on a host comes from the installed packages, not from a checkout.
    probe = run([str(py), "-c", "import fleet.host.sync as s, fleet.settings.inventory as i;"
                 "hv = i.load('inventory/hosts.yml').host_vars('k100-01');"
                 "print('\\n'.join(f.path for f in s.code_files(hv)))"], cwd=work)
    shipped = set(probe.stdout.split())
    assert {"proxy/__main__.py", "hostagent/__main__.py", "hostagent/layout.py"} <= shipped, shipped
    version = run([str(env_dir / "bin" / "vllm-fleet"), "--version"], cwd=work)
    assert "vllm-fleet" in version.stdout and "0." in version.stdout, version.stdout
