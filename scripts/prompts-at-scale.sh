#!/usr/bin/env bash
# The prompt sets for drafters trained at scale, rebuilt byte for byte from the fetched assets
# (the data is not committed: this recipe and its checksums are).
#
#   scripts/prompts-at-scale.sh OUT_DIR [PART_PROMPTS]
#
# Writes OUT_DIR/prompts-scale-v1.jsonl: every human turn of ShareGPT V3 with the conversation
# before it (`sharegpt-turns:`) and the OpenAI evals registry's prompts (at most 1,000 per file),
# each at most 4,000 characters, deduplicated, mixed by the seed-0 shuffle of `dflash-rs data
# prompts` (158,416 prompts, 172 MB). Then OUT_DIR/prompts-scale-v2.jsonl, which extends it
# (`data prompts --extend`: v1's lines first, unchanged): the evals registry at most 5,000 per
# file and WritingBench's queries, each at most 4,000 characters, without the prompts v1 has,
# mixed by the same shuffle (268,081 prompts: 109,665 new, 523 of them WritingBench's). Then
# OUT_DIR/part-NN.jsonl: consecutive runs of PART_PROMPTS prompts (default 40,000, ≈ 43 MB: one
# part is one device run's prompts, carried compressed), v1's lines first (parts 00–03), then
# the new ones from the next part on (04–06), so that a part earlier runs trained on never
# changes. Checks both sets' sha256 against the recorded ones and fails if one differs (a changed
# source or a changed `data prompts`). Evaluation sets are refused by `data prompts`. Needs the
# assets (`scripts/fetch-assets.sh sharegpt evals writingbench`) and the CPU binary (B, default
# target/release/dflash-rs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/prompts-at-scale.sh OUT_DIR [PART_PROMPTS]}
PART=${2:-40000}
B=${B:-target/release/dflash-rs}
HOME_DIR=${DFLASH_HOME:-$HOME/.cache/dflash-rs}
SHA=9b080c213f37f1a125461764ce6257b4312e8351f0c9a0650ae7413ffeacbc30
SHA2=c632f6fc5eab1f05e01b9bd768f81a075eb6ce618823c16aa45e7ee33409f1e1
[ -x "$B" ] || { echo "no dflash-rs binary at $B (cargo build --release -p dflash-cli)" >&2; exit 1; }
[[ "$PART" =~ ^[1-9][0-9]*$ ]] || { echo "PART_PROMPTS must be a positive integer, got '$PART'" >&2; exit 2; }
mkdir -p "$OUT"
check() { # FILE RECORDED-SHA256 NAME
  local got; got=$(sha256sum "$1" | cut -d' ' -f1)
  if [ "$got" != "$2" ]; then
    echo "$3: sha256 $got, recorded $2: the sources or data prompts changed" >&2
    exit 1
  fi
}
mix=$OUT/prompts-scale-v1.jsonl
"$B" data prompts \
  --prompts "sharegpt-turns:$HOME_DIR/datasets/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json" \
  --prompts "evals:$HOME_DIR/datasets/evals-registry" \
  --cap-per-file 1000 --max-chars 4000 --seed 0 --force --out "$mix"
check "$mix" "$SHA" prompts-scale-v1
mix2=$OUT/prompts-scale-v2.jsonl
"$B" data prompts --extend "$mix" \
  --prompts "evals:$HOME_DIR/datasets/evals-registry" \
  --prompts "writingbench:$HOME_DIR/datasets/writingbench/benchmark_all.jsonl" \
  --cap-per-file 5000 --max-chars 4000 --seed 0 --force --out "$mix2"
check "$mix2" "$SHA2" prompts-scale-v2
rm -f "$OUT"/part-*.jsonl
n1=$(wc -l < "$mix")
split -d -l "$PART" --additional-suffix=.jsonl "$mix" "$OUT/part-"
first_new=$(( (n1 + PART - 1) / PART ))
tail -n +"$(( n1 + 1 ))" "$mix2" | split -d -l "$PART" --numeric-suffixes="$first_new" --additional-suffix=.jsonl - "$OUT/part-"
echo "prompts-scale-v1: $n1 prompts, sha256 $SHA"
echo "prompts-scale-v2: $(wc -l < "$mix2") prompts, sha256 $SHA2 (v1's, then the new ones from part $first_new on); parts:"
for p in "$OUT"/part-*.jsonl; do echo "  $p $(wc -l < "$p") prompts"; done
