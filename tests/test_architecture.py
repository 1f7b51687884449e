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


def lint_with(tmp_path: Path, module: str, added: str) -> subprocess.CompletedProcess:
    """import-linter on a copy of the three parts whose file module (a path under the copy) ends with
    the lines added."""
    root = copy_of_the_parts(tmp_path)
    path = root / module
    path.write_text(path.read_text() + added)
    return lint_imports(root)


def test_a_circle_put_back_breaks_the_layers(tmp_path):
    """1. Copy the three parts; 2. make the facts import deploy, which reads them (a circle);
    3. the layers contract is broken and names the import."""
    r = lint_with(tmp_path, "fleet/facts/state.py", "\nfrom fleet.commands import deploy  # noqa: E402\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "The control plane's layers" in r.stdout and "fleet.facts.state -> fleet.commands.deploy" in r.stdout, r.stdout


def test_a_circle_put_back_for_type_hints_alone_breaks_the_layers(tmp_path):
    """1. Copy the three parts; 2. make fleet.settings.cluster import fleet.settings.inventory (which calls it) under
    TYPE_CHECKING only, for a type hint; 3. the layers contract still sees the circle and names it."""
    r = lint_with(tmp_path, "fleet/settings/cluster.py", "\nfrom typing import TYPE_CHECKING  # noqa: E402\n"
                  "if TYPE_CHECKING:\n    from fleet.settings.inventory import HostVars  # noqa: F401\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "The control plane's layers" in r.stdout and "fleet.settings.cluster -> fleet.settings.inventory" in r.stdout, r.stdout


def test_the_control_plane_imported_on_a_host_breaks_the_independence(tmp_path):
    r = lint_with(tmp_path, "hostagent/keeper.py", "\nfrom fleet.settings import inventory  # noqa: E402\n")
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
    package of its own, as one) has its place in the module layers, every room (a subpackage, or a module
    at fleet/'s top) in the rooms' layers, and neither names a module or room that is gone."""
    import tomllib
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    rooms_layers, module_layers = [c["layers"] for c in contracts if c["type"] == "layers"]

    def named(layers):
        return {m.strip() for layer in layers for m in layer.split("|")}

    fleet = ROOT / "fleet"
    rooms = {p for p in fleet.iterdir() if p.name not in ("__init__.py", "__pycache__", "templates")
             and (p.suffix == ".py" or (p / "__init__.py").exists())}
    room_names = {f"fleet.{p.stem}" for p in rooms}
    modules = {"fleet.sim"} | {
        "fleet." + ".".join(p.relative_to(fleet).with_suffix("").parts)
        for p in fleet.rglob("*.py") if "sim" not in p.relative_to(fleet).parts[:1] and p.name != "__init__.py"}
    assert sorted(room_names ^ named(rooms_layers)) == []
    assert sorted(modules ^ named(module_layers)) == []


def test_a_command_imported_by_the_library_breaks_the_rooms(tmp_path):
    """1. Copy the three parts; 2. make the plan import a command (fleet.commands.display); 3. the rooms'
    contract is broken: nothing below the commands imports one."""
    r = lint_with(tmp_path, "fleet/plan/steps.py", "\nfrom fleet.commands import display  # noqa: E402\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "The control plane's rooms" in r.stdout and "fleet.plan.steps -> fleet.commands.display" in r.stdout, r.stdout


# What the benchmarks and profilers (bench/, scripts run from a checkout, not a package) may reach of the
# three parts: the control plane's public surface (load an inventory, render a host, its errors), the data
# plane's units a benchmark drives alone (a routing policy, the body's parse and the per-request digest, the
# fair queue, a timing constant), and the host agent's modules that find, start and stop processes and run
# nginx. Nothing else, and no name with a leading underscore: a benchmark measures what the product runs.
BENCH_MAY_IMPORT = {
    "fleet.settings.inventory", "fleet.render", "fleet.errors",
    "proxy.routing", "proxy.routing.base", "proxy.routing.prefix", "proxy.body", "proxy.forward",
    "proxy.admission", "proxy.state",
    "hostagent.processes", "hostagent.nginx_front", "hostagent.upstream", "hostagent.apikeys", "hostagent.layout",
}


def _bench_reach(bench: Path) -> list[str]:
    found = []
    for path in sorted(bench.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                pairs = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in pairs:
                if module.split(".")[0] not in PARTS:
                    continue
                whole = f"{module}.{name}" if name and f"{module}.{name}" in BENCH_MAY_IMPORT else module
                if whole not in BENCH_MAY_IMPORT or (name or "").startswith("_"):
                    found.append(f"{path.name}: {module}{'.' + name if name else ''}")
    return found


def test_the_benchmarks_reach_only_the_declared_surfaces(tmp_path):
    """Every import of fleet/, proxy/ or hostagent/ in bench/ is in BENCH_MAY_IMPORT (and no private name);
    shown to bite: a benchmark reaching a private name or another module is named."""
    assert _bench_reach(ROOT / "bench") == []
    (tmp_path / "bench_x.py").write_text("from proxy.forward import _digested\nfrom fleet.commands import deploy\n")
    assert _bench_reach(tmp_path) == ["bench_x.py: proxy.forward._digested", "bench_x.py: fleet.commands.deploy"]
