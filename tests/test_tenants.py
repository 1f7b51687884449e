"""Tenants: keys name them, the inventory sets their share and limits, and each pool's queue serves them
fairly (proxy/admission.py). The Balancer and the fair queue are tested on their own (no I/O: an event
loop and futures); the settings are declared twice (fleet/settings/schema.py, proxy/admission.py) and held equal."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pydantic
import pytest
import yaml
from test_render import k100
from test_routing_contract import schema_bounds

from proxy.admission import Bucket, FairQueue, Tenant, TenantConfig, Tenants
from proxy.balancer import Balancer, TenantFull
from proxy.config import ConfigError, load_api_keys, parse_config
from proxy.routing.base import Policy

from fleet import render
from fleet.settings import schema

PROXY_FIELDS = {f.name: f for f in dataclasses.fields(TenantConfig)}


def balancer(n=2, slots=1, queue_max=64) -> Balancer:
    b = Balancer([f"b{i}:1" for i in range(n)], slots=slots, queue_max=queue_max,
                 routing=None)
    for backend in b.backends.values():
        b.mark(backend, True)
    return b


@pytest.mark.unit
def test_the_schema_and_the_proxy_name_the_same_tenant_keys_defaults_and_bounds():
    assert list(schema.TenantSettings.model_fields) == list(PROXY_FIELDS)
    assert schema.TenantSettings().model_dump() == dataclasses.asdict(TenantConfig())
    for name, f in PROXY_FIELDS.items():
        assert schema_bounds(name, schema.TenantSettings) == f.metadata["bounds"], name
    assert schema.TENANT_NAME.pattern == __import__("proxy.config").config.TENANT_NAME.pattern


@pytest.mark.unit
@pytest.mark.parametrize("end", [0, 1])
def test_the_inventorys_tenants_render_into_a_config_the_proxy_takes_as_they_are(end):
    values = {name: f.metadata["bounds"][end] for name, f in PROXY_FIELDS.items()}
    sets = [f"proxy.tenants.app.{k}={v}" for k, v in values.items()] + ["proxy.tenants.batch.weight=2"]
    text = {f.path: f for f in render.render_host(k100(sets))}["conf/proxy.yaml"].content
    config = parse_config(yaml.safe_load(text))
    assert config.tenants == {"app": TenantConfig(**values), "batch": TenantConfig(weight=2)}
    assert config.queue.tenant_reserve == schema.QueueSettings().tenant_reserve == type(config.queue)().tenant_reserve
    reserve = schema_bounds("tenant_reserve", schema.QueueSettings)[end]
    text = {f.path: f for f in render.render_host(k100(sets + [f"proxy.queue.tenant_reserve={reserve}"]))}
    assert parse_config(yaml.safe_load(text["conf/proxy.yaml"].content)).queue.tenant_reserve == reserve
    plain = {f.path: f for f in render.render_host(k100([]))}["conf/proxy.yaml"].content
    assert "tenants" not in plain and "tenant_reserve" not in plain


@pytest.mark.unit
@pytest.mark.parametrize("tenants, message", [
    ({"app": {"weight": 0}}, "tenants.app.weight must be a whole number from 1 to 1000, not 0."),
    ({"app": {"burst": 3}}, "unknown config key 'tenants.app.burst' (known: weight, max_in_flight, "
                            "max_queued, requests_per_minute, tokens_per_minute)."),
    ({"app": {"max_queued": 1.5}}, "tenants.app.max_queued must be a whole number from 0 to 1000000, not 1.5."),
    ({"a b": {}}, "tenant name 'a b' must be letters, digits, '.', '_' or '-' (at most 64)."),
])
def test_tenant_settings_a_proxy_cannot_take_are_refused_in_one_sentence(tenants, message):
    with pytest.raises(ConfigError) as e:
        parse_config({"backends": ["a:1"], "tenants": tenants})
    assert str(e.value) == message
    with pytest.raises(pydantic.ValidationError):
        schema.ProxySettings(tenants=tenants)
    with pytest.raises(ConfigError) as e:
        parse_config({"backends": ["a:1"], "queue": {"tenant_reserve": -1}})
    assert str(e.value) == "queue.tenant_reserve must be a whole number of at least 0, not -1."


@pytest.mark.unit
def test_a_key_file_names_tenants_and_one_naming_an_unknown_tenant_is_refused_without_the_key(tmp_path):
    """1. `KEY` is default's, `KEY TENANT` that tenant's; 2. a tenant the config does not define is refused
    in one sentence naming the line, not the key; 3. so is a line of three words; 4. so is a key given
    to two tenants."""
    path = tmp_path / "keys"
    path.write_text("# clients\nsk-plain\nsk-app app\n  sk-batch   batch \n")
    assert load_api_keys(str(path), ("default", "app", "batch")) == {
        b"sk-plain": "default", b"sk-app": "app", b"sk-batch": "batch"}
    with pytest.raises(ConfigError) as e:
        load_api_keys(str(path), ("default", "app"))
    assert str(e.value) == (f"api_keys_file {path} line 4 names the tenant 'batch', which proxy.tenants does "
                            "not define (it has app, default); add it there or fix the line.")
    assert "sk-" not in str(e.value)
    path.write_text("sk-a app extra\n")
    with pytest.raises(ConfigError, match="line 1 has more than a key and a tenant"):
        load_api_keys(str(path), ("default", "app"))
    path.write_text("sk-a app\nsk-a\n")
    with pytest.raises(ConfigError, match="line 2 gives a key listed before to another tenant"):
        load_api_keys(str(path), ("default", "app"))


def serve_order(b: Balancer, waiting: list, releases: int) -> list[str]:
    """Free one slot at a time, `releases` times; the tenants the slots went to, in order."""
    order = []
    for _ in range(releases):
        held = next(x for x in b.backends.values() if x.in_flight)
        before = {id(w): w.future.done() for w in waiting}
        b.release(held)
        order += [w.tenant.name for w in waiting if w.future.done() and not before[id(w)]]
    return order


async def queue_up(b: Balancer, tenant: Tenant, n: int, tokens: int = 100) -> list:
    """n requests of tenant put in b's queue (every slot is taken); their Waiter objects."""
    tasks = [asyncio.create_task(b.wait_for_slot(30, tenant=tenant, tokens=tokens)) for _ in range(n)]
    await asyncio.sleep(0)
    return tasks


