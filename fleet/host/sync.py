"""What goes into a host's deploy_dir, and putting it there: the rendered files plus the code the host
runs (the proxy, the host agent, the sim engine when engine is sim); only files whose content or mode
differs from the host's copy are put (fleet.plan.steps's file steps, from `changes`), and --diff shows how
they differ."""
from __future__ import annotations

import difflib
import hashlib
from pathlib import Path

from hostagent.facts import HostFacts

from fleet.render import RenderedFile, render_host
from fleet.report import Report
from fleet.settings.inventory import HostVars
from fleet.transport import hostcode
from fleet.transport.connection import Transport


def _package_files(name: str, under: str) -> list[RenderedFile]:
    root = hostcode.package_dir(name)
    return [RenderedFile(f"{under}/{p.relative_to(root)}", p.read_text(), 0o644)
            for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts]


def code_files(hv: HostVars) -> list[RenderedFile]:
    """The code the host runs besides the engine: the proxy and the host agent, and the sim engine when
    engine is sim (under lib/, as `fleet.sim`; fleet/__init__.py is empty, so no control-plane code)."""
    files = _package_files("proxy", "proxy") + _package_files("hostagent", "hostagent")
    if hv.settings.engine == "sim":
        fleet = Path(__file__).resolve().parent.parent
        files.append(RenderedFile("lib/fleet/__init__.py", (fleet / "__init__.py").read_text()))
        files += [RenderedFile(f"lib/fleet/sim/{p.name}", p.read_text(), 0o644)
                  for p in sorted((fleet / "sim").glob("*.py"))]
    return files


def host_files(hv: HostVars) -> list[RenderedFile]:
    """Everything deploy puts under deploy_dir."""
    return render_host(hv) + code_files(hv)


def _sha(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def changes(files: list[RenderedFile], facts: HostFacts) -> list[tuple[RenderedFile, str | None]]:
    """Each file with why it must be put (`new`, `content changed`, `mode 0600 -> 0644`), or None when the
    host's copy is the same (facts: the state probe's answer for these files). No I/O."""
    out = []
    modes = facts.file_modes or {}
    for f in files:
        have, have_mode = facts.files.get(f.path), modes.get(f.path)
        same_content = have == _sha(f.content)
        if same_content and have_mode in (None, f.mode):
            out.append((f, None))
        else:
            out.append((f, "new" if have is None else "content changed" if not same_content
                        else f"mode {have_mode:04o} -> {f.mode:04o}"))
    return out


def put(conn: Transport, hv: HostVars, f: RenderedFile) -> None:
    """Put one file under deploy_dir, with its mode."""
    conn.put(f"{hv.settings.deploy_dir}/{f.path}", f.content.encode(), f.mode)


def diff(conn: Transport, hv: HostVars, f: RenderedFile, facts: HostFacts) -> list[str]:
    """How the host's copy of f differs from the rendered one: a unified diff, git style for modes."""
    have, have_mode = facts.files.get(f.path), (facts.file_modes or {}).get(f.path)
    return _diff_lines(conn, hv, f, f"{hv.settings.deploy_dir}/{f.path}", have, have_mode,
                       have == _sha(f.content))


def put_files(conn: Transport, hv: HostVars, files: list[RenderedFile], facts: HostFacts, report: Report) -> set[str]:
    """Put each file that differs from the host's copy (restart and the swaps; deploy puts its plan's); the
    paths put come back."""
    changed: set[str] = set()
    for f, why in changes(files, facts):
        if why is None:
            report.add(f"file {f.path}", "ok")
            continue
        put(conn, hv, f)
        changed.add(f.path)
        report.add(f"file {f.path}", "changed", f"put ({why})")
    return changed


def _diff_lines(conn, hv, f, path, have, have_mode, same_content) -> list[str]:
    """A unified diff of the host's copy (or /dev/null) against the rendered file, git style for modes."""
    lines = []
    if have is not None and have_mode not in (None, f.mode):
        lines += [f"old mode {have_mode:04o} {hv.name}:{f.path}", f"new mode {f.mode:04o} rendered:{f.path}"]
    if not same_content:
        old = conn.read(path) if have is not None else None
        old_text = old.decode("utf-8", "replace") if old is not None else ""
        lines += difflib.unified_diff(old_text.splitlines(), f.content.splitlines(),
                                      f"{hv.name}:{f.path}" if have is not None else "/dev/null",
                                      f"rendered:{f.path}", lineterm="")
    return lines
