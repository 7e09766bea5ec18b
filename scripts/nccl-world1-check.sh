#!/usr/bin/env bash
# `train --gpus 1` (one rank, its gradients summed through NCCL) against the plain trainer
# on one GPU, f32 and bf16, on the tiny test target: the per-step loss and gradient norm
# must be identical (an all-reduce over one rank is a copy).
# Usage: B=target/cuda/release/dflash-rs W=/tmp/nccl scripts/nccl-world1-check.sh
# (LD_LIBRARY_PATH as docs/GPU.md says, with nvidia/nccl/lib).
set -uo pipefail
B=${B:-target/cuda/release/dflash-rs}
T=tests/fixtures/qwen3-tiny
W=${W:-/tmp/nccl}
mkdir -p $W
DEV=${DEV:-cuda}
for p in "Name a fruit." "What is 3+4?" "Say hello." "Name a planet." "Count to three." "Name a colour." "Spell cat." "Say yes."; do
  printf '{"prompt": "%s"}\n' "$p"; done > $W/p.jsonl
$B data generate --target $T --prompts $W/p.jsonl --out $W/data --max-new-tokens 48 --device $DEV 2>&1 | tail -2
cat > $W/cfg.json <<'J'
{"num_draft_layers": 1, "block_size": 4, "intermediate_size": 128, "target_layer_ids": [1, 2],
 "num_anchors": 16, "mask_token_id": 255, "lr": 0.01, "warmup_ratio": 0.0, "grad_accum": 4, "epochs": 1, "max_steps": 12,
 "save_every": 100, "val_every": 100, "val_sequences": 0}
J
for dt in f32 bf16; do
  $B train --target $T --data $W/data --out $W/plain-$dt --config $W/cfg.json --device $DEV --dtype $dt 2>&1 | tail -1
  $B train --target $T --data $W/data --out $W/nccl1-$dt --config $W/cfg.json --gpus 1 --dtype $dt 2>&1 | tail -3
done
python3 - "$W" <<'P'
import json, sys
w = sys.argv[1]
for dt in ["f32", "bf16"]:
    try:
        a = [json.loads(l) for l in open(f"{w}/plain-{dt}/metrics.jsonl")]
        b = [json.loads(l) for l in open(f"{w}/nccl1-{dt}/metrics.jsonl")]
    except Exception as e:
        print(dt, "missing:", e); continue
    d = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
    g = max(abs(x["grad_norm"] - y["grad_norm"]) / abs(x["grad_norm"]) for x, y in zip(a, b))
    same = all(x["loss"] == y["loss"] for x, y in zip(a, b))
    print(f"{dt}: {len(a)} vs {len(b)} steps, max rel Δloss {d:.3e}, max rel Δgrad_norm {g:.3e}, identical {same}")
P
