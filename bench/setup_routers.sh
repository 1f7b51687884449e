#!/usr/bin/env bash
# The other fronts and the profiler for the benchmarks, in a venv of their own (bench/.venv-routers):
# vllm-router (vLLM's Rust router), smg (SGLang's model gateway) and py-spy. Bench-only: they are
# neither test nor runtime dependencies, and nothing of theirs is committed. A package that does not
# install here is reported and skipped; the benchmarks then leave its rows out.
set -u
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
if [ ! -x .venv-routers/bin/python ]; then
    "$PY" -m venv .venv-routers || { echo "error: '$PY -m venv' failed; install python3-venv." >&2; exit 1; }
fi
status=0
for pkg in "vllm-router==0.1.17" "smg==1.13.0" "py-spy==0.4.3"; do
    if .venv-routers/bin/python -m pip install --quiet --disable-pip-version-check "$pkg"; then
        echo "installed $pkg"
    else
        echo "could not install $pkg; the benchmarks leave it out" >&2
        status=1
    fi
done
ls .venv-routers/bin | grep -E '^(vllm-router|smg|py-spy)' || true
exit $status
