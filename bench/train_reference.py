#!/usr/bin/env python3
"""The PyTorch reference beside `dflash-rs bench train`: the same DFlash training step, written
plainly, on the same shape, in the same device call.

One row of SEQ pseudo-random tokens (every token but the first supervised), ANCHORS anchors, blocks
of B = 16, a drafter of LAYERS Qwen3-style layers over a random HF target of the shape:

- target features: the HF target with `output_hidden_states`, taps = z-lab's default ids
  (tap i = hidden_states[i + 1]), concatenated, under no_grad;
- drafter: fc (taps × hidden → hidden) + hidden_norm on the context; per layer, queries from the
  block rows ([anchor, mask × 15] embedded by the frozen target embedding), keys and values from
  [context ; block] (k_norm / q_norm per head, RoPE at the true positions, GQA without copies),
  attention by flex_attention with the DFlash training mask (a block row of anchor a sees the
  context keys < a and its own block), SwiGLU MLP; final norm;
- loss: the frozen shared LM head on block rows 1..15, cross-entropy against ids[a+1 .. a+15],
  weighted exp(-(k-1)/7) (γ = 7), mean;
- f32 master weights under bf16 autocast, fused AdamW (lr 6e-4, betas .9/.95, wd 0), clip 1.0.

Prints one JSON row: shape, impl, features_ms, step_ms, supervised_tok_s (SEQ − 1 tokens per
row over features + step), medians of STEPS after one warm-up.
Usage: python3 bench/train_reference.py SHAPE(qwen3-8b|CONFIG.json) [SEQ=2048] [ANCHORS=512]
       [LAYERS=5] [STEPS=5]
PROFILE=FILE: after the timed steps, one more step under torch.profiler; its CUDA kernels, summed
by name (the 40 with the most device time), go to FILE (where the reference's step spends its time,
beside `dflash-rs`'s kernel profile).
"""
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AutoConfig, AutoModelForCausalLM

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=40960, vocab_size=151936, tie_word_embeddings=False)
B, GAMMA = 16, 7.0
shape = sys.argv[1]
SEQ, ANCHORS, LAYERS, STEPS = (int(sys.argv[i]) if len(sys.argv) > i else d
                               for i, d in ((2, 2048), (3, 512), (4, 5), (5, 5)))
dev = os.environ.get("DEVICE", "cuda")  # DEVICE=cpu: a dry run of the script on a small shape
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
torch.manual_seed(0)
cfg_dict = QWEN3_8B if shape == "qwen3-8b" else json.load(open(shape))
cfg = AutoConfig.for_model(cfg_dict["model_type"], **{k: v for k, v in cfg_dict.items() if k != "model_type"})
with torch.device(dev):
    target = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval().requires_grad_(False)
