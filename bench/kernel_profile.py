#!/usr/bin/env python3
"""Where a replayed decode forward's GPU time goes, kernel class by kernel class.

Reads the raw CSV of Nsight Compute run over `dflash-rs bench shape --profile-replays N` (the
draft block, the AR step, the chain verify), `dflash-rs bench shape --profile-eager N` (the AR
step and the chain verify run eagerly: for targets whose graphs the profiler cannot replay) or `dflash-rs bench regen --profile-replays N` (a
batched step, a prefill) and that command's output (the line giving each forward's kernel
count), takes the profile's last N · (sum of the counts) kernels — the forwards, N times each,
in that order — and sums, per forward and per kernel class, the kernels' time and DRAM bytes
read (per run: the sums over N runs / N).

    ncu --profile-from-start off --graph-profiling node \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \\
        --log-file NCU.csv dflash-rs bench shape --shape S --device cuda --dtype bf16 \\
        --profile-replays 3 > OUT.txt
    python3 bench/kernel_profile.py NCU.csv OUT.txt [--label S] [--json ROWS.jsonl]

With `--all` (no OUT.txt) every profiled kernel is summed, by class and by name (the 25 with the
most time): for a whole run under the profiler, e.g. `bench regen` of a hybrid target, whose
batched steps and prefills have no replays to profile.

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
        --log-file NCU.csv dflash-rs bench regen --shape S … --max-new-tokens 8
    python3 bench/kernel_profile.py NCU.csv --all [--label S]

Kernels run one at a time under the profiler (each timed alone, caches flushed before each),
so the sums are kernel time without the gaps between kernels, and the DRAM bytes are those a
cold kernel reads. Classes, by kernel name: Gated DeltaNet (its prep, rule and gated norm), GEMM (cuBLAS / CUTLASS / nvjet), attention
(softmax, attention kernels), RMSNorm, RoPE, copies and casts, and other elementwise kernels.
"""
import argparse
import collections
import csv
import json
import re
import sys

CLASSES = [
    ("Gated DeltaNet", ("gdn", "gated_norm")),
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")),
    ("attention", ("softmax", "attention", "interval", "_attn")),
    ("RMSNorm", ("rmsnorm", "rms_norm")),
    ("RoPE", ("rope",)),
    ("copies and casts", ("copy", "cast", "const_set", "index_select", "scatter", "gather", "permute", "swap")),
]


def kernel_class(name):
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other elementwise"


SCALE_T = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
SCALE_B = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def sums(kernels, key):
    """Per key(kernel name): [kernels, µs, DRAM bytes read] summed."""
    by = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for kn, t, b in kernels:
        c = by[key(kn)]
        c[0] += 1
        c[1] += t
        c[2] += b
    return by


def read_ncu(path):
    rows = list(csv.reader(open(path, errors="replace")))
    h = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    hdr, units = rows[h], rows[h + 1]
    ki, ti = hdr.index("Kernel Name"), hdr.index("gpu__time_duration.sum")
    bi = hdr.index("dram__bytes_read.sum") if "dram__bytes_read.sum" in hdr else None
    st = SCALE_T[units[ti]]
    sb = SCALE_B.get(units[bi], 1.0) if bi is not None else 0.0
    out = []
    for r in rows[h + 2:]:
        if len(r) <= ti or not r[ti]:
            continue
        t = float(r[ti].replace(",", "")) * st
        b = float(r[bi].replace(",", "")) * sb if bi is not None and r[bi] else 0.0
        out.append((r[ki], t, b))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ncu_csv")
    p.add_argument("bench_out", nargs="?")
    p.add_argument("--label", default="")
    p.add_argument("--json")
    p.add_argument("--all", action="store_true", help="sum every profiled kernel (no OUT.txt)")
    a = p.parse_args()
    if a.all:
        return whole_run(read_ncu(a.ncu_csv), a.label)
    if a.bench_out is None:
        sys.exit("give the bench command's output (OUT.txt), or --all")
    text = open(a.bench_out, errors="replace").read()
    m = re.search(r"profile replays \((\d+) each, in this order\): (.*)", text)
    if not m:
        sys.exit(f"{a.bench_out}: no 'profile replays' line (run bench shape or bench regen "
                 "with --profile-replays N)")
    reps = int(m.group(1))
    groups = [(g.group(1), int(g.group(2))) for g in re.finditer(r"(?:, )?(.+?) (\d+) kernels", m.group(2))]
    kernels = read_ncu(a.ncu_csv)
    need = reps * sum(k for _, k in groups)
    if len(kernels) < need:
        sys.exit(f"{a.ncu_csv}: {len(kernels)} kernels profiled, the replays alone are {need}")
    if len(kernels) != need:
        print(f"note: {len(kernels)} kernels profiled where the runs launch {need}: the first "
              f"{len(kernels) - need} are left out", file=sys.stderr)
    tail = kernels[-need:]
    rows, at = [], 0
    print(f"{a.label}: kernel time per replay (µs), DRAM read (MB) and its rate, mean of {reps} replays\n")
    print("| forward | class | kernels | kernel µs | share | DRAM read MB | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, k in groups:
        ks = tail[at:at + reps * k]
        at += reps * k
        by = sums(ks, kernel_class)
        total_t = sum(v[1] for v in by.values()) / reps
        total_b = sum(v[2] for v in by.values()) / reps
        for cls, (cnt, t, b) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            t, b = t / reps, b / reps
            gbs = b / (t * 1e3) if t > 0 else 0.0
            print(f"| {name} | {cls} | {cnt // reps} | {t:.1f} | {t / total_t:.0%} | {b / 1e6:.1f} | {gbs:.0f} |")
            rows.append({"shape": a.label, "forward": name, "class": cls, "kernels": cnt // reps,
                         "kernel_us": t, "dram_read_mb": b / 1e6, "gb_s": gbs})
        print(f"| {name} | **all** | {k} | {total_t:.1f} | 100% | {total_b / 1e6:.1f} | "
              f"{total_b / (total_t * 1e3):.0f} |")
        rows.append({"shape": a.label, "forward": name, "class": "all", "kernels": k,
                     "kernel_us": total_t, "dram_read_mb": total_b / 1e6,
                     "gb_s": total_b / (total_t * 1e3)})
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def whole_run(kernels, label):
    """Every kernel of the profile summed, by class, then by name (the 25 with the most time)."""
    total = sum(t for _, t, _ in kernels) or 1.0
    print(f"{label}: {len(kernels)} kernels, {total / 1e3:.1f} ms of kernel time\n")
    for key, title in ((kernel_class, "class"), (lambda n: n.split("(")[0][:80], "kernel")):
        by = sums(kernels, key)
        print(f"| {title} | kernels | ms | share | DRAM read MB |")
        print("|---|---|---|---|---|")
        for name, (cnt, t, b) in sorted(by.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"| {name} | {cnt} | {t / 1e3:.2f} | {t / total:.0%} | {b / 1e6:.1f} |")
        print()


if __name__ == "__main__":
    main()
