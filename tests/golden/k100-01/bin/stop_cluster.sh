#!/usr/bin/env bash
# Stop the deployment of k100-01: the proxy (or nginx and its watcher) and every instance, each process
# proven the deployment's before it is signalled: by its pid file's record (pid, start time, session,
# tag), by FLEET_TAG, or by the session an instance leads (where vLLM's EngineCore and Workers stay, even
# renamed and orphaned). Each process stopped is listed with how it was identified; a stale pid file and
# a stranger on a port are named, never signalled. The work is hostagent/processes.py's (python -m hostagent.processes).
# Rendered by vllm-fleet from inventory/hosts.yml; the next deploy overwrites edits.
#   ./stop_cluster.sh                 everything
#   ./stop_cluster.sh --instance 3    instance 3 only
#   ./stop_cluster.sh --proxy         the proxy only
#   ./stop_cluster.sh --keeper        the keeper only
#   ./stop_cluster.sh --check         list what would be stopped, stop nothing
#   GRACE_S=30 ./stop_cluster.sh      seconds between SIGTERM and SIGKILL (default 10)
# Nothing is killed by a name pattern, and nothing of another user.
set -u

DEPLOY_DIR=/data/aiops/vllm-fleet
SPEC='{"base_port": 8002, "deploy_dir": "/data/aiops/vllm-fleet", "deployment_id": "k100-01-014e7873", "grace_s": 10.0, "instances": 8, "proxy_port": 8000}'
PYTHON=python3

# Any Python 3.7+ will do (standard library only): python3 from PATH, else the inventory's after env_setup.
if python3 -c 'import sys; sys.exit(sys.version_info < (3, 7))' >/dev/null 2>&1; then
    PYTHON=python3
else
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
fi
cd "$DEPLOY_DIR" || exit 1
exec "$PYTHON" -m hostagent.processes stop "$SPEC" "$@"
