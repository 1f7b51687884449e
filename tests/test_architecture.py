"""The architecture as contracts (pyproject.toml [tool.importlinter], drawn in docs/ARCHITECTURE.md):
the three parts never import each other, the host agent is standard library only, the control plane
is layered. The contracts are checked here, and shown to bite: a circle put back breaks them."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.unit

PARTS = ("fleet", "hostagent", "proxy")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the packages under root, with the project's contracts."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
                           "sys.exit(lint_imports_command())", "--config", str(root / "pyproject.toml"),
                           "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


def copy_of_the_parts(tmp_path: Path) -> Path:
    for part in PARTS:
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_a_circle_put_back_breaks_the_layers(tmp_path):
    """1. Copy the three parts; 2. make the facts import deploy, which reads them (a circle);
    3. the layers contract is broken and names the import."""
    root = copy_of_the_parts(tmp_path)
    facts = root / "fleet" / "facts.py"
    facts.write_text(facts.read_text() + "\nfrom . import deploy  # noqa: E402\n")
    r = lint_imports(root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "The control plane's layers" in r.stdout and "fleet.facts -> fleet.deploy" in r.stdout, r.stdout


def test_a_circle_put_back_for_type_hints_alone_breaks_the_layers(tmp_path):
    """1. Copy the three parts; 2. make fleet.cluster import fleet.inventory (which calls it) under
    TYPE_CHECKING only, for a type hint; 3. the layers contract still sees the circle and names it."""
    root = copy_of_the_parts(tmp_path)
    cluster = root / "fleet" / "cluster.py"
    cluster.write_text(cluster.read_text() + "\nfrom typing import TYPE_CHECKING  # noqa: E402\n"
                       "if TYPE_CHECKING:\n    from .inventory import HostVars  # noqa: F401\n")
    r = lint_imports(root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "The control plane's layers" in r.stdout and "fleet.cluster -> fleet.inventory" in r.stdout, r.stdout


def test_the_control_plane_imported_on_a_host_breaks_the_independence(tmp_path):
    root = copy_of_the_parts(tmp_path)
    keeper = root / "hostagent" / "keeper.py"
    keeper.write_text(keeper.read_text() + "\nfrom fleet import inventory  # noqa: E402\n")
    r = lint_imports(root)
    assert r.returncode == 1 and "hostagent is not allowed to import fleet" in r.stdout, r.stdout


def _imports(path: Path):
    """(module name, level, in a function) for every import statement of a file."""
    tree = ast.parse(path.read_text(), str(path))
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0, id(node) in in_function
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level, id(node) in in_function


def test_the_host_agent_imports_the_standard_library_alone():
    """The forbidden contract lists known third-party packages; this checks every import against the
    standard library, so a new dependency cannot slip onto the hosts."""
    found = []
    for path in sorted((ROOT / "hostagent").rglob("*.py")):
        for module, level, _ in _imports(path):
            top = module.split(".")[0]
            if level == 0 and top not in sys.stdlib_module_names and top != "hostagent":
                found.append(f"{path.relative_to(ROOT)}: {module}")
    assert not found, found


# A function-local import of the project's own code that does not hide a circle, and why.
LAZY = {"fleet/sim/cli.py: fleet.sim.server": "the server needs aiohttp; `python -m fleet.sim smi` runs without it"}


def test_no_function_local_import_of_the_project_own_modules():
    """A function-local import of the project's own code hides an import circle (but those in LAZY)."""
    found = []
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            for module, level, local in _imports(path):
                name = f"{path.relative_to(ROOT)}: {'.' * level}{module}"
                if local and (level > 0 or module.split(".")[0] in PARTS) and name not in LAZY:
                    found.append(name)
    assert not found, found


def test_the_layers_name_every_module_of_the_control_plane():
    """A module left out of the layers contract is held to nothing: every module of fleet/ (the sim, a
    package of its own, as one) has its place in a layer, and the layers name no module that is gone."""
    import tomllib
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    named = {m.strip() for layer in layers for m in layer.split("|")}
    modules = {f"fleet.{p.stem}" for p in (ROOT / "fleet").glob("*.py") if p.stem != "__init__"} | {"fleet.sim"}
    assert sorted(modules - named) == [] and sorted(named - modules) == []
