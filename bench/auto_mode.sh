#!/usr/bin/env bash
# `--mode auto` beside AR and the fixed mode that is fastest on the CPU (DDTree-4), same binary,
# one `dflash-rs eval` per set (T = 0, 128 new tokens, chat template, f32): GSM8K, HumanEval,
# MATH-500 and MT-Bench (LIMIT problems each) and the everyday prompts of
# bench/prompts/everyday.jsonl (all 36), printing per set the pooled speed-ups and the per-prompt
# median, range and count below 0.97× AR, and writing OUT/rows.jsonl (one row per set and mode).
# Usage (repository root): cargo build --release -p dflash-cli, then
#   B=target/release/dflash-rs OUT=out [TARGET=smollm2-135m DRAFTER=assets/drafters/smollm2-135m-b16] \
#   [LIMIT=8] [SETS="gsm8k humaneval math500 mt-bench everyday"] [PRODUCTS=exact|q8] bench/auto_mode.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/dflash-rs}
OUT=${OUT:-out}
TARGET=${TARGET:-smollm2-135m}
DRAFTER=${DRAFTER:-assets/drafters/smollm2-135m-b16}
LIMIT=${LIMIT:-8}
PRODUCTS=${PRODUCTS:-exact}
mkdir -p "$OUT"
: > "$OUT/rows.jsonl"
for set in ${SETS:-gsm8k humaneval math500 mt-bench everyday}; do
  ds=$set; lim=(--limit "$LIMIT")
  [ "$set" = everyday ] && { ds=bench/prompts/everyday.jsonl; lim=(); }
  rm -rf "$OUT/$set"
  "$B" eval --target "$TARGET" --dataset "$ds" "${lim[@]}" --drafter "d=$DRAFTER" \
    --modes ar,ddtree:4,auto --max-new-tokens 128 --cpu-products "$PRODUCTS" --out "$OUT/$set" \
    > "$OUT/$set.log" 2>&1
  python3 - "$OUT/$set/report.json" "$set" "$TARGET" "$PRODUCTS" >> "$OUT/rows.jsonl" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
per = {}
for x in r["runs"]:
    per.setdefault(x["item"], {})[x["mode"]] = x["decode_secs"] / max(1, len(x["tokens"]))
for m in r["modes"]:
    s = [v["ar"] / v[m["mode"]] for v in per.values()]
    print(json.dumps({
        "set": sys.argv[2], "target": sys.argv[3], "products": sys.argv[4], "mode": m["mode"],
        "prompts": len(s),
        "tau_pooled": round(m["tau"]["tau_pooled"], 3),
        "speedup_vs_ar_pooled": round(m["speedup_vs_ar"], 3),
        "speedup_per_prompt_median": round(statistics.median(s), 3),
        "speedup_per_prompt_min": round(min(s), 3), "speedup_per_prompt_max": round(max(s), 3),
        "prompts_below_0_97": sum(1 for x in s if x < 0.97),
        "lossless": not r["lossless"]["divergences"]}))
PY
  echo "== $set"; grep -E 'τ pooled' "$OUT/$set.log"
done
