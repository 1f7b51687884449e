"""Inventory: resolution order, and every kind of mistake is one line naming the file and the key."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, free_ports
from fleet_helpers import inv, tagged_pids

from fleet.errors import InventoryError
from fleet.settings import inventory

pytestmark = pytest.mark.unit

BASE = """
defaults:
  base_port: 9002
  max_num_seqs: 2
groups:
  lab:
    hosts: [a]
    max_num_seqs: 3
hosts:
  a:
    engine: sim
    accelerator: sim
    accelerators: 4
    instances: 4
    max_num_seqs: 5
    base_port: 9102
    proxy: {port: 9100, admin_port: 9101}
  b:
    engine: sim
    accelerator: sim
    accelerators: 2
    instances: 2
"""


def write(tmp_path, text):
    p = tmp_path / "hosts.yml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_resolution_order_defaults_group_host_set(tmp_path):
    inv = inventory.load(write(tmp_path, BASE))
    assert inv.host_vars("b").settings.max_num_seqs == 2                      # defaults
    assert inv.host_vars("b").settings.base_port == 9002
    assert inv.host_vars("a").settings.max_num_seqs == 5                      # host beats group
    assert inv.host_vars("a", ["max_num_seqs=6"]).settings.max_num_seqs == 6  # --set beats host
    assert inv.host_vars("b", ["proxy.results_log.backups=7"]).settings.proxy.results_log.backups == 7
    assert inv.host_vars("b").settings.proxy.port == 8000                  # built-in default kept beside it
    assert inv.host_vars("a").settings.proxy.results_log.backups == 3   # the nested block's own default
    assert inv.host_vars("a").ports == [9102, 9103, 9104, 9105]


def test_group_var_applies_without_host_override(tmp_path):
    text = BASE.replace("    max_num_seqs: 5\n", "")
    assert inventory.load(write(tmp_path, text)).host_vars("a").settings.max_num_seqs == 3


def test_select_hosts_groups_all_and_lists(tmp_path):
    inv = inventory.load(write(tmp_path, BASE))
    assert inv.select("lab") == ["a"]
    assert inv.select("all") == ["a", "b"]
    assert inv.select("b,lab") == ["b", "a"]
    with pytest.raises(InventoryError, match="no host or group named 'zz'"):
        inv.select("zz")


def test_ssh_block_means_ssh_connection(tmp_path):
    text = BASE + "    ssh: {host: 10.0.0.5, user: ops}\n"
    assert inventory.load(write(tmp_path, text)).host_vars("b").settings.connection == "ssh"
    assert inventory.load(write(tmp_path, BASE)).host_vars("b").settings.connection == "local"


ERRORS = [
    # (edit of BASE, expected message after "FILE: ")
    (("    max_num_seqs: 5", "    max_num_seqs: four"),
     "hosts.a.max_num_seqs: expected an integer from 1 to 65536, got 'four'."),
    (("    max_num_seqs: 5", "    max_num_seq: 5"),
     "hosts.a.max_num_seq: unknown key (did you mean max_num_seqs?); docs/inventory.md lists every key."),
    (("    proxy: {port: 9100, admin_port: 9101}", "    proxy: {prot: 9100, admin_port: 9101}"),
     "hosts.a.proxy.prot: unknown key (did you mean port?); docs/inventory.md lists every key."),
    (("    hosts: [a]", "    host: [a]"),
     "groups.lab.host: unknown key (did you mean hosts?); docs/inventory.md lists every key."),
    (("    max_num_seqs: 5", "    colour: blue"),
     "hosts.a.colour: unknown key; docs/inventory.md lists every key."),
    (("groups:", "grups:"),
     "grups: unknown top-level key (did you mean groups?); use defaults, groups and hosts."),
    (("  max_num_seqs: 2", "  enforce_eager: 'yes'"),
     "defaults.enforce_eager: expected true or false, got 'yes'."),
    (("    max_num_seqs: 3", "    base_port: 70000"),
     "groups.lab.base_port: expected a port number (1-65535), got 70000."),
    (("    instances: 2", "    instances: 3"),
     "hosts.b.instances: 3 instances but the host has 2 accelerators (one instance per card); "
     "lower instances or raise accelerators."),
    (("    instances: 2", "    instances: 2\n    proxy: {port: 9003}"),
     "hosts.b.proxy.port: 9003 clashes with instance 1 (ports 9002-9003); move one of them."),
    (("    instances: 2", "    instances: 2\n    proxy: {admin_port: 9002}"),
     "hosts.b.proxy.admin_port: 9002 clashes with instance 0 (ports 9002-9003); move one of them."),
    (("    instances: 2", "    instances: 2\n    proxy: {admin_port: 8000}"),
     "hosts.b.proxy.admin_port: 8000 is also proxy.port; give the admin listener its own port."),
    (("    instances: 2", "    instances: 2\n    proxy: {results_log: {backups: x}}"),
     "hosts.b.proxy.results_log.backups: expected an integer from 1 to 100, got 'x'."),
    (("    hosts: [a]", "    hosts: [a, c]"),
     "groups.lab.hosts: 'c' is not defined under hosts."),
    (("    engine: sim\n    accelerator: sim\n    accelerators: 4", "    engine: vllm\n    accelerator: dcu\n    accelerators: 4"),
     "hosts.a.model: the vllm engine needs a model path; set model."),
    (("    engine: sim\n    accelerator: sim\n    accelerators: 4", "    engine: vllm\n    model: /m\n    accelerators: 4"),
     "hosts.a.accelerator: engine vllm needs the host's accelerator kind; set accelerator: dcu (Hygon), "
     "rocm, nvidia or cpu."),
    (("    instances: 2", "    instances: 2\n    extra_args: --trust-remote-code"),
     "hosts.b.extra_args: expected a list of strings, got '--trust-remote-code'."),
    (("    instances: 2", "    instances: 2\n    ssh: {port: 22}"),
     "hosts.b.ssh.host: connection is ssh but no ssh.host is given; add it."),
    (("    instances: 2", "    instances: 2\n    proxy: {queue: {max: -1}}"),
     "hosts.b.proxy.queue.max: expected an integer from 0 to 1000000, got -1."),
    (("    instances: 2", "    instances: 2\n    proxy: {queue: {timeout_s: 0}}"),
     "hosts.b.proxy.queue.timeout_s: expected a finite number of seconds above 0, at most 604800, got 0."),
    (("    instances: 2", "    instances: 2\n    proxy: {queue: {headroom: 1.5}}"),
     "hosts.b.proxy.queue.headroom: expected an integer from 0 to 65536, got 1.5."),
]


@pytest.mark.parametrize("edit,message", ERRORS, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in enumerate(ERRORS)])
def test_inventory_errors_name_file_and_key(tmp_path, edit, message):
    old, new = edit
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    assert str(e.value) == f"{path}: {message}"
    assert "\n" not in str(e.value)


def test_set_errors_name_the_key(tmp_path):
    inv = inventory.load(write(tmp_path, BASE))
    with pytest.raises(InventoryError, match=r"^--set: max_num_seqs: expected an integer from 1 to 65536, got 'lots'\.$"):
        inv.host_vars("a", ["max_num_seqs=lots"])
    with pytest.raises(InventoryError, match=r"^--set nokey: expected key=value"):
        inv.host_vars("a", ["nokey"])
    with pytest.raises(InventoryError, match=r"^--set: bogus: unknown key; docs"):
        inv.host_vars("a", ["bogus=1"])
    with pytest.raises(InventoryError, match=r"^--set: proxy\.admin_prot: unknown key \(did you mean admin_port\?\); docs"):
        inv.host_vars("a", ["proxy.admin_prot=1"])


@pytest.mark.parametrize("text, message", [
    ("hosts:\n\ta: {}\n", "line 2, column 1 (while scanning for the next token; found character that cannot start "
                          "any token); YAML indents with spaces only: replace the tab with spaces."),
    ("hosts:\n  a: {engine: sim\n", "line 3, column 1 (while parsing a flow mapping; did not find expected ',' or "
                                     "'}'); fix the syntax there."),
    ("hosts:\n  a: b: c\n", "line 2, column 7 (mapping values are not allowed in this context); fix the syntax there."),
])
def test_a_yaml_syntax_error_names_the_line_and_the_parsers_words_for_the_problem(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    # libyaml (CSafeLoader) says "found character that ...", PyYAML's own parser names it: '\t'
    assert str(e.value).replace(" '\\t' ", " ") == f"{path}: not valid YAML at {message}"


def test_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(InventoryError, match="no such inventory file; pass -i FILE or set FLEET_INVENTORY"):
        inventory.load(tmp_path / "nope.yml")


def test_example_inventory_is_valid():
    inv = inventory.load(ROOT / "inventory" / "hosts.yml")
    k = inv.host_vars("k100-01")
    assert (k.settings.accelerator, k.settings.instances, k.settings.max_num_seqs, k.settings.base_port) == ("dcu", 8, 4, 8002)
    assert k.settings.connection == "ssh" and "--trust-remote-code" in k.settings.extra_args
    assert inv.host_vars("local").settings.engine == "sim"
    cpu = inv.host_vars("cpu")
    assert (cpu.settings.accelerator, cpu.settings.instances, cpu.settings.cpus_per_instance, cpu.settings.cpu_kvcache_gib) == ("cpu", 2, 0, 1)
    assert not {8000, 8001, 8002, 8003} & {*cpu.ports, cpu.settings.proxy.port, cpu.settings.proxy.admin_port}


@pytest.mark.parametrize("value, message", [
    ("0", "cpu_kvcache_gib: expected a size in GiB above 0"),
    ("1.5", "cpu_kvcache_gib: expected a whole number of GiB above 0"),
])
def test_cpu_kvcache_gib_is_whole_gib_above_zero(value, message):
    inv = inventory.load(ROOT / "inventory" / "hosts.yml")
    with pytest.raises(InventoryError, match=message):
        inv.host_vars("cpu", [f"cpu_kvcache_gib={value}"])
    assert inv.host_vars("cpu", ["cpus_per_instance=1", "instances=9"]).settings.instances == 9  # no accelerators cap
    with pytest.raises(InventoryError, match="cpus_per_instance: expected an integer from 0"):
        inv.host_vars("cpu", ["cpus_per_instance=-1"])


def test_cli_error_is_one_line_without_traceback(tmp_path):
    path = write(tmp_path, BASE.replace("    max_num_seqs: 5", "    max_num_seqs: four"))
    r = inv("status", "--host", "a", "-i", path)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {path}: hosts.a.max_num_seqs: expected an integer from 1 to 65536, got 'four'."
    assert "Traceback" not in r.stdout + r.stderr


# --- issue 12: what used to pass the inventory and fail later ------------------------------------

HOST_A = """\
hosts:
  a:
    connection: local
    engine: sim
    accelerator: sim
    accelerators: 2
    instances: 2
    base_port: {base}
    deploy_dir: {deploy}
    stagger_s: 0
    proxy: {{port: {proxy}, admin_port: {admin}}}
