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

/// Max |Δ| between the training path (one masked forward over several blocks) and the
/// inference path (one block at a time on the draft cache) on `ids`.
pub fn parity_diff(lt: &LoadedTarget, d: &Drafter, ids: &[u32]) -> Result<f32> {
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
    let mut worst = 0f32;
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
        worst = worst.max(dflash_model::ops::compare::max_abs(&inf, &tr)?);
    }
    Ok(worst)
}

/// τ measured by greedy DFlash decoding of each sequence's unsupervised prefix (its prompt),
/// for as many tokens as its response had. Rounds cut short by that budget are left out:
/// the simulated τ describes uncut rounds.
pub fn measured_tau(
    lt: &LoadedTarget,
    d: &Drafter,
    seqs: &[dflash_train::data::Sequence],
) -> Result<f64> {
    let mut rounds = Vec::new();
    let mut pb = dflash_train::progress::Progress::new(
        seqs.len(),
        "doctor: decoding",
        "validation sequences",
    );
    for s in seqs {
        let p = s.prompt_len();
        let req = Request {
            prompt_ids: s.ids[..p].to_vec(),
            max_new_tokens: (s.ids.len() - p).max(2),
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
        )?;
        pb.inc(
            1,
            format!(
                "τ {:.2}",
                dflash_core::stats::summarize(&[&g.rounds]).tau_pooled
            ),
        );
        rounds.push(g.rounds);
    }
    pb.finish();
    let r: Vec<&[dflash_core::stats::RoundOutcome]> = rounds.iter().map(|x| x.as_slice()).collect();
    Ok(dflash_core::stats::summarize(&r).tau_pooled)
}
