#!/usr/bin/env bash
# Stop the deployment of k100-01: the proxy and every instance, by process group, then every
# process of this user still carrying the deployment's FLEET_TAG (vLLM's spawned EngineCore children
# have no port and no "vllm" in their command line; the tag is how they are found).
# Rendered by vllm-fleet from inventory/hosts.yml; the next deploy overwrites edits.
#   ./stop_cluster.sh                 everything
#   ./stop_cluster.sh --instance 3    instance 3 only (its group and its tag)
#   ./stop_cluster.sh --keeper        the keeper only (it restarts dead instances)
#   ./stop_cluster.sh --check         list what would be stopped, stop nothing
# Nothing is killed by a name pattern, and nothing of another user.
set -u

DEPLOY_DIR=/data/aiops/vllm-fleet
FLEET_ID=k100-01-014e7873
GRACE_S="${GRACE_S:-10}"
N=8
BASE_PORT=8002

only="" proxy=1 check=0
while [ $# -gt 0 ]; do
    case "$1" in
        --instance) only="$2"; proxy=0; shift 2 ;;
        --proxy) only="none"; shift ;;
        --keeper) only="keeper"; proxy=0; shift ;;
        --check) check=1; shift ;;
        *) echo "usage: $0 [--instance I | --proxy | --keeper] [--check]" >&2; exit 64 ;;
    esac
done

# This script and its ancestors: never signalled, whatever they carry.
ancestors=" "
p=$$
while [ -n "$p" ] && [ "$p" -gt 0 ] 2>/dev/null; do
    ancestors+="$p "
    p=$(awk '/^PPid:/ { print $2 }' "/proc/$p/status" 2>/dev/null)
done
spared() { case "$ancestors" in *" $1 "*) return 0 ;; esac; [ "$1" = "${BASHPID:-$$}" ]; }

# Processes of this user whose environment holds FLEET_TAG=<prefix>... (exact when $2 = exact).
tagged_pids() {
    local prefix=$1 exact=${2:-} d p kv
    for d in /proc/[0-9]*; do
        p=${d#/proc/}
        spared "$p" && continue
        [ -O "$d" ] || continue
        while IFS= read -r -d '' kv; do
            case "$kv" in
                "FLEET_TAG=$prefix") echo "$p"; break ;;
                "FLEET_TAG=$prefix"*) [ -z "$exact" ] && echo "$p"; break ;;
                FLEET_TAG=*) break ;;
            esac
        done <"$d/environ" 2>/dev/null
    done
}

# Alive means existing and not a zombie: an exited process nobody has reaped yet answers kill -0.
pid_alive() {
    local s
    s=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
    [ -n "$s" ] && [ "$s" != Z ] && [ "$s" != X ]
}
group_alive() { ps -e -o pgid=,stat= 2>/dev/null | awk -v g="$1" '$1 == g && $2 !~ /^[ZX]/ { f = 1 } END { exit !f }'; }

# Wait up to $2 seconds (0.2 s ticks) until none of the pids in $1 is alive.
wait_gone() {
    local pids=$1 ticks=0 limit p any
    limit=$(awk -v g="$2" 'BEGIN { printf "%d", g * 5 }')
    while [ $ticks -lt "$limit" ]; do
        any=0
        for p in $pids; do pid_alive "$p" && any=1; done
        [ $any = 0 ] && return 0
        sleep 0.2; ticks=$((ticks + 1))
    done
    return 1
}


