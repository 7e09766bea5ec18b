#!/usr/bin/env bash
# The drafter's last layer on the rows a draft reads (the default) beside the whole block
# (DFLASH_DISABLED_KERNELS=draft-last-rows), same binary, same GGUF, alternated RUNS times:
# `dflash-rs bench decode` AR, DFlash, DDTree-3, DDTree-4 and DDTree-8 with the shipped drafter
# (JSON rows: OUT/decode-{rows,block}-N.json; the drafts' logits are the same either way), then
# the draft alone (the draft_cost example: median of 201 drafts per number of positions read).
# Usage (repository root): cargo build --release -p dflash-cli -p dflash-engine --examples, then
#   B=target/release/dflash-rs E=target/release/examples/draft_cost OUT=out [RUNS=3] bench/draft_last_rows.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/dflash-rs}
E=${E:-target/release/examples/draft_cost}
OUT=${OUT:-out}
RUNS=${RUNS:-3}
GGUF=${GGUF:-$HOME/.cache/dflash-rs/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$OUT"
for i in $(seq "$RUNS"); do
  for v in block rows; do
    sw=""; [ "$v" = block ] && sw=draft-last-rows
    rm -f "$OUT/decode-$v-$i.json"
    DFLASH_DISABLED_KERNELS=$sw "$B" bench decode --target "$GGUF" \
      --drafter assets/drafters/smollm2-135m-b16 --modes ar,dflash,ddtree:3,ddtree:4,ddtree:8 \
      --max-new-tokens 128 --repeats 3 --output-json "$OUT/decode-$v-$i.json" > "$OUT/decode-$v-$i.txt"
  done
done
for i in $(seq "$RUNS"); do
  for v in block rows; do
    sw=""; [ "$v" = block ] && sw=draft-last-rows
    DFLASH_DISABLED_KERNELS=$sw "$E" > "$OUT/draft-$v-$i.txt"
  done
done
tail -n +1 "$OUT"/*.txt