"""

# (id, text appended under host a (or a whole extra host at column 2), --set values, expected message after
# "FILE: ", or after "--set: " when the row starts with "--set")
BAD = [
    ("inf", "    health_timeout_s: .inf\n", [],
     "hosts.a.health_timeout_s: expected a finite number of seconds above 0, at most 604800, got inf."),
    ("nan", "    proxy_: {{timeout_s: .nan}}\n", [],
     "hosts.a.proxy.timeout_s: expected a finite number of seconds above 0, at most 604800, got nan."),
    ("stagger-inf", "    stagger_s_: .inf\n", [],
     "hosts.a.stagger_s: expected a finite number of seconds from 0 (off) to 604800, got inf."),
    ("health-interval-0", "    proxy_: {{health_interval_s: 0}}\n", [],
     "hosts.a.proxy.health_interval_s: expected a finite number of seconds above 0, at most 604800, got 0."),
    ("connect-timeout-0", "    proxy_: {{connect_timeout_s: 0}}\n", [],
     "hosts.a.proxy.connect_timeout_s: expected a finite number of seconds above 0, at most 604800, got 0."),
    ("results-backups-0", "    proxy_: {{results_log: {{backups: 0}}}}\n", [],
     "hosts.a.proxy.results_log.backups: expected an integer from 1 to 100, got 0."),
    ("instances-huge", "", ["instances=100000000"],
     "--set: instances: expected an integer from 0 to 256, got 100000000."),
    ("fronts-cycle", "    fronts: [b]\n  b:\n    connection: local\n    engine: sim\n    accelerator: sim\n"
                     "    accelerators: 1\n    instances: 1\n    base_port: {other}\n"
                     "    proxy: {{port: {other1}, admin_port: {other2}}}\n    fronts: [a]\n", [],
     "hosts.a.fronts: a cycle: a fronts b, b fronts a; an entry host fronts instances, not other entry hosts."),
    ("duplicate-key", "    max_num_seqs: 2\n    max_num_seqs: 3\n", [],
     "hosts.a.max_num_seqs: given twice (lines 12 and 13); keep one of them."),
    ("overlapping-local-ports", "  b:\n    connection: local\n    engine: sim\n    accelerator: sim\n"
                                "    accelerators: 2\n    instances: 2\n    base_port: {base1}\n"
                                "    proxy: {{port: {other1}, admin_port: {other2}}}\n", [],
     "hosts.b.base_port: port {base1} (instance 0) is also the port of a's instance 1 on this machine; "
     "give each host on one machine its own ports."),
    ("keeper-metrics-port-range", "", ["keeper.metrics_port=70000"],
     "--set: keeper.metrics_port: expected a port number (1-65535), or null, got 70000."),
    ("keeper-metrics-port-clash", "    keeper: {{metrics_port: {proxy}}}\n", [],
     "hosts.a.keeper.metrics_port: {proxy} is also the port of proxy.port; give the keeper's metrics a port "
     "of their own."),
    ("keeper-metrics-port-shared", "  b:\n    connection: local\n    engine: sim\n    accelerator: sim\n"
                                   "    accelerators: 1\n    instances: 1\n    base_port: {other}\n"
                                   "    proxy: {{port: {other1}, admin_port: {other2}}}\n"
                                   "    keeper: {{metrics_port: {base1}}}\n", [],
     "hosts.b.keeper.metrics_port: port {base1} (keeper metrics) is also the port of a's instance 1 on this "
     "machine; give each host on one machine its own ports."),
    ("nginx-worker-injection", "", ["nginx.worker_processes=1; load_module /tmp/evil.so"],
     "--set: nginx.worker_processes: expected auto or a number of worker processes from 1 to 1024, "
     "got '1; load_module /tmp/evil.so'."),
    ("proxy-bind-injection", "", ["proxy.bind=0.0.0.0:80; include /etc/passwd"],
     "--set: proxy.bind: expected an IP address or a host name (no %zone: nginx's listen takes none), "
     "got '0.0.0.0:80; include /etc/passwd'."),
    ("max-body-too-small", "    proxy_: {{max_body_mb: 0.0001}}\n", [],
     "hosts.a.proxy.max_body_mb: expected a size in MiB from 0.001 to 1048576, got 0.0001."),
]


def bad_inventory(tmp_path, extra: str) -> tuple[Path, dict]:
    """Host a (local sim, free ports, deploy_dir in tmp_path) plus `extra`; `proxy_: {...}` merges into a's
    proxy block and `stagger_s_` replaces a's stagger_s, so a row changes one key without a duplicate."""
    base, other = free_ports(4), free_ports(4)
    ports = {"base": base, "base1": base + 1, "proxy": base + 2, "admin": base + 3, "deploy": tmp_path / "deploy",
             "other": other, "other1": other + 1, "other2": other + 2}
    text = HOST_A.format(**ports)
    for line in extra.format(**ports).splitlines(keepends=True):
        if line.startswith("    proxy_: {"):
            more = line.split("{", 1)[1].rstrip("\n")
            text = text.replace("admin_port: %d}" % ports["admin"], "admin_port: %d, %s" % (ports["admin"], more))
        elif line.startswith("    stagger_s_:"):
            text = text.replace("    stagger_s: 0\n", line.replace("stagger_s_", "stagger_s"))
        else:
            text += line
    path = tmp_path / "hosts.yml"
    path.write_text(text)
    return path, ports


