#!/usr/bin/env bash
# `dflash-rs serve` beside llama.cpp's `llama-server` on the CPU, one streaming load
# (bench/serve_load.py: the chat prompts of bench/prompts/everyday.jsonl, T = 0, 128 tokens a
# request) at concurrency 1, 4 and 16 against each server in turn, same GGUF, same threads;
# writes one JSON record (the rows of every server and concurrency).
#
#   B=target/release/dflash-rs OUT=out bench/serve_side_by_side.sh
#   SERVERS="llama-server dflash-auto dflash-ar"   (default; also dflash-auto-q8, dflash-ar-q8)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/dflash-rs}
PY=${PY:-python3}
OUT=${OUT:-out}
THREADS=${THREADS:-2}
MAX_TOKENS=${MAX_TOKENS:-128}
PROMPTS=${PROMPTS:-bench/prompts/everyday.jsonl}
GGUF=${GGUF:-$HOME/.cache/dflash-rs/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}
SERVERS=${SERVERS:-llama-server dflash-auto dflash-ar}
LOADS=${LOADS:-"1:16 4:32 16:48"}   # concurrency:requests
PORT=${PORT:-8411}
mkdir -p "$OUT"
LLAMA=$(scripts/build-llama-server.sh)

start() { # start NAME: the server NAME on $PORT, waiting for /health
  case "$1" in
    llama-server) "$LLAMA" -m "$GGUF" -t "$THREADS" -np 16 -cb -c 32768 --jinja --port "$PORT" \
                    > "$OUT/$1.log" 2>&1 & ;;
    dflash-auto) RAYON_NUM_THREADS=$THREADS "$B" serve --target "$GGUF" --drafter assets/drafters/smollm2-135m-b16 \
                    --served-model-name m --max-batch 16 --port "$PORT" > "$OUT/$1.log" 2>&1 & ;;
    dflash-auto-q8) RAYON_NUM_THREADS=$THREADS "$B" serve --target "$GGUF" --drafter assets/drafters/smollm2-135m-b16 \
                    --served-model-name m --max-batch 16 --cpu-products q8 --port "$PORT" > "$OUT/$1.log" 2>&1 & ;;
    dflash-ar) RAYON_NUM_THREADS=$THREADS "$B" serve --target "$GGUF" --mode ar \
                    --served-model-name m --max-batch 16 --port "$PORT" > "$OUT/$1.log" 2>&1 & ;;
    dflash-ar-q8) RAYON_NUM_THREADS=$THREADS "$B" serve --target "$GGUF" --mode ar --cpu-products q8 \
                    --served-model-name m --max-batch 16 --port "$PORT" > "$OUT/$1.log" 2>&1 & ;;
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac
  PID=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "$1 did not come up: $(tail -5 "$OUT/$1.log")" >&2; exit 1
}

: > "$OUT/serve-rows.jsonl"
for s in $SERVERS; do
  start "$s"
  for load in $LOADS; do
    c=${load%%:*}; n=${load##*:}
    "$PY" bench/serve_load.py "http://127.0.0.1:$PORT" "$PROMPTS" --concurrency "$c" \
      --requests "$n" --max-tokens "$MAX_TOKENS" \
      | "$PY" -c "import json,sys; r=json.load(sys.stdin); r['server']='$s'; print(json.dumps(r))" \
      | tee -a "$OUT/serve-rows.jsonl"
  done
  kill -TERM "$PID"; wait "$PID" || true
done
"$PY" - "$OUT/serve-rows.jsonl" "$OUT/serve-side-by-side.json" "$(git rev-parse --short HEAD)" "$THREADS" <<'PYEOF'
import datetime, json, platform, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ref = {r["concurrency"]: r["output_tok_s"] for r in rows if r["server"] == "llama-server"}
for r in rows:
    if r["concurrency"] in ref:
        r["vs_llama_server"] = round(r["output_tok_s"] / ref[r["concurrency"]], 3)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
json.dump({
    "topic": "Serving", "title": "Serving on the CPU beside llama-server (SmolLM2)",
    "command": "B=target/release/dflash-rs OUT=out bench/serve_side_by_side.sh",
    "date": datetime.date.today().isoformat(), "device": f"{cpu}, {sys.argv[4]} threads",
    "commit": sys.argv[3],
    "reference": "llama.cpp's llama-server (the llama.cpp of llama-cpp-python 0.3.36; -np 16, continuous batching, --jinja) in the same run, same GGUF and threads",
    "notes": "SmolLM2-135M-Instruct Q4_1; the 36 chat prompts of bench/prompts/everyday.jsonl in turn, T = 0, 128 tokens a request, streaming; output tokens/s over the load's wall time; dflash-auto: the bundled drafter, a request alone speculative (auto), several as AR in one batch.",
    "columns": ["server", "concurrency", "requests", "output_tok_s", "vs_llama_server", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tau"],
    "rows": rows,
}, open(sys.argv[2], "w"), indent=1)
PYEOF
cat "$OUT/serve-side-by-side.json"
