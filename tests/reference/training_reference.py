#!/usr/bin/env python3
"""Reference loss and gradients of the DFlash training objective, for dflash-rs's trainer.

Uses transformers' Qwen3 (the tiny target of tests/fixtures/qwen3-tiny) for the context
features and z-lab's own drafter module (`dflash==0.1.0`'s DFlashDraftModel, its forward with an
explicit attention mask, as a training loop calls it) for the drafter, on the z-lab drafters of
tests/fixtures/dflash-tiny (full/ and sliding/), in f32. Written from the objective's definition,
not from dflash-rs:

- features: the target's hidden_states[i + 1] for each tap i, concatenated, each packed sequence
  run alone at its own positions (0, 1, …);
- blocks: for anchor a, the tokens [ids[a], mask × (B − 1)] embedded by the target's embedding,
  at positions a, a + 1, … of the anchor's sequence; all blocks of a row in one drafter forward
  over [context features of the whole row | every block's rows];
- mask: a block row sees the context of its own sequence strictly before its anchor and its own
  block, each key subject to z-lab's layer rule (`_attention_mask`'s causal and sliding-window
  conditions on positions); no other block;
- loss: the target's LM head on block rows 1..B − 1, cross-entropy against ids[a + k] with weight
  exp(−(k − 1)/γ) · loss_mask[a + k] (0 past the sequence's end), Σ w·CE / Σ w; one case with
  the soft loss instead: KL(target ‖ drafter) per row, the target's distribution for token
  a + k being its logits at position a + k − 1 of the packed row;
- gradients of every drafter parameter (the target is frozen);
- then STEPS optimizer steps on the same row and anchors: the gradients' global L2 norm clipped
  to 1 (`clip_grad_norm_`), torch's AdamW (betas 0.9 / 0.95, eps 1e-8, constant lr, weight decay
  on the matrices only).

- a whole run (`run`): two sequences, one row each, every anchor candidate, two rows per step,
  four steps with warmup and cosine, as the trainer documents them.

Writes tests/fixtures/dflash-tiny/training-reference.{json,safetensors}: per case the drafter,
the row (ids, loss mask, sequence lengths), anchors, γ, the loss and `CASE/NAME` gradients, the
optimizer's settings, each step's loss and gradient norm, and `CASE/final/NAME` weights.

Run: venv/bin/pip install torch transformers safetensors 'dflash==0.1.0'
     venv/bin/python tests/reference/training_reference.py
"""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3ForCausalLM

from dflash.model import DFlashDraftModel

torch.backends.cuda.matmul.allow_tf32 = False
ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
GAMMA = 7.0
STEPS = 4
OPT = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)


def tokens(seed, n):
    """Deterministic ids in 1..250 (no mask token 0)."""
    return [((i * 2654435761 + seed * 40503) >> 8) % 250 + 1 for i in range(n)]


def zlab_rule(layer, q, k):
    """z-lab's `_attention_mask` condition for a query at position q and a key at position k."""
    attn = layer.self_attn
    ok = True
    if attn.is_causal:
        ok &= k <= q
    if attn.sliding_window is not None:
        ok &= q - k < attn.sliding_window
        if not attn.is_causal:
            ok &= k - q < attn.sliding_window
    return ok


