#!/usr/bin/env python3
"""Hidden states of a Qwen3.6-27B-shaped hybrid under fla's Gated DeltaNet kernels, transformers'
torch fallback and dflash-rs (CUDA and CPU), layer by layer through 64 layers, and what the
differences do to a DFlash drafter's block logits.

    python3 bench/gdn_parity.py OUT DFLASH_RS [--hidden 1024] [--tokens 512] [--layers 64] [--no-cpu]

The target: a seeded random Qwen3.5 text model with the Qwen3.6-27B layer shape (3 Gated DeltaNet
+ 1 gated attention per 4 layers; 16 key / 48 value heads of 128, conv 4; attention 24 / 4 heads
of 256, partial RoPE 0.25) at a narrower hidden size (default 1024, so that f32 and bf16 copies and
a CPU run fit one call), weights rounded to bf16 and saved to OUT/model. One prefill of
`--tokens` random ids (the chunked path, chunk 64) through:
  - transformers (the installed version) with fla's `chunk_gated_delta_rule` (if `fla` imports) and
    with its torch fallback `torch_chunk_gated_delta_rule`, in f32 and bf16, on the GPU;
  - `DFLASH_RS check forward` on cuda (f32, bf16) and, without --no-cpu, on the CPU (f32).
Per pair: max |Δ| / max |ref| of each tap (tap i = hidden_states[i + 1]) and of the logits; then a
seeded random z-lab DFlash drafter (`dflash==0.1.0`, 2 layers, block 16, taps [1, 16, 31, 46, 61]
scaled to the layer count) drafts a block at 8 anchors from each source's taps: its block logits'
max |Δ| / max |ref| and argmax agreement with the same drafter on the reference's taps.
Writes OUT/gdn-parity.json and prints the table. TF32 is off.
"""
import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3_5ForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5 as M
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from gdn_kernels import fla_chunk, torch_chunk

p = argparse.ArgumentParser()
p.add_argument("out", type=Path)
p.add_argument("dflash_rs")
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--tokens", type=int, default=512)
p.add_argument("--layers", type=int, default=64)
p.add_argument("--no-cpu", action="store_true",
               help="skip dflash-rs on the CPU (at 64 layers of hidden 1,024 it ran past 9 minutes on the "
                    "H200 machine's 16 cores; the CPU path is checked against transformers in the tests)")
