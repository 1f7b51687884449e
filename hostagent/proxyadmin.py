"""The proxy's admin API, called on the host: its loopback admin listener (127.0.0.1:admin_port).

`GET /admin/backends`, `POST /admin/backends/{name}/drain` and `/enable`, `GET /admin/requests`,
`GET /admin/config`, `POST /admin/reload`, `POST /admin/drain-and-exit`, `POST /admin/refresh-models`. Standard library only, Python 3.6+: the state probe
bundles it.
"""
import time

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


def reload(admin_port, drain_timeout_s=0.0):
    """The proxy re-reads its config (`POST /admin/reload` answers once it has applied or refused it), then,
    with drain_timeout_s, the wait here on the host until the backends it removed hold no request in flight
    (up to drain_timeout_s): one host agent command instead of a probe per poll from the control node.
    {"answered", "reloaded", "config" (GET /admin/config after it), "leaving", "waited_s"}."""
    status, answer = call(admin_port, "POST", "/admin/reload", timeout=60.0)
    if status is None:
        return {"answered": False, "reloaded": False, "error": answer}
    config = get_json(admin_port, "/admin/config") or {}
    t0 = time.monotonic()
    leaving = (config.get("leaving") or []) if status == 200 else []
    while leaving and time.monotonic() - t0 < drain_timeout_s:
        time.sleep(0.2)
        leaving = (get_json(admin_port, "/admin/config") or {}).get("leaving") or []
    return {"answered": True, "reloaded": status == 200, "config": config, "leaving": leaving,
            "waited_s": round(time.monotonic() - t0, 1)}


def refresh_models(admin_port):
    """Have the proxy re-read every backend's /v1/models (a runtime adapter added or removed): (status, answer)."""
    return call(admin_port, "POST", "/admin/refresh-models", timeout=30.0)