@pytest.mark.parametrize("extra,sets,message", [r[1:] for r in BAD], ids=[r[0] for r in BAD])
def test_bad_inventory_is_one_sentence_and_starts_nothing(tmp_path, extra, sets, message):
    """1. `inv deploy` on an inventory with one bad value (or one bad --set).  2. It exits 2 with one line on
    standard error naming the file (or --set) and the key path, no traceback.  3. Nothing was started: no
    deploy_dir, no process carrying the deployment's tag."""
    path, ports = bad_inventory(tmp_path, extra)
    args = [a for s in sets for a in ("--set", s)]
    r = inv("deploy", "--host", "a", "-i", str(path), *args)
    source = "" if message.startswith("--set") else f"{path}: "
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == f"error: {source}{message.format(**ports)}", r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "deploy").exists()
    assert not tagged_pids(inventory.deployment_id("a", str(ports["deploy"])) + "/")


def test_max_body_renders_exactly_in_nginx_and_the_proxy():
    """A fractional proxy.max_body_mb reaches nginx as the same byte count the proxy enforces (0.5 -> 512k,
    never `0m`, which nginx reads as no limit)."""
    from fleet import render
    hv = inventory.load(ROOT / "inventory" / "hosts.yml").host_vars("k100-01", ["proxy.max_body_mb=0.5"])
    files = {f.path: f.content for f in render.render_host(hv)}
    assert "client_max_body_size 512k;" in files["conf/nginx.conf"]
    hv = inventory.load(ROOT / "inventory" / "hosts.yml").host_vars("k100-01", ["proxy.max_body_mb=1.3"])
    nginx = {f.path: f.content for f in render.render_host(hv)}["conf/nginx.conf"]
    assert f"client_max_body_size {int(1.3 * 1024 * 1024)};" in nginx


