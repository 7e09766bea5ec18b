#!/usr/bin/env python3
"""A plain PyTorch trainer taking the same steps as a `dflash-rs train` run: the reference beside
dflash-rs's training (its loss curve, and the drafter it ends with, evaluated by the same
`dflash-rs eval`).

`dflash-rs train --plan-out PLAN` writes each step's rows (ids, loss mask, the packed
sequences' first rows, the anchors drawn, the learning rate); this script reads them and takes
those steps with z-lab's own drafter module (`dflash==0.1.0`'s DFlashDraftModel) from the same
initial weights (a drafter directory both start from: `dflash-rs drafter new`, then the run's
`init_from`), written from the objective's definition, not from dflash-rs:

- features: the target's hidden_states[i + 1] for each tap i, concatenated, each packed sequence
  run alone at its own positions (0, 1, …), under no_grad;
- blocks: for anchor a, [ids[a], mask × (B − 1)] embedded by the target's embedding, at positions
  a, a + 1, … of the anchor's sequence; all blocks of a row in one drafter forward over
  [context features of the whole row | every block's rows];
- mask: a block row sees its own sequence's context strictly before its anchor and its own block,
  each key also subject to z-lab's layer rule (causal, sliding window) on positions;
- loss: the target's LM head on block rows 1 … B − 1, cross-entropy against ids[a + k] with
  weight exp(−(k − 1)/γ) · loss_mask[a + k] (0 past the sequence's end), Σ w·CE / Σ w per row;
- a step: the mean of its rows' gradients, their global L2 norm clipped (`clip_grad_norm_`),
  torch's AdamW (weight decay on the matrices only) at the plan's learning rate.

Writes OUT/curve.jsonl (per step: loss = Σ_rows loss·Σw / Σ_rows Σw, grad_norm, lr) and the
final drafter as OUT/drafter (z-lab format: config.json + model.safetensors).

`--time-limit S` stops after the first step that ends S seconds after the start, writing the drafter,
the optimizer and the steps taken to OUT/state.pt (atomically); run the same command again to
continue from there (the curve continues; a run continued at any step takes the same steps).

Usage: python3 bench/train_reference_run.py --target DIR_OR_GGUF --init DRAFTER_DIR --plan PLAN
         --config RUN/train_config.json --out OUT [--device cuda] [--dtype f32|bf16]
         [--steps N] [--time-limit S]
`--dtype bf16`: f32 master weights under bf16 autocast (as dflash-rs's bf16 runs); f32 on the CPU
is the exact comparison (`bench/train_reference_check.sh`).
"""
import argparse
import json
import math
import os
import time
from collections import defaultdict

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from dflash.model import DFlashDraftModel

torch.backends.cuda.matmul.allow_tf32 = False


def load_target(path, device):
    if path.endswith(".gguf"):
        d, f = os.path.split(path)
        m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.to(device).eval().requires_grad_(False)


def layer_ok(layer, qpos, kpos):
    """z-lab's `_attention_mask` condition for queries at qpos [n, 1] and keys at kpos [1, m]."""
    attn = layer.self_attn
    ok = torch.ones(qpos.shape[0], kpos.shape[1], dtype=torch.bool, device=qpos.device)
    if attn.is_causal:
        ok &= kpos <= qpos
    if attn.sliding_window is not None:
        ok &= (qpos - kpos) < attn.sliding_window
        if not attn.is_causal:
            ok &= (kpos - qpos) < attn.sliding_window
    return ok


