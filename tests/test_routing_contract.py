"""The routing keys are declared twice, once per part (fleet/settings/schema.py for the inventory, proxy/routing/
for the proxy; the parts never import each other): the two declarations hold the same policy names,
keys, defaults and bounds, and a value the inventory takes is one the proxy takes."""
from __future__ import annotations

import dataclasses

import pydantic
import pytest
import yaml
from test_render import k100

from proxy.config import ConfigError, parse_config
from proxy.routing import POLICIES, RoutingConfig

from fleet import render
from fleet.settings import schema

PROXY_FIELDS = {f.name: f for f in dataclasses.fields(RoutingConfig)}
BOUNDED = [name for name, f in PROXY_FIELDS.items() if "bounds" in f.metadata]


def schema_bounds(name: str, section=schema.RoutingSettings) -> tuple:
    """(lowest, highest) that a schema section (RoutingSettings) takes for a key, from its pydantic constraints."""
    lo = hi = None
    for c in section.model_fields[name].metadata:
        lo = getattr(c, "ge", lo)
        hi = getattr(c, "le", hi)
    return lo, hi


@pytest.mark.unit
def test_the_schema_and_the_proxy_name_the_same_policies_keys_defaults_and_bounds():
    assert schema.POLICIES == tuple(POLICIES)
    assert schema.RoutingSettings.model_fields["policy"].annotation.__args__ == tuple(POLICIES)
    assert schema.NGINX_POLICY in POLICIES and not POLICIES[schema.NGINX_POLICY].needs_body
    assert list(schema.RoutingSettings.model_fields) == list(PROXY_FIELDS)
    assert schema.RoutingSettings().model_dump() == dataclasses.asdict(RoutingConfig())
    for name in BOUNDED:
        assert schema_bounds(name) == PROXY_FIELDS[name].metadata["bounds"], name
    assert set(PROXY_FIELDS) - set(BOUNDED) == {"policy"}


@pytest.mark.unit
@pytest.mark.parametrize("end", [0, 1])
def test_the_inventorys_extremes_render_into_a_config_the_proxy_takes_as_they_are(tmp_path, end):
    values = {name: PROXY_FIELDS[name].metadata["bounds"][end] for name in BOUNDED}
    sets = [f"proxy.routing.{k}={v}" for k, v in values.items()] + ["proxy.routing.policy=least_conn"]
    text = {f.path: f for f in render.render_host(k100(sets))}["conf/proxy.yaml"].content
    routing = parse_config(yaml.safe_load(text)).routing
    assert dataclasses.asdict(routing) == {"policy": "least_conn", **values}


@pytest.mark.unit
@pytest.mark.parametrize("name", BOUNDED)
def test_a_value_beyond_a_bound_is_refused_by_both(name):
    lo, hi = PROXY_FIELDS[name].metadata["bounds"]
    for wrong in (lo - 1, hi + 1):
        with pytest.raises(pydantic.ValidationError):
            schema.RoutingSettings(**{name: wrong})
        with pytest.raises(ConfigError, match=f"routing.{name} must be"):
            parse_config({"backends": ["a:1"], "routing": {name: wrong}})
