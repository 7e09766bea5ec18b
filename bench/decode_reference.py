#!/usr/bin/env python3
"""The reference beside `dflash-rs bench shape --output-json` (run in the same device call by
bench/decode_side_by_side.sh): the decode costs of a dense shape in PyTorch, random bf16
weights, one GPU, a --cache-token context.

- HF transformers eager with the dynamic cache, and with a static cache whose forward
  torch.compile compiles (mode "reduce-overhead": CUDA graphs): the AR step (one token) and a
  16-row forward on the cache (a DFlash chain verify), each reading back the arg-max per row;
- z-lab's draft block (`dflash==0.1.0`'s DFlashDraftModel, when it imports) at the drafter
  shape `bench shape` times (--draft-layers layers of the target's width, B = --block-size):
  one block over a cached context, the target's LM head on its B - 1 rows, the arg-max per row;
- the weight-read floor: the target's weight bytes / the bandwidth of one read of a 4 GiB bf16
  buffer (a sum, measured here).

Rows (JSON lines, the keys of `bench shape --output-json`): shape, impl, mode, ar_ms, verify16_ms,
draft_ms, read_floor_ms. Medians of --repeats after two warm-up calls (the compiled variant
compiles in its warm-up). The timed forwards write the same cache positions again and again,
so the cache stays at --cache rows (the static cache has room for releases that append instead).

    python3 bench/decode_reference.py SHAPE.json [--cache 512] [--repeats 10] [--json OUT.jsonl]
        [--device cuda] [--variants eager,compiled,zlab] [--compile-backend inductor]
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StaticCache

p = argparse.ArgumentParser()
p.add_argument("shape")
p.add_argument("--cache", type=int, default=512)
p.add_argument("--repeats", type=int, default=10)
p.add_argument("--block-size", type=int, default=16)
p.add_argument("--draft-layers", type=int, default=5)
p.add_argument("--device", default="cuda")
p.add_argument("--variants", default="eager,compiled,zlab")
p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (eager: a check of the calls on a CPU)")
p.add_argument("--json")
a = p.parse_args()
dev = torch.device(a.device)
cuda = dev.type == "cuda"


def sync():
    if cuda:
        torch.cuda.synchronize()


def crop_to(cache, n):
    """Keep the first n positions (a negative crop: the form every transformers 5 release takes)."""
    cache.crop(-(cache.get_seq_length() - n))


def timed(fn, repeats=a.repeats):
    for _ in range(2):
        fn()
    sync()
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


shape = json.load(open(a.shape))
cfg = AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "architectures"})
name = a.shape.split("/")[-1].removesuffix(".json")
t0 = time.time()
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with dev:
    model = AutoModelForCausalLM.from_config(cfg).eval()
torch.set_default_dtype(torch.float32)
params = sum(w.numel() for w in model.parameters())
print(f"{name}: {params / 1e9:.2f} B parameters, built in {time.time() - t0:.0f} s", file=sys.stderr)
# 4 GiB of bf16 on the GPU (a read far past its caches), 128 MiB on a CPU check
buf = torch.ones(2 * 1024**3 if cuda else 64 * 1024**2, dtype=torch.bfloat16, device=dev)
gb_s = buf.numel() * 2 / timed(lambda: buf.sum(dtype=torch.float32), repeats=5) / 1e6
del buf
floor_ms = params * 2 / gb_s / 1e6
B = a.block_size
ids = torch.randint(0, cfg.vocab_size, (1, a.cache + B), device=dev)
ctx = ids[:, : a.cache]
rows = []


def row(impl, mode, **k):
    r = {"shape": name, "impl": impl, "mode": mode, "cache_rows": a.cache, "block_size": B,
         "read_floor_ms": round(floor_ms, 3), "read_bandwidth_gb_s": round(gb_s, 1)}
    r.update({key: (round(v, 3) if isinstance(v, float) else v) for key, v in k.items()})
    print(json.dumps(r), flush=True)
    rows.append(r)


version = __import__("transformers").__version__
variants = a.variants.split(",")
with torch.inference_mode():
    if "eager" in variants:
        cache = DynamicCache(config=cfg)
        model(ctx, past_key_values=cache, use_cache=True)

        def eager(n):
            def run():
                out = model(ids[:, a.cache: a.cache + n], past_key_values=cache, use_cache=True)
                crop_to(cache, a.cache)
                return out.logits.argmax(-1)
            return run

        row(f"transformers {version}", "eager, dynamic cache",
            ar_ms=timed(eager(1)), verify16_ms=timed(eager(B)), draft_ms=None)
        del cache
    if "compiled" in variants:
        # room for every timed call: releases that derive the position from the cache (not from
        # cache_position) append each call's rows
        cache = StaticCache(config=cfg, max_cache_len=a.cache + (4 + 2 * a.repeats) * (B + 1))
        model(ctx, past_key_values=cache, use_cache=True, cache_position=torch.arange(a.cache, device=dev))
        mode = "reduce-overhead" if cuda and a.compile_backend == "inductor" else None
        fwd = torch.compile(model.forward, backend=a.compile_backend, mode=mode)
        pos = {n: torch.arange(a.cache, a.cache + n, device=dev) for n in (1, B)}

        def compiled(n):
            def run():
                out = fwd(input_ids=ids[:, a.cache: a.cache + n], past_key_values=cache, use_cache=True,
                          cache_position=pos[n])
                return out.logits.argmax(-1)
            return run

        row(f"transformers {version} + torch {torch.__version__} compile", "static cache, compiled",
            ar_ms=timed(compiled(1)), verify16_ms=timed(compiled(B)), draft_ms=None)
        del cache, fwd
    if "zlab" in variants:
        try:
            from dflash.model import DFlashDraftModel
        except ImportError as e:
            print(f"z-lab's dflash does not import ({e}): no draft row", file=sys.stderr)
            DFlashDraftModel = None
        if DFlashDraftModel is not None:
            from transformers import Qwen3Config

            L = cfg.num_hidden_layers
            taps = sorted({min(L - 1, max(1, round(1 + i * (L - 3) / 4))) for i in range(5)})
            dc = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                             intermediate_size=cfg.intermediate_size, num_hidden_layers=a.draft_layers,
                             num_attention_heads=cfg.num_attention_heads,
                             num_key_value_heads=cfg.num_key_value_heads,
                             head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                             rms_norm_eps=cfg.rms_norm_eps, rope_theta=getattr(cfg, "rope_theta", 1e6),
                             max_position_embeddings=cfg.max_position_embeddings)
            dc.block_size, dc.num_target_layers = B, L
            dc.dflash_config = {"target_layer_ids": taps, "mask_token_id": 0}
            torch.manual_seed(1)
            draft = DFlashDraftModel(dc).to(dev, torch.bfloat16).eval()
            head = model.get_output_embeddings()
            embed = model.get_input_embeddings()
            hidden = torch.randn(1, a.cache, len(taps) * cfg.hidden_size, device=dev, dtype=torch.bfloat16)
            positions = torch.arange(a.cache + B, device=dev)[None]
            dcache = DynamicCache(config=dc)
            block = ids[:, a.cache - 1: a.cache - 1 + B].clone()
            block[:, 1:] = 0
            # the context but its last row in the draft cache, as after a round
            draft(target_hidden=hidden[:, : a.cache - 1], noise_embedding=embed(block),
                  position_ids=positions[:, : a.cache - 1 + B], past_key_values=dcache, use_cache=True)
            crop_to(dcache, a.cache - 1)

            def zlab():
                h = draft(target_hidden=hidden[:, a.cache - 1:], noise_embedding=embed(block),
                          position_ids=positions[:, a.cache - 1: a.cache + B],
                          past_key_values=dcache, use_cache=True)[:, 1 - B:, :]
                crop_to(dcache, a.cache - 1)
                return draft.compute_logits(h, head).argmax(-1)

            from importlib.metadata import version as dist_version

            row(f"z-lab dflash {dist_version('dflash')} draft block ({a.draft_layers} layers, B = {B}),"
                f" transformers {version}", "eager",
                ar_ms=None, verify16_ms=None, draft_ms=timed(zlab))
if a.json:
    with open(a.json, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
