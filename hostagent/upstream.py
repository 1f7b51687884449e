"""The upstream include file: one `server` line per backend, `down` for those failing /health."""
from __future__ import annotations

from . import files


def render(backends: list[str], down: set[str] | frozenset = frozenset(), max_fails: int = 1,
           fail_timeout_s: float = 5) -> str:
    """The text nginx includes inside `upstream vllm_backends {}`.

    Every backend keeps its line, so the block stays valid even when all are down (nginx then
    answers 502 at once instead of waiting on dead engines).
    """
    lines = ["# Written by hostagent (the /health watcher): backends failing /health are marked down.",
             f"# down: {', '.join(b for b in backends if b in down) or 'none'}"]
    for b in backends:
        lines.append(f"server {b} max_fails={max_fails} fail_timeout={fail_timeout_s:g}s"
                     + (" down;" if b in down else ";"))
    return "\n".join(lines) + "\n"


def parse_down(text: str) -> set[str]:
    """The backends marked down in an upstream file's text."""
    return {line.split()[1] for line in text.splitlines()
            if line.startswith("server ") and line.rstrip().endswith(" down;")}


def write(path: str, text: str, mode: int = 0o644) -> bool:
    """Replace the file atomically when its text differs, with mode; True when it changed."""
    return files.write_if_changed(path, text, mode)
