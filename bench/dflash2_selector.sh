#!/usr/bin/env bash
# Does a trained DFlash2 candidate selector raise τ over the unary ranking alone? On SmolLM2:
# the bundled DFlash drafter's layers, frozen, become a DFlash2 drafter (identity convs: its
# block logits are the DFlash drafter's bit for bit) whose selector alone is trained on the
# bundled regenerated data; then `eval` runs both drafters on the same GSM8K problems at T = 0.
# The DFlash drafter drafts each position's argmax (the unary ranking); the DFlash2 drafter's
# selector re-ranks the same logits' top 16 after the previous draft.
#
#   B=target/release/dflash-rs WORK=/tmp/d2sel bench/dflash2_selector.sh
# STEPS (400), ANCHORS (128), LIMIT (16 problems), TOKENS (128 new tokens) change the run.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/dflash-rs}
WORK=${WORK:-/tmp/d2sel}
STEPS=${STEPS:-400}
ANCHORS=${ANCHORS:-128}
LIMIT=${LIMIT:-16}
TOKENS=${TOKENS:-128}
mkdir -p "$WORK/base" "$WORK/data"
# the DFlash drafter without its draft vocabulary: both drafters rank the whole vocabulary
cp assets/drafters/smollm2-135m-b16/{config.json,model.safetensors} "$WORK/base/"
[ -f "$WORK/data/data/manifest.json" ] || tar -xJf assets/data/smollm2-135m-regen-1024.tar.xz -C "$WORK/data"
cat > "$WORK/selector.json" <<JSON
{
  "num_draft_layers": 5,
  "block_size": 16,
  "init_from": "$WORK/base",
  "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 64, "selector_top_k": 16},
  "train_only": ["candidate_selector."],
  "num_anchors": $ANCHORS,
  "max_length": 2048,
  "lr": 0.003,
  "warmup_ratio": 0.02,
  "grad_accum": 1,
  "max_steps": $STEPS,
  "save_every": $STEPS,
  "val_every": 200,
  "val_sequences": 16
}
JSON
[ -d "$WORK/run/best" ] || "$B" train --target smollm2-135m --data "$WORK/data/data" --out "$WORK/run" --config "$WORK/selector.json"
for d in base:"$WORK/base" dflash2:"$WORK/run/best"; do
  n=${d%%:*}
  "$B" eval --target smollm2-135m --drafter "${d#*:}" --dataset gsm8k --limit "$LIMIT" \
    --max-new-tokens "$TOKENS" --modes ar,dflash,ddtree:4 --out "$WORK/eval-$n" --force
done
for n in base dflash2; do echo "== $n"; sed -n '/^| mode/,/^$/p' "$WORK/eval-$n/report.md"; done
