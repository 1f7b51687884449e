"""API keys on both fronts: the proxy and nginx refuse a request without a valid key in the same words,
serve only the proxy's paths, take a changed key file while running, and keep the keys out of nginx.conf
and every log. Real nginx, a real sim cluster deployed with `inv`."""
from __future__ import annotations

import http.client
import json
import os
import signal
import stat

import pytest
from conftest import require_tool, wait_until
from fleet_helpers import deployment_id, inv, kill_tagged, status_json, write_inventory

from hostagent import apikeys
from hostagent.facts import parse

from fleet.settings import inventory

KEY = "sk-Alpha-1"
ODD_KEY = 'k.e+y$/(x)"\\;{}#z'     # every character nginx's parser or PCRE could read as syntax
NEW_KEY = "sk-new-2"


def request(port: int, path: str, key: str | None = None, method: str = "GET", body: dict | None = None):
    """(status, headers with lower-case names, JSON body or None) of one request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        r = conn.getresponse()
        data = r.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = None
        return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed
    finally:
        conn.close()


def chat(port: int, key: str | None) -> int:
    body = {"model": "Test-Model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    return request(port, "/v1/chat/completions", key, "POST", body)[0]


def check_front(port: int, front: str) -> dict:
    """What must hold on either front; returns the 401 body."""
    status, headers, unauthorized = request(port, "/v1/chat/completions", None, "POST", {"model": "Test-Model"})
    assert status == 401 and headers.get("www-authenticate") == "Bearer", (front, status, headers)
    assert ("x-front" in headers) == (front == "nginx"), headers
    assert chat(port, "sk-wrong") == 401
    assert chat(port, KEY.lower()) == 401, "a key is case-sensitive"
    assert chat(port, KEY) == 200 and chat(port, ODD_KEY) == 200
    assert request(port, "/v1/models", KEY)[0] == 200
    assert request(port, "/health")[0] == 200 and request(port, "/metrics")[0] == 200   # open, as documented
    for path in ("/", "/sim/stats", "/version", "/tokenize"):
        assert request(port, path, KEY)[0] == 404, (front, path)
    return unauthorized


@pytest.mark.nginx
@pytest.mark.cluster
def test_keys_hold_on_both_fronts_and_a_changed_key_file_is_taken(tmp_path):
    """1. a sim cluster whose proxy.api_keys_file holds KEY and ODD_KEY, deployed: the proxy answers 401
    without a valid key, 200 with one, 404 outside /v1/, /health and /metrics;
    2. swap-to-nginx: nginx does the same, with the very same 401 body; the keys are in
    run/nginx_keys.conf (mode 0600), not in conf/nginx.conf;
    3. KEY replaced by NEW_KEY in the file while nginx runs: the watcher rewrites the map and reloads
    nginx, NEW_KEY gets 200 and KEY 401, with no command;
    4. swap-to-proxy and the key file changed back: `deploy --check` says it would reload the proxy for
    it, `deploy` reloads it (same pid) and the old key is 401; a second deploy has nothing to do; an
    emptied file fails the doctor's check, and with --no-doctor the deploy's `api keys` step, in one
    sentence, and the proxy keeps its keys; SIGHUP
    by hand takes a changed file too;
    5. no key appears in any file under logs/."""
    require_tool("nginx")
    keys = tmp_path / "keys"
    keys.write_text(f"# clients\n{KEY}\n{ODD_KEY}\n")
    inventory = write_inventory(tmp_path, instances=2)
    inventory.write_text(inventory.read_text().replace(
        "      health_interval_s: 0.5\n", f"      health_interval_s: 0.5\n      api_keys_file: {keys}\n"))
    deploy = tmp_path / "deploy"
    try:
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        port = status_json(inventory)["proxy"]["port"]
        proxy_401 = check_front(port, "proxy")

        r = inv("swap-to-nginx", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert status_json(inventory)["front"] == "nginx"
        assert check_front(port, "nginx") == proxy_401
        conf = (deploy / "conf" / "nginx.conf").read_text()
        assert KEY not in conf and "nginx_keys.conf" in conf
        keys_conf = deploy / "run" / "nginx_keys.conf"
        assert stat.S_IMODE(keys_conf.stat().st_mode) == 0o600

        keys.write_text(f"{NEW_KEY}\n{ODD_KEY}\n")
        # A reload is done when the old workers have stopped accepting: both keys' answers change then.
        wait_until(lambda: chat(port, NEW_KEY) == 200 and chat(port, KEY) == 401, timeout=30,
                   what="nginx takes the new key file")
        assert chat(port, ODD_KEY) == 200

        r = inv("swap-to-proxy", "--host", "t", inventory=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert chat(port, NEW_KEY) == 200 and chat(port, KEY) == 401
        keys.write_text(f"{KEY}\n")
        pid = status_json(inventory)["proxy"]["pid"]
        r = inv("deploy", "--host", "t", "--check", inventory=inventory)
        assert "would reload pid %d with the new config (the key file changed)" % pid in r.stdout, r.stdout
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert r.returncode == 0 and "API keys taken from the key file" in r.stdout, r.stdout + r.stderr
        assert status_json(inventory)["proxy"]["pid"] == pid
        assert chat(port, KEY) == 200 and chat(port, NEW_KEY) == 401
        r = inv("deploy", "--host", "t", inventory=inventory)
        assert "ok: proxy: already running" in r.stdout, r.stdout
        keys.write_text("# nobody yet\n")
        r = inv("deploy", "--host", "t", inventory=inventory)       # the doctor's check stops it first
        assert r.returncode == 2 and "fail  api keys: api_keys_file" in r.stdout, r.stdout + r.stderr
        r = inv("deploy", "--host", "t", "--no-doctor", inventory=inventory)
        assert r.returncode == 2, r.stdout + r.stderr
        assert (f"failed: api keys: api_keys_file {keys} holds no key; put one key per line, or drop the "
                "setting. The front keeps the keys it had.") in r.stdout, r.stdout
        assert chat(port, KEY) == 200
        keys.write_text(f"{NEW_KEY}\n")
        os.kill(pid, signal.SIGHUP)        # by hand, as before: a reload reads the file too
        wait_until(lambda: chat(port, NEW_KEY) == 200 and chat(port, KEY) == 401, timeout=30,
                   what="the proxy takes the changed key file")
    finally:
        inv("stop", "--host", "t", inventory=inventory)
        kill_tagged(deployment_id(inventory) + "/")
    for path in (deploy / "logs").rglob("*"):
        if path.is_file():
            text = path.read_bytes()
            for key in (KEY, NEW_KEY, ODD_KEY):
                assert key.encode() not in text, f"a key in {path}"


@pytest.mark.unit
def test_a_key_nginx_cannot_check_is_refused_in_one_sentence_without_the_key(tmp_path):
    """A key with a character nginx cannot compare, a line of three words (a blank inside a key), and an
    empty file: one sentence each, naming the file, never the key."""
    path = tmp_path / "keys"
    path.write_text("sk-good\nsk-bäd app\n")
    with pytest.raises(apikeys.KeysError) as e:
        apikeys.read_keys(str(path))
    assert str(e.value) == (f"api_keys_file {path}: key 2 has a character nginx mode cannot check (blanks, "
                            "control or non-ASCII characters); use printable ASCII keys.")
    path.write_text("sk-good\nsk bad secret\n")
    with pytest.raises(apikeys.KeysError) as e:
        apikeys.read_keys(str(path))
    assert str(e.value) == (f"api_keys_file {path} line 2 has more than a key and a tenant; write `KEY` or "
                            "`KEY TENANT`.")
    path.write_text("# none yet\n")
    with pytest.raises(apikeys.KeysError, match="holds no key; put one key per line, or drop the setting"):
        apikeys.read_keys(str(path))
    assert apikeys.pattern("a-b") == '"~^(?i:bearer)[ \\t]+a\\x2db[ \\t]*\\z"'


@pytest.mark.unit
def test_the_host_and_the_proxy_fingerprint_a_key_file_alike(tmp_path):
    """A deploy compares the key file's digest (the host agent's) with the running proxy's (its
    /admin/config), so both must agree whatever the file's layout:
    1. comments, blanks, repeats and order do not change it; 2. a key added or removed does; 3. nginx's
    map records the same digest; 4. a file that cannot be used is a sentence, not a digest; 5. a key's
    tenant counts, `default` written out or not alike."""
    from proxy.config import keys_digest, load_api_keys
    path = tmp_path / "keys"
    path.write_text("# clients\nsk-b\n\n  sk-a  \nsk-b\n")
    first = apikeys.file_digest(str(path))
    assert first == {"digest": keys_digest(load_api_keys(str(path))), "error": None}
    path.write_text("sk-a\nsk-b\n")
    assert apikeys.file_digest(str(path)) == first
    path.write_text("sk-a\nsk-b\nsk-c\n")
    assert apikeys.file_digest(str(path))["digest"] not in (first["digest"], None)
    conf = tmp_path / "nginx_keys.conf"
    apikeys.write(str(conf), str(path))
    assert apikeys.conf_digest(str(conf)) == keys_digest(load_api_keys(str(path)))
    path.write_text("sk-a default\nsk-b\nsk-c\n")     # `default` written out: the same keys, the same tenants
    assert apikeys.file_digest(str(path))["digest"] == keys_digest(load_api_keys(str(path)))
    without = apikeys.file_digest(str(path))["digest"]
    path.write_text("sk-a app\nsk-b\nsk-c batch\n")   # 5. a key moved to another tenant changes it
    tenants = ("default", "app", "batch")
    assert apikeys.file_digest(str(path))["digest"] == keys_digest(load_api_keys(str(path), tenants)) != without
    apikeys.write(str(conf), str(path))
    assert apikeys.conf_digest(str(conf)) == keys_digest(load_api_keys(str(path), tenants))
    assert "app" not in conf.read_text().split("{", 1)[1]      # nginx's map holds the keys alone
    path.write_text("# none\n")
    assert apikeys.file_digest(str(path)) == {
        "digest": None, "error": f"api_keys_file {path} holds no key; put one key per line, or drop the setting."}


@pytest.mark.unit
def test_deploy_takes_a_key_file_only_when_the_front_runs_other_keys(tmp_path):
    """What deploy decides from the probe's facts, on either front: 1. no key file set: nothing to take;
    2. the file's digest differs from the running proxy's (or from nginx's map): take it; 3. the same:
    nothing; 4. a file that cannot be used: a failed `api keys` step in one sentence, nothing taken."""
    from fleet.plan import steps as plan
    path = write_inventory(tmp_path, instances=1)
    hv = inventory.load(path).host_vars("t")
    found = {"proxy": {"config": {"api_keys_digest": "aaaa"}}, "api_keys": {"digest": "bbbb", "error": None,
                                                                           "nginx_digest": "bbbb"}}
    assert plan.keys_to_take(hv, parse(found), "running") == (None, None)          # no api_keys_file
    hv.settings.proxy.api_keys_file = "keys"
    assert plan.keys_to_take(hv, parse(found), "running") == ("bbbb", None)
    assert plan.keys_to_take(hv, parse(found), "nginx_digest") == (None, None)
    found["proxy"]["config"]["api_keys_digest"] = "bbbb"
    assert plan.keys_to_take(hv, parse(found), "running") == (None, None)
    found["api_keys"] = {"digest": None, "error": "api_keys_file keys holds no key; put one key per line, or "
                         "drop the setting.", "nginx_digest": "bbbb"}
    assert plan.keys_to_take(hv, parse(found), "nginx_digest") == (None, found["api_keys"]["error"])
    found["mode"] = "nginx"
    steps = plan.front(hv, parse(found), set())
    assert [(s.name, *s.checked()) for s in steps][0] == (
        "api keys", "failed", "api_keys_file keys holds no key; put one key per line, or drop the setting. "
                              "The front keeps the keys it had.")
