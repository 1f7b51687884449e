"""The proxy routes by the body's `model` (issue 18): one pool per served model, each with its own
least-connections pick, slots and queue; aliases and adapters reach their model; an unknown model is
vLLM's 404 and never reaches an engine; GET /v1/models is the union of what the backends serve.

The config and the name scan are tested on their own, then the proxy as a process before sim engines.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from conftest import http_status, wait_until
from proxy.config import ConfigError, parse_config
from proxy.models import NO_MODEL, Router, model_of
from proxy_helpers import start_proxy, start_sims

def config(models, backends=("a:1", "a:2", "b:1")):
    return parse_config({"backends": list(backends), "models": models})


TWO = [{"name": "vision", "aliases": ["see"], "adapters": ["style"], "slots": 6, "backends": ["a:1", "a:2"]},
       {"name": "text", "slots": 3, "backends": ["b:1"]}]


@pytest.mark.unit
def test_the_models_form_parses_into_pools():
    c = config(TWO)
    assert [(p.name, p.backends, p.slots, p.names) for p in c.models] == [
        ("vision", ("a:1", "a:2"), 6, ("vision", "see", "style")), ("text", ("b:1",), 3, ("text",))]
    assert parse_config({"backends": ["a:1"]}).models == ()


@pytest.mark.unit
@pytest.mark.parametrize("models, backends, says", [
    ([{"name": "x", "backends": ["a:9"]}], ("a:1",), "backend 'a:9' is not in 'backends'"),
    ([{"name": "x", "backends": ["a:1"]}, {"name": "y", "backends": ["a:1"]}], ("a:1",),
     "backend a:1 is in two models, 'x' and 'y'"),
    ([{"name": "x", "backends": ["a:1"]}, {"name": "y", "aliases": ["x"], "backends": ["a:2"]}], ("a:1", "a:2"),
     "the name 'x' reaches two models, 'x' and 'y'"),
    ([{"name": "x", "backends": ["a:1"]}], ("a:1", "a:2"), "backend(s) a:2 serve no model"),
    ([{"name": "x", "backends": []}], ("a:1",), "model 'x': backends must be a non-empty list"),
    ([{"name": "x", "backends": ["a:1"], "aliases": "y"}], ("a:1",), "model 'x': aliases must be a list"),
    ([{"name": "x", "backends": ["a:1"], "weight": 2}], ("a:1",), "unknown config key 'models[0].weight'"),
    ([], ("a:1",), "models must be a non-empty list"),
])
def test_a_wrong_models_form_is_one_sentence(models, backends, says):
    with pytest.raises(ConfigError) as e:
        config(models, backends)
    assert says in str(e.value) and str(e.value).endswith(".")


@pytest.mark.unit
@pytest.mark.parametrize("body, model", [
    (b'{"model": "vision", "messages": []}', "vision"),
    (b'{"messages": [{"role": "user", "content": "say \\"model\\": \\"x\\""}], "model":"text"}', "text"),
    (b'{"metadata": {"model": "inner"}, "model": "outer"}', "outer"),       # parsed whole: two keys
    (b'{"model": "caf\\u00e9"}', "caf\u00e9"),
    (b'{"messages": []}', NO_MODEL),
    (b'{"model": 3}', NO_MODEL),
    (b"", NO_MODEL),
    (b"[1, 2]", None),
    (b"not json", None),
])
def test_model_of_reads_the_top_level_model(body, model):
    assert model_of(body) == model


@pytest.mark.unit
def test_the_router_resolves_names_and_learns_adapters_from_the_backends():
    r = Router(config(TWO))
    assert r.by_model and set(r.pools) == {"vision", "text"} and r.only() is None
    assert [r.resolve(n) for n in ("vision", "see", "style", "text", "rt")] == [
        "vision", "vision", "vision", "text", None]
    a1 = r.backends["a:1"]
    r.set_served(a1, [{"id": "vision"}, {"id": "rt", "parent": "vision"}])
    assert r.resolve("rt") == "vision"
    r.set_served(a1, [{"id": "vision"}])
    assert r.resolve("rt") is None
    assert [b.slots for b in r.backends.values()] == [6, 6, 3]
    plain = Router(parse_config({"backends": ["a:1"], "slots": 2}))
    assert not plain.by_model and plain.only() is plain.pools[NO_MODEL]


@pytest.mark.unit
def test_a_reload_keeps_the_backends_that_stay_in_their_pool():
    r = Router(config(TWO))
    a1 = r.backends["a:1"]
    r.mark(a1, True)
    moved = [{"name": "vision", "backends": ["a:1"]}, {"name": "text", "backends": ["a:2", "b:1"]}]
    added, removed = r.update(config(moved))
    assert r.backends["a:1"] is a1 and a1.healthy
    assert r.backends["a:2"] is not None and r.model_label(r.backends["a:2"]) == "text"
    assert added == [] and removed == []


@pytest.mark.unit
def test_a_reload_holds_a_new_backend_until_healthy_and_drains_a_removed_one():
    """A host joining and one leaving an entry host's fleet, as the proxy's reload sees it:
    1. a:1 healthy carries two requests; 2. the reload adds b:1 and removes a:1: no new request goes to
    either (b:1 has not answered /health yet; a:1 is gone), and a:1 is `leaving` with its two requests;
    3. b:1's first good /health makes it the pick; 4. a:1's requests end: nothing is leaving any more."""
    r = Router(parse_config({"backends": ["a:1"], "slots": 4}))
    pool = r.only()
    a1 = r.backends["a:1"]
    r.mark(a1, True)
    held = [pool.acquire(), pool.acquire()]
    assert held == [a1, a1]
    added, removed = r.update(parse_config({"backends": ["b:1"], "slots": 4}))
    assert (added, removed) == (["b:1"], ["a:1"])
    assert pool.acquire() is None
    assert [(b.name, b.in_flight) for b in r.leaving()] == [("a:1", 2)]
    r.mark(r.backends["b:1"], True)
    assert pool.acquire().name == "b:1"
    for b in held:
        pool.release(b)
    assert r.leaving() == [] and a1.in_flight == 0


@pytest.mark.unit
def test_one_pools_queue_never_holds_up_another():
    r = Router(config(TWO, backends=("a:1", "a:2", "b:1")))
    for b in r.backends.values():
        r.mark(b, True)

    async def run():
        vision, text = r.pools["vision"], r.pools["text"]
        held = [vision.acquire() for _ in range(12)]
        assert all(held) and vision.acquire() is None     # 2 backends x 6 slots
        waiting = asyncio.create_task(vision.wait_for_slot(5))
        await asyncio.sleep(0)
        assert vision.queued == 1 and r.queued == 1
        assert text.acquire() is not None                 # text's slots are its own
        vision.release(held[0])
        assert (await waiting).name == held[0].name
    asyncio.run(run())


# The proxy as a process before sim engines: vision on two, text on one.

def post(port, body: dict, path="/v1/chat/completions"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def results(tmp_path, at_least=1) -> list[dict]:
    """The results log's lines once it holds at_least (it is written off the event loop)."""
    path = tmp_path / "req_results.log"

    def lines():
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    wait_until(lambda: len(lines()) >= at_least, what=f"{at_least} results-log lines")
    return lines()


