#!/usr/bin/env python3
"""Reference outputs of z-lab's DFlash2 drafter (`DFlash2DraftModel`, dflash==0.1.0) for the
dflash-rs DFlash2 parity tests.

Seeded random DFlash2 drafters (z-lab's own modules, weights drawn here, saved in z-lab's
checkpoint format: the selector codebooks without a `.weight` suffix) for two targets:
  tiny-full      the random tiny Qwen3 of tests/fixtures/qwen3-tiny; full attention, not causal
  tiny-sliding   the same target; layers [sliding (window 4 < block 8), full], is_causal false
  smollm2        SmolLM2-135M-Instruct (the Q4_1 GGUF of scripts/fetch-assets.sh, dequantized
                 to f32 by transformers); weights rounded to bf16 and stored as bf16
Writes under tests/fixtures/dflash2/: one drafter directory per case, reference.safetensors and
reference.json with, per case:
  (a) one block without a draft cache: context taps, the block's normed hidden rows 1..B-1
      and its logits (SmolLM2: the first 4,096 columns), the selector's greedy proposals, and a
      sampled walk at T = 0.7 (its path, candidates and q rows);
  (b) tiny-full: two rounds with a draft cache;
  (c) greedy `dflash_generate`: every verify block and the acceptance lengths.

Run: venv/bin/pip install torch transformers safetensors gguf 'dflash==0.1.0'
     scripts/fetch-assets.sh
     venv/bin/python tests/reference/dflash2_reference.py
"""

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import dflash.model
from dflash.model import DFlash2DraftModel, _crop_to, _make_cache, dflash_generate, extract_context_feature

torch.backends.cuda.matmul.allow_tf32 = False
if not torch.cuda.is_available():
    dflash.model._cuda_time = time.perf_counter
ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
OUT = FIX / "dflash2"
HOME = Path(os.environ.get("DFLASH_RS_HOME", Path.home() / ".cache" / "dflash-rs"))
SMOLLM2 = HOME / "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK = 8
T_SAMPLED = 0.7
SMOLLM2_COLUMNS = 4096


def make_drafter(target, seed, *, hidden, heads, kv_heads, head_dim, inter, taps, layer_types, window,
                 conv_k, conv_gs, rank, top_k, multiplier=None, softcap=None, bf16=False):
    tc = target.config
    extra = dict(sliding_window=window, use_sliding_window=True) if window else {}
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=layer_types, **extra,
    )
    cfg.architectures = ["DFlash2DraftModel"]
    cfg.is_causal = False
    cfg.block_size = BLOCK
    cfg.num_target_layers = tc.num_hidden_layers
    dc = {"target_layer_ids": taps, "mask_token_id": 0, "conv_kernel_size": conv_k, "conv_group_size": conv_gs,
          "selector_rank": rank, "selector_top_k": top_k}
    if multiplier is not None:
        dc["output_multiplier"] = multiplier
    if softcap is not None:
        dc["final_logit_softcapping"] = softcap
    cfg.dflash_config = dc
    torch.manual_seed(seed)
    d = DFlash2DraftModel(cfg).eval()
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "codebook" in n:
                p.normal_(0.0, 1.0)  # large enough that the edge term reorders candidates
            elif n.endswith("base_kernel"):
                p.normal_(0.0, 0.3)
                p[:, 0] += 1.0  # near the identity, as a trained conv starts
            elif p.dim() == 2:
                p.normal_(0.0, 0.05)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            if bf16:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return d


def save_drafter(d, out, bf16):
    """z-lab's checkpoint layout: config.json + model.safetensors, codebooks without `.weight`."""
    out.mkdir(parents=True, exist_ok=True)
    d.config.to_json_file(str(out / "config.json"))
    sd = {}
    for k, v in d.state_dict().items():
        if k.startswith("candidate_selector.") and "codebook" in k:
            k = k.removesuffix(".weight")
        v = v.detach().contiguous()
        sd[k] = v.to(torch.bfloat16) if bf16 else v
    save_file(sd, str(out / "model.safetensors"))


def taps_of(d, target, ids):
    with torch.no_grad():
        hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return extract_context_feature(hs, d.target_layer_ids)


def block_forward(d, target, ctx_ids, anchor_tok, cache=None, start=0):
    """z-lab's forward for one block: context taps of ctx_ids[start:], block at len(ctx_ids); the
    normed hidden rows 1..B-1 and their draft logits."""
    with torch.no_grad():
        ctx = taps_of(d, target, ctx_ids)[:, start:]
        anchor = len(ctx_ids)
        block = torch.full((1, BLOCK), d.mask_token_id, dtype=torch.long)
        block[0, 0] = anchor_tok
        noise = target.get_input_embeddings()(block)
        pos = torch.arange(start, anchor + BLOCK)[None]
        h = d(target_hidden=ctx, noise_embedding=noise, position_ids=pos, past_key_values=cache,
              use_cache=cache is not None)[:, 1:]
        logits = d.compute_logits(h, target.lm_head)
        if cache is not None:
            _crop_to(cache, anchor)
    return ctx[0].contiguous(), block[0].tolist(), h, logits


