#!/usr/bin/env python3
"""Where a training step's GPU time goes, kernel by kernel.

Reads the raw CSV of Nsight Compute run over `dflash-rs bench train --profile-step` (the last
step's drafter part: forward, loss, backward, AdamW, recorded alone) and sums the kernels' time
by class and by kernel name.

    ncu --profile-from-start off --replay-mode application --metrics gpu__time_duration.sum \\
        --csv --page raw --log-file NCU.csv dflash-rs bench train --shape S --device cuda \\
        --dtype bf16 --seq-len 2048 --anchors 512 --steps 1 --profile-step
    python3 bench/train_profile.py NCU.csv [--label S] [--top 25] [--json ROWS.jsonl]

Kernels run one at a time under the profiler, so the sums are kernel time without the gaps
between kernels. Classes, by kernel name: GEMM (cuBLAS / CUTLASS / nvjet), the training
attention (`train_attn_*`, the block softmax), binary elementwise (candle's `b*` kernels: the
autograd's gradient sums, residuals, scaling), fills (the autograd's zeroed gradient buffers),
copies and casts, reductions, the cross-entropy, RMSNorm, SwiGLU, RoPE, AdamW, other.
"""
import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_profile import read_ncu  # noqa: E402

CLASSES = [
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
    ("training attention", ("train_attn", "block_softmax")),
    ("cross-entropy", ("ce_", "cross_entropy", "log_softmax")),
    ("RMSNorm", ("rms",)),
    ("SwiGLU", ("silu",)),
    ("RoPE", ("rope",)),
    ("AdamW", ("adam", "sq_sum")),
    ("fills", ("fill", "const_set", "zeros")),
    ("copies and casts", ("copy", "cast", "index", "cat", "permute", "gather", "scatter", "where")),
    ("reductions", ("reduce", "sum", "max", "min", "argm")),
    ("binary elementwise", ("badd", "bmul", "bsub", "bdiv", "bmaximum", "bminimum")),
    ("unary elementwise", ("affine", "usqr", "usqrt", "uexp", "ulog", "uneg", "urecip", "powf", "elu", "gelu", "tanh")),
]


def kernel_class(name):
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ncu_csv")
    p.add_argument("--label", default="")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json")
    a = p.parse_args()
    kernels = read_ncu(a.ncu_csv)
    if not kernels:
        sys.exit(f"{a.ncu_csv}: no kernels (run bench train with --profile-step under ncu --profile-from-start off)")
    total = sum(t for _, t, _ in kernels)
    by_class = collections.defaultdict(lambda: [0, 0.0])
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, t, _ in kernels:
        short = name.split("(")[0].strip()
        by_class[kernel_class(short)][0] += 1
        by_class[kernel_class(short)][1] += t
        by_name[short][0] += 1
        by_name[short][1] += t
    print(f"{a.label}: the drafter step's kernels, {len(kernels)} kernels, {total / 1e3:.1f} ms of kernel time\n")
    print("| class | kernels | ms | share |\n|---|---|---|---|")
    rows = []
    for cls, (n, t) in sorted(by_class.items(), key=lambda kv: -kv[1][1]):
        print(f"| {cls} | {n} | {t / 1e3:.1f} | {t / total:.0%} |")
        rows.append({"label": a.label, "table": "class", "class": cls, "kernels": n, "ms": t / 1e3})
    print(f"\n| kernel (top {a.top}) | class | kernels | ms | share |\n|---|---|---|---|---|")
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"| `{name[:70]}` | {kernel_class(name)} | {n} | {t / 1e3:.2f} | {t / total:.1%} |")
        rows.append({"label": a.label, "table": "kernel", "kernel": name, "class": kernel_class(name),
                     "kernels": n, "ms": t / 1e3})
    rows.append({"label": a.label, "table": "total", "kernels": len(kernels), "ms": total / 1e3})
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
