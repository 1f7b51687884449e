"""The vertical slice: deploy a local sim cluster, talk to it with the official openai client, stop it."""
from __future__ import annotations

import json
import os
import re
import stat
import urllib.request

import openai
import pytest

from conftest import wait_until

from hostagent.processes import parse_record

from fleet_helpers import deployment_id, inv, status_json, stop_by_own_scripts, tagged_pids, write_inventory

pytestmark = pytest.mark.cluster


def deployed(tmp_path):
    """Deploy a 4-instance sim cluster in tmp_path; stop it (its own stop script, then a sweep by tag) whatever
    the tests do (fleet_helpers.stop_by_own_scripts; `inv stop` is test_stop_leaves_no_tagged_process's)."""
    inventory = write_inventory(tmp_path)
    dep = deployment_id(inventory)
    loose = os.umask(0o022)       # the common default: the logs' modes below are the toolkit's own doing
    try:
        first = inv("deploy", "--host", "t", inventory=inventory)
    finally:
        os.umask(loose)
    try:
        assert first.returncode == 0, first.stdout + first.stderr
        yield inventory, dep, first, tmp_path
    finally:
        stop_by_own_scripts(inventory, ["t"])


@pytest.fixture
def cluster(tmp_path):
    """A cluster of the test's own, for a test that changes it."""
    yield from deployed(tmp_path)


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    """One cluster for the module's tests that only read it (their xdist group keeps them on one worker)."""
    yield from deployed(tmp_path_factory.mktemp("shared"))


def recap(output: str) -> dict:
    m = re.search(r"^t : ok=(\d+) changed=(\d+) skipped=(\d+) failed=(\d+) unreachable=(\d+)$", output, re.M)
    assert m, output
    return dict(zip(["ok", "changed", "skipped", "failed", "unreachable"], map(int, m.groups())))


def test_deploy_then_redeploy_changes_nothing(cluster):
    inventory, dep, first, _ = cluster
    for i in range(4):
        assert re.search(rf"^instance {i}: healthy on :\d+ after [\d.]+s$", first.stdout, re.M), first.stdout
    r1 = recap(first.stdout)
    assert r1["failed"] == 0 and r1["changed"] >= 5
    second = inv("deploy", "--host", "t", inventory=inventory)
    assert second.returncode == 0, second.stdout + second.stderr
    assert recap(second.stdout)["changed"] == 0
    assert "started pid" not in second.stdout and second.stdout.count("already healthy") == 4

    # Only the backend list changes: the running proxy re-reads its config on SIGHUP, no restart.
    proxy_pid = status_json(inventory)["proxy"]["pid"]
    third = inv("deploy", "--host", "t", "--set", "instances=3", inventory=inventory)
    assert third.returncode == 0, third.stdout + third.stderr
    assert f"reloaded, pid {proxy_pid}, 3 backends" in third.stdout, third.stdout
    st = status_json(inventory, "--set", "instances=3")
    assert st["proxy"]["pid"] == proxy_pid and len(st["proxy"]["backends"]) == 3


def test_a_changed_bind_address_restarts_the_proxy_on_it(cluster):
    """1. deploy with proxy.bind 127.0.0.1 (the test inventory's proxy listens on every address);
    2. deploy with proxy.bind 0.0.0.0 (the port opened to the network): a SIGHUP cannot move a listener, so the proxy reports the setting as pending a restart and
    deploy restarts it beside the old one, confirming the new one where the old does not listen (the
    kernel gives 127.0.0.1's connections to the more specific old socket until it leaves); 3. then to
    127.0.0.2 the same way; 4. the entry port answers on the new address only, and the next deploy has
    nothing left to do."""
    inventory, dep, _, _ = cluster
    port = status_json(inventory)["proxy"]["port"]

    def answering(address: str) -> int:
        with urllib.request.urlopen(f"http://{address}:{port}/health", timeout=5) as r:
            assert r.status == 200
            return json.loads(r.read())["pid"]
    closed = inv("deploy", "--host", "t", "--set", "proxy.bind=127.0.0.1", inventory=inventory)
    assert closed.returncode == 0, closed.stdout + closed.stderr
    assert answering("127.0.0.1") == status_json(inventory, "--set", "proxy.bind=127.0.0.1")["proxy"]["pid"]
    opened = inv("deploy", "--host", "t", "--set", "proxy.bind=0.0.0.0", inventory=inventory)
    assert opened.returncode == 0, opened.stdout + opened.stderr
    assert re.search(r"^changed: proxy: restarted beside the old one", opened.stdout, re.M), opened.stdout
    pid = status_json(inventory, "--set", "proxy.bind=0.0.0.0")["proxy"]["pid"]
    assert answering("127.0.0.1") == pid and answering("127.0.0.2") == pid

    moved = inv("deploy", "--host", "t", "--set", "proxy.bind=127.0.0.2", inventory=inventory)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert re.search(r"^changed: proxy: restarted beside the old one", moved.stdout, re.M), moved.stdout
    st = status_json(inventory, "--set", "proxy.bind=127.0.0.2")
    assert st["proxy"]["state"] == "healthy", st    # read where it listens, not at 127.0.0.1
    assert answering("127.0.0.2") == st["proxy"]["pid"]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
    again = inv("deploy", "--host", "t", "--set", "proxy.bind=127.0.0.2", inventory=inventory)
    assert recap(again.stdout)["changed"] == 0, again.stdout


