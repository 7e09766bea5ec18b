#!/usr/bin/env bash
# The prompt set for drafters trained at scale, rebuilt byte for byte from the fetched assets
# (the data is not committed: this recipe and its checksums are).
#
#   scripts/prompts-at-scale.sh OUT_DIR [PART_PROMPTS]
#
# Writes OUT_DIR/prompts-scale-v1.jsonl: every human turn of ShareGPT V3 with the conversation
# before it (`sharegpt-turns:`) and the OpenAI evals registry's prompts (at most 1,000 per file),
# each at most 4,000 characters, deduplicated, mixed by the seed-0 shuffle of `dflash-rs data
# prompts` (158,416 prompts, 172 MB); then OUT_DIR/part-NN.jsonl, consecutive runs of
# PART_PROMPTS prompts (default 40,000, ≈ 43 MB: one part is one device run's prompts, carried
# compressed); and OUT_DIR/writingbench.jsonl, WritingBench's queries of at most 4,000
# characters (523 of its 1,000), shuffled by seed 0, kept out of the mix so that the parts stay
# the ones earlier runs trained on. Checks both files' sha256 against the recorded ones and fails
# if one differs (a changed source or a changed `data prompts`). Evaluation sets are refused by
# `data prompts`. Needs the assets (`scripts/fetch-assets.sh sharegpt evals writingbench`) and
# the CPU binary (B, default target/release/dflash-rs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/prompts-at-scale.sh OUT_DIR [PART_PROMPTS]}
PART=${2:-40000}
B=${B:-target/release/dflash-rs}
HOME_DIR=${DFLASH_HOME:-$HOME/.cache/dflash-rs}
SHA=9b080c213f37f1a125461764ce6257b4312e8351f0c9a0650ae7413ffeacbc30
WB_SHA=16f8f54c897de259fa001d0965d06b0ea44da43f19e00692648bdea6f9d26601
[ -x "$B" ] || { echo "no dflash-rs binary at $B (cargo build --release -p dflash-cli)" >&2; exit 1; }
[[ "$PART" =~ ^[1-9][0-9]*$ ]] || { echo "PART_PROMPTS must be a positive integer, got '$PART'" >&2; exit 2; }
mkdir -p "$OUT"
mix=$OUT/prompts-scale-v1.jsonl
"$B" data prompts \
  --prompts "sharegpt-turns:$HOME_DIR/datasets/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json" \
  --prompts "evals:$HOME_DIR/datasets/evals-registry" \
  --cap-per-file 1000 --max-chars 4000 --seed 0 --out "$mix"
got=$(sha256sum "$mix" | cut -d' ' -f1)
if [ "$got" != "$SHA" ]; then
  echo "prompts-scale-v1: sha256 $got, recorded $SHA: the sources or data prompts changed" >&2
  exit 1
fi
wb=$OUT/writingbench.jsonl
"$B" data prompts --prompts "writingbench:$HOME_DIR/datasets/writingbench/benchmark_all.jsonl" \
  --max-chars 4000 --seed 0 --out "$wb"
got_wb=$(sha256sum "$wb" | cut -d' ' -f1)
if [ "$got_wb" != "$WB_SHA" ]; then
  echo "writingbench.jsonl: sha256 $got_wb, recorded $WB_SHA: the source or data prompts changed" >&2
  exit 1
fi
rm -f "$OUT"/part-*.jsonl
split -d -l "$PART" --additional-suffix=.jsonl "$mix" "$OUT/part-"
echo "prompts-scale-v1: $(wc -l < "$mix") prompts, sha256 $got; parts:"
for p in "$OUT"/part-*.jsonl; do echo "  $p $(wc -l < "$p") prompts"; done
echo "writingbench: $wb, $(wc -l < "$wb") prompts, sha256 $got_wb"
