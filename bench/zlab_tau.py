#!/usr/bin/env python3
"""z-lab's own decoding loop on trained drafters: τ of `dflash_generate` (dflash==0.1.0) on the first
GSM8K problems, beside the τ `dflash-rs eval` measured on the same problems (issue 30: the two
drafters of the reference-trainer comparison, evaluated by both harnesses).

The prompt is the one `dflash-rs eval --dataset gsm8k` builds (the question, then "\\nPlease reason
step by step, and put your final answer within \\boxed{}.", the target's chat template with the
generation prompt); greedy, stopping at the target's EOS, `max_new_tokens` as given. τ pooled = the
committed tokens over the rounds (z-lab's `acceptance_lengths`). With `--report`, each problem's
prompt length is checked against the dflash-rs report's (a different prompt is an error) and the
report's DFlash τ of the same label and problems is printed beside.

Usage: python3 bench/zlab_tau.py GGUF GSM8K_JSONL NAME=DRAFTER_DIR... [--limit 8] [--max-new-tokens 128]
         [--dtype bf16|f32] [--report REPORT.json[.xz]] [--json OUT.jsonl]
"""
import argparse
import json
import lzma
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.model import DFlashDraftModel, dflash_generate

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def load_report(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("gsm8k")
    ap.add_argument("drafters", nargs="+", help="NAME=DIR (z-lab format)")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--report", help="a dflash-rs eval report.json(.xz) of the same problems")
    ap.add_argument("--json", help="append one row per drafter to this file")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":  # return_stats times with CUDA events; on the CPU the host clock does
        import time
        import dflash.model
        dflash.model._cuda_time = time.perf_counter
    g = Path(a.gguf)
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    target = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=dtype).to(dev).eval()
    eos = target.generation_config.eos_token_id or tok.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    questions = []
    with open(a.gsm8k) as f:
        for line in f:
            if line.strip():
                questions.append(json.loads(line)["question"])
            if len(questions) == a.limit:
                break
    report = load_report(a.report) if a.report else None
    for spec in a.drafters:
        name, _, path = spec.partition("=")
        if not path:
            sys.exit(f"{spec}: expected NAME=DIR")
        modes = ("dflash", f"dflash[{name}]")  # the report's label: alone, or among several drafters
        draft = DFlashDraftModel.from_pretrained(path, dtype=dtype).to(dev).eval()
        committed = rounds = 0
        for i, q in enumerate(questions):
            ids = tok.apply_chat_template([{"role": "user", "content": q + SUFFIX}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"].to(dev)
            if report is not None:
                mine = [r for r in report["runs"] if r["item"] == f"gsm8k-{i}" and r["mode"] in modes]
                if mine and mine[0]["prompt_tokens"] != ids.shape[1]:
                    sys.exit(f"gsm8k-{i}: {ids.shape[1]} prompt tokens here, {mine[0]['prompt_tokens']} in "
                             f"{a.report}: not the same prompt")
            with torch.no_grad():
                out = dflash_generate(draft, target, ids, a.max_new_tokens, eos, temperature=0.0, return_stats=True)
            committed += sum(out.acceptance_lengths)
            rounds += len(out.acceptance_lengths)
        tau = committed / rounds
        line = f"{name}: z-lab dflash_generate τ {tau:.3f} ({rounds} rounds, {committed} tokens, {len(questions)} problems)"
        row = dict(drafter=name, harness="zlab-dflash_generate", problems=len(questions),
                   max_new_tokens=a.max_new_tokens, dtype=a.dtype, tau_pooled=tau)
        if report is not None:
            mine = [r for r in report["runs"] if r["mode"] in modes and int(r["item"].split("-")[1]) < len(questions)]
            if mine:
                t = sum(x["tau_round"] for r in mine for x in r["rounds"]) / sum(len(r["rounds"]) for r in mine)
                line += f"; dflash-rs eval τ {t:.3f} on the same problems"
                row["dflash_rs_tau_pooled"] = t
        print(line, flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        del draft
        torch.cuda.empty_cache() if dev == "cuda" else None


if __name__ == "__main__":
    main()
