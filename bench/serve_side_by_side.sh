#!/usr/bin/env bash
# `dflash-rs serve` beside llama.cpp's `llama-server` on the CPU, one streaming load
# (bench/serve_load.py: the chat prompts of bench/prompts/everyday.jsonl, T = 0, 128 tokens a
# request) at concurrency 1, 4 and 16 against each server in turn, same GGUF, same threads;
# writes one JSON record (the rows of every server and concurrency).
#
#   B=target/release/dflash-rs OUT=out bench/serve_side_by_side.sh
#   SERVERS="llama-server dflash-auto dflash-ar"   (default; also llama-cpp-python, dflash-auto-q8, dflash-ar-q8,
#            dflash-spec: --batch-speculation on, dflash-chain: on with --mode dflash)
#   DEVICE="--device cuda --dtype bf16"            (dflash-rs's device; llama-server runs on the CPU)
#   PROMPTS=humaneval                               (HumanEval's first 36 tasks as chat requests, from
#                                                    HUMANEVAL, default the fetch-assets copy)
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
DEVICE=${DEVICE:-}
DRAFTER=${DRAFTER:-assets/drafters/smollm2-135m-b16}
mkdir -p "$OUT"
if [ "$PROMPTS" = humaneval ]; then
  HUMANEVAL=${HUMANEVAL:-$HOME/.cache/dflash-rs/datasets/humaneval/HumanEval.jsonl.gz}
  "$PY" -c 'import gzip, json, sys
for l in list(gzip.open(sys.argv[1], "rt"))[:36]:
    print(json.dumps({"prompt": "Complete this Python function.\n\n" + json.loads(l)["prompt"]}))' \
    "$HUMANEVAL" > "$OUT/humaneval.jsonl"
  PROMPTS=$OUT/humaneval.jsonl
fi
case " $SERVERS " in *" llama-server "*) LLAMA=$(scripts/build-llama-server.sh) ;; esac
case " $SERVERS " in *" llama-cpp-python "*) LCP=$(scripts/install-llama-cpp-python.sh) ;; esac

get() { # get PATH: the body of GET http://127.0.0.1:$PORT/PATH (python's urllib: curl may be missing)
  "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())' \
    "http://127.0.0.1:$PORT/$1" 2>/dev/null
}

dflash() { # dflash NAME: dflash-rs serve in the flags NAME stands for, in the background
  local flags
  case "$1" in
    dflash-auto) flags="--drafter $DRAFTER" ;;
    dflash-auto-q8) flags="--drafter $DRAFTER --cpu-products q8" ;;
    dflash-spec) flags="--drafter $DRAFTER --batch-speculation on" ;;
    dflash-chain) flags="--drafter $DRAFTER --batch-speculation on --mode dflash" ;;
    dflash-ar) flags="--mode ar" ;;
    dflash-ar-q8) flags="--mode ar --cpu-products q8" ;;
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086
  RAYON_NUM_THREADS=$THREADS "$B" serve --target "$GGUF" $flags $DEVICE --served-model-name m \
    --max-batch 16 --port "$PORT" > "$OUT/$1.log" 2>&1 &
}

start() { # start NAME: the server NAME on $PORT, waiting for /health
  case "$1" in
    llama-server) "$LLAMA" -m "$GGUF" -t "$THREADS" -np 16 -cb -c 32768 --jinja --port "$PORT" \
                    > "$OUT/$1.log" 2>&1 & ;;
    # one request at a time; its default interrupt_requests cuts a stream when the next arrives
    llama-cpp-python) "$LCP" -m llama_cpp.server --model "$GGUF" --n_threads "$THREADS" --n_ctx 4096 \
                    --interrupt_requests False --host 127.0.0.1 --port "$PORT" > "$OUT/$1.log" 2>&1 & ;;
    dflash-*) dflash "$1" ;;
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac
  PID=$!
  for _ in $(seq 1 900); do
    get v1/models > /dev/null && return 0
    sleep 0.2
  done
  echo "$1 did not come up: $(tail -5 "$OUT/$1.log")" >&2; exit 1
}

