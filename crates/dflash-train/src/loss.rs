//! The block-masked drafter objective, on the one drafter forward.
//!
//! For a training row (one sequence, or several packed: [`crate::pack`]) and its anchors:
//! context features = the target's taps of every position (one clean causal forward per
//! sequence, no gradient); blocks `[token at a, mask × (B-1)]` at positions
//! `a … a+B-1`, all in one drafter forward with the training mask from the shared rule
//! (`DraftLayout::Training`); block row k ≥ 1 predicts the token at `a + k` with weight
//! `exp(-(k-1)/γ) · loss_mask[a+k] · [a+k < L]`; row 0 is not trained;
//! `loss = Σ w·CE / Σ w` (or `Σ w·KL(target ‖ drafter) / Σ w`).
//! Example: a = 37, B = 16, γ = 7: rows 1..15 predict tokens 38..52 with weights
//! 1, e^(-1/7), …, e^(-14/7).
//!
//! A DFlash2 drafter adds its selector's term ([`crate::selector_loss`]) times
//! `selector_weight`, and its acceptance counts come from the selector's top-1.

use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, D};
use dflash_core::stats::AcceptCounts;
use dflash_core::visibility::packed;
use dflash_model::models::drafter::{DraftLayout, Drafter, Tape};
use dflash_model::ops::cross_entropy::{cross_entropy_rows, linear_cross_entropy_rows};
use dflash_model::{Rows, Target};

use crate::config::LossKind;
use crate::pack::TrainingRow;

/// What the target says about a sequence: concatenated taps `[1, L, n_taps·h]` and, for
/// the KL loss, its logits `[L, vocab]`.
#[derive(Clone)]
pub struct Features {
    pub taps: Tensor,
    pub target_logits: Option<Tensor>,
}

impl Features {
    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        let b = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        b(&self.taps) + self.target_logits.as_ref().map(b).unwrap_or(0)
    }
}

/// The clean target forward (no gradient flows into the target: its weights are plain tensors)
/// over a training row: each packed sequence at its own positions, seeing only itself.
pub fn target_features(
    target: &Target,
    taps: &[usize],
    row: &TrainingRow,
    with_logits: bool,
) -> Result<Features> {
    let pos = row.segs.positions();
    // the target rule per sequence (one sequence: exactly `causal(0, len)`)
    let mask = packed(&[], &row.segs.owners());
    let mut cache = target.new_cache();
    let rows = if with_logits { Rows::All } else { Rows::None };
    let out = target.forward(&row.seq.ids, &pos, &mask, &mut cache, taps, &rows)?;
    Ok(Features {
        taps: Target::concat_taps(&out.taps)?.unsqueeze(0)?.detach(),
        target_logits: out.logits.map(|l| l.detach()),
    })
}

pub struct LossOutput {
    pub loss: Tensor,
    pub weight_sum: f64,
    pub counts: AcceptCounts,
    /// Each anchor's position in the row and the drafts accepted there, in anchor order.
    pub accepted: Vec<(usize, usize)>,
    /// `[n_anchors · (B-1), vocab]`
    pub draft_logits: Tensor,
    /// DFlash2: the supervised rows whose label is among the selector's candidates.
    pub selector_covered: Option<usize>,
    /// The drafter's taped forward: [`LossOutput::backward`] runs its written backward after
    /// the loss's.
    pub tape: Option<Tape>,
}

impl LossOutput {
    /// The gradients of the loss for every tracked tensor: candle's backward of the loss down
    /// to the drafter's output, then (a taped forward) the drafter's written backward, whose
    /// weights' gradients land in the same store under the drafter's own tensors.
    pub fn backward(&self) -> Result<GradStore> {
        self.backward_over(1.0)
    }

    /// [`LossOutput::backward`] of `loss / n` (gradient accumulation over `n` rows).
    pub fn backward_over(&self, n: f64) -> Result<GradStore> {
        self.backward_each_over(n, &mut |_, _| Ok(()))
    }

    /// [`LossOutput::backward_over`], calling `done(i, store)` once drafter layer `i`'s
    /// weights hold their gradients, last layer first ([`Tape::backward_each`]), while the
    /// layers below still run theirs. Without a taped forward (candle's autograd) every
    /// gradient arrives at once and `done` is not called.
    pub fn backward_each_over(
        &self,
        n: f64,
        done: &mut dyn FnMut(usize, &GradStore) -> Result<()>,
    ) -> Result<GradStore> {
        let loss = if n == 1.0 {
            self.loss.clone()
        } else {
            (&self.loss / n)?
        };
        let mut g = loss.backward()?;
        if let Some(t) = &self.tape {
            let _p = tracing::info_span!(target: "phase", "drafter backward").entered();
            if let Some(d) = g.remove(&t.hidden) {
                t.backward_each(&d, &mut g, &mut |i, g| {
                    done(i, g).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
                })?;
            }
        }
        Ok(g)
    }
}

