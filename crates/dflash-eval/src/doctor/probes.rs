//! Measurements the doctor's checks (and `check device`) are built on: training-path vs
//! inference-path drafter logits, τ measured by decoding, and how far tap statistics moved.

use anyhow::Result;
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, Mode, Request};
use dflash_model::io::loader::LoadedTarget;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_train::fingerprint::Fingerprint;
use dflash_train::loss::{block_loss, target_features, Objective};

/// The largest deviation of `now` from `then`, in units of each tap's std.
pub(super) fn tap_deviation(then: &Fingerprint, now: &Fingerprint) -> Vec<(usize, f64)> {
    then.taps
        .iter()
        .zip(&now.taps)
        .map(|(a, b)| {
            let s = a.std.max(1e-12);
            let mut d = ((a.mean - b.mean).abs() / s).max((a.std - b.std).abs() / s);
            for (x, y) in a.head.iter().zip(&b.head) {
                d = d.max((*x as f64 - *y as f64).abs() / s);
            }
            (a.tap, d)
        })
        .collect()
}

/// How the training path's drafter logits (one masked forward over several blocks) and the
/// inference path's (one block at a time on the draft cache) compare on the same prompt.
/// Example: f32 on the CPU, the tiny test pair → max |Δ| 1.8e-7, 45 of 45 arg-maxes equal; a
/// path that lets the block see its anchor's own features moves most arg-maxes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Parity {
    /// The largest |Δ| over every compared logit.
    pub max_abs: f32,
    /// Draft positions whose arg-max (the greedy draft token) is the same on both paths.
    pub same_argmax: usize,
    /// Draft positions compared (anchors × (block − 1)).
    pub positions: usize,
}

impl Parity {
    /// The fraction of positions whose greedy draft token is the same on both paths.
    pub fn agreement(&self) -> f64 {
        self.same_argmax as f64 / self.positions.max(1) as f64
    }

    /// "N of M greedy draft tokens equal", as the doctor and `check device` print it.
    pub fn agreement_text(&self) -> String {
        format!(
            "{} of {} greedy draft tokens equal",
            self.same_argmax, self.positions
        )
    }
}

/// [`Parity`] of the two drafter paths on `ids`, at three anchors (0, len/3, len/2).
pub fn parity_diff(lt: &LoadedTarget, d: &Drafter, ids: &[u32]) -> Result<Parity> {
    let b = d.block_size;
    let row = dflash_train::pack::TrainingRow::fully_supervised(ids);
    let feats = target_features(&lt.target, &d.target_layer_ids, &row, false)?;
    let anchors: Vec<usize> = [0, ids.len() / 3, ids.len() / 2]
        .into_iter()
        .filter(|&a| a + 1 < ids.len())
        .collect();
    let mut anchors_sorted = anchors.clone();
    anchors_sorted.dedup();
    let obj = Objective {
        block: b,
        gamma: 7.0,
        kind: dflash_train::config::LossKind::Ce,
        selector_weight: 1.0,
    };
    let train = block_loss(d, &lt.target, &row, &feats, &anchors_sorted, obj)?.draft_logits;
    let argmax = |t: &candle_core::Tensor| -> Result<Vec<u32>> {
        Ok(t.to_dtype(candle_core::DType::F32)?
            .argmax(candle_core::D::Minus1)?
            .to_device(&candle_core::Device::Cpu)?
            .to_vec1::<u32>()?)
    };
    let mut p = Parity {
        max_abs: 0.0,
        same_argmax: 0,
        positions: 0,
    };
    for (j, &a) in anchors_sorted.iter().enumerate() {
        let mut cache = d.new_cache();
        let ctx = feats.taps.narrow(1, 0, a)?;
        let inf = d.draft(
            &lt.target,
            None,
            &mut cache,
            &ctx,
            BlockAt {
                token: ids[a],
                anchor: a,
                block: b,
                positions: b - 1,
            },
        )?;
        let tr = train.narrow(0, j * (b - 1), b - 1)?;
        p.max_abs = p
            .max_abs
            .max(dflash_model::ops::compare::max_abs(&inf, &tr)?);
        let (x, y) = (argmax(&inf)?, argmax(&tr)?);
        p.same_argmax += x.iter().zip(&y).filter(|(a, b)| a == b).count();
        p.positions += x.len();
    }
    Ok(p)
}

/// τ measured by greedy DFlash decoding of each sequence's unsupervised prefix (its prompt), on
/// its response's tokens: decoded for the response's length plus a block (so that no round
/// within the response drafts a block cut at the budget, which z-lab's loop and this engine do
/// at a generation's end and training never scores), then walked as the trainer's validation
/// walks the response ([`dflash_core::stats::walk_rounds`]: the rounds anchored in it, each
/// counted up to its last token). Returns τ and the sequences whose decoding left their stored
/// response (another text than the walk scored).
pub fn measured_tau(
    lt: &LoadedTarget,
    d: &Drafter,
    seqs: &[dflash_train::data::Sequence],
) -> Result<(f64, usize)> {
    let (mut tokens, mut rounds, mut other_text) = (0u64, 0u64, 0usize);
    let ctx = lt.target.config.max_position_embeddings;
    let mut pb = dflash_train::progress::Progress::new(
        seqs.len(),
        "doctor: decoding",
        "validation sequences",
    );
    for s in seqs {
        let (p, end) = (s.prompt_len(), s.ids.len());
        let req = Request {
            prompt_ids: s.ids[..p].to_vec(),
            max_new_tokens: (end - p + d.block_size - 1)
                .min(ctx.saturating_sub(p))
                .max(2),
            sampling: SamplingParams::default(),
            stop_ids: lt.tokenizer.stop_ids.clone(),
            loop_window: 0,
        };
        let g = generate(
            &lt.target,
            Some(d),
            Mode::Chain {
                block: d.block_size,
            },
            &req,
            Default::default(),
            None,
        )?;
        let n = g.new_tokens.len().min(end - p);
        other_text += usize::from(g.new_tokens[..n] != s.ids[p..p + n]);
        let taus: Vec<usize> = g.rounds.iter().map(|r| r.tau_round).collect();
        let (t, r) = dflash_core::stats::walk_rounds(p, end, &taus);
        (tokens, rounds) = (tokens + t, rounds + r);
        pb.inc(1, format!("τ {:.2}", t as f64 / r.max(1) as f64));
    }
    pb.finish();
    Ok((tokens as f64 / rounds.max(1) as f64, other_text))
}
