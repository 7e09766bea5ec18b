#!/usr/bin/env bash
# `dflash-rs bench regen` (batched decoding on random weights: eager and graph-replayed steps,
# each with the attention as matmuls, as the interval kernel and as the decode kernel — the
# default; ATTENTION lists the variants to run; the prefills run the prefill kernel except
# under `matmuls` and `noprefill`, the decode kernel with prefills as matmuls) beside HF
# transformers `generate`
# (bench/regen_reference.py) on the same shape and prompts, in one call of a CUDA machine; then
# one JSON file of rows for docs/bench/.
#
#   B=path/to/dflash-rs OUT=dir bench/regen_side_by_side.sh [SHAPE]
# SHAPE defaults to bench/shapes/smollm2-135m.json. Cases (PROMPT_MIN:PROMPT_MAX:NEW, the
# CASES variable): 256:256:512 (equal lengths) and 64:1024:256 (lengths spread like real
# prompts); 256 slots, bf16. Writes $OUT/regen.json (rows: shape, impl, attention, cuda_graphs,
# batch, prompt_tokens_min, prompt_tokens, new_tokens, new_tok_s, ms_per_step) and $OUT/regen.md.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/cuda/release/dflash-rs}
OUT=${OUT:-bench-out}
SHAPE=${1:-bench/shapes/smollm2-135m.json}
CASES=${CASES:-256:256:512 64:1024:256}
SLOTS=${SLOTS:-256}
ATTENTION=${ATTENTION:-matmuls interval decode}
mkdir -p "$OUT"
rm -f "$OUT/regen-rows.jsonl"
for c in $CASES; do
  IFS=: read -r lo hi new <<< "$c"
  for graphs in 0 1; do
    for att in $ATTENTION; do
      g=""; [ "$graphs" = 1 ] && g=--cuda-graphs
      case $att in
        matmuls) env="DFLASH_DISABLED_KERNELS=attention"; name=matmuls ;;
        interval) env="DFLASH_DISABLED_KERNELS=decode-attention"; name="fused interval kernel" ;;
        decode) env="DFLASH_DISABLED_KERNELS="; name="fused decode kernel" ;;
        noprefill) env="DFLASH_DISABLED_KERNELS=prefill-attention"; name="fused decode kernel, prefills as matmuls" ;;
        *) echo "unknown attention variant $att (matmuls interval decode noprefill)" >&2; exit 2 ;;
      esac
      f="$OUT/ours-$lo-$hi-$new-g$graphs-$att.json"
      env "$env" "$B" bench regen --shape "$SHAPE" --device cuda --dtype bf16 \
        --slots "$SLOTS" --prompt-tokens "$hi" --prompt-tokens-min "$lo" --max-new-tokens "$new" $g \
        --output-json "$f" > "${f%.json}.log" 2>&1 || echo "bench regen $c graphs $graphs $att failed: $(tail -2 "${f%.json}.log")"
      [ -f "$f" ] && python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r['attention']=sys.argv[2]; print(json.dumps(r))" "$f" "$name" >> "$OUT/regen-rows.jsonl"
    done
  done
  timeout 400 python3 bench/regen_reference.py --shape "$SHAPE" --slots "$SLOTS" --prompt-tokens "$hi" \
    --prompt-tokens-min "$lo" --new-tokens "$new" --json "$OUT/regen-rows.jsonl" > "$OUT/ref-$lo-$hi-$new.log" 2>&1 \
    || echo "reference $c failed: $(tail -2 "$OUT/ref-$lo-$hi-$new.log")"
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/regen-rows.jsonl")]
with open(f"{out}/regen.json", "w") as f:
    json.dump(rows, f, indent=1)
lines = ["| prompts | new | impl | attention | graphs | tokens/s | ms per step (with prefills) |",
         "|---|---|---|---|---|---|---|"]
for r in rows:
    p = f"{r.get('prompt_tokens_min', r['prompt_tokens'])}–{r['prompt_tokens']}"
    lines.append(f"| {p} | {r['new_tokens']} | {r['impl']} | {r.get('attention', 'SDPA')} | "
                 f"{r.get('cuda_graphs', '')} | {r['new_tok_s']:.0f} | {r['ms_per_step']:.2f} |")
open(f"{out}/regen.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
