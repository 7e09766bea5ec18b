//! The doctor's checks, in the order it runs them: each a function of the [`Subject`]
//! returning one plain [`Check`].

use anyhow::Result;
use dflash_model::io::loader::identity_hash;
use dflash_model::models::drafter::Drafter;
use dflash_train::checkpoint::TrainingRecord;
use dflash_train::config::TrainConfig;
use dflash_train::data::{manifest_sha256, read_sequences};
use dflash_train::fingerprint::{fingerprint, KernelMatch};
use dflash_train::trainer::{usable_sequences, validate, FeatureCache, TrainableDrafter};

use super::probes::{measured_tau, parity_diff, tap_deviation};
use super::{Check, Subject};

const NO_RECORD: &str = "no training record (training.json) beside the drafter";

/// Check 1: The drafter's sizes, taps, mask token and block against the target's.
pub(super) fn configuration(s: &Subject) -> Check {
    let (cfg, tc) = (&s.cfg, &s.lt.target.config);
    let detail = match &s.drafter {
        Ok(d) => format!(
            "hidden {} = {}, vocab {} = {}, num_target_layers {} = {}, taps {:?} (layer outputs){}, mask token {} < vocab, block {}",
            cfg.hidden_size, tc.hidden_size, cfg.vocab_size, tc.vocab_size, cfg.num_target_layers,
            tc.num_hidden_layers, s.taps,
            s.taps_note.as_ref().map(|n| format!(" [{n}]")).unwrap_or_default(),
            d.mask_token_id, d.block_size
        ),
        Err(e) => format!("{e:#}"),
    };
    Check::new("configuration", s.drafter.is_ok(), detail)
}

/// Check 2: What the target loaded: a layer, the embedding or the LM head left out is a wrong
/// loading path (another model class, a wrapper's prefix).
pub(super) fn target_tensors(s: &Subject) -> Check {
    let ignored = &s.lt.target.ignored_tensors;
    let essential = |n: &String| {
        n.starts_with("model.layers.") || n.starts_with("model.embed") || n == "lm_head.weight"
    };
    let listed = if ignored.is_empty() {
        String::new()
    } else {
        let first: Vec<&str> = ignored.iter().take(6).map(String::as_str).collect();
        format!(": {}", first.join(", "))
    };
    Check::new(
        "target tensors",
        !ignored.iter().any(essential),
        format!(
            "{} loaded, {} ignored{listed}",
            s.lt.target.loaded_tensors.len(),
            ignored.len()
        ),
    )
}

/// Check 3: The training record: its absence (a z-lab checkpoint) skips the checks that need it.
pub(super) fn training_record(s: &Subject) -> Check {
    match &s.record {
        Some(r) => Check::new(
            "training record",
            true,
            format!(
                "loss {:?}, {} steps, mask token {}, data '{}'",
                r.loss, r.steps, r.mask_token_id, r.data_source
            ),
        ),
        None => Check::skipped(
            "training record",
            &format!("{NO_RECORD} (e.g. a z-lab checkpoint): the target identity, the trained tap ids and statistics and the stored τ cannot be checked; the other checks run"),
        ),
    }
}

/// Check 4: The target's files are the ones the drafter was trained with.
pub(super) fn target_identity(s: &Subject) -> Result<Check> {
    let Some(r) = &s.record else {
        return Ok(Check::skipped("target identity", NO_RECORD));
    };
    let now = identity_hash(&s.lt.source)?;
    let then = &r.fingerprint.target_hash;
    Ok(Check::new(
        "target identity",
        now == *then,
        if now == *then {
            "the target's files are the ones the drafter was trained with".into()
        } else {
            format!(
                "the target's files differ from training ({}… vs {}…)",
                &now[..12],
                &then[..12.min(then.len())]
            )
        },
    ))
}

/// The tap ids the record was trained on.
fn trained_taps(r: &TrainingRecord) -> Vec<usize> {
    r.fingerprint.taps.iter().map(|t| t.tap).collect()
}

/// Check 5: The tap ids read now are the ones trained on; a constant shift names the
/// layer-output vs `hidden_states`-index mix-up. Example: trained on [1, 3], reading [2, 4]
/// → "shifted by 1".
pub(super) fn tap_ids(s: &Subject) -> Check {
    let Some(r) = &s.record else {
        return Check::skipped("tap ids", NO_RECORD);
    };
    let (taps, trained) = (&s.taps, trained_taps(r));
    if *taps == trained {
        return Check::new("tap ids", true, format!("taps {taps:?} as trained"));
    }
    let shift = if trained.len() == taps.len() && !trained.is_empty() {
        let d: Vec<i64> = taps
            .iter()
            .zip(&trained)
            .map(|(a, b)| *a as i64 - *b as i64)
            .collect();
        d.iter().all(|x| *x == d[0]).then_some(d[0])
    } else {
        None
    };
    let hint = shift
        .map(|s| format!(" (shifted by {s}: a layer-output vs hidden_states-index mix-up?)"))
        .unwrap_or_default();
    Check::new(
        "tap ids",
        false,
        format!("the drafter taps {taps:?} but was trained on {trained:?}{hint}"),
    )
}