def waiters(b: Balancer) -> list:
    return list(b._queue._fifos.values())


@pytest.mark.unit
def test_two_tenants_of_equal_weight_alternate_and_each_keeps_its_own_order():
    """1. one slot is taken; 2. batch queues 6, then app queues 3; 3. the freed slots alternate between
    them (app first: batch's request on the slot was counted) until app has none left, then batch's rest; 4. each
    tenant's requests are served in their arrival order."""
    async def run():
        b = balancer(n=1)
        app, batch = Tenant("app"), Tenant("batch")
        b.acquire(tenant=batch)
        t_batch = await queue_up(b, batch, 6)
        t_app = await queue_up(b, app, 3)
        assert b.queued == 9 and app.queued == 3 and batch.queued == 6
        got = []
        for _ in range(9):
            held = b.backends["b0:1"]
            b.release(held, next(t for t in (app, batch) if t.in_flight))
            await asyncio.sleep(0)
            got.append("app" if sum(t.done() for t in t_app) > got.count("app") else "batch")
        assert got == ["app", "batch", "app", "batch", "app", "batch", "batch", "batch", "batch"]
        assert [t.done() for t in t_batch + t_app] == [True] * 9
        assert b.queued == 0 and app.queued == batch.queued == 0
    asyncio.run(run())


@pytest.mark.unit
def test_weights_three_to_one_serve_three_to_one_and_an_idle_tenant_banks_nothing():
    """1. gold (weight 3) and lead (weight 1) both wait with 40 each: of the first 20 slots gold gets 15;
    2. lead alone then takes every freed slot (work-conserving); 3. gold comes back with 4 requests
    after lead was served 10 more: gold is served at once, and lead still gets its 1 in 4 (gold did
    not bank credit for the time it was idle)."""
    async def run():
        b = balancer(n=1)
        gold, lead = Tenant("gold", TenantConfig(weight=3)), Tenant("lead")
        b.acquire(tenant=lead)
        tg = await queue_up(b, gold, 40)
        tl = await queue_up(b, lead, 40)

        async def serve(k: int) -> list[str]:
            out = []
            for _ in range(k):
                done_g = sum(t.done() for t in tg)
                holder = gold if gold.in_flight else lead
                b.release(b.backends["b0:1"], holder)
                await asyncio.sleep(0)
                out.append("gold" if sum(t.done() for t in tg) > done_g else "lead")
            return out
        first = await serve(20)
        assert first.count("gold") == 15, first
        for t in tg:
            if not t.done():
                t.cancel()
        await asyncio.sleep(0)
        assert gold.queued == 0
        assert (await serve(10)) == ["lead"] * 10
        tg = await queue_up(b, gold, 4)
        again = await serve(5)
        assert again[0] == "gold" and again.count("lead") == 1, again
        for t in tg + tl:
            t.cancel()
        await asyncio.sleep(0)
    asyncio.run(run())