a = p.parse_args()
a.out.mkdir(parents=True, exist_ok=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = "cuda" if torch.cuda.is_available() else "cpu"


def use_kernel(name):
    """Route transformers' Gated DeltaNet prefill through fla or the torch fallback, explicitly."""
    if name == "fla":
        params = inspect.signature(fla_chunk).parameters

        def call(*args, **kw):
            return fla_chunk(*args, **{k: v for k, v in kw.items() if k in params})

        M.torch_chunk_gated_delta_rule = call
    else:
        M.torch_chunk_gated_delta_rule = torch_chunk


L = a.layers
layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)]
VOCAB = 8192
cfg = Qwen3_5TextConfig(
    vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=L,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
    rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=layer_types, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
torch.manual_seed(0)
t0 = time.time()
with torch.device(dev):
    model = Qwen3_5ForCausalLM(cfg).eval()
with torch.no_grad():
    for n, w in model.named_parameters():
        if "norm" in n:
            w.add_(0.2 * torch.randn_like(w))
        elif w.dim() == 2:
            w.mul_(2.0)
        w.copy_(w.to(torch.bfloat16).float())  # the saved bf16 weights, exactly
model.to(torch.bfloat16).save_pretrained(str(a.out / "model"), safe_serialization=True)
del model
print(f"model written: {time.time() - t0:.0f} s", file=sys.stderr)


def load(dt):
    """The saved model as transformers loads it (casting the in-memory one would also cast
    buffers such as RoPE's inv_freq)."""
    return Qwen3_5ForCausalLM.from_pretrained(str(a.out / "model"), dtype=dt).to(dev).eval()


g = torch.Generator().manual_seed(1)
ids = torch.randint(0, VOCAB, (1, a.tokens), generator=g)
(a.out / "ids.json").write_text(json.dumps(ids[0].tolist()))

src = {}  # name → (taps [L-1, T, H] f32, logits [T, V] f32)
for dt_name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
    m = load(dt)
    for kernel in ["fallback", "fla"] if fla_chunk else ["fallback"]:
        use_kernel(kernel)
        with torch.no_grad():
            o = m(ids.to(dev), output_hidden_states=True)
        src[f"transformers+{kernel} {dt_name}"] = (
            torch.stack([o.hidden_states[i + 1][0] for i in range(L - 1)]).float(),
            o.logits[0].float(),
        )
        del o
    del m
model = load(torch.float32)
use_kernel("fallback")
runs = [("cuda", "f32"), ("cuda", "bf16")] if dev == "cuda" else []
runs += [] if a.no_cpu else [("cpu", "f32")]
for d, dt in runs:
    f = a.out / f"dflash-rs-{d}-{dt}.safetensors"
    t0 = time.time()
    subprocess.run([a.dflash_rs, "check", "forward", "--target", str(a.out / "model"), "--ids", str(a.out / "ids.json"),
                    "--out", str(f), "--device", d, "--dtype", dt], check=True)
    print(f"dflash-rs {d} {dt}: {time.time() - t0:.0f} s", file=sys.stderr)
    o = load_file(str(f))
    src[f"dflash-rs {d} {dt}"] = (o["taps"].to(dev), o["logits"].to(dev))
    f.unlink()

# the drafter
TAPS = sorted({round(x * (L - 2) / 62) for x in [1, 16, 31, 46, 61]})  # [1, 16, 31, 46, 61] at 64 layers
from dflash.model import DFlashDraftModel  # noqa: E402

dcfg = Qwen3Config(
    vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=2,
    num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192,
    rope_theta=10000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, layer_types=["full_attention"] * 2,
)
dcfg.architectures = ["DFlashDraftModel"]
dcfg.block_size = 16
dcfg.num_target_layers = L
dcfg.dflash_config = {"target_layer_ids": TAPS, "mask_token_id": 0}
torch.manual_seed(2)
with torch.device(dev):
    drafter = DFlashDraftModel(dcfg).eval().float()
ANCHORS = [x for x in (a.tokens - 16 * (k + 1) for k in range(8)) if x > 0]


def block_logits(taps):
    outs = []
    with torch.no_grad():
        for anchor in ANCHORS:
            ctx = torch.cat([taps[t][None, :anchor] for t in TAPS], dim=-1)
            block = torch.zeros((1, 16), dtype=torch.long, device=dev)
            block[0, 0] = ids[0, anchor]
            noise = model.get_input_embeddings()(block)
            pos = torch.arange(0, anchor + 16, device=dev)[None]
            h = drafter(target_hidden=ctx, noise_embedding=noise, position_ids=pos)
            outs.append(model.lm_head(h[:, 1:])[0])
    return torch.cat(outs)


def rel(x, y):
    return float((x - y).abs().max() / y.abs().max())


drafted = {k: block_logits(v[0]) for k, v in src.items()}
PAIRS = [
    ("f32", "transformers+fla f32", "transformers+fallback f32"),
    ("f32", "dflash-rs cuda f32", "transformers+fallback f32"),
    ("f32", "dflash-rs cpu f32", "transformers+fallback f32"),
    ("f32", "dflash-rs cuda f32", "dflash-rs cpu f32"),
    ("f32", "dflash-rs cuda f32", "transformers+fla f32"),
    ("bf16", "transformers+fla bf16", "transformers+fallback f32"),
    ("bf16", "transformers+fallback bf16", "transformers+fallback f32"),
    ("bf16", "dflash-rs cuda bf16", "transformers+fallback f32"),
    ("bf16", "transformers+fallback bf16", "transformers+fla bf16"),
    ("bf16", "dflash-rs cuda bf16", "transformers+fla bf16"),
]
rows = []
for dt, x, y in PAIRS:
    if x not in src or y not in src:
        continue
    (tx, lx), (ty, ly) = src[x], src[y]
    per_layer = [rel(tx[i], ty[i]) for i in range(L - 1)]
    dx, dy = drafted[x], drafted[y]
    rows.append({
        "dtype": dt, "impl": x, "reference": y,
        "taps_rel": {str(t): per_layer[t] for t in TAPS},
        "taps_rel_max": max(per_layer), "worst_layer": per_layer.index(max(per_layer)),
        "per_layer_rel": per_layer,
        "logits_rel": rel(lx, ly),
        "drafter_logits_rel": rel(dx, dy),
        "drafter_argmax_agree_pct": float((dx.argmax(-1) == dy.argmax(-1)).float().mean() * 100),
    })
meta = {
    "transformers": __import__("transformers").__version__, "torch": torch.__version__,
    "fla": __import__("fla").__version__ if fla_chunk else None,
    "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
    "layers": L, "hidden": a.hidden, "tokens": a.tokens, "taps": TAPS, "anchors": ANCHORS,
}
(a.out / "gdn-parity.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
print(json.dumps(meta))
print("| dtype | impl | reference | taps " + " | ".join(f"{t}" for t in TAPS) + " | max over layers (layer) | logits | drafter logits | drafter argmax agree |")
print("|---|---|---|" + "---|" * (len(TAPS) + 4))
for r in rows:
    taps = " | ".join(f"{r['taps_rel'][str(t)]:.1e}" for t in TAPS)
    print(f"| {r['dtype']} | {r['impl']} | {r['reference']} | {taps} | {r['taps_rel_max']:.1e} ({r['worst_layer']}) | "
          f"{r['logits_rel']:.1e} | {r['drafter_logits_rel']:.1e} | {r['drafter_argmax_agree_pct']:.1f} % |")
