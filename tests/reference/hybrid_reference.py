#!/usr/bin/env python3
"""Reference outputs of transformers' Qwen3.5 hybrid (Gated DeltaNet + gated attention) for the
dflash-rs qwen3_5 parity tests, on a random tiny config: several layers of both kinds, Hv != Hk,
partial RoPE, conv kernel 4. transformers' torch fallback (no fla) in f32.

Writes tests/fixtures/qwen35-tiny/: config.json, model.safetensors, a word-level tokenizer, and
reference.safetensors + reference.json with
  (1) a full prefill of 20 tokens: logits of every row and taps (hidden_states[i+1]);
  (2) prefill(12) then ONE forward of the next 8 tokens with the cache (the chunked path from
      the cached conv and recurrent states): logits and taps of the 8 rows;
  (3) prefill(12) then 8 single-token decode steps (the recurrent path): logits per step.

Run: venv/bin/pip install torch transformers safetensors; venv/bin/python tests/reference/hybrid_reference.py
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DynamicCache, Qwen3_5ForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

torch.backends.cuda.matmul.allow_tf32 = False
ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "qwen35-tiny"
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]


def main():
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYERS),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=LAYERS,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    model = Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # zero-centred norms start at 0: give them values so (1 + w) matters
                p.add_(0.2 * torch.randn_like(p))
            elif p.dim() == 2:
                p.mul_(3.0)  # larger than the default init so every path carries signal
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(OUT), safe_serialization=True)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m.content }} {% endfor %}"}) + "\n"
    )

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, 20), generator=g)
    taps = list(range(len(LAYERS) - 1))  # the last hidden state is post-norm in transformers
    t = {}
    with torch.no_grad():
        o = model(ids, output_hidden_states=True)
        t["full.logits"] = o.logits[0].float().clone()
        t["full.taps"] = torch.stack([o.hidden_states[i + 1][0] for i in taps]).clone()
        # (2) prefill 12, then one forward of 8 with the cache
        cache = DynamicCache(config=cfg)
        model(ids[:, :12], cache=cache, use_cache=True)
        o2 = model(ids[:, 12:], cache=cache, use_cache=True, output_hidden_states=True)
        t["verify.logits"] = o2.logits[0].float().clone()
        t["verify.taps"] = torch.stack([o2.hidden_states[i + 1][0] for i in taps]).clone()
        # (3) prefill 12, then 8 decode steps
        cache = DynamicCache(config=cfg)
        model(ids[:, :12], cache=cache, use_cache=True)
        steps = []
        for i in range(12, 20):
            steps.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1].float())
        t["decode.logits"] = torch.stack(steps).clone()
    save_file({k: v.contiguous() for k, v in t.items()}, str(OUT / "reference.safetensors"))
    (OUT / "reference.json").write_text(json.dumps({
        "source": "transformers " + __import__("transformers").__version__ + ", torch " + torch.__version__
        + " (torch fallback: no fla)",
        "ids": ids[0].tolist(), "taps": taps, "prefill": 12,
    }, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
