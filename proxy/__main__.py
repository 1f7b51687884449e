"""`python -m proxy --config FILE`: serve the public port and the loopback admin port until SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from . import logfile
from .app import make_admin_app, make_app
from .state import PROXY
from .config import ConfigError, load_api_keys, load_config

log = logging.getLogger("proxy")

CLOSE_LINGER_S = 1.0  # after SIGTERM, how long kept-alive connections are answered (and told to close)


async def serve(config, config_path: str) -> None:
    app = make_app(config, config_path)
    proxy = app[PROXY]
    admin = make_admin_app(proxy)
    # handler_cancellation: a client that goes away cancels its handler, which aborts the upstream request.
    # shutdown_timeout: how long requests in flight may run on after SIGTERM.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=config.shutdown_timeout_s)
    admin_runner = web.AppRunner(admin, access_log=None)
    await runner.setup()
    await admin_runner.setup()
    public = web.TCPSite(runner, config.listen.host, config.listen.port, reuse_port=config.listen.reuse_port or None)
    try:
        await public.start()
        await web.TCPSite(admin_runner, config.admin.host, config.admin.port).start()
    except OSError:   # a port taken: close the client session and the health loop before saying so
        await runner.cleanup()
        await admin_runner.cleanup()
        raise
    log.info("listening on %s:%d, admin on %s:%d, backends %s", config.listen.host, config.listen.port,
             config.admin.host, config.admin.port, ", ".join(config.backends))

    # Signal handlers only set a flag; the work happens here, in order.
    stop, reload = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)   # deploy, stop, swap-to-nginx: drain then exit 0
    loop.add_signal_handler(signal.SIGINT, stop.set)    # Ctrl-C by hand: the same
    loop.add_signal_handler(signal.SIGHUP, reload.set)  # deploy after a config change: re-read it
    while not stop.is_set():
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(reload.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        if reload.is_set() and not stop.is_set():
            reload.clear()
            proxy.reload()
    in_flight = sum(b.in_flight for b in proxy.balancer.backends.values())
    log.info("stopping: no new connections; %d requests in flight get up to %g s",
             in_flight, proxy.config.shutdown_timeout_s)
    # 1. Stop listening: new connections go to the port's other listener (nginx during a swap) or are
    #    refused. 2. For a moment, answer what kept-alive connections still send, with Connection: close,
    #    so a busy client reconnects instead of racing its next request against our closing the
    #    connection. 3. Then aiohttp closes the idle connections and waits for the requests in flight.
    await public.stop()
    proxy.closing = True
    await asyncio.sleep(min(CLOSE_LINGER_S, proxy.config.shutdown_timeout_s))
    await runner.cleanup()
    await admin_runner.cleanup()
    log.info("stopped")


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
    uvloop.run(main_coroutine)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy", description=__doc__)
    parser.add_argument("--config", required=True, help="the proxy's YAML config (conf/proxy.yaml)")
    parser.add_argument("--loop", choices=("auto", "asyncio"), default="auto",
                        help="auto: uvloop when installed (the default); asyncio: the standard loop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=logfile.FORMAT)
    try:
        config = load_config(args.config)
        load_api_keys(config.api_keys_file)
    except ConfigError as e:
        print(f"proxy: {e}", file=sys.stderr)
        return 2
    try:
        logfile.setup(config.log)
    except OSError as e:
        print(f"proxy: cannot write its log {config.log.path} ({e.strerror or e}).", file=sys.stderr)
        return 2
    try:
        run(serve(config, args.config), args.loop)
    except OSError as e:
        print(f"proxy: cannot listen ({e.strerror or e}); is the port taken?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
