"""Request fixups: mend what clients are known to get wrong before vLLM refuses it."""
from __future__ import annotations


def numeric_user(user) -> bool:
    """Whether a request's top-level `user` is a number (not a bool), which vLLM refuses with 400.

    The seed's incident: one client sent `"user": 12345` and every request of it failed. The proxy
    sends it on as a string (proxy.fix_numeric_user), recorded as a fixup in the results log.
    """
    return isinstance(user, (int, float)) and not isinstance(user, bool)
