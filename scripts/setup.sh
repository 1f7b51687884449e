#!/usr/bin/env bash
# Create .venv and install vllm-fleet into it (with the test extras when given "test").
# Needs Python 3.10+ with venv; no root.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "error: $PY is missing or older than 3.10; install Python 3.10+ or set PYTHON=/path/to/python3." >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    if ! "$PY" -m venv .venv 2>/dev/null; then
        rm -rf .venv
        echo "error: '$PY -m venv' does not work here; install the venv module (Debian: apt install python3-venv) and rerun." >&2
        exit 1
    fi
fi
extras=""
[ "${1:-}" = test ] && extras="[test]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".$extras"
