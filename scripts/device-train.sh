#!/usr/bin/env bash
# The drafter pipeline for SmolLM2-135M or Qwen2.5-Coder-0.5B (B = 16) on a CUDA machine, in
# phases: check the device, regenerate data, train (time-limited, resumable), export, benchmark
# and evaluate. Every phase can stop and be re-run: training resumes from its last checkpoint,
# data generation from its last finished shard, and an evaluation whose report exists is skipped.
#
# Usage (from the repository root):  scripts/device-train.sh PHASE...
# Phases:
#   setup     check the target GGUF (fetched by scripts/fetch-assets.sh when missing), the
#             binary and the evaluation datasets; print the GPU
#   restore   unpack the committed shards (DATA_TAR) into $WORK/data
#   data      regenerate responses for $PROMPTS (greedy, batched decoding) for DATA_SECS
#             (finished shards are kept; continues an existing $WORK/data)
#   profile   the same with DFLASH_PROFILE=1 for PROFILE_SECS, then a profiled 8-step training
#             probe: time per phase of decoding and of a training step → $OUT
#   check     `dflash-rs check device` (CPU vs GPU parity, losslessness, kernels) → $OUT
#   probes    8 profiled training steps for each PROBES="PACK:ANCHORS:ACCUM …" → $OUT
#   plan      a short probe run times one optimizer step; the run's max_steps = TRAIN_SECS / step
#   cfg       the run's config with max_steps = STEPS (instead of plan)
#   train     train (or --resume) until UNTIL seconds after this call started, with a checkpoint
#   savedata  the data directory → $OUT/data.tar.xz
#   vocab     the draft vocabulary (VOCAB, 8192 tokens) of the data → $OUT/draft_vocab.json
#   export    the latest checkpoint as a bf16 drafter in $E, the run's records → $OUT
#   bench     `dflash-rs bench decode` of the drafter $E → $OUT/bench*.md
#   reference the PyTorch reference (bench/zlab_reference.py: z-lab dflash, transformers) → $OUT
#   refrun    the PyTorch reference trainer (bench/train_reference_run.py) on the steps `train`
#             wrote to PLAN_OUT, from INIT_FROM, until UNTIL (continued by the next refrun); its
#             drafter exported as bf16 to $WORK/ref-export (evaluate it with E=$WORK/ref-export
#             EVAL_DIR=$WORK/eval-ref)
#   shape     `dflash-rs bench shape` on SHAPES (random weights; no GGUF needed) → $OUT
#   mfu       `dflash-rs bench train` on the Qwen3-8B and SmolLM2 shapes (random weights) → $OUT
#   eval      `dflash-rs eval` of $E on EVAL_DATASETS at EVAL_TEMPS, one run after another
#
# Paths (environment):
#   DFLASH_HOME  asset cache (~/.cache/dflash-rs); TARGET the alias of the target's GGUF:
#                smollm2-135m (default) or qwen2.5-coder-0.5b (its drafter: LAYERS=3 fits 100 MB)
#   B            the CUDA binary (target/cuda/release/dflash-rs, from scripts/cuda-build.sh)
#   WORK         data, run, export and probes ($DFLASH_HOME/device-train); OUT: logs ($WORK/out)
#   PROMPTS      the prompt file for `data` ($WORK/prompts.jsonl; docs/GPU.md has the command)
#   DATA_TAR     shards to restore (assets/data/smollm2-135m-regen-1024.tar.xz)
#   E            the drafter to bench and evaluate ($WORK/export when it exists, else the target's
#                bundled assets/drafters/$TARGET-b16)
#   Optional, for machines that receive files instead of fetching them: STAGE (a directory of
#   the GGUF's parts, part00 part01 …, concatenated by setup), BIN_XZ (an xz-compressed binary,
#   unpacked to B), DATASETS_TAR (a tar.xz of $DFLASH_HOME/datasets/…), PROMPTS_XZ (PROMPTS,
#   xz-compressed), WHEELS (a directory of wheels for `reference`).
# Knobs: DEV (cuda), TRAIN_DTYPE (bf16), DATA_DTYPE (f32; bf16 prefills 5× faster and rounds some
#   greedy choices differently), DATA_SECS (240; DATA_UNTIL: until that many seconds after the
#   call started), DATA_TOKENS (1024), BATCH (128), SHARD (64; a shard is written only when all
#   of its prompts are done, and continuing shards needs the same size), TRAIN_SECS (900, plan),
#   STEPS (cfg), UNTIL (560), ANCHORS (256), PACK (pack sequences into rows of this many tokens;
#   unset: one sequence per row), ACCUM (4), LOOP_WINDOW (cut each response after its first
#   repeated window of this many tokens), DATA_LOOP (the same cut while regenerating: a response
#   ends at its first repeated window of this many tokens; 0: never), DATA_GRAPHS ("1": batched
#   steps replayed from a CUDA graph), DATA_TEMP (0: greedy responses; 1: sampled, seed 0 — the
#   lower τ at T = 0, docs/bench/greedy-vs-sampled-h200-2026-12-05.json), DATA_LIMIT (the prompt file's first N), INIT_FROM (a drafter directory to continue from: same
#   weights, fresh optimizer), CACHE_MB (device memory for target features kept between epochs,
#   0: runs with a 30–60 GB cache ran out of device memory, docs/BENCHMARKS.md), LR (6e-4) and
#   WARMUP (0.04: the share of the steps warming up to LR; a continuation's knobs), LAYERS (the
#   drafter's layers from a random init, 5; a shape ablation's knob), BENCH_MODES
#   (ar,dflash,ddtree:8), BENCH_TOKENS (256), REPEATS (1), GRAPHS ("1": with --cuda-graphs;
#   "0 1": without and with), SHAPES (bench/shapes/smollm2-135m.json qwen3-8b), EVAL_LIMIT (32;
#   EVAL_LIMITS="mt-bench:32 …" per dataset), EVAL_TOKENS (256), EVAL_DATASETS (the four),
#   EVAL_TEMPS (0 1), EVAL_MODES (ar,dflash,ddtree:8,ddtree:32), EVAL_ARGS (more eval flags, e.g.
#   --cuda-graphs), EVAL_MIN (200: seconds a run needs to start), EVAL_DIR ($WORK/eval), PLAN_OUT
#   (`train --plan-out`: each step's rows and anchors, for `refrun`; needs INIT_FROM).
# The shipped drafters' commands are in their cards (assets/drafters/*/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
export DFLASH_HOME=${DFLASH_HOME:-$HOME/.cache/dflash-rs}
TARGET=${TARGET:-smollm2-135m}
case $TARGET in
  smollm2-135m)
    G=$DFLASH_HOME/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf ASSET=smollm2
    G_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ;;
  qwen2.5-coder-0.5b)
    G=$DFLASH_HOME/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ASSET=qwen2.5-coder
    G_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 ;;
  *) echo "TARGET must be smollm2-135m or qwen2.5-coder-0.5b, got '$TARGET'" >&2; exit 2 ;;