/// Labels and weights of every trained row, in block order; a label past the end of the
/// anchor's own sequence has weight 0.
pub fn labels_and_weights(
    row: &TrainingRow,
    anchors: &[usize],
    block: usize,
    gamma: f64,
) -> (Vec<u32>, Vec<f32>) {
    let seq = &row.seq;
    let mut labels = Vec::with_capacity(anchors.len() * (block - 1));
    let mut weights = Vec::with_capacity(labels.capacity());
    for &a in anchors {
        let (_, end) = row.segs.bounds(a);
        for k in 1..block {
            let p = a + k;
            let inside = p < end;
            labels.push(if inside { seq.ids[p] } else { 0 });
            let m = if inside { seq.loss_mask[p] as f64 } else { 0.0 };
            weights.push((m * (-((k - 1) as f64) / gamma).exp()) as f32);
        }
    }
    (labels, weights)
}

/// What a block is trained on: its size B, the decay γ of the row weights, CE or KL, and
/// the weight of a DFlash2 selector's term (ignored for a DFlash drafter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Objective {
    pub block: usize,
    pub gamma: f64,
    pub kind: LossKind,
    pub selector_weight: f64,
}

impl Objective {
    /// The objective of a training config.
    pub fn of(cfg: &crate::config::TrainConfig) -> Self {
        Self {
            block: cfg.block_size,
            gamma: cfg.gamma,
            kind: cfg.loss,
            selector_weight: cfg.selector_loss_weight,
        }
    }
}

/// The loss of `anchors`' blocks of one training row (the module doc's objective), with the
/// acceptance counts of the drafter's argmax. Phases (`dflash_model::profile`): drafter
/// layers, LM head, loss, acceptance counts.
pub fn block_loss(
    drafter: &Drafter,
    target: &Target,
    row: &TrainingRow,
    feats: &Features,
    anchors: &[usize],
    obj: Objective,
) -> Result<LossOutput> {
    let Objective {
        block,
        gamma,
        kind,
        selector_weight,
    } = obj;
    if anchors.is_empty() {
        bail!("no anchors: the sequence needs two consecutive supervised tokens");
    }
    let dev = feats.taps.device().clone();
    let block_tokens: Vec<u32> = anchors
        .iter()
        .flat_map(|&a| drafter.block_tokens(row.seq.ids[a], block))
        .collect();
    let (hidden, tape) = block_hidden(drafter, target, row, feats, anchors, &block_tokens)?;
    // block rows 1..B of every block (row 0, the anchor, is never trained): a narrow of
    // [anchors, B, h], whose backward is a zero-padded copy (not an index_add)
    let h = hidden.dim(2)?;
    let n_rows = anchors.len() * (block - 1);
    let hidden_rows = hidden
        .reshape((anchors.len(), block, h))?
        .narrow(1, 1, block - 1)?
        .reshape((1, n_rows, h))?;
    let (labels, weights) = labels_and_weights(row, anchors, block, gamma);
    let wsum: f64 = weights.iter().map(|&w| w as f64).sum();
    if wsum <= 0.0 {
        bail!("no supervised label in any block");
    }
    let (per_row, pred, logits) = match kind {
        LossKind::Ce => ce_rows(drafter, target, &hidden_rows, &labels)?,
        LossKind::Kl => kl_rows(drafter, target, &hidden_rows, feats, row, anchors, block)?,
    };
    let w = Tensor::from_vec(weights.clone(), weights.len(), &dev)?.to_dtype(per_row.dtype())?;
    let mut loss = ((per_row * w)?.sum_all()? / wsum)?;
    let mut pred = pred;
    let mut selector_covered = None;
    if let Some(sel) = drafter.selector.as_ref() {
        let _s = tracing::info_span!(target: "phase", "selector").entered();
        // each row's predecessor in the sequence: the anchor, then the labels before it
        let prev: Vec<u32> = anchors
            .iter()
            .flat_map(|&a| (1..block).map(move |k| row.seq.ids[(a + k - 1).min(row.len() - 1)]))
            .collect();
        let term = crate::selector_loss::selector_term(
            sel,
            &hidden_rows.squeeze(0)?,
            &logits,
            &labels,
            &prev,
            &weights,
            wsum,
        )?;
        if selector_weight > 0.0 {
            let extra = (term.loss * selector_weight)?.to_dtype(loss.dtype())?;
            loss = (loss + extra)?;
        }
        pred = term.top1;
        selector_covered = Some(term.covered);
    }
    let (counts, accepted) = acceptance(anchors, block, &weights, &pred, &labels);
    Ok(LossOutput {
        loss,
        weight_sum: wsum,
        counts,
        accepted,
        draft_logits: logits,
        selector_covered,
        tape,
    })
}

