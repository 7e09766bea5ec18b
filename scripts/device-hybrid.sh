#!/usr/bin/env bash
# The hybrid (Gated DeltaNet + gated attention) target on a CUDA machine. Steps (STEPS, default
# all four, in this order; each writes to $OUT, a failing step is reported and the next runs):
#   check   `dflash-rs check device` on the tiny Qwen3.5 hybrid of tests/fixtures (our kernels,
#           the GDN prep, recurrence and gated norm included, against their CPU twins; f32 logits
#           and taps against the CPU; AR on the device = AR on the CPU; DFlash and DDTree = AR on
#           the device; bf16 reported);
#   shapes  `dflash-rs bench shape` at the Qwen3.6-27B shape in bf16 on random weights
#           (bench/shapes/qwen3.6-27b-8l.json: 8 layers, then bench/shapes/qwen3.6-27b.json: 64);
#   hf      the reference on the same shapes: bench/hybrid_hf_speed.py (transformers + fla);
#   parity  bench/gdn_parity.py: fla, transformers' torch fallback and dflash-rs (CUDA, CPU)
#           layer by layer through a 64-layer random target at the 27B layer shape.
# fla for the hf and parity steps: the wheels flash-linear-attention==0.6.0 and fla-core==0.6.0
# (and dflash==0.1.0 for parity's drafter) importable, e.g. installed with
# `pip install --no-index --no-deps --target /tmp/site *.whl` and PYTHONPATH=/tmp/site.
#
# Usage (repository root): scripts/device-hybrid.sh
#   B       the CUDA binary (target/cuda/release/dflash-rs, from scripts/cuda-build.sh)
#   OUT     where the logs go (out/)
#   SHAPES  the shapes to bench (default: qwen3.6-27b-8l qwen3.6-27b)
#   STEPS   the steps to run (default: check shapes hf parity)
#   WORK    scratch for parity's model (default: /tmp/gdn-parity)
#   REPEATS the median of how many timed forwards (default 10)
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/cuda/release/dflash-rs}
OUT=${OUT:-out}
SHAPES=${SHAPES:-qwen3.6-27b-8l qwen3.6-27b}
STEPS=${STEPS:-check shapes hf parity}
WORK=${WORK:-/tmp/gdn-parity}
REPEATS=${REPEATS:-10}
mkdir -p "$OUT"
status=0
for step in $STEPS; do
  case $step in
    check)
      "$B" check device --device cuda --dtype bf16 --target tests/fixtures/qwen35-tiny \
        --drafter tests/fixtures/dflash-tiny/hybrid > "$OUT/check-hybrid.md" 2> "$OUT/check-hybrid.log" \
        || { echo "check device failed" >&2; status=1; } ;;
    shapes)
      for s in $SHAPES; do
        "$B" bench shape --shape "bench/shapes/$s.json" --device cuda --dtype bf16 --budgets 8,32 \
          --repeats "$REPEATS" > "$OUT/shape-$s.txt" 2>&1 || { echo "bench shape $s failed" >&2; status=1; }
      done ;;
    hf)
      for s in $SHAPES; do
        python3 bench/hybrid_hf_speed.py "bench/shapes/$s.json" "$OUT/hf-$s.json" > "$OUT/hf-$s.log" 2>&1 \
          || { echo "hybrid_hf_speed $s failed" >&2; status=1; }
      done ;;
    parity)
      python3 bench/gdn_parity.py "$WORK" "$B" --no-cpu > "$OUT/parity.md" 2> "$OUT/parity.log" \
        && cp "$WORK/gdn-parity.json" "$OUT/" || { echo "gdn_parity failed" >&2; status=1; } ;;
    *) echo "unknown step $step" >&2; status=1 ;;
  esac
done
exit $status
