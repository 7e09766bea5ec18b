#!/usr/bin/env bash
# The CPU's exact f32 products beside its integer ones (DFLASH_CPU_QUANT=q8: 8-bit rows against
# the GGUF's blocks, crates/dflash-model/src/cpu/q8/mod.rs), same binary, same GGUF, in one run:
#   1. `dflash-rs bench decode` AR, DFlash, DDTree-4 and DDTree-8 with the shipped drafter
#      (JSON rows: OUT/decode-{exact,q8}.json);
#   2. the verify_cost example (1 to 33 rows on a 512-row cache, median of 9);
#   3. the README's main command (`generate --mode ddtree:4 --compare-ar`, the muffin
#      question, 128 tokens) RUNS times per mode, alternating.
# Usage (repository root): B=target/release/dflash-rs E=target/release/examples/verify_cost
#   OUT=out [RUNS=3] bench/cpu_products.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/dflash-rs}
E=${E:-target/release/examples/verify_cost}
OUT=${OUT:-out}
RUNS=${RUNS:-3}
THREADS=${THREADS:-2}
GGUF=${GGUF:-$HOME/.cache/dflash-rs/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}
PROMPT="A baker makes 24 muffins in the morning and twice as many in the afternoon. She sells 50 of them. How many muffins are left?"
mkdir -p "$OUT"
for q in exact q8; do
  rm -f "$OUT/decode-$q.json"
  DFLASH_CPU_QUANT=$q RAYON_NUM_THREADS=$THREADS "$B" bench decode --target "$GGUF" \
    --drafter assets/drafters/smollm2-135m-b16 --modes ar,dflash,ddtree:4,ddtree:8 \
    --max-new-tokens 64 --repeats 3 --output-json "$OUT/decode-$q.json" > "$OUT/decode-$q.txt"
  DFLASH_CPU_QUANT=$q RAYON_NUM_THREADS=$THREADS "$E" smollm2-135m 512 9 33 > "$OUT/verify-$q.txt"
done
for i in $(seq "$RUNS"); do
  for q in exact q8; do
    DFLASH_CPU_QUANT=$q RAYON_NUM_THREADS=$THREADS "$B" generate --target smollm2-135m \
      --mode ddtree:4 --compare-ar --chat --max-new-tokens 128 --prompt "$PROMPT" \
      2>&1 | grep -E "^\[(ddtree:4|ar)\]" > "$OUT/main-$q-$i.txt"
  done
done
tail -n +1 "$OUT"/*.txt
