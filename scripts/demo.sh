#!/usr/bin/env bash
# The main job on the built-in `local` demo host: deploy simulated vLLM instances and the proxy,
# send one chat request through the proxy, print the status table. `inv stop --host local` ends it.
set -eu
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/inv deploy --host local
.venv/bin/inv chat --host local
.venv/bin/inv status --host local
echo
echo "The demo cluster keeps running: try '.venv/bin/inv status --host local', then '.venv/bin/inv stop --host local'."
