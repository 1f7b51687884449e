"""The host agent's one spelling of each small job: the HTTP call, the Prometheus text parser, the atomic
write, the identity-checked pid reader."""
from __future__ import annotations

import os
import socket
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hostagent import exposition, files, httpcall, layout, processes

pytestmark = pytest.mark.unit

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0 1733300000000
vllm:generation_tokens_total{engine="0",model_name="m"} 120.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 5.0
proxy_requests_total{backend="a \\"quoted\\" name",status="200"} 7
broken_line_without_value
"""


def test_the_parser_reads_samples_labels_and_values_and_skips_comments_and_broken_lines():
    found = exposition.samples(METRICS)
    assert ("vllm:num_requests_waiting", {"engine": "0", "model_name": "m"}, 1.0) in found   # timestamp dropped
    assert ("vllm:time_to_first_token_seconds_bucket", {"engine": "0", "le": "+Inf", "model_name": "m"}, 5.0) in found
    assert ("proxy_requests_total", {"backend": 'a \\"quoted\\" name', "status": "200"}, 7.0) in found
    assert not any(name.startswith(("#", "broken")) for name, _, _ in found)
    assert exposition.total(found, "vllm:num_requests_running", "vllm:num_requests_waiting") == 3.0
    assert exposition.total(found, "vllm:generation_tokens_total") == 120.0    # not its _created sibling
    assert exposition.total(found, "vllm:absent") is None
    kept = exposition.samples(METRICS, ("vllm:num_requests_running",))
    assert [name for name, _, _ in kept] == ["vllm:num_requests_running"]


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):                       # noqa: N802 - http.server's name
        status = 503 if self.path == "/health" else 200
        body = b'{"pid": 42}'
        self.send_response(status)
        self.send_header("X-Front", "nginx")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):                      # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpcall.base_url("127.0.0.1", httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_http_error_status_is_an_answer_with_its_body_and_headers(server):
    answer = httpcall.get(server + "/health")
    assert answer.status == 503 and answer.json() == {"pid": 42} and answer.headers.get("X-Front") == "nginx"
    posted = httpcall.call(server + "/echo", "POST", {"a": 1})
    assert posted.status == 200 and posted.json() == {"a": 1}


def test_nothing_answering_and_a_stranger_speaking_no_http_are_no_status():
    with socket.socket() as s:                        # bound, never listening: the connection is refused
        s.bind(("127.0.0.1", 0))
        refused = httpcall.get(httpcall.base_url("127.0.0.1", s.getsockname()[1]) + "/health", 1.0)
    assert refused.status is None and refused.error and not refused.timed_out

    stranger = socket.socket()
    stranger.bind(("127.0.0.1", 0))
    stranger.listen(1)

    def greet():
        conn, _ = stranger.accept()
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        conn.close()
    threading.Thread(target=greet, daemon=True).start()
    try:
        answer = httpcall.get(httpcall.base_url("127.0.0.1", stranger.getsockname()[1]) + "/health", 2.0)
    finally:
        stranger.close()
    assert answer.status is None and answer.error


def test_the_atomic_write_replaces_whole_with_its_mode_and_leaves_no_temporary_file(tmp_path):
    path = str(tmp_path / "sub" / "keys.conf")
    assert files.write_if_changed(path, "one\n", mode=0o600) is True
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and open(path).read() == "one\n"
    assert files.write_if_changed(path, "one\n", mode=0o600) is False
    files.write_atomic(path, "two\n")
    assert open(path).read() == "two\n" and os.listdir(tmp_path / "sub") == ["keys.conf"]


def test_the_pid_reader_counts_a_record_only_while_its_process_is_that_one(tmp_path):
    path = str(tmp_path / "keeper.pid")
    tag = layout.tag("dep", "keeper")
    assert processes.read_pidfile(path, tag) == (None, None, None)          # no file
    processes.write_record(path, os.getpid(), tag)
    proc, rec, why = processes.read_pidfile(path, tag)
    assert proc is not None and proc.pid == os.getpid() and rec["pid"] == os.getpid() and why is None
    # The same pid, another start time: a reused pid is not the process recorded.
    with open(path, "w") as f:
        f.write(processes.format_record(os.getpid(), rec["pgid"], rec["sid"], rec["start"] + 1, tag))
    proc, rec, why = processes.read_pidfile(path, tag)
    assert proc is None and rec is not None and why == "started at another time"
    assert processes.verified(path, tag) is None
    assert processes.recorded_session(path) == rec["sid"]      # the session, whatever runs now
