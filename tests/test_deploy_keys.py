"""A key file deploy would trip on: said before any engine starts, and a proxy that exits at start said in
its own one sentence, with no keeper or boot hook left claiming a deployment that does not serve."""
from __future__ import annotations

import re

import pytest
from fleet_helpers import deployment_id, inv, stop_by_own_scripts, tagged_pids, write_inventory

from hostagent.facts import parse

pytestmark = pytest.mark.cluster


def test_a_proxy_that_exits_at_start_is_its_one_sentence_and_no_keeper_starts(tmp_path):
    """1. a key file naming a tenant the inventory does not define, deployed with --no-doctor (the doctor
    would have refused it); 2. the instances start, the proxy exits at start: its step is the proxy's own
    sentence, not a dump of its log; 3. no keeper runs and no boot hook is installed, each said."""
    keys = tmp_path / "keys"
    keys.write_text("k" * 24 + " gold\n")
    keys.chmod(0o600)
    inventory = write_inventory(tmp_path, instances=1)
    try:
        r = inv("deploy", "--host", "t", "--no-doctor", "-e", f"proxy.api_keys_file={keys}", inventory=inventory)
        assert r.returncode == 2, r.stdout + r.stderr
        failed = re.findall(r"^failed: proxy: (.*)$", r.stdout, re.M)
        assert failed == [f"exited at start: api_keys_file {keys} line 1 names the tenant 'gold', which "
                          "proxy.tenants does not define (it has default); add it there or fix the line."], r.stdout
        assert r.stdout.count("names the tenant") == 1 and "k" * 16 not in r.stdout + r.stderr, r.stdout
        assert "skipped: keeper: not started: the front failed above" in r.stdout, r.stdout
        assert "skipped: boot hook: not installed: the front failed above" in r.stdout, r.stdout
        assert not [p for p in tagged_pids(deployment_id(inventory) + "/keeper")], "a keeper runs"
    finally:
        stop_by_own_scripts(inventory, ["t"])


@pytest.mark.process
def test_deploy_without_the_doctor_refuses_a_missing_key_file_before_any_engine_starts(tmp_path):
    """--no-doctor skips the doctor's checks; the state read before anything starts still finds a key file the
    proxy could not start with, and the deploy stops there."""
    inventory = write_inventory(tmp_path, instances=1)
    r = inv("deploy", "--host", "t", "--no-doctor", "-e", f"proxy.api_keys_file={tmp_path / 'nope'}",
            inventory=inventory)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"FAILED: api keys: cannot read api_keys_file {tmp_path / 'nope'}: No such file or directory" in r.stderr
    assert "nothing was started" in r.stderr and not (tmp_path / "deploy" / "bin").exists()
    assert not tagged_pids(deployment_id(inventory) + "/")


