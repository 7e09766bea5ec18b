//! The doctor against another stack (`doctor --canary` / `--against`): the failures of the
//! project dflash-rs exists for, each injected into an otherwise faithful foreign dump, are
//! named by the first failed check; the faithful dumps pass.
//!
//! The faithful foreign stack is transformers + z-lab's `dflash==0.1.0` on the tiny Qwen3 target
//! and its `full` drafter (`tests/reference/canary_reference.py` wrote
//! `tests/fixtures/canary/qwen3-tiny-zlab`). The faults of the evaluation side cannot arise
//! inside dflash-rs (one visibility rule, one position rule, one tap convention, one drafter
//! forward), so they are injected where another stack meets ours: its dump. The training-side
//! faults are injected into dflash-rs's own dump, whose `train` rounds come from dflash-rs's
//! trainer (`block_loss`, hard CE): the faithful trainer.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Tensor};
use dflash_eval::doctor::canary::{
    capture, ce_and_kl, context_key, layer_outputs, logits_key, tap_key, target_logits_key,
    train_context_key, Canary, PromptAt,
};
use dflash_eval::doctor::{doctor_against, write_canary, DoctorReport, Tolerances};
use dflash_model::io::loader::LoadedTarget;
use dflash_model::models::drafter::Drafter;
use dflash_testkit::{fixtures, load, tmp};

fn target() -> LoadedTarget {
    load(&fixtures().join("qwen3-tiny"), DType::F32)
}
fn drafter_dir() -> PathBuf {
    fixtures().join("dflash-tiny/full")
}
fn zlab() -> Canary {
    Canary::read(&fixtures().join("canary/qwen3-tiny-zlab")).unwrap()
}

/// `dump` written to a fresh folder and checked against the tiny target and `full` drafter.
fn against(lt: &LoadedTarget, dump: &Canary, name: &str) -> DoctorReport {
    let dir = tmp(&format!("canary-{name}"));
    dump.write(&dir).unwrap();
    doctor_against(lt, &drafter_dir(), &dir, &Tolerances::default()).unwrap()
}

/// The first failed check is `check` and its detail says `says`.
fn assert_named(r: &DoctorReport, check: &str, says: &str) {
    let first = r.checks.iter().find(|c| c.failed()).unwrap_or_else(|| {
        panic!("no check failed: {:#?}", r.checks);
    });
    assert_eq!(first.name, check, "{:#?}", r.checks);
    assert!(first.detail.contains(says), "{}", first.detail);
}

/// Their taps replaced by `taps[(prompt, layer)]`, and the context rows rebuilt from them (a
/// faithful stack's context is its own taps).
fn with_taps(mut c: Canary, taps: HashMap<(usize, usize), Tensor>) -> Canary {
    for ((pi, l), t) in taps {
        c.tensors.insert(tap_key(pi, l), t);
    }
    for (pi, p) in c.meta.prompts.iter().enumerate() {
        let feats = c.features(pi).unwrap();
        for (ri, r) in p.rounds.iter().enumerate() {
            let ctx = feats.narrow(0, 0, r.context_rows).unwrap();
            c.tensors.insert(context_key(pi, ri), ctx);
        }
    }
    c
}

#[test]
fn dflash_rs_against_itself_is_zero_and_against_zlab_within_the_parity_tolerances() {
    let lt = target();
    let dir = tmp("canary-self");
    write_canary(&lt, &drafter_dir(), &dir).unwrap();
    let ours = Canary::read(&dir).unwrap();
    let r = against(&lt, &ours, "self");
    assert!(r.ok(), "{:#?}", r.checks);
    for c in &r.checks[3..6] {
        assert!(c.detail.contains("0.0e0"), "{}: {}", c.name, c.detail);
    }
    // transformers + z-lab's dflash: the same prompts, ids, anchors and rule, values at f32
    // rounding
    let z = zlab();
    assert_eq!(
        z.meta.prompts.iter().map(|p| &p.ids).collect::<Vec<_>>(),
        ours.meta.prompts.iter().map(|p| &p.ids).collect::<Vec<_>>()
    );
    let r = against(&lt, &z, "zlab");
    assert!(r.ok(), "{:#?}", r.checks);
}

