#!/usr/bin/env bash
# `data generate --gpus 1` (the launcher, one rank, its stream merged) against one process on one
# GPU, sampled at T = 0.8, on the tiny test target: the merged data must be identical.
# Usage: B=target/cuda/release/dflash-rs scripts/regen-gpus-check.sh (LD_LIBRARY_PATH as docs/GPU.md says).
set -uo pipefail
B=${B:-target/cuda/release/dflash-rs}; T=tests/fixtures/qwen3-tiny; W=${W:-/tmp/rg}; rm -rf "$W"; mkdir -p "$W"
for i in $(seq 0 9); do printf '{"prompt": "t%d t%d t%d"}\n' $((3+i)) $((40+7*i)) $((200-i)); done > $W/p.jsonl
$B data generate --target $T --prompts $W/p.jsonl --out $W/one --max-new-tokens 24 --shard-size 2 --temperature 0.8 --seed 3 --device cuda 2>&1 | tail -1
$B data generate --target $T --prompts $W/p.jsonl --out $W/g1 --max-new-tokens 24 --shard-size 2 --temperature 0.8 --seed 3 --gpus 1 2>&1 | tail -2
python3 - "$W" <<'P'
import json
def seqs(d):
    m = json.load(open(f"{d}/manifest.json")); out = []
    for sh in m["shards"]:
        out += [l for l in open(f"{d}/{sh['file']}") if l.strip()]
    return m, out
import sys; w = sys.argv[1]
m1, a = seqs(f"{w}/one"); m2, b = seqs(f"{w}/g1")
print("shards", len(m1["shards"]), len(m2["shards"]), "sequences", len(a), len(b), "identical", a == b, m2["shards"][0]["file"])
P
