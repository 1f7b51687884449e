"""The host agent's one HTTP call (urllib): a GET or a POST with a timeout, answered as status and body.

Every reader of /health, /metrics, the proxy's admin API and vLLM's endpoints goes through `call`, so a
refused connection, a timeout, an HTTP error status and a stranger that speaks no HTTP (sshd on the port)
read the same everywhere. Standard library only, Python 3.6+ (the probes bundle it, fleet.transport.hostcode).
"""
import http.client
import json
import urllib.error
import urllib.request


class Answer(object):
    """What one call got: status (None when nothing answered: then error says why), body, headers."""

    __slots__ = ("status", "body", "headers", "error", "timed_out")

    def __init__(self, status=None, body=b"", headers=None, error=None, timed_out=False):
        self.status, self.body, self.headers = status, body, headers or {}
        self.error, self.timed_out = error, timed_out

    def text(self):
        return self.body.decode("utf-8", "replace")

    def json(self):
        """The body as JSON, None when it is not JSON."""
        try:
            return json.loads(self.text())
        except ValueError:
            return None


def call(url, method="GET", body=None, timeout=2.0, headers=None):
    """One request to url; body (any JSON value) goes as a JSON body. An HTTP error status is an answer."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers=dict({"Content-Type": "application/json"} if data is not None else {},
                                              **(headers or {})))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Answer(r.status, r.read(), r.headers)
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read(), e.headers)
    except (OSError, ValueError, http.client.HTTPException) as e:   # refused, timeout, no HTTP spoken
        # Python < 3.10 raises socket.timeout, no TimeoutError; urllib wraps a connect timeout in URLError.
        timed_out = isinstance(e, TimeoutError) or "timed out" in str(e)
        return Answer(error=str(getattr(e, "reason", None) or e), timed_out=timed_out)


def get(url, timeout=2.0):
    """GET url: its Answer."""
    return call(url, timeout=timeout)


def base_url(address, port):
    """http://ADDRESS:PORT, an IPv6 address in brackets."""
    return "http://[%s]:%d" % (address, port) if ":" in address else "http://%s:%d" % (address, port)