H, NH, NKV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
D = getattr(cfg, "head_dim", None) or H // NH
L = cfg.num_hidden_layers
ROPE_THETA = float(cfg_dict.get("rope_theta", 10000.0))
taps = [int(round(1 + i * (L - 4) / (LAYERS - 1))) for i in range(LAYERS)] if LAYERS > 1 else [L // 2]


class Rms(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.w.to(x.dtype), cfg.rms_norm_eps)


def rope(x, pos):  # x [heads, n, D], rotate-half RoPE at positions pos
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([f.cos(), f.cos()], -1).to(x.dtype), torch.cat([f.sin(), f.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.q, self.k, self.v, self.o = lin(H, NH * D), lin(H, NKV * D), lin(H, NKV * D), lin(NH * D, H)
        self.qn, self.kn, self.n1, self.n2 = Rms(D), Rms(D), Rms(H), Rms(H)
        I = cfg.intermediate_size
        self.gate, self.up, self.down = lin(H, I), lin(H, I), lin(I, H)

    def forward(self, h, ctx, qpos, kpos, mask):
        x = self.n1(h)
        kv_in = torch.cat([ctx, x], 0)
        q = self.qn(self.q(x).view(-1, NH, D)).transpose(0, 1)
        k = self.kn(self.k(kv_in).view(-1, NKV, D)).transpose(0, 1)
        v = self.v(kv_in).view(-1, NKV, D).transpose(0, 1)
        q, k = rope(q, qpos), rope(k, kpos)
        if dev == "cpu":  # the dry run: flex_attention has no CPU backward; the same mask, dense
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=dense_mask, enable_gqa=True)[0]
        else:
            a = flex_attention(q[None], k[None], v[None], block_mask=mask, enable_gqa=True)[0]
        h = h + self.o(a.transpose(0, 1).reshape(-1, NH * D))
        x = self.n2(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class Drafter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(len(taps) * H, H, bias=False)
        self.hidden_norm, self.norm = Rms(H), Rms(H)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, feats, block_emb, qpos, kpos, mask):
        ctx = self.hidden_norm(self.fc(feats))
        h = block_emb
        for layer in self.layers:
            h = layer(h, ctx, qpos, kpos, mask)
        return self.norm(h)


drafter = Drafter().to(dev)  # f32 master weights
opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
g = torch.Generator().manual_seed(0)
ids = torch.randint(1, cfg.vocab_size, (SEQ,), generator=g).to(dev)
anchors = torch.randperm(SEQ - B, generator=g)[:ANCHORS].sort().values.to(dev) + 1
n_rows = ANCHORS * B
block_of = torch.arange(n_rows, device=dev) // B
anchor_of_row = anchors[block_of]
qpos = anchor_of_row + torch.arange(n_rows, device=dev) % B
kpos = torch.cat([torch.arange(SEQ, device=dev), qpos])


def mask_mod(b, h, q_idx, kv_idx):  # the DFlash training rule
    ctx_key = kv_idx < SEQ
    return torch.where(ctx_key, kv_idx < anchor_of_row[q_idx], (kv_idx - SEQ) // B == q_idx // B)


mask = create_block_mask(mask_mod, None, None, n_rows, SEQ + n_rows, device=dev)
if dev == "cpu":
    dense_mask = mask_mod(None, None, torch.arange(n_rows)[:, None], torch.arange(SEQ + n_rows)[None])
block_tokens = ids[anchor_of_row].clone()
block_tokens[torch.arange(n_rows, device=dev) % B != 0] = 0  # the mask token (id 0)
trained = torch.arange(n_rows, device=dev) % B != 0
labels = ids[(qpos[trained]).clamp(max=SEQ - 1)]
k = (torch.arange(n_rows, device=dev) % B)[trained]
weights = torch.exp(-(k.float() - 1) / GAMMA)
lm_head = target.get_output_embeddings().weight
embed = target.get_input_embeddings()


def step(model):
    """One training step; returns (features seconds, drafter step seconds)."""
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        hs = target(ids[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[t + 1][0] for t in taps], -1)
    sync()
    t1 = time.perf_counter()
    with torch.autocast(dev, dtype=torch.bfloat16):
        h = model(feats, embed(block_tokens), qpos, kpos, mask)
        logits = h[trained] @ lm_head.T
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    loss = (ce * weights).sum() / weights.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    assert math.isfinite(loss.item())
    return t1 - t0, time.perf_counter() - t1


# flex_attention is fast only compiled; a plain trainer compiles its model (the first step
# compiles and is not timed)
model, compiled = torch.compile(drafter), True
try:
    step(model)
except Exception as e:  # no working compiler on this machine: say so, time eager
    print(f"torch.compile failed ({type(e).__name__}: {e}); timing eager", file=sys.stderr)
    opt.zero_grad(set_to_none=True)
    model, compiled = drafter, False
    step(model)
t_feats, t_step = zip(*(step(model) for _ in range(STEPS)))
tf, ts = statistics.median(t_feats), statistics.median(t_step)
if os.environ.get("PROFILE"):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90)
    open(os.environ["PROFILE"], "w").write(table)
print(json.dumps({"shape": shape, "impl": "pytorch+flex_attention", "features_ms": round(tf * 1e3, 2),
                  "step_ms": round(ts * 1e3, 2), "supervised_tok_s": round((SEQ - 1) / (tf + ts)),
                  "seq_len": SEQ, "anchors": ANCHORS, "draft_layers": LAYERS, "block_size": B,
                  "torch": torch.__version__, "compiled": compiled,
                  # the caching allocator's high watermarks since the start (weights included)
                  "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                  "reserved_mem_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2)}))
