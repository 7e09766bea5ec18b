"""HF transformers beside `dflash-rs bench regen`: batched greedy decoding on a random-weight
model of a shape (config.json), `--slots` prompts of `--prompt-tokens` tokens (or lengths spread
over `--prompt-tokens-min ..= --prompt-tokens`, left-padded) to exactly
`--new-tokens` new tokens each (no EOS), bf16 on CUDA. Two variants: eager with the dynamic
cache, and the static cache (which transformers compiles with torch.compile; warmed up first).

Usage: python3 bench/regen_reference.py --shape bench/shapes/smollm2-135m.json \
           --slots 256 --prompt-tokens 256 --new-tokens 512 [--json OUT.jsonl]
"""

import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens-min", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--variants", default="eager,static")
    ap.add_argument("--json")
    a = ap.parse_args()

    cfg = AutoConfig.from_pretrained(a.shape)
    torch.manual_seed(0)
    # initialised where it runs (a large shape's random init on the host takes minutes)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    vocab = getattr(cfg, "vocab_size", None) or cfg.text_config.vocab_size
    # a hybrid's Gated DeltaNet layers run fla's kernels when fla imports, else torch's fallback
    gdn = ""
    text = getattr(cfg, "text_config", cfg)
    if "linear_attention" in (getattr(text, "layer_types", None) or []):
        try:
            import fla  # noqa: F401

            gdn = "+fla"
        except ImportError:
            gdn = "+torch-gdn"
    # the same prompt tokens as bench_tokens in dflash-rs: (17 + i * 7919) % vocab, prompt j
    # starting at offset j
    base = [(17 + i * 7919) % vocab for i in range(a.prompt_tokens + a.slots)]
    lo = a.prompt_tokens if a.prompt_tokens_min is None else a.prompt_tokens_min
    lens = [lo + (7919 * j) % (a.prompt_tokens - lo + 1) for j in range(a.slots)]
    # left-padded to the longest prompt, as generate() expects for a decoder
    ids = torch.zeros((a.slots, a.prompt_tokens), dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for j, n in enumerate(lens):
        ids[j, a.prompt_tokens - n :] = torch.tensor(base[j : j + n])
        mask[j, a.prompt_tokens - n :] = 1
    rows = []
    for variant in a.variants.split(","):
        kw = dict(
            max_new_tokens=a.new_tokens,
            min_new_tokens=a.new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        if variant == "static":
            kw["cache_implementation"] = "static"
        with torch.inference_mode():
            for _ in range(2 if variant == "static" else 1):  # compile, then warm
                model.generate(input_ids=ids, attention_mask=mask, **kw)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
        tokens = (out.shape[1] - a.prompt_tokens) * a.slots
        row = {
            "shape": a.shape,
            "impl": f"transformers-{variant}" + gdn,
            "batch": a.slots,
            "requests": a.slots,
            "prompt_tokens": a.prompt_tokens,
            "prompt_tokens_min": lo,
            "new_tokens": a.new_tokens,
            "seconds": secs,
            "new_tok_s": tokens / secs,
            "ms_per_step": 1e3 * secs / a.new_tokens,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
