"""The benchmarks' stack: sim engines and every front before them, on free loopback ports, stopped by pid.

Fronts: `direct` (the sims themselves; `url` gives the first), `proxy` (conf/proxy.yaml as `inv render`
makes it: slots from max_num_seqs, the queue on), `proxy-lc` (the same with `slots: 0`: least connections
alone, as before the queue), `proxy-prefix` (the rendered config with `proxy.routing.policy=prefix` and
the `routing_set` overrides: the prefix-aware policy; `proxy-prefix-b` a second one, with its own ports and
index, as the backup entry's), `proxy-pair` (two proxies of the `proxy` config, on their own ports, each
the other's peer in `share`: active-active entries, each with its share of every backend's slots once it has
polled the other; `url("proxy-pair-b")` is the second's), `proxy-otel` (the `proxy` config with
`otlp.endpoint` set: every request's spans exported to a local sink that accepts and discards them),
`proxy-otel-down` (the same, its collector a loopback port nothing listens on, the export's timeout 300 s:
a collector that is down),
`proxy-w2` (the `proxy` config with `workers: 2`: a supervisor and two worker processes sharing the slots),
`proxy-prefix-w2` (the `proxy-prefix` config with `workers: 2`: the workers teach each other their routing),
`proxy-w2-plain` (`proxy-w2` with `resume.enabled: false`: streams pass as they come, no usage asked per event),
`proxy-base` (the `proxy` config served by the proxy of another checkout, `baseline`: the code before a
change, in the same run), `proxy-prefix-base` (the `proxy-prefix` config served by that checkout), `nginx` (conf/nginx.conf as rendered),
`proxy-tenants` (keys naming tenants, `proxy.tenants` set, the inventory's `proxy.queue.tenant_reserve`),
`proxy-tenants-0` and `proxy-tenants-2` (the same with a reserve of 0 and 2 slots),
`vllm-router` and `smg` with their default policy, `vllm-router-cache` and `smg-cache` with
`--policy cache_aware`, `vllm-router-p2` with `--policy power_of_two`, `vllm-router-random` with
`--policy random` (from bench/.venv-routers, made by bench/setup_routers.sh, or the PATH). A front whose program is missing is left out and said so.

The models form (`models:` in proxy.yaml, a pool per served model): `proxy-models` (the sims split in two
pools, the first half serving `m`, the rest `m2`) and `proxy-models-1` (one pool `m` of every sim, alias
`m2`); `pools` replaces those pools (front -> [{name, backends: [sim index, ...], aliases}]). Every sim
answers the names in `served` (default `m` alone); the models fronts need `m2` there too.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hostagent import nginx_front, processes, upstream  # noqa: E402

from fleet import render  # noqa: E402
from fleet.settings import inventory  # noqa: E402

# An OTLP/HTTP sink: takes every export and discards it (the empty body is an empty ExportTraceServiceResponse).
SINK = """import sys
from aiohttp import web
async def traces(request):
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")
app = web.Application(client_max_size=64 * 1024 * 1024)
app.router.add_post("/v1/traces", traces)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""
ROUTERS_BIN = Path(__file__).resolve().parent / ".venv-routers" / "bin"


def cpu_s(pid: int, waited_children: bool = False) -> float:
    """CPU seconds (user + system) pid has used so far, with its waited-for children's when asked (Linux
    /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15 if waited_children else 13]) / os.sysconf("SC_CLK_TCK")


def pid_of(pid_file: Path) -> int:
    """The pid a deployment's pid file records (run/proxy.pid, run/keeper.pid)."""
    rec, why = processes.read_record_file(str(pid_file))
    if rec is None:
        raise SystemExit(f"{pid_file}: {why or 'no such file'}")
    return rec["pid"]


def end_pid(pid: int) -> None:
    """SIGTERM pid (nginx's master: a daemon, not our child, proven by Stack.nginx_pid) and wait for it to
    go, SIGKILL after 10 s; pid 0 (not proven) is left alone."""
    if pid <= 0:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    return   # ended, not yet reaped by its parent
            except (OSError, IndexError):
                return
            time.sleep(0.05)


