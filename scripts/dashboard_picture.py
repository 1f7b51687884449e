"""Draw docs/dashboard.svg: the Grafana dashboard (dashboards/vllm-fleet.json) as it shows a sim cluster under
load, from real data: deploy a local sim cluster with `inv deploy`, render its conf/prometheus.yml with
`inv render`, run a real Prometheus on it (scrape every second), load the proxy in phases (a burst that fills
the queue, an engine killed so the keeper restarts it), then ask Prometheus' query_range for each panel's
queries and draw the panels where the dashboard puts them. Everything on 127.0.0.1, stopped at the end.

    .venv/bin/python scripts/dashboard_picture.py [--out docs/dashboard.svg] [--seconds 150]

Needs /usr/bin/prometheus (Debian's `prometheus` package).
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from stack import free_ports, sim_inventory  # noqa: E402

DASHBOARD = ROOT / "dashboards" / "vllm-fleet.json"
COLORS = ["#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0", "#508642",
          "#cca300"]
CELL_W, CELL_H = 50, 34          # one grid column (of 24) and one grid row, in pixels


def inv(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"inv {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def client(port: int, stop: threading.Event) -> None:
    """Chat requests to the proxy until stop is set; every third streamed, prompts sharing prefixes."""
    n = random.randrange(1000)
    while not stop.is_set():
        body = {"model": "Demo-Model", "max_tokens": random.choice([16, 32, 64]),
                "messages": [{"role": "system", "content": "You are a map reader. " * 30},
                             {"role": "user", "content": f"question {n % 7}"}]}
        if n % 3 == 0:
            body.update(stream=True, stream_options={"include_usage": True})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
        except OSError:
            time.sleep(0.2)
        n += 1


def run_stack(work: Path, seconds: float) -> tuple[dict, float, float]:
    """Deploy, scrape, load; returns each expression's query_range result, and the time range."""
    base = free_ports(6)
    inventory = sim_inventory(
        work / "hosts.yml", "demo", work / "deploy", base, 3, max_num_seqs=4, model="/models/Demo-Model",
        sim={"load_s": 2, "prefill_ms": 200, "token_ms": 15, "output_tokens": 48},
        proxy={"port": base + 3, "admin_port": base + 4, "health_interval_s": 1, "queue": {"max": 6}},
        keeper={"metrics_port": base + 5, "backoff_base_s": 3, "dead_after_s": 5})
    prom = None
    stop = threading.Event()
    clients: list[threading.Thread] = []
    try:
        print("deploying a sim cluster of 3 instances ...", flush=True)
        inv("deploy", "--host", "demo", "--inventory", str(inventory))
        inv("render", "--host", "demo", "--out", str(work / "rendered"), "--inventory", str(inventory))
        config = yaml.safe_load((work / "rendered" / "conf" / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_port = free_ports(1)
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        prom = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=open(work / "prometheus.log", "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                get(f"http://127.0.0.1:{prom_port}/-/ready", 2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("Prometheus did not start; see " + str(work / "prometheus.log"))
                time.sleep(0.3)
        start = time.time()
        proxy = base + 3

        def clients_to(n: int) -> None:
            while len(clients) < n:
                t = threading.Thread(target=client, args=(proxy, stop), daemon=True)
                t.start()
                clients.append(t)

        # The phases: light, a burst past the slots and the queue, an engine killed, light again.
        plan = [(0.0, 4), (0.25, 22), (0.5, 8)]
        killed = False
        while time.time() - start < seconds:
            frac = (time.time() - start) / seconds
            n = [c for at, c in plan if frac >= at][-1]
            if frac >= 0.5 and n < len(clients):
                stop.set()                        # fewer clients: end them all, start the right number
                for t in clients:
                    t.join(35)
                clients.clear()
                stop.clear()
            clients_to(n)
            if frac >= 0.55 and not killed:
                killed = True
                print("killing instance 1's engine; the keeper restarts it ...", flush=True)
                req = urllib.request.Request(f"http://127.0.0.1:{base + 1}/sim/fault",
                                             json.dumps({"fault": "engine-death"}).encode(),
                                             {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=5) as r:
                        r.read()
                except OSError as e:
                    print(f"  (fault not injected: {e})")
            time.sleep(0.5)
        end = time.time()
        stop.set()
        for t in clients:
            t.join(35)
        print("querying Prometheus ...", flush=True)
        results = {}
        for expr in exprs(json.loads(DASHBOARD.read_text())):
            q = expr.replace("$host", ".*")
            params = urllib.parse.urlencode({"query": q, "start": start, "end": end, "step": 2})
            data = json.loads(get(f"http://127.0.0.1:{prom_port}/api/v1/query_range?{params}"))
            results[expr] = data["data"]["result"] if data.get("status") == "success" else []
        return results, start, end
    finally:
        stop.set()
        if prom is not None:
            os.killpg(prom.pid, signal.SIGTERM)
            prom.wait(20)
        subprocess.run([sys.executable, "-m", "invoke", "stop", "--host", "demo", "--inventory", str(inventory)],
                       cwd=ROOT, capture_output=True, timeout=300)


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or "value"


def fmt_value(v: float, unit: str) -> str:
    if math.isnan(v):
        return "NaN"
    if unit == "percentunit":
        return f"{v * 100:.0f}%"
    if unit == "bytes":
        for u, d in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
            if abs(v) >= d:
                return f"{v / d:.1f} {u}"
        return f"{v:.0f} B"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    suffix = " req/s" if unit == "reqps" else ""
    return (f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.2f}") + suffix


def draw(dashboard: dict, results: dict, start: float, end: float) -> str:
    width = 24 * CELL_W
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    height = bottom * CELL_H + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="#111217"/>',
           '<text x="10" y="24" fill="#d8d9da" font-size="16">vllm-fleet</text>',
           f'<text x="{width - 10}" y="24" fill="#8e8e8e" text-anchor="end">host: All · a sim cluster of 3 '
           f'instances under load, {end - start:.0f} s, Prometheus query_range (dashboards/vllm-fleet.json)</text>']
    for p in dashboard["panels"]:
        g = p["gridPos"]
        x, y, w, h = g["x"] * CELL_W + 4, g["y"] * CELL_H + 36, g["w"] * CELL_W - 8, g["h"] * CELL_H - 6
        title = html.escape(p["title"])
        if p["type"] == "row":
            out.append(f'<text x="{x + 4}" y="{y + 20}" fill="#d8d9da" font-size="13" font-weight="bold">{title}</text>')
            continue
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="3" fill="#181b1f" stroke="#2c3235"/>')
        out.append(f'<text x="{x + 8}" y="{y + 16}" fill="#d8d9da" font-size="12">{title}</text>')
        unit = p["fieldConfig"]["defaults"].get("unit", "short")
        series = []
        for t in p["targets"]:
            for s in results.get(t["expr"], []):
                pts = [(float(a), float(b)) for a, b in s["values"]]
                series.append((legend(t["legendFormat"], s["metric"]), pts))
        if not series:
            out.append(f'<text x="{x + w / 2}" y="{y + h / 2}" fill="#8e8e8e" text-anchor="middle">No data</text>')
            continue
        if p["type"] == "stat":
            step = w / len(series)
            for i, (name, pts) in enumerate(series):
                value = pts[-1][1]
                cx = x + step * i + step / 2
                out.append(f'<text x="{cx}" y="{y + h / 2 + 12}" fill="{COLORS[i % len(COLORS)]}" font-size="30" '
                           f'text-anchor="middle">{html.escape(fmt_value(value, unit))}</text>')
                out.append(f'<text x="{cx}" y="{y + h - 10}" fill="#8e8e8e" text-anchor="middle">{html.escape(name)}</text>')
            continue
        shown = series[:8]
        legend_rows = math.ceil(len(shown) / 2)
        px, py, pw, ph = x + 52, y + 26, w - 62, h - 46 - 14 * legend_rows
        values = [v for _, pts in shown for _, v in pts if not math.isnan(v) and not math.isinf(v)]
        lo, hi = min(values + [0.0]), max(values + [0.0])
        hi = hi if hi > lo else lo + 1
        for k in range(5):
            gy = py + ph - ph * k / 4
            out.append(f'<line x1="{px}" y1="{gy:.1f}" x2="{px + pw}" y2="{gy:.1f}" stroke="#2c3235"/>')
            out.append(f'<text x="{px - 4}" y="{gy + 4:.1f}" fill="#8e8e8e" text-anchor="end" font-size="10">'
                       f'{html.escape(fmt_value(lo + (hi - lo) * k / 4, unit))}</text>')
        for k in range(4):
            tx = px + pw * k / 3
            out.append(f'<text x="{tx:.1f}" y="{py + ph + 4:.1f}" fill="#8e8e8e" font-size="9" '
                       f'text-anchor="{("start", "middle", "middle", "end")[k]}" dy="6">'
                       f'{(end - start) * k / 3:.0f} s</text>')
        for i, (name, pts) in enumerate(shown):
            coords = [f"{px + pw * (t - start) / (end - start):.1f},{py + ph - ph * (v - lo) / (hi - lo):.1f}"
                      for t, v in pts if not math.isnan(v) and not math.isinf(v)]
            if coords:
                out.append(f'<polyline fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="1.5" '
                           f'points="{" ".join(coords)}"/>')
            lx = x + 10 + (i % 2) * (w / 2)
            ly = py + ph + 22 + 14 * (i // 2)
            out.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{COLORS[i % len(COLORS)]}"/>')
            out.append(f'<text x="{lx + 14}" y="{ly - 3}" fill="#c7d0d9" font-size="10">{html.escape(name[:60])}</text>')
        if len(series) > len(shown):
            out.append(f'<text x="{x + w - 8}" y="{y + 16}" fill="#8e8e8e" text-anchor="end">{len(shown)} of '
                       f'{len(series)} series</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "dashboard.svg"))
    ap.add_argument("--seconds", type=float, default=150)
    args = ap.parse_args()
    if not (shutil.which("prometheus") or os.path.exists("/usr/bin/prometheus")):
        print("error: prometheus is not installed (Debian: apt-get install prometheus).", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="dashboard-picture-") as tmp:
        results, start, end = run_stack(Path(tmp), args.seconds)
    Path(args.out).write_text(draw(json.loads(DASHBOARD.read_text()), results, start, end))
    empty = [e for e, r in results.items() if not r]
    print(f"wrote {args.out}; {len(results) - len(empty)} of {len(results)} queries had data")
    for e in empty:
        print(f"  no data: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
