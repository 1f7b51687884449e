"""Where the proxy's time goes under load: py-spy samples of the proxy while wrk drives it, by module.

    .venv/bin/python bench/profile_proxy.py [--seconds 10] [--connections 64] [--backends 4] [--loop auto|asyncio]

Starts the sims (instant mode) and the proxy as bench_proxy.py does, runs wrk against the proxy and
py-spy (from bench/.venv-routers, made by bench/setup_routers.sh) on the proxy's pid at the same time,
then prints the share of busy samples (the results-log thread's waits left out) per group of frames (the innermost frame that is the proxy's own code,
aiohttp's server or client, the event loop, prometheus_client, the results log...) and the top leaf
functions. The raw samples stay in --out (a py-spy "raw" file, one stack a line, for flame graphs).
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

from bench_proxy import CHAT, wrk  # noqa: E402
from stack import Stack, find_program  # noqa: E402

GROUPS = (  # first match on a frame's "(file:line)", innermost frame first; py-spy shows the proxy's by basename
    ("results log", "(results_log.py:"), ("prometheus_client", "prometheus_client/"),
    *(("proxy (own code)", f"({m}.py:") for m in ("forward", "balancer", "app", "state", "metrics", "fixups")),
    ("aiohttp server", "aiohttp/web"), ("aiohttp http parser/writer", "aiohttp/http"),
    ("aiohttp client", "aiohttp/client"), ("aiohttp connector", "aiohttp/connector"),
    ("aiohttp streams", "aiohttp/streams"), ("aiohttp other", "aiohttp/"), ("yarl/multidict", "yarl/"),
    ("yarl/multidict", "multidict/"), ("event loop (asyncio)", "asyncio/"), ("uvloop", "uvloop"),
)


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
    ap.add_argument("--out", default="proxy-profile.txt", help="py-spy's raw samples")
    args = ap.parse_args(argv)
    pyspy, wrk_bin = find_program("py-spy"), shutil.which("wrk")
    if not pyspy or not wrk_bin:
        print("profile_proxy: needs py-spy (bench/setup_routers.sh) and wrk (Debian package wrk).", file=sys.stderr)
        return 2
    front = "proxy" if args.loop == "auto" else "proxy-asyncio"
    with tempfile.TemporaryDirectory(prefix="profile-proxy-") as tmp:
        stack = Stack(Path(tmp), args.backends, 256, ["--sim-instant"])
        try:
            stack.start([front])
            pid = stack.procs[-1].pid
            url = stack.url(front) + "/v1/chat/completions"
            load = threading.Thread(target=lambda: print("wrk:", wrk(wrk_bin, url, CHAT, args.connections,
                                                                      args.seconds + 2, Path(tmp))))
            load.start()
            subprocess.run([pyspy, "record", "-p", str(pid), "-d", str(int(args.seconds)), "-r", "200",
                            "-f", "raw", "-o", args.out, "--nonblocking"], check=True, capture_output=True)
            load.join()
        finally:
            stack.stop()
    groups: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    total = 0
    for line in Path(args.out).read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        stack_frames = frames.split(";")
        if stack_frames[-1].startswith("ResultsLog._run "):
            continue   # the writer thread blocked in get() or sleeping between batches: idle, not work
        n = int(count)
        total += n
        groups[group_of(stack_frames)] += n
        leaves[stack_frames[-1]] += n
    print(f"{total} samples of the proxy ({args.loop} loop), by group:")
    for name, n in groups.most_common():
        print(f"  {n / total:6.1%}  {name}")
    print("top leaf functions:")
    for name, n in leaves.most_common(15):
        print(f"  {n / total:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
