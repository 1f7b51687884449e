"""Where the proxy's time goes under load: py-spy samples of the proxy while wrk drives it, by module.

    .venv/bin/python bench/profile_proxy.py [--seconds 10] [--connections 64] [--backends 4] [--loop auto|asyncio]
                                            [--policy least_conn|prefix] [--stream] [--baseline DIR]

Starts the sims (instant mode) and the proxy as bench_proxy.py does (the rendered config, results log on,
least_conn unless --policy says otherwise), runs wrk against the proxy and py-spy (from
bench/.venv-routers, made by bench/setup_routers.sh) on the proxy's pid at the same time, then prints the
share of busy samples (the results-log thread's waits left out) per group of frames (the innermost frame
that is the proxy's own code, aiohttp's server or client, the event loop, prometheus_client, the results
log...), per feature of the proxy (FEATURES: the innermost frame of its own code names it) and the top leaf
functions; each share also as microseconds of the proxy's CPU per request (the CPU it used while wrk ran,
Linux /proc, over the requests wrk had answered). --stream: bench_proxy.py's streamed requests
(1,000-chunk SSE answers, 16 connections) instead of short chat completions. --baseline DIR: the proxy of
another checkout (the code before a change) is the one profiled, on the same config (bench_proxy.py's
`proxy-base`).
The raw samples stay in --out (a py-spy "raw" file, one stack a line, for flame graphs); --read FILE reads
such a file again without running anything (a profile of an earlier commit, by today's features).
"""
from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import CHAT, SSE, wrk  # noqa: E402
from stack import Stack, cpu_s, find_program  # noqa: E402

GROUPS = (  # first match on a frame's "(file:line)", innermost frame first; py-spy shows the proxy's by basename
    ("results log", "(results_log.py:"), ("prometheus_client", "prometheus_client/"),
    ("the upstream client (proxy/upstream.py)", "(upstream.py:"),
    *(("proxy (own code)", f"({m}.py:") for m in ("forward", "balancer", "app", "state", "metrics", "fixups")),
    ("aiohttp server", "aiohttp/web"), ("aiohttp http parser/writer", "aiohttp/http"),
    ("aiohttp client", "aiohttp/client"), ("aiohttp connector", "aiohttp/connector"),
    ("aiohttp streams", "aiohttp/streams"), ("aiohttp other", "aiohttp/"), ("yarl/multidict", "yarl/"),
    ("yarl/multidict", "multidict/"), ("event loop (asyncio)", "asyncio/"), ("uvloop", "uvloop"),
)


PROXY_DIR = Path(__file__).resolve().parent.parent / "proxy"
OWN = {f"{m.relative_to(PROXY_DIR)}" for m in PROXY_DIR.rglob("*.py")}   # py-spy names them so: forward.py, routing/prefix.py
# What each of the proxy's features costs a request: the innermost frame of the proxy's own code names the
# feature (its module, or (module, function) first), unless aiohttp's code is deeper (the sample is then
# HTTP in or out, which every request pays whatever the features). Libraries the feature calls (json,
# prometheus_client, hashlib) count as the feature's.
FEATURES = {
    ("forward.py", "_log_attempt"): "results log (a line per answer, the observer)",
    "results_log.py": "results log (a line per answer, the observer)",
    "body.py": "body read once (proxy/body.py)",
    "routes.py": "route allow-list (proxy/routes.py)",
    "clients.py": "client socket deadlines (proxy/clients.py)",
    "resume.py": "stream continuation (the splice)",
    ("balancer.py", "route_of"): "prefix routing",
    ("metrics.py", "routed"): "prefix routing", ("metrics.py", "predicted"): "prefix routing",
    "routing/": "prefix routing",
    "admission.py": "tenants and keys", ("forward.py", "_rate_limited"): "tenants and keys",
    ("forward.py", "_tenant_settled"): "tenants and keys", ("forward.py", "_refused"): "tenants and keys",
    ("forward.py", "_tenant_of"): "tenants and keys", ("metrics.py", "tenant_"): "tenants and keys",
    "tracing.py": "ids and trace context", ("forward.py", "_exchange"): "ids and trace context",
    ("forward.py", "_trace_context"): "ids and trace context", ("forward.py", "new_request_id"): "ids and trace context",
    ("forward.py", "upstream_headers"): "header filtering", ("forward.py", "downstream_headers"): "header filtering",
    ("forward.py", "_headers_for"): "header filtering", ("forward.py", "_ids"): "header filtering",
    "share.py": "entry pair share (proxy/share.py)",
    "metrics.py": "metrics (prometheus_client)",
    "balancer.py": "slots and queue (balancer, admission order)", "state.py": "slots and queue (balancer, admission order)",
    "forward.py": "request path (forward.py, app.py)", "app.py": "request path (forward.py, app.py)",
    "server.py": "request path (forward.py, app.py)",
    "upstream.py": "HTTP in and out (aiohttp, the upstream client, the loop)",
}
HTTP = ("aiohttp/", "yarl/", "multidict/", "uvloop")
# Helpers several features call (a JSON text parsed): their time is their caller's feature.
SHARED = {("body.py", "loads")}


