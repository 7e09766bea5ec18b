#!/usr/bin/env python3
"""Reference outputs of z-lab's DFlash package for the dflash-rs drafter parity tests.

Uses z-lab's own code (`pip install dflash==0.1.0`, transformers >= 5.15) with the random
tiny Qwen3 target of tests/fixtures/qwen3-tiny (written by target_reference.py) and seeded
random drafters. Writes under tests/fixtures/dflash-tiny/:
  full/ and sliding/   drafter checkpoints (config.json + model.safetensors, z-lab format)
  reference.safetensors + reference.json:
    (a) block forwards: context taps, block tokens, positions and the drafter's logits, without
        a cache and with a draft KV cache (two rounds), for both drafters;
    (b) greedy `dflash_generate`: every verify block (anchor + drafts) and acceptance lengths.

Run: venv/bin/pip install torch transformers safetensors 'dflash==0.1.0'
     venv/bin/python tests/reference/dflash_reference.py
"""

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.model import DFlashDraftModel, _crop_to, _make_cache, dflash_generate, extract_context_feature

import dflash.model

torch.backends.cuda.matmul.allow_tf32 = False
# return_stats times with torch.cuda.synchronize(); on a CPU-only machine use a plain clock
if not torch.cuda.is_available():
    dflash.model._cuda_time = time.perf_counter
ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
OUT = FIX / "dflash-tiny"
TAPS = [1, 2]
BLOCK = 8


def make_drafter(target, seed, sliding, quiet=False):
    torch.manual_seed(seed)
    extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True) if sliding else dict(
        layer_types=["full_attention", "full_attention"]
    )
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, **extra,
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = BLOCK
    cfg.num_target_layers = target.config.num_hidden_layers
    cfg.dflash_config = {"target_layer_ids": TAPS, "mask_token_id": 0}
    d = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        if quiet:
            # small residual updates: the drafter mostly repeats what the mask embedding says,
            # so a loop of the target gets accepted for whole blocks, yet context still matters
            for n, p in d.named_parameters():
                if "o_proj" in n or "down_proj" in n:
                    p.mul_(0.1)
    return d


def pick_mask_token(d, target, prompt):
    """The mask token that gives the most varied acceptance lengths (a random drafter
    otherwise accepts nothing, which would leave the acceptance path untested)."""
    best, best_key = 0, None
    with torch.no_grad():
        const = target.lm_head(d.norm(target.get_input_embeddings().weight)).argmax(-1)
    seen = set(dflash_generate(d, target, torch.tensor([prompt]), max_new_tokens=48, stop_token_ids=None)[0].tolist())
    for m in [m for m in range(target.config.vocab_size) if int(const[m]) in seen]:
        d.config.dflash_config["mask_token_id"] = m
        d.mask_token_id = m
        acc = dflash_generate(d, target, torch.tensor([prompt]), max_new_tokens=48, stop_token_ids=None,
                              temperature=0.0, return_stats=True).acceptance_lengths
        key = (len(set(acc)), sum(acc))
        if best_key is None or key > best_key:
            best, best_key = m, key
    return best


def block_forward(d, target, ctx_ids, anchor_tok, cache=None, start=0):
    """z-lab's own forward for one block: context taps of ctx_ids[start:], block at len(ctx_ids)."""
    with torch.no_grad():
        hs = target(torch.tensor([ctx_ids]), output_hidden_states=True).hidden_states
        ctx = extract_context_feature(hs, d.target_layer_ids)[:, start:]
        anchor = len(ctx_ids)
        block = torch.full((1, BLOCK), d.mask_token_id, dtype=torch.long)
        block[0, 0] = anchor_tok
        noise = target.get_input_embeddings()(block)
        pos = torch.arange(start, anchor + BLOCK)[None]
        h = d(target_hidden=ctx, noise_embedding=noise, position_ids=pos, past_key_values=cache, use_cache=cache is not None)
        logits = target.lm_head(h[:, 1:])[0]
        if cache is not None:
            _crop_to(cache, anchor)
    return ctx[0].contiguous(), block[0].tolist(), logits.contiguous()


def main():
    target = Qwen3ForCausalLM.from_pretrained(str(FIX / "qwen3-tiny"), dtype=torch.float32).eval()
    tensors, meta = {}, {"source": "dflash 0.1.0 + transformers " + __import__("transformers").__version__,
                         "block_size": BLOCK, "taps": TAPS, "cases": {}}
    # the prompt of qwen3-tiny/reference.json: the target's greedy continuation settles on one token
    ctx_ids = json.loads((FIX / "qwen3-tiny" / "reference.json").read_text())["ids"]
    for name, sliding, quiet, seed in [("full", False, False, 0), ("sliding", True, False, 1), ("quiet", False, True, 2)]:
        d = make_drafter(target, seed, sliding, quiet)
        mask_id = pick_mask_token(d, target, ctx_ids) if quiet else 0
        d.config.dflash_config["mask_token_id"] = mask_id
        d.mask_token_id = mask_id
        d.save_pretrained(str(OUT / name), safe_serialization=True)
        # (a) no cache: context 0..12, anchor at 12
        ctx, block, logits = block_forward(d, target, ctx_ids, 77)
        tensors[f"{name}.nocache.ctx"], tensors[f"{name}.nocache.logits"] = ctx, logits
        meta["cases"][name] = {"mask_token_id": mask_id, "ctx_ids": ctx_ids, "nocache_block": block}
        if sliding:
            # transformers' sliding-window cache layers drop old keys: compare the uncached forward only
            continue
        # (a) with a cache: round 1 context 0..8 anchor at 8; round 2 context 8..12 anchor at 12
        cache = _make_cache(d.config)
        ctx1, block1, logits1 = block_forward(d, target, ctx_ids[:8], ctx_ids[8], cache=cache)
        ctx2, block2, logits2 = block_forward(d, target, ctx_ids, 77, cache=cache, start=8)
        tensors[f"{name}.cache1.ctx"], tensors[f"{name}.cache1.logits"] = ctx1, logits1
        tensors[f"{name}.cache2.ctx"], tensors[f"{name}.cache2.logits"] = ctx2, logits2
        # (b) greedy dflash_generate: record every target call after the prefill
        calls = []
        hook = target.register_forward_pre_hook(
            lambda m, args, kwargs: calls.append((args[0] if args else kwargs["input_ids"])[0].tolist()), with_kwargs=True
        )
        res = dflash_generate(d, target, torch.tensor([ctx_ids]), max_new_tokens=48, stop_token_ids=None,
                              temperature=0.0, return_stats=True)
        hook.remove()
        meta["cases"][name].update({
            "cache1_block": block1, "cache2_block": block2,
            "generate": {"prompt_ids": ctx_ids, "max_new_tokens": 48,
                         "output_ids": res.output_ids[0].tolist(),
                         "verify_blocks": calls[1:], "acceptance_lengths": res.acceptance_lengths},
        })
        print(f"[{name}] mask {mask_id}, acceptance lengths {res.acceptance_lengths}")
    save_file(tensors, str(OUT / "reference.safetensors"))
    (OUT / "reference.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
