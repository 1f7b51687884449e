"""`python -m hostagent COMMAND --config conf/nginx_front.json [--nginx BIN]`, run in deploy_dir.

Commands: check (preflight), to-nginx, to-proxy, reload, watch, restart-proxy (a zero-gap restart of
the proxy), drain (stop's first step: the front stops taking requests and finishes those in flight). Each prints progress lines, then one
line `FLEET_RESULT {json}`; the exit status is 0 on success, 1 on a failure said in that line.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from . import drain, handover, host, watch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hostagent", description=__doc__)
    parser.add_argument("command", choices=["check", "to-nginx", "to-proxy", "reload", "watch", "restart-proxy",
                                            "drain"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nginx", default=None, help="the nginx binary (default: found as check does)")
    parser.add_argument("--healthy", action="store_true",
                        help="restart-proxy: the new proxy must answer 200 on /health before the old one leaves")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="drain: how long requests in flight get")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, flush=True)
    try:
        cfg = host.load_config(args.config)
        if args.command == "watch":
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
            watch.run(cfg)
            return 0
        if args.command == "check":
            result = handover.preflight(cfg, args.nginx)
        elif args.command == "to-nginx":
            result = handover.to_nginx(cfg, args.config, args.nginx, say)
        elif args.command == "to-proxy":
            result = handover.to_proxy(cfg, args.config, args.nginx, say)
        elif args.command == "restart-proxy":
            result = handover.restart_proxy(cfg, args.healthy, say)
        elif args.command == "drain":
            result = drain.drain(cfg, args.timeout_s, say)
        else:
            result = handover.reload(cfg, args.config, args.nginx, say)
        print("FLEET_RESULT " + json.dumps({"ok": True, **result}), flush=True)
        return 0
    except host.FrontError as e:
        print("FLEET_RESULT " + json.dumps({"ok": False, "error": str(e)}), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
