#!/usr/bin/env bash
# Create .venv with CPU torch and mcore_rl (editable) plus test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TORCH_VERSION:-2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
# torch first, pinned, so nothing below can pull a multi-GB CUDA build
"${pip[@]}" install "torch==${TORCH}"
echo "torch==${TORCH}" > .venv/torch-constraint.txt
"${pip[@]}" install -c .venv/torch-constraint.txt -e ".[dev]"
.venv/bin/python -c "import mcore_rl, megatron.core, transformers, ray; print('mcore_rl ready:', megatron.core.__version__)"
