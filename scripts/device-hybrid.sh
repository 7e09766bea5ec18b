#!/usr/bin/env bash
# The hybrid (Gated DeltaNet + gated attention) target on a CUDA machine. Steps (STEPS, default
# all four, in this order; each writes to $OUT, a failing step is reported and the next runs):
#   check   `dflash-rs check device` on the tiny Qwen3.5 hybrid of tests/fixtures (our kernels,
#           the GDN prep, recurrence and gated norm included, against their CPU twins; f32 logits
#           and taps against the CPU; AR on the device = AR on the CPU; DFlash and DDTree = AR on
#           the device; bf16 reported);
#   shapes  `dflash-rs bench shape` at the Qwen3.6-27B shape in bf16 on random weights
#           (bench/shapes/qwen3.6-27b-8l.json: 8 layers, then bench/shapes/qwen3.6-27b.json: 64);
#   hf      the reference on the same shapes: bench/hybrid_hf_speed.py (transformers + fla);
#   parity  bench/gdn_parity.py: fla, transformers' torch fallback and dflash-rs (CUDA, CPU)
#           layer by layer through a 64-layer random target at the 27B layer shape;
#   tiny    the tiny hybrid end to end on the device: `data generate`, `train` (60 steps, f32),
#           `doctor` (with the validation shard) and `eval` (AR, DFlash, DDTree-8, CUDA graphs);
#   decode  the decoding loop at each of SHAPES on random weights (`bench decode --shape`: AR,
#           DFlash, DDTree-8 with a random 5-layer drafter, without and with CUDA graphs, bf16;
#           each mode's tokens against AR's; DECODE_DTYPE, default bf16), rows as JSON;
#   regen   `bench regen` at PROFILE_SHAPE, 256 slots, 16, 64 and 256 prompts per prefill forward;
#           then NCU over a short run of 64 slots (4 prefills, 8 steps), every kernel summed by
#           class and by name (`bench/kernel_profile.py --all`);
#   profile Nsight Compute (NCU) over `bench shape --profile-eager 1` at PROFILE_SHAPE (the AR
#           step and the chain verify run eagerly: NCU fails on the hybrid's graph nodes;
#           bench/kernel_profile.py), then over one Gated DeltaNet layer's chunked rule at
#           T = 2,048 and 8,192, ours in f32 and TF32 products (`bench shape --profile-gdn-rule
#           --gdn-math`) and fla's
#           (`bench/gdn_profile.py fla`), side by side (`bench/gdn_profile.py report`);
#   train   `dflash-rs bench train` at the Qwen3.6-27B shape (bf16, online features from the
#           64-layer hybrid target; 256 anchors if 512 do not fit), then the PyTorch reference
#           (bench/train_reference.py, HF target with fla) on the same shape and anchors.
# fla for the hf and parity steps: the wheels flash-linear-attention==0.6.0 and fla-core==0.6.0
# (and dflash==0.1.0 for parity's drafter) importable, e.g. installed with
# `pip install --no-index --no-deps --target /tmp/site *.whl` and PYTHONPATH=/tmp/site.
#
# Usage (repository root): scripts/device-hybrid.sh
#   B       the CUDA binary (target/cuda/release/dflash-rs, from scripts/cuda-build.sh)
#   OUT     where the logs go (out/)
#   SHAPES  the shapes to bench (default: qwen3.6-27b-8l qwen3.6-27b)
#   STEPS   the steps to run (default: check shapes hf parity tiny train)
#   WORK    scratch for parity's model (default: /tmp/gdn-parity)
#   REPEATS the median of how many timed forwards (default 10)
#   NCU     Nsight Compute (default /usr/local/cuda/bin/ncu); PROFILE_SHAPE (qwen3.6-27b-8l)
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/cuda/release/dflash-rs}
OUT=${OUT:-out}
SHAPES=${SHAPES:-qwen3.6-27b-8l qwen3.6-27b}
STEPS=${STEPS:-check shapes hf parity tiny train}
WORK=${WORK:-/tmp/gdn-parity}
REPEATS=${REPEATS:-10}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
DECODE_DTYPE=${DECODE_DTYPE:-bf16}
PROFILE_SHAPE=${PROFILE_SHAPE:-qwen3.6-27b-8l}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
status=0
for step in $STEPS; do
  case $step in
    check)
      "$B" check device --device cuda --dtype bf16 --target tests/fixtures/qwen35-tiny \
        --drafter tests/fixtures/dflash-tiny/hybrid > "$OUT/check-hybrid.md" 2> "$OUT/check-hybrid.log" \
        || { echo "check device failed" >&2; status=1; } ;;
    shapes)
      for s in $SHAPES; do
        "$B" bench shape --shape "bench/shapes/$s.json" --device cuda --dtype bf16 --budgets 8,32 \
          --repeats "$REPEATS" > "$OUT/shape-$s.txt" 2>&1 || { echo "bench shape $s failed" >&2; status=1; }
      done ;;
    hf)
      for s in $SHAPES; do
        python3 bench/hybrid_hf_speed.py "bench/shapes/$s.json" "$OUT/hf-$s.json" > "$OUT/hf-$s.log" 2>&1 \
          || { echo "hybrid_hf_speed $s failed" >&2; status=1; }
      done ;;
    parity)
      python3 bench/gdn_parity.py "$WORK" "$B" --no-cpu > "$OUT/parity.md" 2> "$OUT/parity.log" \
        && cp "$WORK/gdn-parity.json" "$OUT/" || { echo "gdn_parity failed" >&2; status=1; } ;;
    tiny)
      T=tests/fixtures/qwen35-tiny; W=$WORK-tiny; rm -rf "$W"; mkdir -p "$W"
      python3 -c "import json
