#!/usr/bin/env python3
"""llama.cpp's AR decode on the CPU, the reference beside `dflash-rs bench decode --device cpu`.

    pip install llama-cpp-python==0.3.36        # builds llama.cpp from source (minutes)
    python3 bench/llama_cpp_cpu.py GGUF OUT.json [--threads 2] [--new-tokens 64] [--repeats 3]

The same four prompts as `dflash-rs bench decode` (crates/dflash-cli/src/bench_cmd.rs), in the
ChatML turn SmolLM2 and Qwen2.5 use; per prompt the cache is reset, the prompt evaluated
(prefill, timed apart) and `--new-tokens` tokens decoded greedily one at a time
(`Llama.eval` + `Llama.sample(temp=0)`, end-of-sequence not stopping it). ms/token is the
decode time over the new tokens, mean over the prompts, median over `--repeats` after one
warm-up. Writes rows `{impl, mode, ms_per_token, prefill_ms, threads, model}`.
"""
import argparse
import json
import os
import statistics
import time

from llama_cpp import Llama, __version__

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "What are three tips for staying focused while studying?",
    "Summarise the plot of Romeo and Juliet.",
]

p = argparse.ArgumentParser()
p.add_argument("gguf")
p.add_argument("out")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--repeats", type=int, default=3)
a = p.parse_args()

llm = Llama(model_path=a.gguf, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=1024,
            n_batch=512, verbose=False, logits_all=False)


def one(prompt):
    text = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    for _ in range(a.new_tokens):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    t2 = time.perf_counter()
    return (t2 - t1) / a.new_tokens, t1 - t0


runs = []
for rep in range(a.repeats + 1):
    r = [one(pr) for pr in PROMPTS]
    if rep > 0:
        runs.append((sum(x[0] for x in r) / len(r), sum(x[1] for x in r) / len(r)))
row = {
    "impl": f"llama.cpp (llama-cpp-python {__version__})",
    "mode": "ar",
    "ms_per_token": round(statistics.median(x[0] for x in runs) * 1e3, 3),
    "prefill_ms": round(statistics.median(x[1] for x in runs) * 1e3, 3),
    "threads": a.threads,
    "model": os.path.basename(a.gguf),
    "new_tokens": a.new_tokens,
}
print(json.dumps(row))
json.dump(row, open(a.out, "w"), indent=1)