esac
B=${B:-target/cuda/release/dflash-rs}
WORK=${WORK:-$DFLASH_HOME/device-train}
OUT=${OUT:-$WORK/out}; mkdir -p "$OUT" "$WORK"
PROMPTS=${PROMPTS:-$WORK/prompts.jsonl}
DEV=${DEV:-cuda}
TRAIN_DTYPE=${TRAIN_DTYPE:-bf16}
D=$WORK/data
R=$WORK/run
if [ -z "${E:-}" ]; then
  if [ -f "$WORK/export/model.safetensors" ] || [ ! -f "assets/drafters/$TARGET-b16/model.safetensors" ]; then
    E=$WORK/export
  else
    E=assets/drafters/$TARGET-b16
  fi
fi
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/log.txt"; }
elapsed() { echo $(( $(date +%s) - T0 )); }
# CUDA runtime libraries: the toolchain of scripts/cuda-build.sh, or a torch venv's nvidia wheels
for lib in "$DFLASH_HOME/cuda-13.0/site/nvidia/cu13/lib" "$DFLASH_HOME/cuda-13.0/site/nvidia/nccl/lib" \
    "$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)/nvidia/cu13/lib" \
    "$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)/nvidia/nccl/lib" /usr/local/cuda/lib64; do
  [ -d "$lib" ] && LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
