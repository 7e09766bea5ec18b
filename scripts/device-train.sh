#!/usr/bin/env bash
# The first real drafter (SmolLM2-135M, B = 16) on the GPU machine, in phases that fit the
# 10-minute calls of one warm lease: state lives under /root between back-to-back calls, and
# what must outlast the lease comes back through $OUT.
#
# Usage (on the device, from the repository root):
#   scripts/device-train.sh PHASE...
# Phases, in order:
#   setup   assemble the staged GGUF (/root/stage/smollm2.gguf/part*), unpack .device/dflash-rs.xz
#           and .device/datasets.tar.xz (evaluation datasets) when carried
#   restore unpack the shards of earlier leases (DATA_TAR, default the committed
#           assets/data/smollm2-135m-regen-1024.tar.xz, 17,553 sequences, 1,024-token cap, shards of
#           16: the seventh session's prompt file is used up, see docs/GPU.md) into $ROOT/data
#   data    regenerate responses for .device/prompts.jsonl.xz (greedy, f32, batched decoding),
#           stopped after DATA_SECS (finished shards are kept; the manifest lists them);
#           continues an existing $ROOT/data
#   profile the same with DFLASH_PROFILE=1 for PROFILE_SECS, then a profiled 8-step training
#           probe: time per phase of decoding and of a training step → $OUT
#   check   `dflash-rs device-check` (CPU vs GPU parity, losslessness) → $OUT/device-check.md
#   probes  8 profiled training steps for each PROBES="PACK:ANCHORS:ACCUM …" → $OUT/probe-*.log
#   plan    a short probe run times one optimizer step; the run's max_steps = TRAIN_SECS / step
#   cfg     the run's config with max_steps = STEPS (instead of plan: when the step time changes
#           during the run, e.g. once the feature cache holds every row)
#   train   train (or --resume) until UNTIL seconds after this call started, with a checkpoint
#   savedata the data directory → $OUT/data.tar.xz
#   export  the latest checkpoint as bf16 + the run's records → $OUT (and the data with SAVE_DATA=1)
#   bench   `dflash-rs bench` of the exported drafter (AR, DFlash, DDTree-8; CUDA graphs) → $OUT
#   eval    the exported drafter (or E): `dflash-rs eval` on the four datasets, one run after another
# Environment: DATA_SECS (240; DATA_UNTIL: until that many seconds after this call started), TRAIN_SECS (900), UNTIL (560), BATCH (128), SHARD (64),
#   DATA_TOKENS (1024), ANCHORS (anchors per training row, 256), PACK (pack training sequences
#   into rows of this many tokens; unset: one sequence per row), ACCUM (rows per step, 4),
#   EVAL_LIMIT (32; EVAL_LIMITS="mt-bench:32 …" per dataset), EVAL_TOKENS (256), EVAL_DATASETS (the four), EVAL_TEMPS (0 1), EVAL_MODES
#   (ar,dflash,ddtree:8,ddtree:32), EVAL_ARGS (more eval flags, e.g. --cuda-graphs), E (the
#   drafter to evaluate: the export by default), EVAL_MIN (200: seconds a run needs to start), INIT_FROM (a drafter directory to continue from, e.g. the committed
#   assets/drafters/smollm2-135m-b16: fresh optimizer, same weights), STEPS (for cfg), CACHE_MB
#   (device memory for the target features kept between epochs, 0: at SmolLM2's size the
#   features cost little to recompute, and runs with a 30–60 GB cache ran out of device memory
#   after ≈ 1,000 steps, docs/BENCHMARKS.md, seventh session), DATA_DTYPE (regeneration
#   dtype, f32; bf16 prefills 5× faster and rounds some greedy choices differently),
#   LOOP_WINDOW (cut each response after its first repeated window of this many tokens:
#   `loop_window` in the training config; 32 keeps 25 % of the ninth session's data).
# The eighth session's run (the shipped drafter): DATA_DTYPE=bf16 BATCH=256 SHARD=16
#   DATA_TOKENS=1024 DATA_UNTIL=555 … setup restore data savedata, then STEPS=6500 PACK=2048
#   ANCHORS=512 ACCUM=2 INIT_FROM=… UNTIL=580 … cfg train export, then UNTIL=575 … train export
#   (--resume), then bench. The seventh session's: the same with STEPS=7000 over four calls.
# The run of 2026-11-30 (docs/BENCHMARKS.md): PROFILE_SECS=60 DATA_SECS=120 DATA_TOKENS=384
#   SHARD=16 BATCH=64 TRAIN_SECS=500 UNTIL=585 … setup restore profile data plan train, then
#   UNTIL=225 … train export. Keep SHARD well below BATCH × (time / longest response): a shard
#   is written only when all of its prompts are done.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# overridable for a dry run on the CPU: ROOT=/tmp/x DEV=cpu TRAIN_DTYPE=f32 B=target/release/dflash-rs
ROOT=${ROOT:-/root}
export DFLASH_HOME=${DFLASH_HOME:-$ROOT/dh}
B=${B:-$ROOT/dflash-rs}
DEV=${DEV:-cuda}
TRAIN_DTYPE=${TRAIN_DTYPE:-bf16}
D=$ROOT/data
R=$ROOT/run
E=${E:-$ROOT/export}
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/log.txt"; }
elapsed() { echo $(( $(date +%s) - T0 )); }
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}

