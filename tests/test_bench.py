"""`inv bench` against real sim clusters deployed through the real command line."""
from __future__ import annotations

import json
import struct
import urllib.request
import xml.etree.ElementTree as ET
import zlib
from datetime import datetime

import pytest
from conftest import wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory

from fleet.commands import bench

# One request: 300 ms to the first token (whatever the prompt: no prefill time) + 16 tokens x 40 ms,
# about 1 s, long enough that process start-up jitter on a loaded machine stays well inside the 20% the
# parallel check allows.
SLOW_SIM = "{load_s: 0.3, overhead_ms: 300, prefill_ms: 0, token_ms: 40, output_tokens: 16}"


def deployed(tmp_path, edit=lambda text: text, **kw):
    """A deployed sim cluster, on ports of this xdist worker's slice (conftest.free_ports)."""
    inventory = write_inventory(tmp_path, **kw)
    inventory.write_text(edit(inventory.read_text()))
    r = inv("deploy", "--host", "t", inventory=inventory)
    if r.returncode != 0:
        undeploy(inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    return inventory


def undeploy(inventory):
    inv("stop", "--host", "t", inventory=inventory)
    kill_tagged(deployment_id(inventory) + "/")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """8 instances x max_num_seqs 4 (capacity 32), then one `inv bench` sweep 8..64 of the short scenario;
    with the proxy's results-log lines of each level."""
    tmp = tmp_path_factory.mktemp("bench8")
    inventory = deployed(tmp, instances=8, max_num_seqs=4, sim=SLOW_SIM)
    try:
        out = tmp / "out"
        r = inv("bench", "--host", "t", "--scenario", "short", "--out", str(out), inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads((out / "bench.json").read_text())
        yield r, result, out, logged_levels(tmp / "deploy" / "logs" / "req_results.log", result)
    finally:
        undeploy(inventory)


def most_at_once(lines: list[dict]) -> int:
    """The most requests in flight at one instant, from results-log lines (each ended at `ts` and took
    `latency_ms` from its arrival)."""
    edges = []
    for e in lines:
        end = datetime.fromisoformat(e["ts"]).timestamp()
        edges += [(end - e["latency_ms"] / 1000, 1), (end, -1)]
    most = now = 0
    for _, step in sorted(edges):     # an end before a start at the same instant: never counted as overlap
        now += step
        most = max(most, now)
    return most


def logged_levels(path, result) -> dict[int, list[dict]]:
    """The results log's final line of each request, by level: the single request comes first, then the
    levels one after another, each to its end, so the log's last lines are the last level's, and so back
    (the log is written off the proxy's event loop: wait for every line)."""
    levels = result["scenarios"][0]["levels"]
    want = 1 + sum(lv["requests"] for lv in levels)

    def finals():
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [e for e in lines if e["final"]]
    wait_until(lambda: len(finals()) >= want, what=f"{want} requests in the results log")
    logged, by_level = finals(), {}
    assert len(logged) == want, logged
    for lv in reversed(levels):
        logged, by_level[lv["concurrency"]] = logged[:-lv["requests"]], logged[-lv["requests"]:]
    return by_level


@pytest.mark.cluster
@pytest.mark.xdist_group("load")
def test_throughput_stops_growing_at_capacity_and_the_slots_run_in_parallel(sweep):
    """1. capacity 32: up to 32 concurrent requests nobody waits in the proxy's queue and the slots run
    together; beyond 32, requests wait their turn and the level takes at least two request times;
    2. the terminal says what the bench found, with the queueing sentence and a daily estimate.
    What is asserted follows from the slots, not from timings a busy machine stretches (the sweep's
    throughput figures are printed for the log; `bench.saturation` and `bench.analyse` are tested on
    fixed figures below)."""
    r, result, _, logged = sweep
    sc = result["scenarios"][0]
    assert result["capacity"] == 32 and sc["scenario"] == "short" and sc["max_tokens"] == 64
    levels = {lv["concurrency"]: lv for lv in sc["levels"]}
    assert list(levels) == [8, 16, 32, 48, 64]
    assert all(lv["success_rate"] == 1.0 for lv in levels.values()), r.stdout
    rps = {c: lv["throughput_rps"] for c, lv in levels.items()}
    print("throughput by concurrency:", rps, "parallel ratio at 32:", sc["findings"].get("parallel_ratio"))

    # One request takes at least the sim's schedule: 300 ms to the first token + 16 x 40 ms.
    least_s = 0.3 + 16 * 0.04
    assert sc["single"]["latency_s"] >= least_s * 0.95, sc["single"]
    # Up to the capacity no request waits for a slot; beyond it they do, and 64 requests on 32 slots
    # take two request times at least: throughput cannot grow past the capacity.
    queued = {c: sum(1 for e in logged[c] if e["queued_ms"] > 0) for c in levels}
    assert all(e["status"] == 200 for c in levels for e in logged[c]), [e for c in levels for e in logged[c] if e["status"] != 200]
    assert queued[8] == queued[16] == queued[32] == 0 and queued[64] > 0, queued
    assert levels[64]["total_s"] >= 2 * least_s * 0.95, levels[64]
    assert rps[64] < 64 / (2 * least_s * 0.95), rps
    assert len(levels[32]["by_backend"]) == 8          # every backend took part

    # The sim's smi reports each card's busy slots. At 8, least connections puts one request on each
    # card: no sample ever shows a card past 1 of 4 slots. At 32 the slots run together: by the proxy's
    # own record of each request (its end and its latency), more than half of the 32 slots held requests
    # at one instant (an smi sample every 0.5 s may all fall outside a level on a busy machine).
    at8 = levels[8]["util_samples"]
    assert at8 and all(c["util_pct"] <= 25 for s in at8 for c in s["cards"]), at8
    assert most_at_once(logged[32]) > 16, [(e["ts"], e["latency_ms"], e["backend"]) for e in logged[32]]
    util = levels[32]["utilisation"]
    assert util["cards"] == 8 and 70 <= util["mem_pct"] <= 90, util   # an engine's 52000 of 65520 MiB

    out, found = r.stdout, sc["findings"]
    assert "Accelerators at concurrency" in out and "median utilisation" in out
    sat = found["saturation"]
    assert (f"Throughput stops growing at concurrency {sat} (" if sat else "Throughput still grew") in out
    assert "beyond the server's capacity only adds queueing" in out
    verdict = ("the slots run in parallel" if found["parallel_ratio"] <= 1.5 else
               "requests queued below capacity")
    assert f"At concurrency 32 the 32 requests took {levels[32]['total_s']:.2f} s in all" in out
    assert verdict in out
    daily = found["daily_estimate"]
    assert daily == int(found["peak_throughput_rps"] * 86400 * 0.75)
    assert f"{daily:,} requests a day" in out
    assert "t : ok=1 changed=0 skipped=0 failed=0 unreachable=0" in out


@pytest.mark.cluster
@pytest.mark.xdist_group("load")
def test_report_files_exist_and_parse(sweep):
    """JSON with every request's figures, a Markdown table per scenario, a well-formed SVG chart."""
    _, result, out, _ = sweep
    sc = result["scenarios"][0]
    for lv in sc["levels"]:
        assert len(lv["samples"]) == lv["requests"] == lv["concurrency"]
        lat = lv["latency_s"]
        assert lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert 0 < lv["ttft_s"]["p50"] < lat["p50"]       # streamed: first token before the end
        assert lv["output_tokens"] == 16 * lv["requests"]
        assert sum(lv["by_backend"].values()) == lv["requests"]
    md = (out / "report.md").read_text()
    assert md.startswith("# Load test of t")
    for c in (8, 16, 32, 48, 64):
        assert f"\n| {c} | 100% |" in md
    assert "![throughput and p95 latency against concurrency](chart.svg)" in md

    svg = ET.parse(out / "chart.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert svg.tag == f"{ns}svg"
    assert len(svg.findall(f".//{ns}polyline")) == 2       # throughput and p95 latency
    assert len(svg.findall(f".//{ns}circle")) == 10        # a point per level on each line


@pytest.mark.cluster
def test_a_dead_engines_500_never_reaches_the_bench(tmp_path):
    """1. a 4-instance cluster whose proxy checks /health only once a minute, its API servers staying up
    after their engine dies (vLLM 0.11; 0.32's exits after a few seconds, answering the same meanwhile);
    2. engine death on instance 0 (its /health 503, /v1/models 200, its completions 500 "EngineCore
    encountered an issue"), unseen by the health checks yet; 3. bench: every request succeeds, none is
    answered by the dead instance (the proxy holds its 500 back, sends the request elsewhere and takes it
    out at once), and the proxy counts that ejection."""
    inventory = deployed(tmp_path, instances=4, max_num_seqs=4,
                         sim="{load_s: 0.3, prefill_ms: 20, token_ms: 5, output_tokens: 16}",
                         extra="extra_args: [--sim-after-engine-death, stay]\n",
                         edit=lambda text: text.replace("health_interval_s: 0.5", "health_interval_s: 60"))
    try:
        st = status_json(inventory)
        dead = st["instances"][0]["port"]
        req = urllib.request.Request(f"http://127.0.0.1:{dead}/sim/fault", json.dumps(
            {"fault": "engine-death"}).encode(), {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()
        out = tmp_path / "out"
        r = inv("bench", "--host", "t", "--scenario", "short", "--concurrency", "8,16", "--requests", "24",
                "--out", str(out), inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        sc = json.loads((out / "bench.json").read_text())["scenarios"][0]
        for lv in sc["levels"]:
            assert lv["requests"] == 24 and lv["ok"] == 24 and not lv["failures"], lv
            assert f"127.0.0.1:{dead}" not in {s["backend"] for s in lv["samples"]}
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{st['proxy']['port']}/metrics", timeout=5).read().decode()
        assert f'proxy_ejections_total{{backend="127.0.0.1:{dead}",reason="engine_dead"}} 1.0' in metrics
    finally:
        undeploy(inventory)


@pytest.mark.process
def test_mistakes_are_one_sentence(tmp_path):
    """Bad options and a host with nothing deployed: exit 2, one sentence, no traceback, no report."""
    inventory = write_inventory(tmp_path, instances=2)
    out = tmp_path / "out"
    cases = [
        (["--image", str(tmp_path / "missing.png")], "no such file"),
        (["--concurrency", "8,x"], "--concurrency takes a comma list of positive integers"),
        (["--scenario", "long"], "unknown scenario 'long'"),
        (["--requests", "-3"], "--requests takes a whole number of at least 0, got '-3'"),
        ([], "nothing answers at http://127.0.0.1:"),
    ]
    not_an_image = tmp_path / "notes.txt"
    not_an_image.write_text("hello")
    cases.append((["--image", str(not_an_image)], "not a PNG, JPEG, GIF or WebP file"))
    for args, message in cases:
        r = inv("bench", "--host", "t", "--out", str(out), *args, inventory=inventory)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert message in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr
    assert not out.exists()


@pytest.mark.unit
def test_parallel_finding_counts_the_waves_of_requests_beyond_the_concurrency():
    """--requests 6 at concurrency 4 is two waves: 2x one request is parallel, not queueing (it said
    "2.02x one request alone: requests queued below capacity")."""
    scenario = {"single": {"ok": True, "latency_s": 0.36},
                "levels": [{"concurrency": 4, "requests": 6, "ok": 6, "total_s": 0.72, "throughput_rps": 8.3,
                            "utilisation": None, "failures": {}}]}
    found = bench.analyse(scenario, 16, "4 instances x max_num_seqs 4")
    assert found["parallel_ratio"] == 1.0
    assert ("At concurrency 4 the 6 requests took 0.72 s in all, 1.00x 2 requests one after another "
            "(2 x 0.36 s): the slots run in parallel.") in found["text"]
    scenario["levels"][0].update(requests=4, ok=4, total_s=0.72)
    found = bench.analyse(scenario, 16, "4 instances x max_num_seqs 4")
    assert "2.00x one request alone (0.36 s): requests queued below capacity" in " ".join(found["text"])


@pytest.mark.unit
def test_generated_png_is_a_valid_image():
    png = bench.make_png(8, 4)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and bench.image_mime(png) == "image/png"
    pos, chunks = 8, {}
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", png[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + data)
        chunks[kind] = data
        pos += 12 + length
    assert struct.unpack(">II", chunks[b"IHDR"][:8]) == (8, 4)
    assert len(zlib.decompress(chunks[b"IDAT"])) == 4 * (1 + 8 * 3)
    url = bench.load_image(None)["url"]
    assert url.startswith("data:image/png;base64,")


@pytest.mark.parametrize("rps, expected", [
    ([8, 16, 32, 25, 33], 32),      # the sim's one-wave sweep: flat after capacity
    ([25.5, 44.4, 67.3, 60.2, 60.5], 32),   # the seed's short answers
    ([10, 20, 30, 40, 50], None),   # still growing: not saturated
    ([10, 10.4, 30, 40, 50], 8),    # +4% is not growth
])
@pytest.mark.unit
def test_saturation_is_where_throughput_stops_growing_by_more_than_5_percent(rps, expected):
    levels = [{"concurrency": c, "throughput_rps": x} for c, x in zip((8, 16, 32, 48, 64), rps)]
    assert bench.saturation(levels) == expected


@pytest.mark.unit
def test_percentile_interpolates_between_ranks():
    assert bench.percentile([], 50) is None
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile(list(range(101)), 95) == 95


@pytest.mark.unit
def test_util_summary_is_the_median_of_the_cards_mean():
    """Cards as fleet.host.smi reads them (hy-smi's default table gives VRAM% only: MiB unknown, NaN)."""
    from fleet.host.smi import Card
    samples = [{"cards": [bench.card_figures(Card(0, 52000, 65520, 50.0)),
                          bench.card_figures(Card(1, util_pct=90.0, vram_pct=70.0))]},
               {"cards": [bench.card_figures(Card(0, 52000, 65520, 100.0)),
                          bench.card_figures(Card(1, util_pct=100.0, vram_pct=70.0))]},
               {"cards": [bench.card_figures(Card(0, 2, 65520, 0.0)), bench.card_figures(Card(1, vram_pct=0.0))]}]
    json.dumps(samples, allow_nan=False)                   # NaN never reaches bench.json
    u = bench.util_summary(samples)
    assert u == {"util_pct": 70.0, "mem_pct": 74.7, "samples": 3, "cards": 2}


@pytest.mark.unit
def test_image_none_sends_text_only():
    """`--image none`: the chat content is the prompt alone, for a text-only model."""
    image = bench.load_image("none")
    assert image["url"] is None and image["bytes"] == 0
    body = json.loads(bench.request_body(bench.SCENARIOS["short"], "m", image["url"], "u"))
    assert body["messages"] == [{"role": "user", "content": bench.SCENARIOS["short"].prompt}]
    with_image = json.loads(bench.request_body(bench.SCENARIOS["short"], "m", "data:image/png;base64,x", "u"))
    assert [p["type"] for p in with_image["messages"][0]["content"]] == ["text", "image_url"]