@pytest.fixture
def fleet(procs, tmp_path):
    vision = start_sims(procs, tmp_path, 2, seqs=1, token_ms=40,
                        extra=["--served-model-name", "vision", "see", "rt-style"])
    text = start_sims(procs, tmp_path, 1, seqs=2, extra=["--served-model-name", "text"])
    models = [{"name": "vision", "aliases": ["see"], "adapters": [], "slots": 1,
               "backends": [f"127.0.0.1:{p}" for p in vision]},
              {"name": "text", "aliases": [], "adapters": [], "slots": 2, "backends": [f"127.0.0.1:{text[0]}"]}]
    port, admin = start_proxy(procs, tmp_path, vision + text, models=models, queue={"max": 64, "timeout_s": 30})
    # The proxy has read every backend's /v1/models (the name only the vision sims list routes).
    wait_until(lambda: http_status(f"http://127.0.0.1:{port}/v1/models") == 200
               and len(json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())["data"]) == 4,
               what="the proxy's model list")
    return port, admin, vision, text


@pytest.mark.process
def test_requests_go_to_their_models_backends(fleet, tmp_path):
    port, _, vision, text = fleet
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
    seen: dict[str, set] = {}
    for model in ["vision", "see", "rt-style", "text"] * 2:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.parse().model == ("text" if model == "text" else "vision")   # vLLM answers its first name
        seen.setdefault(model, set()).add(raw.headers["X-Backend"])
    names = {f"127.0.0.1:{p}" for p in vision}
    assert seen["vision"] | seen["see"] | seen["rt-style"] <= names
    assert seen["text"] == {f"127.0.0.1:{text[0]}"}
    logged = {(e["model"], e.get("served_model")) for e in results(tmp_path, 8)}
    assert logged == {("vision", None), ("see", "vision"), ("rt-style", "vision"), ("text", None)}
    ids = sorted(m.id for m in client.models.list().data)
    assert ids == ["rt-style", "see", "text", "vision"]