def run_inv(inventory: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    """`inv ARGS --inventory INVENTORY` from the checkout, its output captured."""
    return subprocess.run([sys.executable, "-m", "invoke", *args, "--inventory", str(inventory)], cwd=ROOT,
                          capture_output=True, text=True, **kw)


def free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports, below the kernel's ephemeral range (a port bind(0)
    hands out is also what the next outgoing connection may take before the server listens there)."""
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    top = lo if lo > 12000 else 65535
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(10000, top - n)
        if all(_free(base + i) for i in range(n)):
            return base
    raise SystemExit("bench: no run of free loopback ports found.")


def sim_inventory(path: Path, host: str, deploy_dir: Path, base: int, instances: int, **keys) -> Path:
    """Write an inventory of one local sim host at path: `instances` sims on cards 0.., ports from base,
    deploy_dir its own; keys add to or replace the host's (sim, proxy, keeper, max_num_seqs ...)."""
    spec = {"connection": "local", "engine": "sim", "accelerator": "sim", "accelerators": instances,
            "instances": instances, "base_port": base, "deploy_dir": str(deploy_dir), "stagger_s": 0, **keys}
    path.write_text(yaml.safe_dump({"hosts": {host: spec}}, sort_keys=False))
    return path


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=1).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"bench: {url} did not answer 200 within {timeout:g}s.")


def find_program(name: str) -> str | None:
    """A front's program: bench/.venv-routers/bin first, then the PATH (nginx: /usr/sbin too)."""
    local = ROUTERS_BIN / name
    if local.exists():
        return str(local)
    return shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)


def _no_sdk() -> str | None:
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
    except ImportError:
        return "the OpenTelemetry SDK is not installed (pip install -e '.[otel]')"
    return None


TENANT_KEY = "sk-{}"   # proxy-tenants' key of a tenant: clients send it as `Authorization: Bearer sk-NAME`


