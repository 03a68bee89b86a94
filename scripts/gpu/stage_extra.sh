#!/usr/bin/env bash
# Stage what the lent GPU machines lack beside SGLang (../shared/tools/sglang-gpu carries that):
# megatron-core and Ray for Python 3.12 (and py-spy, DeepGEMM), split into pieces that fit one device call each.
#
#   bash scripts/gpu/stage_extra.sh        # here, in the project root: writes .gpu-extra/e1, e2
#
# On the device, after the SGLang chunks: carry e1 in one call and e2 in the next (any order),
# each running `bash .gpu-extra/eK/install.sh`; the second one to arrive installs both wheels
# into /tmp/sglang-site (the same PYTHONPATH entry as SGLang's).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
stage=${GPU_EXTRA_STAGE:-$HOME/.cache/mcore-rl-gpu-extra}
out="$root/.gpu-extra"
mkdir -p "$stage"
grep -qx '/.gpu-extra/' "$root/.git/info/exclude" 2>/dev/null || echo '/.gpu-extra/' >> "$root/.git/info/exclude"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 -d "$stage" \
  megatron-core==0.16.1 ray==2.60.0 mmh3==5.2.0 py-spy==0.4.1 sgl-deep-gemm==0.1.5.post1
rm -rf "$out" && mkdir -p "$out/e1" "$out/e2"
ray=$(ls "$stage"/ray-2.60.0-*.whl)
split -b 40m -d "$ray" "$out/e1/ray.part"          # ray.part00, ray.part01
mv "$out/e1/ray.part01" "$out/e2/"
basename "$ray" | tee "$out/e1/RAY" > "$out/e2/RAY"
cp "$stage"/megatron_core-0.16.1-*.whl "$stage"/mmh3-*.whl "$out/e2/"
# DeepGEMM: sglang 0.5.17 requires it, ../shared/tools/sglang-gpu does not carry it; without it SGLang's
# block-FP8 GEMMs run on triton whatever SGLANG_ENABLE_JIT_DEEPGEMM says (issue 28). Its JIT uses the image's nvcc.
cp "$stage"/sgl_deep_gemm-0.1.5.post1-*.whl "$out/e2/"
# py-spy (a static binary): PYSPY=1 bash scripts/gpu/session.sh ... samples the driver's threads
python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = next(n for n in z.namelist() if n.endswith('/scripts/py-spy')); open(sys.argv[2], 'wb').write(z.read(n))" \
  "$(ls "$stage"/py_spy-0.4.1-*.whl)" "$out/e2/py-spy"
for d in e1 e2; do cp "$root/scripts/gpu/install_extra.sh" "$out/$d/install.sh"; done
du -sh "$out"/*