def selector_cases(d, target, h, logits, anchor_tok, seed):
    """The selector's greedy proposals and one sampled walk (path, candidates, q rows)."""
    with torch.no_grad():
        anchor = torch.tensor([anchor_tok])
        greedy, cand0, _ = d.candidate_selector.select(h, logits, anchor, 0.0)
        torch.manual_seed(seed)
        path, cand, q = d.candidate_selector.select(h, logits, anchor, T_SAMPLED)
    return {
        "greedy": greedy[0].tolist(),
        "greedy_candidates": cand0[0].tolist(),
        "sampled_temperature": T_SAMPLED,
        "sampled_path": path[0].tolist(),
        "sampled_candidates": cand[0].tolist(),
    }, q[0].contiguous()


def generate_case(d, target, prompt, max_new):
    calls = []
    hook = target.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((args[0] if args else kwargs["input_ids"])[0].tolist()), with_kwargs=True
    )
    res = dflash_generate(d, target, torch.tensor([prompt]), max_new_tokens=max_new, stop_token_ids=None,
                          temperature=0.0, return_stats=True)
    hook.remove()
    return {"prompt_ids": prompt, "max_new_tokens": max_new, "output_ids": res.output_ids[0].tolist(),
            "verify_blocks": calls[1:], "acceptance_lengths": res.acceptance_lengths}


def pick_mask_token(d, target, prompt, candidates):
    """The mask token (among `candidates`) whose greedy generation accepts the most drafts, so
    that the acceptance path is exercised."""
    best, best_key = candidates[0], None
    for m in candidates:
        d.config.dflash_config["mask_token_id"] = m
        d.mask_token_id = m
        acc = dflash_generate(d, target, torch.tensor([prompt]), max_new_tokens=32, stop_token_ids=None,
                              temperature=0.0, return_stats=True).acceptance_lengths
        key = (sum(acc), len(set(acc)))
        if best_key is None or key > best_key:
            best, best_key = m, key
    d.config.dflash_config["mask_token_id"] = best
    d.mask_token_id = best
    return best


def main():
    tensors, meta = {}, {"source": "dflash 0.1.0 + transformers " + __import__("transformers").__version__
                         + ", torch " + torch.__version__, "block_size": BLOCK, "cases": {}}
    tiny = Qwen3ForCausalLM.from_pretrained(str(FIX / "qwen3-tiny"), dtype=torch.float32).eval()
    tiny_ids = json.loads((FIX / "qwen3-tiny" / "reference.json").read_text())["ids"]
    smol = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name,
                                                dtype=torch.float32).eval()
    smol_ids = json.loads((FIX / "smollm2.json").read_text())["cases"][0]["prompt_ids"]
    tiny_shape = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, taps=[1, 2], conv_k=3, conv_gs=16,
                      rank=8, top_k=6, multiplier=0.8, softcap=6.0)
    cases = [
        ("tiny-full", tiny, tiny_ids, dict(tiny_shape, layer_types=["full_attention"] * 2, window=None), 3, False),
        ("tiny-sliding", tiny, tiny_ids,
         dict(tiny_shape, layer_types=["sliding_attention", "full_attention"], window=4), 4, False),
        ("smollm2", smol, smol_ids,
         dict(hidden=576, heads=2, kv_heads=1, head_dim=32, inter=64, taps=[1, 27], layer_types=["full_attention"] * 2,
              window=None, conv_k=2, conv_gs=16, rank=4, top_k=8), 5, True),
    ]
    for name, target, ids, shape, seed, bf16 in cases:
        d = make_drafter(target, seed, bf16=bf16, **shape)
        full = name != "tiny-sliding"
        if name == "tiny-full":
            pick_mask_token(d, target, ids, list(range(0, 256, 8)))
        elif name == "smollm2":
            d.config.dflash_config["mask_token_id"] = 16  # <empty_output>, the default mask token
            d.mask_token_id = 16
        save_drafter(d, OUT / name, bf16)
        # context 0..12, anchor at 12 (the tiny prompt has 12 tokens: anchor token 77)
        ctx_ids, anchor_tok = ids[:12], (ids[12] if len(ids) > 12 else 77)
        ctx, block, h, logits = block_forward(d, target, ctx_ids, anchor_tok)
        sel, q = selector_cases(d, target, h, logits, anchor_tok, seed)
        cols = logits.shape[-1] if name != "smollm2" else SMOLLM2_COLUMNS
        tensors[f"{name}.nocache.ctx"] = ctx
        tensors[f"{name}.nocache.hidden"] = h[0].contiguous()
        tensors[f"{name}.nocache.logits"] = logits[0, :, :cols].contiguous()
        tensors[f"{name}.nocache.sampled_q"] = q
        case = {"mask_token_id": d.mask_token_id, "ctx_ids": ctx_ids, "nocache_block": block,
                "logit_columns": cols, "selector": sel}
        if full:
            # (b) a draft cache: round 1 context 0..8 (anchor 8), round 2 context 8..12 (anchor 12)
            if name == "tiny-full":
                cache = _make_cache(d.config)
                _, b1, _, l1 = block_forward(d, target, ctx_ids[:8], ctx_ids[8], cache=cache)
                _, b2, _, l2 = block_forward(d, target, ctx_ids, anchor_tok, cache=cache, start=8)
                tensors[f"{name}.cache1.logits"], tensors[f"{name}.cache2.logits"] = l1[0], l2[0]
                case.update({"cache1_block": b1, "cache2_block": b2})
            case["generate"] = generate_case(d, target, ids, 40 if name == "tiny-full" else 24)
            print(f"[{name}] acceptance lengths {case['generate']['acceptance_lengths']}")
        print(f"[{name}] greedy proposals {sel['greedy']}")
        meta["cases"][name] = case
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT / "reference.safetensors"))
    (OUT / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