setup() {
  mkdir -p $DFLASH_HOME/models/smollm2-135m $ROOT
  local g=$DFLASH_HOME/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$g" ] || cat /root/stage/smollm2.gguf/part* > "$g"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $g" | sha256sum -c --quiet || { log "GGUF checksum failed"; exit 1; }
  if [ -f .device/dflash-rs.xz ]; then xz -d -c .device/dflash-rs.xz > $B && chmod +x $B; fi
  # the evaluation datasets (tar of $DFLASH_HOME/datasets/{gsm8k,humaneval,math500,mt-bench})
  if [ -f .device/datasets.tar.xz ]; then tar -C $DFLASH_HOME -xJf .device/datasets.tar.xz; fi
  [ -x $B ] || { log "no binary at $B"; exit 1; }
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
}

restore() {
  mkdir -p $ROOT && tar -C $ROOT -xJf "${DATA_TAR:-assets/data/smollm2-135m-regen-1024.tar.xz}" && log "restore: $(ls $D | wc -l) files in $D"
}

profile() {
  [ -f $ROOT/prompts.jsonl ] || xz -d -c .device/prompts.jsonl.xz > $ROOT/prompts.jsonl
  DFLASH_PROFILE=1 $B data generate --prompts $ROOT/prompts.jsonl --out $D --time-limit "${PROFILE_SECS:-60}" \
    --max-new-tokens "${DATA_TOKENS:-1024}" --batch-size "${BATCH:-128}" --shard-size "${SHARD:-64}" --device $DEV --dtype "${DATA_DTYPE:-f32}" \
    > "$OUT/profile-data.log" 2>&1
  rm -rf $ROOT/pprobe
  config 8 > $ROOT/pprobe.json
  DFLASH_PROFILE=1 $B train --data $D --out $ROOT/pprobe --config $ROOT/pprobe.json > "$OUT/profile-train.log" 2>&1
  log "profile: $(grep -c . "$OUT/profile-train.log") lines"
}

data() {
  [ -f $ROOT/prompts.jsonl ] || xz -d -c .device/prompts.jsonl.xz > $ROOT/prompts.jsonl
  [ -n "${DATA_UNTIL:-}" ] && DATA_SECS=$(( DATA_UNTIL - $(elapsed) ))
  if [ "${DATA_SECS:-240}" -lt 20 ]; then log "data: skipped, ${DATA_SECS} s left"; return; fi
  log "data: $(wc -l < $ROOT/prompts.jsonl) prompts, ${DATA_SECS:-240} s"
  $B data generate --prompts $ROOT/prompts.jsonl --out $D --time-limit "${DATA_SECS:-240}" \
    --max-new-tokens "${DATA_TOKENS:-1024}" --batch-size "${BATCH:-128}" --shard-size "${SHARD:-64}" --device $DEV --dtype "${DATA_DTYPE:-f32}" \
    > "$OUT/data.log" 2>&1
  python3 - "$D/manifest.json" <<'EOF' | tee -a "$OUT/log.txt"
import json, sys
m = json.load(open(sys.argv[1]))
s = m["shards"]
print(f"data: {len(s)} shards, {sum(x['sequences'] for x in s)} sequences, "
      f"{sum(x['supervised_tokens'] for x in s)} supervised tokens, {sum(x['tokens'] for x in s)} tokens")
EOF
}

