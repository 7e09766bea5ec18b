#!/usr/bin/env bash
# GPU decoding's figures on a CUDA machine. Steps (STEPS, default all four, in this order; each
# writes to $OUT, a failing step is reported and the next runs):
#   check    `dflash-rs check device` on the tiny Qwen3 of tests/fixtures with z-lab's quiet
#            drafter (kernels against their CPU twins, AR on the device = AR on the CPU, DFlash
#            and DDTree = AR, CUDA graphs = without, graphs kept across generations = fresh),
#            then the same with a DFlash2 drafter (tests/fixtures/dflash2/tiny-full);
#   side     bench/decode_side_by_side.sh: `bench shape --output-json` (eager and from CUDA graphs, the
#            draft block's graph included) beside HF transformers (eager, compiled static cache)
#            and z-lab's draft block on SHAPES, in this call (about 6 minutes for the two
#            default shapes; WHEELS: a folder with the dflash==0.1.0 wheel);
#   profile  Nsight Compute over `bench shape --profile-replays REPLAYS` (3) at each of SHAPES (only the
#            replays: the draft block, the AR step, the chain verify), then
#            bench/kernel_profile.py: kernel time and DRAM reads per kernel class
#            (NCU, default /usr/local/cuda/bin/ncu);
#   regen    data regeneration's batched decoding: bench/regen_side_by_side.sh on REGEN_SHAPES
#            (prompts of 64–1,024 tokens, 256 new, 256 slots; beside HF transformers `generate`),
#            then Nsight Compute over `bench regen --profile-replays 3` (a batched step of 256
#            rows on 1,024-row sequences, a prefill of 16 prompts of 1,024 tokens) and
#            bench/kernel_profile.py;
#   eval     `dflash-rs eval` of the bundled drafter on SmolLM2-135M-Instruct (GSM8K's first
#            EVAL_LIMIT problems, 128 new tokens, bf16, AR / DFlash / DDTree-8, with CUDA
#            graphs): the real model's speed-ups. The GGUF comes from the asset cache
#            ($DFLASH_HOME; scripts/fetch-assets.sh smollm2, or STAGE: a folder of its parts,
#            concatenated in name order, as ../shared/tools/device-stage splits it); the
#            evaluation datasets from the cache too (or DATASETS_TAR: a tar.xz of its datasets/).
#
# Usage (repository root): scripts/device-decode.sh
#   B           the CUDA binary (target/cuda/release/dflash-rs, from scripts/cuda-build.sh)
#   OUT         where the results go (out/)
#   SHAPES      the shapes (config.json files; default SmolLM2-135M's and Qwen3-8B's)
#   REGEN_SHAPES  regen's shapes (SmolLM2-135M's and Qwen2.5-Coder-1.5B's)
#   EVAL_LIMIT  problems for eval (32); DRAFTER the drafter (the bundled one)
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/cuda/release/dflash-rs}
OUT=${OUT:-out}
SHAPES=${SHAPES:-bench/shapes/smollm2-135m.json bench/shapes/qwen3-8b.json}
STEPS=${STEPS:-check side profile regen eval}
REGEN_SHAPES=${REGEN_SHAPES:-bench/shapes/smollm2-135m.json bench/shapes/qwen2.5-coder-1.5b.json}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
EVAL_LIMIT=${EVAL_LIMIT:-32}
REPLAYS=${REPLAYS:-3}
DRAFTER=${DRAFTER:-assets/drafters/smollm2-135m-b16}
export DFLASH_HOME=${DFLASH_HOME:-$HOME/.cache/dflash-rs}
mkdir -p "$OUT"
status=0
for step in $STEPS; do
  case $step in
    check)
      "$B" check device --device cuda --dtype bf16 --target tests/fixtures/qwen3-tiny \
        --drafter tests/fixtures/dflash-tiny/quiet --max-new-tokens 32 > "$OUT/check.md" \
        2> "$OUT/check.log" || { echo "check device failed" >&2; status=1; }
      "$B" check device --device cuda --dtype bf16 --target tests/fixtures/qwen3-tiny \
        --drafter tests/fixtures/dflash2/tiny-full --max-new-tokens 32 > "$OUT/check-dflash2.md" \
        2> "$OUT/check-dflash2.log" || { echo "check device (DFlash2 drafter) failed" >&2; status=1; } ;;
    side)
      # shellcheck disable=SC2086
      B=$B OUT=$OUT/side bench/decode_side_by_side.sh $SHAPES > "$OUT/side.log" 2>&1 \
        || { echo "decode_side_by_side failed" >&2; status=1; } ;;
    profile)
      for s in $SHAPES; do
        n=$(basename "$s" .json)
        "$NCU" --profile-from-start off --graph-profiling node \
          --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
          --log-file "$OUT/ncu-$n.csv" "$B" bench shape --shape "$s" --device cuda --dtype bf16 \
          --profile-replays "$REPLAYS" > "$OUT/profile-$n.txt" 2>&1 \
          && python3 bench/kernel_profile.py "$OUT/ncu-$n.csv" "$OUT/profile-$n.txt" --label "$n" \
            --json "$OUT/kernel-profile.jsonl" > "$OUT/kernel-profile-$n.md" \
          || { echo "kernel profile $n failed" >&2; status=1; }
      done ;;
    regen)
      for s in $REGEN_SHAPES; do
        n=$(basename "$s" .json)
        B=$B OUT=$OUT/regen-$n CASES="64:1024:256" bench/regen_side_by_side.sh "$s" > "$OUT/regen-$n.log" 2>&1 \
          || { echo "regen_side_by_side $n failed" >&2; status=1; }
        "$NCU" --profile-from-start off --graph-profiling node \
          --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
          --log-file "$OUT/ncu-regen-$n.csv" "$B" bench regen --shape "$s" --device cuda --dtype bf16 \
          --slots 256 --prompt-tokens 1024 --profile-replays 3 > "$OUT/profile-regen-$n.txt" 2>&1 \
          && python3 bench/kernel_profile.py "$OUT/ncu-regen-$n.csv" "$OUT/profile-regen-$n.txt" \
            --label "$n" --json "$OUT/kernel-profile-regen.jsonl" > "$OUT/kernel-profile-regen-$n.md" \
          || { echo "regen kernel profile $n failed" >&2; status=1; }
      done ;;
    eval)
      G=$DFLASH_HOME/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
      if [ ! -f "$G" ] && [ -n "${STAGE:-}" ]; then mkdir -p "$(dirname "$G")" && cat "$STAGE"/part* > "$G"; fi
      if [ -n "${DATASETS_TAR:-}" ]; then tar -C "$DFLASH_HOME" -xJf "$DATASETS_TAR"; fi
      scripts/fetch-assets.sh smollm2 datasets > "$OUT/assets.log" 2>&1 \
        || { echo "assets missing (scripts/fetch-assets.sh smollm2 datasets)" >&2; status=1; continue; }
      "$B" eval --target smollm2-135m --dataset gsm8k --limit "$EVAL_LIMIT" --drafter "shipped=$DRAFTER" \
        --modes ar,dflash,ddtree:8 --max-new-tokens 128 --device cuda --dtype bf16 --cuda-graphs \
        --out "$OUT/eval-gsm8k" --force > "$OUT/eval.log" 2>&1 \
        || { echo "eval failed (or a mode left AR's text beyond a bf16 near-tie)" >&2; status=1; } ;;
    *) echo "unknown step $step (check side profile regen eval)" >&2; status=1 ;;
  esac
done
exit $status
