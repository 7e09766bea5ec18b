#!/usr/bin/env bash
# Math and code training prompts, rebuilt byte for byte from the fetched assets (the data is
# not committed: this recipe and its checksum are).
#
#   scripts/prompts-problems.sh OUT_DIR
#
# Writes OUT_DIR/prompts-problems-v1.jsonl: ASDiv's math word problems (passage and question),
# MBPP's problem texts, reasoning-gym's CodeI/O tasks (description and input/output spec) and
# LeetCode's problem statements, each at most 4,000 characters, deduplicated, without any that
# shares a run of 13 words with an item of GSM8K, HumanEval, MT-Bench or MATH-500
# (`--drop-eval-overlap`: one ASDiv problem), mixed by the seed-0 shuffle of `dflash-rs data
# prompts` (6,957 prompts, 3.3 MB: run 7's). Then OUT_DIR/prompts-problems-v2.jsonl, which
# extends it (`--extend`: v1's lines first, unchanged) with the same problems under
# instructions (`--template`): ASDiv's step by step and as a Python program, MBPP's and LeetCode's
# in Python with an explanation and algorithm first, CodeI/O's in Python. Then
# OUT_DIR/prompts-problems-v3.jsonl: v2's lines, then MATH's test set (4,997 problems) without
# the 346 that quote one of our MATH-500 items (`--drop-eval-overlap`; the short ones by all
# their words), as is and step by step (9,302 prompts). Checks the three sha256s against the
# recorded ones and fails if one differs (a changed source or a changed `data prompts`). Needs
# the assets
# (`scripts/fetch-assets.sh problems datasets`) and the CPU binary (B, default
# target/release/dflash-rs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/prompts-problems.sh OUT_DIR}
B=${B:-target/release/dflash-rs}
P=${DFLASH_HOME:-$HOME/.cache/dflash-rs}/datasets/problems
SHA=a7a11c07ce2c03c5b68a07d61f80150428cfe847ba7f77075d41923c019cc2bb
SHA2=01944cd7784b7074844c0b1797c16cd68b1dd76ddea29d93257f47ecab6e9681
SHA3=2ecab2ff55e8b0cf348dc06a5671f1c0b65867668d3149a03577bd26c94f67f5
# v2's instructions around the same problems (the target answers each problem again, in
# another form)
T_STEPS=$'{prompt}\nExplain your reasoning step by step, then state the final answer.'
T_PROGRAM=$'Write a short Python program that computes the answer to this problem, then explain it.\n\n{prompt}'
T_PYTHON=$'{prompt}\nWrite the solution in Python and explain how it works.'
T_ALGORITHM=$'Describe an efficient algorithm for this problem before writing any code, then implement it in Python.\n\n{prompt}'
[ -x "$B" ] || { echo "no dflash-rs binary at $B (cargo build --release -p dflash-cli)" >&2; exit 1; }
mkdir -p "$OUT"
out=$OUT/prompts-problems-v1.jsonl
"$B" data prompts \
  --prompts "fields:passage+question:$P/asdiv.jsonl" \
  --prompts "fields:doc.text:$P/mbpp-requests.jsonl.gz" \
  --prompts "fields:task_description+input_output_spec:$P/codeio-hq.json.gz" \
  --prompts "fields:readme_description:$P/leetcode" \
  --max-chars 4000 --seed 0 --drop-eval-overlap --force --out "$out"
check() { # FILE RECORDED-SHA256 NAME
  local got; got=$(sha256sum "$1" | cut -d' ' -f1)
  if [ "$got" != "$2" ]; then
    echo "$3: sha256 $got, recorded $2: the sources or data prompts changed" >&2
    exit 1
  fi
}
check "$out" "$SHA" prompts-problems-v1
out2=$OUT/prompts-problems-v2.jsonl
"$B" data prompts --extend "$out" \
  --prompts "fields:passage+question:$P/asdiv.jsonl" --template "$T_STEPS" \
  --prompts "fields:passage+question:$P/asdiv.jsonl" --template "$T_PROGRAM" \
  --prompts "fields:doc.text:$P/mbpp-requests.jsonl.gz" --template "$T_PYTHON" \
  --prompts "fields:doc.text:$P/mbpp-requests.jsonl.gz" --template "$T_ALGORITHM" \
  --prompts "fields:task_description+input_output_spec:$P/codeio-hq.json.gz" --template "$T_PYTHON" \
  --prompts "fields:readme_description:$P/leetcode" --template "$T_PYTHON" \
  --prompts "fields:readme_description:$P/leetcode" --template "$T_ALGORITHM" \
  --max-chars 4000 --seed 0 --drop-eval-overlap --force --out "$out2"
check "$out2" "$SHA2" prompts-problems-v2
out3=$OUT/prompts-problems-v3.jsonl
math=()
for sub in algebra counting_and_probability geometry intermediate_algebra number_theory prealgebra precalculus; do
  math+=(--prompts "fields:doc.problem:$P/math-test/$sub.jsonl.gz" --template "{prompt}"
         --prompts "fields:doc.problem:$P/math-test/$sub.jsonl.gz" --template "$T_STEPS")
done
"$B" data prompts --extend "$out2" "${math[@]}" --max-chars 4000 --seed 0 --drop-eval-overlap --force --out "$out3"
check "$out3" "$SHA3" prompts-problems-v3
echo "prompts-problems-v1: $(wc -l < "$out") prompts, sha256 $SHA"
echo "prompts-problems-v2: $(wc -l < "$out2") prompts, sha256 $SHA2 (v1's, then the same problems under instructions)"
echo "prompts-problems-v3: $(wc -l < "$out3") prompts, sha256 $SHA3 (v2's, then MATH's test set without our evaluation items, as is and step by step)"
