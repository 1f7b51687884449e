"""A chat request through a host's entry port, with the standard library (the demo's smoke test)."""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from fleet.errors import FleetError
from fleet.settings.cluster import address
from fleet.settings.inventory import HostVars

KEY_ENV = "OPENAI_API_KEY"        # the key chat and bench send without --api-key (the openai client's variable)


def api_key(given: str = "") -> str:
    """The API key to send: --api-key, else $OPENAI_API_KEY, else none ("")."""
    return given or os.environ.get(KEY_ENV, "")


def auth_headers(key: str) -> dict:
    """The Authorization header of key (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_refused(hv: HostVars, url: str, key: str) -> str:
    """What a 401 from the entry port means, in one sentence (never the key itself)."""
    if key:
        return (f"{hv.name}: {url} refused the API key sent (401); check --api-key (or {KEY_ENV}) against the "
                "host's proxy.api_keys_file.")
    return f"{hv.name}: the entry port wants an API key: --api-key (or {KEY_ENV})."


def entry_url(hv: HostVars) -> str:
    """http://address:port of the host's entry (proxy or nginx) as seen from here."""
    return f"http://{address(hv.settings)}:{hv.settings.proxy.port}"


def chat(hv: HostVars, prompt: str, max_tokens: int = 64, user: str = "fleet-demo",
         timeout: float = 120, model: str = "", key: str = "") -> dict:
    """Send one chat completion (to `model`, else the host's first; key: the API key, if any); return
    answer, backend, request id, finish_reason and latency."""
    body = json.dumps({"model": hv.served_model(model).name, "max_tokens": max_tokens, "user": user,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    url = entry_url(hv) + "/v1/chat/completions"
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", **auth_headers(key)})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = json.loads(r.read())
            headers = r.headers
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise FleetError(key_refused(hv, url, key)) from None
        raise FleetError(f"{hv.name}: {url} answered {e.code}: {e.read()[:300].decode('utf-8', 'replace')}; "
                         "see `inv status` and logs/proxy.log.") from None
    except OSError as e:
        raise FleetError(f"{hv.name}: nothing answers at {url} ({e}); run `inv deploy --host {hv.name}` "
                         "first.") from None
    choice = data["choices"][0]
    return {"answer": choice["message"]["content"], "finish_reason": choice.get("finish_reason"),
            "backend": headers.get("X-Backend"), "request_id": headers.get("X-Request-Id"),
            "completion_tokens": (data.get("usage") or {}).get("completion_tokens"),
            "latency_s": round(time.monotonic() - t0, 3)}
