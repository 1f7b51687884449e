"""The proxy's admin API, called on the host: its loopback admin listener (127.0.0.1:admin_port).

`GET /admin/backends`, `POST /admin/backends/{name}/drain` and `/enable`, `GET /admin/requests`,
`GET /admin/config`, `POST /admin/drain-and-exit`, `POST /admin/refresh-models`. Standard library only, Python 3.6+: the state probe
bundles it.
"""
from hostagent import httpcall


def call(admin_port, method, path, body=None, timeout=5.0):
    """(status, decoded JSON or text) of one admin call; (None, reason) when nothing answers."""
    answer = httpcall.call(httpcall.base_url("127.0.0.1", admin_port) + path, method, body, timeout)
    if answer.status is None:
        return None, answer.error
    decoded = answer.json()
    return answer.status, decoded if decoded is not None else answer.text()


def get_json(admin_port, path, timeout=5.0):
    """The JSON a GET at path answers with 200, None otherwise."""
    status, body = call(admin_port, "GET", path, timeout=timeout)
    return body if status == 200 and not isinstance(body, str) else None


def backends(admin_port, timeout=5.0):
    """Backend name -> its admin record, or None when the proxy does not answer."""
    body = get_json(admin_port, "/admin/backends", timeout)
    if not isinstance(body, list):
        return None
    return {b["name"]: b for b in body}


def drain(admin_port, name):
    """Drain backend name: (status, answer)."""
    return call(admin_port, "POST", "/admin/backends/%s/drain" % name)


def enable(admin_port, name):
    """Give backend name back to the proxy's picking: (status, answer)."""
    return call(admin_port, "POST", "/admin/backends/%s/enable" % name)


def refresh_models(admin_port):
    """Have the proxy re-read every backend's /v1/models (a runtime adapter added or removed): (status, answer)."""
    return call(admin_port, "POST", "/admin/refresh-models", timeout=30.0)
