//! Training DFlash2 drafters: the convs' and the selector's gradients match finite differences
//! at f64; the selector's training scores are the inference walk's; a run trains convs and
//! selector together; a selector trained alone on a DFlash drafter's frozen layers leaves them
//! bit for bit and raises the acceptance its ranking gives over the unary ranking.

use candle_core::{DType, Var};
use dflash_core::config::Dflash2Params;
use dflash_model::models::drafter::Drafter;
use dflash_testkit::*;
use dflash_train::config::{LossKind, TrainConfig};
use dflash_train::loss::{block_loss, target_features, Objective};
use dflash_train::pack::TrainingRow;
use dflash_train::trainer::{read_metrics, train, TrainOptions, TrainableDrafter};

const SIZES: Dflash2Params = Dflash2Params {
    conv_kernel_size: 3,
    conv_group_size: 16,
    selector_rank: 8,
    selector_top_k: 64,
};

fn obj(selector_weight: f64) -> Objective {
    Objective {
        block: 4,
        gamma: 7.0,
        kind: LossKind::Ce,
        selector_weight,
    }
}

/// A DFlash2 drafter for the tiny target with every path carrying signal.
fn setup(dtype: DType) -> (dflash_model::io::loader::LoadedTarget, TrainableDrafter) {
    signal_drafter("d2obj", dtype, Some(SIZES))
}

fn var<'a>(td: &'a TrainableDrafter, name: &str) -> &'a Var {
    &td.params.iter().find(|(n, _)| n == name).unwrap().1
}

/// The loss's gradient at `(name, flat)` against a central finite difference.
fn check_fd(
    td: &TrainableDrafter,
    loss: &dyn Fn() -> f64,
    grads: &candle_core::backprop::GradStore,
    name: &str,
    flat: usize,
) {
    let v = var(td, name);
    let analytic = grads
        .get(v.as_tensor())
        .unwrap_or_else(|| panic!("no gradient for {name}"))
        .flatten_all()
        .unwrap()
        .get(flat)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert_finite_difference(v, flat, analytic, loss, name);
}

