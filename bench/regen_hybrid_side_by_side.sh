#!/usr/bin/env bash
# Batched decoding of a hybrid target (Gated DeltaNet + gated attention, random weights, bf16):
# `dflash-rs bench regen` at 1 slot and at each of SLOTS beside HF transformers' batched
# `generate` with fla's kernels (bench/regen_reference.py, eager: the static cache does not
# take linear-attention layers) on the same shape and prompts, in one call of a CUDA machine.
#
#   B=path/to/dflash-rs OUT=dir WHEELS=dir-of-fla-wheels bench/regen_hybrid_side_by_side.sh [SHAPE]
# SHAPE defaults to bench/shapes/qwen3.6-27b-8l.json; SLOTS to "64 256"; PROMPT (256) and NEW
# (128) tokens per sequence. Writes $OUT/regen-hybrid.jsonl (rows: shape, impl, batch,
# prompt_tokens, new_tokens, new_tok_s, ms_per_step, slot_state_bytes) and prints a table.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/cuda/release/dflash-rs}
OUT=${OUT:-bench-out}
SHAPE=${1:-bench/shapes/qwen3.6-27b-8l.json}
SLOTS=${SLOTS:-64 256}
PROMPT=${PROMPT:-256}
NEW=${NEW:-128}
mkdir -p "$OUT"
rows="$OUT/regen-hybrid.jsonl"
rm -f "$rows"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/fla-site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/fla-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import fla" 2>/dev/null || echo "fla does not import: the reference runs torch's Gated DeltaNet fallback"
for s in 1 $SLOTS; do
  f="$OUT/ours-$s.json"
  # one slot: eight requests one after another (as `data generate --batch-size 1`)
  req=$s; [ "$s" = 1 ] && req=8
  if "$B" bench regen --shape "$SHAPE" --device cuda --dtype bf16 --slots "$s" --requests "$req" \
    --prompt-tokens "$PROMPT" --max-new-tokens "$NEW" --output-json "$f" > "$OUT/ours-$s.log" 2>&1; then
    cat "$f" >> "$rows"
  else
    echo "bench regen, $s slots, failed: $(tail -2 "$OUT/ours-$s.log")"
  fi
done
for s in $SLOTS; do
  timeout 300 python3 bench/regen_reference.py --shape "$SHAPE" --slots "$s" --prompt-tokens "$PROMPT" \
    --new-tokens "$NEW" --variants eager --json "$rows" > "$OUT/ref-$s.log" 2>&1 \
    || echo "reference, $s slots, failed: $(tail -2 "$OUT/ref-$s.log")"
done
python3 - "$rows" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| impl | batch | tokens/s | ms per step (with prefills) | state per slot (MiB) |")
print("|---|---|---|---|---|")
for r in rows:
    st = r.get("slot_state_bytes")
    st = "" if st is None else f"{st / 2**20:.1f}"
    print(f"| {r['impl']} | {r['batch']} | {r['new_tok_s']:.0f} | {r['ms_per_step']:.2f} | {st} |")
PY
