#!/usr/bin/env python3
"""transformers reference for scripts/bench-cpu.sh: AR prefill and decode tokens/s of the same
SmolLM2-135M GGUF (dequantized to f32) on CPU, same prompt, greedy with a KV cache.
Usage: venv/bin/python bench/transformers_cpu_ar.py [threads=2] [new_tokens=128] [repeats=3]"""
import os, statistics, sys, time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

threads, new, reps = (int(x) for x in (sys.argv[1:] + ["2", "128", "3"][len(sys.argv) - 1:]))
torch.set_num_threads(threads)
home = Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache/dflash-rs"))
g = home / "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32).eval()
prompt = " ".join(["The history of the printing press begins in the fifteenth century."] * 24)
ids = torch.tensor([tok(prompt)["input_ids"]])
pre, dec = [], []
with torch.inference_mode():
    for _ in range(reps):
        t0 = time.perf_counter()
        o = model(ids, use_cache=True)
        t1 = time.perf_counter()
        past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        for _ in range(new - 1):
            o = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
        pre.append(ids.shape[1] / (t1 - t0))
        dec.append((new - 1) / (t2 - t1))
print(f"transformers {__import__('transformers').__version__} torch {torch.__version__} threads {threads}: "
      f"prefill {statistics.median(pre):.1f} tok/s ({ids.shape[1]} tokens), decode {statistics.median(dec):.2f} tok/s ({new} tokens)")