/// The position of the largest |gradient| of `name` (a codebook row the loss reads).
fn largest(td: &TrainableDrafter, grads: &candle_core::backprop::GradStore, name: &str) -> usize {
    let g = grads
        .get(var(td, name).as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .abs()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    (0..g.len()).max_by(|&a, &b| g[a].total_cmp(&g[b])).unwrap()
}

#[test]
fn dflash2_gradients_match_finite_differences_at_f64() {
    let (lt, td) = setup(DType::F64);
    let s = TrainingRow::single(sequence(2, 5, 16));
    let f = target_features(&lt.target, &td.drafter.target_layer_ids, &s, false).unwrap();
    let anchors = [5usize, 8, 12];
    // the convs, through the block loss (the selector's term treats the layers' output as a
    // constant, so it is left out here)
    // the block loss with the selector's term at weight `w`
    let loss = |w: f64| -> f64 {
        block_loss(&td.drafter, &lt.target, &s, &f, &anchors, obj(w))
            .unwrap()
            .loss
            .to_scalar::<f64>()
            .unwrap()
    };
    let loss0 = || loss(0.0);
    let out = block_loss(&td.drafter, &lt.target, &s, &f, &anchors, obj(0.0)).unwrap();
    let g = out.backward().unwrap();
    for (name, flat) in [
        ("layers.0.attention_conv.base_kernel", 70usize),
        ("layers.0.attention_conv.kernel_projection.weight", 123),
        ("layers.1.mlp_conv.base_kernel", 5),
        ("layers.1.mlp_conv.kernel_projection.weight", 301),
        ("layers.0.self_attn.q_proj.weight", 100),
    ] {
        check_fd(&td, &loss0, &g, name, flat);
    }
    // the selector's term: its projection and codebooks
    let loss1 = || loss(1.0);
    let out = block_loss(&td.drafter, &lt.target, &s, &f, &anchors, obj(1.0)).unwrap();
    assert!(
        out.selector_covered.unwrap() > 0,
        "no label among the candidates"
    );
    let g = out.backward().unwrap();
    for name in [
        "candidate_selector.hidden_projection.weight",
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
    ] {
        let flat = largest(&td, &g, name);
        check_fd(&td, &loss1, &g, name, flat);
    }
}

/// The selector's training scores after a predecessor are the inference walk's scores after
/// that predecessor (one rule: the same candidates, unary and edge term).
#[test]
fn training_scores_are_the_walk_scores() {
    let (lt, td) = setup(DType::F32);
    let d = &td.drafter;
    let sel = d.selector.as_ref().unwrap();
    let t = &lt.target;
    let ctx: Vec<u32> = tiny_prompt();
    let (h, l) = fresh_block(t, d, &ctx, 7, 4);
    let steps = sel.steps(&h, &l, 7, |j| j).unwrap();
    // position 2, after each candidate of position 1
    let p = 2;
    let prevs = steps[p - 1].tokens.clone();
    let n = prevs.len();
    let rows = h.narrow(0, p, 1).unwrap().repeat((n, 1)).unwrap();
    let cands = vec![steps[p].tokens.clone(); n];
    let unary = vec![steps[p].unary.clone(); n];
    let s = sel
        .training_scores(&rows, &cands, &unary, &prevs)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (j, row) in s.iter().enumerate() {
        let want = steps[p].scores(j);
        for (a, b) in row.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
    }
}

fn small_config() -> TrainConfig {
    TrainConfig {
        num_draft_layers: 1,
        block_size: 4,
        intermediate_size: Some(128),
        mask_token_id: Some(255),
        target_layer_ids: Some(vec![1, 2]),
        num_anchors: 64,
        lr: 1e-2,
        warmup_ratio: 0.0,
        grad_accum: 4,
        epochs: 1,
        max_steps: Some(120),
        save_every: 120,
        val_every: 120,
        val_sequences: 0,
        ..Default::default()
    }
}

#[test]
fn dflash2_run_trains_convs_and_selector() {
    let (tdir, data) = four_sequences("d2run", 10, 20);
    let lt = load(&tdir, DType::F32);
    let mut cfg = small_config();
    cfg.dflash2 = Some(SIZES);
    let out = tmp("d2run-out");
    let s = train(&lt, &data, &out, cfg, &TrainOptions::default()).unwrap();
    let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
    let (first, last) = (&m[0], s.last.unwrap());
    // block CE plus the selector's term
    assert!(
        last.loss < first.loss * 0.7,
        "loss {} → {}",
        first.loss,
        last.loss
    );
    assert!(
        last.simulated_tau >= 0.9 * 4.0,
        "simulated τ {} (acceptance {:?})",
        last.simulated_tau,
        last.acceptance
    );
    let ck = s.latest_checkpoint.unwrap().join("drafter");
    let d = Drafter::load_dir(&ck, &lt.target).unwrap();
    assert!(d.config.is_dflash2() && d.selector.is_some());
    // the convs moved away from the identity they started at
    let w = candle_core::safetensors::load(ck.join("model.safetensors"), &candle_core::Device::Cpu)
        .unwrap();
    let kp = w["layers.0.attention_conv.kernel_projection.weight"]
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(kp > 0.0, "the dynamic taps did not train");
}

/// A selector trained alone on top of a trained DFlash drafter: the layers stay bit for bit
/// (`train_only`), the block logits stay the DFlash drafter's (identity convs), and the
/// selector's ranking accepts more than the unary ranking it started from (simulated τ).
#[test]
fn a_trained_selector_raises_acceptance_over_the_unary_ranking() {
    let (tdir, data) = four_sequences("d2sel", 30, 24);
    let lt = load(&tdir, DType::F32);
    // a DFlash drafter trained a little: its argmax is right often, not always
    let mut cfg = small_config();
    cfg.max_steps = Some(15);
    cfg.save_every = 15;
    let a = tmp("d2sel-a");
    let sa = train(&lt, &data, &a, cfg.clone(), &TrainOptions::default()).unwrap();
    let from = sa.latest_checkpoint.unwrap().join("drafter");
    let mut cfg_b = cfg.clone();
    cfg_b.dflash2 = Some(SIZES);
    cfg_b.init_from = Some(from.to_string_lossy().to_string());
    cfg_b.train_only = Some(vec!["candidate_selector.".into()]);
    cfg_b.max_steps = Some(60);
    cfg_b.save_every = 60;
    cfg_b.lr = 3e-2;
    let b = tmp("d2sel-b");
    let sb = train(&lt, &data, &b, cfg_b, &TrainOptions::default()).unwrap();
    let m = read_metrics(&b.join("metrics.jsonl")).unwrap();
    let (first, last) = (&m[0], sb.last.unwrap());
    eprintln!(
        "selector alone: simulated τ {} → {}",
        first.simulated_tau, last.simulated_tau
    );
    assert!(
        last.simulated_tau > first.simulated_tau + 0.1,
        "simulated τ {} → {}",
        first.simulated_tau,
        last.simulated_tau
    );
    // the layers are the DFlash drafter's, bit for bit
    let dev = candle_core::Device::Cpu;
    let wa = candle_core::safetensors::load(from.join("model.safetensors"), &dev).unwrap();
    let ckb = sb.latest_checkpoint.unwrap().join("drafter");
    let wb = candle_core::safetensors::load(ckb.join("model.safetensors"), &dev).unwrap();
    for (n, t) in &wa {
        let d = (t - &wb[n]).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{n} changed");
    }
    // and so are its block logits
    let da = Drafter::load_dir(&from, &lt.target).unwrap();
    let db = Drafter::load_dir(&ckb, &lt.target).unwrap();
    let row = TrainingRow::single(sequence(30, 4, 24));
    let f = target_features(&lt.target, &da.target_layer_ids, &row, false).unwrap();
    let la = block_loss(&da, &lt.target, &row, &f, &[4, 9], obj(0.0)).unwrap();
    let lb = block_loss(&db, &lt.target, &row, &f, &[4, 9], obj(0.0)).unwrap();
    let d = (la.draft_logits - lb.draft_logits)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(d, 0.0, "identity convs changed the logits by {d}");
}
