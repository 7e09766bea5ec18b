#!/usr/bin/env bash
# dflash-rs's trainer beside the PyTorch reference trainer (bench/train_reference_run.py), same
# steps: a small run on the CPU in f32, where the two loss curves must agree to rounding.
#   1. `dflash-rs data generate` on SmolLM2-135M (PROMPTS prompts, 48 new tokens);
#   2. `dflash-rs drafter init` (a LAYERS-layer drafter, seed 0): the weights both start from;
#   3. `dflash-rs train --plan-out` (STEPS steps, 2 rows of ≤ 512 packed tokens, 16 anchors);
#   4. the reference on that plan from the same weights;
#   5. the curves side by side (OUT/compare.json): the largest relative loss difference per step.
# The same two trainers at scale on the GPU: the plan of a real run, `--device cuda --dtype bf16`.
# Usage (repository root): B=target/release/dflash-rs PY=venv/bin/python OUT=out
#   [STEPS=12 LAYERS=2 PROMPTS=8] bench/train_reference_check.sh
# (PY: a python with torch, transformers, gguf, safetensors and dflash==0.1.0)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-target/release/dflash-rs}
PY=${PY:-python3}
OUT=${OUT:-out}
STEPS=${STEPS:-12}
LAYERS=${LAYERS:-2}
PROMPTS=${PROMPTS:-8}
T=smollm2-135m
GGUF=$HOME/.cache/dflash-rs/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf "$OUT" && mkdir -p "$OUT"
for p in "Name a fruit." "What is 3+4?" "Say hello in Spanish." "Name a planet." \
  "Count to three." "Why is the sky blue?" "Write a haiku about rain." "What is a prime number?" \
  "Name two colours." "Translate 'cat' to French."; do
  printf '{"prompt": "%s"}\n' "$p"
done | head -n "$PROMPTS" > "$OUT/prompts.jsonl"
RAYON_NUM_THREADS=2 "$B" data generate --target $T --prompts "$OUT/prompts.jsonl" --out "$OUT/data" \
  --max-new-tokens 48 --batch-size 4 --device cpu --dtype f32 >&2
"$B" drafter init --target $T --out "$OUT/init" --force --layers "$LAYERS" --seed 0 >&2
cat > "$OUT/config.json" <<JSON
{"init_from": "$OUT/init", "num_draft_layers": $LAYERS, "num_anchors": 16, "pack_length": 512,
 "max_length": 512, "grad_accum": 2, "max_steps": $STEPS, "lr": 1e-3, "warmup_ratio": 0.25,
 "val_sequences": 0, "val_every": 100, "save_every": 100, "seed": 0}
JSON
RAYON_NUM_THREADS=2 "$B" train --target $T --data "$OUT/data" --out "$OUT/run" --config "$OUT/config.json" \
  --plan-out "$OUT/plan.jsonl" --device cpu --dtype f32 >&2
"$PY" bench/train_reference_run.py --target "$GGUF" --init "$OUT/init" --plan "$OUT/plan.jsonl" \
  --config "$OUT/run/train_config.json" --out "$OUT/ref" --device cpu --dtype f32 >&2
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
ours = {m["step"]: m for m in (json.loads(l) for l in open(f"{out}/run/metrics.jsonl")) if "step" in m}
ref = [json.loads(l) for l in open(f"{out}/ref/curve.jsonl")]
rows = []
for r in ref:
    m = ours[r["step"]]
    rows.append(dict(step=r["step"], loss_dflash_rs=m["loss"], loss_reference=r["loss"],
                     rel=abs(m["loss"] - r["loss"]) / abs(r["loss"]),
                     grad_norm_dflash_rs=m["grad_norm"], grad_norm_reference=r["grad_norm"],
                     lr_dflash_rs=m["lr"], lr_reference=r["lr"]))
worst = max(x["rel"] for x in rows)
json.dump(dict(steps=len(rows), worst_rel_loss_diff=worst, rows=rows),
          open(f"{out}/compare.json", "w"), indent=1)
for x in rows:
    print(f"step {x['step']:3d}: loss {x['loss_dflash_rs']:.6f} vs {x['loss_reference']:.6f} "
          f"(rel {x['rel']:.1e}), grad norm {x['grad_norm_dflash_rs']:.4f} vs "
          f"{x['grad_norm_reference']:.4f}")
print(f"worst relative loss difference over {len(rows)} steps: {worst:.2e}")
# f32 on the CPU: the same steps agree to rounding; more is a training bug to find
if worst > 1e-4:
    sys.exit(f"the curves differ by {worst:.2e} (> 1e-4)")
PYEOF
