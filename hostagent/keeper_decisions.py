"""The keeper's decisions: a pure function of what it knows of an instance, what it observed this round,
and the time. No clock, file or HTTP call here: the keeper (hostagent/keeper.py) gathers `Observed`,
calls `decide`, and carries out the actions it returns; the tests drive `decide` on plain data.

An instance's state is `instances.classify`'s, the same function `inv status` uses; on top of it the
keeper waits dead_after_s before it calls an unhealthy instance dead, adds "stalled" (its stall probe timed
out probe_failures times in a row while /health said 200 and no token was generated), backs off, and
stops at a crash loop. Times: `now` is a monotonic clock (waits), `wall` the wall clock (the restarts in
window_s, kept across keeper restarts in run/keeper.json).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from . import instances

REASONS = instances.REASONS + ("stalled",)
PROBE_RESULTS = ("ok", "busy", "timeout", "error")


# --- what the keeper observed of one instance, and what it decides to do -----------------------------

@dataclass
class Observed:
    """One instance as read this round."""
    identity: tuple | None            # (pid file text, mtime in ns): one start; None: no pid file (stopped)
    alive: bool = False               # the process the pid file records runs, and still is that one
    health: int | None = None         # GET /health status, None: no answer
    listening: bool = False           # something answers on its port (read when it is not alive)
    ready: bool = False               # run/instance_<i>.ready: it was healthy since this start
    age_s: float = 0.0                # seconds since the pid file was written
    drained: bool = False             # the operator drained its backend in the proxy
    probing: bool = False             # a stall probe is in flight
    probe: tuple | None = None        # a stall probe's outcome since last round: (answer, tokens before, after)


@dataclass(frozen=True)
class Log:
    level: str                        # "info", "warning", "error"
    message: str


@dataclass(frozen=True)
class MarkReady:
    """Healthy for the first time since its start: write run/instance_<i>.ready (as `inv status` does)."""
    index: int


@dataclass(frozen=True)
class Probe:
    """Send one stall probe (in the background: its outcome comes back as Observed.probe)."""
    index: int


@dataclass(frozen=True)
class Restart:
    """Restart the instance, under the run lock (none taken: `lock_refused`; taken: `begin_restart`)."""
    index: int
    reason: str


@dataclass(frozen=True)
class Crashloop:
    """Dead again after max_restarts within window_s: say so loudly, with the engine log's last lines."""
    index: int
    reason: str
    restarts: int


# --- what the keeper knows of one instance ------------------------------------------------------

@dataclass
class Watch:
    index: int
    identity: tuple | None = None
    healthy_once: bool = False
    unhealthy_since: float | None = None
    probe_failures: int = 0
    next_probe: float = 0.0
    dead_reason: str | None = None
    restart_at: float | None = None        # monotonic time of the next restart (backoff)
    state: str = "unknown"
    recent: list = field(default_factory=list)     # wall times of the restarts within window_s
    restarts: int = 0
    by_reason: dict = field(default_factory=dict)
    last_reason: str | None = None
    last_at: float | None = None
    last_result: str | None = None
    crashloop: bool = False
    crashloop_identity: list | None = None
    probes: dict = field(default_factory=dict)

    @classmethod
    def restore(cls, index: int, saved: dict | None = None) -> "Watch":
        """A watch carried over from run/keeper.json (restarts, crash loop, probes counted)."""
        saved = saved or {}
        return cls(index, recent=list(saved.get("recent", [])), restarts=int(saved.get("restarts", 0)),
                   by_reason=dict(saved.get("by_reason", {})), last_reason=saved.get("last_reason"),
                   last_at=saved.get("last_at"), last_result=saved.get("last_result"),
                   crashloop=bool(saved.get("crashloop")), crashloop_identity=saved.get("crashloop_identity"),
                   probes=dict(saved.get("probes", {})))

    def record(self, now: float) -> dict:
        """What run/keeper.json keeps of it (read by `inv status`)."""
        left = None if self.restart_at is None else round(max(0.0, self.restart_at - now), 1)
        return {"state": self.state, "restarts": self.restarts, "by_reason": self.by_reason,
                "last_reason": self.last_reason, "last_at": self.last_at, "last_result": self.last_result,
                "recent": self.recent, "crashloop": self.crashloop,
                "crashloop_identity": list(self.crashloop_identity) if self.crashloop_identity else None,
                "dead_reason": self.dead_reason, "restart_in_s": left, "probe_failures": self.probe_failures,
                "probes": self.probes}


def _new_start(w: Watch, identity) -> None:
    w.identity = identity
    w.healthy_once = False
    w.unhealthy_since = None
    w.probe_failures = 0
    w.dead_reason = None
    w.restart_at = None


def probe_result(answer: str, before: float | None, after: float | None) -> str:
    """ok, error (an answer, so no stall: /health says the rest), busy (timed out while the engine's
    generated-token counter moved: queued behind long requests) or timeout."""
    if answer != "timeout":
        return answer
    return "busy" if before is not None and after is not None and after > before else "timeout"


# --- the decisions ------------------------------------------------------------------------------

