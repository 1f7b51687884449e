"""Which of the engines' routes the entry port passes on: the inference API, and what `open_routes` adds.

vLLM's API server also serves its management: runtime adapters (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`), cache resets, sleep and wake, profiling, `/collective_rpc`, weight updates.
Through the entry port any key holder would reach them, on whichever instance the pick chose; they are
the operator's, on each instance's own port (`inv lora` loads adapters so). Everything not listed here
is answered 404 by the proxy itself, and nginx mode renders the same list (fleet/settings/schema.py holds a copy,
tests/test_routes.py holds the two equal).
"""
from __future__ import annotations

import functools
import re
import urllib.parse
from dataclasses import dataclass

# (method, path) of what a caller of vLLM 0.32 needs; docs/proxy.md says why each is here and what is not.
INFERENCE_ROUTES = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/score"),
    ("POST", "/v1/rerank"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"),
)
ANY = "*"        # an open route written without a method: every method
# `[METHOD ]PATH`, the path's segments literal (URL-safe characters) or `{name}` (any one segment).
OPEN_ROUTE = re.compile(r"^(?:(GET|POST|PUT|PATCH|DELETE) )?((?:/(?:[A-Za-z0-9._~-]+|\{[A-Za-z_]\w*\}))+)$")
SEGMENT = re.compile(r"\{[A-Za-z_]\w*\}")


def parse_route(entry: str) -> tuple[str, str] | None:
    """(method or ANY, path) of an open_routes entry, None when it is not `[METHOD ]/path`."""
    m = OPEN_ROUTE.match(entry) if isinstance(entry, str) else None
    if m is None or any(s in (".", "..") for s in m.group(2).split("/")):
        return None
    return m.group(1) or ANY, m.group(2)


@dataclass(frozen=True)
class Routes:
    """The routes passed on: exact (method, path) pairs, and the open routes with a `{name}` segment."""

    exact: frozenset
    patterns: tuple = ()    # (method or ANY, compiled regex of the path)

    @classmethod
    def of(cls, open_routes=()) -> "Routes":
        """INFERENCE_ROUTES plus open_routes (entries parse_route accepts)."""
        exact, patterns = set(INFERENCE_ROUTES), []
        for method, path in map(parse_route, open_routes):
            if SEGMENT.search(path):
                regex = "".join("[^/]+" if SEGMENT.fullmatch(p) else re.escape(p)
                                for p in re.split(r"(\{[A-Za-z_]\w*\})", path))
                patterns.append((method, re.compile(regex + r"\Z")))
            else:
                exact.add((method, path))
        return cls(frozenset(exact), tuple(patterns))

    def allows(self, method: str, raw_path: str) -> bool:
        """Whether a request reaches the engines: its path as the engine's server routes it (the raw
        path percent-decoded, as uvicorn does: no dot segment resolved, no slash merged)."""
        path = raw_path.partition("?")[0] if "?" in raw_path else raw_path
        if "%" in path:
            path = urllib.parse.unquote(path)
        if (method, path) in self.exact or (ANY, path) in self.exact:
            return True
        return any(m in (method, ANY) and regex.match(path) for m, regex in self.patterns)


@functools.lru_cache(maxsize=8)
def compiled(open_routes: tuple[str, ...]) -> Routes:
    """Routes.of(open_routes), made once per config (a reload brings another tuple)."""
    return Routes.of(open_routes)
