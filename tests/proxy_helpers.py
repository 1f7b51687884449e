"""Sim engines and a proxy on free loopback ports, for the proxy's tests."""
from __future__ import annotations

import os

import yaml

from conftest import PYTHON, ROOT, free_port, free_ports, http_status, wait_until


def start_sims(procs, tmp_path, n, seqs=4, token_ms=5, extra=()):
    """n sim engines on free loopback ports, their device files under tmp_path/sim-dev."""
    base = free_ports(n)
    env = {**os.environ, "FLEET_SIM_DEV_DIR": str(tmp_path / "sim-dev")}
    for i in range(n):
        procs.start([PYTHON, "-m", "fleet.sim", "serve", "m", "--host", "127.0.0.1", "--port", str(base + i),
                     "--max-num-seqs", str(seqs), "--sim-load-s", "0", "--sim-prefill-ms", "20",
                     "--sim-token-ms", str(token_ms), *extra], cwd=ROOT, env=env)
    ports = [base + i for i in range(n)]
    for p in ports:
        wait_until(lambda: http_status(f"http://127.0.0.1:{p}/health") == 200, what=f"sim :{p} healthy")
    return ports


def start_proxy(procs, tmp_path, ports, **extra):
    """The proxy over ports (a list of sim ports, or of host:port names); returns (port, admin_port)."""
    port, admin = free_port(), free_port()
    conf = {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"host": "127.0.0.1", "port": admin},
            "backends": [p if isinstance(p, str) else f"127.0.0.1:{p}" for p in ports], "health": {"interval_s": 0.3, "timeout_s": 1},
            "results_log": {"path": str(tmp_path / "req_results.log")}, **extra}
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(conf))
    log = open(tmp_path / "proxy.log", "ab")
    procs.start([PYTHON, "-m", "proxy", "--config", str(path)], cwd=ROOT, stderr=log)
    wait_until(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, what="proxy healthy")
    return port, admin
