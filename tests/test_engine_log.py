"""Engine logs are bounded while the engines run: each instance's output goes through the rotating writer
(hostagent/logwriter.py), nothing is lost at a rotation, and `inv logs --instance` reads across the
rotated files. A real sim cluster deployed with `inv`, its engine as chatty as vLLM at debug level."""
from __future__ import annotations

import http.client
import json
import math
import re

import pytest

from conftest import wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, tagged_pids, write_inventory
from hostagent import logwriter

LOG_BYTES = 20000                                         # per request
LINE = len("sim-log 0000000001 " + "x" * 100 + "\n")      # the sim's chatter line
MAX_BYTES = int(0.05 * 1048576)
REQUESTS = 40
SEQ = re.compile(r"^sim-log (\d{10}) x+$")


def seqs(text: str) -> list[int]:
    return [int(m.group(1)) for m in map(SEQ.match, text.splitlines()) if m]


def chat(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = {"model": "Test-Model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


@pytest.mark.cluster
def test_a_chatty_engine_log_rotates_while_serving_and_loses_nothing(tmp_path):
    """1. one sim instance writing LOG_BYTES of numbered lines per request, engine_log 0.05 MiB x 2;
    2. REQUESTS requests through the proxy (16 times the bound in all) all succeed;
    3. logs/vllm_0.log, .1 and .2 exist and no .3; each file stays under the bound plus one read;
    4. the numbered lines of .2, .1 and the log, in that order, follow each other with no gap up to the
       last one written: nothing was lost at a rotation;
    5. `inv logs --instance 0 -n 1000` prints the last 1000 of them, across the files;
    6. `inv stop` leaves no process of the deployment: the writer ended with its engine."""
    inventory = write_inventory(tmp_path, instances=1, extra=f"""\
        engine_log: {{max_mb: 0.05, backups: 2}}
        extra_args: [--sim-log-bytes, '{LOG_BYTES}']
        """)
    logs = tmp_path / "deploy" / "logs"
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        port = status_json(inventory)["proxy"]["port"]
        assert [chat(port) for _ in range(REQUESTS)] == [200] * REQUESTS
        total = REQUESTS * math.ceil(LOG_BYTES / LINE)
        log = logs / "vllm_0.log"
        wait_until(lambda: (seqs(log.read_text()) or [0])[-1] == total, timeout=30,
                   what="the writer wrote the last line")
        files = [logs / "vllm_0.log.2", logs / "vllm_0.log.1", log]
        assert all(f.exists() for f in files) and not (logs / "vllm_0.log.3").exists()
        for f in files:
            assert f.stat().st_size < MAX_BYTES + logwriter.CHUNK, f
        kept = seqs("".join(f.read_text() for f in files))
        assert kept == list(range(kept[0], total + 1)) and kept[0] > 1, (kept[:3], kept[-3:])
        assert status_json(inventory)["instances"][0]["state"] == "healthy"

        r = inv("logs", "--host", "t", "--instance", "0", "-n", "1000", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        shown = seqs(r.stdout)
        assert shown == list(range(total - 999, total + 1)), (len(shown), shown[:2], shown[-2:])
        assert len(seqs(log.read_text())) < 1000, "the 1000 lines span the rotated files"

        r = inv("stop", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert tagged_pids(deployment_id(inventory) + "/") == [], "the writer ends with its engine"
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(deployment_id(inventory) + "/")
