//! `doctor --against DIR`: another stack's canary dump ([`super::canary`]) against what
//! dflash-rs computes for the same prompts, quantity by quantity in the order data flows —
//! format, token ids, the target's taps, the drafter's round inputs (context rows, positions,
//! visibility), the block logits, the drafts — each a [`Check`] with its largest divergence.
//! Then, when the dump has training rounds, the training side
//! ([`super::against_training`]). The first failed check names the likely cause, e.g. "taps of layer 2 equal dflash-rs's
//! layer 1 output: `hidden_states[i]` for `hidden_states[i+1]`?" or "round inputs include the
//! anchor's own feature".

use anyhow::Result;
use candle_core::Tensor;
use dflash_model::io::loader::LoadedTarget;
use dflash_model::models::drafter::Drafter;

use super::canary::{
    capture, context_key, layer_outputs, logits_key, tap_key, Canary, CanaryPrompt, CanaryRound,
    PromptAt,
};
use super::{Check, Tolerances};
use dflash_train::fingerprint::KernelMatch;

/// max |a − b| / std(b) over two same-shape tensors (∞ when a holds a non-finite value or the
/// shapes differ).
pub(super) fn deviation(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.dims() != b.dims() {
        return Ok(f64::INFINITY);
    }
    if a.elem_count() == 0 {
        return Ok(0.0);
    }
    let av = a.flatten_all()?.to_vec1::<f32>()?;
    let bv = b.flatten_all()?.to_vec1::<f32>()?;
    if av.iter().any(|x| !x.is_finite()) {
        return Ok(f64::INFINITY);
    }
    let n = bv.len() as f64;
    let mean = bv.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (bv.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n)
        .sqrt()
        .max(1e-12);
    let worst = av
        .iter()
        .zip(&bv)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max);
    Ok(worst / std)
}

/// The checks of `theirs` against dflash-rs with `lt` and `d`.
pub fn against(
    lt: &LoadedTarget,
    d: &Drafter,
    theirs: &Canary,
    tol: &Tolerances,
) -> Result<Vec<Check>> {
    let m = &theirs.meta;
    let mut checks = Vec::new();
    // 1. the drafter they ran is this one's shape
    let same = m.block_size == d.block_size && m.taps == d.target_layer_ids;
    checks.push(Check::new(
        "canary: drafter",
        same,
        format!(
            "{}: block {}, taps {:?} (layer outputs); this drafter: block {}, taps {:?}",
            m.producer, m.block_size, m.taps, d.block_size, d.target_layer_ids
        ),
    ));
    if !same {
        return Ok(checks);
    }
    // 2. token ids: theirs against our tokenizer (ours are then computed on their ids)
    let mut diff_ids = Vec::new();
    for (pi, p) in m.prompts.iter().enumerate() {
        if lt.tokenizer.encode(&p.text, false)? != p.ids {
            diff_ids.push(pi);
        }
    }
    checks.push(Check::new(
        "canary: token ids",
        diff_ids.is_empty(),
        if diff_ids.is_empty() {
            format!("{} prompts tokenized alike", m.prompts.len())
        } else {
            format!("prompts {diff_ids:?} tokenize differently here: another tokenizer or template? (compared on their ids)")
        },
    ));
    // their prompts, ids and anchors (a round that counted the anchor's own row still sits at
    // its anchor)
    let ours = capture(lt, d, &PromptAt::of(theirs))?;
    checks.push(kernels_check(theirs, &ours));
    checks.push(taps_check(lt, theirs, &ours, tol)?);
    checks.push(round_inputs_check(theirs, &ours, tol)?);
    let inputs_agree = !checks.iter().any(Check::failed);
    checks.push(logits_check(theirs, &ours, tol, inputs_agree)?);
    checks.push(drafts_check(theirs, &ours));
    checks.extend(super::against_training::training_checks(
        theirs, &ours, tol,
    )?);
    Ok(checks)
}

