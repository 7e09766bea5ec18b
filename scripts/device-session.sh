#!/usr/bin/env bash
# Run on the GPU machine (the `device` tool) by the last call of a session: assembles the staged
# SmolLM2 GGUF, unpacks the CUDA binary, then runs the device checks, the benchmarks with the
# PyTorch reference beside them, and a short bf16 training run. Logs go to $OUT.
# Expects: .device/dflash-rs.xz; .device/whl/*.whl (reference only); /root/stage/smollm2.gguf/part*
# (device-stage; check, bench, reference and train only: shape and mfu use random weights).
# Usage: scripts/device-session.sh [check] [bench] [reference] [train] [shape] [mfu]   (default: the first four)
#   shape: bench-shape on $SHAPES (default: the Qwen3-8B and SmolLM2 shapes; random target +
#          5-layer drafter, bf16), with the eager vs CUDA-graph forwards
#   mfu:   bench-train on the Qwen3-8B and SmolLM2 shapes (bf16, 2,048 tokens, 512 anchors)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export DFLASH_HOME=/root/dh
mkdir -p $DFLASH_HOME/models/smollm2-135m
G=$DFLASH_HOME/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
# the staged GGUF, for the steps that load SmolLM2 (shape and mfu use random weights)
need_gguf() {
  [ -f "$G" ] || cat /root/stage/smollm2.gguf/part* > "$G"
  echo 'b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  '"$G" | sha256sum -c || exit 1
}
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
export LD_LIBRARY_PATH=$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
xz -d -c .device/dflash-rs.xz > /root/dflash-rs && chmod +x /root/dflash-rs
B=/root/dflash-rs
if ls .device/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
step() { echo "== $*" | tee -a "$OUT/log.txt"; }
want() { [ $# -eq 0 ] && return 0; for w in $WANT; do [ "$w" = "$1" ] && return 0; done; return 1; }
WANT="${*:-check bench reference train}"
if want check; then
need_gguf
step device-check
$B device-check --device cuda 2>&1 | tee "$OUT/device-check.md"
fi
if want bench; then
need_gguf
step bench bf16
$B bench --device cuda --dtype bf16 --modes ar,dflash,ddtree:8 --new-tokens 256 --repeats ${REPEATS:-2} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-bf16.md"
fi
if want reference; then
need_gguf
step reference
timeout 300 python3 bench/zlab_reference.py "$G" 256 2>&1 | grep -v -i warn | tail -5 | tee "$OUT/reference.txt"
fi
if want shape && [[ " ${*:-} " == *" shape "* ]]; then
for sh in ${SHAPES:-bench/shapes/smollm2-135m.json qwen3-8b}; do
step bench-shape $sh
$B bench-shape --shape $sh --device cuda --dtype bf16 ${SHAPE_ARGS:-} 2>&1 | tee -a "$OUT/bench-shape.md"
done
fi
if want mfu && [[ " ${*:-} " == *" mfu "* ]]; then
for sh in qwen3-8b bench/shapes/smollm2-135m.json; do
step bench-train $sh
$B bench-train --shape $sh --device cuda --dtype bf16 --seq-len 2048 --anchors 512 --peak-tflops 989 2>&1 | tee -a "$OUT/bench-train.md"
done
fi
if want train; then
need_gguf
step train
for p in "Name a fruit." "What is 3+4?" "Say hello in Spanish." "Name a planet." "Count to five." "Why is the sea salty?" "Give me a haiku." "What is an atom?"; do echo "{\"prompt\": \"$p\"}"; done > /tmp/p.jsonl
$B data generate --prompts /tmp/p.jsonl --out /tmp/data --max-new-tokens 96 --device cuda --dtype bf16 2>&1 | tail -2 | tee -a "$OUT/train.txt"
echo '{"num_draft_layers": 5, "block_size": 16, "num_anchors": 64, "max_steps": 40, "save_every": 40, "val_every": 40, "val_sequences": 1, "dtype": "bf16", "device": "cuda"}' > /tmp/cfg.json
$B train --data /tmp/data --out /tmp/run --config /tmp/cfg.json 2>&1 | tail -3 | tee -a "$OUT/train.txt"
tail -2 /tmp/run/metrics.jsonl | tee -a "$OUT/train.txt"
fi
