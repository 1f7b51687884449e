"""Host-side code sent on standard input: a script plus the host agent's modules it imports.

A probe (`python3 - SPEC_JSON`, source on stdin) runs where nothing may be deployed yet, so it cannot
import the deployed `hostagent/`. `bundle` puts the modules' text in front of the script and registers
them as `hostagent.NAME`, so the script's `from hostagent import processes` works the same on the host
as in the control node's tests. Only self-contained modules (standard library imports alone) qualify.
"""
from __future__ import annotations

from pathlib import Path

HOSTAGENT = Path(__file__).resolve().parent.parent / "hostagent"


def source(name: str) -> str:
    """The text of hostagent/NAME.py."""
    return (HOSTAGENT / f"{name}.py").read_text()


def bundle(script: str, *modules: str) -> str:
    """script, preceded by the hostagent modules it imports."""
    lines = ["import sys as _sys, types as _types",
             "_pkg = _sys.modules.get('hostagent') or _types.ModuleType('hostagent')",
             "_pkg.__path__ = getattr(_pkg, '__path__', [])",
             "_sys.modules['hostagent'] = _pkg"]
    for name in modules:
        lines += [f"_m = _types.ModuleType('hostagent.{name}')",
                  f"_sys.modules['hostagent.{name}'] = _m",
                  f"setattr(_pkg, {name!r}, _m)",
                  f"exec(compile({source(name)!r}, 'hostagent/{name}.py', 'exec'), _m.__dict__)"]
    return "\n".join(lines) + "\ndel _sys, _types, _pkg, _m\n" + script


# The probes: host code run from the control node, each with the host agent modules it imports.
PROBES = {"state": ("probe.py", ("processes",)), "holders": ("holders_probe.py", ("processes",)),
          "doctor": ("doctor_probe.py", ("processes",)), "cpu_mem": ("cpu_mem_probe.py", ())}


def probe(name: str) -> str:
    """The source of the probe NAME, bundled with the host agent modules it imports."""
    file, modules = PROBES[name]
    text = (Path(__file__).resolve().parent / file).read_text()
    return bundle(text, *modules) if modules else text