config() { # $1 max_steps → the run's training config
  local n=$1
  local INIT=""
  [ -n "${INIT_FROM:-}" ] && INIT=", \"init_from\": \"$INIT_FROM\""
  [ -n "${PACK:-}" ] && INIT="$INIT, \"pack_length\": $PACK"
  [ -n "${LOOP_WINDOW:-}" ] && INIT="$INIT, \"loop_window\": $LOOP_WINDOW"
  local every=$(( n / 8 > 25 ? n / 8 : 25 ))
  cat <<EOF
{"num_draft_layers": 5, "block_size": 16, "num_anchors": ${ANCHORS:-256}, "max_length": 2048,
 "lr": 6e-4, "warmup_ratio": 0.04, "grad_accum": ${ACCUM:-4}, "max_steps": $n,
 "save_every": $every, "val_every": $every, "val_sequences": 32, "keep_last": 2,
 "seed": 0, "init_seed": 0, "dtype": "$TRAIN_DTYPE", "device": "$DEV"$INIT}
EOF
}

probes() { # PROBES="PACK:ANCHORS:ACCUM …" (PACK 0 = one sequence per row): 8 profiled steps each
  for c in ${PROBES:-0:256:4 2048:512:2}; do
    IFS=: read -r pk an ac <<< "$c"
    local p=""; [ "$pk" != 0 ] && p=$pk
    rm -rf $ROOT/pp
    PACK=$p ANCHORS=$an ACCUM=$ac config 8 > $ROOT/pp.json
    DFLASH_PROFILE=1 $B train --data $D --out $ROOT/pp --config $ROOT/pp.json > "$OUT/probe-$pk-$an-$ac.log" 2>&1
    log "probe pack $pk anchors $an accum $ac: $(tail -n 1 $ROOT/pp/metrics.jsonl | cut -c1-200)"
  done
}

plan() {
  rm -rf $ROOT/probe
  config 8 > $ROOT/probe.json
  $B train --data $D --out $ROOT/probe --config $ROOT/probe.json > "$OUT/probe.log" 2>&1
  local n
  n=$(python3 - $ROOT/probe/metrics.jsonl "${TRAIN_SECS:-900}" <<'EOF'
import json, sys
ms = [json.loads(l) for l in open(sys.argv[1])]
# elapsed after step k = cumulative supervised tokens / cumulative rate; skip the warm-up steps
t = []; c = 0
for m in ms:
    c += m["supervised_tokens"]; t.append(c / m["tokens_per_sec"])
per = (t[-1] - t[2]) / (len(t) - 3)
print(max(10, int(float(sys.argv[2]) / per)))
print(f"probe: {per:.3f} s/step, {ms[-1]['tokens_per_sec']:.0f} supervised tok/s", file=sys.stderr)
EOF
  )
  log "plan: max_steps $n for ${TRAIN_SECS:-900} s ($(tail -c 300 "$OUT/probe.log" | tr '\n' ' ' | tail -c 120))"
  config "$n" > $ROOT/cfg.json
}

train() {
  local left=$(( ${UNTIL:-560} - $(elapsed) ))
  local resume=""
  [ -f $R/latest ] && resume=--resume
  if [ "$left" -lt 20 ]; then log "train: skipped, $left s left"; return; fi
  log "train: $resume for at most $left s"
  $B train --data $D --out $R --config $ROOT/cfg.json $resume --time-limit "$left" \
    --feature-cache-mb "${CACHE_MB:-0}" >> "$OUT/train.log" 2>&1
  log "train: exit $?, $(tail -n 1 $R/metrics.jsonl | cut -c1-300)"
}

