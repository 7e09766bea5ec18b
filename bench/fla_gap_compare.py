#!/usr/bin/env python3
"""Compare the outputs of bench/fla_gap.py (fla and torch fallback, on the GPU) with dflash-rs
(`dflash-rs check forward`, CPU): max |Δ| / max |ref| of logits and of each tap, per dtype.
Usage: python3 bench/fla_gap_compare.py FLA_GAP_DIR OURS_F32.safetensors OURS_BF16.safetensors"""
import sys

import numpy as np
from safetensors.numpy import load_file

d = sys.argv[1]
fla, fb = load_file(f"{d}/fla.safetensors"), load_file(f"{d}/fallback.safetensors")
ours = {"f32": load_file(sys.argv[2]), "bf16": load_file(sys.argv[3])}


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


print("| dtype | pair | logits | taps (max over layers) |")
print("|---|---|---|---|")
for dt in ["f32", "bf16"]:
    for name, a, b in [
        ("fla vs torch fallback", fla[f"{dt}.logits"], fb[f"{dt}.logits"]),
        ("dflash-rs vs torch fallback", ours[dt]["logits"], fb[f"{dt}.logits"]),
        ("dflash-rs vs fla", ours[dt]["logits"], fla[f"{dt}.logits"]),
    ]:
        ta = {"fla vs torch fallback": fla, "dflash-rs vs torch fallback": ours[dt], "dflash-rs vs fla": ours[dt]}[name]
        tb = fla if name == "dflash-rs vs fla" else fb
        ta = ta[f"{dt}.taps"] if "fla vs" in name[:4] else ta["taps"] if ta is ours[dt] else ta[f"{dt}.taps"]
        taps = max(rel(ta[i], tb[f"{dt}.taps"][i]) for i in range(tb[f"{dt}.taps"].shape[0]))
        print(f"| {dt} | {name} | {rel(a, b):.2e} | {taps:.2e} |")

# The doctor's fingerprint metric (dflash_train::fingerprint / dflash_eval::doctor): per tap,
# max(|Δ mean|, |Δ std|, max |Δ first 8 values of the last row|) in units of the tap's std.
print("\n| dtype | pair | doctor deviation (std units, max over taps) |")
print("|---|---|---|")
for dt in ["f32", "bf16"]:
    a, b = fla[f"{dt}.taps"], fb[f"{dt}.taps"]
    dev = 0.0
    for i in range(b.shape[0]):
        s = b[i].std()
        dev = max(dev, abs(a[i].mean() - b[i].mean()) / s, abs(a[i].std() - s) / s,
                  float(np.abs(a[i][-1, :8] - b[i][-1, :8]).max() / s))
    print(f"| {dt} | fla vs torch fallback | {dev:.2e} |")