def objective(target, drafter, seqs, anchors, kl=False):
    """The row's loss (its gradients left in the drafter). seqs: [(ids, loss_mask)] packed side
    by side; anchors: row indices; kl: KL(target ‖ drafter) per row instead of the CE, the
    target's distribution for token a + k being its logits at position a + k − 1."""
    block, mask_id = drafter.block_size, drafter.mask_token_id
    ids = [t for s, _ in seqs for t in s]
    loss_mask = [m for _, ms in seqs for m in ms]
    starts, pos = [], []
    for s, _ in seqs:
        starts.append(len(pos))
        pos.extend(range(len(s)))
    seg = [j for j, (s, _) in enumerate(seqs) for _ in s]
    L = len(ids)
    with torch.no_grad():
        feats, tlogits = [], []
        for j, (s, _) in enumerate(seqs):
            out = target(torch.tensor([s]), output_hidden_states=True)
            feats.append(torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], -1))
            tlogits.append(out.logits[0])
        taps = torch.cat(feats, 1)  # [1, L, n_taps·h]
        tlogits = torch.cat(tlogits, 0)  # [L, vocab]
        block_ids = torch.tensor([[ids[a]] + [mask_id] * (block - 1) for a in anchors]).reshape(1, -1)
        noise = target.model.embed_tokens(block_ids)
    bpos = [pos[a] + r for a in anchors for r in range(block)]
    position_ids = torch.tensor([pos + bpos])
    n = len(anchors) * block
    # one mask per layer (rules differ); the drafter's layers read it from the forward's kwargs
    masks = []
    for layer in drafter.layers:
        m = torch.zeros((n, L + n), dtype=torch.bool)
        for j, a in enumerate(anchors):
            s = seg[a]
            for r in range(block):
                qi, qp = j * block + r, pos[a] + r
                for c in range(starts[s], a):
                    m[qi, c] = zlab_rule(layer, qp, pos[c])
                for i in range(block):
                    m[qi, L + j * block + i] = zlab_rule(layer, qp, pos[a] + i)
        masks.append(m[None, None])
    # run the layers with their own masks: z-lab's forward passes one mask to every layer
    hidden = noise
    th = drafter.hidden_norm(drafter.fc(taps))
    pe = drafter.rotary_emb(hidden, position_ids)
    for layer, m in zip(drafter.layers, masks):
        hidden = layer(hidden_states=hidden, target_hidden=th, attention_mask=m,
                       position_ids=position_ids, position_embeddings=pe)
    hidden = drafter.norm(hidden)
    rows = hidden.reshape(len(anchors), block, -1)[:, 1:, :].reshape(-1, hidden.shape[-1])
    logits = drafter.compute_logits(rows, target.lm_head)
    labels, weights = [], []
    for a in anchors:
        end = starts[seg[a]] + len(seqs[seg[a]][0])
        for k in range(1, block):
            p = a + k
            inside = p < end
            labels.append(ids[p] if inside else 0)
            weights.append((loss_mask[p] if inside else 0) * math.exp(-(k - 1) / GAMMA))
    w = torch.tensor(weights, dtype=torch.float32)
    if kl:
        # the target's prediction of token a + k: its logits at a + k − 1 (the row's last past the end)
        tpos = [min(a + k - 1, L - 1) for a in anchors for k in range(1, block)]
        tlogp = torch.log_softmax(tlogits[tpos].float(), -1)
        per_row = (tlogp.exp() * (tlogp - torch.log_softmax(logits.float(), -1))).sum(-1)
    else:
        per_row = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(labels), reduction="none")
    loss = (w * per_row).sum() / w.sum()
    drafter.zero_grad()
    loss.backward()
    return loss