def decide(w: Watch, obs: Observed, now: float, wall: float, k: dict, health_timeout_s: float,
           busy: bool = False) -> tuple[Watch, list]:
    """(what the keeper knows of the instance after this round, the actions to carry out).

    k: the keeper's settings (dead_after_s, backoff_base_s, backoff_max_s, max_restarts, window_s,
    stall_probe, probe_interval_s, probe_failures); busy: another instance is being restarted (one at a
    time)."""
    w = copy.deepcopy(w)
    acts: list = []
    if obs.probe is not None:
        result = probe_result(*obs.probe)
        w.probes[result] = w.probes.get(result, 0) + 1
        if result == "timeout":
            w.probe_failures += 1
            acts.append(Log("warning", f"instance {w.index}: stall probe timed out ({w.probe_failures}/"
                            f"{k['probe_failures']}) with /health 200 and no token generated"))
        elif result in ("ok", "busy"):
            w.probe_failures = 0
    if obs.identity is None:
        w.state, w.identity = "stopped", None
        w.dead_reason = w.restart_at = None
        return w, acts
    if obs.identity != w.identity:
        if w.crashloop and w.crashloop_identity is not None and list(obs.identity) != list(w.crashloop_identity):
            acts.append(Log("warning", f"instance {w.index}: started by someone else (inv restart or deploy): "
                            "crashloop cleared"))
            w.crashloop, w.crashloop_identity, w.recent = False, None, []
        _new_start(w, obs.identity)
        w.healthy_once = obs.ready
    state, why = instances.classify(obs.alive, True, obs.health, w.healthy_once, obs.age_s, health_timeout_s,
                                    obs.listening)
    reason = None
    if state == "healthy":
        if not w.healthy_once:
            acts.append(MarkReady(w.index))
        w.healthy_once, w.unhealthy_since = True, None
        if w.probe_failures >= k["probe_failures"]:
            reason = "stalled"
        elif k["stall_probe"] and not obs.probing and now >= w.next_probe:
            w.next_probe = now + k["probe_interval_s"]
            acts.append(Probe(w.index))
    elif why == "unhealthy":          # healthy once since its start: dead only after dead_after_s of it
        w.unhealthy_since = now if w.unhealthy_since is None else w.unhealthy_since
        if now - w.unhealthy_since >= k["dead_after_s"]:
            reason = "unhealthy"
    else:
        reason = why                  # exited, start-timeout, or None while loading
    if reason is None:
        if w.dead_reason is not None:
            acts.append(Log("info", f"instance {w.index}: recovered before its restart"))
        w.dead_reason = w.restart_at = None
        w.state = "healthy" if state == "healthy" else ("unhealthy" if w.healthy_once else "loading")
        if obs.drained:
            w.state += ", drained"
        return w, acts
    return w, acts + _dead(w, reason, obs.drained, now, wall, k, busy)


def _dead(w: Watch, reason: str, drained: bool, now: float, wall: float, k: dict, busy: bool) -> list:
    if w.crashloop:
        w.state = "crashloop"
        return []
    if drained:
        w.state = f"dead ({reason}), drained by the operator: left alone"
        return []
    acts: list = []
    if w.dead_reason is None:
        w.dead_reason = reason
        w.recent = [t for t in w.recent if t >= wall - k["window_s"]]
        if len(w.recent) >= k["max_restarts"]:
            w.crashloop, w.crashloop_identity, w.state = True, w.identity, "crashloop"
            return [Crashloop(w.index, reason, len(w.recent))]
        wait = min(k["backoff_max_s"], k["backoff_base_s"] * 2 ** len(w.recent))
        w.restart_at = now + wait
        acts.append(Log("warning", f"instance {w.index}: dead ({reason}); restart {len(w.recent) + 1} in {wait:g}s"))
    w.state = f"dead ({w.dead_reason}), restart in {max(0.0, w.restart_at - now):.0f}s"
    if now < w.restart_at or busy:
        return acts
    w.state = "restarting"
    return acts + [Restart(w.index, w.dead_reason)]


def lock_refused(w: Watch) -> Watch:
    """A restart found the run lock held (deploy, stop, restart or swap): nothing done, tried next round."""
    w = copy.deepcopy(w)
    w.state = f"dead ({w.dead_reason}), waiting: the run lock is held (deploy, stop, restart or swap)"
    return w


def begin_restart(w: Watch, wall: float) -> Watch:
    """The keeper holds the run lock and restarts the instance: one more restart counted."""
    w = copy.deepcopy(w)
    w.recent.append(wall)
    w.restarts += 1
    w.by_reason[w.dead_reason] = w.by_reason.get(w.dead_reason, 0) + 1
    w.last_reason, w.last_at = w.dead_reason, wall
    return w


def end_restart(w: Watch, result: str, identity, now: float, k: dict) -> Watch:
    """The restart ended (result: "ok", "failed: ...", "cancelled ..."): what it started is a new start."""
    w = copy.deepcopy(w)
    w.last_result = result
    _new_start(w, identity)
    w.next_probe = now + k["probe_interval_s"]
    return w