@pytest.mark.unit
def test_a_tenant_at_its_max_in_flight_is_passed_over_and_its_max_queued_is_a_refusal():
    """1. two backends of one slot; capped (max_in_flight 1, max_queued 2) takes one slot, then queues 2;
    2. a third of its requests is refused by TenantFull naming max_in_flight; 3. other takes the second
    slot and queues one; 4. the slot other frees goes to other's waiter, passing capped's (at its cap);
    5. capped's own slot, freed, goes to its oldest waiter; slots never exceed one per backend."""
    async def run():
        b = balancer(n=2)
        capped = Tenant("capped", TenantConfig(max_in_flight=1, max_queued=2))
        other = Tenant("other")
        assert b.may_take(capped)
        first = b.acquire(tenant=capped)
        assert not b.may_take(capped) and b.may_take(other)
        tc = await queue_up(b, capped, 2)
        assert capped.queued == 2 and capped.in_flight == 1
        with pytest.raises(TenantFull) as e:
            await b.wait_for_slot(30, tenant=capped)
        assert e.value.args[0] == "max_in_flight" and "tenant capped has 1 requests in flight" in e.value.args[1]
        second = await b.wait_for_slot(30, tenant=other)    # capped's waiters do not hold up other
        assert second is not None and second is not first and other.in_flight == 1
        to = await queue_up(b, other, 1)
        b.release(second, other)
        await asyncio.sleep(0)
        assert to[0].done() and not any(t.done() for t in tc)
        b.release(first, capped)
        await asyncio.sleep(0)
        assert [t.done() for t in tc] == [True, False]
        assert capped.in_flight == 1 and capped.queued == 1
        assert [x.in_flight for x in b.backends.values()] == [1, 1]
        tc[1].cancel()
        await asyncio.sleep(0)
        assert capped.queued == 0 and b.queued == 0
    asyncio.run(run())


class Recorder(Policy):
    """A policy that records the order the queue hands it, and takes the third waiter of it."""

    def __init__(self):
        from proxy.routing import RoutingConfig
        super().__init__(RoutingConfig(lookahead=2))
        self.seen = []

    def pick(self, route, least, candidates):
        return least

    def waiter(self, queue, backends):
        order = list(itertools.islice(queue, 3))
        self.seen.append([w.tenant.name for w in order])
        return order[2] if len(order) > 2 else None


@pytest.mark.unit
def test_the_routing_policy_reads_the_fair_order_and_reorders_only_the_first_tenants_own_waiters():
    """1. a holds the slot and queues a1 a2 a3, then b queues b1 (equal weights): the fair order is b1 a1 a2 a3
    (a's request on the slot was counted); 2. the policy sees that order and would take its third, a2: another
    tenant's than the head's, so b1 keeps its turn and gets the slot (a look-ahead never costs a tenant its
    share: a flood's cached prompts would overtake an interactive tenant again and again); 3. next, the order
    is a1 a2 a3 and the policy's third, a3, is the head's own tenant's: taken, and a1 and a2, passed over,
    each count one overtaking."""
    async def run():
        b = balancer(n=1)
        b.policy = rec = Recorder()
        a, bt = Tenant("a"), Tenant("b")
        b.acquire(tenant=a)
        ta = await queue_up(b, a, 3)
        tb = await queue_up(b, bt, 1)
        queue = b._queue
        assert [w.tenant.name for w in queue] == ["b", "a", "a", "a"]
        ws = list(queue)
        b.release(b.backends["b0:1"], a)
        await asyncio.sleep(0)
        assert rec.seen[0] == ["b", "a", "a"]
        assert tb[0].done() and not any(t.done() for t in ta) and [w.overtaken for w in ws] == [0, 0, 0, 0]
        b.release(b.backends["b0:1"], bt)
        await asyncio.sleep(0)
        assert rec.seen[1] == ["a", "a", "a"]
        assert ta[2].done() and not ta[0].done() and not ta[1].done()
        assert [w.overtaken for w in ws[1:3]] == [1, 1]
        for t in ta + tb:
            t.cancel()
        await asyncio.sleep(0)
    asyncio.run(run())


