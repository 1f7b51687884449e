"""`python -m proxy --config FILE`: serve the public port and the loopback admin port until SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from .app import BALANCER, make_admin_app, make_app
from .config import ConfigError, load_config

log = logging.getLogger("proxy")


async def serve(config) -> None:
    app = make_app(config)
    admin = make_admin_app(app[BALANCER])
    # handler_cancellation: a client that goes away cancels its handler, which aborts the upstream request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    admin_runner = web.AppRunner(admin, access_log=None)
    await runner.setup()
    await admin_runner.setup()
    await web.TCPSite(runner, config.listen.host, config.listen.port, shutdown_timeout=5).start()
    await web.TCPSite(admin_runner, config.admin.host, config.admin.port).start()
    log.info("listening on %s:%d, admin on %s:%d, backends %s", config.listen.host, config.listen.port,
             config.admin.host, config.admin.port, ", ".join(config.backends))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):   # the handler only sets a flag; shutdown runs below
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: no new connections, in-flight requests get up to 5 s")
    await runner.cleanup()
    await admin_runner.cleanup()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy", description=__doc__)
    parser.add_argument("--config", required=True, help="the proxy's YAML config (conf/proxy.yaml)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"proxy: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as e:
        print(f"proxy: cannot listen ({e.strerror or e}); is the port taken?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
