#!/usr/bin/env bash
# A drafter's vocabulary subset with its prompt's tokens (the default) beside the subset alone
# (DFLASH_DISABLED_KERNELS=prompt-vocab), same binary, the bundled SmolLM2 drafter, CPU f32: `eval` on
# the first LIMIT problems of each dataset (AR, DFlash, DDTree-4, DDTree-8; every mode must
# equal AR), then the README's main command, alternated RUNS times.
# Usage (repository root): cargo build --release -p dflash-cli, then
#   B=target/release/dflash-rs OUT=out [LIMIT=8] [RUNS=3] [DATASETS="gsm8k humaneval math500 mt-bench"] bench/draft_vocab_prompt.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/dflash-rs}
OUT=${OUT:-out}
LIMIT=${LIMIT:-8}
RUNS=${RUNS:-3}
mkdir -p "$OUT"
for ds in ${DATASETS:-gsm8k humaneval math500 mt-bench}; do
  for v in subset prompt; do
    sw=""; [ "$v" = subset ] && sw=prompt-vocab
    DFLASH_DISABLED_KERNELS=$sw "$B" eval --target smollm2-135m --dataset "$ds" --limit "$LIMIT" \
      --drafter smollm2-135m-b16=assets/drafters/smollm2-135m-b16 \
      --modes ar,dflash,ddtree:4,ddtree:8 --max-new-tokens 128 --device cpu --dtype f32 \
      --out "$OUT/$ds-$v" --force > "$OUT/$ds-$v.log" 2>&1
    grep -E "τ pooled" "$OUT/$ds-$v.log" | sed "s/^/$ds $v /"
  done
done
P="A baker makes 24 muffins in the morning and twice as many in the afternoon. She sells 50 of them. How many muffins are left?"
for i in $(seq "$RUNS"); do
  for v in subset prompt; do
    sw=""; [ "$v" = subset ] && sw=prompt-vocab
    echo "main command, $v, run $i: $(DFLASH_DISABLED_KERNELS=$sw "$B" generate --target smollm2-135m --mode ddtree:4 \
      --compare-ar --chat --max-new-tokens 128 --prompt "$P" 2>&1 | grep -oE 'tau [0-9.]+|over AR [0-9.]+×|identical' | tr '\n' ' ')"
  done
done | tee "$OUT/main.txt"
