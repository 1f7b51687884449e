"""`inv stop`'s first step, run on the host: the front stops taking requests and finishes the ones in
flight, up to a bound, with a line of progress a second; only then are the instances stopped.

- proxy: POST /admin/drain-and-exit {"timeout_s": T}. The proxy stops listening at once, keeps answering
  what its kept-alive connections still send (each answer closes its connection), waits for its requests
  in flight, cuts those still running at the bound and names them in the answer, then exits. Progress is
  read from GET /admin/backends (in_flight), which it answers until it exits.
- nginx: the /health watcher stops, then SIGQUIT, nginx's graceful quit: it closes its listeners and
  exits once its requests are done. nginx counts nothing it can tell us, so progress and the names of
  what the bound cut come from the instances: their `vllm:num_requests_running` on /metrics.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import exposition, httpcall, nginx_front, parts, proxyadmin

PROGRESS_S = 1.0       # one line of progress a second
EXIT_WAIT_S = 5.0      # after the drain, how long the front gets to exit before the stop script takes over


def drain(cfg: dict, timeout_s: float, say=print) -> dict:
    """Drain whichever front runs (the proxy, nginx, or both in the middle of a swap)."""
    result: dict = {"changed": False}
    pid, pgid = parts.proxy_pid(cfg)
    if pid:
        result["proxy"] = drain_proxy(cfg, pid, pgid, timeout_s, say)
        result["changed"] = True
    nginx = nginx_front.nginx_pid(cfg)
    if nginx:
        result["nginx"] = drain_nginx(cfg, nginx, timeout_s, say)
        result["changed"] = True
    if not result["changed"]:
        say("drain: no front runs; nothing to drain")
    return result


def proxy_in_flight(cfg: dict) -> int | None:
    """The proxy's requests in flight, those waiting in its queue included (its admin API), or None when
    it does not answer."""
    body = proxyadmin.get_json(cfg["admin_port"], "/admin/requests", timeout=2)
    if not isinstance(body, list):
        return None
    return len(body)


def drain_proxy(cfg: dict, pid: int, pgid: int, timeout_s: float, say) -> dict:
    answer: list = []
    call = threading.Thread(target=lambda: answer.append(proxyadmin.call(
        cfg["admin_port"], "POST", "/admin/drain-and-exit", {"timeout_s": timeout_s, "pid": pid},
        timeout=timeout_s + 15)), daemon=True)
    t0 = time.monotonic()
    call.start()
    say(f"drain: proxy pid {pid} stops accepting; its requests in flight get up to {timeout_s:g}s")
    # The proxy ends the drain at the bound itself; the slack covers its answer.
    _progress(call.is_alive, lambda: _count(proxy_in_flight(cfg), "at the proxy"), t0, timeout_s, say, 15)
    status, body = answer[0] if answer else (None, "no answer")
    if status == 200 and isinstance(body, dict) and body.get("pid") == pid:
        cut = body["cut"]
        for c in cut:
            say(f"drain: cut request {c['request_id']} (trace {c['trace_id']}, {c['path']}) on {c['backend']}: "
                f"in flight for {c['age_s']}s, past the {timeout_s:g}s bound")
        say(f"drain: the proxy finished its requests in flight ({body['in_flight_at_start']} when it stopped "
            f"accepting) in {body['waited_s']}s" + (f", but {len(cut)}, cut at the {timeout_s:g}s bound "
                                                  "(named above)" if cut else ""))
        result = {"pid": pid, "in_flight": body["in_flight_at_start"], "waited_s": body["waited_s"], "cut": cut,
                  "cut_count": len(cut)}
    elif time.monotonic() - t0 < timeout_s:
        # A proxy started before this version has no drain call: SIGTERM makes it stop listening and
        # drain for its shutdown_timeout_s. Its requests are counted, not named.
        say(f"drain: proxy pid {pid} has no drain call ({status}); SIGTERM: it stops listening and drains")
        try:
            parts.signal_group(pgid, pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        t1 = time.monotonic()
        _progress(lambda: parts.alive(pid), lambda: _count(proxy_in_flight(cfg), "at the proxy"), t1,
                  timeout_s - (t1 - t0), say)
        left = proxy_in_flight(cfg) if parts.alive(pid) else 0
        if left:
            say(f"drain: {left} request(s) still in flight at the proxy after {timeout_s:g}s; the stop cuts them")
        result = {"pid": pid, "waited_s": round(time.monotonic() - t0, 2), "cut_count": left or 0}
    else:
        say(f"drain: the proxy did not answer its drain call ({body}); the stop goes on")
        result = {"pid": pid, "error": str(body), "waited_s": round(time.monotonic() - t0, 2), "cut_count": 0}
    _wait_gone(pid)
    return result


def drain_nginx(cfg: dict, pid: int, timeout_s: float, say) -> dict:
    if nginx_front.stop_watcher(cfg):
        say("drain: /health watcher stopped (it would reload a quitting nginx)")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGQUIT)
    say(f"drain: nginx pid {pid} quits gracefully: no new connections, its requests in flight get up to "
        f"{timeout_s:g}s")
    _progress(lambda: parts.alive(pid), lambda: _count(sum(running_at(cfg).values()), "at the instances"),
              t0, timeout_s, say)
    waited = round(time.monotonic() - t0, 2)
    if not parts.alive(pid):
        say(f"drain: nginx finished its requests and exited in {waited}s")
        return {"pid": pid, "waited_s": waited, "cut": [], "cut_count": 0}
    running = {b: n for b, n in running_at(cfg).items() if n}
    cut = [{"backend": b, "running": n} for b, n in sorted(running.items())]
    say(f"drain: nginx still had requests after {timeout_s:g}s: {sum(running.values())} running at the "
        "instances (" + (", ".join(f"{b}: {n}" for b, n in sorted(running.items())) or "none counted") +
        "); the stop cuts them")
    return {"pid": pid, "waited_s": waited, "cut": cut, "cut_count": sum(running.values())}


def engine_requests(base_url: str) -> int:
    """The requests the engine at base_url runs or queues now (vLLM's /metrics), 0 when unreadable."""
    answer = httpcall.get(base_url + "/metrics", timeout=2)
    if answer.status != 200:
        return 0
    found = exposition.samples(answer.text(), ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    return int(exposition.total(found, "vllm:num_requests_running", "vllm:num_requests_waiting") or 0)


def running_at(cfg: dict) -> dict[str, int]:
    """Backend -> the requests its engine runs or queues now, 0 when unreadable."""
    with ThreadPoolExecutor(max_workers=min(16, len(cfg["backends"]) or 1)) as pool:
        return dict(zip(cfg["backends"], pool.map(lambda b: engine_requests(f"http://{b}"), cfg["backends"])))


def _count(n: int | None, where: str) -> str:
    return f"{n} request(s) in flight {where}" if n is not None else f"requests in flight {where} unknown"


def _progress(going, describe, t0: float, bound_s: float, say, slack_s: float = 0.0) -> None:
    """While going(), up to bound_s + slack_s after t0, a line of progress a second."""
    next_line = t0 + PROGRESS_S
    while going() and time.monotonic() - t0 < bound_s + slack_s:
        time.sleep(0.05)
        now = time.monotonic()
        if now >= next_line and going():
            say(f"drain: {describe()}, {now - t0:.0f}s of {bound_s:g}s")
            next_line += PROGRESS_S


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    while parts.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
