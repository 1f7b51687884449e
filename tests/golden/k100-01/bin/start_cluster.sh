#!/usr/bin/env bash
# Start the vllm instances of k100-01: instance i -> accelerator i -> port BASE_PORT+i.
# Rendered by vllm-fleet from inventory/hosts.yml; the next deploy overwrites edits.
# Usable by hand; these environment variables override the inventory:
#   N=4 ./start_cluster.sh          start instances 0..3 only
#   MAX_SEQS=1 ./start_cluster.sh   one sequence per instance (deterministic, for debugging)
#   BASE_PORT, MAX_LEN, EAGER=1, ONLY=i (just instance i), STAGGER_S, BIND (the engines' listen address)
# An instance whose port already listens is skipped, so running it again is harmless.
# While the deployment's keeper runs, these overrides (but ONLY and STAGGER_S) are refused (exit 5): the
# proxy's slots and ports and the keeper's restarts follow the inventory, so an override would make
# the engines disagree with them. Stop the keeper first (./bin/stop_cluster.sh --keeper) to debug.
set -u

DEPLOY_DIR=/data/aiops/vllm-fleet
FLEET_ID=k100-01-014e7873
# The host agent's Python runs each engine log's rotating writer (hostagent/logwriter.py).
PYTHON=python3
LOG_MAX_BYTES=104857600
LOG_BACKUPS=3


