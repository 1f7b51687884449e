"""The proxy's logs stay bounded and say what matters: proxy.log rotates by size while the proxy runs, a
malformed request is one line, and a results log that cannot be written is named once with its OS error."""
from __future__ import annotations

import os
import shutil
import socket
import stat
import urllib.request

import pytest

from conftest import wait_until
from proxy_helpers import start_proxy, start_sims

pytestmark = pytest.mark.process

BAD_REQUESTS = (
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GARBAGE \x01\x02 HTTP/9\r\n\r\n",
)


def send_raw(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(payload)
        return c.recv(64)


def chat(port: int, rid: str) -> int:
    body = b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
        return r.status


def dropped(port: int) -> float:
    """The proxy's count of results-log lines it could not write, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("proxy_results_log_dropped_total "):
                return float(line.split()[1])
    return 0.0


def test_malformed_requests_leave_proxy_log_bounded(procs, tmp_path):
    """1. The proxy logs to logs/proxy.log rotated at 20 KiB, 2 backups (log.max_mb, log.backups).
    2. 1,000 malformed requests (three kinds, each on its own connection), each answered 400.
    3. proxy.log stays under its bound, the rotation happened while the proxy ran (no more files than
       backups), no traceback anywhere, each bad request one line naming the sender and the fault.
    4. The proxy still serves."""
    sims = start_sims(procs, tmp_path, 1)
    logs = tmp_path / "logs"
    max_mb, backups = 0.02, 2
    bound = int(max_mb * 1024 * 1024)
    port, _ = start_proxy(procs, tmp_path, sims,
                          log={"path": str(logs / "proxy.log"), "max_mb": max_mb, "backups": backups})
    for i in range(1000):
        assert send_raw(port, BAD_REQUESTS[i % len(BAD_REQUESTS)]).startswith(b"HTTP/1.")
    wait_until(lambda: (logs / "proxy.log.1").exists(), what="proxy.log rotated")
    files = sorted(p.name for p in logs.iterdir())
    assert files == ["proxy.log", "proxy.log.1", "proxy.log.2"], files
    texts = [(logs / name).read_text() for name in files]
    for name in files:
        assert (logs / name).stat().st_size <= bound, (name, (logs / name).stat().st_size)
    assert not any("Traceback" in t for t in texts)
    bad = [line for t in texts for line in t.splitlines() if "Error handling request" in line]
    assert len(bad) > 100        # the kept files hold the last few hundred of the 1,000
    assert all("from 127.0.0.1 (400): " in line for line in bad), bad[:3]
    assert all(len(line) < 400 for line in bad)
    assert chat(port, "after-bad") == 200


def test_unwritable_results_log_is_named_once_and_serving_goes_on(procs, tmp_path):
    """1. The results log's path becomes a directory under the running proxy (root can write anywhere, so
    this is the failure a test can cause whoever runs it).  2. Requests go on answering 200 while its lines
    cannot be written; proxy.log names the file and the OS error once for the whole burst, not per batch.
    3. The path freed again: lines are written again, and the count of dropped lines is said."""
    sims = start_sims(procs, tmp_path, 1)
    port, _ = start_proxy(procs, tmp_path, sims)
    results = tmp_path / "req_results.log"
    own_log = tmp_path / "proxy.log"
    assert chat(port, "before") == 200
    wait_until(lambda: results.exists() and "before" in results.read_text(), what="the first line")
    results.unlink()
    results.mkdir()
    for i in range(3):
        assert chat(port, f"lost-{i}") == 200
        # Each line lost before the next request: three failing batches, not one batch of three.
        wait_until(lambda: dropped(port) == i + 1, what=f"line {i + 1} counted as dropped")
    text = own_log.read_text()
    assert text.count("cannot write") == 1, text
    line = next(x for x in text.splitlines() if "cannot write" in x)
    assert str(results) in line and "Is a directory (errno 21)" in line and "goes on serving" in line
    assert "NoneType" not in text and "Traceback" not in text
    shutil.rmtree(results)
    assert chat(port, "again") == 200
    wait_until(lambda: results.is_file() and "again" in results.read_text(), what="the log written again")
    # The recovery line itself: the error line above already says "... until it can be written again".
    wait_until(lambda: "written again; 3 line(s) were dropped" in own_log.read_text(),
               what="the recovery logged with its count")
    assert "written again; 3 line(s) were dropped" in own_log.read_text()
    assert "lost-" not in results.read_text()


def test_the_proxys_logs_are_its_users_alone_whatever_the_umask(procs, tmp_path):
    """1. A results log and its .1 left 0644 by an earlier run; the proxy started under umask 022, its
       own log in a directory it makes, both logs rotating at a few KiB.
    2. The two loose files are 0600 once it runs, and proxy.log says so for each.
    3. Chats and malformed requests until both logs rotated: every file, old and new, is 0600, and the
       directory the proxy made is 0700."""
    sims = start_sims(procs, tmp_path, 1)
    logs, results = tmp_path / "logs", tmp_path / "results"
    results.mkdir()
    for name in ("req_results.log", "req_results.log.1"):
        (results / name).write_text("{}\n")
        (results / name).chmod(0o644)
    loose = os.umask(0o022)
    try:
        port, _ = start_proxy(procs, tmp_path, sims, log={"path": str(logs / "proxy.log"), "max_mb": 0.004,
                                                           "backups": 2},
                              results_log={"path": str(results / "req_results.log"), "max_mb": 0.001, "backups": 3})
    finally:
        os.umask(loose)
    said = (logs / "proxy.log").read_text()
    for name in ("req_results.log", "req_results.log.1"):
        assert f"{results / name} was mode 0644, readable beyond its user: now 0600" in said, said
    for i in range(6):
        assert chat(port, f"private-{i}") == 200
    for i in range(40):
        send_raw(port, BAD_REQUESTS[i % len(BAD_REQUESTS)])
    wait_until(lambda: (results / "req_results.log.3").exists() and (logs / "proxy.log.1").exists(),
               what="both logs rotated")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for d in (logs, results) for p in d.iterdir()}
    assert {name for name, mode in modes.items() if mode != 0o600} == set(), modes
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
