#!/usr/bin/env bash
# dflash-rs on the CPU beside llama.cpp, same GGUF, same threads, same prompts, in one run:
#   1. llama.cpp AR (bench/llama_cpp_cpu.py; needs `pip install llama-cpp-python==0.3.36`,
#      PY names that python);
#   2. `dflash-rs bench decode --device cpu` AR, DFlash and DDTree-4 with the shipped drafter,
#      with the GGUF's Q4_1 weights streamed from their blocks (the default) and, for
#      comparison, with f32 panels (DFLASH_CPU_QUANT=f32).
# Usage (repository root): B=target/release/dflash-rs PY=python3 OUT=out bench/cpu_vs_llama.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/dflash-rs}
PY=${PY:-python3}
OUT=${OUT:-out}
THREADS=${THREADS:-2}
N=${N:-64}
GGUF=${GGUF:-$HOME/.cache/dflash-rs/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$OUT"
"$PY" bench/llama_cpp_cpu.py "$GGUF" "$OUT/llama-cpp.json" --threads "$THREADS" --new-tokens "$N"
for q in exact f32; do
  DFLASH_CPU_QUANT=$q RAYON_NUM_THREADS=$THREADS "$B" bench decode --target "$GGUF" \
    --drafter assets/drafters/smollm2-135m-b16 --modes ar,dflash,ddtree:4 --max-new-tokens "$N" \
    --repeats 3 > "$OUT/dflash-rs-$q.txt"
done
cat "$OUT/llama-cpp.json"; cat "$OUT"/dflash-rs-quant*.txt
