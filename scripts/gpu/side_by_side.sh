#!/usr/bin/env bash
# Independent sessions side by side, one per GPU of a multi-GPU machine: each sees only its GPU
# (CUDA_VISIBLE_DEVICES; our NVML readings follow it by UUID), starts its own loopback Ray and
# writes under $OUT/gN with its temporary files in /tmp/gN. Each argument is one GPU's session:
#   bash scripts/gpu/side_by_side.sh "STEPS=25 bash scripts/gpu/session.sh run50" \
#     "LAYERS=8 bash scripts/gpu/session.sh loop1gpu"
# Run `ray stop --force` before, never between: the sessions' clusters live side by side.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/out}
gpu=0
for session in "$@"; do
  mkdir -p "$OUT/g$gpu" "/tmp/g$gpu"
  (export CUDA_VISIBLE_DEVICES=$gpu OUT=$OUT/g$gpu TMPDIR=/tmp/g$gpu; eval "$session") > "$OUT/g$gpu/session.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
sessions=("$@")
for ((g = 0; g < gpu; g++)); do echo "== GPU $g: ${sessions[g]}"; tail -25 "$OUT/g$g/session.log"; done