@pytest.mark.unit
def test_a_tenant_that_ran_alone_banks_nothing_against_one_that_comes_after_it():
    """1. One slot; tenant a runs 10 requests alone, each taking the free slot at once (it never queues);
    2. a holds the slot, b queues 3 requests and a one: in the fair order a's comes before b's third (a is
    one request ahead: the one it holds), not behind all of b's (b starts at the queue's present, where a's
    time stood, not at 0, 1,000 tokens behind a)."""
    async def run():
        b = balancer(n=1)
        a, bt = Tenant("a"), Tenant("b")
        for _ in range(10):
            b.release(b.acquire(tenant=a, tokens=100), a)
        b.acquire(tenant=a, tokens=100)
        tb = await queue_up(b, bt, 3)
        ta = await queue_up(b, a, 1)
        assert [w.tenant.name for w in b._queue] == ["b", "b", "a", "b"]
        for t in ta + tb:
            t.cancel()
        await asyncio.sleep(0)
    asyncio.run(run())


@pytest.mark.unit
def test_token_cost_serves_tokens_in_proportion_and_request_cost_serves_requests():
    """The fair queue on its own: long (1000-token prompts) and short (100) both backlogged, equal weights.
    1. counted in tokens, short is served 10 requests for each of long's; 2. counted in requests, 1 for 1."""
    for cost, want in (("tokens", 10), ("requests", 1)):
        q = FairQueue(cost)
        long_, short = Tenant("long"), Tenant("short")

        class W:
            def __init__(self, tenant, tokens):
                self.tenant, self.tokens, self.route, self.overtaken = tenant, tokens, None, 0
        for _ in range(50):
            q.append(W(long_, 1000))
            q.append(W(short, 100))
        served = []
        for _ in range(22):
            w = next(iter(q))
            q.served(w, charge=True)
            served.append(w.tenant.name)
        assert served.count("short") == want * served.count("long"), (cost, served)


@pytest.mark.unit
def test_buckets_refuse_past_their_rate_and_usage_corrects_the_tokens_taken():
    """1. requests_per_minute 2: the third request within the minute is refused, naming the limit, with
    the wait until one is back (30 s at 2 a minute); 2. tokens_per_minute 600: a request reckoned at 500
    that used 100 gives 400 back; one that used 1100 leaves the bucket 500 in debt: 50.1 s until a token is back."""
    now = [0.0]
    t = Tenant("app", TenantConfig(requests_per_minute=2, tokens_per_minute=600))
    t.requests, t.tokens = Bucket(2, lambda: now[0]), Bucket(600, lambda: now[0])
    for _ in range(2):
        assert t.refusal() is None
        t.admitted(500)
        t.used(500, 100)
    limit, message, wait = t.refusal()
    assert limit == "requests_per_minute" and wait == 30.0
    assert message == "tenant app sent its 2 requests per minute (requests_per_minute); retry in 30s."
    assert t.tokens.level == 400
    now[0] = 60.0
    assert t.refusal() is None
    t.admitted(500)
    t.used(500, 1100)     # 600 - 1100: 500 in debt
    limit, _, wait = t.refusal()
    assert limit == "tokens_per_minute" and wait == pytest.approx(501 / 10)   # 10 tokens a second


@pytest.mark.unit
def test_a_reload_keeps_a_tenants_counts_and_drops_a_removed_one():
    tenants = Tenants({"app": TenantConfig(weight=2)})
    tenants["app"].in_flight = 3
    tenants.update({"app": TenantConfig(weight=5), "new": TenantConfig()})
    assert tenants["app"].in_flight == 3 and tenants["app"].weight == 5
    assert tenants.names() == ["default", "app", "new"]
    tenants.update({})
    assert tenants.names() == ["default"]


