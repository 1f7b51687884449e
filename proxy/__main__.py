"""`python -m proxy --config FILE`: serve the public port and the loopback admin port until SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

from . import app, logfile, otlp, workers
from .balancer import Balancer
from .listener import listen_socket
from .results_log import ResultsLog
from .server import Server, Worker
from .state import tenant_names
from .config import ConfigError, load_api_keys, load_config

log = logging.getLogger("proxy")


def run(main_coroutine, loop: str = "auto") -> None:
    """Run on uvloop when it is importable (every vLLM environment has it) unless loop is "asyncio"."""
    try:
        if loop == "asyncio":
            raise ImportError("asyncio asked for")
        import uvloop
    except ImportError as e:
        log.info("event loop: asyncio (%s)", e if loop == "asyncio" else "uvloop is not installed")
        asyncio.run(main_coroutine)
        return
    log.info("event loop: uvloop %s", uvloop.__version__)
    if hasattr(uvloop, "run"):
        uvloop.run(main_coroutine)
    else:                              # uvloop before 0.18 (an older vendor vLLM environment)
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(main_coroutine)


# Every request makes a few hundred container objects (aiohttp's request, response, futures, headers):
# at Python's default (700) a young-generation collection ran every few requests, and full ones walked
# every object the proxy holds (its prefix index among them). Fewer, larger young collections free the
# same cycles a little later: 6% of a request's CPU on the bench (docs/PERFORMANCE.md).
GC_THRESHOLDS = (20_000, 50, 1_000)


def collect_less() -> None:
    """What the start made (modules, the config) out of the collector's walks; its thresholds raised."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy", description=__doc__)
    parser.add_argument("--config", required=True, help="the proxy's YAML config (conf/proxy.yaml)")
    parser.add_argument("--admin-wait-s", type=float, default=0.0,
                        help="a zero-gap restart: the admin port is taken once the proxy replaced leaves it")
    parser.add_argument("--loop", choices=("auto", "asyncio"), default="auto",
                        help="auto: uvloop when installed (the default); asyncio: the standard loop")
    # A worker of several (proxy.workers > 1): started by the supervisor, which `python -m proxy` then is.
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--supervisor", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=logfile.FORMAT)
    try:
        config = load_config(args.config)
        load_api_keys(config.api_keys_file, tenant_names(config))
        if config.otlp.endpoint is not None and otlp.missing():   # the SDK is optional: checked when asked for
            raise ConfigError(otlp.missing())
    except ConfigError as e:
        print(f"proxy: {e}", file=sys.stderr)
        return 2
    count = config.workers.resolve(workers.cores())
    worker = None
    if args.worker is not None:
        me, count = workers.parse_worker(args.worker)
        workers.follow_supervisor(args.supervisor)
        app.PID = args.supervisor       # the proxy the operator sees: /health, /admin/config, drain-and-exit
        Balancer.lending = workers.Lending(args.run_dir, me, count)
        ResultsLog.shared = True
        worker = Worker(me, count, args.run_dir, args.listen_fd, Balancer.lending, args.supervisor)
    try:
        logfile.setup(config.log, rotate=worker is None and count == 1 or worker is not None and worker.me == 0)
    except OSError as e:
        print(f"proxy: cannot write its log {config.log.path} ({e.strerror or e}).", file=sys.stderr)
        return 2
    try:
        if worker is None and count > 1:
            listen = config.listen
            return workers.supervise(config, ["--config", args.config, "--admin-wait-s", str(args.admin_wait_s),
                                              "--loop", args.loop], count,
                                     lambda: listen_socket(listen.host, listen.port, listen.reuse_port, listening=False))
        collect_less()
        run(Server(config, args.config, args.admin_wait_s, worker).serve(), args.loop)
    except OSError as e:
        print(f"proxy: cannot listen ({e.strerror or e}); is the port taken?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
