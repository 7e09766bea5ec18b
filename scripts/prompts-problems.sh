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
# prompts` (6,957 prompts, 3.3 MB). Checks its sha256 against the recorded one and fails if it
# differs (a changed source or a changed `data prompts`). Needs the assets
# (`scripts/fetch-assets.sh problems datasets`) and the CPU binary (B, default
# target/release/dflash-rs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/prompts-problems.sh OUT_DIR}
B=${B:-target/release/dflash-rs}
P=${DFLASH_HOME:-$HOME/.cache/dflash-rs}/datasets/problems
SHA=a7a11c07ce2c03c5b68a07d61f80150428cfe847ba7f77075d41923c019cc2bb
[ -x "$B" ] || { echo "no dflash-rs binary at $B (cargo build --release -p dflash-cli)" >&2; exit 1; }
mkdir -p "$OUT"
out=$OUT/prompts-problems-v1.jsonl
"$B" data prompts \
  --prompts "fields:passage+question:$P/asdiv.jsonl" \
  --prompts "fields:doc.text:$P/mbpp-requests.jsonl.gz" \
  --prompts "fields:task_description+input_output_spec:$P/codeio-hq.json.gz" \
  --prompts "fields:readme_description:$P/leetcode" \
  --max-chars 4000 --seed 0 --drop-eval-overlap --out "$out"
got=$(sha256sum "$out" | cut -d' ' -f1)
if [ "$got" != "$SHA" ]; then
  echo "prompts-problems-v1: sha256 $got, recorded $SHA: the sources or data prompts changed" >&2
  exit 1
fi
echo "prompts-problems-v1: $(wc -l < "$out") prompts, sha256 $SHA"