@pytest.mark.xdist_group("deploy_local_shared")
def test_logs_are_the_deployment_users_alone_and_the_engines_ipc_directory_its_own(shared_cluster):
    """Deployed under umask 022: 1. one chat, so the results log (callers' `user` values, answer snippets)
    has a line; 2. logs/ is 0700 and every log in it (proxy, results, keeper, each engine's) 0600;
    3. run/ipc, where vLLM would put its ZMQ sockets (VLLM_RPC_BASE_PATH), is 0700."""
    inventory, dep, _, tmp = shared_cluster
    st = status_json(inventory)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{st['proxy']['port']}/v1", api_key="none")
    client.chat.completions.create(model="Test-Model", max_tokens=2, user="who-reads-this",
                                   messages=[{"role": "user", "content": "hello"}])
    logs = tmp / "deploy" / "logs"
    wait_until(lambda: "who-reads-this" in (logs / "req_results.log").read_text(), what="the results log line")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in logs.iterdir()}
    assert {"proxy.log", "req_results.log", "keeper.log", "keeper.out", "vllm_0.log", "vllm_3.log"} <= set(modes)
    assert {name: mode for name, mode in modes.items() if mode != 0o600} == {}
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp / "deploy" / "run" / "ipc").stat().st_mode) == 0o700


@pytest.mark.xdist_group("deploy_local_shared")
def test_status_json_contract(shared_cluster):
    inventory, dep, _, tmp = shared_cluster
    st = status_json(inventory)
    assert st["host"] == "t" and st["front"] == "proxy"
    assert st["proxy"]["state"] == "healthy" and st["proxy"]["pid"]
    assert [i["index"] for i in st["instances"]] == [0, 1, 2, 3]
    for i in st["instances"]:
        assert i["state"] == "healthy" and i["pid"] == i["pgid"] and i["accelerator"] == i["index"]
    # The table form names every instance with its state.
    table = inv("status", "--host", "t", inventory=inventory).stdout
    assert table.count("healthy") >= 5


@pytest.mark.xdist_group("deploy_local_shared")
def test_openai_client_through_proxy_stream_and_not(shared_cluster):
    inventory, dep, _, tmp = shared_cluster
    st = status_json(inventory)
    backends = {f"127.0.0.1:{i['port']}" for i in st["instances"]}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{st['proxy']['port']}/v1", api_key="none")

    raw = client.chat.completions.with_raw_response.create(
        model="Test-Model", max_tokens=16, user="trace-abc-123",
        messages=[{"role": "user", "content": "hello"}])
    assert raw.headers["x-backend"] in backends
    answer = raw.parse()
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 16
    assert answer.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model="Test-Model", max_tokens=8, user="trace-stream-9", stream=True,
        messages=[{"role": "user", "content": "hello"}])
    assert stream.response.headers["x-backend"] in backends
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text

    # The line is written off the event loop once the response has ended: wait for both.
    log = tmp / "deploy" / "logs" / "req_results.log"

    def logged():
        if not log.exists():
            return {}
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        found = {line["trace_id"]: line for line in lines}
        return found if {"trace-abc-123", "trace-stream-9"} <= found.keys() else {}
    by_trace = wait_until(logged, timeout=10, what="both results-log lines")
    assert by_trace["trace-abc-123"]["status"] == 200
    assert by_trace["trace-abc-123"]["backend"] in backends
    assert by_trace["trace-abc-123"]["completion_tokens"] == 16
    assert by_trace["trace-stream-9"]["status"] == 200


def test_stop_leaves_no_tagged_process(cluster):
    inventory, dep, _, tmp = cluster
    before = tagged_pids(dep + "/")
    assert len(before) >= 9      # 4 API servers + 4 spawned engine children + the proxy
    r = inv("stop", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert tagged_pids(dep + "/") == []
    assert recap(r.stdout)["failed"] == 0
    st = status_json(inventory)
    assert {i["state"] for i in st["instances"]} == {"stopped"} and st["front"] is None
    again = inv("stop", "--host", "t", inventory=inventory)
    assert again.returncode == 0 and recap(again.stdout)["changed"] == 0


def test_deploy_brings_back_an_instance_whose_api_server_was_killed(cluster):
    """1. SIGKILL instance 0's API server: its spawned engine child lives on, holding card 0.
    2. `inv status` says dead (or stopped) and fails.  3. `inv deploy` stops the leftovers by tag, waits
    for card 0, starts instance 0 again: healthy, the orphan gone, the other instances untouched."""
    import os
    import signal
    inventory, dep, _, tmp = cluster
    before = status_json(inventory)
    pid = parse_record((tmp / "deploy" / "run" / "instance_0.pid").read_bytes())["pid"]
    orphans = [p for p in tagged_pids(dep + "/0") if p != pid]
    assert orphans, "the sim's engine child should carry the instance's tag"
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: status_json(inventory)["instances"][0]["state"] in ("dead", "stopped"),
               what="instance 0 seen down")
    assert inv("status", "--host", "t", inventory=inventory).returncode == 2
    r = inv("deploy", "--host", "t", inventory=inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    after = status_json(inventory)
    assert after["instances"][0]["state"] == "healthy" and after["instances"][0]["pid"] != pid
    assert not set(orphans) & set(tagged_pids(dep + "/0"))
    assert [i["pid"] for i in after["instances"][1:]] == [i["pid"] for i in before["instances"][1:]]

    # The entry port down is a failure of the host, and deploy brings the proxy back.
    proxy_pid = after["proxy"]["pid"]
    os.kill(proxy_pid, signal.SIGKILL)
    wait_until(lambda: status_json(inventory)["proxy"]["state"] == "dead", what="the proxy seen dead")
    down = inv("status", "--host", "t", inventory=inventory)
    assert down.returncode == 2 and "FAILED: proxy: dead" in down.stderr, down.stdout + down.stderr
    again = inv("deploy", "--host", "t", inventory=inventory)
    assert again.returncode == 0, again.stdout + again.stderr
    assert status_json(inventory)["proxy"]["state"] == "healthy"
