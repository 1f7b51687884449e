"""The Grafana dashboard, dashboards/vllm-fleet.json: provisioning-ready (a datasource variable, a host variable,
every panel on `${datasource}`), and every metric name its PromQL reads really exported by the proxy, the sim
engines and the keeper of a deployed sim cluster (the real-engine tier checks the vllm: names on vLLM itself)."""
from __future__ import annotations

import json
import re
import threading
import urllib.request

import pytest

from conftest import ROOT, wait_until
from fleet_helpers import load

DASHBOARD = ROOT / "dashboards" / "vllm-fleet.json"

# PromQL words that are not metric names: aggregation modifiers, binary operators, `offset`, `bool`.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not a function call, a keyword, a
    label list of by/without/on/ignoring/group_left/group_right, a label matcher inside braces, a range or
    a duration."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)                  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)                 # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word, rest = m.group(0), text[m.end():]
        before = text[:m.start()]
        if re.match(r"\s*\(", rest) or word.lower() in KEYWORDS:
            continue                                           # a function, or a keyword
        if before and (before[-1].isdigit() or before[-1] == "."):
            continue                                           # the unit of a number (1e3, 5m)
        names.add(word)
    return names


def panel_exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets (rows' nested panels too) and its
    query variables."""
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))
    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query))
    return exprs


def dashboard_metric_names() -> set[str]:
    return {n for e in panel_exprs(json.loads(DASHBOARD.read_text())) for n in metric_names(e)}


def exported(text: str) -> set[str]:
    """The series names a /metrics text exports: its samples' names, and those of every family its TYPE
    lines declare (a labelled counter has no sample before its first count; a histogram's are its _bucket,
    _sum and _count)."""
    names = set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{| )", text, re.M))
    for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M):
        names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


@pytest.mark.unit
@pytest.mark.parametrize("expr, names", [
    ('sum by (status) (rate(proxy_requests_total{host=~"$host"}[1m]))', {"proxy_requests_total"}),
    ('histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{job="x"}[5m])))',
     {"vllm:time_to_first_token_seconds_bucket"}),
    ("sum by (host, instance) (rate(a_total[5m])) / on (host) group_left (model) sum(b_total offset 1h)",
     {"a_total", "b_total"}),
    ('up{job=~"vllm-fleet-.*", host="rate(x)"} == bool 1 and on() vector(1) > 1e3', {"up"}),
    ("max_over_time(fleet_keeper_up[1m:10s]) unless ignoring(instance) absent(c)", {"fleet_keeper_up", "c"}),
])
def test_metric_names_are_read_off_promql(expr, names):
    assert metric_names(expr) == names


@pytest.mark.unit
def test_exported_names_are_samples_and_declared_families():
    """A sample's name; a labelled counter declared without a sample yet; a histogram's three series."""
    text = ('# TYPE a_total counter\na_total{x="1"} 2.0\n# TYPE b_total counter\n'
            '# TYPE h histogram\nh_bucket{le="+Inf"} 0.0\nup 1\n')
    assert exported(text) == {"a_total", "b_total", "h_bucket", "h_sum", "h_count", "up"}


@pytest.mark.unit
def test_the_dashboard_is_provisioning_ready():
    """uid and title fixed, schemaVersion 39, a datasource variable of type datasource (prometheus) and a
    multi-value host variable from the scrape jobs' host label, every panel and target on ${datasource},
    every query on $host, unique panel ids, a panel per issue 20's subject."""
    d = json.loads(DASHBOARD.read_text())
    assert (d["uid"], d["title"], d["schemaVersion"]) == ("vllm-fleet", "vllm-fleet", 39)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    host = variables["host"]
    assert host["type"] == "query" and host["multi"] and host["includeAll"]
    assert re.fullmatch(r"label_values\(.*, host\)", host["query"]["query"])
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and 'host=~"$host"' in t["expr"], (p["title"], t)
    titles = " | ".join(p["title"] for p in panels).lower()
    for subject in ("healthy", "keepers up", "requests by status", "latency percentiles", "time to first token",
                    "queue", "per-instance load", "kv-cache", "prefix-cache hit rate", "keeper restarts",
                    "output tokens", "card memory"):
        assert subject in titles, subject


# --- against a live sim cluster ------------------------------------------------------------------------

def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_every_metric_the_dashboard_reads_is_exported_by_a_live_sim_cluster(sim_cluster):
    """1. Deploy a sim cluster (2 instances, the proxy, the keeper), send it requests.  2. Read the proxy's,
    each engine's and the keeper's /metrics.  3. Every metric name of every panel's PromQL is among their
    samples."""
    _, hv = sim_cluster()
    stop = threading.Event()
    worker = threading.Thread(target=load, args=(hv.settings.proxy.port, stop, 60), daemon=True)
    worker.start()
    try:
        wait_until(lambda: 'status="200"' in get(f"http://127.0.0.1:{hv.settings.proxy.port}/metrics"),
                   timeout=30, what="a request answered through the proxy")
    finally:
        stop.set()
        worker.join(40)
    texts = [get(f"http://127.0.0.1:{hv.settings.proxy.port}/metrics"),
             get(f"http://127.0.0.1:{hv.settings.keeper.metrics_port}/metrics"),
             *(get(f"http://127.0.0.1:{p}/metrics") for p in hv.ports)]
    have = set().union(*map(exported, texts))
    # Scraping adds `up` to every target; the keeper's card gauges need an smi (the sim's here).
    wanted = dashboard_metric_names() - {"up"}
    assert not wanted - have, sorted(wanted - have)