done
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}

need_gguf() {
  if [ ! -f "$G" ]; then
    mkdir -p "$(dirname "$G")"
    if [ -n "${STAGE:-}" ]; then cat "$STAGE"/part* > "$G"; else scripts/fetch-assets.sh "$ASSET" >&2; fi
  fi
  echo "$G_SHA  $G" | sha256sum -c --quiet || { log "GGUF checksum failed: $G"; exit 1; }
}

setup() {
  need_gguf
  if [ -n "${BIN_XZ:-}" ]; then mkdir -p "$(dirname "$B")" && xz -d -c "$BIN_XZ" > "$B" && chmod +x "$B"; fi
  [ -x "$B" ] || { log "no binary at $B (scripts/cuda-build.sh builds it)"; exit 1; }
  if [ -n "${DATASETS_TAR:-}" ]; then tar -C "$DFLASH_HOME" -xJf "$DATASETS_TAR";
  elif [ ! -f "$DFLASH_HOME/datasets/gsm8k/test.jsonl" ]; then scripts/fetch-assets.sh datasets >&2 || log "setup: evaluation datasets not fetched"; fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
}

restore() {
  tar -C "$WORK" -xJf "${DATA_TAR:-assets/data/smollm2-135m-regen-1024.tar.xz}" && log "restore: $(ls "$D" | wc -l) files in $D"
}

prompts() {
  if [ ! -f "$PROMPTS" ] && [ -n "${PROMPTS_XZ:-}" ]; then xz -d -c "$PROMPTS_XZ" > "$PROMPTS"; fi
  [ -f "$PROMPTS" ] || { log "no prompt file at $PROMPTS (docs/GPU.md: dflash-rs data prompts)"; exit 1; }
}

generate() { # $1 seconds
  local graphs=""
  [ "${DATA_GRAPHS:-0}" = 1 ] && graphs=--cuda-graphs
  $B data generate --target "$TARGET" --prompts "$PROMPTS" --out "$D" --time-limit "$1" \
    --max-new-tokens "${DATA_TOKENS:-1024}" --batch-size "${BATCH:-128}" --shard-size "${SHARD:-64}" \
    --loop-window "${DATA_LOOP:-0}" --device "$DEV" --dtype "${DATA_DTYPE:-f32}" $graphs \
    --temperature "${DATA_TEMP:-0}" ${DATA_LIMIT:+--limit "$DATA_LIMIT"}
}

profile() {
  prompts
  DFLASH_PROFILE=1 generate "${PROFILE_SECS:-60}" > "$OUT/profile-data.log" 2>&1
  rm -rf "$WORK/pprobe"
  config 8 > "$WORK/pprobe.json"
  DFLASH_PROFILE=1 train_cmd --out "$WORK/pprobe" --config "$WORK/pprobe.json" > "$OUT/profile-train.log" 2>&1
  log "profile: $(grep -c . "$OUT/profile-train.log") lines"
}

data() {
  prompts
  [ -n "${DATA_UNTIL:-}" ] && DATA_SECS=$(( DATA_UNTIL - $(elapsed) ))
  if [ "${DATA_SECS:-240}" -lt 20 ]; then log "data: skipped, ${DATA_SECS} s left"; return; fi
  log "data: $(wc -l < "$PROMPTS") prompts, ${DATA_SECS:-240} s"
  generate "${DATA_SECS:-240}" > "$OUT/data.log" 2>&1
  python3 - "$D/manifest.json" <<'EOF' | tee -a "$OUT/log.txt"
import json, sys
m = json.load(open(sys.argv[1]))
s = m["shards"]
print(f"data: {len(s)} shards, {sum(x['sequences'] for x in s)} sequences, "
      f"{sum(x['supervised_tokens'] for x in s)} supervised tokens, {sum(x['tokens'] for x in s)} tokens")
EOF
}