/// Check 6: The kernel family and precision that computed the training features against the
/// ones computing them now (the seeds' failure: fla's kernels in training, transformers' torch
/// fallback in evaluation). Another numerics family fails by name; another implementation of
/// the same numerics (dflash-rs's CUDA kernels vs its host path) or another precision is named
/// and left to the tap statistics to judge.
pub(super) fn kernel_family(s: &Subject) -> Check {
    const NAME: &str = "kernel family";
    let Some(r) = &s.record else {
        return Check::skipped(NAME, NO_RECORD);
    };
    let Some(then) = &r.fingerprint.kernels else {
        return Check::skipped(
            NAME,
            "the training record predates recorded kernel families; the tap statistics still compare the hidden states",
        );
    };
    let now = dflash_train::fingerprint::kernel_family(&s.lt.target);
    let KernelMatch::SameNumerics {
        other_implementation,
        other_precision,
    } = now.against(then)
    else {
        return Check::new(
            NAME,
            false,
            format!(
                "training features came from {}; this run computes them with {}: the drafter sees hidden states it was not trained on — evaluate with the training kernels or retrain on these",
                then.describe(),
                now.describe()
            ),
        );
    };
    let mut notes = Vec::new();
    if other_implementation {
        notes.push(format!(
            "another implementation of the same numerics ({} at training)",
            then.linear_attention.as_deref().unwrap_or("none")
        ));
    }
    if other_precision {
        notes.push(format!(
            "another precision ({} at training): the tap statistics use the cross-dtype tolerance",
            then.precision
        ));
    }
    Check::new(
        NAME,
        true,
        if notes.is_empty() {
            format!("{}, as at training", now.describe())
        } else {
            format!("{}; {}", now.describe(), notes.join("; "))
        },
    )
}

/// Check 7: The taps' statistics on the canary prompts with the current engine, device and dtype
/// against the fingerprint stored at training (another kernel, dtype or loading path); the
/// same-dtype tolerance only on the device kind of training.
pub(super) fn tap_statistics(s: &Subject) -> Result<Check> {
    let Some(r) = &s.record else {
        return Ok(Check::skipped("tap statistics", NO_RECORD));
    };
    let fp = &r.fingerprint;
    let now = fingerprint(s.lt, &trained_taps(r))?;
    let limit = if now.dtype == fp.dtype && now.device == fp.device {
        s.tol.tap_rel
    } else {
        s.tol.tap_rel_cross_dtype
    };
    let dev = tap_deviation(fp, &now);
    let bad: Vec<String> = dev
        .iter()
        .filter(|(_, d)| *d > limit)
        .map(|(t, d)| format!("tap {t}: {d:.2e}"))
        .collect();
    let worst = dev.iter().map(|x| x.1).fold(0.0, f64::max);
    Ok(Check::new(
        "tap statistics",
        bad.is_empty(),
        if bad.is_empty() {
            format!(
                "max deviation {worst:.2e} std ≤ {limit:.0e} ({} on {} now, {} on {} at training)",
                now.dtype, now.device, fp.dtype, fp.device
            )
        } else {
            format!("hidden states differ from training beyond {limit:.0e} std: {} (another kernel, dtype or loading path?)", bad.join(", "))
        },
    ))
}

/// Check 8: The training path (many blocks in one masked forward) and the inference path (one block
/// on the draft cache) give the same logits, within `parity_abs`: the drafter's own paths in
/// f32; beside a bf16 target, where the bf16 paths round differently ([`super::Tolerances`]),
/// an f32 copy of the drafter on the same taps and LM head, the bf16 paths' agreement reported.
/// Example: the shipped Coder drafter beside its bf16 target on the CPU: the f32 copy 1.7e-5
/// apart (45 of 45 greedy draft tokens equal), the bf16 paths 0.125 apart (reported).
pub(super) fn train_infer_parity(s: &Subject, d: &Drafter) -> Result<Check> {
    const NAME: &str = "train/infer parity";
    let ids =
        s.lt.tokenizer
            .encode(dflash_train::fingerprint::CANARY_PROMPTS[0], false)?;
    let p = parity_diff(s.lt, d, &ids)?;
    let agree = p.agreement_text();
    let dtype = s.lt.target.dtype;
    if dtype == candle_core::DType::F32 {
        return Ok(Check::new(
            NAME,
            p.max_abs <= s.tol.parity_abs,
            format!(
                "max |Δ logits| {:.2e} (≤ {:.0e}); {agree}",
                p.max_abs, s.tol.parity_abs
            ),
        ));
    }
    let d32 = Drafter::load_dir_as(s.dir, &s.lt.target, candle_core::DType::F32)?;
    let p32 = parity_diff(s.lt, &d32, &ids)?;
    Ok(Check::new(
        NAME,
        p32.max_abs <= s.tol.parity_abs,
        format!(
            "an f32 copy of the drafter on this {dtype:?} target's taps: max |Δ logits| {:.2e} (≤ {:.0e}), {}; in {dtype:?}, where the paths round differently: {agree}, max |Δ logits| {:.2e} (reported)",
            p32.max_abs,
            s.tol.parity_abs,
            p32.agreement_text(),
            p.max_abs
        ),
    ))
}

