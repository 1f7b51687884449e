"""The proxy's own instructions per request, counted by callgrind: a figure the machine's load cannot move.

    .venv/bin/python bench/instructions_proxy.py [--baseline DIR] [--seconds 40] [--connections 4] [--stream]

On a machine shared with other work, the CPU time a request takes moves by 10% and more from one round to
the next (bench_proxy.py's rounds); the instructions the proxy's own process executes for it do not. The
sims (instant mode) and the proxy of this checkout (with --baseline, that checkout's proxy too, on the same
config: the rendered one, results log on, least_conn) start as bench_proxy.py starts them, each proxy under
valgrind's callgrind with its counting off; wrk warms each up, then counting goes on in all of them at once,
a quiet spell measures what they execute while idle (timers, health checks), and wrk drives them all at the
same time for --seconds (so the machine's load, which sets how many requests each answers and so what its
timers add per request, is the same for all). Instructions per request: what each executed under load, less
its idle rate over the same seconds, over the requests it answered. User space only: the system calls' own
work (the sends and receives) is the kernel's and not counted. Needs valgrind (Debian package `valgrind`)
and wrk.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import CHAT, SSE, wrk  # noqa: E402
from stack import ROOT, Stack, wait_http  # noqa: E402

IDLE_S = 5.0   # the quiet spell whose instructions a second are taken out of the loaded ones


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="another checkout (the code before a change) measured beside this one")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--stream", action="store_true", help="streamed answers (1,000 chunks) instead of chat")
    args = ap.parse_args(argv)
    wrk_bin, valgrind = shutil.which("wrk"), shutil.which("valgrind")
    if not wrk_bin or not valgrind:
        print("instructions_proxy: needs wrk and valgrind (Debian packages).", file=sys.stderr)
        return 2
    roots = [("proxy", ROOT)] + ([("proxy-base", Path(args.baseline).resolve())] if args.baseline else [])
    body = SSE if args.stream else CHAT
    with tempfile.TemporaryDirectory(prefix="instructions-proxy-") as tmp:
        stack = Stack(Path(tmp), 4, 256, ["--sim-instant", "--sim-output-tokens", "1000"], proxy_set=("proxy.routing.policy=least_conn",))
        procs: dict[str, subprocess.Popen] = {}
        try:
            stack.start(["direct"])
            for front, root in roots:
                path = stack.deploy / "conf" / f"{front}.yaml"     # the proxy's config as Stack wrote it
                procs[front] = subprocess.Popen(
                    [valgrind, "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/{front}.cg",
                     sys.executable, "-m", "proxy", "--config", str(path)],
                    cwd=root, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for front in procs:
                wait_http(stack.url(front) + "/health", timeout=600)
                wrk(wrk_bin, stack.url(front) + "/v1/chat/completions", body, args.connections, 5, Path(tmp))
            _control(procs, "-i", "on")
            time.sleep(IDLE_S)
            _control(procs, "-d", "idle")       # the idle part: its own file, the counters start again
            runs: dict[str, dict] = {}

            def drive(front: str) -> None:
                runs[front] = wrk(wrk_bin, stack.url(front) + "/v1/chat/completions", body, args.connections,
                                  args.seconds, Path(tmp))
            threads = [threading.Thread(target=drive, args=(f,)) for f in procs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            _control(procs, "-i", "off")
            per = {}
            for front, p in procs.items():
                os.kill(p.pid, signal.SIGTERM)
                p.wait(120)
                idle = _total(Path(f"{tmp}/{front}.cg.1"))
                loaded = _total(Path(f"{tmp}/{front}.cg")) - idle / IDLE_S * args.seconds
                n = runs[front]["requests"]
                per[front] = loaded / n
                print(f"{front}: {n} {'streams' if args.stream else 'requests'} in {args.seconds:g} s, "
                      f"{per[front] / 1e3:.1f} k instructions each (idle {idle / IDLE_S / 1e6:.1f} M a second taken "
                      f"out), errors {runs[front]['non_2xx'] + runs[front]['socket_errors']}")
            if "proxy-base" in per:
                print(f"proxy / proxy-base, instructions per {'stream' if args.stream else 'request'}: "
                      f"{per['proxy'] / per['proxy-base']:.3f}x")
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            stack.stop()
    return 0


def _control(procs: dict, *argv: str) -> None:
    for p in procs.values():
        subprocess.run(["callgrind_control", *argv, str(p.pid)], capture_output=True, check=False)


def _total(path: Path) -> int:
    """The instructions a callgrind file counted (its `totals:` line)."""
    found = re.search(r"^totals:\s*(\d+)", path.read_text(errors="replace"), re.M)
    return int(found.group(1)) if found else 0


if __name__ == "__main__":
    sys.exit(main())