/// (1) The evaluation's context slice included the anchor position.
#[test]
fn context_including_the_anchor_is_named() {
    let lt = target();
    let mut z = zlab();
    let feats: Vec<Tensor> = (0..z.meta.prompts.len())
        .map(|pi| z.features(pi).unwrap())
        .collect();
    for (pi, p) in z.meta.prompts.iter_mut().enumerate() {
        let (n, feats) = (p.ids.len(), &feats[pi]);
        for (ri, r) in p.rounds.iter_mut().enumerate() {
            r.context_rows = (r.anchor + 1).min(n);
            z.tensors.insert(
                context_key(pi, ri),
                feats.narrow(0, 0, r.context_rows).unwrap(),
            );
        }
    }
    let r = against(&lt, &z, "anchor");
    assert_named(
        &r,
        "canary: round inputs",
        "include the anchor's own feature",
    );
}

/// (2) K/V expanded for GQA twice: with 4 query heads over 2 K/V heads, `repeat_kv` applied
/// twice makes 8 heads `[0,0,0,0,1,1,1,1]` of which the first 4 are used, so query heads 2 and
/// 3 read K/V head 0 instead of 1. Their drafter computed exactly that: the same weights with
/// K/V head 1 made a copy of head 0 in every layer.
#[test]
fn kv_heads_expanded_twice_are_named() {
    let lt = target();
    let src = drafter_dir();
    let faulty = tmp("gqa-twice");
    std::fs::copy(src.join("config.json"), faulty.join("config.json")).unwrap();
    let mut w =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let hd = 16;
    for (k, t) in w.iter_mut() {
        if k.ends_with("k_proj.weight") || k.ends_with("v_proj.weight") {
            let head0 = t.narrow(0, 0, hd).unwrap();
            *t = Tensor::cat(&[&head0, &head0], 0).unwrap();
        }
    }
    candle_core::safetensors::save(&w, faulty.join("model.safetensors")).unwrap();
    let d = Drafter::load_dir(&faulty, &lt.target).unwrap();
    let mut z = zlab();
    let theirs = capture(&lt, &d, &PromptAt::of(&z)).unwrap();
    for (pi, p) in z.meta.prompts.iter().enumerate() {
        for ri in 0..p.rounds.len() {
            let k = logits_key(pi, ri);
            z.tensors.insert(k.clone(), theirs.tensors[&k].clone());
        }
    }
    let r = against(&lt, &z, "gqa");
    assert_named(&r, "canary: block logits", "K/V expanded for GQA twice");
}

/// (3) Block position ids off by one.
#[test]
fn block_positions_off_by_one_are_named() {
    let lt = target();
    let mut z = zlab();
    for p in &mut z.meta.prompts {
        for r in &mut p.rounds {
            r.block_positions.iter_mut().for_each(|x| *x += 1);
        }
    }
    let r = against(&lt, &z, "positions");
    assert_named(&r, "canary: round inputs", "block position ids off by 1");
}

/// (4) An empty context at anchor 0 not guarded: an attention over no context keys that
/// divides by zero gives NaN logits for that block.
#[test]
fn unguarded_empty_context_is_named() {
    let lt = target();
    let mut z = zlab();
    assert_eq!(z.meta.prompts[0].rounds[0].context_rows, 0);
    let k = logits_key(0, 0);
    let nan = (z.tensors[&k].zeros_like().unwrap() / 0.0).unwrap();
    z.tensors.insert(k, nan);
    let r = against(&lt, &z, "empty");
    assert_named(
        &r,
        "canary: block logits",
        "empty context at anchor 0 not guarded",
    );
}

