"""The least_conn policy: the backend with the fewest requests in flight (ties round robin), nothing else.

It never reads the body, so in the plain form a request is counted on its backend before its body is
read (the seed's pile-up fix: counting after the read let many requests see one backend as idlest).
"""
from __future__ import annotations

from typing import Sequence

from .base import Backend, Policy, Route


class LeastConn(Policy):
    """The least loaded backend with a free slot; learns nothing, so it has nothing to forget."""

    needs_body = False

    def pick(self, route: Route | None, least: Backend, candidates: Sequence[Backend]) -> Backend:
        return least