/// The kernel family that computed their taps against ours: other numerics (fla's chunked
/// kernels vs transformers' torch fallback, which dflash-rs reproduces) fail by name; another
/// precision is named and left to the taps check.
fn kernels_check(theirs: &Canary, ours: &Canary) -> Check {
    const NAME: &str = "canary: kernel family";
    let (Some(t), Some(o)) = (&theirs.meta.kernels, &ours.meta.kernels) else {
        return Check::skipped(NAME, "their dump does not say what computed its taps");
    };
    let KernelMatch::SameNumerics {
        other_precision, ..
    } = o.against(t)
    else {
        return Check::new(
            NAME,
            false,
            format!(
                "their taps come from {}, ours from {}: a drafter trained on one and evaluated on the other sees other hidden states (the seeds' failure); compare like with like",
                t.describe(),
                o.describe()
            ),
        );
    };
    let precision = if !other_precision {
        String::new()
    } else {
        format!(
            " (another precision: {} there, {} here)",
            t.precision, o.precision
        )
    };
    Check::new(
        NAME,
        true,
        format!(
            "theirs: {}; ours: {}{precision}",
            t.describe(),
            o.describe()
        ),
    )
}

/// The target's taps: the largest deviation per tapped layer; a divergent layer is explained
/// by a one-layer shift, a linear-attention layer at or before it, or other weights.
fn taps_check(
    lt: &LoadedTarget,
    theirs: &Canary,
    ours: &Canary,
    tol: &Tolerances,
) -> Result<Check> {
    const NAME: &str = "canary: target taps";
    let limit = tol.tap_rel;
    let layers = lt.target.config.num_hidden_layers;
    let types = lt.target.config.resolved_layer_types();
    let mut worst: Vec<(usize, f64)> = theirs.meta.taps.iter().map(|&l| (l, 0.0)).collect();
    for (pi, p) in theirs.meta.prompts.iter().enumerate() {
        for (k, &l) in theirs.meta.taps.iter().enumerate() {
            let dev = deviation(
                theirs.rows(&tap_key(pi, l), p.ids.len())?,
                &ours.tensors[&tap_key(pi, l)],
            )?;
            worst[k].1 = worst[k].1.max(dev);
        }
    }
    let detail = worst
        .iter()
        .map(|(l, d)| format!("layer {l}: {d:.1e}"))
        .collect::<Vec<_>>()
        .join(", ");
    let Some(&(bad, dev)) = worst.iter().find(|(_, d)| *d > limit) else {
        return Ok(Check::new(
            NAME,
            true,
            format!("max deviation per tapped layer (in std) {detail} ≤ {limit:.0e}"),
        ));
    };
    // their tap `bad` against our neighbouring layers' outputs
    let ids = &theirs.meta.prompts[0].ids;
    let pi_bad = theirs.rows(&tap_key(0, bad), ids.len())?;
    let mut shift = None;
    for s in [-1i64, 1] {
        let n = bad as i64 + s;
        if n < 0 || n >= layers as i64 {
            continue;
        }
        let other = &layer_outputs(&lt.target, ids, &[n as usize])?[0];
        if deviation(pi_bad, other)? <= limit {
            shift = Some((s, n));
        }
    }
    let first_linear = types[..=bad.min(types.len() - 1)]
        .iter()
        .position(|t| t == "linear_attention");
    let why = match (shift, first_linear) {
        (Some((s, n)), _) => format!(
            "their tap of layer {bad} equals dflash-rs's output of layer {n} (shifted by {s}): hidden_states[i] for hidden_states[i+1]? (tap = output of layer i = hidden_states[i+1])"
        ),
        (None, Some(g)) => match (&theirs.meta.kernels, &ours.meta.kernels) {
            (Some(t), Some(o))
                if matches!(
                    o.against(t),
                    KernelMatch::SameNumerics {
                        other_precision: true,
                        ..
                    }
                ) =>
            {
                format!(
                "taps of layer {bad} differ by {dev:.1e} std, with linear-attention layers from layer {g} on: the same kernel numerics in another precision ({} there, {} here): run the doctor in {}",
                t.precision, o.precision, t.precision
            )
            }
            _ => format!(
                "taps of layer {bad} differ by {dev:.1e} std, with linear-attention layers from layer {g} on: another linear-attention kernel (fla vs a torch fallback)?"
            ),
        },
        (None, None) if dev > 0.1 && bad == theirs.meta.taps[0] => format!(
            "taps differ from the first tapped layer ({bad}) on by {dev:.1e} std: other weights — the checkpoint loaded through another class (a VLM wrapper's model.language_model. prefix?) or another model"
        ),
        (None, None) => format!(
            "taps of layer {bad} differ by {dev:.1e} std: another attention kernel, dtype or loading path"
        ),
    };
    Ok(Check::new(NAME, false, format!("{why} [{detail}]")))
}

