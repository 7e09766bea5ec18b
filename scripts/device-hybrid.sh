#!/usr/bin/env bash
# The hybrid (Gated DeltaNet + gated attention) target on a CUDA machine, in one call:
#   1. `dflash-rs check device` on the tiny Qwen3.5 hybrid of tests/fixtures (our kernels, the
#      GDN recurrence included, against their CPU twins; f32 logits and taps against the CPU;
#      AR on the device = AR on the CPU; DFlash and DDTree = AR on the device; bf16 reported);
#   2. `dflash-rs bench shape` at the Qwen3.6-27B shape in bf16 on random weights
#      (bench/shapes/qwen3.6-27b-8l.json: 8 layers, then bench/shapes/qwen3.6-27b.json: 64).
# Each step's output goes to $OUT; a failing step is reported and the next one runs.
#
# Usage (repository root): scripts/device-hybrid.sh
#   B    the CUDA binary (target/cuda/release/dflash-rs, from scripts/cuda-build.sh)
#   OUT  where the logs go (out/)
#   SHAPES  the shapes to bench (default: qwen3.6-27b-8l qwen3.6-27b)
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/cuda/release/dflash-rs}
OUT=${OUT:-out}
SHAPES=${SHAPES:-qwen3.6-27b-8l qwen3.6-27b}
mkdir -p "$OUT"
status=0
"$B" check device --device cuda --dtype bf16 --target tests/fixtures/qwen35-tiny \
  --drafter tests/fixtures/dflash-tiny/hybrid > "$OUT/check-hybrid.md" 2> "$OUT/check-hybrid.log" \
  || { echo "check device failed" >&2; status=1; }
for s in $SHAPES; do
  "$B" bench shape --shape "bench/shapes/$s.json" --device cuda --dtype bf16 --budgets 8,32 \
    --repeats 5 > "$OUT/shape-$s.txt" 2>&1 || { echo "bench shape $s failed" >&2; status=1; }
done
exit $status