@pytest.mark.unit
def test_nginx_refuses_a_host_with_tenants_saying_what_to_keep():
    """nginx mode has no shared queue to share slots by tenant: swap-to-nginx (and a deploy in nginx mode)
    refuse a host with `proxy.tenants` in one sentence; without tenants nothing changes."""
    from test_render import k100 as host_vars

    from fleet.plan import steps as plan
    assert plan.nginx_refusal(host_vars([])) is None
    why = plan.nginx_refusal(host_vars(["proxy.tenants.app.weight=3", "proxy.tenants.batch.weight=1"]))
    assert why == ("k100-01: nginx cannot be the front here: it cannot share the slots fairly among the tenants "
                   "app, batch nor keep their limits; keep the proxy as the front, or drop `proxy.tenants` to use "
                   "nginx.")


@pytest.mark.unit
def test_a_full_queue_turns_away_the_flooding_tenants_newest_not_the_newcomer():
    """1. one slot, queue max 4, all 4 waiting are batch's; 2. app's request arrives: batch's newest waiter
    gets QueueFull (429) and app waits in its place; 3. another of batch's is refused itself (batch holds 3
    of 4, app 1); 4. the freed slot goes to app (its share), then batch's in order."""
    from proxy.balancer import QueueFull

    async def run():
        b = balancer(n=1, queue_max=4)
        app, batch = Tenant("app"), Tenant("batch")
        b.acquire(tenant=batch)
        tb = await queue_up(b, batch, 4)
        ta = await queue_up(b, app, 1)
        await asyncio.sleep(0)
        assert tb[3].done() and isinstance(tb[3].exception(), QueueFull)
        assert b.queued == 4 and app.queued == 1 and batch.queued == 3
        with pytest.raises(QueueFull):
            await b.wait_for_slot(30, tenant=batch)
        b.release(b.backends["b0:1"], batch)
        await asyncio.sleep(0)
        assert ta[0].done() and not any(t.done() for t in tb[:3])
        for t in tb[:3]:
            t.cancel()
        await asyncio.sleep(0)
    asyncio.run(run())


@pytest.mark.unit
def test_a_request_turned_away_by_the_queue_gives_back_what_its_buckets_gave():
    """A request admitted by its tenant's buckets, then refused by the queue (full), took nothing of the
    fleet: its request and its tokens go back, so the limits count only what was served."""
    now = [0.0]
    t = Tenant("app", TenantConfig(requests_per_minute=1, tokens_per_minute=100))
    t.requests, t.tokens = Bucket(1, lambda: now[0]), Bucket(100, lambda: now[0])
    t.admitted(80)
    assert t.refusal()[0] == "requests_per_minute"
    t.refunded(80)
    assert t.refusal() is None and t.tokens.level == 100


def reserved(n: int, reserve: int = 1) -> tuple[Balancer, list]:
    """A pool of n one-slot backends with `reserve` (proxy.queue.tenant_reserve) and a clock tests move."""
    b = balancer(n=n)
    now = [1000.0]
    b._queue._clock = lambda: now[0]
    b.set_reserve(reserve)
    return b, now


@pytest.mark.unit
def test_the_reserve_keeps_the_last_free_slot_from_a_flooding_tenant_while_another_is_active():
    """8 slots, reserve 1, app and batch of equal weight (a share of 4 each while both are active).
    1. app holds 1; batch takes slots while more than one is free or it holds no more than its share: 6,
    then it may not (may_take False) and its next request queues though a slot is free;
    2. app's new request takes that free slot at once: nobody is ahead of it in the fair order;
    3. a batch slot freed stays free (batch above its share, app active), and app's next request takes it;
    4. app's 3 requests end: the first slot freed stays free (the reserve), the next two go to batch's
    waiters; 5. app stays away RESERVE_ACTIVE_S: a freed slot and the reserved one go to batch's last two
    waiters, every slot busy (an idle tenant's share goes to the others)."""
    from proxy.admission import RAMP_S, RESERVE_ACTIVE_S

    async def run():
        b, now = reserved(8)
        app, batch = Tenant("app"), Tenant("batch")
        first = b.acquire(tenant=app)
        held = []
        while b.may_take(batch):
            held.append(b.acquire(tenant=batch))
            now[0] += 1.5 * RAMP_S
        assert batch.in_flight == 6 and b._free_slots() == (1, 8)
        tb = await queue_up(b, batch, 4)
        assert b.queued == 4 and b._free_slots() == (1, 8)
        assert b.may_take(app) and b.acquire(tenant=app) is not None and b._free_slots() == (0, 8)
        b.release(held.pop(), batch)
        await asyncio.sleep(0)
        assert b._free_slots() == (1, 8) and not any(t.done() for t in tb)
        assert b.may_take(app) and b.acquire(tenant=app) is not None
        assert app.in_flight == 3 and batch.in_flight == 5
        for _ in range(3):      # app's requests end
            now[0] += 1.5 * RAMP_S
            b.release(next(x for x in b.backends.values() if x.in_flight and x not in held), app)
            await asyncio.sleep(0)
            assert b._free_slots() == (1, 8)
        assert [t.done() for t in tb] == [True, True, False, False] and batch.in_flight == 7
        now[0] += RESERVE_ACTIVE_S + 1       # app was last seen longer ago than that: nobody to keep it for
        b.release(held.pop(), batch)
        await asyncio.sleep(0)
        assert all(t.done() for t in tb) and b.queued == 0 and b._free_slots() == (0, 8) and batch.in_flight == 8
    asyncio.run(run())


