"""One instance as status and the keeper both see it (hostagent/instances.py)."""
from __future__ import annotations

import socket
import threading

import pytest

from hostagent import instances

pytestmark = pytest.mark.unit


def test_a_stranger_that_speaks_no_http_is_no_answer_and_its_port_is_taken():
    """1. Something that is not an HTTP server (sshd's banner) holds an instance's port; 2. /health reads
    as no answer (it made the whole state probe fail once: BadStatusLine is no OSError); 3. the instance
    is port-taken, not dead."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def banner():
            for _ in range(2):
                conn, _ = server.accept()
                with conn:
                    conn.sendall(b"SSH-2.0-OpenSSH_8.9\r\n")
        t = threading.Thread(target=banner, daemon=True)
        t.start()
        status = instances.health(instances.url({"port": port}))
        assert status is None
        assert instances.listening(port)
        t.join(5)
    state, _ = instances.classify(alive=False, pidfile=False, health=status, was_ready=False, age_s=None,
                                  health_timeout_s=60, listening=True)
    assert state == "port-taken"