@pytest.mark.process
def test_an_unknown_model_is_vllms_404_and_never_reaches_an_engine(fleet, tmp_path):
    port, _, vision, text = fleet
    sent = [json.loads(urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats").read()) for p in vision + text]
    status, headers, body = post(port, {"model": "nope", "user": "trace-404",
                                        "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and "X-Backend" not in headers
    assert body == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}}
    lines = [e for e in results(tmp_path) if e.get("trace_id") == "trace-404"]   # the fixture's own log
    assert [(e["status"], e["backend"], e["model"]) for e in lines] == [(404, None, "nope")]
    after = [json.loads(urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats").read()) for p in vision + text]
    assert after == sent
    status, _, body = post(port, {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and "names no `model`; this host serves vision, text" in body["error"]["message"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert 'proxy_model_requests_total{model="none",status="404"} 1.0' in metrics
    assert 'proxy_backend_model{backend="127.0.0.1:%d",model="text"} 1.0' % text[0] in metrics


@pytest.mark.process
def test_a_saturated_model_does_not_hold_up_another(fleet, tmp_path):
    """vision has 2 backends x 1 slot at 40 ms a token: 8 long requests fill it and queue; text's
    requests meanwhile go straight to its own backend, none of them waits in a queue."""
    port, admin, _, _ = fleet
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def run():
        async with aiohttp.ClientSession() as s:
            async def ask(model, tokens):
                t0 = time.monotonic()
                async with s.post(url, json={"model": model, "max_tokens": tokens,
                                             "messages": [{"role": "user", "content": "x"}]}) as r:
                    await r.read()
                    return r.status, time.monotonic() - t0
            slow = [asyncio.create_task(ask("vision", 20)) for _ in range(8)]

            def vision_queued():
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/admin/config") as r:
                    pools = {p["name"]: p["queued"] for p in json.loads(r.read())["models"]}
                return pools["vision"] >= 4 and pools
            pools = await asyncio.to_thread(wait_until, vision_queued, what="vision's queue filling")
            assert pools["text"] == 0
            quick = await asyncio.gather(*(ask("text", 2) for _ in range(2)))   # text has 2 slots
            still = sum(not t.done() for t in slow)
            done = await asyncio.gather(*slow)
            return quick, still, done
    quick, still, done = asyncio.run(run())
    assert all(status == 200 for status, _ in quick + done)
    assert still >= 1   # text was answered while vision's requests were still waiting or running
    waited = {(e["model"], e["queued_ms"] > 0) for e in results(tmp_path, 10)}
    assert ("vision", True) in waited and ("text", True) not in waited


@pytest.mark.process
def test_a_refresh_learns_a_name_the_backends_list_now(fleet):
    """The admin's refresh-models reads every backend's /v1/models at once: `inv lora add` calls it."""
    port, admin, _, _ = fleet
    req = urllib.request.Request(f"http://127.0.0.1:{admin}/admin/refresh-models", b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert sorted(json.loads(r.read())["models"]) == ["rt-style", "see", "text", "vision"]
