#!/usr/bin/env bash
# `dflash-rs bench shape --output-json` (eager forwards and, on the GPU, CUDA-graph replays) beside
# bench/decode_reference.py (HF transformers eager and compiled with a static cache, z-lab's
# draft block) on the same shapes in one call of a CUDA machine; then one JSON file of rows for
# docs/bench/ and a table.
#
#   B=path/to/dflash-rs OUT=dir [WHEELS=dir] [TAU=6.5] bench/decode_side_by_side.sh [SHAPE ...]
# Shapes (config.json files) default to SmolLM2-135M's and Qwen3-8B's; bf16, a 512-row cache,
# B = 16, 5 draft layers, medians. WHEELS: a folder holding z-lab's dflash wheel (installed into
# a temporary folder for the reference's draft row). Writes $OUT/decode.json (rows: shape, impl,
# mode, ar_ms, verify16_ms, draft_ms, read_floor_ms, costmodel for ours) and $OUT/decode.md.
# DEV (cuda), OURS_ARGS and REF_ARGS (more flags for each side, e.g. a CPU check of the script:
# DEV=cpu OURS_ARGS="--cache 64 --repeats 1" REF_ARGS="--cache 64 --repeats 2 --compile-backend eager").
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/cuda/release/dflash-rs}
OUT=${OUT:-bench-out}
TAU=${TAU:-6.5}
DEV=${DEV:-cuda}
mkdir -p "$OUT"
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(bench/shapes/smollm2-135m.json bench/shapes/qwen3-8b.json)
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$OUT/site" "$WHEELS"/dflash-*.whl \
    && export PYTHONPATH=$OUT/site${PYTHONPATH:+:$PYTHONPATH}
fi
rm -f "$OUT/decode-rows.jsonl"
for sh in "${shapes[@]}"; do
  n=$(basename "$sh" .json)
  # shellcheck disable=SC2086
  "$B" bench shape --shape "$sh" --device "$DEV" --dtype bf16 --budgets 8,16,32,64 --gdn-lengths '' \
    --tau "$TAU" --output-json "$OUT/$n-ours.jsonl" ${OURS_ARGS:-} > "$OUT/$n-ours.md" 2>&1 \
    || echo "dflash-rs bench shape $sh failed: $(tail -3 "$OUT/$n-ours.md")"
  [ -f "$OUT/$n-ours.jsonl" ] && cat "$OUT/$n-ours.jsonl" >> "$OUT/decode-rows.jsonl"
  # shellcheck disable=SC2086
  timeout 900 python3 bench/decode_reference.py "$sh" --device "$DEV" --json "$OUT/decode-rows.jsonl" ${REF_ARGS:-} \
    > "$OUT/$n-ref.log" 2>&1 \
    || echo "reference $sh failed: $(tail -3 "$OUT/$n-ref.log")"
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/decode-rows.jsonl")]
for r in rows:  # one name per shape on both sides
    r["shape"] = os.path.basename(r["shape"]).removesuffix(".json")
json.dump(rows, open(f"{out}/decode.json", "w"), indent=1)
f = lambda x: "" if x is None else f"{x:.3f}"
md = ["| shape | impl | mode | AR ms | verify16 ms | draft ms | read floor ms | cost model (τ): chain / best DDTree |",
      "|---|---|---|---|---|---|---|---|"]
for r in rows:
    cm = r.get("costmodel")
    c = f"({cm['tau']}) {cm['dflash']:.2f}× / {cm['ddtree_best']:.2f}×" if cm else ""
    md.append(f"| {r['shape']} | {r['impl']} | {r['mode']} | {f(r.get('ar_ms'))} | {f(r.get('verify16_ms'))} | "
              f"{f(r.get('draft_ms'))} | {f(r.get('read_floor_ms'))} | {c} |")
open(f"{out}/decode.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
