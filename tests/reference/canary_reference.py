#!/usr/bin/env python3
"""Canary dumps (docs/DOCTOR.md, "Checking another stack") written by other stacks, for
`dflash-rs doctor --against`:

  tests/fixtures/canary/qwen3-tiny-zlab/      transformers + z-lab's dflash==0.1.0, f32: the tiny
                                              Qwen3 target and the dflash-tiny/full drafter
  tests/fixtures/canary/qwen35-tiny-fallback/ transformers' torch fallback of the Gated DeltaNet
                                              layers (no fla) in bf16: the tiny Qwen3.5 hybrid and
                                              a seeded random drafter for it, saved as
                                              tests/fixtures/dflash-tiny/hybrid/
  tests/fixtures/canary/qwen35-tiny-fallback-f32/  the same in f32

Each round is z-lab's own block forward (`DFlashDraftModel.forward` without a cache): the
context features `extract_context_feature(hidden_states, target_layer_ids)[:, :anchor]`, the
block [anchor token, mask × (B−1)] embedded by the target, position ids 0 .. anchor + B, the
target's LM head on rows 1.. . The visibility written is z-lab's rule for each drafter layer
(full attention: context and the whole block; sliding: causal inside the block, q − k < W).

Run: venv/bin/pip install torch transformers safetensors tokenizers 'dflash==0.1.0'
     venv/bin/python tests/reference/canary_reference.py
"""

import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash.model import DFlashDraftModel, extract_context_feature

torch.backends.cuda.matmul.allow_tf32 = False
ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
# dflash_train::fingerprint::CANARY_PROMPTS
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Question: what is 12 times 7? Answer:",
]


def anchors(n):
    a = [0, n // 2, max(n - 1, 0)]
    return [x for i, x in enumerate(a) if i == 0 or x != a[i - 1]]


def visibility(d, anchor, block):
    """z-lab's rule per drafter layer: key intervals [lo, hi) per block row."""
    out = []
    for lt in d.config.layer_types:
        rows = []
        for r in range(block):
            q = anchor + r
            if lt == "sliding_attention":
                w = d.config.sliding_window
                rows.append([[max(0, q - w + 1), q + 1]])
            else:
                rows.append([[0, anchor + block]])
        out.append(rows)
    return out


def dump(target, d, tok, out, producer, dtype, linear_attention=None):
    taps = list(d.target_layer_ids)
    block = d.block_size
    tensors, prompts = {}, []
    with torch.no_grad():
        for pi, text in enumerate(PROMPTS):
            ids = tok.encode(text, add_special_tokens=False).ids
            hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for l in taps:
                tensors[f"p{pi}.tap{l}"] = hs[l + 1][0].float().clone()
            feats = extract_context_feature(hs, taps)
            rounds = []
            for ri, a in enumerate(anchors(len(ids))):
                ctx = feats[:, :a]
                blk = torch.full((1, block), d.mask_token_id, dtype=torch.long)
                blk[0, 0] = ids[a]
                noise = target.get_input_embeddings()(blk)
                pos = torch.arange(0, a + block)[None]
                h = d(target_hidden=ctx, noise_embedding=noise, position_ids=pos)
                logits = target.lm_head(h[:, 1:])[0].float()
                tensors[f"p{pi}.r{ri}.context"] = ctx[0].float().clone()
                tensors[f"p{pi}.r{ri}.logits"] = logits.clone()
                rounds.append({
                    "anchor": a, "anchor_token": ids[a], "context_rows": a,
                    "block_positions": list(range(a, a + block)),
                    "visibility": visibility(d, a, block),
                    "drafts": logits.argmax(-1).tolist(),
                })
            prompts.append({"text": text, "ids": ids, "rounds": rounds})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "canary.safetensors"))
    # the kernel family that computed the taps (dflash_train::fingerprint::KernelFamily)
    kernels = {"linear_attention": linear_attention,
               "numerics": TORCH_FALLBACK if linear_attention else None, "precision": dtype}
    meta = {"format": "dflash-canary/1", "producer": producer, "block_size": block, "taps": taps,
            "mask_token_id": d.mask_token_id, "prompts": prompts, "kernels": kernels}
    (out / "canary.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out} ({dtype})")


def hybrid_drafter(target):
    torch.manual_seed(3)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=["full_attention"],
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = 4
    cfg.num_target_layers = target.config.num_hidden_layers
    # taps on a Gated DeltaNet layer (1) and on the gated-attention layer after two of them (2)
    cfg.dflash_config = {"target_layer_ids": [1, 2], "mask_token_id": 0}
    d = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for _, p in d.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return d


TORCH_FALLBACK = "transformers-torch-fallback"
FALLBACK = "transformers torch_chunk_gated_delta_rule"


def main():
    assert importlib.util.find_spec("fla") is None, "these are the torch-fallback fixtures: run without fla"
    version = "transformers " + __import__("transformers").__version__ + ", dflash 0.1.0"
    target = AutoModelForCausalLM.from_pretrained(str(FIX / "qwen3-tiny"), dtype=torch.float32).eval()
    d = DFlashDraftModel.from_pretrained(str(FIX / "dflash-tiny" / "full"), dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(FIX / "qwen3-tiny" / "tokenizer.json"))
    dump(target, d, tok, FIX / "canary" / "qwen3-tiny-zlab", version, "f32")

    hybrid = AutoModelForCausalLM.from_pretrained(str(FIX / "qwen35-tiny"), dtype=torch.float32).eval()
    hd = hybrid_drafter(hybrid)
    hd.save_pretrained(str(FIX / "dflash-tiny" / "hybrid"), safe_serialization=True)
    tok = Tokenizer.from_file(str(FIX / "qwen35-tiny" / "tokenizer.json"))
    dump(hybrid, hd, tok, FIX / "canary" / "qwen35-tiny-fallback-f32",
         version + ", the torch fallback of the Gated DeltaNet layers (no fla), f32", "f32", FALLBACK)
    hybrid, hd = hybrid.to(torch.bfloat16), hd.to(torch.bfloat16)
    dump(hybrid, hd, tok, FIX / "canary" / "qwen35-tiny-fallback",
         version + ", the torch fallback of the Gated DeltaNet layers (no fla), bf16", "bf16", FALLBACK)


if __name__ == "__main__":
    main()
