#!/usr/bin/env python3
"""The reference beside `dflash-rs bench shape` for a hybrid shape: HF transformers (+ fla when it
imports) on the same shape, random bf16 weights, one GPU, eager.

    python3 bench/hybrid_hf_speed.py SHAPE.json OUT.json [--cache 512] [--repeats 10]

Times (median of --repeats, CUDA events, after two warm-up calls): the AR step (one token on a
--cache-token cache) and a 16-row forward on that cache (a DFlash chain verify), then fla's
`chunk_gated_delta_rule` and transformers' torch fallback on one layer's inputs at the shape's
Gated DeltaNet size (bf16 inputs, T = 2,048 and 8,192), and the weight-read floor: weight bytes ÷ the
bandwidth of one read of a 4 GiB bf16 buffer (a sum, measured here). The cache is not
rolled back between timed calls (transformers' linear-attention cache cannot be), so each call
sees a few more positions; at a 512-token cache that changes nothing measurable.
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from gdn_kernels import fla_chunk, torch_chunk

p = argparse.ArgumentParser()
p.add_argument("shape")
p.add_argument("out")
p.add_argument("--cache", type=int, default=512)
p.add_argument("--repeats", type=int, default=10)
a = p.parse_args()
def timed(fn, repeats=a.repeats):
    for _ in range(2):
        fn()
    ms = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ms.append(s.elapsed_time(e))
    return statistics.median(ms)


cfg = AutoConfig.for_model(**{k: v for k, v in json.load(open(a.shape)).items() if k != "architectures"})
name = a.shape.split("/")[-1].removesuffix(".json")
t0 = time.time()
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg).eval()
torch.set_default_dtype(torch.float32)
params = sum(w.numel() for w in model.parameters())
print(f"{name}: {params / 1e9:.2f} B parameters, built in {time.time() - t0:.0f} s", file=sys.stderr)
buf = torch.ones(2 * 1024**3, dtype=torch.bfloat16, device="cuda")  # 4 GiB
gb_s = buf.numel() * 2 / timed(lambda: buf.sum(dtype=torch.float32), repeats=5) / 1e6
del buf
read_ms = params * 2 / gb_s / 1e6
row = {"shape": name, "impl": f"transformers {__import__('transformers').__version__} eager"
       + (f" + fla {__import__('fla').__version__}" if fla_chunk else " (torch fallback)"),
       "params_b": round(params / 1e9, 2), "read_floor_ms": round(read_ms, 3),
       "read_bandwidth_gb_s": round(gb_s, 1)}
ids = torch.randint(0, cfg.vocab_size, (1, a.cache + 4096), device="cuda")
with torch.no_grad():
    cache = DynamicCache(config=cfg)
    model(ids[:, : a.cache], past_key_values=cache, use_cache=True)
    pos = [a.cache]

    def step(n):
        def run():
            model(ids[:, pos[0]: pos[0] + n], past_key_values=cache, use_cache=True)
            pos[0] += n
        return run

    row["ar_ms"] = round(timed(step(1)), 3)
    row["verify16_ms"] = round(timed(step(16)), 3)
    row["verify16_over_ar"] = round(row["verify16_ms"] / row["ar_ms"], 2)
del model, cache
torch.cuda.empty_cache()

# one Gated DeltaNet layer's chunked rule at the shape (q, k repeated to the value heads, as
# transformers calls it)
hv, hk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
for T in [2048, 8192]:
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(1, T, hv, dk, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, T, hv, dk, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, T, hv, dv, device="cuda", generator=g).bfloat16()
    gate = -torch.rand(1, T, hv, device="cuda", generator=g) * 0.5
    beta = torch.rand(1, T, hv, device="cuda", generator=g).bfloat16()
    kw = dict(g=gate, beta=beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if fla_chunk:
        row[f"fla_chunk_ms_T{T}"] = round(timed(lambda: fla_chunk(q, k, v, **kw)), 3)
    row[f"torch_chunk_ms_T{T}"] = round(timed(lambda: torch_chunk(q, k, v, **kw), repeats=3), 3)
print(json.dumps(row))
json.dump(row, open(a.out, "w"), indent=1)
