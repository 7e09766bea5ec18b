#!/usr/bin/env bash
# CPU benchmark of the target runtime: AR prefill and decode tokens/s on SmolLM2-135M (f32).
# Usage: scripts/bench-cpu.sh [threads=2] [new_tokens=128] [repeats=3]
# Prints one JSON line per run and a median summary (a record: docs/bench/cpu-ar-xeon2c-2026-12-01.json).
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}; new=${2:-128}; reps=${3:-3}
scripts/fetch-assets.sh smollm2 >&2
cargo build --release --quiet -p dflash-cli
prompt=$(python3 -c "print(' '.join(['The history of the printing press begins in the fifteenth century.']*24))")
for i in $(seq 1 "$reps"); do
  RAYON_NUM_THREADS=$threads "${CARGO_TARGET_DIR:-target}/release/dflash-rs" generate --target smollm2-135m --dtype f32 \
    --prompt "$prompt" --max-new-tokens "$new" --json 2>/dev/null
done | python3 -c '
import json, statistics, sys
runs = [json.loads(l) for l in sys.stdin if l.strip()]
pre = [r["prompt_tokens"] / r["prefill_seconds"] for r in runs]
dec = [(r["new_tokens"] - 1) / r["decode_seconds"] for r in runs]
for r, p, d in zip(runs, pre, dec):
    print(json.dumps({"prompt_tokens": r["prompt_tokens"], "new_tokens": r["new_tokens"], "prefill_tok_s": round(p, 1), "decode_tok_s": round(d, 2)}))
n_p, n_d = runs[0]["prompt_tokens"], runs[0]["new_tokens"]
print(f"median over {len(runs)} runs: prefill {statistics.median(pre):.1f} tok/s ({n_p} tokens), decode {statistics.median(dec):.2f} tok/s ({n_d} tokens)")
'