config() { # $1 max_steps → the run's training recipe (device and dtype are flags of train)
  local n=$1
  local INIT=""
  [ -n "${INIT_FROM:-}" ] && INIT=", \"init_from\": \"$INIT_FROM\""
  [ -n "${PACK:-}" ] && INIT="$INIT, \"pack_length\": $PACK"
  [ -n "${LOOP_WINDOW:-}" ] && INIT="$INIT, \"loop_window\": $LOOP_WINDOW"
  local every=$(( n / 8 > 25 ? n / 8 : 25 ))
  cat <<EOF
{"num_draft_layers": ${LAYERS:-5}, "block_size": 16, "num_anchors": ${ANCHORS:-256}, "max_length": 2048,
 "lr": ${LR:-6e-4}, "warmup_ratio": ${WARMUP:-0.04}, "grad_accum": ${ACCUM:-4}, "max_steps": $n,
 "save_every": $every, "val_every": $every, "val_sequences": 32, "keep_last": 2,
 "seed": 0, "init_seed": 0$INIT}
EOF
}

train_cmd() { $B train --target "$TARGET" --data "$D" --device "$DEV" --dtype "$TRAIN_DTYPE" "$@"; }

probes() { # PROBES="PACK:ANCHORS:ACCUM …" (PACK 0 = one sequence per row): 8 profiled steps each
  for c in ${PROBES:-0:256:4 2048:512:2}; do
    IFS=: read -r pk an ac <<< "$c"
    local p=""; [ "$pk" != 0 ] && p=$pk
    rm -rf "$WORK/pp"
    PACK=$p ANCHORS=$an ACCUM=$ac config 8 > "$WORK/pp.json"
    DFLASH_PROFILE=1 train_cmd --out "$WORK/pp" --config "$WORK/pp.json" > "$OUT/probe-$pk-$an-$ac.log" 2>&1
    log "probe pack $pk anchors $an accum $ac: $(tail -n 1 "$WORK/pp/metrics.jsonl" | cut -c1-200)"
  done
}

plan() {
  rm -rf "$WORK/probe"
  config 8 > "$WORK/probe.json"
  train_cmd --out "$WORK/probe" --config "$WORK/probe.json" > "$OUT/probe.log" 2>&1
  local n
  n=$(python3 - "$WORK/probe/metrics.jsonl" "${TRAIN_SECS:-900}" <<'EOF'
import json, sys
ms = [json.loads(l) for l in open(sys.argv[1])]
# elapsed after step k = cumulative supervised tokens / cumulative rate; skip the warm-up steps
# and the last one (it validates and writes the checkpoint: 2.2x the step time when counted)
t = []; c = 0
for m in ms:
    c += m["supervised_tokens"]; t.append(c / m["tokens_per_sec"])
per = (t[-2] - t[2]) / (len(t) - 4)
print(max(10, int(float(sys.argv[2]) / per)))
print(f"probe: {per:.3f} s/step, {ms[-1]['tokens_per_sec']:.0f} supervised tok/s", file=sys.stderr)
EOF
  )
  log "plan: max_steps $n for ${TRAIN_SECS:-900} s ($(tail -c 300 "$OUT/probe.log" | tr '\n' ' ' | tail -c 120))"
  config "$n" > "$WORK/cfg.json"
}