export_() {
  local latest
  latest=$(cat $R/latest) || { log "export: no checkpoint in $R"; return; }
  rm -rf $E
  $B drafter export --from "$R/checkpoints/$latest/drafter" --out $E --dtype bf16 2>&1 | tee -a "$OUT/log.txt"
  ( cd $E && split -b 15M -d -a 1 model.safetensors "$OUT/model.safetensors.part" )
  [ -n "${SAVE_DATA:-}" ] && tar -C $ROOT -cJf "$OUT/data.tar.xz" data
  tar -C "$ROOT" -cJf "$OUT/run.tar.xz" run/metrics.jsonl run/train_config.json export/config.json \
    export/training.json data/manifest.json cfg.json
  log "export: $latest → $E ($(du -b $E/model.safetensors | cut -f1) bytes)"
}

eval_() {
  # one run after another (eight processes on one GPU ran 10× slower each), temperatures outer:
  # every dataset at T = 0 first. A run starts only with EVAL_MIN seconds left before UNTIL and
  # stops between items at UNTIL; a run whose report exists (an earlier call of the same warm
  # lease) is not repeated, so the same command in back-to-back calls works through the list.
  local lim=${EVAL_LIMIT:-32} tok=${EVAL_TOKENS:-256}
  mkdir -p $ROOT/eval
  for t in ${EVAL_TEMPS:-0 1}; do
    for ds in ${EVAL_DATASETS:-gsm8k humaneval mt-bench math500}; do
      local o=$ROOT/eval/$ds-t$t left
      [ -f $o/report.json ] && { log "eval $ds T=$t: done before"; continue; }
      left=$(( ${UNTIL:-560} - $(elapsed) ))
      if [ "$left" -lt "${EVAL_MIN:-200}" ]; then log "eval $ds T=$t: not started, $left s left"; continue; fi
      local l=$lim; [[ " ${EVAL_LIMITS:-} " == *" $ds:"* ]] && l=$(sed -E "s/.* $ds:([0-9]+) .*/\1/" <<< " $EVAL_LIMITS ")
      timeout "$left" $B eval --dataset $ds --limit "$l" --drafter smollm2-135m-b16=$E \
        --time-limit $(( left - 20 )) \
        --modes ${EVAL_MODES:-ar,dflash,ddtree:8,ddtree:32} --max-new-tokens "$tok" --temperature $t \
        --device $DEV --dtype $TRAIN_DTYPE ${EVAL_ARGS:-} --out $o > $o.log 2>&1
      log "eval $ds T=$t: exit $?; $(grep -E 'time limit|τ pooled' $o.log | sed 's/  */ /g' | tr '\n' ';')"
      tar -C "$ROOT" -cJf "$OUT/eval.tar.xz" eval
    done
  done
}

for p in "$@"; do
  case $p in
    setup) setup ;;
    restore) restore ;;
    profile) profile ;;
    probes) probes ;;
    check) $B device-check --device $DEV > "$OUT/device-check.md" 2>&1; log "check: exit $?, $(grep -ci fail "$OUT/device-check.md") lines mention a failure" ;;
    data) data ;;
    plan) plan ;;
    cfg) config "${STEPS:?cfg needs STEPS}" > $ROOT/cfg.json && log "cfg: max_steps $STEPS" ;;
    bench) $B bench --device $DEV --dtype bf16 --modes ar,dflash,ddtree:8 --new-tokens 256 --repeats 1 \
             --cuda-graphs on --drafter $E > "$OUT/bench.md" 2>&1; log "bench: exit $?" ;;
    train) train ;;
    export) export_ ;;
    savedata) tar -C $ROOT -cJf "$OUT/data.tar.xz" data && log "savedata: $(du -b $OUT/data.tar.xz | cut -f1) bytes" ;;
    eval) eval_ ;;
    *) log "unknown phase $p"; exit 2 ;;
  esac
done
log "phases done: $*"