def case(target, drafter, seqs, anchors):
    """The loss and gradients of the row, then STEPS optimizer steps on it."""
    loss = objective(target, drafter, seqs, anchors)
    grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
    meta = dict(ids=[t for s, _ in seqs for t in s], loss_mask=[m for _, ms in seqs for m in ms],
                lengths=[len(s) for s, _ in seqs], anchors=anchors, gamma=GAMMA, loss=loss.item())
    params = list(drafter.parameters())
    opt = torch.optim.AdamW(
        [dict(params=[p for p in params if p.dim() >= 2], weight_decay=OPT["weight_decay"]),
         dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
        lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"])
    losses, norms = [], []
    for step in range(STEPS):
        if step > 0:
            loss = objective(target, drafter, seqs, anchors)
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(params, OPT["grad_clip"]).item())
        opt.step()
    meta["train"] = dict(OPT, steps=STEPS, losses=losses, grad_norms=norms,
                         loss_after=objective(target, drafter, seqs, anchors).item())
    for n, p in drafter.named_parameters():
        grads[f"final/{n}"] = p.detach().clone()
    return meta, grads


def main():
    torch.manual_seed(0)
    target = Qwen3ForCausalLM.from_pretrained(FIX / "qwen3-tiny", dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    one = (tokens(3, 30), [0] * 6 + [1] * 24)
    a = (tokens(5, 17), [0] * 3 + [1] * 14)
    b = (tokens(9, 15), [0] * 4 + [1] * 11)
    cases = {}
    tensors = {}
    for dname in ["full", "sliding"]:
        for cname, seqs, anchors in [
            ("single", [one], [5, 9, 14, 25]),  # the last block runs past the end
            ("packed", [a, b], [2, 8, 13, 19, 24]),  # 13: near the end of the first sequence
        ]:
            drafter = DFlashDraftModel.from_pretrained(FIX / "dflash-tiny" / dname, dtype=torch.float32)
            drafter.train()
            meta, grads = case(target, drafter, seqs, anchors)
            key = f"{dname}-{cname}"
            meta["drafter"] = dname
            cases[key] = meta
            for n, g in grads.items():
                tensors[f"{key}/{n}"] = g.contiguous()
            print(f"{key}: loss {meta['loss']:.6f}, after {STEPS} steps {meta['train']['loss_after']:.6f}")
    drafter = DFlashDraftModel.from_pretrained(FIX / "dflash-tiny" / "full", dtype=torch.float32)
    drafter.train()
    loss = objective(target, drafter, [a, b], [2, 8, 13, 19, 24], kl=True)
    cases["full-packed-kl"] = dict(
        drafter="full", loss_kind="kl", ids=a[0] + b[0], loss_mask=a[1] + b[1],
        lengths=[len(a[0]), len(b[0])], anchors=[2, 8, 13, 19, 24], gamma=GAMMA, loss=loss.item())
    for n, p in drafter.named_parameters():
        tensors[f"full-packed-kl/{n}"] = p.grad.detach().clone()
    print(f"full-packed-kl: loss {loss.item():.6f}")
    cases["run"], run_weights = run(target, [a, b])
    for n, w in run_weights.items():
        tensors[f"run/final/{n}"] = w
    print(f"run: losses {cases['run']['losses']}")
    out = FIX / "dflash-tiny"
    (out / "training-reference.json").write_text(json.dumps(dict(
        note="tests/reference/training_reference.py: transformers' Qwen3 target, z-lab's DFlashDraftModel",
        cases=cases), indent=1) + "\n")
    save_file(tensors, out / "training-reference.safetensors")


# A whole run as `dflash-rs train` documents it (the Rust test runs the trainer with these
# settings on the same two sequences): each sequence one row; every anchor candidate (a position
# whose token and next token are supervised) an anchor; each step both rows, the gradient the
# mean of the rows' gradients, the step's loss the rows' losses weighted by their weight sums;
# lr: linear warmup over ceil(warmup_ratio · steps) steps, then cosine to min_lr_ratio · lr.
RUN = dict(steps=4, lr=3e-3, warmup_ratio=0.25, min_lr_ratio=0.1, beta1=0.9, beta2=0.95,
           eps=1e-8, weight_decay=0.1, grad_clip=1.0, gamma=GAMMA, drafter="full")


def lr_at(step):
    warm = math.ceil(RUN["warmup_ratio"] * RUN["steps"])
    if step < warm:
        return RUN["lr"] * (step + 1) / warm
    p = min((step - warm) / max(RUN["steps"] - warm, 1), 1.0)
    lo = RUN["min_lr_ratio"] * RUN["lr"]
    return lo + (RUN["lr"] - lo) * 0.5 * (1 + math.cos(math.pi * p))


def run(target, seqs):
    drafter = DFlashDraftModel.from_pretrained(FIX / "dflash-tiny" / RUN["drafter"], dtype=torch.float32)
    drafter.train()
    params = list(drafter.parameters())
    opt = torch.optim.AdamW(
        [dict(params=[p for p in params if p.dim() >= 2], weight_decay=RUN["weight_decay"]),
         dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
        lr=RUN["lr"], betas=(RUN["beta1"], RUN["beta2"]), eps=RUN["eps"])
    rows = []
    for ids, mask in seqs:
        anchors = [i for i in range(len(ids) - 1) if mask[i] and mask[i + 1]]
        wsum = sum(mask[a + k] * math.exp(-(k - 1) / GAMMA)
                   for a in anchors for k in range(1, drafter.block_size) if a + k < len(ids))
        rows.append(([(ids, mask)], anchors, wsum))
    losses, norms, lrs = [], [], []
    for step in range(RUN["steps"]):
        total = {n: torch.zeros_like(p) for n, p in drafter.named_parameters()}
        num = den = 0.0
        for row, anchors, wsum in rows:
            loss = objective(target, drafter, row, anchors)
            num, den = num + loss.item() * wsum, den + wsum
            for n, p in drafter.named_parameters():
                total[n] += p.grad / len(rows)
        for n, p in drafter.named_parameters():
            p.grad = total[n]
        losses.append(num / den)
        norms.append(torch.nn.utils.clip_grad_norm_(params, RUN["grad_clip"]).item())
        lr = lr_at(step)
        lrs.append(lr)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
    meta = dict(RUN, sequences=[dict(ids=i, loss_mask=m) for i, m in seqs], losses=losses,
                grad_norms=norms, lrs=lrs)
    return meta, {n: p.detach().clone() for n, p in drafter.named_parameters()}


if __name__ == "__main__":
    main()
