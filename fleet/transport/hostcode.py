"""Host-side code sent on standard input: a script plus the host agent's modules it imports.

A probe (`python3 - SPEC_JSON`, source on stdin) runs where nothing may be deployed yet, so it cannot
import the deployed `hostagent/`. `bundle` puts the modules' text in front of the script and registers
them as `hostagent.NAME`, so the script's `from hostagent import processes` works the same on the host
as in the control node's tests. Only self-contained modules (standard library imports, and other such
host agent modules) qualify; `script` finds what a file imports and bundles it in dependency order.

The probes live in hostagent/probes/ (`probe("state")` is hostagent/probes/state.py, bundled). The host
agent's directory is found without importing it, from an installed wheel as from a checkout.
"""
from __future__ import annotations

import ast
import importlib.util
import threading
from functools import lru_cache
from pathlib import Path


def package_dir(name: str) -> Path:
    """Where an installed (or checked-out) top-level package's files are, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the {name} package is not installed beside fleet; install vllm-fleet with it "
                          "(pyproject's packages must include hostagent* and proxy*).")
    return Path(list(spec.submodule_search_locations)[0])


HOSTAGENT = package_dir("hostagent")
PROBES = "probes"        # the one subpackage a bundle holds modules of
# ast.parse is not thread-safe in some CPython releases (gh-106905; seen on 3.11.7 as "SystemError: AST
# constructor recursion depth mismatch" when a deploy's hosts, threads under --forks, parsed at once).
_PARSE = threading.Lock()


def path(name: str) -> Path:
    """The file of host agent module NAME (`processes`, `probes.state`)."""
    return HOSTAGENT.joinpath(*name.split(".")).with_suffix(".py")


def source(name: str) -> str:
    """The text of hostagent/NAME.py (NAME dotted for a subpackage: `probes.state`)."""
    return path(name).read_text()


@lru_cache(maxsize=None)
def imports(name: str) -> tuple[str, ...]:
    """The host agent modules NAME imports (`from hostagent import x`, `from . import x`,
    `from hostagent.x import ...`, and another probe: `from hostagent.probes import x`, as `probes.x`), in
    the order they appear."""
    parts = ["hostagent", *name.split(".")[:-1]]          # the package NAME is in
    found: list[str] = []
    with _PARSE:
        tree = ast.parse(source(name))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level > len(parts):
            continue
        base = parts[:len(parts) - node.level + 1] if node.level else []
        full = base + (node.module.split(".") if node.module else [])
        if full[:1] != ["hostagent"]:
            continue
        if full[1:2] == [PROBES]:        # another probe: `from hostagent.probes import doctor`
            names = [f"{PROBES}.{n}" for n in full[2:3] or [a.name for a in node.names]]
        else:
            names = full[1:2] or [a.name for a in node.names]
        for mod in names:
            if path(mod).exists() and mod not in found:
                found.append(mod)
    return tuple(found)


def needs(name: str) -> list[str]:
    """Every host agent module NAME imports, directly or not, each after the modules it imports."""
    order: list[str] = []

    def visit(mod: str, seen: tuple[str, ...]) -> None:
        for dep in imports(mod):
            if dep in seen:
                raise ValueError(f"hostagent/{dep}.py imports itself through {' -> '.join(seen)}")
            if dep not in order:
                visit(dep, seen + (dep,))
                order.append(dep)
    visit(name, (name,))
    return order


def bundle(script: str, *modules: str) -> str:
    """script, preceded by the hostagent modules it imports (given in dependency order; a probe's as
    `probes.NAME`, under a `hostagent.probes` package made for them)."""
    lines = ["import sys as _sys, types as _types",
             "_pkg = _sys.modules.get('hostagent') or _types.ModuleType('hostagent')",
             "_pkg.__path__ = getattr(_pkg, '__path__', [])",
             "_sys.modules['hostagent'] = _pkg"]
    if any(name.startswith(PROBES + ".") for name in modules):
        lines += [f"_p = _types.ModuleType('hostagent.{PROBES}')",
                  f"_p.__path__, _p.__package__ = [], 'hostagent.{PROBES}'",
                  f"_sys.modules['hostagent.{PROBES}'] = _p",
                  f"setattr(_pkg, {PROBES!r}, _p)",
                  "del _p"]
    for name in modules:
        package, _, short = f"hostagent.{name}".rpartition(".")
        lines += [f"_m = _types.ModuleType('hostagent.{name}')",
                  f"_m.__package__ = {package!r}",
                  f"_sys.modules['hostagent.{name}'] = _m",
                  f"setattr(_sys.modules[{package!r}], {short!r}, _m)",
                  f"exec(compile({source(name)!r}, 'hostagent/{name.replace('.', '/')}.py', 'exec'), _m.__dict__)"]
    lines.append("del _sys, _types, _pkg" + (", _m" if modules else ""))
    return "\n".join(lines) + "\n" + script


@lru_cache(maxsize=None)      # the text is the same for the whole run: read and bundled once
def script(name: str) -> str:
    """hostagent/NAME.py as a script to send (stdin or `-c`), with the modules it needs bundled."""
    return bundle(source(name), *needs(name))


def probe(name: str) -> str:
    """The probe hostagent/probes/NAME.py (state, holders, doctor, cpu_mem), bundled, to send on stdin."""
    return script(f"probes.{name}")