def row_loss(target, drafter, row, gamma, autocast):
    """One plan row's loss (its gradients added to the drafter's) and its weight sum."""
    dev = next(drafter.parameters()).device
    block, mask_id = drafter.block_size, drafter.mask_token_id
    ids, loss_mask, starts = row["ids"], row["loss_mask"], row["starts"]
    anchors = row["anchors"]
    L = len(ids)
    ends = starts[1:] + [L]
    # every index tensor on the device: the masks of a 512-anchor row are [8192, 10240] per layer
    seg = torch.zeros(L, dtype=torch.long, device=dev)
    pos = torch.zeros(L, dtype=torch.long, device=dev)
    for j, (s, e) in enumerate(zip(starts, ends)):
        seg[s:e] = j
        pos[s:e] = torch.arange(e - s, device=dev)
    a_t = torch.tensor(anchors, dtype=torch.long, device=dev)
    with torch.no_grad(), autocast():
        feats = []
        for s, e in zip(starts, ends):
            out = target(torch.tensor([ids[s:e]], device=dev), output_hidden_states=True)
            feats.append(torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], -1))
        taps = torch.cat(feats, 1)
        block_ids = torch.full((len(anchors), block), mask_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = torch.tensor([ids[a] for a in anchors], device=dev)
        noise = target.model.embed_tokens(block_ids.reshape(1, -1))
    r = torch.arange(block, device=dev)
    bpos = (pos[a_t][:, None] + r[None, :]).reshape(-1)  # [n]
    n = bpos.shape[0]
    position_ids = torch.cat([pos, bpos])[None]
    qpos = bpos[:, None]
    # context keys: the anchor's own sequence, strictly before the anchor
    qa = a_t.repeat_interleave(block)
    c = torch.arange(L, device=dev)[None, :]
    ctx = (c >= torch.tensor(starts, device=dev)[seg[qa]][:, None]) & (c < qa[:, None])
    # block keys: the query's own block
    qb = torch.arange(n, device=dev) // block
    own = qb[:, None] == qb[None, :]
    masks = []
    for layer in drafter.layers:
        m = torch.cat([ctx & layer_ok(layer, qpos, pos[None, :]),
                       own & layer_ok(layer, qpos, bpos[None, :])], 1)
        masks.append(m[None, None])
    with autocast():
        hidden = noise
        th = drafter.hidden_norm(drafter.fc(taps))
        pe = drafter.rotary_emb(hidden, position_ids)
        for layer, m in zip(drafter.layers, masks):
            hidden = layer(hidden_states=hidden, target_hidden=th, attention_mask=m,
                           position_ids=position_ids, position_embeddings=pe)
        hidden = drafter.norm(hidden)
        rows = hidden.reshape(len(anchors), block, -1)[:, 1:, :].reshape(-1, hidden.shape[-1])
        logits = drafter.compute_logits(rows, target.lm_head)
    k = torch.arange(1, block, device=dev)
    p = a_t[:, None] + k[None, :]  # [A, B − 1]
    end = torch.tensor(ends, device=dev)[seg[a_t]][:, None]
    inside = p < end
    pc = p.clamp(max=L - 1)
    lm = torch.tensor(loss_mask, dtype=torch.float32, device=dev)
    w = (lm[pc] * inside * torch.exp(-(k - 1).float() / gamma)[None, :]).reshape(-1)
    labels = torch.where(inside, torch.tensor(ids, device=dev)[pc], 0).reshape(-1)
    ce = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    wsum = w.sum()
    loss = (w * ce).sum() / wsum
    return loss, wsum.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--init", required=True, help="the drafter directory both runs start from")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--config", required=True, help="the dflash-rs run's train_config.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all)")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds; then save OUT/state.pt and stop (run again to continue)")
    a = ap.parse_args()
    cfg = json.load(open(a.config))
    if cfg.get("loss", "ce") != "ce":
        raise SystemExit(f"{a.config}: loss {cfg.get('loss')!r}: only the hard cross-entropy is here")
    gamma = float(cfg.get("gamma", 7.0))
    steps = defaultdict(list)
    with open(a.plan) as f:
        for line in f:
            r = json.loads(line)
            steps[r["step"]].append(r)
    order = sorted(steps)
    if a.steps:
        order = order[: a.steps]
    dev = torch.device(a.device)
    target = load_target(a.target, dev)
    drafter = DFlashDraftModel.from_pretrained(a.init, dtype=torch.float32).to(dev)
    drafter.train()
    params = list(drafter.parameters())
    opt = torch.optim.AdamW(
        [dict(params=[p for p in params if p.dim() >= 2], weight_decay=cfg.get("weight_decay", 0.0)),
         dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
        lr=1.0, betas=(cfg.get("beta1", 0.9), cfg.get("beta2", 0.95)), eps=cfg.get("eps", 1e-8))
    if a.dtype == "bf16":
        def autocast():
            return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
    else:
        import contextlib
        autocast = contextlib.nullcontext
    os.makedirs(a.out, exist_ok=True)
    state_path = os.path.join(a.out, "state.pt")
    curve_path = os.path.join(a.out, "curve.jsonl")
    taken = 0
    if os.path.exists(state_path):
        st = torch.load(state_path, map_location=dev, weights_only=False)
        drafter.load_state_dict(st["drafter"])
        opt.load_state_dict(st["opt"])
        taken = st["taken"]
        with open(curve_path) as f:  # the curve as it was when the state was saved
            kept = f.readlines()[:taken]
        with open(curve_path, "w") as f:
            f.writelines(kept)
        print(f"continuing after {taken} steps ({state_path})", flush=True)
    curve = open(curve_path, "a" if taken else "w")
    t0 = time.time()
    for i, s in enumerate(order):
        if i < taken:
            continue
        if a.time_limit and time.time() - t0 > a.time_limit:
            tmp = state_path + ".tmp"
            torch.save(dict(drafter=drafter.state_dict(), opt=opt.state_dict(), taken=i), tmp)
            os.replace(tmp, state_path)
            print(f"time limit: {i} of {len(order)} steps taken; state in {state_path}", flush=True)
            return
        rows = sorted(steps[s], key=lambda r: r["row"])
        drafter.zero_grad(set_to_none=True)
        num = den = 0.0
        for row in rows:
            loss, wsum = row_loss(target, drafter, row, gamma, autocast)
            (loss / len(rows)).backward()
            num, den = num + loss.item() * wsum, den + wsum
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.get("grad_clip", 1.0)).item()
        lr = rows[0]["lr"]
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        curve.write(json.dumps(dict(step=s, loss=num / den, grad_norm=norm, lr=lr)) + "\n")
        curve.flush()
        if s % 50 == 0 or s == order[-1]:
            print(f"step {s}: loss {num / den:.4f}, grad norm {norm:.3f}, lr {lr:.2e}, "
                  f"{time.time() - t0:.0f} s", flush=True)
    out = os.path.join(a.out, "drafter")
    drafter.save_pretrained(out, safe_serialization=True)
    if os.path.exists(state_path):
        os.remove(state_path)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