for i in range(8): print(json.dumps({'prompt': ' '.join('t%d' % (((i % 2) * 53 + j * 17) % 250 + 1) for j in range(5))}))" > "$W/prompts.jsonl"
      printf '%s\n' '{"num_draft_layers": 1, "block_size": 6, "intermediate_size": 96, "mask_token_id": 255, "target_layer_ids": [1, 3], "num_anchors": 32, "lr": 0.01, "warmup_ratio": 0.0, "grad_accum": 2, "max_steps": 60, "save_every": 60, "val_every": 60, "val_sequences": 1}' > "$W/config.json"
      { "$B" data generate --target $T --prompts "$W/prompts.jsonl" --out "$W/data" --max-new-tokens 32 --device cuda \
        && "$B" train --target $T --data "$W/data" --out "$W/run" --config "$W/config.json" --device cuda \
        && "$B" doctor --target $T --drafter "$W/run/best" --data "$W/data" --device cuda \
        && "$B" eval --target $T --drafter "$W/run/best" --dataset "$W/prompts.jsonl" --modes ar,dflash,ddtree:8 \
             --max-new-tokens 32 --out "$W/eval" --force --device cuda --cuda-graphs \
        && tar -C "$W/run" -cJf "$OUT/tiny-hybrid-drafter.tar.xz" best; } > "$OUT/tiny.log" 2>&1 \
        || { echo "tiny hybrid end to end failed" >&2; status=1; } ;;
    decode)
      for s in $SHAPES; do
        for g in "" --cuda-graphs; do
          # shellcheck disable=SC2086
          n=decode-$s-$DECODE_DTYPE${g:+-graphs}
          "$B" bench decode --shape "bench/shapes/$s.json" --device cuda --dtype "$DECODE_DTYPE" \
            --modes ar,dflash,ddtree:8 --max-new-tokens 32 --repeats 1 $g --output-json "$OUT/$n.jsonl" \
            > "$OUT/$n.txt" 2>&1 || { echo "bench decode $s $g failed" >&2; status=1; }
        done
      done ;;
    regen)
      # batched decoding of PROFILE_SHAPE at 256 slots by prompts per prefill forward, then
      # Nsight Compute over a short run (its prefills and steps), summed by class and kernel
      rs=bench/shapes/$PROFILE_SHAPE.json
      for pp in 16 64 256; do
        "$B" bench regen --shape "$rs" --device cuda --dtype bf16 --slots 256 --prompt-tokens 256 \
          --max-new-tokens 128 --prefill-prompts $pp --output-json "$OUT/regen-prefill.jsonl" \
          > "$OUT/regen-prefill-$pp.txt" 2>&1 || { echo "bench regen, $pp per prefill, failed" >&2; status=1; }
      done
      "$NCU" --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
        --log-file "$OUT/ncu-regen.csv" "$B" bench regen --shape "$rs" --device cuda --dtype bf16 \
        --slots 64 --prompt-tokens 256 --max-new-tokens 8 > "$OUT/ncu-regen.txt" 2>&1 \
        && python3 bench/kernel_profile.py "$OUT/ncu-regen.csv" --all --label "$PROFILE_SHAPE regen" \
          > "$OUT/kernel-profile-regen.md" || { echo "regen kernel profile failed" >&2; status=1; } ;;
    profile)
      ps=$PWD/bench/shapes/$PROFILE_SHAPE.json
      "$NCU" --profile-from-start off \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
        --log-file "$OUT/ncu-$PROFILE_SHAPE.csv" "$B" bench shape --shape "$ps" --device cuda --dtype bf16 \
        --profile-eager 1 > "$OUT/profile-$PROFILE_SHAPE.txt" 2>&1 \
        && python3 bench/kernel_profile.py "$OUT/ncu-$PROFILE_SHAPE.csv" "$OUT/profile-$PROFILE_SHAPE.txt" \
          --label "$PROFILE_SHAPE" --json "$OUT/kernel-profile.jsonl" > "$OUT/kernel-profile-$PROFILE_SHAPE.md" \
        || { echo "kernel profile $PROFILE_SHAPE failed" >&2; status=1; }
      gdn=(--profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis
           --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv --page raw)
      # ours with the f32 FMA kernels (an f32 model's) and the TF32 tensor-core ones (bf16's)
      for m in f32 tf32; do
        "$NCU" "${gdn[@]}" --log-file "$OUT/ncu-gdn-ours-$m.csv" "$B" bench shape --shape "$ps" --device cuda \
          --dtype bf16 --gdn-math $m --gdn-lengths 2048,8192 --profile-gdn-rule 3 > "$OUT/gdn-ours-$m.txt" 2>&1 \
          || { echo "GDN rule profile (ours, $m) failed" >&2; status=1; }
      done
      (cd bench && "$NCU" "${gdn[@]}" --log-file "$OUT/ncu-gdn-fla.csv" python3 gdn_profile.py fla \
        "$ps" 2048,8192 3) > "$OUT/gdn-fla.txt" 2>&1 || { echo "GDN rule profile (fla) failed" >&2; status=1; }
      for m in f32 tf32; do
        (cd bench && python3 gdn_profile.py report "$OUT/ncu-gdn-ours-$m.csv" "$OUT/gdn-ours-$m.txt" \
          "$OUT/ncu-gdn-fla.csv" "$OUT/gdn-fla.txt" --label "dflash-rs $m" --json "$OUT/gdn-profile-$m.jsonl") \
          > "$OUT/gdn-profile-$m.md" 2>&1 || { echo "GDN profile report ($m) failed" >&2; status=1; }
      done ;;
    train)
      for anchors in 512 256; do
        "$B" bench train --shape bench/shapes/qwen3.6-27b.json --device cuda --dtype bf16 --anchors $anchors \
          --steps 3 --peak-tflops 989 --output-json "$OUT/train-27b.json" > "$OUT/train-27b-$anchors.txt" 2>&1 && break
        echo "bench train at $anchors anchors failed" >&2; status=1
      done
      python3 bench/train_reference.py bench/shapes/qwen3.6-27b.json 2048 "$anchors" 5 3 \
        > "$OUT/train-27b-ref.json" 2> "$OUT/train-27b-ref.log" \
        || { echo "train_reference at the 27B shape failed" >&2; status=1; } ;;
    *) echo "unknown step $step" >&2; status=1 ;;
  esac
done
exit $status
