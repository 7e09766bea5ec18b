//! DFlash2's candidate selector weights (z-lab `CandidateSelector`): what the model computes
//! for the walk of [`dflash_core::selector`].
//!
//! From the drafter's normed hidden rows `h` `[P, H]` (block rows 1 ..= P) and their draft
//! logits: the top `selector_top_k` logits of each row (the unary scores, best first, by
//! [`crate::ops::top_k::top_k_rows`] on the logits' device), `hp = hidden_projection(h)`
//! `[P, R]`, and the edge term `⟨A[prev] ⊙ hp_p, B[c]⟩` for every predecessor `prev` (the
//! anchor at p = 0, the candidates of p − 1 after it) and candidate `c` of p: one batched
//! matmul `[P, K, R] × [P, R, K]` on the device, of which `P · K²` values leave it. The
//! checkpoint stores the codebooks `candidate_selector.predecessor_codebook` and
//! `candidate_selector.successor_codebook` (`[V, R]`) without a `.weight` suffix (a
//! `.weight` suffix, as transformers' `save_pretrained` writes them, is read too).

use anyhow::Result;
use candle_core::{DType, Module, Tensor};
use dflash_core::selector::SelectorStep;

use crate::io::weights::TensorStore;
use crate::layers::linear::Linear;
use crate::layers::mlp::load_linear;
use crate::ops::top_k::top_k_rows;

#[derive(Debug, Clone)]
pub struct CandidateSelector {
    hidden_projection: Linear,
    predecessor: Tensor,
    successor: Tensor,
    pub top_k: usize,
}

/// A codebook by z-lab's name (no `.weight`), or as transformers' `save_pretrained` writes it.
fn codebook(store: &TensorStore, name: &str, vocab: usize, rank: usize) -> Result<Tensor> {
    let bare = format!("{}.{name}", CandidateSelector::PREFIX);
    let with_weight = format!("{bare}.weight");
    if !store.contains(&bare) && store.contains(&with_weight) {
        return store.get(&with_weight, &[vocab, rank]);
    }
    store.get(&bare, &[vocab, rank])
}

impl CandidateSelector {
    pub const PREFIX: &'static str = "candidate_selector";

    pub fn load(
        store: &TensorStore,
        vocab: usize,
        hidden: usize,
        rank: usize,
        top_k: usize,
    ) -> Result<Self> {
        let p = Self::PREFIX;
        Ok(Self {
            hidden_projection: load_linear(
                store,
                &format!("{p}.hidden_projection"),
                rank,
                hidden,
                false,
            )?,
            predecessor: codebook(store, "predecessor_codebook", vocab, rank)?,
            successor: codebook(store, "successor_codebook", vocab, rank)?,
            top_k,
        })
    }

    /// Training scores `[n, K]` (f32; f64 for an f64 drafter): `unary + ⟨A[prev] ⊙ hp, B[c]⟩` for row i's candidates
    /// `cands[i]` after its predecessor `prev[i]` (the ground truth's previous token). Gradients
    /// reach the projection and the codebooks; `hidden` `[n, H]` and `unary` enter as given
    /// (the trainer passes them detached).
    pub fn training_scores(
        &self,
        hidden: &Tensor,
        cands: &[Vec<u32>],
        unary: &[Vec<f32>],
        prev: &[u32],
    ) -> Result<Tensor> {
        let dev = hidden.device();
        let f = crate::layers::norm::compute_dtype(hidden.dtype());
        let (n, k) = (cands.len(), cands.first().map_or(0, |c| c.len()));
        let hp = self.hidden_projection.forward(hidden)?.to_dtype(f)?; // [n, R]
        let a = self
            .predecessor
            .index_select(&Tensor::new(prev, dev)?, 0)?
            .to_dtype(f)?;
        let flat: Vec<u32> = cands.iter().flatten().copied().collect();
        let b = self
            .successor
            .index_select(&Tensor::new(flat, dev)?, 0)?
            .to_dtype(f)?
            .reshape((n, k, hp.dim(1)?))?;
        let edge = (a * hp)?
            .unsqueeze(1)?
            .matmul(&b.transpose(1, 2)?.contiguous()?)?
            .squeeze(1)?;
        let u: Vec<f32> = unary.iter().flatten().copied().collect();
        Ok((edge + Tensor::from_vec(u, (n, k), dev)?.to_dtype(f)?)?)
    }

    /// The walk's steps for one block: `hidden` `[P, H]` (normed block rows 1 ..= P),
    /// `logits` `[P, columns]` (f32, after the multiplier and soft-capping), the anchor token,
    /// and the token of each logit column (a vocabulary head's subset, or the identity).
    pub fn steps(
        &self,
        hidden: &Tensor,
        logits: &Tensor,
        anchor: u32,
        token_of: impl Fn(u32) -> u32,
    ) -> Result<Vec<SelectorStep>> {
        let top = top_k_rows(logits, self.top_k)?;
        let (p, k) = (top.len(), top.first().map_or(0, |r| r.len()));
        if p == 0 || k == 0 {
            return Ok(Vec::new());
        }
        let tokens: Vec<Vec<u32>> = top
            .iter()
            .map(|r| r.iter().map(|&(j, _)| token_of(j)).collect())
            .collect();
        let dev = hidden.device();
        let f32_rows = |t: &Tensor| t.to_dtype(DType::F32);
        let hp = f32_rows(&self.hidden_projection.forward(hidden)?)?; // [P, R]
        let r = hp.dim(1)?;
        // predecessors: the anchor for position 0, the candidates of p - 1 for p ≥ 1
        let mut pred_ids = vec![anchor];
        pred_ids.extend(tokens[..p - 1].iter().flatten());
        let pred = f32_rows(
            &self
                .predecessor
                .index_select(&Tensor::new(pred_ids, dev)?, 0)?,
        )?;
        let succ_ids: Vec<u32> = tokens.iter().flatten().copied().collect();
        let succ = f32_rows(
            &self
                .successor
                .index_select(&Tensor::new(succ_ids, dev)?, 0)?,
        )?
        .reshape((p, k, r))?;
        // position 0: [1, R] ⊙ hp_0, against its K successors
        let x0 = pred.narrow(0, 0, 1)?.broadcast_mul(&hp.narrow(0, 0, 1)?)?;
        let e0 = x0
            .matmul(&succ.get(0)?.t()?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut edges = vec![e0];
        if p > 1 {
            let xs = pred
                .narrow(0, 1, (p - 1) * k)?
                .reshape((p - 1, k, r))?
                .broadcast_mul(&hp.narrow(0, 1, p - 1)?.unsqueeze(1)?)?;
            let es = xs
                .matmul(&succ.narrow(0, 1, p - 1)?.transpose(1, 2)?.contiguous()?)?
                .reshape((p - 1, k * k))?
                .to_vec2::<f32>()?;
            edges.extend(es);
        }
        Ok(top
            .into_iter()
            .zip(tokens)
            .zip(edges)
            .map(|((row, tokens), edge)| SelectorStep {
                tokens,
                unary: row.into_iter().map(|(_, v)| v).collect(),
                edge,
            })
            .collect())
    }
}
