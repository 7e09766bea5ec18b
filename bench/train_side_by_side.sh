#!/usr/bin/env bash
# `dflash-rs bench train` beside the PyTorch reference (bench/train_reference.py) on the same
# shapes in one call of a CUDA machine, then one JSON file of rows for docs/bench/.
#
#   B=path/to/dflash-rs OUT=dir bench/train_side_by_side.sh [SHAPE ...]
# Shapes default to SmolLM2-135M's and Qwen3-8B's; one 2,048-token row, 512 anchors, B = 16,
# 5 draft layers, bf16, median of 5 steps after a warm-up. Writes $OUT/train-step.json (rows:
# shape, impl, features_ms, step_ms, supervised_tok_s, mfu_pct; the reference's MFU is counted
# with dflash-rs's FLOPs of the same step), $OUT/train-step.md (the table) and, per shape, the
# phase profile of dflash-rs's step (DFLASH_PROFILE=1) in $OUT/profile-*.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/cuda/release/dflash-rs}
OUT=${OUT:-bench-out}
PEAK=${PEAK:-989}
mkdir -p "$OUT"
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(bench/shapes/smollm2-135m.json qwen3-8b)
args=(--device cuda --dtype bf16 --seq-len 2048 --anchors 512 --peak-tflops "$PEAK")
for sh in "${shapes[@]}"; do
  n=$(basename "$sh" .json)
  "$B" bench train --shape "$sh" "${args[@]}" --output-json "$OUT/$n-ours.json" > "$OUT/$n-ours.md" 2>&1 \
    || echo "dflash-rs bench train $sh failed: $(tail -3 "$OUT/$n-ours.md")"
  DFLASH_PROFILE=1 "$B" bench train --shape "$sh" "${args[@]}" --steps 2 > "$OUT/profile-$n.txt" 2>&1
  python3 bench/train_reference.py "$sh" 2048 512 5 5 > "$OUT/$n-ref.json" 2> "$OUT/$n-ref.log" \
    || echo "reference $sh failed: $(tail -3 "$OUT/$n-ref.log")"
done
python3 - "$OUT" "$PEAK" "${shapes[@]}" <<'PY'
import json, sys, os
out, peak, shapes = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
rows, md = [], ["| shape | impl | features ms | step ms | supervised tok/s | MFU % |", "|---|---|---|---|---|---|"]
for sh in shapes:
    n = os.path.basename(sh).removesuffix(".json")
    got = {}
    for side in ("ours", "ref"):
        try:
            got[side] = json.loads(open(f"{out}/{n}-{side}.json").read().strip().splitlines()[-1])
        except Exception as e:
            print(f"{n} {side}: no row ({e})")
    if "ours" in got and "ref" in got:
        got["ref"]["mfu_pct"] = 100 * got["ours"]["tflop_per_step"] / (got["ref"]["step_ms"] / 1e3) / peak
        got["ours"]["vs_reference_tok_s"] = got["ours"]["supervised_tok_s"] / got["ref"]["supervised_tok_s"]
    for r in got.values():
        rows.append(r)
        md.append(f"| {n} | {r['impl']} | {r['features_ms']:.1f} | {r['step_ms']:.1f} | {r['supervised_tok_s']:.0f} | "
                  + (f"{r['mfu_pct']:.1f}" if r.get("mfu_pct") is not None else "") + " |")
json.dump(rows, open(f"{out}/train-step.json", "w"), indent=1)
open(f"{out}/train-step.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
