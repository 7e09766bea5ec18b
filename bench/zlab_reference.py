#!/usr/bin/env python3
"""The PyTorch reference beside `dflash-rs bench` (run in the same device call): SmolLM2-135M
(the same GGUF, dequantized, bf16 on CUDA, eager attention), 4 chat prompts, greedy.

- AR through z-lab's harness: `dflash_generate(..., block_size=1)` (dflash==0.1.0), ms/token;
- HF `generate` (greedy), ms/token;
- one target forward of 1 and 16 new tokens on a warm 512-token cache, ms.
Usage: python3 bench/zlab_reference.py GGUF [new_tokens=256]
"""
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, Qwen3Config

from dflash.model import DFlashDraftModel, dflash_generate

torch.backends.cuda.matmul.allow_tf32 = False
gguf = Path(sys.argv[1])
new = int(sys.argv[2]) if len(sys.argv) > 2 else 256
dev = "cuda"
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
target = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
                                              attn_implementation="eager").to(dev).eval()
c = target.config
dc = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                 num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                 num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                 max_position_embeddings=c.max_position_embeddings)
dc.block_size, dc.num_target_layers = 16, c.num_hidden_layers
dc.dflash_config = {"target_layer_ids": [c.num_hidden_layers // 2], "mask_token_id": 16}
draft = DFlashDraftModel(dc).to(dev, torch.bfloat16).eval()
prompts = ["Explain in two sentences why the sky is blue.",
           "Write a Python function that checks whether a number is prime.",
           "What are three tips for staying focused while studying?",
           "Summarise the plot of Romeo and Juliet."]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt",
                               return_dict=True)["input_ids"].to(dev) for p in prompts]


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


with torch.inference_mode():
    res = {}
    for name in ["zlab-ar", "hf-generate"]:
        reps = []
        for rep in range(3):
            tot = 0.0
            for x in ids:
                if name == "zlab-ar":
                    r = dflash_generate(draft, target, x, max_new_tokens=new, stop_token_ids=None, block_size=1,
                                        return_stats=True)
                    tot += r.time_per_output_token
                else:
                    tot += timed(lambda: target.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)) / new
            if rep:
                reps.append(tot / len(ids))
        res[name] = statistics.median(reps)
    # one forward on a warm 512-token cache
    ctx = torch.randint(200, 20000, (1, 512), device=dev)
    for n in (1, 16):
        times = []
        for i in range(12):
            cache = DynamicCache(config=c)
            target(ctx, past_key_values=cache, use_cache=True)
            x = torch.randint(200, 20000, (1, n), device=dev)
            t = timed(lambda: target(x, past_key_values=cache, use_cache=True))
            if i >= 2:
                times.append(t)
        res[f"forward-{n}"] = statistics.median(times)
print(f"reference (torch {torch.__version__}, transformers {__import__('transformers').__version__}, dflash 0.1.0, bf16, eager):")
print(f"  AR through z-lab's harness {res['zlab-ar'] * 1e3:.2f} ms/token; HF generate {res['hf-generate'] * 1e3:.2f} ms/token")
print(f"  one target forward on a 512-token cache: 1 token {res['forward-1'] * 1e3:.2f} ms, 16 tokens {res['forward-16'] * 1e3:.2f} ms")
