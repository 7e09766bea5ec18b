//! `doctor --against`, the training side: a dump's `train` rounds (what another stack's trainer
//! gave its drafter, the target logits its loss targets came from, the loss it computed)
//! against the clean target and the hard-CE objective. Each check names the training faults of
//! the original project: features at or after the anchor in the drafter's training inputs (a
//! shortcut to the labels), target logits that are not the clean target's (noise leaking into
//! them), a loss that is a soft-KL mixture rather than hard cross-entropy.

use anyhow::Result;
use candle_core::Tensor;

use super::against::deviation;
use super::canary::{
    ce_and_kl, logits_key, target_logits_key, train_context_key, Canary, TrainRound,
};
use super::{Check, Tolerances};

/// The rounds of `theirs` that carry training, as (prompt, round, anchor, train).
fn train_rounds(c: &Canary) -> Vec<(usize, usize, usize, &TrainRound)> {
    let mut out = Vec::new();
    for (pi, p) in c.meta.prompts.iter().enumerate() {
        for (ri, r) in p.rounds.iter().enumerate() {
            if let Some(t) = &r.train {
                out.push((pi, ri, r.anchor, t));
            }
        }
    }
    out
}

/// The three training checks, or one skipped check when the dump has no training rounds.
pub(super) fn training_checks(
    theirs: &Canary,
    ours: &Canary,
    tol: &Tolerances,
) -> Result<Vec<Check>> {
    if train_rounds(theirs).is_empty() {
        return Ok(vec![Check::skipped(
            "canary: training",
            "the dump has no training rounds (`train`): the training side is not checked",
        )]);
    }
    Ok(vec![
        inputs(theirs, tol)?,
        targets(theirs, ours, tol)?,
        objective(theirs)?,
    ])
}

/// The trainer's context rows: strictly before the anchor, and their own taps.
fn inputs(theirs: &Canary, tol: &Tolerances) -> Result<Check> {
    const NAME: &str = "canary: training inputs";
    for (pi, ri, a, t) in train_rounds(theirs) {
        let n = theirs.meta.prompts[pi].ids.len();
        let feats = theirs.features(pi)?;
        let ctx = theirs.rows(&train_context_key(pi, ri), t.context_rows)?;
        if t.context_rows > a {
            let last = t.context_rows - 1;
            return Ok(Check::new(NAME, false, format!(
                "prompt {pi}, anchor {a}: the trainer gave its drafter {} context rows, the target's features up to position {last}, at or after the anchor — the rows the labels of positions {}..={} are computed from: a shortcut to the loss target (the fc fed the layer that defines the labels?)",
                t.context_rows, a + 1, (a + theirs.meta.block_size - 1).min(n - 1)
            )));
        }
        if t.context_rows < a {
            return Ok(Check::new(
                NAME,
                false,
                format!(
                    "prompt {pi}, anchor {a}: {} training context rows where the rule gives {a}",
                    t.context_rows
                ),
            ));
        }
        let dev = deviation(ctx, &feats.narrow(0, 0, a)?)?;
        if dev > tol.tap_rel {
            return Ok(Check::new(NAME, false, format!(
                "prompt {pi}, anchor {a}: the training context rows differ from the taps by {dev:.1e} std: noise or another transform on the features before the drafter?"
            )));
        }
    }
    Ok(Check::new(
        NAME,
        true,
        "the trainer's context rows are the taps strictly before each anchor".into(),
    ))
}

/// The target logits the trainer's loss targets came from, against the clean target's.
fn targets(theirs: &Canary, ours: &Canary, tol: &Tolerances) -> Result<Check> {
    const NAME: &str = "canary: training targets";
    let b1 = theirs.meta.block_size - 1;
    let mut worst = 0f64;
    for (pi, ri, a, _) in train_rounds(theirs) {
        let Some(clean) = ours.tensors.get(&target_logits_key(pi, ri)) else {
            continue;
        };
        let tl = theirs.rows(&target_logits_key(pi, ri), b1)?;
        let dev = deviation(tl, clean)?;
        if dev > tol.logit_rel {
            let am = |t: &Tensor| -> Result<Vec<u32>> { Ok(t.argmax(1)?.to_vec1::<u32>()?) };
            let flips = am(tl)?
                .iter()
                .zip(am(clean)?)
                .filter(|(x, y)| **x != *y)
                .count();
            return Ok(Check::new(NAME, false, format!(
                "prompt {pi}, anchor {a}: the target logits the loss targets came from differ from the clean target's by {dev:.1e} std (argmax differs at {flips} of {b1} positions): noise on the hidden states leaking into the target's logits?"
            )));
        }
        worst = worst.max(dev);
    }
    Ok(Check::new(
        NAME,
        true,
        format!("the clean target's logits (within {worst:.1e} std)"),
    ))
}

/// The trainer's loss against hard CE recomputed from its drafter's logits and labels; a
/// mixture with KL(target ‖ drafter) is named with its weight.
fn objective(theirs: &Canary) -> Result<Check> {
    const NAME: &str = "canary: training objective";
    let b1 = theirs.meta.block_size - 1;
    let mut alphas = Vec::new();
    let mut worst = 0f64;
    for (pi, ri, a, t) in train_rounds(theirs) {
        let q = theirs.rows(&logits_key(pi, ri), b1)?;
        let p = theirs.rows(&target_logits_key(pi, ri), b1)?;
        let Some((ce, kl)) = ce_and_kl(q, p, t)? else {
            continue;
        };
        let gap = (t.loss - ce).abs() / ce.abs().max(1.0);
        if gap <= 1e-4 {
            worst = worst.max(gap);
            continue;
        }
        let alpha = if (kl - ce).abs() > 1e-9 {
            (t.loss - ce) / (kl - ce)
        } else {
            f64::NAN
        };
        if !(alpha > 0.0 && alpha <= 1.0 + 1e-6) {
            return Ok(Check::new(NAME, false, format!(
                "prompt {pi}, anchor {a}: the loss {:.6} is neither the hard cross-entropy {ce:.6} of the drafter's logits and labels nor a mixture of it with KL(target ‖ drafter) {kl:.6}",
                t.loss
            )));
        }
        alphas.push(alpha);
    }
    if let Some(&a0) = alphas.first() {
        let consistent = alphas.iter().all(|a| (a - a0).abs() < 1e-3);
        return Ok(Check::new(
            NAME,
            false,
            if consistent {
                format!(
                "the loss is a soft-KL mixture, {a0:.2} · KL(target ‖ drafter) + {:.2} · CE, not hard cross-entropy on the target's tokens (greedy acceptance rewards the argmax; the paper trains with CE)",
                1.0 - a0
            )
            } else {
                format!("the loss mixes KL(target ‖ drafter) into the cross-entropy with weights {:.2}..{:.2}: not hard cross-entropy", alphas.iter().cloned().fold(f64::INFINITY, f64::min), alphas.iter().cloned().fold(0.0, f64::max))
            },
        ));
    }
    Ok(Check::new(
        NAME,
        true,
        format!("hard cross-entropy on the labels (the recorded loss within {worst:.1e} relative)"),
    ))
}