def _frame(frame: str) -> tuple[str, str]:
    """(file as py-spy names it, function) of a frame `function (file:line)`."""
    function, _, where = frame.rpartition(" (")
    return where.rsplit(":", 1)[0], function.rsplit(".", 1)[-1]


def feature_of(stack: list[str]) -> str:
    """The feature a sample's time goes to (FEATURES), "HTTP in and out (aiohttp, the upstream client, the loop)" for the rest."""
    for depth in range(len(stack) - 1, -1, -1):
        path, function = _frame(stack[depth])
        if path not in OWN or path == "__main__.py" or (path, function) in SHARED:
            continue
        if any(h in f for f in stack[depth + 1:] for h in HTTP):
            break
        for key, name in FEATURES.items():
            if isinstance(key, tuple) and path == key[0] and function.startswith(key[1]):
                return name
        for key, name in FEATURES.items():
            if isinstance(key, str) and path.startswith(key):
                return name
        return "request path (forward.py, app.py)"
    return "HTTP in and out (aiohttp, the upstream client, the loop)"


def group_of(stack: list[str]) -> str:
    """The group of a sample: its innermost frame that matches a group."""
    for frame in reversed(stack):
        for name, needle in GROUPS:
            if needle in frame:
                return name
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--loop", choices=("auto", "asyncio"), default="auto")
    ap.add_argument("--policy", choices=("least_conn", "prefix"), default="least_conn",
                    help="proxy.routing.policy (bench_proxy.py's `proxy` is least_conn)")
    ap.add_argument("--stream", action="store_true", help="streamed answers (1,000 chunks, 16 connections)")
    ap.add_argument("--baseline", help="another checkout whose proxy is profiled instead (proxy-base)")
    ap.add_argument("--out", default="proxy-profile.txt", help="py-spy's raw samples")
    ap.add_argument("--read", help="a raw file of an earlier run: report it, run nothing")
    args = ap.parse_args(argv)
    if args.read:
        return report(Path(args.read), args.loop, None)
    pyspy, wrk_bin = find_program("py-spy"), shutil.which("wrk")
    if not pyspy or not wrk_bin:
        print("profile_proxy: needs py-spy (bench/setup_routers.sh) and wrk (Debian package wrk).", file=sys.stderr)
        return 2
    front = "proxy-base" if args.baseline else "proxy" if args.loop == "auto" else "proxy-asyncio"
    body, connections = (SSE, 16) if args.stream else (CHAT, args.connections)
    with tempfile.TemporaryDirectory(prefix="profile-proxy-") as tmp:
        stack = Stack(Path(tmp), args.backends, 256, ["--sim-instant", "--sim-output-tokens", "1000"],
                      proxy_set=(f"proxy.routing.policy={args.policy}",),
                      baseline=Path(args.baseline).resolve() if args.baseline else None)
        try:
            stack.start([front])
            pid = stack.procs[-1].pid
            url = stack.url(front) + "/v1/chat/completions"
            ran: dict = {}
            load = threading.Thread(target=lambda: ran.update(wrk(wrk_bin, url, body, connections,
                                                                   args.seconds + 2, Path(tmp))))
            cpu = cpu_s(pid)
            load.start()
            subprocess.run([pyspy, "record", "-p", str(pid), "-d", str(int(args.seconds)), "-r", "200",
                            "-f", "raw", "-o", args.out, "--nonblocking"], check=True, capture_output=True)
            load.join()
            us = (cpu_s(pid) - cpu) / ran["requests"] * 1e6 if ran.get("requests") else None
            print("wrk:", ran)
        finally:
            stack.stop()
    if us is not None:
        print(f"the proxy's CPU per request: {us:.0f} us ({'streamed, 1,000 chunks' if args.stream else 'chat'})")
    return report(Path(args.out), args.loop, us)


def report(raw: Path, loop: str, us: float | None) -> int:
    """Print the groups, features and leaves of a py-spy raw file (us: the CPU per request, to scale them)."""
    groups: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    features: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        stack_frames = frames.split(";")
        if stack_frames[-1].startswith("ResultsLog._run "):
            continue   # the writer thread blocked in get() or sleeping between batches: idle, not work
        n = int(count)
        total += n
        groups[group_of(stack_frames)] += n
        features[feature_of(stack_frames)] += n
        leaves[stack_frames[-1]] += n
    def line(name: str, n: int) -> str:
        return f"  {n / total:6.1%}" + (f" {n / total * us:6.1f} us" if us else "") + f"  {name}"
    print(f"{total} samples of the proxy ({loop} loop), by group:")
    for name, n in groups.most_common():
        print(line(name, n))
    print("by feature (the innermost frame of the proxy's own code; times the CPU per request: its cost):")
    for name, n in features.most_common():
        print(line(name, n))
    print("top leaf functions:")
    for name, n in leaves.most_common(15):
        print(line(name, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