class Stack:
    """n sims and the fronts asked for, from rendered files in work/deploy; stop() ends them all by pid.

    sim_args: the sims' timing flags. max_num_seqs: each sim's, and the inventory's (the proxy's slots).
    tenants: `proxy-tenants`'s `tenants` section (default: app and batch, equal weights); its key file has
    one key per tenant, `sk-NAME NAME` (TENANT_KEY), and `sk-default` for the default tenant.
    front_preexec: run in each proxy's and nginx's process before it starts (bench_hostile.py: a login
    shell's open-file limit).
    """

    FRONTS = ("direct", "proxy", "proxy-tenants", "proxy-tenants-0", "proxy-tenants-2", "proxy-lc", "proxy-prefix",
              "proxy-prefix-b", "proxy-prefix-base", "proxy-pair", "proxy-pair-b", "proxy-asyncio", "proxy-models",
              "proxy-models-1", "proxy-otel", "proxy-otel-down", "proxy-base", "proxy-w2", "proxy-prefix-w2", "proxy-w2-plain", "nginx", "vllm-router",
              "vllm-router-cache", "vllm-router-p2", "vllm-router-random", "smg", "smg-cache")
    PROXIES = ("proxy", "proxy-tenants", "proxy-tenants-0", "proxy-tenants-2", "proxy-lc", "proxy-prefix",
               "proxy-prefix-b", "proxy-prefix-base", "proxy-pair", "proxy-pair-b", "proxy-asyncio", "proxy-models",
               "proxy-models-1", "proxy-otel", "proxy-otel-down", "proxy-base", "proxy-w2", "proxy-prefix-w2", "proxy-w2-plain")
    ROUTERS = {"vllm-router": None, "vllm-router-cache": "cache_aware", "vllm-router-p2": "power_of_two",
               "vllm-router-random": "random", "smg": None, "smg-cache": "cache_aware"}   # front -> its --policy (None: the default)

    def __init__(self, work: Path, backends: int, max_num_seqs: int, sim_args: list[str],
                 proxy_set: tuple[str, ...] = (), served: tuple[str, ...] = ("m",),
                 pools: dict[str, list[dict]] | None = None, routing_set: tuple[str, ...] = (),
                 baseline: Path | None = None, tenants: dict | None = None, front_preexec=None):
        self.work, self.deploy = work, work / "deploy"
        self.front_preexec = front_preexec
        self.baseline = baseline
        self.n, self.max_num_seqs, self.sim_args, self.served = backends, max_num_seqs, sim_args, served
        extra = len(self.FRONTS) + len(self.PROXIES) + len(self.ROUTERS) + 2   # a port each, two for the sinks
        base = free_ports(backends + extra)
        self.backend_ports = [base + i for i in range(backends)]
        spare = iter(range(base + backends, base + backends + extra))
        self.ports = {f: next(spare) for f in self.FRONTS if f != "direct"}
        self.admin_ports = {f: next(spare) for f in self.PROXIES}
        self.metrics_ports = {f: next(spare) for f in self.ROUTERS}
        self.sink_port = next(spare)   # proxy-otel's span sink
        self.down_port = next(spare)   # proxy-otel-down's collector: nothing listens there
        self.procs: list[subprocess.Popen] = []
        self.pids: dict[str, int] = {}
        self.router_pids: dict[str, int] = {}   # vllm-router's and smg's
        self.sim_pids: list[int] = []
        self.nginx_pid_file: Path | None = None
        self.skipped: dict[str, str] = {}
        inv_path = work / "hosts.yml"
        inv_path.write_text(textwrap.dedent(f"""\
            hosts:
              bench:
                connection: local
                engine: sim
                accelerator: sim
                accelerators: {backends}
                instances: {backends}
                max_num_seqs: {max_num_seqs}
                base_port: {base}
                deploy_dir: {self.deploy}
                proxy: {{port: {self.ports['proxy']}, admin_port: {self.admin_ports['proxy']}, bind: 127.0.0.1}}
            """))
        inv = inventory.load(inv_path)

        def rendered(*overrides: str) -> dict[str, str]:
            hv = inv.host_vars("bench", [*proxy_set, *overrides])
            hv.settings.python = sys.executable
            return {f.path: f.content for f in render.render_host(hv)}
        files = rendered()
        for d in ("conf", "logs", "run/nginx", "sim-dev"):
            (self.deploy / d).mkdir(parents=True, exist_ok=True)
        proxy_conf = yaml.safe_load(files["conf/proxy.yaml"])
        self.slots = proxy_conf["slots"]
        # proxy.routing as the inventory renders it (only written into proxy.yaml when not least_conn)
        self.routing = yaml.safe_load(rendered("proxy.routing.policy=prefix", *routing_set)["conf/proxy.yaml"]).get(
            "routing", {"policy": "prefix"})
        half = max(1, backends // 2)
        self.pools = {"proxy-models": [{"name": "m", "backends": list(range(half))},
                                       {"name": "m2", "backends": list(range(half, backends))}],
                      "proxy-models-1": [{"name": "m", "aliases": ["m2"], "backends": list(range(backends))}],
                      **(pools or {})}
        for front in self.PROXIES:
            conf = {**proxy_conf, "listen": {**proxy_conf["listen"], "port": self.ports[front]},
                    "admin": {**proxy_conf["admin"], "port": self.admin_ports[front]},
                    "results_log": {**proxy_conf["results_log"],
                                    "path": str(self.deploy / "logs" / f"req_results_{front}.log")}}
            if front == "proxy-lc":
                conf["slots"] = 0
            if front in ("proxy-prefix", "proxy-prefix-b", "proxy-prefix-base", "proxy-prefix-w2"):
                conf["routing"] = self.routing
            if front in ("proxy-pair", "proxy-pair-b"):
                pair = ["proxy-pair", "proxy-pair-b"]
                conf["share"] = {"me": pair.index(front), "entries": [
                    {"name": f, "weight": 1, "health": None if f == front else f"{self.url(f)}/health"} for f in pair]}
            if front in ("proxy-w2", "proxy-prefix-w2", "proxy-w2-plain"):
                conf["workers"] = 2
            if front == "proxy-w2-plain":   # streams passed as they come: not resumable, so no usage asked per event
                conf["resume"] = {**conf["resume"], "enabled": False}
            if front == "proxy-otel":
                conf["otlp"] = {"endpoint": f"http://127.0.0.1:{self.sink_port}/v1/traces"}
            if front == "proxy-otel-down":
                conf["otlp"] = {"endpoint": f"http://127.0.0.1:{self.down_port}/v1/traces", "timeout_s": 300}
            if front in ("proxy-tenants", "proxy-tenants-0", "proxy-tenants-2"):
                self.tenants = tenants or {"app": {}, "batch": {}}
                # proxy-tenants: the inventory's tenant_reserve; proxy-tenants-N: N (0: fully work-conserving)
                reserve = (int(front.rsplit("-", 1)[1]) if front[-1].isdigit()
                           else inv.host_vars("bench", list(proxy_set)).settings.proxy.queue.tenant_reserve)
                conf["queue"] = {**conf["queue"], "tenant_reserve": reserve}
                keys = self.deploy / "conf" / "api_keys"
                keys.write_text("".join(f"{TENANT_KEY.format(t)} {t}\n" for t in self.tenants)
                                + TENANT_KEY.format("default") + "\n")
                conf["api_keys_file"], conf["tenants"] = str(keys), self.tenants
            if front in self.pools:
                conf["models"] = [{**pool, "slots": self.slots,
                                   "backends": [conf["backends"][i] for i in pool["backends"]]}
                                  for pool in self.pools[front]]
            (self.deploy / "conf" / f"{front}.yaml").write_text(yaml.safe_dump(conf))
        (self.deploy / "conf" / "nginx.conf").write_text(
            rendered(f"proxy.port={self.ports['nginx']}")["conf/nginx.conf"])
        # nginx.conf includes the upstream list the /health watcher keeps: every backend up here.
        (self.deploy / "run" / "nginx_upstream.conf").write_text(
            upstream.render([f"127.0.0.1:{p}" for p in self.backend_ports], set(), 1, 5))

    def url(self, front: str) -> str:
        port = self.backend_ports[0] if front == "direct" else self.ports[front]
        return f"http://127.0.0.1:{port}"

    def _start(self, argv, log: str, **kw) -> subprocess.Popen:
        out = open(self.deploy / "logs" / log, "ab")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def start(self, fronts: list[str]) -> list[str]:
        """Start the sims and the fronts asked for; returns the fronts that run."""
        env = {**os.environ, "FLEET_SIM_DEV_DIR": str(self.deploy / "sim-dev")}
        env.pop("FLEET_TAG", None)
        for i, port in enumerate(self.backend_ports):
            self.sim_pids.append(self._start([sys.executable, "-m", "fleet.sim", "serve", "m", "--host", "127.0.0.1", "--port", str(port),
                         "--max-num-seqs", str(self.max_num_seqs), "--sim-load-s", "0",
                         "--served-model-name", *self.served, *self.sim_args],
                        f"sim_{i}.log", cwd=ROOT, env={**env, "SIM_VISIBLE_DEVICES": str(i)}).pid)
        for port in self.backend_ports:
            wait_http(f"http://127.0.0.1:{port}/health")
        running = []
        for front in fronts:
            how = getattr(self, "_start_" + front.replace("-", "_"))
            why = how()
            if why:
                self.skipped[front] = why
                print(f"bench: {front} left out: {why}", file=sys.stderr)
            else:
                running.append(front)
        return running

    def _start_direct(self):
        return None   # the sims themselves

    def cpu_s(self, front: str) -> float:
        """CPU seconds (user + system) a proxy front's process has used so far (Linux /proc)."""
        return cpu_s(self.pids[front])

    def children_cpu_s(self, front: str) -> float:
        """CPU seconds the live descendants of a proxy front have used so far: its workers, its span
        exporter (proxy.otlp_export), 0 when it has none. One that ended meanwhile takes its time with it."""
        return max(0.0, self.tree_cpu_s(front) - self.cpu_s(front))

    def tree_cpu_s(self, front: str) -> float:
        """CPU seconds a front's processes have used so far, every one of them: a proxy's and its children's
        (its workers, its span exporter), nginx's master's and workers', a router's; the sims' for `sims`,
        0 for `direct`. Processes that ended meanwhile take their time with them."""
        if front == "sims":
            roots = self.sim_pids
        elif front == "nginx":
            roots = [self.nginx_pid()] if self.nginx_pid_file else []
        else:
            roots = [pid for pid in (self.pids.get(front), self.router_pids.get(front)) if pid]
        snap = processes.snapshot()
        pids, grew = set(roots), True
        while grew:
            grew = False
            for p in snap.values():
                if p.ppid in pids and p.pid not in pids:
                    pids.add(p.pid)
                    grew = True
        total = 0.0
        for pid in pids:
            try:
                total += cpu_s(pid)
            except (OSError, IndexError):   # it ended meanwhile
                pass
        return total

    def _proxy(self, front: str, *extra: str, root: Path = ROOT):
        self.pids[front] = self._start([sys.executable, "-m", "proxy", "--config", str(self.deploy / "conf" / f"{front}.yaml"), *extra],
                    f"{front}.log", cwd=root, preexec_fn=self.front_preexec).pid
        wait_http(self.url(front) + "/health")

    def _start_proxy_otel(self):
        why = _no_sdk()
        if why:
            return why
        self._start([sys.executable, "-c", SINK, str(self.sink_port)], "otlp_sink.log")
        self._proxy("proxy-otel")

    def _start_proxy_otel_down(self):
        why = _no_sdk()
        if why:
            return why
        self._proxy("proxy-otel-down")

    def _start_proxy_base(self):
        if self.baseline is None:
            return "no --baseline checkout given"
        self._proxy("proxy-base", root=self.baseline)

    def _start_proxy_prefix_base(self):
        if self.baseline is None:
            return "no --baseline checkout given"
        self._proxy("proxy-prefix-base", root=self.baseline)

    def _start_proxy(self):
        self._proxy("proxy")

    def _start_proxy_tenants(self):
        self._proxy("proxy-tenants")

    def _start_proxy_tenants_0(self):
        self._proxy("proxy-tenants-0")

    def _start_proxy_tenants_2(self):
        self._proxy("proxy-tenants-2")

    def set_tenants(self, tenants: dict) -> None:
        """Give `proxy-tenants` another `tenants` section (the same names), by a reload."""
        path = self.deploy / "conf" / "proxy-tenants.yaml"
        conf = yaml.safe_load(path.read_text())
        conf["tenants"] = tenants
        path.write_text(yaml.safe_dump(conf))
        req = urllib.request.Request(self.admin_url("proxy-tenants") + "/admin/reload", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["reloaded"], "proxy-tenants refused its new tenants"

    def _start_proxy_lc(self):
        self._proxy("proxy-lc")

    def _start_proxy_prefix(self):
        self._proxy("proxy-prefix")

    def _start_proxy_prefix_b(self):
        self._proxy("proxy-prefix-b")

    def _start_proxy_pair(self):
        self._proxy("proxy-pair")
        self._proxy("proxy-pair-b")
        want = str(max(1, self.max_num_seqs // 2))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = [json.loads(urllib.request.urlopen(self.admin_url(f) + "/admin/config", timeout=5).read())
                   ["share"]["slots"] for f in ("proxy-pair", "proxy-pair-b")]
            if got == [want, want]:
                return None
            time.sleep(0.1)
        raise SystemExit(f"bench: proxy-pair did not reach {want} slots each within 30 s")

    def _start_proxy_w2(self):
        self._proxy("proxy-w2")

    def _start_proxy_prefix_w2(self):
        self._proxy("proxy-prefix-w2")

    def _start_proxy_w2_plain(self):
        self._proxy("proxy-w2-plain")

    def _start_proxy_asyncio(self):
        self._proxy("proxy-asyncio", "--loop", "asyncio")

    def _start_proxy_models(self):
        self._proxy("proxy-models")

    def _start_proxy_models_1(self):
        self._proxy("proxy-models-1")

    def admin_url(self, front: str) -> str:
        return f"http://127.0.0.1:{self.admin_ports[front]}"

    def _start_nginx(self):
        nginx = find_program("nginx")
        if not nginx:
            return "nginx is not installed (Debian package nginx)"
        argv = [nginx, "-p", str(self.deploy), "-c", str(self.deploy / "conf" / "nginx.conf")]
        user = nginx_front.worker_user({"deploy_dir": str(self.deploy)})
        if user:   # as root, workers of deploy_dir's owner, as hostagent starts them (`nobody` cannot reach /tmp/...)
            argv += ["-g", f"user {user};"]
        check = subprocess.run([*argv, "-t", "-q"], capture_output=True, text=True)
        if check.returncode != 0:
            raise SystemExit(f"bench: nginx -t refused the rendered config: {check.stderr.strip()}")
        subprocess.run(argv, check=True, preexec_fn=self.front_preexec)
        self.nginx_pid_file = self.deploy / "run" / "nginx.master.pid"   # nginx's own
        wait_http(self.url("nginx") + "/health")   # open with API keys on, as /v1/models is not

    def _workers(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.backend_ports]

    def _router(self, front: str, program: str, *argv: str):
        prog = find_program(program)
        if not prog:
            return "not installed; run bench/setup_routers.sh"
        policy = self.ROUTERS[front]
        self.router_pids[front] = self._start([prog, *argv, "--host", "127.0.0.1", "--port", str(self.ports[front]),
                     "--worker-urls", *self._workers(), "--prometheus-host", "127.0.0.1",
                     "--prometheus-port", str(self.metrics_ports[front]),
                     *(["--policy", policy] if policy else []),
                     "--log-level", "warning" if program == "vllm-router" else "warn"],
                    f"{front}.log").pid
        wait_http(self.url(front) + "/v1/models", timeout=60)

    def _start_vllm_router(self):
        return self._router("vllm-router", "vllm-router")

    def _start_vllm_router_cache(self):
        return self._router("vllm-router-cache", "vllm-router")

    def _start_vllm_router_p2(self):
        return self._router("vllm-router-p2", "vllm-router")

    def _start_vllm_router_random(self):
        return self._router("vllm-router-random", "vllm-router")

    def _start_smg(self):
        return self._router("smg", "smg", "launch")

    def _start_smg_cache(self):
        return self._router("smg-cache", "smg", "launch")

    def sim_stats(self) -> list[dict]:
        """Each sim's /sim/stats (peak_in_flight: the most requests it held at once)."""
        import json
        out = []
        for p in self.backend_ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats", timeout=5) as r:
                out.append(json.loads(r.read()))
        return out

    def reset_sim_stats(self) -> None:
        for p in self.backend_ports:
            req = urllib.request.Request(f"http://127.0.0.1:{p}/sim/reset-stats", method="POST", data=b"")
            urllib.request.urlopen(req, timeout=5).read()

    def restart(self, front: str) -> None:
        """Stop one proxy front or nginx by its pid (SIGTERM, SIGKILL after 10 s) and start it again."""
        if front == "nginx":
            end_pid(self.nginx_pid())
            self._start_nginx()
        else:
            proc = next(p for p in self.procs if p.pid == self.pids[front])
            os.killpg(proc.pid, signal.SIGTERM)
            _reap(proc)
            self.procs.remove(proc)
            getattr(self, "_start_" + front.replace("-", "_"))()

    def nginx_pid(self) -> int:
        """nginx's master pid, from its own pid file; 0 when that pid is not an nginx master of this user's
        (a stale file whose number was handed out again: nothing is signalled then)."""
        pid = int(self.nginx_pid_file.read_text().split()[0])
        try:
            ours = Path(f"/proc/{pid}").stat().st_uid == os.getuid()
            master = Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"nginx: master process")
        except OSError:
            return 0
        return pid if ours and master else 0

    def stop(self) -> None:
        if self.nginx_pid_file and self.nginx_pid_file.exists():
            try:
                pid = self.nginx_pid()
                if pid:
                    os.kill(pid, signal.SIGQUIT)
            except (ProcessLookupError, ValueError):
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            _reap(p)


def _reap(p: subprocess.Popen) -> None:
    """Wait for p (SIGTERMed) to end; SIGKILL its group after 10 s."""
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)