train() {
  local left=$(( ${UNTIL:-560} - $(elapsed) ))
  local resume=""
  [ -f "$R/latest" ] && resume=--resume
  if [ "$left" -lt 20 ]; then log "train: skipped, $left s left"; return; fi
  log "train: $resume for at most $left s"
  local plan=()
  [ -n "${PLAN_OUT:-}" ] && plan=(--plan-out "$PLAN_OUT")
  train_cmd --out "$R" --config "$WORK/cfg.json" $resume --time-limit "$left" \
    --feature-cache-mb "${CACHE_MB:-0}" "${plan[@]}" >> "$OUT/train.log" 2>&1
  log "train: exit $?, $(tail -n 1 "$R/metrics.jsonl" | cut -c1-300)"
}

export_() {
  local latest
  latest=$(cat "$R/latest") || { log "export: no checkpoint in $R"; return; }
  E=$WORK/export
  rm -rf "$E"
  $B drafter export --from "$R/checkpoints/$latest/drafter" --out "$E" --force --dtype bf16 2>&1 | tee -a "$OUT/log.txt"
  [ -n "${SAVE_DATA:-}" ] && tar -C "$WORK" -cJf "$OUT/data.tar.xz" data
  tar -C "$WORK" -cJf "$OUT/run.tar.xz" run/metrics.jsonl run/train_config.json export/config.json \
    export/training.json data/manifest.json cfg.json
  log "export: $latest → $E ($(du -b "$E/model.safetensors" | cut -f1) bytes)"
}

bench() {
  need_gguf
  for g in ${GRAPHS:-1}; do
    local flag="" name=bench
    [ "$g" = 1 ] && flag=--cuda-graphs && name=bench-graphs
    $B bench decode --target "$TARGET" --device "$DEV" --dtype bf16 --modes "${BENCH_MODES:-ar,dflash,ddtree:8}" \
      --max-new-tokens "${BENCH_TOKENS:-256}" --repeats "${REPEATS:-1}" $flag --drafter "$E" ${BENCH_ARGS:-} \
      > "$OUT/$name.md" 2>&1
    log "bench ($name): exit $?"
  done
}

reference() {
  need_gguf
  if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl \
      && export PYTHONPATH=$WORK/site
  fi
  timeout 300 python3 bench/zlab_reference.py "$G" "${BENCH_TOKENS:-256}" 2>&1 | grep -v -i warn | tail -5 | tee "$OUT/reference.txt"
}

refrun() {
  need_gguf
  local left=$(( ${UNTIL:-560} - $(elapsed) ))
  [ -n "${PLAN_OUT:-}" ] && [ -n "${INIT_FROM:-}" ] || { log "refrun: needs PLAN_OUT and INIT_FROM"; return; }
  if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl \
      && export PYTHONPATH=$WORK/site
  fi
  if [ -f "$WORK/ref/drafter/model.safetensors" ] && [ ! -f "$WORK/ref/state.pt" ]; then
    log "refrun: finished before"; return
  fi
  log "refrun: for at most $left s"
  # stops cleanly after the step that ends 90 s before the budget (state in $WORK/ref/state.pt,
  # continued by the next refrun); the timeout is a backstop
  timeout "$left" python3 bench/train_reference_run.py --target "$G" --init "$INIT_FROM" --plan "$PLAN_OUT" \
    --config "$R/train_config.json" --out "$WORK/ref" --device "$DEV" --dtype "$TRAIN_DTYPE" \
    --time-limit $(( left > 180 ? left - 90 : left / 2 )) >> "$OUT/refrun.log" 2>&1
  log "refrun: exit $?, $(tail -n 1 "$WORK/ref/curve.jsonl" 2>/dev/null | cut -c1-200)"
  if [ -f "$WORK/ref/drafter/model.safetensors" ]; then
    rm -rf "$WORK/ref-export"
    $B drafter export --from "$WORK/ref/drafter" --out "$WORK/ref-export" --force --dtype bf16 >> "$OUT/log.txt" 2>&1
    tar -C "$WORK" -cJf "$OUT/ref.tar.xz" ref/curve.jsonl ref-export/config.json
  fi
}

