"""`python -m hostagent.start_when_free --wait-free HOST:PORT --ready-file FILE -- -m MODULE ARGS...`

Start a Python server the moment a port becomes free, for swap-to-proxy: import the heavy libraries
first (aiohttp, yaml, prometheus_client: most of a start-up), touch FILE to say so, wait until
HOST:PORT can be bound (polled every millisecond), then run MODULE in this very process as
`python -m MODULE ARGS` would. The pid, the environment and the log stay those start_proxy.sh set up.
"""
from __future__ import annotations

import argparse
import importlib
import runpy
import socket
import sys
import time


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hostagent.start_when_free")
    parser.add_argument("--wait-free", required=True, help="HOST:PORT to wait for")
    parser.add_argument("--ready-file", required=True, help="touched once the imports are done")
    parser.add_argument("--timeout-s", type=float, default=60)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- -m MODULE ARGS...")
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if len(rest) < 2 or rest[0] != "-m":
        parser.error("expected -- -m MODULE ARGS...")
    host, _, port = args.wait_free.rpartition(":")
    for name in ("aiohttp.web", "yaml", "prometheus_client", "asyncio"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass      # the module itself will say what is missing
    open(args.ready_file, "w").close()
    print(f"launch: imports done, waiting for port {port} to be free", flush=True)
    deadline = time.monotonic() + args.timeout_s
    while not port_free(host.strip("[]") or "0.0.0.0", int(port)):
        if time.monotonic() > deadline:
            print(f"launch: port {port} still taken after {args.timeout_s:g}s; giving up", flush=True)
            return 1
        time.sleep(0.001)
    sys.argv = [rest[1]] + rest[2:]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