/// The drafter's hidden states of `anchors`' blocks (`block_tokens`, block after block), and
/// the tape of the taped forward, whose written backward follows the loss's
/// (`LossOutput::backward`; with `--disable-kernels train-tape`, candle's autograd through the
/// traced forward instead).
fn block_hidden(
    drafter: &Drafter,
    target: &Target,
    row: &TrainingRow,
    feats: &Features,
    anchors: &[usize],
    block_tokens: &[u32],
) -> Result<(Tensor, Option<Tape>)> {
    let _phase = tracing::info_span!(target: "phase", "drafter layers").entered();
    let emb = drafter.embed_block(target, block_tokens)?;
    let layout = DraftLayout::Training {
        segs: &row.segs,
        anchors,
        block: block_tokens.len() / anchors.len(),
    };
    Ok(if drafter.trains_taped() {
        let t = drafter.forward_taped(&feats.taps, &emb, layout)?;
        (t.hidden.clone(), Some(t))
    } else {
        (drafter.forward(&feats.taps, &emb, layout, None)?, None)
    })
}

/// Hard cross-entropy of the trained rows against their labels: `(per-row loss, the argmax,
/// the logits)`.
fn ce_rows(
    drafter: &Drafter,
    target: &Target,
    hidden_rows: &Tensor,
    labels: &[u32],
) -> Result<(Tensor, Vec<u32>, Tensor)> {
    Ok(match target.lm_head_weight() {
        // the head and the loss as one node (no selector reads the logits' graph): the
        // logits' gradients are never accumulated, the rows' come from them directly
        Some(w) if drafter.logits_are_the_heads() && drafter.selector.is_none() => {
            let _p = tracing::info_span!(target: "phase", "LM head + loss").entered();
            let x = hidden_rows.squeeze(0)?;
            let w = w.to_dtype(x.dtype())?;
            linear_cross_entropy_rows(&x, &w, labels)?
        }
        _ => {
            let phase = tracing::info_span!(target: "phase", "LM head").entered();
            // logits in the model's dtype, into the fused cross-entropy (f32 inside)
            let logits = drafter.training_logits(target, hidden_rows)?.squeeze(0)?; // [R, V]
            drop(phase);
            let _loss = tracing::info_span!(target: "phase", "loss").entered();
            let (per_row, pred) = cross_entropy_rows(&logits, labels)?;
            (per_row, pred, logits)
        }
    })
}

/// KL(target ‖ drafter) of the trained rows: the target's prediction of token a+k is its
/// logits at position a+k-1. `(per-row loss, the argmax, the logits)`.
fn kl_rows(
    drafter: &Drafter,
    target: &Target,
    hidden_rows: &Tensor,
    feats: &Features,
    row: &TrainingRow,
    anchors: &[usize],
    block: usize,
) -> Result<(Tensor, Vec<u32>, Tensor)> {
    let phase = tracing::info_span!(target: "phase", "LM head").entered();
    let logits = drafter.logits(target, hidden_rows)?.squeeze(0)?; // [R, V] f32
    drop(phase);
    let _loss = tracing::info_span!(target: "phase", "loss").entered();
    let tl = feats
        .target_logits
        .as_ref()
        .context("the KL loss needs the target's logits")?;
    let pos: Vec<u32> = anchors
        .iter()
        .flat_map(|&a| (1..block).map(move |k| (a + k - 1).min(row.len() - 1) as u32))
        .collect();
    let n = pos.len();
    let tl = tl
        .index_select(&Tensor::from_vec(pos, n, logits.device())?, 0)?
        .to_dtype(logits.dtype())?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let tlogp = candle_nn::ops::log_softmax(&tl, D::Minus1)?;
    let p = tlogp.exp()?;
    let per_row = (p * (tlogp - &logp)?)?.sum(D::Minus1)?;
    let pred: Vec<u32> = logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1()?;
    Ok((per_row, pred, logits))
}

/// Acceptance counts from the argmax `pred` of every block's trained rows: a draft without a
/// supervised label ends the walk. Also each anchor's accepted count.
fn acceptance(
    anchors: &[usize],
    block: usize,
    weights: &[f32],
    pred: &[u32],
    labels: &[u32],
) -> (AcceptCounts, Vec<(usize, usize)>) {
    let _counts = tracing::info_span!(target: "phase", "acceptance counts").entered();
    let mut counts = AcceptCounts::new(block - 1);
    let mut accepted = Vec::with_capacity(anchors.len());
    for (j, &a) in anchors.iter().enumerate() {
        let rows = j * (block - 1)..(j + 1) * (block - 1);
        let k = counts.add_block(rows.map(|r| (weights[r] != 0.0).then(|| pred[r] == labels[r])));
        accepted.push((a, k));
    }
    (counts, accepted)
}
