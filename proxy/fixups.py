"""Request fixups: mend what clients are known to get wrong before vLLM refuses it."""
from __future__ import annotations

import json


def fix_numeric_user(body: bytes, raw: bytes | None) -> tuple[bytes, list[str]]:
    """The body with a numeric top-level `user` turned into its string, and the fixups done.

    raw: the `user` value as results_log.user_value found it (the cheap scan, done once per body).
    vLLM's request validation answers 400 to `"user": 12345` (the seed's incident: one client's
    every request failed). The full parse runs only on a hit.
    """
    if raw is None or not (raw[:1].isdigit() or raw[:1] == b"-"):
        return body, []
    try:
        request = json.loads(body)
    except ValueError:
        return body, []
    user = request.get("user") if isinstance(request, dict) else None
    if isinstance(user, bool) or not isinstance(user, (int, float)):
        return body, []
    request["user"] = json.dumps(user)
    return json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode(), ["user-to-string"]
