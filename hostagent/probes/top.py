"""The live view's sampler (`inv top`), run on the host as `python3 -c SOURCE SPEC_JSON` (bundled with the
host agent modules it imports, fleet.transport.hostcode): every `interval_s` it prints one JSON line, a frame of
what the host is doing now, until `count` frames are out (0: until its output is closed).

A frame holds each instance's state (hostagent.instances.classify, as `inv status` reads it) and the samples
of its engine's /metrics that the view uses, the proxy's samples (each `[name, labels, value]`, parsed
here by hostagent.exposition: the control plane reads numbers, never exposition text), which front runs, the
keeper's record, and at most every `smi_every_s` (never under 2 s) what the accelerator's smi printed.
A source that cannot be read is named in the frame's `errors`; the others are read all the same.
Standard library only, Python 3.6+; it reads and changes nothing on the host (no ready marker written).
"""
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hostagent import exposition, httpcall, instances, layout
from hostagent.observe import (
    HEALTH_TIMEOUT_S,
    alive,
    instance_facts,
    keeper_facts,
    nginx_facts,
    read_mode,
    read_pidfile,
)

# The series the view reads; the rest of an engine's /metrics (vLLM's runs to ~100 KiB) stays on the host.
ENGINE_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket")
PROXY_SERIES = ("proxy_backend_in_flight", "proxy_backend_slots", "proxy_backend_healthy", "proxy_backend_drained",
                "proxy_queue_length", "proxy_requests_total", "proxy_tenant_in_flight", "proxy_tenant_queue_length",
                "proxy_tenant_weight", "proxy_tenant_requests_total", "proxy_tenant_limited_total",
                "proxy_tenant_queue_wait_seconds_bucket")
MIN_SMI_EVERY_S = 2.0
METRICS_TIMEOUT_S = 2.0


def scrape(url, names):
    """(samples, None) of GET url's /metrics, the metrics of names only, or (None, why) when it cannot be
    read."""
    answer = httpcall.get(url + "/metrics", METRICS_TIMEOUT_S)
    if answer.status != 200:
        return None, "%s/metrics: %s" % (url, answer.error or "HTTP %d" % answer.status)
    return exposition.samples(answer.text(), names), None


def read_instance(spec, inst):
    d, dep = spec["deploy_dir"], spec["deployment_id"]
    f = instance_facts(d, dep, inst["index"], inst["port"], True, inst.get("address") or "127.0.0.1",
                       float(spec.get("health_timeout_s", HEALTH_TIMEOUT_S)))
    out = {"index": inst["index"], "state": f["state"], "reason": f["reason"], "health": f["health"],
           "pid": f["pid"], "metrics": None, "error": None}
    if f["state"] == "healthy":     # a loading or dying engine's /metrics is no news: its state says it
        out["metrics"], out["error"] = scrape(instances.url(inst), ENGINE_SERIES)
    return out


def read_proxy(spec):
    d, dep = spec["deploy_dir"], spec["deployment_id"]
    pid, _, _, stale = read_pidfile(layout.path(d, layout.PROXY_PID), layout.tag(dep, "proxy"))
    up = stale is None and alive(pid)
    out = {"alive": up, "metrics": None, "error": None}
    if up:
        # its public port, where /metrics is: loopback unless proxy.bind is one address
        where = {"address": spec.get("proxy_address"), "port": spec["proxy_port"]}
        out["metrics"], out["error"] = scrape(instances.url(where), PROXY_SERIES)
    return out


def read_smi(command):
    try:
        r = subprocess.run(["bash", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=10, universal_newlines=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"rc": None, "out": "", "err": str(e)}
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr[-2000:]}


def frame(spec, pool, with_smi):
    d, dep = spec["deploy_dir"], spec["deployment_id"]
    t0 = time.time()
    insts = [pool.submit(read_instance, spec, inst) for inst in spec["instances"]]
    prox = pool.submit(read_proxy, spec)
    smi = pool.submit(read_smi, spec["smi"]) if with_smi else None
    keeper = keeper_facts(d, dep, log_tails=False)   # the view shows no log: none read each second
    state = keeper["state"] if isinstance(keeper["state"], dict) else {}
    out = {"t": t0, "mode": read_mode(d), "nginx": nginx_facts(d, dep)["alive"],
           "keeper": {"alive": keeper["alive"], "state": state.get("state"), "restarting": state.get("restarting"),
                      "lock_held": state.get("lock_held"), "instances": state.get("instances") or {}},
           "instances": [f.result() for f in insts], "proxy": prox.result()}
    if smi is not None:
        out["smi"] = smi.result()
    return out


def exit_at_eof():
    """The view keeps this sampler's standard input open while it runs: its end (the view quit, or its SSH
    session closed) ends the sampler at once, not at its next write."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    os._exit(0)


def main():
    spec = json.loads(sys.argv[1])
    if spec.get("exit_at_eof"):
        threading.Thread(target=exit_at_eof, daemon=True).start()
    interval = max(0.2, float(spec.get("interval_s", 1.0)))
    count = int(spec.get("count", 0))
    smi_every = max(MIN_SMI_EVERY_S, float(spec.get("smi_every_s", MIN_SMI_EVERY_S)))
    last_smi = None
    n = 0
    with ThreadPoolExecutor(max_workers=min(32, len(spec["instances"]) + 2)) as pool:
        while True:
            start = time.monotonic()
            with_smi = bool(spec.get("smi")) and (last_smi is None or start - last_smi >= smi_every)
            if with_smi:
                last_smi = start
            line = json.dumps(frame(spec, pool, with_smi))
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, OSError):     # the view went away: so does its sampler
                os._exit(0)
            n += 1
            if count and n >= count:
                return
            time.sleep(max(0.0, interval - (time.monotonic() - start)))


if __name__ == "__main__":
    main()
