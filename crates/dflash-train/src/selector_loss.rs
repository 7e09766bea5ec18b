//! DFlash2's selector objective: rank the target's token first among the candidates the
//! selector will see, given the previous token.
//!
//! For every trained block row (block row k ≥ 1 of the block at anchor a, label `y = ids[a+k]`,
//! predecessor `ids[a+k-1]`: the anchor for k = 1) the candidates are the top
//! `selector_top_k` draft logits, as at inference ([`dflash_core::selector`]). When `y` is
//! among them the row's term is the cross-entropy of `softmax(scores)` over the candidates at
//! `y`, the scores taken after the ground truth's predecessor (teacher forcing: in decoding the
//! walk's predecessor is the previous draft, which equals the label while drafts are
//! accepted); a row whose label is not a candidate has no term (the selector cannot propose
//! it). Rows weigh as in the block loss (γ-decayed, masked) and the sum is divided by the same
//! weight sum. The hidden rows and the unary scores enter as constants: the term trains the
//! selector's projection and codebooks only; the layers learn from the block loss.
//!
//! The selector's top-1 under teacher forcing is what the greedy walk drafts while it is
//! accepted, so the trainer's acceptance counts for a DFlash2 drafter come from it.
//! Example: candidates (7, 3, 9) with label 3 after predecessor 5 → the term
//! `−log softmax(unary + edge(5, ·))[1]`; the row's draft is the argmax of those scores.

use anyhow::Result;
use candle_core::{DType, Tensor, D};
use dflash_model::models::selector::CandidateSelector;
use dflash_model::ops::top_k::top_k_rows;

/// The selector's term of one training row and its teacher-forced top-1 per block row.
pub struct SelectorTerm {
    /// `Σ_r w_r · CE_r / weight_sum` (a scalar; zero without any row).
    pub loss: Tensor,
    /// Per block row: the selector's top-1 token after the true predecessor.
    pub top1: Vec<u32>,
    /// Rows with a weight whose label is among the candidates.
    pub covered: usize,
}

/// The selector term for `hidden` `[R, H]` and `logits` `[R, V]` of `R` block rows with their
/// labels, predecessors and weights.
pub fn selector_term(
    sel: &CandidateSelector,
    hidden: &Tensor,
    logits: &Tensor,
    labels: &[u32],
    prev: &[u32],
    weights: &[f32],
    weight_sum: f64,
) -> Result<SelectorTerm> {
    let top = top_k_rows(&logits.detach().to_dtype(DType::F32)?, sel.top_k)?;
    let cands: Vec<Vec<u32>> = top
        .iter()
        .map(|r| r.iter().map(|&(t, _)| t).collect())
        .collect();
    let unary: Vec<Vec<f32>> = top
        .iter()
        .map(|r| r.iter().map(|&(_, v)| v).collect())
        .collect();
    let scores = sel.training_scores(&hidden.detach(), &cands, &unary, prev)?; // [R, K]
    let top1_idx: Vec<u32> = scores.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1()?;
    let top1: Vec<u32> = top1_idx
        .iter()
        .zip(&cands)
        .map(|(&i, c)| c[i as usize])
        .collect();
    // the rows with a term: a weight, and the label among the candidates
    let mut rows = Vec::new();
    let mut at = Vec::new();
    let mut w = Vec::new();
    for (r, c) in cands.iter().enumerate() {
        if weights[r] == 0.0 {
            continue;
        }
        if let Some(i) = c.iter().position(|&t| t == labels[r]) {
            rows.push(r as u32);
            at.push(i as u32);
            w.push(weights[r]);
        }
    }
    let dev = hidden.device();
    let loss = if rows.is_empty() {
        Tensor::zeros((), scores.dtype(), dev)?
    } else {
        let n = rows.len();
        let s = scores.index_select(&Tensor::new(rows.as_slice(), dev)?, 0)?;
        let logp = candle_nn::ops::log_softmax(&s, D::Minus1)?;
        let picked = logp
            .gather(&Tensor::from_vec(at, (n, 1), dev)?, 1)?
            .squeeze(1)?;
        let w = Tensor::from_vec(w, n, dev)?.to_dtype(picked.dtype())?;
        ((picked * w)?.sum_all()? * (-1.0 / weight_sum))?
    };
    Ok(SelectorTerm {
        loss,
        top1,
        covered: rows.len(),
    })
}