def test_chat_and_bench_send_the_key_from_the_option_or_the_environment(tmp_path, monkeypatch):
    """1. a host with keys on; 2. chat and bench without a key: one sentence naming --api-key, exit 2 (not
    `answered 401 ...; see inv status`); 3. with --api-key, or OPENAI_API_KEY, they are served; the key is
    never printed nor written into bench's reports; 4. deploy --check from another inventory file that
    has no key file says first that the host was deployed from the other file and that keys would be off."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    key = "sk-" + "7" * 29
    keys = tmp_path / "keys"
    keys.write_text(key + "\n")
    keys.chmod(0o600)
    inventory = write_inventory(tmp_path, instances=1)
    inventory.write_text(inventory.read_text().replace("    proxy:\n", f"    proxy:\n      api_keys_file: {keys}\n", 1))
    bench = ["bench", "--host", "t", "--scenario", "short", "--concurrency", "1", "--image", "none"]
    try:
        r = inv("deploy", "--host", "t", inventory=inventory, check=True)
        assert re.search(r"^changed: files: put \d+ new file\(s\); -v lists them$", r.stdout, re.M), r.stdout
        assert "put (new)" not in r.stdout
        wanted = "the entry port wants an API key: --api-key (or OPENAI_API_KEY).\n"
        for argv in (["chat", "--host", "t"], [*bench, "--out", tmp_path / "b0"]):
            r = inv(*argv, inventory=inventory)
            assert r.returncode == 2 and r.stderr.endswith(wanted) and "see `inv status`" not in r.stderr, r
        r = inv("chat", "--host", "t", "--api-key", key, inventory=inventory)
        assert r.returncode == 0 and "X-Backend" in r.stdout and key not in r.stdout + r.stderr, r
        r = inv(*bench, "--out", tmp_path / "b1", inventory=inventory, env={"OPENAI_API_KEY": key})
        assert r.returncode == 0 and key not in r.stdout + r.stderr, r.stdout + r.stderr
        assert key not in (tmp_path / "b1" / "bench.json").read_text()
        r = inv("chat", "--host", "t", "--api-key", "sk-wrong-key-but-long", inventory=inventory)
        assert r.returncode == 2 and "refused the API key sent (401); check --api-key" in r.stderr, r

        # The same host from another inventory file without the keys (FLEET_INVENTORY forgotten): said first.
        other = tmp_path / "other.yml"
        other.write_text(inventory.read_text().replace(f"      api_keys_file: {keys}\n", ""))
        r = inv("deploy", "--host", "t", "--check", inventory=other)
        warnings = [line for line in r.stdout.splitlines() if line.startswith("WARNING: ")]
        assert warnings == [
            f"WARNING: t was deployed from {inventory}; this run uses {other} (set FLEET_INVENTORY or -i to the "
            "first if that is the one you mean)",
            "WARNING: the running proxy checks API keys and this inventory sets no proxy.api_keys_file: the entry "
            "port would take requests without a key"], r.stdout
        assert r.stdout.index(warnings[0]) < r.stdout.index("changed: proxy: would")
    finally:
        stop_by_own_scripts(inventory, ["t"])


@pytest.mark.unit
def test_settings_a_deploy_would_switch_off_are_named(tmp_path):
    """Tenants and keepalived, from the running proxy's config and the deployed files (keys: above)."""
    from fleet.plan import drift
    from fleet.settings.inventory import load
    hv = load(write_inventory(tmp_path, instances=1)).host_vars("t")
    found = {"proxy": {"config": {"api_keys": False, "tenants": [{"name": "default"}, {"name": "batch"}]}}}
    said = drift.sentences(hv, parse(found), {"inventory": hv.inventory_path, "keepalived": True})
    assert said == ["the running proxy shares its slots among the tenant(s) batch, which this inventory's "
                    "proxy.tenants does not define: the deploy turns them off",
                    "keepalived of an earlier deploy runs here and this inventory sets no vrrp: the deploy leaves "
                    "it running its old config"]
    assert drift.sentences(hv, parse({"proxy": {"config": None}}), {"inventory": None, "keepalived": False}) == []
    # Deployed from another inventory file: said while any of it runs; once stopped, nothing is undone.
    other = {"inventory": "/elsewhere/hosts.yml", "keepalived": False}
    assert drift.sentences(hv, parse({"proxy": {"config": None}}), other) == []
    for running in ({"proxy": {"alive": True, "config": None}}, {"keeper": {"alive": True}},
                    {"instances": [{"index": 0, "alive": True}]}):
        assert drift.sentences(hv, parse(running), other) == [
            f"t was deployed from /elsewhere/hosts.yml; this run uses {hv.inventory_path} (set FLEET_INVENTORY "
            "or -i to the first if that is the one you mean)"], running


@pytest.mark.process
def test_deploy_check_counts_the_new_files_in_one_line_and_lists_them_with_v(tmp_path):
    inventory = write_inventory(tmp_path, instances=1)
    r = inv("deploy", "--host", "t", "--check", inventory=inventory)
    counted = re.findall(r"^changed: files: would put (\d+) new file\(s\); -v lists them$", r.stdout, re.M)
    assert r.returncode == 0 and len(counted) == 1 and "(new)" not in r.stdout, r.stdout
    r = inv("deploy", "--host", "t", "--check", "-v", inventory=inventory)
    listed = re.findall(r"^changed: file (\S+): would put \(new\)$", r.stdout, re.M)
    assert len(listed) == int(counted[0]) and "conf/proxy.yaml" in listed, r.stdout


@pytest.mark.unit
def test_an_inventory_path_is_compared_as_a_file_not_as_text(tmp_path, monkeypatch):
    from fleet.plan.drift import _same_file
    monkeypatch.chdir(tmp_path)
    assert _same_file("inventory/hosts.yml", str(tmp_path / "inventory" / "hosts.yml"))
    assert _same_file("inventory/hosts.yml", "/srv/checkout/inventory/hosts.yml")      # run from elsewhere
    assert not _same_file("/etc/fleet/hosts.yml", str(tmp_path / "inventory" / "hosts.yml"))
    assert not _same_file("hosts.yml", "/etc/fleet/other-hosts.yml")


@pytest.mark.unit
def test_a_deploy_records_its_inventory_by_absolute_path(tmp_path, monkeypatch):
    """1. Two checkouts, each with inventory/hosts.yml, loaded by the relative path from their own directory.
    2. Each host's inventory_path (what the deployed headers name) is absolute, so the second is told
    apart from the first: the default path no longer matches any other `.../inventory/hosts.yml`."""
    from fleet.plan.drift import _same_file
    from fleet.settings import inventory
    paths = []
    for checkout in ("a", "b"):
        (tmp_path / checkout / "inventory").mkdir(parents=True)
        write_inventory(tmp_path / checkout / "inventory")
        monkeypatch.chdir(tmp_path / checkout)
        paths.append(inventory.load("inventory/hosts.yml").host_vars("t").inventory_path)
    assert paths == [str(tmp_path / c / "inventory" / "hosts.yml") for c in ("a", "b")]
    assert not _same_file(*paths)
