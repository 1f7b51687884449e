"""Sim engines and a proxy on free loopback ports, for the proxy's tests."""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess

import yaml

from conftest import PYTHON, ROOT, free_ports, http_status, wait_until


def start_sims(procs, tmp_path, n, seqs=4, token_ms=5, extra=()):
    """n sim engines, each on the free loopback port it binds (--port 0) and names in its log
    (tmp_path/sim-<i>.log); their device files under tmp_path/sim-dev. Returns their ports."""
    env = {**os.environ, "FLEET_SIM_DEV_DIR": str(tmp_path / "sim-dev")}
    logs = []
    for i in range(n):
        path = tmp_path / f"sim-{len(list(tmp_path.glob('sim-*.log')))}.log"
        with open(path, "wb") as log:
            sim = procs.start([PYTHON, "-m", "fleet.sim", "serve", "m", "--host", "127.0.0.1", "--port", "0",
                               "--max-num-seqs", str(seqs), "--sim-load-s", "0", "--sim-prefill-ms", "20",
                               "--sim-token-ms", str(token_ms), *extra],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        logs.append((sim, path))

    def bound(sim, path):
        found = SERVING.search(path.read_text())
        assert found or sim.poll() is None, f"a sim exited before serving: {path.read_text()[-2000:]}"
        return found and int(found.group(1))
    ports = [wait_until(lambda: bound(sim, path), what=f"sim {path.name} serving") for sim, path in logs]
    wait_until(lambda: all(http_status(f"http://127.0.0.1:{p}/health") == 200 for p in ports),
               what=f"{n} sims healthy")
    return ports


SERVING = re.compile(r"fleet\.sim serving .* on http://127\.0\.0\.1:(\d+) ")


def start_proxy(procs, tmp_path, ports, env_extra=None, nofile=None, **extra):
    """The proxy over ports (a list of sim ports, or of host:port names); returns (port, admin_port).

    Its config is tmp_path/proxy.yaml (extra: more config keys) and its log tmp_path/proxy.log;
    env_extra: environment variables added to its own; nofile: (soft, hard) open-file limits it starts with.
    Its two ports come from this xdist worker's slice
    (conftest.free_ports), so no other worker of the run starts a server on them.
    """
    port = free_ports(2)
    admin = port + 1
    conf = {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"host": "127.0.0.1", "port": admin},
            "backends": [p if isinstance(p, str) else f"127.0.0.1:{p}" for p in ports],
            "health": {"interval_s": 0.3, "timeout_s": 1},
            "results_log": {"path": str(tmp_path / "req_results.log")}, **extra}
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(conf))
    with open(tmp_path / "proxy.log", "ab") as log:
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile)) if nofile else None
        proxy = procs.start([PYTHON, "-m", "proxy", "--config", str(path)], cwd=ROOT, stderr=log,
                            env={**os.environ, **(env_extra or {})}, preexec_fn=limit)

    def up():
        assert proxy.poll() is None, f"the proxy exited; see {tmp_path / 'proxy.log'}"
        return http_status(f"http://127.0.0.1:{port}/health") == 200
    wait_until(up, what="proxy healthy")
    return port, admin


def results_lines(path) -> list[dict]:
    """The results log's whole lines (none when it is not there yet): its writer thread may be appending
    the last one as it is read, and a test that polls must not trip on half a line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]