/// (5) Hidden states from another linear-attention path: the tiny Qwen3.5 hybrid's dump by
/// transformers' torch fallback of the Gated DeltaNet layers in bf16 (no fla;
/// `canary_reference.py`) against dflash-rs at f32: the taps of the first tapped layer, a
/// Gated DeltaNet layer, diverge and the check names the linear-attention kernel. The same
/// path at f32 passes.
#[test]
fn another_linear_attention_path_is_named() {
    let lt = load(&fixtures().join("qwen35-tiny"), DType::F32);
    let hybrid = |dump: &str| {
        doctor_against(
            &lt,
            &fixtures().join("dflash-tiny/hybrid"),
            &fixtures().join("canary").join(dump),
            &Tolerances::default(),
        )
        .unwrap()
    };
    let f32_fallback = hybrid("qwen35-tiny-fallback-f32");
    assert!(f32_fallback.ok(), "{:#?}", f32_fallback.checks);
    let r = hybrid("qwen35-tiny-fallback");
    assert_named(
        &r,
        "canary: target taps",
        "the same kernel numerics in another precision (bf16 there, f32 here)",
    );
    let check =
        |r: &DoctorReport, name: &str| r.checks.iter().find(|c| c.name == name).cloned().unwrap();
    let k = check(&r, "canary: kernel family");
    assert!(
        !k.failed() && k.detail.contains("another precision"),
        "{k:?}"
    );
    // the round inputs are their own taps, correctly sliced: only the taps are named
    assert!(
        !check(&r, "canary: round inputs").failed(),
        "{:#?}",
        r.checks
    );

    // the same f32 dump, saying its taps came from fla (the seeds' training features): named
    // before the taps (which agree here: the numbers are the fallback's)
    let mut fla = Canary::read(&fixtures().join("canary/qwen35-tiny-fallback-f32")).unwrap();
    let k = fla.meta.kernels.as_mut().unwrap();
    k.linear_attention = Some("fla 0.6.0 chunk_gated_delta_rule".into());
    k.numerics = Some("fla".into());
    let dir = tmp("canary-fla-labelled");
    fla.write(&dir).unwrap();
    let r = doctor_against(
        &lt,
        &fixtures().join("dflash-tiny/hybrid"),
        &dir,
        &Tolerances::default(),
    )
    .unwrap();
    assert_named(
        &r,
        "canary: kernel family",
        "their taps come from linear attention fla 0.6.0 chunk_gated_delta_rule (fla numerics), f32, ours from linear attention dflash-rs host",
    );
}

/// (6) The target loaded through another class: a causal-LM class reading the VLM wrapper's
/// checkpoint finds none of its `model.language_model.layers.*` tensors and initialises the
/// layers afresh. Their taps come from such a target: the tiny target's embedding and head
/// with other layer weights (a fixed pattern, `0.05 · sin(0.7 · i)`, in place of the trained
/// ones).
#[test]
fn target_loaded_through_another_class_is_named() {
    let lt = target();
    let fresh = tmp("fresh-layers");
    let src = fixtures().join("qwen3-tiny");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), fresh.join(f)).unwrap();
    }
    let w =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let w: HashMap<String, Tensor> = w
        .into_iter()
        .map(|(k, t)| {
            let t = if k.starts_with("model.layers.") && t.rank() == 2 {
                let n = t.elem_count() as u32;
                (Tensor::arange(0u32, n, t.device())
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    * 0.7)
                    .unwrap()
                    .sin()
                    .unwrap()
                    .affine(0.05, 0.0)
                    .unwrap()
                    .reshape(t.shape())
                    .unwrap()
            } else {
                t
            };
            (k, t)
        })
        .collect();
    candle_core::safetensors::save(&w, fresh.join("model.safetensors")).unwrap();
    let other = load(&fresh, DType::F32);
    let z = zlab();
    let mut taps = HashMap::new();
    for (pi, p) in z.meta.prompts.iter().enumerate() {
        let outs = layer_outputs(&other.target, &p.ids, &z.meta.taps).unwrap();
        for (l, t) in z.meta.taps.iter().zip(outs) {
            taps.insert((pi, *l), t);
        }
    }
    let r = against(&lt, &with_taps(z, taps), "class");
    assert_named(&r, "canary: target taps", "loaded through another class");
}

/// (10) A tap off by one: their tap "layer i" is `hidden_states[i]` (the output of layer i − 1)
/// instead of `hidden_states[i + 1]`.
#[test]
fn tap_off_by_one_is_named() {
    let lt = target();
    let z = zlab();
    let mut taps = HashMap::new();
    for (pi, p) in z.meta.prompts.iter().enumerate() {
        let below: Vec<usize> = z.meta.taps.iter().map(|l| l - 1).collect();
        let outs = layer_outputs(&lt.target, &p.ids, &below).unwrap();
        for (l, t) in z.meta.taps.iter().zip(outs) {
            taps.insert((pi, *l), t);
        }
    }
    let r = against(&lt, &with_taps(z, taps), "tap-shift");
    assert_named(&r, "canary: target taps", "shifted by -1");
}

/// A dump that is not one, or lacks a tensor, is refused by name.
#[test]
fn broken_dumps_are_refused_by_name() {
    let d = tmp("canary-broken");
    let e = Canary::read(&d).unwrap_err().to_string();
    assert!(e.contains("canary.json"), "{e}");
    let mut z = zlab();
    z.tensors.remove(&logits_key(1, 1));
    z.write(&d).unwrap();
    let e = Canary::read(&d).unwrap_err().to_string();
    assert!(e.contains("p1.r1.logits") && e.contains("missing"), "{e}");
}

