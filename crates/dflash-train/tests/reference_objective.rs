//! The training objective against a PyTorch reference (tests/reference/training_reference.py:
//! transformers' Qwen3 for the context features, z-lab's `DFlashDraftModel` run over a row's
//! blocks with the training mask, the γ-weighted cross-entropy written from its definition):
//! the loss and every drafter parameter's gradient, for a full-attention and a sliding-window
//! drafter, on one sequence and on two packed side by side, and with the soft loss (KL to the
//! target's distribution) on the packed row (f32); then a few optimizer steps on
//! the same row (global-norm clipping, torch's AdamW with weight decay on the matrices): each
//! step's loss and gradient norm, and the weights after them.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use dflash_core::config::DrafterConfig;
use dflash_model::ops::compare::rel_err;
use dflash_model::Target;
use dflash_testkit::*;
use dflash_train::config::LossKind;
use dflash_train::config::TrainConfig;
use dflash_train::data::Sequence;
use dflash_train::loss::{block_loss, target_features, Features, LossOutput, Objective};
use dflash_train::optim::AdamW;
use dflash_train::pack::{pack, TrainingRow};
use dflash_train::trainer::TrainableDrafter;
use dflash_train::trainer::{read_metrics, train, TrainOptions};
use serde_json::Value;

/// The reference's drafter of case `c`, trainable on the target `t`.
fn drafter_of(dir: &std::path::Path, c: &Value, t: &Target) -> TrainableDrafter {
    let ddir = dir.join(c["drafter"].as_str().unwrap());
    let cfg: DrafterConfig =
        serde_json::from_str(&std::fs::read_to_string(ddir.join("config.json")).unwrap()).unwrap();
    let w = candle_core::safetensors::load(ddir.join("model.safetensors"), &Device::Cpu).unwrap();
    TrainableDrafter::new(cfg, &w, t).unwrap()
}

/// Case `key`'s row: its sequences packed side by side into the one row.
fn row_of(key: &str, c: &Value) -> TrainingRow {
    let (all_ids, all_mask) = (ids(&c["ids"]), ids(&c["loss_mask"]));
    let mut seqs = Vec::new();
    let mut at = 0;
    for n in c["lengths"].as_array().unwrap() {
        let n = n.as_u64().unwrap() as usize;
        seqs.push(Sequence {
            ids: all_ids[at..at + n].to_vec(),
            loss_mask: all_mask[at..at + n].iter().map(|&m| m as u8).collect(),
        });
        at += n;
    }
    let order: Vec<usize> = (0..seqs.len()).collect();
    let mut rows = pack(&seqs, &order, at);
    assert_eq!(rows.len(), 1, "{key}: one packed row");
    rows.remove(0)
}