: > "$OUT/serve-rows.jsonl"
rounds() { # the batch's rounds so far by kind (dflash-rs's /metrics), as JSON
  { get metrics || true; } | "$PY" -c '
import json, re, sys
n = {"ar": 0, "draft": 0}
for l in sys.stdin:
    m = re.match(r"dflash:batch_rounds_total\{.*kind=\"(\w+)\".*\} (\S+)", l)
    if m:
        n[m.group(1)] += float(m.group(2))
print(json.dumps(n))'
}

for s in $SERVERS; do
  start "$s"
  for load in $LOADS; do
    c=${load%%:*}; n=${load##*:}
    before=$(rounds)
    "$PY" bench/serve_load.py "http://127.0.0.1:$PORT" "$PROMPTS" --concurrency "$c" \
      --requests "$n" --max-tokens "$MAX_TOKENS" > "$OUT/load.json"
    "$PY" -c "import json,sys; r=json.load(open('$OUT/load.json')); b=json.loads(sys.argv[1]); a=json.loads(sys.argv[2])
r['server']='$s'
if '$s'.startswith('dflash'):
    r['batch_ar_rounds'], r['batch_draft_rounds'] = int(a['ar']-b['ar']), int(a['draft']-b['draft'])
print(json.dumps(r))" "$before" "$(rounds)" | tee -a "$OUT/serve-rows.jsonl"
  done
  kill -TERM "$PID"; wait "$PID" || true
done
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
"$PY" - "$OUT/serve-rows.jsonl" "$OUT/serve-side-by-side.json" "$COMMIT" "$THREADS" "$DEVICE" "$GPU" <<'PYEOF'
import datetime, json, platform, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for base, key in [("llama-server", "vs_llama_server"), ("dflash-ar", "vs_dflash_ar")]:
    ref = {r["concurrency"]: r["output_tok_s"] for r in rows if r["server"] == base}
    for r in rows:
        if r["concurrency"] in ref:
            r[key] = round(r["output_tok_s"] / ref[r["concurrency"]], 3)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
gpu = "cuda" in sys.argv[5]
json.dump({
    "topic": "Serving",
    "title": "Serving on a GPU: the speculative batch beside AR (SmolLM2)" if gpu else "Serving on the CPU beside llama-server (SmolLM2)",
    "command": f"B=target/release/dflash-rs OUT=out DEVICE='{sys.argv[5]}' bench/serve_side_by_side.sh" if gpu else "B=target/release/dflash-rs OUT=out bench/serve_side_by_side.sh",
    "date": datetime.date.today().isoformat(),
    "device": f"{sys.argv[6]}; dflash-rs {sys.argv[5]}" if gpu else f"{cpu}, {sys.argv[4]} threads",
    "commit": sys.argv[3],
    "reference": "dflash-rs --mode ar in the same call" if gpu else "llama.cpp's llama-server (the llama.cpp of llama-cpp-python 0.3.36; -np 16, continuous batching, --jinja) in the same run, same GGUF and threads",
    "notes": "SmolLM2-135M-Instruct Q4_1; the 36 chat prompts of bench/prompts/everyday.jsonl in turn, T = 0, 128 tokens a request, streaming; output tokens/s over the load's wall time; dflash-auto: the bundled drafter, a request alone speculative (auto), several as AR in one batch; dflash-spec: the same with --batch-speculation on (several in one speculative batch); llama-cpp-python: its server (0.3.36, built by pip for this CPU, interrupt_requests off), one request at a time.",
    "columns": ["server", "concurrency", "requests", "output_tok_s", "vs_dflash_ar" if gpu else "vs_llama_server", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tau", "batch_draft_rounds", "batch_ar_rounds"],
    "rows": rows,
}, open(sys.argv[2], "w"), indent=1)
PYEOF
cat "$OUT/serve-side-by-side.json"
