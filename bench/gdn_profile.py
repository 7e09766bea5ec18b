#!/usr/bin/env python3
"""One Gated DeltaNet layer's chunked rule under Nsight Compute: dflash-rs's kernels beside fla's,
kernel by kernel (time, DRAM traffic, SM and tensor-pipe use), at the same head sizes and lengths.

    # fla's `chunk_gated_delta_rule` (bf16 q, k, v, β; f32 g; L2 norms in its kernel), run under ncu:
    ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        --csv --page raw --log-file FLA.csv python3 bench/gdn_profile.py fla SHAPE.json 2048,8192 3 > FLA.txt
    # ours (`dflash-rs bench shape --profile-gdn-rule N`), the same ncu flags:
    ncu … --log-file OURS.csv dflash-rs bench shape --shape SHAPE.json --device cuda \\
        --gdn-lengths 2048,8192 --profile-gdn-rule 3 > OURS.txt
    python3 bench/gdn_profile.py report OURS.csv OURS.txt FLA.csv FLA.txt [--json ROWS.jsonl]

Both programs print `gdn rule profile (N runs each, in this order): T = 2048, T = 8192` and
profile only those runs (the profiler's range), the same kernels for every length; the report
splits each profile into its lengths and runs, and sums per kernel name over one run. Kernels
run one at a time under the profiler (caches flushed), so the times are kernel time without the
gaps between kernels.
"""
import argparse
import collections
import csv
import json
import re
import sys

from kernel_profile import SCALE_B, SCALE_T


