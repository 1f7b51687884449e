"""Where things live under a host's deploy_dir, and the FLEET_TAG format: the one spelling of both.

Every path here is relative to deploy_dir (`path(deploy_dir, rel)` makes it absolute). Everyone asks
this module: the host agent, the probes and the control plane (the one host agent module `fleet` may
import). Standard library only, Python 3.6+, and no import of the rest of the package: it is bundled in
front of scripts sent on standard input, and runs beside `processes.py` when that runs as a script.

    run/      pid files (instance_<i>.pid, proxy.pid, keeper.pid, nginx.pid, ...), the launch each
              instance runs (instance_<i>.launch), the run lock, mode,
              the keeper's state, the runtime LoRA adapters' record, ipc/ (the engines' ZMQ sockets)
    logs/     vllm_<i>.log, proxy.log, req_results.log, keeper.log (+ rotated .1 ...)
    conf/     hostagent.json, proxy.yaml, nginx_front.json, nginx.conf, prometheus.yml, keepalived.conf
    bin/      start_cluster.sh, start_proxy.sh, stop_cluster.sh, boot.sh (what the boot hook runs),
              check_front.sh (keepalived's track script)
    lib/      the control plane's modules an engine imports (the sim's fleet.sim)
    sim-dev/  the sim accelerator's device files

The templates (fleet/templates) take every path from here too: fleet.render gives them this module as
`layout` and `at(rel)` for rel under deploy_dir; tests/test_render_paths.py holds them to it.

A tag is `FLEET_TAG=<deployment-id>/<instance>`, where instance is an index (`3`) or a part's name
(`proxy`, `keeper`, `nginx`, `nginx-watch`, `keepalived`).
"""
import os

RUN, LOGS, CONF, BIN = "run", "logs", "conf", "bin"
LIB, SIM_DEV = "lib", "sim-dev"
HOSTAGENT_CODE, PROXY_CODE = "hostagent", "proxy"       # the shipped code's directories

# run/
PROXY_PID = RUN + "/proxy.pid"
PROXY_NEXT_PID = RUN + "/proxy.next.pid"              # a zero-gap restart's new proxy, until it takes over
PROXY_WAITING = RUN + "/proxy.waiting"                # the new proxy waits for the port (swap-to-proxy)
KEEPER_PID = RUN + "/keeper.pid"
NGINX_PID = RUN + "/nginx.pid"                        # the record of nginx's master, written by the host agent
NGINX_MASTER_PID = RUN + "/nginx.master.pid"          # nginx's own pid file (a bare pid)
NGINX_WATCH_PID = RUN + "/nginx_watch.pid"
LOCK = RUN + "/fleet.lock"
BOOT_LOCK = RUN + "/boot.lock"                        # one bin/boot.sh at a time
MODE = RUN + "/mode"                                  # "proxy" or "nginx": who fronts the instances
KEEPER_STATE = RUN + "/keeper.json"
KEEPER_METRICS = RUN + "/keeper.prom"
LORA_ADAPTERS = RUN + "/lora_adapters.json"        # the runtime LoRA adapters to load again after a start
NGINX_UPSTREAM = RUN + "/nginx_upstream.conf"         # nginx's upstream servers, rewritten by the /health watcher
NGINX_KEYS = RUN + "/nginx_keys.conf"                 # the API keys as nginx's map (mode 0600)
NGINX_TEMP = RUN + "/nginx"                           # nginx's temporary files, unless nginx.temp_dir
# keepalived (vrrp.addresses): the record of its supervisor (hostagent vrrp-run, which runs keepalived as
# its child), and keepalived's own pid files (bare pids: its main process and its VRRP child)
KEEPALIVED_PID = RUN + "/keepalived.pid"
KEEPALIVED_MAIN_PID = RUN + "/keepalived.main.pid"
KEEPALIVED_VRRP_PID = RUN + "/keepalived.vrrp.pid"
# The engines' ZMQ IPC sockets (VLLM_RPC_BASE_PATH; vLLM's default is /tmp): mode 0700, removed by a whole
# stop. vLLM names each socket DIR/<uuid4>, and a Unix socket's path holds 107 bytes at most, so
# deploy_dir may be IPC_PATH_MAX - len("/run/ipc/") - 36 = 62 bytes long.
IPC_DIR = RUN + "/ipc"
IPC_SOCKET_NAME_BYTES = 36                            # str(uuid4())
IPC_PATH_MAX = 107                                    # sizeof(sockaddr_un.sun_path) - 1

# logs/
PROXY_LOG = LOGS + "/proxy.log"
RESULTS_LOG = LOGS + "/req_results.log"
KEEPER_LOG = LOGS + "/keeper.log"
KEEPER_OUT = LOGS + "/keeper.out"                     # the keeper's standard output and error
BOOT_LOG = LOGS + "/boot.log"                         # what bin/boot.sh did (at a reboot, and its watchdog)
# nginx mode's logs: here unless nginx.log_dir names another directory (the same file names there)
NGINX_ERROR_LOG = LOGS + "/nginx_error.log"
NGINX_ACCESS_LOG = LOGS + "/nginx_access.log"
NGINX_WATCH_LOG = LOGS + "/nginx_watch.log"
KEEPALIVED_LOG = LOGS + "/keepalived.log"             # keepalived's and its supervisor's lines