/// Case `c`'s anchors and objective (γ, and CE or KL) for a drafter of `block` tokens.
fn objective_of(c: &Value, block: usize) -> (Vec<usize>, Objective) {
    let anchors: Vec<usize> = c["anchors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_u64().unwrap() as usize)
        .collect();
    let kind = match c["loss_kind"].as_str() {
        Some("kl") => LossKind::Kl,
        _ => LossKind::Ce,
    };
    let obj = Objective {
        block,
        gamma: c["gamma"].as_f64().unwrap(),
        kind,
        selector_weight: 0.0,
    };
    (anchors, obj)
}

/// One case's row, its target features, anchors and objective: what each loss is taken on.
struct Batch {
    row: TrainingRow,
    feats: Features,
    anchors: Vec<usize>,
    obj: Objective,
}

impl Batch {
    /// The loss of `td` on this batch.
    fn loss(&self, td: &TrainableDrafter, t: &Target) -> LossOutput {
        block_loss(
            &td.drafter,
            t,
            &self.row,
            &self.feats,
            &self.anchors,
            self.obj,
        )
        .unwrap()
    }
}

/// Case `key`'s loss and every drafter parameter's gradient equal the reference's.
fn check_loss_and_gradients(
    key: &str,
    c: &Value,
    td: &TrainableDrafter,
    t: &Target,
    batch: &Batch,
    want: &HashMap<String, Tensor>,
) {
    let out = batch.loss(td, t);
    let loss = out.loss.to_scalar::<f32>().unwrap() as f64;
    let want_loss = c["loss"].as_f64().unwrap();
    assert!(
        (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
        "{key}: loss {loss} vs {want_loss}"
    );
    let g = out.backward().unwrap();
    let mut compared = 0;
    for ((name, _), grad) in td.params.iter().zip(td.grads_of(&g)) {
        let want = &want[&format!("{key}/{name}")];
        let grad = grad.unwrap_or_else(|| panic!("{key}: no gradient for {name}"));
        let e = rel_err(&grad, want).unwrap();
        assert!(e <= 1e-4, "{key}: gradient of {name}: rel err {e}");
        compared += 1;
    }
    let names = want
        .keys()
        .filter(|k| k.starts_with(&format!("{key}/")) && !k.contains("/final/"))
        .count();
    assert_eq!(compared, names, "{key}: every reference gradient compared");
}

/// The optimizer steps of `tr` (a case's `train`) from `td`'s weights: each step's loss and
/// gradient norm, the loss after them, and the weights after them equal the reference's.
fn check_optimizer_steps(
    key: &str,
    tr: &Value,
    td: &mut TrainableDrafter,
    t: &Target,
    batch: &Batch,
    want: &HashMap<String, Tensor>,
) {
    let f = |k: &str| tr[k].as_f64().unwrap();
    let mut opt = AdamW::new(
        &td.params,
        f("beta1"),
        f("beta2"),
        f("eps"),
        f("weight_decay"),
    )
    .unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b.abs();
    let steps = tr["steps"].as_u64().unwrap() as usize;
    for step in 0..=steps {
        let out = batch.loss(td, t);
        let loss = out.loss.to_scalar::<f32>().unwrap() as f64;
        let want_loss = match step {
            s if s == steps => f("loss_after"),
            s => tr["losses"][s].as_f64().unwrap(),
        };
        assert!(
            close(loss, want_loss),
            "{key}: step {step} loss {loss} vs {want_loss}"
        );
        if step == steps {
            break;
        }
        let g = out.backward().unwrap();
        let grads = td.grads_of(&g);
        let norm = td
            .update(
                t,
                &mut opt,
                grads,
                f("grad_clip"),
                f("lr"),
                &dflash_train::collective::Single,
            )
            .unwrap();
        let want_norm = tr["grad_norms"][step].as_f64().unwrap();
        assert!(
            close(norm, want_norm),
            "{key}: step {step} gradient norm {norm} vs {want_norm}"
        );
    }
    // AdamW moves a coordinate by about lr whatever its gradient's size, so one whose
    // gradient sits at rounding level may move the other way: the weights agree to 5e-4
    // of their largest (1.1e-4 seen), the losses and norms to 1e-4
    for (name, v) in &td.params {
        let e = rel_err(v.as_tensor(), &want[&format!("{key}/final/{name}")]).unwrap();
        assert!(e <= 5e-4, "{key}: {name} after {steps} steps: rel err {e}");
    }
}

/// Each of the reference's five objective cases: the loss and every gradient, then (the CE
/// cases) the optimizer steps from the same weights.
#[test]
fn loss_and_gradients_match_the_pytorch_reference() {
    let dir = fixtures().join("dflash-tiny");
    let meta = json(&dir.join("training-reference.json"));
    let want: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("training-reference.safetensors"), &Device::Cpu)
            .unwrap();
    let t = tiny();
    let cases = meta["cases"].as_object().unwrap();
    assert_eq!(cases.len(), 6);
    for (key, c) in cases.iter().filter(|(k, _)| *k != "run") {
        let mut td = drafter_of(&dir, c, &t);
        let row = row_of(key, c);
        let (anchors, obj) = objective_of(c, td.drafter.block_size);
        let feats = target_features(
            &t,
            &td.drafter.target_layer_ids,
            &row,
            obj.kind == LossKind::Kl,
        )
        .unwrap();
        let batch = Batch {
            row,
            feats,
            anchors,
            obj,
        };
        check_loss_and_gradients(key, c, &td, &t, &batch, &want);
        // the optimizer steps, from the same weights (the CE cases)
        let tr = &c["train"];
        if !tr.is_null() {
            check_optimizer_steps(key, tr, &mut td, &t, &batch, &want);
        }
    }
}

/// A whole `train` run (the trainer's data, rows, anchor candidates, two rows per step, the
/// warmup-and-cosine schedule, clipping and AdamW, from a z-lab drafter's weights) against the
/// same run written in PyTorch from the trainer's documented rules: each step's loss, learning
/// rate and gradient norm, and the checkpoint's weights.
#[test]
fn a_training_run_matches_the_pytorch_reference() {
    let dir = fixtures().join("dflash-tiny");
    let meta = json(&dir.join("training-reference.json"));
    let want: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("training-reference.safetensors"), &Device::Cpu)
            .unwrap();
    let r = &meta["cases"]["run"];
    let f = |k: &str| r[k].as_f64().unwrap();
    let steps = r["steps"].as_u64().unwrap() as usize;
    let seqs: Vec<Sequence> = r["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| Sequence {
            ids: ids(&s["ids"]),
            loss_mask: ids(&s["loss_mask"]).iter().map(|&m| m as u8).collect(),
        })
        .collect();
    let (target_dir, data) = tiny_data("reference-run", &seqs);
    let lt = load(&target_dir, candle_core::DType::F32);
    let ddir = dir.join(r["drafter"].as_str().unwrap());
    let dcfg: DrafterConfig =
        serde_json::from_str(&std::fs::read_to_string(ddir.join("config.json")).unwrap()).unwrap();
    let cfg = TrainConfig {
        num_draft_layers: dcfg.num_hidden_layers,
        block_size: dcfg.block_size,
        intermediate_size: Some(dcfg.intermediate_size),
        mask_token_id: Some(0),
        target_layer_ids: Some(vec![1, 2]),
        init_from: Some(ddir.to_string_lossy().to_string()),
        // every anchor candidate, both rows in every step
        num_anchors: 10_000,
        grad_accum: seqs.len(),
        lr: f("lr"),
        warmup_ratio: f("warmup_ratio"),
        min_lr_ratio: f("min_lr_ratio"),
        beta1: f("beta1"),
        beta2: f("beta2"),
        eps: f("eps"),
        weight_decay: f("weight_decay"),
        grad_clip: f("grad_clip"),
        gamma: f("gamma"),
        epochs: steps,
        max_steps: Some(steps),
        save_every: steps,
        val_every: steps,
        val_sequences: 0,
        ..Default::default()
    };
    let out = tmp("reference-run-out");
    let s = train(&lt, &data, &out, cfg, &TrainOptions::default()).unwrap();
    let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(m.len(), steps);
    let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * b.abs();
    for (i, mi) in m.iter().enumerate() {
        let (l, lr, n) = (
            r["losses"][i].as_f64().unwrap(),
            r["lrs"][i].as_f64().unwrap(),
            r["grad_norms"][i].as_f64().unwrap(),
        );
        assert!(close(mi.lr, lr, 1e-9), "step {i}: lr {} vs {lr}", mi.lr);
        assert!(close(mi.loss, l, 1e-4), "step {i}: loss {} vs {l}", mi.loss);
        assert!(
            close(mi.grad_norm, n, 1e-4),
            "step {i}: gradient norm {} vs {n}",
            mi.grad_norm
        );
    }
    // AdamW's first steps move every coordinate by about lr whatever its gradient's size
    // (m̂/√v̂ = ±1 at step 1), so coordinates with rounding-level gradients drift apart: the
    // checkpoint's weights agree to 2e-3 of their largest (8.8e-4 seen), the losses to 1e-4
    let ck = s.latest_checkpoint.unwrap().join("drafter");
    let got = candle_core::safetensors::load(ck.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut compared = 0;
    for (name, w) in &got {
        let Some(ref_w) = want.get(&format!("run/final/{name}")) else {
            continue;
        };
        let e = rel_err(&w.to_dtype(candle_core::DType::F32).unwrap(), ref_w).unwrap();
        assert!(e <= 2e-3, "{name} after {steps} steps: rel err {e}");
        compared += 1;
    }
    let names = want.keys().filter(|k| k.starts_with("run/final/")).count();
    assert_eq!(compared, names, "every trained weight compared");
}
