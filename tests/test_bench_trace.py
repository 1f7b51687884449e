"""bench/bench_trace.py's accounting: where the oracle's cache hits went (issue 40)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_trace as bt  # noqa: E402


@pytest.mark.unit
def test_a_hit_missed_is_told_apart_sent_from_its_holder_or_held_by_no_engine():
    """Prompts of 3 ids (1,536 tokens) on two of the 8 backends, each backend's cache 3 ids, the oracle's
    pooled cache 8 x 3: 1. the first goes to b0; 2. the second shares two ids with it but goes to b1, which
    holds nothing: the oracle's 1,024 tokens were on b0 (sent from its holder); 3. two others evict both
    backends' caches; 4. the last shares the first's two ids, which no engine holds any more while the
    oracle's pooled cache still does (in no engine). The second's miss counts too under what the prediction
    overruled for it (its results-log line's `overruled`)."""
    ids = [[0, 1, 2], [0, 1, 3], [7, 8, 9], [5, 6, 10], [0, 1, 4]]
    reqs = [bt.Request(i, x, 1536, 1) for i, x in enumerate(ids)]
    recs = [{"id": f"r{i}", "sent": float(i), "backend": b} for i, b in enumerate(["b0", "b1", "b0", "b1", "b0"])]
    log = [{"request_id": f"r{i}", "route": "shared", "match_tokens": 0, "cached_tokens": 0} for i in range(5)]
    log[1]["overruled"] = "slot expired"       # it waited for its holder, then went elsewhere
    kv = 3 * bt.ID_TOKENS
    assert bt.held(reqs, recs, kv) == [(0, 0, "b0"), (1024, 0, "b0"), (0, 0, "b0"), (0, 0, "b1"), (0, 0, "b0")]
    assert bt.oracle_hits(reqs, bt.BACKENDS * kv) == [0, 1024, 0, 0, 1024]
    total = sum(r.input_length for r in reqs)
    per_request: list[dict] = []
    got = bt.losses(reqs, recs, log, bt.BACKENDS * kv, per_request)
    assert [(x["backend"], x["holder"], x["best"], x["mine"], x["oracle"]) for x in per_request][:2] == [
        ("b0", "b0", 0, 0, 0), ("b1", "b0", 1024, 0, 1024)]
    assert per_request[1]["overruled"] == "slot expired" and len(per_request) == 5
    assert got["sent from its holder"] == pytest.approx(1024 / total)
    assert got["in no engine"] == pytest.approx(1024 / total)
    assert got["shared"] == pytest.approx(2048 / total)
    assert got["overruled slot expired"] == pytest.approx(1024 / total) and "overruled balance" not in got