def run_fla(shape, lengths, reps):
    import torch

    from gdn_kernels import fla_chunk
    if fla_chunk is None:
        sys.exit("fla does not import (flash-linear-attention==0.6.0 and fla-core==0.6.0)")
    cfg = json.load(open(shape))
    cfg = cfg.get("text_config", cfg)
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = []
    for t in lengths:
        # the key heads repeated to the value heads, as transformers calls fla
        q = torch.randn(1, t, hk, dk, device="cuda", generator=g).repeat_interleave(hv // hk, 2)
        k = torch.randn(1, t, hk, dk, device="cuda", generator=g).repeat_interleave(hv // hk, 2)
        v = torch.randn(1, t, hv, dv, device="cuda", generator=g)
        gate = -torch.rand(1, t, hv, device="cuda", generator=g) * 0.5
        beta = torch.rand(1, t, hv, device="cuda", generator=g)
        inputs.append((q.bfloat16(), k.bfloat16(), v.bfloat16(), gate, beta.bfloat16()))
    kw = dict(initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for q, k, v, gate, beta in inputs:  # Triton's compilation and autotuning, outside the range
        for _ in range(2):
            fla_chunk(q, k, v, g=gate, beta=beta, **kw)
    torch.cuda.synchronize()
    names = ", ".join(f"T = {t}" for t in lengths)
    print(f"gdn rule profile ({reps} runs each, in this order): {names}", flush=True)
    torch.cuda.profiler.start()
    for q, k, v, gate, beta in inputs:
        for _ in range(reps):
            fla_chunk(q, k, v, g=gate, beta=beta, **kw)
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def read(csv_path, txt_path):
    """[(length, [kernel rows of one run ...])] of one profile: each row a dict of the metrics."""
    text = open(txt_path, errors="replace").read()
    m = re.search(r"gdn rule profile \((\d+) runs each,[^)]*in this order\): (.*)", text)
    if not m:
        sys.exit(f"{txt_path}: no 'gdn rule profile' line")
    reps = int(m.group(1))
    lengths = [int(x) for x in re.findall(r"T = (\d+)", m.group(2))]
    rows = list(csv.reader(open(csv_path, errors="replace")))
    h = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    hdr, units = rows[h], rows[h + 1]
    kernels = []
    for r in rows[h + 2:]:
        if len(r) < len(hdr):
            continue
        k = {"name": r[hdr.index("Kernel Name")]}
        for col, u, val in zip(hdr, units, r):
            if not val:
                continue
            try:
                x = float(val.replace(",", ""))
            except ValueError:
                continue
            k[col] = x * SCALE_T.get(u, 1.0) if col == "gpu__time_duration.sum" else (
                x * SCALE_B.get(u, 1.0) if col.startswith("dram__bytes") else x)
        kernels.append(k)
    per = len(kernels) // (reps * len(lengths)) if lengths else 0
    if per == 0 or per * reps * len(lengths) != len(kernels):
        sys.exit(f"{csv_path}: {len(kernels)} kernels do not split into {len(lengths)} lengths × {reps} runs")
    out = []
    for i, t in enumerate(lengths):
        block = kernels[i * reps * per:(i + 1) * reps * per]
        out.append((t, reps, block))
    return out


TENSOR_COLS = (
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",  # every tensor op
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
)


def tensor_col(cols):
    """The tensor pipes' active cycles (ComputeWorkloadAnalysis), the first of TENSOR_COLS there."""
    return next((c for c in TENSOR_COLS if c in cols), None)


def report(a):
    print("| impl | T | kernel | launches per run | µs per run | DRAM read MB | DRAM write MB | SM throughput % | tensor pipe % |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for impl, (c, t) in ((a.label, (a.ours_csv, a.ours_txt)), ("fla 0.6.0", (a.fla_csv, a.fla_txt))):
        for length, reps, block in read(c, t):
            tcol = tensor_col(set().union(*[k.keys() for k in block]))
            by = collections.OrderedDict()
            for k in block:
                s = by.setdefault(k["name"].split("(")[0][:60], collections.defaultdict(float))
                s["n"] += 1
                s["us"] += k.get("gpu__time_duration.sum", 0.0)
                s["rd"] += k.get("dram__bytes_read.sum", 0.0)
                s["wr"] += k.get("dram__bytes_write.sum", 0.0)
                w = k.get("gpu__time_duration.sum", 0.0)
                s["smw"] += w * k.get("sm__throughput.avg.pct_of_peak_sustained_elapsed", 0.0)
                s["tw"] += w * (k.get(tcol, 0.0) if tcol else 0.0)
            total = collections.defaultdict(float)
            for name, s in by.items():
                us = s["us"] / reps
                r = {"impl": impl, "T": length, "kernel": name, "launches": s["n"] / reps, "us": us,
                     "dram_read_mb": s["rd"] / reps / 1e6, "dram_write_mb": s["wr"] / reps / 1e6,
                     "sm_pct": s["smw"] / s["us"] if s["us"] else 0.0,
                     "tensor_pct": s["tw"] / s["us"] if s["us"] and tcol else None}
                rows.append(r)
                for key in ("us", "dram_read_mb", "dram_write_mb"):
                    total[key] += r[key]
                total["smw"] += s["smw"] / reps
                total["tw"] += s["tw"] / reps
                total["n"] += r["launches"]
            rows.append({"impl": impl, "T": length, "kernel": "all", "launches": total["n"], "us": total["us"],
                         "dram_read_mb": total["dram_read_mb"], "dram_write_mb": total["dram_write_mb"],
                         "sm_pct": total["smw"] / total["us"] if total["us"] else 0.0,
                         "tensor_pct": total["tw"] / total["us"] if total["us"] and tcol else None})
    f = lambda x: "—" if x is None else f"{x:.1f}"
    for r in rows:
        name = "**all**" if r["kernel"] == "all" else f"`{r['kernel']}`"
        print(f"| {r['impl']} | {r['T']} | {name} | {r['launches']:.0f} | {r['us']:.1f} | {r['dram_read_mb']:.1f} | "
              f"{r['dram_write_mb']:.1f} | {f(r['sm_pct'])} | {f(r['tensor_pct'])} |")
    if a.json:
        with open(a.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fla")
    f.add_argument("shape")
    f.add_argument("lengths")
    f.add_argument("reps", type=int)
    r = sub.add_parser("report")
    for n in ("ours_csv", "ours_txt", "fla_csv", "fla_txt"):
        r.add_argument(n)
    r.add_argument("--json")
    r.add_argument("--label", default="dflash-rs", help="the impl name of our rows")
    a = p.parse_args()
    if a.cmd == "fla":
        run_fla(a.shape, [int(x) for x in a.lengths.split(",")], a.reps)
    else:
        report(a)


if __name__ == "__main__":
    main()