# record_identity FILE PID TAG: wait (briefly: setsid runs in the child) until PID leads its own session,
# then write its identity record, which every later signal is checked against: pid, process group,
# session, start time (field 22 of /proc/PID/stat: a reused pid has another) and FLEET_TAG.
record_identity() {
    local file=$1 pid=$2 tag=$3 tries=0 stat="" f=()
    while [ $tries -lt 100 ]; do
        { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || stat=""
        [ -n "$stat" ] || break
        read -r -a f <<<"${stat##*) }"            # f[0] is field 3 (state), f[3] field 6 (session)
        [ "${f[3]}" = "$pid" ] && break
        tries=$((tries + 1)); sleep 0.02
    done
    if [ ${#f[@]} -ge 20 ]; then
        echo "pid=$pid pgid=${f[2]} sid=${f[3]} start=${f[19]} tag=$tag" >"$file.tmp"
    else
        echo "pid=$pid tag=$tag" >"$file.tmp"       # it exited already: nothing left to prove
    fi
    mv -f "$file.tmp" "$file"
}

# recorded_alive FILE: the pid FILE records, when it still runs: that pid has the recorded start time (a
# reused pid has another) and is not a zombie; nothing (and false) otherwise.
recorded_alive() {
    local rec pid start stat f=()
    { read -r rec <"$1"; } 2>/dev/null || return 1
    case "$rec" in
        pid=*) pid=${rec#pid=}; pid=${pid%% *}
               start=$(grep -o 'start=[0-9]*' <<<"$rec" | cut -d= -f2) ;;
        *) return 1 ;;
    esac
    { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || return 1
    read -r -a f <<<"${stat##*) }"
    [ "${f[0]}" != Z ] && [ "${f[0]}" != X ] && [ -n "$start" ] && [ "${f[19]}" = "$start" ] && echo "$pid"
}

overrides=()
for name in N BASE_PORT MAX_LEN MAX_SEQS EAGER BIND CPUS_PER_INSTANCE KVCACHE_GIB; do
    [ -n "${!name:-}" ] && overrides+=("$name=${!name}")
done
if [ -n "${overrides[*]-}" ] && keeper=$(recorded_alive "$DEPLOY_DIR/run/keeper.pid"); then
    echo "${overrides[*]-} refused: this deployment's keeper (pid $keeper) runs, and it and the proxy follow the inventory, not the environment. To debug with it, stop the keeper first (./bin/stop_cluster.sh --keeper); to keep it, change the inventory and run inv deploy." >&2
    exit 5
fi

N="${N:-8}"
BASE_PORT="${BASE_PORT:-8002}"
MAX_LEN="${MAX_LEN:-8192}"
MAX_SEQS="${MAX_SEQS:-4}"
EAGER="${EAGER:-0}"
STAGGER_S="${STAGGER_S:-5}"
# Loopback unless another host's proxy fronts these instances (then the address it reaches): the proxy
# is the only door, and its API keys are not bypassed through base_port + i. Unquoted on purpose: the
# default is shell-quoted, and in this form the quotes are removed rather than kept (no expansion in it).
BIND=${BIND:-127.0.0.1}
ONLY="${ONLY:-}"

# The host's environment (env_setup from the inventory: shell code by design), run in this shell.
# Activation scripts (conda's among them) often read unset variables, so set -u is off around it. Its
# output is kept aside; when it fails, this script stops with its exit status and last lines instead of
# running whatever `vllm` or `python` comes first on the PATH.
mkdir -p "$DEPLOY_DIR/run" || exit 1
env_setup_out="$DEPLOY_DIR/run/env_setup.$$.out"
set +u
# env_setup's paths are the host's (often ~/...): shellcheck cannot follow them.
# shellcheck disable=SC1090,SC1091
{
source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve
} >"$env_setup_out" 2>&1 </dev/null
env_setup_rc=$?
set -u
if [ "$env_setup_rc" -ne 0 ]; then
    echo "env_setup failed (exit $env_setup_rc); its last lines:" >&2
    tail -n 5 "$env_setup_out" | sed 's/^/    /' >&2
    rm -f "$env_setup_out"
    exit "$env_setup_rc"
fi
rm -f "$env_setup_out"

ENGINE=(vllm serve /data/models/MiniCPM-V-4_5 --enable-prompt-tokens-details)
EXTRA_ARGS=(--trust-remote-code --limit-mm-per-prompt '{"image": 4}' --dtype bfloat16)
SERVED_NAME=MiniCPM-V-4_5
GPU_MEMORY_UTILIZATION=0.9

# Each instance's launch as the inventory wants it, and its digest (fleet/plan/launches.py): copied to the
# instance's launch record (beside its pid file) when it starts, with the overrides above that were set,
# so deploy sees what it runs and rolls a difference.
LAUNCH_OF=(
    '{"argv":["vllm","serve","/data/models/MiniCPM-V-4_5","--enable-prompt-tokens-details","--host","127.0.0.1","--port","8002","--max-num-seqs","4","--max-model-len","8192","--gpu-memory-utilization","0.9","--served-model-name=MiniCPM-V-4_5","--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"bind":"127.0.0.1","cards":[0],"enforce_eager":false,"engine_flags":[],"env":{"HIP_VISIBLE_DEVICES":"0"},"env_setup":"source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve","extra_args":["--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"gpu_memory_utilization":0.9,"group":"MiniCPM-V-4_5","max_model_len":8192,"max_num_seqs":4,"model":"/data/models/MiniCPM-V-4_5","port":8002,"served_names":["MiniCPM-V-4_5"]}'
    '{"argv":["vllm","serve","/data/models/MiniCPM-V-4_5","--enable-prompt-tokens-details","--host","127.0.0.1","--port","8003","--max-num-seqs","4","--max-model-len","8192","--gpu-memory-utilization","0.9","--served-model-name=MiniCPM-V-4_5","--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"bind":"127.0.0.1","cards":[1],"enforce_eager":false,"engine_flags":[],"env":{"HIP_VISIBLE_DEVICES":"1"},"env_setup":"source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve","extra_args":["--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"gpu_memory_utilization":0.9,"group":"MiniCPM-V-4_5","max_model_len":8192,"max_num_seqs":4,"model":"/data/models/MiniCPM-V-4_5","port":8003,"served_names":["MiniCPM-V-4_5"]}'
    '{"argv":["vllm","serve","/data/models/MiniCPM-V-4_5","--enable-prompt-tokens-details","--host","127.0.0.1","--port","8004","--max-num-seqs","4","--max-model-len","8192","--gpu-memory-utilization","0.9","--served-model-name=MiniCPM-V-4_5","--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"bind":"127.0.0.1","cards":[2],"enforce_eager":false,"engine_flags":[],"env":{"HIP_VISIBLE_DEVICES":"2"},"env_setup":"source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve","extra_args":["--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"gpu_memory_utilization":0.9,"group":"MiniCPM-V-4_5","max_model_len":8192,"max_num_seqs":4,"model":"/data/models/MiniCPM-V-4_5","port":8004,"served_names":["MiniCPM-V-4_5"]}'
    '{"argv":["vllm","serve","/data/models/MiniCPM-V-4_5","--enable-prompt-tokens-details","--host","127.0.0.1","--port","8005","--max-num-seqs","4","--max-model-len","8192","--gpu-memory-utilization","0.9","--served-model-name=MiniCPM-V-4_5","--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"bind":"127.0.0.1","cards":[3],"enforce_eager":false,"engine_flags":[],"env":{"HIP_VISIBLE_DEVICES":"3"},"env_setup":"source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve","extra_args":["--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"gpu_memory_utilization":0.9,"group":"MiniCPM-V-4_5","max_model_len":8192,"max_num_seqs":4,"model":"/data/models/MiniCPM-V-4_5","port":8005,"served_names":["MiniCPM-V-4_5"]}'
    '{"argv":["vllm","serve","/data/models/MiniCPM-V-4_5","--enable-prompt-tokens-details","--host","127.0.0.1","--port","8006","--max-num-seqs","4","--max-model-len","8192","--gpu-memory-utilization","0.9","--served-model-name=MiniCPM-V-4_5","--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"bind":"127.0.0.1","cards":[4],"enforce_eager":false,"engine_flags":[],"env":{"HIP_VISIBLE_DEVICES":"4"},"env_setup":"source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve","extra_args":["--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"gpu_memory_utilization":0.9,"group":"MiniCPM-V-4_5","max_model_len":8192,"max_num_seqs":4,"model":"/data/models/MiniCPM-V-4_5","port":8006,"served_names":["MiniCPM-V-4_5"]}'
    '{"argv":["vllm","serve","/data/models/MiniCPM-V-4_5","--enable-prompt-tokens-details","--host","127.0.0.1","--port","8007","--max-num-seqs","4","--max-model-len","8192","--gpu-memory-utilization","0.9","--served-model-name=MiniCPM-V-4_5","--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"bind":"127.0.0.1","cards":[5],"enforce_eager":false,"engine_flags":[],"env":{"HIP_VISIBLE_DEVICES":"5"},"env_setup":"source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve","extra_args":["--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"gpu_memory_utilization":0.9,"group":"MiniCPM-V-4_5","max_model_len":8192,"max_num_seqs":4,"model":"/data/models/MiniCPM-V-4_5","port":8007,"served_names":["MiniCPM-V-4_5"]}'
    '{"argv":["vllm","serve","/data/models/MiniCPM-V-4_5","--enable-prompt-tokens-details","--host","127.0.0.1","--port","8008","--max-num-seqs","4","--max-model-len","8192","--gpu-memory-utilization","0.9","--served-model-name=MiniCPM-V-4_5","--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"bind":"127.0.0.1","cards":[6],"enforce_eager":false,"engine_flags":[],"env":{"HIP_VISIBLE_DEVICES":"6"},"env_setup":"source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve","extra_args":["--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"gpu_memory_utilization":0.9,"group":"MiniCPM-V-4_5","max_model_len":8192,"max_num_seqs":4,"model":"/data/models/MiniCPM-V-4_5","port":8008,"served_names":["MiniCPM-V-4_5"]}'
    '{"argv":["vllm","serve","/data/models/MiniCPM-V-4_5","--enable-prompt-tokens-details","--host","127.0.0.1","--port","8009","--max-num-seqs","4","--max-model-len","8192","--gpu-memory-utilization","0.9","--served-model-name=MiniCPM-V-4_5","--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"bind":"127.0.0.1","cards":[7],"enforce_eager":false,"engine_flags":[],"env":{"HIP_VISIBLE_DEVICES":"7"},"env_setup":"source /opt/dtk/env.sh && source ~/miniconda3/bin/activate vllm-serve","extra_args":["--trust-remote-code","--limit-mm-per-prompt","{\"image\": 4}","--dtype","bfloat16"],"gpu_memory_utilization":0.9,"group":"MiniCPM-V-4_5","max_model_len":8192,"max_num_seqs":4,"model":"/data/models/MiniCPM-V-4_5","port":8009,"served_names":["MiniCPM-V-4_5"]}'
)
DIGEST_OF=(f85237e4bab8b975 14f6e96c18239312 5899ffd84bcd35ec dfd8a7f2aa1fcc65 6b486aa31e099941 1fae1674b0ee5a98 e94886b94694228c 3caa0b61c80f0e50)

# The engines' ZMQ IPC sockets: in the deployment's own directory (0700), not the world's /tmp; a whole
# stop removes it. Set after env_setup, so this deployment's directory is the one every instance uses.
export VLLM_RPC_BASE_PATH="$DEPLOY_DIR/run/ipc"
mkdir -p "$DEPLOY_DIR/run" && (umask 077 && mkdir -p "$DEPLOY_DIR/logs" "$VLLM_RPC_BASE_PATH") &&
    chmod 700 "$VLLM_RPC_BASE_PATH" || exit 1
command -v ss >/dev/null || { echo "ss not found: install iproute2" >&2; exit 3; }
command -v setsid >/dev/null || { echo "setsid not found: install util-linux" >&2; exit 3; }


# Instance $1's output, piped through the rotating writer into $2: the previous run's log becomes .1, and
# the file rotates at LOG_MAX_BYTES while the engine runs. Its own session (no stop of whoever ran this
# script takes it) and tag <id>/log-<i> (a stop of the deployment finds it; not the instance's own, whose
# members hold its card); it ignores SIGTERM and ends when the engine's output closes, after its last
# line. Its own output goes nowhere: it must not hold this script's (deploy reads that to its end).
log_writer() {
    FLEET_TAG="$FLEET_ID/log-$1" PYTHONPATH="$DEPLOY_DIR" exec setsid "$PYTHON" -m hostagent.logwriter "$2" \
        --max-bytes "$LOG_MAX_BYTES" --backups "$LOG_BACKUPS" --rotate-first >/dev/null 2>&1
}

# record_launch I FILE: instance I's launch record, {"digest", "overrides", "launch"}: the overrides are
# the ones set when this script started (NAME=value), each value escaped for JSON (backslash, double quote).
record_launch() {
    local pair value o=()
    for pair in ${overrides[@]+"${overrides[@]}"}; do
        value=${pair#*=}
        value=${value//\\/\\\\}
        value=${value//\"/\\\"}
        o+=("\"${pair%%=*}\":\"$value\"")
    done
    local IFS=,
    printf '{"digest":"%s","overrides":{%s},"launch":%s}\n' "${DIGEST_OF[$1]-none}" "${o[*]-}" \
        "${LAUNCH_OF[$1]-null}" >"$2.tmp" && mv -f "$2.tmp" "$2"
}

port_listening() {
    ss -ltnH 2>/dev/null | awk '{print $4}' | grep -Eq "[:.]$1\$"
}

start_instance() {
    local i=$1 port=$((BASE_PORT + $1)) log="$DEPLOY_DIR/logs/vllm_$1.log"
    local pidfile="$DEPLOY_DIR/run/instance_$1.pid"
    if port_listening "$port"; then
        echo "instance $i: port $port already listening, skipped"
        return 1
    fi
    rm -f "$DEPLOY_DIR/run/instance_$i.ready"
    # --served-model-name=NAME, one token: the flag takes one or more values, and in this form it takes
    # exactly one, so no extra argument after it can become another served name.
    local args=(--host "$BIND" --port "$port" --max-num-seqs "$MAX_SEQS" --max-model-len "$MAX_LEN")
    args+=(--gpu-memory-utilization "$GPU_MEMORY_UTILIZATION")
    args+=("--served-model-name=$SERVED_NAME")
    [ "$EAGER" = 1 ] && args+=(--enforce-eager)
    # setsid: the instance leads its own session (and group), where its spawned children stay: a stop
    # finds them by that session even when they are renamed, orphaned and without FLEET_TAG.
    # SPT_NOENV=1: vLLM renames EngineCore and Worker with setproctitle, which otherwise overwrites
    # the environment /proc/PID/environ shows, FLEET_TAG included.
    FLEET_TAG="$FLEET_ID/$i" SPT_NOENV=1 HIP_VISIBLE_DEVICES="$i" \
        setsid "${ENGINE[@]}" "${args[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} > >(log_writer "$i" "$log") 2>&1 </dev/null &
    local pid=$!
    record_identity "$pidfile" "$pid" "$FLEET_ID/$i"
    record_launch "$i" "$DEPLOY_DIR/run/instance_$i.launch"
    echo "instance $i: started pid $pid on port $port, accelerator $i, log $log"
    return 0
}

started=0
for ((i = 0; i < N; i++)); do
    [ -n "$ONLY" ] && [ "$ONLY" != "$i" ] && continue
    if [ $started -gt 0 ] && [ "$STAGGER_S" != 0 ]; then
        sleep "$STAGGER_S"   # staggered: 8 instances reading 17 GB at once saturate the disk
    fi
    start_instance "$i" && started=$((started + 1))
done
echo "started $started instance(s)"