/// Their rounds beside ours, as (prompt, round, their prompt, their round, our round).
fn paired_rounds<'a>(
    theirs: &'a Canary,
    ours: &'a Canary,
) -> impl Iterator<
    Item = (
        usize,
        usize,
        &'a CanaryPrompt,
        &'a CanaryRound,
        &'a CanaryRound,
    ),
> {
    theirs
        .meta
        .prompts
        .iter()
        .zip(&ours.meta.prompts)
        .enumerate()
        .flat_map(|(pi, (tp, op))| {
            tp.rounds
                .iter()
                .zip(&op.rounds)
                .enumerate()
                .map(move |(ri, (tr, or))| (pi, ri, tp, tr, or))
        })
}

/// The drafter's inputs per round: context rows (count and values), block positions and the
/// visibility of each block row.
fn round_inputs_check(theirs: &Canary, ours: &Canary, tol: &Tolerances) -> Result<Check> {
    const NAME: &str = "canary: round inputs";
    let mut worst = 0f64;
    let mut rounds = 0;
    for (pi, ri, tp, tr, or) in paired_rounds(theirs, ours) {
        rounds += 1;
        let at = format!("prompt {pi}, anchor {}", tr.anchor);
        let tc = theirs.rows(&context_key(pi, ri), tr.context_rows)?;
        // their context rows against their own taps (a tap divergence is the taps check's)
        let n = tp.ids.len();
        let their_feats = theirs.features(pi)?;
        if tr.context_rows == or.context_rows + 1 && tr.anchor < n {
            let last = tc.narrow(0, or.context_rows, 1)?;
            let own = their_feats.narrow(0, tr.anchor, 1)?;
            if deviation(&last, &own)? <= tol.tap_rel {
                return Ok(Check::new(NAME, false, format!(
                        "round inputs include the anchor's own feature ({at}: {} context rows, the last is the anchor's; the rule gives {}, strictly before the anchor)",
                        tr.context_rows, or.context_rows
                    )));
            }
        }
        if tr.context_rows != or.context_rows {
            return Ok(Check::new(
                NAME,
                false,
                format!(
                    "{at}: {} context rows where the rule gives {} (positions 0..{})",
                    tr.context_rows, or.context_rows, or.context_rows
                ),
            ));
        }
        let dev = deviation(tc, &their_feats.narrow(0, 0, tr.context_rows)?)?;
        if dev > tol.tap_rel {
            return Ok(Check::new(NAME, false, format!(
                    "{at}: the context rows differ by {dev:.1e} std from the taps they come from: another order or normalisation of the concatenated taps?"
                )));
        }
        worst = worst.max(dev);
        if tr.block_positions != or.block_positions {
            let d: Vec<i64> = tr
                .block_positions
                .iter()
                .zip(&or.block_positions)
                .map(|(a, b)| *a as i64 - *b as i64)
                .collect();
            let constant = d.len() == or.block_positions.len() && d.iter().all(|x| *x == d[0]);
            return Ok(Check::new(
                NAME,
                false,
                if constant {
                    format!(
                            "{at}: block position ids off by {} ({:?}… where the block starts at the anchor, {:?}…)",
                            d[0],
                            &tr.block_positions[..2.min(tr.block_positions.len())],
                            &or.block_positions[..2]
                        )
                } else {
                    format!(
                        "{at}: block position ids {:?}, the rule gives {:?}",
                        tr.block_positions, or.block_positions
                    )
                },
            ));
        }
        for (li, (tl, ol)) in tr.visibility.iter().zip(&or.visibility).enumerate() {
            if let Some(r) = (0..ol.len()).find(|&r| tl.get(r) != Some(&ol[r])) {
                return Ok(Check::new(
                        NAME,
                        false,
                        format!(
                            "{at}, drafter layer {li}: block row {r} sees {:?} where the rule gives {:?}",
                            tl.get(r),
                            ol[r]
                        ),
                    ));
            }
        }
    }
    Ok(Check::new(
        NAME,
        true,
        format!("{rounds} rounds: context rows strictly before each anchor and equal to the taps (within {worst:.1e} std), positions and visibility as the rule"),
    ))
}

