"""Sim engines and a proxy on free loopback ports, for the proxy's tests."""
from __future__ import annotations

import os

import yaml

from conftest import PYTHON, ROOT, free_port, free_ports, http_status, wait_until


def start_sims(procs, tmp_path, n, seqs=4, token_ms=5, extra=()):
    """n sim engines on free loopback ports, their device files under tmp_path/sim-dev.

    A port found free can be taken before the sim binds it (other test runs share the machine):
    then all n start again on other ports, up to three times.
    """
    env = {**os.environ, "FLEET_SIM_DEV_DIR": str(tmp_path / "sim-dev")}
    for attempt in range(3):
        base = free_ports(n)
        started = [procs.start([PYTHON, "-m", "fleet.sim", "serve", "m", "--host", "127.0.0.1",
                                "--port", str(base + i), "--max-num-seqs", str(seqs), "--sim-load-s", "0",
                                "--sim-prefill-ms", "20", "--sim-token-ms", str(token_ms), *extra],
                               cwd=ROOT, env=env) for i in range(n)]
        ports = [base + i for i in range(n)]

        def up():
            if any(p.poll() is not None for p in started):
                return "exited"
            return all(http_status(f"http://127.0.0.1:{p}/health") == 200 for p in ports) and "up"
        if wait_until(up, what=f"{n} sims healthy") == "up":
            return ports
        for p in started:             # one lost its port: stop the rest, try other ports
            procs.stop(p)
    raise AssertionError("three times a sim's port was taken before it could bind it")


def start_proxy(procs, tmp_path, ports, env_extra=None, **extra):
    """The proxy over ports (a list of sim ports, or of host:port names); returns (port, admin_port).

    Its config is tmp_path/proxy.yaml (extra: more config keys) and its log tmp_path/proxy.log;
    env_extra: environment variables added to its own; a lost port race is retried.
    """
    for attempt in range(3):
        port, admin = free_port(), free_port()
        conf = {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"host": "127.0.0.1", "port": admin},
                "backends": [p if isinstance(p, str) else f"127.0.0.1:{p}" for p in ports],
                "health": {"interval_s": 0.3, "timeout_s": 1},
                "results_log": {"path": str(tmp_path / "req_results.log")}, **extra}
        path = tmp_path / "proxy.yaml"
        path.write_text(yaml.safe_dump(conf))
        with open(tmp_path / "proxy.log", "ab") as log:
            proxy = procs.start([PYTHON, "-m", "proxy", "--config", str(path)], cwd=ROOT, stderr=log,
                                env={**os.environ, **(env_extra or {})})

        def up():
            if proxy.poll() is not None:
                return "exited"
            return http_status(f"http://127.0.0.1:{port}/health") == 200 and "up"
        if wait_until(up, what="proxy healthy") == "up":
            return port, admin
        procs.stop(proxy)
    raise AssertionError(f"the proxy did not start three times; see {tmp_path / 'proxy.log'}")