@pytest.mark.unit
def test_without_a_reserve_or_another_active_tenant_a_flooding_tenant_takes_every_slot():
    """1. reserve 0: batch takes all 8 slots beside app's; 2. reserve 1 but batch alone (no other tenant
    active in the pool): it takes all 8 too; the reserve never costs a tenant that is alone."""
    b, _ = reserved(8, reserve=0)
    app, batch = Tenant("app"), Tenant("batch")
    b.acquire(tenant=app)
    while b.may_take(batch) and b.acquire(tenant=batch) is not None:
        pass
    assert batch.in_flight == 7 and b._free_slots() == (0, 8)
    b, _ = reserved(8)
    batch = Tenant("batch")
    while b.may_take(batch) and b.acquire(tenant=batch) is not None:
        pass
    assert batch.in_flight == 8


@pytest.mark.unit
def test_two_backlogged_tenants_leave_no_slot_idle_with_a_reserve():
    """Reserve 1, 8 slots, gold (weight 3) and lead (weight 1) both keep 40 waiting: after each of 30
    releases every slot is taken again (one of them is always at or below its share, so it takes the last
    free slot), and gold holds 5 to 7 of the 8 (its share is 6)."""
    async def run():
        b, _ = reserved(8)
        gold, lead = Tenant("gold", TenantConfig(weight=3)), Tenant("lead")
        tasks = await queue_up(b, gold, 40) + await queue_up(b, lead, 40)
        assert b._free_slots() == (0, 8)
        for i in range(30):
            busy = next(x for x in b.backends.values() if x.in_flight)
            b.release(busy, gold if gold.in_flight > 6 or (i % 2 and gold.in_flight) or not lead.in_flight else lead)
            await asyncio.sleep(0)
            assert b._free_slots() == (0, 8), i
            assert 5 <= gold.in_flight <= 7, i
        for t in tasks:
            t.cancel()
        await asyncio.sleep(0)
    asyncio.run(run())


@pytest.mark.unit
def test_above_its_share_a_flood_takes_the_idle_slots_one_per_ramp_interval():
    """8 slots, reserve 1, app holds 1 and is active (its share and batch's: 4). 1. batch's requests take
    its share at once and one more (5); 2. its next waits though 2 slots are free; RAMP_S later (the
    pool's own timer dispatches then) it has the slot (6); 3. the last free slot is the reserve: batch's
    third waiter stays waiting whatever the time."""
    from proxy.admission import RAMP_S

    async def run():
        b = balancer(n=8)
        b.set_reserve(1)
        app, batch = Tenant("app"), Tenant("batch")
        b.acquire(tenant=app)
        while b.may_take(batch):
            b.acquire(tenant=batch)
        assert batch.in_flight == 5 and b._free_slots() == (2, 8)
        tb = await queue_up(b, batch, 2)
        assert not any(t.done() for t in tb)
        await asyncio.wait_for(tb[0], 20 * RAMP_S)
        assert batch.in_flight == 6 and b._free_slots() == (1, 8)
        await asyncio.sleep(3 * RAMP_S)
        assert not tb[1].done() and b.queued == 1
        tb[1].cancel()
        await asyncio.sleep(0)
    asyncio.run(run())
