"""Routing policies: one module per policy behind one interface (base.Policy), and the registry of them.

A new policy is a module with a Policy subclass and one line in POLICIES; its keys, if it has any, are
fields of base.RoutingConfig (with their bounds; fleet/settings/schema.py's RoutingSettings mirrors them, and
tests/test_routing_contract.py holds the two equal).
"""
from __future__ import annotations

from .base import Hold, Policy, Route, RoutingConfig
from .least_conn import LeastConn
from .prefix import Prefix

# routing.policy's names, each the class that routes by it.
POLICIES: dict[str, type[Policy]] = {
    "least_conn": LeastConn,
    "prefix": Prefix,
}


def make_policy(config: RoutingConfig) -> Policy:
    """A pool's policy, as config names it (config.py checked the name)."""
    return POLICIES[config.policy](config)


__all__ = ["POLICIES", "Hold", "Policy", "Route", "RoutingConfig", "make_policy"]
