#!/usr/bin/env python3
"""How far are hidden states of a Qwen3.5 hybrid from each other under fla's Gated DeltaNet
kernels and transformers' torch fallback? (the gap the seeds' evaluation fell into)

Run twice on the GPU, once with `flash-linear-attention`/`fla-core` importable and once
without: `python3 bench/fla_gap.py OUT fla` / `python3 bench/fla_gap.py OUT fallback`.
Both build the same seeded random tiny Qwen3.5 (dims fla's kernels accept), run a 64-token
prefill (chunked path) in f32 and bf16, and write OUT/<mode>.safetensors (logits, taps as f32);
the fallback run also writes the model to OUT/model for dflash-rs to run
(`dflash-rs check forward --target OUT/model --ids OUT/ids.json --out OURS.safetensors --dtype f32|bf16`), and OUT/ids.json.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

out, mode = Path(sys.argv[1]), sys.argv[2]
out.mkdir(parents=True, exist_ok=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
try:
    import fla  # noqa: F401
    has_fla = True
except ImportError:
    has_fla = False
assert has_fla == (mode == "fla"), f"mode {mode} but fla importable = {has_fla}"
torch.manual_seed(0)
layers = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
cfg = Qwen3_5TextConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=len(layers),
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=layers, linear_conv_kernel_dim=4,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
model = Qwen3_5ForCausalLM(cfg).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:
            p.add_(0.2 * torch.randn_like(p))
        elif p.dim() == 2:
            p.mul_(3.0)
if mode == "fallback":
    model.save_pretrained(str(out / "model"), safe_serialization=True)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 512, (1, 64), generator=g)
(out / "ids.json").write_text(json.dumps(ids[0].tolist()))
res = {}
for name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
    m = model.to("cuda", dt)
    with torch.no_grad():
        o = m(ids.cuda(), output_hidden_states=True)
    res[f"{name}.logits"] = o.logits[0].float().cpu().contiguous()
    res[f"{name}.taps"] = torch.stack([o.hidden_states[i + 1][0] for i in range(len(layers) - 1)]).float().cpu().contiguous()
save_file(res, str(out / f"{mode}.safetensors"))
print(f"{mode}: fla importable {has_fla}, transformers {__import__('transformers').__version__}, torch {torch.__version__}")