# SIGTERM every process group given as "what:pgid" at once, wait up to GRACE_S for them all, then
# SIGKILL what is left: eight instances stop in one grace period, not eight.
stop_groups() {
    local item ticks=0 limit live=() still
    limit=$(awk -v g="$GRACE_S" 'BEGIN { printf "%d", g * 5 }')   # 0.2 s ticks
    for item in "$@"; do
        if ! group_alive "${item##*:}"; then
            echo "${item%:*}: process group ${item##*:} already gone"
        elif [ $check = 1 ]; then
            echo "${item%:*}: would stop process group ${item##*:}"
        else
            kill -TERM -- "-${item##*:}" 2>/dev/null
            live+=("$item")
        fi
    done
    while [ ${#live[@]} -gt 0 ]; do
        still=()
        for item in "${live[@]}"; do
            if group_alive "${item##*:}"; then
                still+=("$item")
            else
                echo "${item%:*}: process group ${item##*:} stopped"
            fi
        done
        live=(${still[@]+"${still[@]}"})
        [ ${#live[@]} -gt 0 ] && [ $ticks -ge "$limit" ] && break
        [ ${#live[@]} -gt 0 ] && { sleep 0.2; ticks=$((ticks + 1)); }
    done
    for item in ${live[@]+"${live[@]}"}; do
        kill -KILL -- "-${item##*:}" 2>/dev/null
        echo "${item%:*}: process group ${item##*:} killed (SIGKILL after ${GRACE_S}s)"
    done
}

# Stop the process groups recorded in the pid files given as "what=pidfile", then remove the files.
stop_pidfiles() {
    local item pid pgid groups=() files=()
    for item in "$@"; do
        [ -f "${item#*=}" ] || continue
        read -r pid pgid <"${item#*=}"
        groups+=("${item%%=*}:${pgid:-$pid}")
        files+=("${item#*=}")
    done
    [ ${#groups[@]} -gt 0 ] || return 0
    stop_groups "${groups[@]}"
    if [ $check = 0 ]; then
        for item in "${files[@]}"; do rm -f "$item" "${item%.pid}.ready"; done
    fi
}

if [ "$only" = none ]; then
    stop_pidfiles "proxy=$DEPLOY_DIR/run/proxy.pid"
    exit 0
fi
# The keeper first, and alone: once it is gone, nothing restarts what this stop takes down (a restart
# it had begun is cancelled; what it started already carries the tag and is swept below).
if [ $proxy = 1 ] || [ "$only" = keeper ]; then
    stop_pidfiles "keeper=$DEPLOY_DIR/run/keeper.pid"
    [ "$only" = keeper ] && exit 0
fi
targets=()
if [ $proxy = 1 ]; then   # stopped with the instances, at once; in nginx mode the /health watcher and nginx too
    targets+=("proxy=$DEPLOY_DIR/run/proxy.pid" "nginx watcher=$DEPLOY_DIR/run/nginx_watch.pid"
              "nginx=$DEPLOY_DIR/run/nginx.pid")
fi
for ((i = 0; i < N; i++)); do
    [ -n "$only" ] && [ "$only" != "$i" ] && continue
    targets+=("instance $i=$DEPLOY_DIR/run/instance_$i.pid")
done
for f in "$DEPLOY_DIR"/run/instance_*.pid; do     # instances beyond N from an earlier, larger deploy
    [ -e "$f" ] && [ -z "$only" ] || continue
    i=${f##*/instance_}; i=${i%.pid}
    [ "$i" -ge "$N" ] 2>/dev/null || continue
    targets+=("instance $i=$f")
done
stop_pidfiles ${targets[@]+"${targets[@]}"}

# The process still listening on an instance's port without a pid file (started by hand, or a pid
# file lost): stopped when it is this user's; another user's is only named.
for ((i = 0; i < N; i++)); do
    [ -n "$only" ] && [ "$only" != "$i" ] && continue
    port=$((BASE_PORT + i))
    for p in $(ss -ltnpH "sport = :$port" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
        spared "$p" && continue
        if [ ! -O "/proc/$p" ]; then
            echo "port $port: held by pid $p of another user; not touched"
        elif [ $check = 1 ]; then
            echo "port $port: pid $p ($(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-60)): would be stopped"
        else
            kill -TERM "$p" 2>/dev/null && echo "port $port: pid $p sent SIGTERM"
            wait_gone "$p" "$GRACE_S" || { kill -KILL "$p" 2>/dev/null && echo "port $port: pid $p killed (SIGKILL)"; }
        fi
    done
done

# The tag sweep: what the process groups missed (children that left the group, orphans of a SIGKILL).
if [ -n "$only" ]; then prefix="$FLEET_ID/$only"; exact=1; else prefix="$FLEET_ID/"; exact=""; fi
pids=$(tagged_pids "$prefix" "$exact")
for p in $pids; do
    tag=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -m1 '^FLEET_TAG=')
    if [ $check = 1 ]; then
        echo "tagged pid $p ($tag): would be killed"
    else
        kill -TERM "$p" 2>/dev/null && echo "tagged pid $p ($tag): sent SIGTERM"
    fi
done
if [ $check = 0 ] && [ -n "$pids" ]; then
    if ! wait_gone "$pids" "$GRACE_S"; then
        for p in $(tagged_pids "$prefix" "$exact"); do
            kill -KILL "$p" 2>/dev/null && echo "tagged pid $p: killed (SIGKILL after ${GRACE_S}s)"
        done
        wait_gone "$(tagged_pids "$prefix" "$exact")" 5
    fi
fi
left=$(tagged_pids "$prefix" "$exact" | wc -l)
echo "left with tag $prefix: $left"
[ "$left" = 0 ] || [ $check = 1 ]
