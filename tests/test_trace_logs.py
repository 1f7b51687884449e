"""`inv trace` and `inv logs` on a host whose proxy has been logging (and rotating) for a while."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from conftest import wait_until
from fleet_helpers import inv, write_inventory
from proxy_helpers import start_proxy, start_sims

OTEL_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{OTEL_TRACE}-00f067aa0ba902b7-01"


@pytest.mark.process
def test_trace_finds_a_failed_request_after_rotation(procs, tmp_path):
    """1. A client sends a numeric `user` with the fixup off: vLLM's 400 and its error body are logged.
    2. Enough traffic follows to rotate that line into a backup file.  3. `inv trace` by trace id, by
    request id and by the W3C trace id of the client's traceparent finds it, with the backend's error body, oldest first; `inv logs --results` tails."""
    inventory = write_inventory(tmp_path, instances=1)
    logs = tmp_path / "deploy" / "logs"
    [sim] = start_sims(procs, tmp_path, 1, token_ms=0)
    port, _ = start_proxy(procs, tmp_path, [sim], fix_numeric_user=False,
                          results_log={"path": str(logs / "req_results.log"), "max_mb": 0.006, "backups": 3})
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def run():
        async with aiohttp.ClientSession() as s:
            bad = {"model": "m", "user": 4242, "messages": [{"role": "user", "content": "hi"}]}
            async with s.post(url, json=bad, headers={"X-Request-Id": "rid-bad-1", "traceparent": TRACEPARENT}) as r:
                assert r.status == 400 and r.headers["X-Trace-Id"] == OTEL_TRACE
            for i in range(30):
                ok = {"model": "m", "max_tokens": 4, "user": f"u-{i}", "messages": [{"role": "user", "content": "x"}]}
                async with s.post(url, json=ok) as r:
                    assert r.status == 200
    asyncio.run(run())
    def logged():
        files = sorted(logs.glob("req_results.log*"))
        return sum(len(f.read_text().splitlines()) for f in files) == 31 and len(files) >= 3
    wait_until(logged, what="all 31 lines written, the log rotated twice")
    assert "4242" not in (logs / "req_results.log").read_text()

    by_trace = inv("trace", "4242", "--host", "t", inventory=inventory)
    assert by_trace.returncode == 0, by_trace.stdout + by_trace.stderr
    assert "request rid-bad-1" in by_trace.stdout and "status 400" in by_trace.stdout
    assert "error: " in by_trace.stdout and "valid string" in by_trace.stdout
    by_id = inv("trace", "rid-bad-1", "--host", "t", inventory=inventory)
    assert "trace 4242" in by_id.stdout
    # By the W3C trace id (the X-Trace-Id the client got), from a traceparent the client sent.
    by_otel = inv("trace", OTEL_TRACE, "--host", "t", inventory=inventory)
    assert "request rid-bad-1" in by_otel.stdout and f"otel trace {OTEL_TRACE}" in by_otel.stdout

    none = inv("trace", "nobody", "--host", "t", inventory=inventory)
    assert none.returncode == 2 and "no results-log line has trace id, W3C trace id or request id 'nobody'" in \
        none.stderr and "no results-log line" not in none.stdout, none.stdout + none.stderr

    tail = inv("logs", "--host", "t", "--results", "-n", "3", inventory=inventory)
    assert tail.returncode == 0, tail.stderr
    lines = [x for x in tail.stdout.splitlines() if x.startswith("{")]
    assert lines == (logs / "req_results.log").read_text().splitlines()[-3:]
    assert all(json.loads(x)["status"] == 200 for x in lines)


@pytest.mark.unit
def test_logs_refuses_an_unknown_instance_in_one_sentence(tmp_path):
    inventory = write_inventory(tmp_path, instances=2)
    r = inv("logs", "--host", "t", "--instance", "5", inventory=inventory)
    assert r.returncode == 2
    assert "there is no instance 5; instances are 0-1." in r.stderr and "Traceback" not in r.stderr
    r = inv("logs", "--host", "t", "--proxy", "--results", inventory=inventory)
    assert r.returncode == 2 and "choose one of --instance I, --proxy, --results and --keeper." in r.stderr
