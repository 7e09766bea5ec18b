//! Training rows and their objective: which sequences train, the seeded epoch order, one
//! row's loss (training and validation alike) and validation.

use anyhow::Result;
use candle_core::DType;
use dflash_core::stats::AcceptCounts;
use dflash_model::io::loader::LoadedTarget;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::drafter::TrainableDrafter;
use super::features::FeatureCache;
use crate::anchors;
use crate::config::{LossKind, TrainConfig};
use crate::data::Sequence;
use crate::loss::{block_loss, target_features, Features, LossOutput, Objective};
use crate::pack::TrainingRow;

/// Sequences cut after their first loop (`loop_window`, [`crate::loops`]) and to
/// `max_length`, and the ones without two consecutive supervised tokens dropped (counted).
/// Returns (sequences, dropped, supervised tokens cut as loops).
pub fn usable_sequences(seqs: Vec<Sequence>, cfg: &TrainConfig) -> (Vec<Sequence>, usize, usize) {
    let (mut dropped, mut looped) = (0, 0);
    let kept = seqs
        .into_iter()
        .filter_map(|mut s| {
            if let Some(w) = cfg.loop_window {
                looped += crate::loops::cut_loop(&mut s, w);
            }
            s.ids.truncate(cfg.max_length);
            s.loss_mask.truncate(cfg.max_length);
            if anchors::candidates(&s.loss_mask).is_empty() {
                dropped += 1;
                None
            } else {
                Some(s)
            }
        })
        .collect();
    (kept, dropped, looped)
}

/// The order of `n` rows in `epoch`: a ChaCha8 permutation seeded by (`seed`, `epoch`).
pub(super) fn permutation(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    p.shuffle(&mut ChaCha8Rng::seed_from_u64(anchors::seed_for(
        seed,
        epoch,
        usize::MAX,
    )));
    p
}

/// The anchors training row `si` trains in `epoch`: `num_anchors` of its candidates drawn
/// with the seed of (run, epoch, row) — the same on every visit, rank and resume, and what
/// `--plan-out` writes.
pub fn row_anchors(row: &TrainingRow, cfg: &TrainConfig, epoch: usize, si: usize) -> Vec<usize> {
    anchors::sample(
        row.anchor_candidates(),
        cfg.num_anchors,
        anchors::seed_for(cfg.seed, epoch, si),
    )
}

/// One training row's objective: the clean target forward for its features (or the ones
/// `cache` kept for `key`), the block loss at `anchors`. Training goes through here,
/// validation through the same features and block loss.
pub fn row_loss(
    td: &TrainableDrafter,
    lt: &LoadedTarget,
    cfg: &TrainConfig,
    row: &TrainingRow,
    anchors: &[usize],
    (cache, key): (&mut FeatureCache, usize),
) -> Result<LossOutput> {
    let feats = row_features(td, lt, cfg, row, (cache, key))?;
    block_loss(
        &td.drafter,
        &lt.target,
        row,
        &feats,
        anchors,
        Objective::of(cfg),
    )
}

/// A row's target features: the clean target forward, or the ones `cache` kept for `key`.
fn row_features(
    td: &TrainableDrafter,
    lt: &LoadedTarget,
    cfg: &TrainConfig,
    row: &TrainingRow,
    (cache, key): (&mut FeatureCache, usize),
) -> Result<Features> {
    cache.get(key, || {
        let _p = tracing::info_span!(target: "phase", "target features").entered();
        target_features(
            &lt.target,
            &td.drafter.target_layer_ids,
            row,
            cfg.loss == LossKind::Kl,
        )
    })
}

/// What validation measures on held-out sequences.
#[derive(Debug, Clone)]
pub struct Validation {
    /// The loss, weighted as training weighs it.
    pub loss: f64,
    pub counts: AcceptCounts,
    /// (tokens, rounds) of the decoding walk over every sequence's response
    /// ([`dflash_core::stats::walk_decoding`]); `None` only if some visited anchor was not
    /// scored.
    pub walk: Option<(u64, u64)>,
}

impl Validation {
    /// τ of the decoding walk, tokens / rounds.
    pub fn walked_tau(&self) -> Option<f64> {
        self.walk
            .filter(|&(_, r)| r > 0)
            .map(|(t, r)| t as f64 / r as f64)
    }

    /// The τ decoding would measure on these sequences: the walk's, or the harmonic mean over
    /// the anchors ([`AcceptCounts::simulated_decoding_tau`]) when the walk reached an anchor
    /// that was not scored.
    pub fn decoding_tau(&self) -> f64 {
        self.walked_tau()
            .unwrap_or_else(|| self.counts.simulated_decoding_tau())
    }
}

/// Loss and acceptance on held-out sequences at every anchor candidate (so that the decoding
/// walk finds each anchor it visits), `num_anchors` of them per drafter forward (the memory of
/// a training row), the features of `seqs[i]` kept in `cache` under key `key0 + i` (a cache
/// of budget 0 keeps none).
pub fn validate(
    td: &TrainableDrafter,
    lt: &LoadedTarget,
    cfg: &TrainConfig,
    seqs: &[Sequence],
    (cache, key0): (&mut FeatureCache, usize),
) -> Result<Validation> {
    let _p = tracing::info_span!(target: "phase", "validation").entered();
    let mut counts = AcceptCounts::new(cfg.block_size - 1);
    let mut walk = Some((0u64, 0u64));
    let (mut num, mut den) = (0.0, 0.0);
    for (i, s) in seqs.iter().enumerate() {
        let row = TrainingRow::single(s.clone());
        let feats = row_features(td, lt, cfg, &row, (&mut *cache, key0 + i))?;
        // a single-sequence row: anchor positions are the sequence's
        let mut acc = std::collections::HashMap::new();
        for chunk in row.anchor_candidates().chunks(cfg.num_anchors.max(1)) {
            let out = block_loss(
                &td.drafter,
                &lt.target,
                &row,
                &feats,
                chunk,
                Objective::of(cfg),
            )?;
            num += out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * out.weight_sum;
            den += out.weight_sum;
            counts.merge(&out.counts);
            acc.extend(out.accepted);
        }
        let w = dflash_core::stats::walk_decoding(s.prompt_len(), s.ids.len(), |a| {
            acc.get(&a).copied()
        });
        walk = walk.zip(w).map(|((t, r), (t2, r2))| (t + t2, r + r2));
    }
    Ok(Validation {
        loss: num / den.max(1e-12),
        counts,
        walk,
    })
}