# conf/
HOSTAGENT_CONF = CONF + "/hostagent.json"
PROXY_CONF = CONF + "/proxy.yaml"
NGINX_FRONT_CONF = CONF + "/nginx_front.json"
NGINX_CONF = CONF + "/nginx.conf"
PROMETHEUS_CONF = CONF + "/prometheus.yml"            # scrape jobs for the operator's Prometheus (not run here)
KEEPALIVED_CONF = CONF + "/keepalived.conf"           # vrrp.addresses: this entry's VRRP instances

# bin/
START_CLUSTER = BIN + "/start_cluster.sh"
START_PROXY = BIN + "/start_proxy.sh"
STOP_CLUSTER = BIN + "/stop_cluster.sh"
BOOT = BIN + "/boot.sh"                               # the boot hook's script: the deployment back, as deploy starts it
CHECK_FRONT = BIN + "/check_front.sh"                 # keepalived's track script: the local front's /health
# start_cluster.sh's environment overrides that change what the proxy and the keeper expect (ports, slots,
# how many instances, the engine's flags). By hand only: the script refuses them while the keeper runs,
# and the toolkit's own runs of the script (deploy, the keeper, restart) clear them from its environment.
# ONLY and STAGGER_S change nothing the others rely on.
START_OVERRIDES = ("N", "BASE_PORT", "MAX_LEN", "MAX_SEQS", "EAGER", "BIND", "CPUS_PER_INSTANCE", "KVCACHE_GIB")

_INSTANCE_PID = ("instance_", ".pid")


# The per-instance paths take an index, or a shell variable that holds one (`$1` in start_cluster.sh).

def instance_pidfile(i):
    """run/instance_<i>.pid: instance i's identity record."""
    return "%s/%s%s%s" % (RUN, _INSTANCE_PID[0], i, _INSTANCE_PID[1])


def instance_ready(i):
    """run/instance_<i>.ready: the marker of an instance seen healthy since its start (a later 503 is a
    death, not loading)."""
    return "%s/instance_%s.ready" % (RUN, i)


def instance_launch(i):
    """run/instance_<i>.launch: the launch instance i was started with (JSON: its description as deploy
    rendered it, that description's digest, and the start_cluster.sh overrides set by hand), written by
    start_cluster.sh beside the pid file; deploy compares it with the launch it wants."""
    return "%s/instance_%s.launch" % (RUN, i)


def instance_log(i):
    """logs/vllm_<i>.log: instance i's engine log."""
    return "%s/vllm_%s.log" % (LOGS, i)


def env_setup_out(pid):
    """run/env_setup.<pid>.out: what a script's env_setup printed, kept aside (pid: the script's, `$$`)."""
    return "%s/env_setup.%s.out" % (RUN, pid)


def pidfile_instance(name):
    """The index of an instance pid file's name (`instance_3.pid` -> 3), None for any other name."""
    head, tail = _INSTANCE_PID
    middle = name[len(head):-len(tail)]
    if name.startswith(head) and name.endswith(tail) and middle.isdigit():
        return int(middle)
    return None


def ipc_socket_bytes(deploy_dir):
    """The length in bytes of the longest path vLLM gives an IPC socket of this deployment."""
    return len(path(deploy_dir, IPC_DIR).encode()) + 1 + IPC_SOCKET_NAME_BYTES


def path(deploy_dir, rel):
    """rel (one of this module's paths) under deploy_dir."""
    return os.path.join(deploy_dir, *rel.split("/"))


# --- where the host reaches its own listeners -----------------------------------------------------

# A bind address that means every address of the host: IPv4's wildcards, then IPv6's.
WILDCARDS_V4 = ("", "*", "0.0.0.0")
WILDCARDS_V6 = ("::", "[::]")


def local_address(bind):
    """Where the host itself reaches a port bound to `bind`: loopback for a wildcard (::1 for IPv6's),
    else bind itself (one address, brackets dropped)."""
    if bind in WILDCARDS_V4:
        return "127.0.0.1"
    if bind in WILDCARDS_V6:
        return "::1"
    return bind[1:-1] if bind.startswith("[") and bind.endswith("]") else bind


# --- the tag --------------------------------------------------------------------------------------

TAG_VAR = "FLEET_TAG"


def tag(deployment_id, instance):
    """The FLEET_TAG value of one part of a deployment: `<deployment-id>/<instance>` (an index or a name)."""
    return "%s/%s" % (deployment_id, instance)


def tag_prefix(deployment_id):
    """What every tag of the deployment starts with."""
    return tag(deployment_id, "")


def parse_tag(value):
    """(deployment_id, instance) of a tag, instance a string ("3", "proxy"); None when it is no tag."""
    if not value or "/" not in value:
        return None
    deployment_id, _, instance = value.rpartition("/")
    if not deployment_id or not instance:
        return None
    return deployment_id, instance


def tag_instance(value, deployment_id):
    """The instance index a tag names within deployment_id, None when it names none (another part, another
    deployment, no tag)."""
    parsed = parse_tag(value)
    if parsed is None or parsed[0] != deployment_id or not parsed[1].isdigit():
        return None
    return int(parsed[1])