def test_ports_shared_on_one_ssh_target_are_named_and_other_machines_may_reuse_them(tmp_path):
    """Two hosts on one ssh target may not both listen on a port; on two targets they may (same base_port)."""
    text = textwrap.dedent("""\
        defaults: {engine: sim, accelerator: sim, accelerators: 2, instances: 2}
        hosts:
          x: {ssh: {host: 10.0.0.5}, base_port: 9002}
          y: {ssh: {host: 10.0.0.6}, base_port: 9002}
          z: {ssh: {host: 10.0.0.5}, base_port: 9102}
        """)
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as e:
        inventory.load(path)
    assert str(e.value) == (f"{path}: hosts.z.proxy.port: port 8000 (proxy) is also the port of x's proxy on "
                            "the machine 10.0.0.5:22; give each host on one machine its own ports.")
    ok = text.replace("base_port: 9102}", "base_port: 9102, proxy: {port: 9100, admin_port: 9101}}")
    assert [h.ports for h in map(inventory.load(write(tmp_path, ok)).host_vars, "xyz")] == \
        [[9002, 9003], [9002, 9003], [9102, 9103]]


def test_a_rule_across_keys_broken_by_set_says_set_took_part(tmp_path):
    """The file's key path is named, and the --set that broke the rule with it (it named the file alone,
    whose value was fine)."""
    inv = inventory.load(write(tmp_path, BASE))
    with pytest.raises(InventoryError, match=r"hosts\.a\.instances: expected at least 1 instance, got 0 "
                                             r"\(with --set instances=0\)\.$"):
        inv.host_vars("a", ["instances=0"])
    with pytest.raises(InventoryError, match=r"hosts\.a\.proxy\.port: 9102 clashes with instance 0 .*; move one "
                                             r"of them \(with --set proxy\.port=9102\)\.$"):
        inv.host_vars("a", ["proxy.port=9102"])
    with pytest.raises(InventoryError, match=r"^--set =3: expected key=value"):
        inv.host_vars("a", ["=3"])


