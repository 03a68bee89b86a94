#!/usr/bin/env bash
# On the GPU machine: keep this piece under /tmp/gpu-extra; once every piece is there, join Ray's
# wheel and install it and megatron-core into /tmp/sglang-site.
set -euo pipefail
d=$(cd "$(dirname "$0")" && pwd)
keep=/tmp/gpu-extra
mkdir -p "$keep" && cp "$d"/* "$keep"/
[ -f "$keep/py-spy" ] && chmod +x "$keep/py-spy"  # PYSPY=1 in scripts/gpu/session.sh
name=$(cat "$keep/RAY")
if ls "$keep"/ray.part00 "$keep"/ray.part01 >/dev/null 2>&1; then
  cat "$keep"/ray.part0* > "$keep/$name"
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/sglang-site "$keep/$name" "$keep"/megatron_core-*.whl "$keep"/mmh3-*.whl \
    "$keep"/sgl_deep_gemm-*.whl 2>&1 | grep -v -i warning || true
  PYTHONPATH=/tmp/sglang-site python3 -c "import ray, megatron.core; print('gpu-extra: ready, ray', ray.__version__, 'megatron-core', megatron.core.__version__)"
  PYTHONPATH=/tmp/sglang-site python3 -c "import deep_gemm" 2>/dev/null && echo "gpu-extra: deep_gemm imports" \
    || echo "gpu-extra: deep_gemm does not import (SGLang's block-FP8 GEMMs stay on triton)"
else
  set -- "$keep"/ray.part*
  echo "gpu-extra: $# of 2 ray pieces here"
fi