/// Check 9: The stored simulated τ, the simulated τ now and τ measured by decoding the validation
/// shard agree.
pub(super) fn simulated_vs_measured_tau(s: &Subject, d: &Drafter) -> Result<Check> {
    const NAME: &str = "simulated vs measured τ";
    let Some(r) = &s.record else {
        return Ok(Check::skipped(NAME, NO_RECORD));
    };
    let Some(data) = s.data else {
        let stored = r
            .val_simulated_tau
            .map_or("none".to_string(), |t| format!("{t:.3}"));
        return Ok(Check::skipped(
            NAME,
            &format!(
                "stored simulated τ {stored}; pass --data DIR to measure τ on the validation shard"
            ),
        ));
    };
    let (_, seqs) = read_sequences(data)?;
    let tcfg: TrainConfig = r.train_config.clone();
    let (seqs, _, _) = usable_sequences(seqs, &tcfg);
    let n_val = tcfg
        .val_sequences
        .min(seqs.len().saturating_sub(1))
        .max(1)
        .min(seqs.len());
    let val = &seqs[seqs.len() - n_val..];
    let weights =
        candle_core::safetensors::load(s.dir.join("model.safetensors"), &s.lt.target.device)?;
    let td = TrainableDrafter::new(s.cfg.clone(), &weights, &s.lt.target)?;
    let v = validate(&td, s.lt, &tcfg, val, (&mut FeatureCache::new(0), 0))?;
    let sim_now = v.counts.simulated_tau();
    // what decoding measures: the walk over the responses' anchors (dflash_core::stats::
    // walk_decoding), which the harmonic mean of per-anchor τ approximates
    let harmonic = v.counts.simulated_decoding_tau();
    let sim_decoding = v.decoding_tau();
    // the walk scores the drafter's arg-max over the whole vocabulary, so the τ it is held to
    // is decoding's with the whole vocabulary too; a `draft_vocab.json` restricts decoding's
    // proposals (to its tokens and the prompt's) and its τ is reported beside
    let (measured, other_text, with_vocab) = match &d.draft_vocab {
        None => {
            let (m, o) = measured_tau(s.lt, d, val)?;
            (m, o, None)
        }
        Some(v) => {
            let mut whole = Drafter::load_dir(s.dir, &s.lt.target)?;
            whole.draft_vocab = None;
            let (m, o) = measured_tau(s.lt, &whole, val)?;
            let (mv, _) = measured_tau(s.lt, d, val)?;
            (m, o, Some((v.token_ids.len(), mv)))
        }
    };
    // a record from before every checkpoint was validated may hold none, and the stored value
    // was validated on the training data's last sequences: it is compared only when `--data`
    // is that data set (its manifest's sha256 is the record's); otherwise only the measured
    // half is checked, and the detail says so
    let tol = s.tol.tau_rel;
    let same_data = manifest_sha256(data).is_ok_and(|h| h == r.data_manifest_sha256);
    let stored_agrees = !same_data
        || r.val_simulated_tau
            .is_none_or(|stored| (sim_now - stored).abs() <= tol * stored);
    let agree =
        stored_agrees && (measured - sim_decoding).abs() <= tol * sim_decoding.max(measured);
    let stored = match r.val_simulated_tau {
        None => "none recorded".to_string(),
        Some(t) if same_data => format!("{t:.3}"),
        Some(t) => {
            format!("{t:.3} (on the training data's validation sequences, not these: not compared)")
        }
    };
    Ok(Check::new(
        NAME,
        agree,
        format!(
            "stored simulated τ {stored}, simulated now {sim_now:.3} (uniform anchors; as decoding visits them: {sim_decoding:.3} by the walk, {harmonic:.3} as the harmonic mean), measured by decoding {measured:.3} on {} validation sequence(s){}{} (tolerance {:.0}%)",
            val.len(),
            match with_vocab {
                None => String::new(),
                Some((n, t)) => format!(
                    " with the whole vocabulary, as the walk scores it ({t:.3} drafting from the {n} tokens of {} and each prompt's)",
                    dflash_model::models::draft_vocab::FILE
                ),
            },
            match other_text {
                0 => String::new(),
                k => format!(", {k} of them decoded to another text than stored"),
            },
            tol * 100.0
        ),
    ))
}