ENTRY = """
defaults: {engine: sim, accelerator: sim, accelerators: 2, instances: 2}
hosts:
  gw: {fronts: [gw, k1], base_port: 7002, proxy: {port: 7000, admin_port: 7001}}
  k1: {address: 10.9.0.1, base_port: 7102, proxy: {port: 7100, admin_port: 7101}}
"""


def test_an_entry_host_carries_each_backend_with_the_host_that_runs_it(tmp_path):
    """An entry host's variables carry its proxy's backends with their host and index (fleet.commands.top reads
    them instead of working the fronts out again); a plain host carries none."""
    path = tmp_path / "hosts.yml"
    path.write_text(ENTRY)
    loaded = inventory.load(path)
    gw = loaded.host_vars("gw")
    assert [(f.backend, f.host.name, f.index) for f in gw.fronted] == [
        ("127.0.0.1:7002", "gw", 0), ("127.0.0.1:7003", "gw", 1), ("10.9.0.1:7102", "k1", 0), ("10.9.0.1:7103", "k1", 1)]
    assert gw.fronted[0].host is gw and gw.fronted[2].host.settings.bind == "10.9.0.1"
    assert loaded.host_vars("k1").fronted is None and loaded.fronted_by("k1") == {"gw"}


def test_the_fronts_graph_is_checked_at_load_before_any_host_is_built(tmp_path, monkeypatch):
    """A member that is no host is refused by load itself, before any host's variables are built (the
    graph is checked once, not by each entry host on its way)."""
    path = tmp_path / "hosts.yml"
    path.write_text(ENTRY.replace("[gw, k1]", "[gw, k9]"))
    built = []
    monkeypatch.setattr(inventory.Inventory, "host_vars", lambda self, name, overrides=(): built.append(name))
    with pytest.raises(InventoryError, match=r"hosts\.gw\.fronts: 'k9' is not defined under hosts; add it"):
        inventory.load(path)
    assert built == []


@pytest.mark.parametrize("fronts, message", [
    ("[gw, k1]", r"a cycle: gw fronts k1, k1 fronts gw"),
    ("[ghost]", r"'ghost' is not defined under hosts"),
])
def test_a_fronts_set_on_the_command_line_is_checked_on_a_host_with_its_own_bind(tmp_path, fronts, message):
    """--set fronts=... changes the graph after load: it is checked before a host is built, also on a host
    whose explicit bind means no entry host reaches it (a cycle once went round until RecursionError)."""
    path = tmp_path / "hosts.yml"
    path.write_text(ENTRY.replace("  k1: {address: 10.9.0.1,", "  k1: {address: 10.9.0.1, bind: 127.0.0.1,"))
    loaded = inventory.load(path)
    with pytest.raises(InventoryError, match=message):
        loaded.host_vars("k1", [f"fronts={fronts}"])
