"""The routing seam: the balancer asks its policy (proxy/routing/) for the pick, tells it what was sent,
what ended and which backend went cold, and lets it choose the waiter a freed slot goes to; a policy
registered in POLICIES is a name the config takes. least_conn never needs the body."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from proxy import routing
from proxy.balancer import Balancer
from proxy.config import parse_config
from proxy.models import Router
from proxy.routing import Policy, RoutingConfig


@dataclass
class Tagged:
    """The fake policy's route: the tag route_of read from the body."""

    tag: str
    decision: str = "load"
    matched_tokens: int = 0
    prompt_tokens: int = 0


class LastCandidate(Policy):
    """Picks the last candidate, never the least loaded, and writes down every call."""

    needs_body = True

    def __init__(self, config: RoutingConfig):
        super().__init__(config)
        self.calls: list[tuple] = []

    def route_of(self, body: bytes) -> Tagged:
        return Tagged(body.decode())

    def pick(self, route, least, candidates):
        self.calls.append(("pick", route.tag if route else None, least.name, [b.name for b in candidates]))
        route.decision = "fake"
        return candidates[-1]

    def sent(self, route, backend):
        self.calls.append(("sent", route.tag if route else None, backend.name))

    def ended(self, backend):
        self.calls.append(("ended", backend.name))

    def forget(self, backend):
        self.calls.append(("forget", backend))

    def waiter(self, queue, backends):
        return list(queue)[-1]      # the last to come, to show the balancer follows it


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(routing.POLICIES, "fake", LastCandidate)
    return RoutingConfig(policy="fake")


def pool(config: RoutingConfig, n=3, slots=1) -> Balancer:
    b = Balancer([f"b{i}:1" for i in range(n)], slots=slots, queue_max=8, routing=config)
    for backend in b.backends.values():
        b.mark(backend, True)
    return b


@pytest.mark.unit
def test_a_registered_policy_is_a_name_the_config_takes(fake):
    config = parse_config({"backends": ["a:1"], "routing": {"policy": "fake"}})
    assert isinstance(Router(config).only().policy, LastCandidate)


@pytest.mark.unit
def test_the_balancer_counts_the_policys_pick_and_tells_it_what_was_sent_and_ended(fake):
    b = pool(fake)
    policy = b.policy
    route = policy.route_of(b"conversation 1")
    got = b.acquire(route=route)
    assert got.name == "b2:1" and got.in_flight == 1 and route.decision == "fake"
    assert policy.calls == [("pick", "conversation 1", "b0:1", ["b0:1", "b1:1", "b2:1"]),
                            ("sent", "conversation 1", "b2:1")]
    policy.calls.clear()
    assert b.acquire(route=policy.route_of(b"2")).name == "b1:1"   # b2 has no free slot left
    b.release(got)
    assert policy.calls[-1] == ("ended", "b2:1") and got.in_flight == 0


@pytest.mark.unit
def test_the_policy_forgets_a_backend_that_goes_cold_or_leaves(fake):
    b = pool(fake)
    b0, b1, b2 = b.backends.values()
    b.eject(b0, "test")
    b.mark(b1, False, "down")
    b.set_drained(b2, True)
    b.update(["b0:1"])
    assert [c for c in b.policy.calls if c[0] == "forget"] == [
        ("forget", "b0:1"), ("forget", "b1:1"), ("forget", "b2:1"), ("forget", "b1:1"), ("forget", "b2:1")]


@pytest.mark.unit
def test_a_freed_slot_goes_to_the_waiter_the_policy_prefers(fake):
    async def run():
        b = pool(fake, n=1)
        held = b.acquire(route=b.policy.route_of(b"first"))
        tasks = [asyncio.create_task(b.wait_for_slot(5, b.policy.route_of(tag.encode()))) for tag in "xyz"]
        await asyncio.sleep(0)
        assert b.queued == 3
        b.release(held)          # the policy prefers the last waiter, z
        await asyncio.sleep(0)
        done = [t for t in tasks if t.done()]
        for t in tasks:
            t.cancel()
        return done == [tasks[2]], b.policy.calls
    first_to_z, calls = asyncio.run(run())
    assert first_to_z and ("sent", "z", "b0:1") in calls


@pytest.mark.unit
@pytest.mark.parametrize("extra, needs_body", [
    ({"routing": {"policy": "least_conn"}}, False),
    ({"routing": {"policy": "prefix"}}, True),
    ({"routing": {"policy": "least_conn"}, "models": [{"name": "m", "backends": ["a:1"]}]}, True),
])
def test_least_conn_alone_never_needs_the_body(extra, needs_body):
    """The seed's rule, count before the body is read, holds with least_conn in the plain form: the
    router reads the body first only for the models form's `model` or a policy that needs it."""
    router = Router(parse_config({"backends": ["a:1"], **extra}))
    assert router.needs_body is needs_body
    least_conn = routing.make_policy(RoutingConfig(policy="least_conn"))
    assert not least_conn.needs_body and least_conn.route_of(b'{"prompt": "x"}') is None


@pytest.mark.unit
def test_only_the_balancer_calls_the_policy_and_a_request_ends_at_its_pool_once():
    """The seams of issue 39: no module of the proxy but the balancer (and the policies themselves) reaches
    a pool's policy; the request path ends a request at its pool in one call (Balancer.finish), and a
    tenant's buckets are touched only by admission.py."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "proxy"
    for path in root.rglob("*.py"):
        if path.name == "balancer.py" or path.parent.name == "routing":
            continue
        text = path.read_text()
        if path.name != "config.py":      # it reads routing.policy, the policy's name in the config
            assert not re.search(r"\.policy\b", text), f"{path.name} reaches a pool's policy"
        if path.name != "admission.py":
            assert not re.search(r"\.(admitted|refunded|used)\(", text), f"{path.name} touches a tenant's buckets"
    forward = (root / "forward.py").read_text()
    assert forward.count(".finish(") == 1 and not re.search(r"\.(learn|ended)\(", forward)