/// The block logits per round; `inputs_agree`: no earlier check failed, so a divergence here is
/// the drafter's own.
fn logits_check(
    theirs: &Canary,
    ours: &Canary,
    tol: &Tolerances,
    inputs_agree: bool,
) -> Result<Check> {
    const NAME: &str = "canary: block logits";
    let b1 = theirs.meta.block_size - 1;
    let mut worst = 0f64;
    for (pi, ri, _, tr, or) in paired_rounds(theirs, ours) {
        let tl = theirs.rows(&logits_key(pi, ri), b1)?;
        let finite = tl
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|x| x.is_finite());
        if !finite && or.context_rows == 0 {
            return Ok(Check::new(NAME, false, format!(
                    "prompt {pi}, anchor {}: non-finite logits with an empty context: an empty context at anchor 0 not guarded (the block must attend to itself alone)",
                    tr.anchor
                )));
        }
        let dev = deviation(tl, &ours.tensors[&logits_key(pi, ri)])?;
        if dev > tol.logit_rel && !inputs_agree {
            return Ok(Check::new(
                    NAME,
                    false,
                    format!(
                        "prompt {pi}, anchor {}: block logits differ by {dev:.1e} std (their inputs already differ: see the checks above)",
                        tr.anchor
                    ),
                ));
        }
        if dev > tol.logit_rel {
            return Ok(Check::new(NAME, false, format!(
                    "prompt {pi}, anchor {}: block logits differ by {dev:.1e} std with the same inputs: the drafter's attention differs (K/V expanded for GQA twice: the wrong K/V head per query head?) or other drafter weights",
                    tr.anchor
                )));
        }
        worst = worst.max(dev);
    }
    Ok(Check::new(
        NAME,
        true,
        format!("max deviation {worst:.1e} std ≤ {:.0e}", tol.logit_rel),
    ))
}

/// The greedy drafts (a consequence of the logits: reported, failed only with the logits).
fn drafts_check(theirs: &Canary, ours: &Canary) -> Check {
    let (mut same, mut all) = (0, 0);
    for (tp, op) in theirs.meta.prompts.iter().zip(&ours.meta.prompts) {
        for (tr, or) in tp.rounds.iter().zip(&op.rounds) {
            all += or.drafts.len();
            same += tr
                .drafts
                .iter()
                .zip(&or.drafts)
                .filter(|(a, b)| a == b)
                .count();
        }
    }
    Check::new(
        "canary: drafts",
        true,
        format!(
            "{same} of {all} greedy drafts equal (near-ties may differ within the logit tolerance)"
        ),
    )
}