eval_() {
  # one run after another (several processes on one GPU serialise their kernels), temperatures
  # outer: every dataset at T = 0 first. A run starts only with EVAL_MIN seconds left before UNTIL
  # and stops between items at UNTIL; a run whose report exists is not repeated, so the same
  # command run again works through the rest of the list.
  local lim=${EVAL_LIMIT:-32} tok=${EVAL_TOKENS:-256}
  local dir=${EVAL_DIR:-$WORK/eval}
  mkdir -p "$dir"
  for t in ${EVAL_TEMPS:-0 1}; do
    for ds in ${EVAL_DATASETS:-gsm8k humaneval mt-bench math500}; do
      local o=$dir/$ds-t$t left
      [ -f "$o/report.json" ] && { log "eval $ds T=$t: done before"; continue; }
      left=$(( ${UNTIL:-560} - $(elapsed) ))
      if [ "$left" -lt "${EVAL_MIN:-200}" ]; then log "eval $ds T=$t: not started, $left s left"; continue; fi
      local l=$lim; [[ " ${EVAL_LIMITS:-} " == *" $ds:"* ]] && l=$(sed -E "s/.* $ds:([0-9]+) .*/\1/" <<< " $EVAL_LIMITS ")
      timeout "$left" $B eval --target "$TARGET" --dataset "$ds" --limit "$l" --drafter "$TARGET-b16=$E" \
        --time-limit $(( left - 20 )) \
        --modes "${EVAL_MODES:-ar,dflash,ddtree:8,ddtree:32}" --max-new-tokens "$tok" --temperature "$t" \
        --device "$DEV" --dtype "$TRAIN_DTYPE" ${EVAL_ARGS:-} --out "$o" > "$o.log" 2>&1
      log "eval $ds T=$t: exit $?; $(grep -E 'time limit|τ pooled' "$o.log" | sed 's/  */ /g' | tr '\n' ';')"
      tar -C "$dir/.." -cJf "$OUT/$(basename "$dir").tar.xz" "$(basename "$dir")"
    done
  done
}

for p in "$@"; do
  case $p in
    setup) setup ;;
    restore) restore ;;
    profile) profile ;;
    probes) probes ;;
    check) need_gguf; $B check device --target "$TARGET" --device "$DEV" --dtype bf16 > "$OUT/check-device.md" 2>&1
           log "check: exit $?, $(grep -ci fail "$OUT/check-device.md") lines mention a failure" ;;
    data) data ;;
    vocab) $B data vocab --data "$D" --size "${VOCAB:-8192}" --out "$OUT/draft_vocab.json" --force >> "$OUT/log.txt" 2>&1
           log "vocab: exit $?" ;;
    plan) plan ;;
    cfg) config "${STEPS:?cfg needs STEPS}" > "$WORK/cfg.json" && log "cfg: max_steps $STEPS" ;;
    train) train ;;
    export) export_ ;;
    savedata) tar -C "$WORK" -cJf "$OUT/data.tar.xz" data && log "savedata: $(du -b "$OUT/data.tar.xz" | cut -f1) bytes" ;;
    bench) bench ;;
    reference) reference ;;
    refrun) refrun ;;
    shape) for sh in ${SHAPES:-bench/shapes/smollm2-135m.json qwen3-8b}; do
             $B bench shape --shape "$sh" --device "$DEV" --dtype bf16 ${SHAPE_ARGS:-} >> "$OUT/bench-shape.md" 2>&1
             log "bench shape $sh: exit $?"
           done ;;
    mfu) for sh in qwen3-8b bench/shapes/smollm2-135m.json; do
           $B bench train --shape "$sh" --device "$DEV" --dtype bf16 --seq-len 2048 --anchors 512 --peak-tflops 989 \
             >> "$OUT/bench-train.md" 2>&1
           log "bench train $sh: exit $?"
         done ;;
    eval) eval_ ;;
    *) log "unknown phase $p"; exit 2 ;;
  esac
done
log "phases done: $*"