/// dflash-rs's own dump (its `train` rounds from the trainer's `block_loss`).
fn ours(lt: &LoadedTarget) -> Canary {
    let d = Drafter::load_dir(&drafter_dir(), &lt.target).unwrap();
    let prompts = dflash_eval::doctor::canary::canary_prompts(lt).unwrap();
    capture(lt, &d, &prompts).unwrap()
}

/// The rounds with training, as (prompt, round).
fn trained(c: &Canary) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for (pi, p) in c.meta.prompts.iter().enumerate() {
        for (ri, r) in p.rounds.iter().enumerate() {
            if r.train.is_some() {
                v.push((pi, ri));
            }
        }
    }
    v
}

#[test]
fn the_faithful_trainer_passes_the_training_checks() {
    let lt = target();
    let c = ours(&lt);
    assert!(!trained(&c).is_empty());
    let r = against(&lt, &c, "train-ok");
    assert!(r.ok(), "{:#?}", r.checks);
    assert!(
        r.checks
            .iter()
            .any(|c| c.name == "canary: training objective"
                && c.detail.contains("hard cross-entropy"))
    );
}

/// (7) Noise on the combined hidden states leaking into the target's logits: the target logits
/// the trainer's loss targets came from carry noise (a fixed pattern of 0.5 logit std).
#[test]
fn noise_in_the_target_logits_is_named() {
    let lt = target();
    let mut c = ours(&lt);
    for (pi, ri) in trained(&c) {
        let k = target_logits_key(pi, ri);
        let t = &c.tensors[&k];
        let std = t
            .flatten_all()
            .unwrap()
            .var_keepdim(0)
            .unwrap()
            .sqrt()
            .unwrap();
        let n = t.elem_count() as u32;
        let noise = Tensor::arange(0u32, n, t.device())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .affine(1.3, 0.0)
            .unwrap()
            .sin()
            .unwrap()
            .reshape(t.shape())
            .unwrap()
            .broadcast_mul(&(std * 0.5).unwrap())
            .unwrap();
        let noisy = (t + noise).unwrap();
        c.tensors.insert(k, noisy);
    }
    let r = against(&lt, &c, "noise");
    assert_named(&r, "canary: training targets", "noise on the hidden states");
}

/// (8) The fc fed the target layer that defines the loss target: the trainer's drafter was
/// given the target's features through the block's own positions, the rows the labels are
/// computed from.
#[test]
fn a_shortcut_to_the_loss_target_is_named() {
    let lt = target();
    let mut c = ours(&lt);
    let b = c.meta.block_size;
    for (pi, ri) in trained(&c) {
        let n = c.meta.prompts[pi].ids.len();
        let feats = c.features(pi).unwrap();
        let round = &mut c.meta.prompts[pi].rounds[ri];
        let rows = (round.anchor + b).min(n);
        round.train.as_mut().unwrap().context_rows = rows;
        c.tensors
            .insert(train_context_key(pi, ri), feats.narrow(0, 0, rows).unwrap());
    }
    let r = against(&lt, &c, "shortcut");
    assert_named(
        &r,
        "canary: training inputs",
        "a shortcut to the loss target",
    );
}

/// (9) A 70 % soft-KL mixture instead of hard cross-entropy: the trainer's loss is
/// 0.7 · KL(target ‖ drafter) + 0.3 · CE of the same logits.
#[test]
fn a_soft_kl_mixture_is_named_with_its_weight() {
    let lt = target();
    let mut c = ours(&lt);
    let b1 = c.meta.block_size - 1;
    for (pi, ri) in trained(&c) {
        let q = c.rows(&logits_key(pi, ri), b1).unwrap().clone();
        let p = c.rows(&target_logits_key(pi, ri), b1).unwrap().clone();
        let t = c.meta.prompts[pi].rounds[ri].train.as_mut().unwrap();
        if let Some((ce, kl)) = ce_and_kl(&q, &p, t).unwrap() {
            t.loss = 0.7 * kl + 0.3 * ce;
        }
    }
    let r = against(&lt, &c, "soft-kl");
    assert_named(
        &r,
        "canary: training objective",
        "0.70 · KL(target ‖ drafter) + 0.30 · CE",
    );
}
