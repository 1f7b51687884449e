#!/usr/bin/env bash
# Stop the deployment of k100-01: the proxy and every instance, by process group, then every
# process of this user still carrying the deployment's FLEET_TAG (vLLM's spawned EngineCore children
# have no port and no "vllm" in their command line; the tag is how they are found).
# Rendered by vllm-fleet from inventory/hosts.yml; the next deploy overwrites edits.
#   ./stop_cluster.sh                 everything
#   ./stop_cluster.sh --instance 3    instance 3 only (its group and its tag)
#   ./stop_cluster.sh --check         list what would be stopped, stop nothing
# Nothing is killed by a name pattern, and nothing of another user.
set -u

DEPLOY_DIR=/data/aiops/vllm-fleet
FLEET_ID=k100-01-014e7873
GRACE_S="${GRACE_S:-10}"
N=8

only="" proxy=1 check=0
while [ $# -gt 0 ]; do
    case "$1" in
        --instance) only="$2"; proxy=0; shift 2 ;;
        --proxy) only="none"; shift ;;
        --check) check=1; shift ;;
        *) echo "usage: $0 [--instance I | --proxy] [--check]" >&2; exit 64 ;;
    esac
done

# Processes of this user whose environment holds FLEET_TAG=<prefix>... (exact when $2 = exact).
tagged_pids() {
    local prefix=$1 exact=${2:-} d p kv
    for d in /proc/[0-9]*; do
        p=${d#/proc/}
        [ "$p" = "$$" ] && continue
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

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

# SIGTERM a process group, wait up to GRACE_S, then SIGKILL what is left.
stop_group() {
    local what=$1 pgid=$2 ticks=0 limit
    limit=$(awk -v g="$GRACE_S" 'BEGIN { printf "%d", g * 5 }')   # 0.2 s ticks
    if ! group_alive "$pgid"; then
        echo "$what: process group $pgid already gone"
        return 0
    fi
    if [ $check = 1 ]; then
        echo "$what: would stop process group $pgid"
        return 0
    fi
    kill -TERM -- "-$pgid" 2>/dev/null
    while group_alive "$pgid" && [ $ticks -lt "$limit" ]; do
        sleep 0.2; ticks=$((ticks + 1))
    done
    if group_alive "$pgid"; then
        kill -KILL -- "-$pgid" 2>/dev/null
        echo "$what: process group $pgid killed (SIGKILL after ${GRACE_S}s)"
    else
        echo "$what: process group $pgid stopped"
    fi
}

stop_pidfile() {
    local what=$1 pidfile=$2 pid pgid
    [ -f "$pidfile" ] || return 0
    read -r pid pgid <"$pidfile"
    stop_group "$what" "${pgid:-$pid}"
    [ $check = 1 ] || rm -f "$pidfile" "${pidfile%.pid}.ready"
}

if [ "$only" = none ]; then
    stop_pidfile proxy "$DEPLOY_DIR/run/proxy.pid"
    exit 0
fi
[ $proxy = 1 ] && stop_pidfile proxy "$DEPLOY_DIR/run/proxy.pid"
if [ $proxy = 1 ]; then     # nginx mode: the /health watcher, then nginx (SIGTERM: fast shutdown)
    stop_pidfile "nginx watcher" "$DEPLOY_DIR/run/nginx_watch.pid"
    stop_pidfile nginx "$DEPLOY_DIR/run/nginx.pid"
fi
for ((i = 0; i < N; i++)); do
    [ -n "$only" ] && [ "$only" != "$i" ] && continue
    stop_pidfile "instance $i" "$DEPLOY_DIR/run/instance_$i.pid"
done
for f in "$DEPLOY_DIR"/run/instance_*.pid; do     # instances beyond N from an earlier, larger deploy
    [ -e "$f" ] && [ -z "$only" ] || continue
    i=${f##*/instance_}; i=${i%.pid}
    stop_pidfile "instance $i" "$f"
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
    sleep 1
    for p in $(tagged_pids "$prefix" "$exact"); do
        kill -KILL "$p" 2>/dev/null && echo "tagged pid $p: killed (SIGKILL)"
    done
    sleep 0.2
fi
left=$(tagged_pids "$prefix" "$exact" | wc -l)
echo "left with tag $prefix: $left"
[ "$left" = 0 ] || [ $check = 1 ]
