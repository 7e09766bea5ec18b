//! The training objective: gradients reach exactly the trainable parameters and match finite
//! differences at f64; the training mask is the rule written out by hand; nothing at or after
//! an anchor leaks into its block.

use candle_core::{DType, Tensor, Var};
use dflash_core::segments::Segments;
use dflash_core::visibility::{draft_training, DraftRule};
use dflash_model::ops::compare::max_abs;
use dflash_testkit::*;
use dflash_train::config::LossKind;
use dflash_train::loss::{block_loss, target_features, Objective};
use dflash_train::pack::{pack, TrainingRow};
use dflash_train::trainer::TrainableDrafter;

/// The objective these tests train: blocks of 4, γ = 7, of the given kind.
fn obj(kind: LossKind) -> Objective {
    Objective {
        block: 4,
        gamma: 7.0,
        kind,
        selector_weight: 1.0,
    }
}

fn setup(dtype: DType) -> (dflash_model::io::loader::LoadedTarget, TrainableDrafter) {
    signal_drafter("obj", dtype, None)
}

#[test]
fn gradients_reach_trainable_parameters_only() {
    let (lt, td) = setup(DType::F32);
    let s = TrainingRow::single(sequence(1, 6, 20));
    for kind in [LossKind::Ce, LossKind::Kl] {
        let f = target_features(
            &lt.target,
            &td.drafter.target_layer_ids,
            &s,
            kind == LossKind::Kl,
        )
        .unwrap();
        let out = block_loss(&td.drafter, &lt.target, &s, &f, &[6, 9, 14], obj(kind)).unwrap();
        let g = out.backward().unwrap();
        for (n, p) in &td.params {
            let gi = g
                .get(p.as_tensor())
                .unwrap_or_else(|| panic!("{kind:?}: no gradient for {n}"));
            let norm = gi
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm > 0.0, "{kind:?}: zero gradient for {n}");
        }
        assert!(
            g.get(&lt.target.embedding_table().table().unwrap())
                .is_none(),
            "the frozen embedding got a gradient"
        );
        assert!(
            g.get(&f.taps).is_none(),
            "the target features got a gradient"
        );
    }
}

#[test]
fn gradient_matches_finite_differences_at_f64() {
    let (lt, td) = setup(DType::F64);
    let s = TrainingRow::single(sequence(2, 5, 16));
    let f = target_features(&lt.target, &td.drafter.target_layer_ids, &s, false).unwrap();
    let anchors = [5usize, 8, 12];
    let loss = || -> f64 {
        block_loss(&td.drafter, &lt.target, &s, &f, &anchors, obj(LossKind::Ce))
            .unwrap()
            .loss
            .to_scalar::<f64>()
            .unwrap()
    };
    let out = block_loss(&td.drafter, &lt.target, &s, &f, &anchors, obj(LossKind::Ce)).unwrap();
    let grads = out.backward().unwrap();
    let probes = [
        ("fc.weight", 7usize),
        ("layers.0.self_attn.q_proj.weight", 100),
        ("layers.0.self_attn.k_proj.weight", 33),
        ("layers.1.self_attn.v_proj.weight", 250),
        ("layers.1.self_attn.o_proj.weight", 17),
        ("layers.0.mlp.down_proj.weight", 41),
        ("layers.1.self_attn.k_norm.weight", 3),
        ("hidden_norm.weight", 9),
        ("norm.weight", 20),
    ];
    for (name, flat) in probes {
        let var: &Var = &td.params.iter().find(|(n, _)| n == name).unwrap().1;
        let analytic = grads
            .get(var.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .get(flat)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert_finite_difference(var, flat, analytic, &loss, name);
    }
}

#[test]
fn training_mask_is_the_rule_written_out() {
    // an independent dense construction of "context strictly before the anchor, own block
    // bidirectional, other blocks invisible"
    let (seq_len, b) = (30usize, 5usize);
    let anchors = [0usize, 4, 6, 22, 28];
    let v = draft_training(DraftRule::FULL, &Segments::single(seq_len), &anchors, b);
    let n = anchors.len() * b;
    assert_eq!((v.rows, v.cols), (n, seq_len + n));
    for (j, &a) in anchors.iter().enumerate() {
        for r in 0..b {
            let row = j * b + r;
            for c in 0..seq_len + n {
                let want = if c < seq_len {
                    c < a
                } else {
                    (c - seq_len) / b == j
                };
                assert_eq!(v.get(row, c), want, "anchor {a} row {r} col {c}");
            }
        }
    }
}

#[test]
fn nothing_at_or_after_the_anchor_leaks() {
    let (lt, td) = setup(DType::F32);
    let s = TrainingRow::single(sequence(3, 4, 24));
    let a = 12usize;
    let f = target_features(&lt.target, &td.drafter.target_layer_ids, &s, false).unwrap();
    let base = block_loss(&td.drafter, &lt.target, &s, &f, &[a], obj(LossKind::Ce)).unwrap();
    // (1) noise on the context features at positions >= a
    let taps = f.taps.squeeze(0).unwrap();
    let (l, w) = taps.dims2().unwrap();
    let noise = Tensor::randn(0f32, 10.0, (l - a, w), taps.device()).unwrap();
    let perturbed = Tensor::cat(
        &[
            taps.narrow(0, 0, a).unwrap(),
            (taps.narrow(0, a, l - a).unwrap() + noise).unwrap(),
        ],
        0,
    )
    .unwrap();
    let f2 = dflash_train::loss::Features {
        taps: perturbed.unsqueeze(0).unwrap(),
        target_logits: None,
    };
    let out = block_loss(&td.drafter, &lt.target, &s, &f2, &[a], obj(LossKind::Ce)).unwrap();
    let d = max_abs(&out.draft_logits, &base.draft_logits).unwrap();
    assert!(
        d <= 1e-6,
        "features at/after the anchor changed the block logits by {d}"
    );
    let dl = max_abs(&out.loss, &base.loss).unwrap();
    assert!(dl <= 1e-6, "…and the loss by {dl}");
    // (2) different tokens after the anchor (features recomputed from them): same logits
    let mut s3 = s.clone();
    for t in s3.seq.ids.iter_mut().skip(a + 1) {
        *t = (*t + 17) % 250 + 1;
    }
    let f3 = target_features(&lt.target, &td.drafter.target_layer_ids, &s3, false).unwrap();
    let out3 = block_loss(&td.drafter, &lt.target, &s3, &f3, &[a], obj(LossKind::Ce)).unwrap();
    let d = max_abs(&out3.draft_logits, &base.draft_logits).unwrap();
    assert!(
        d <= 1e-6,
        "tokens after the anchor changed the block logits by {d}"
    );
    // (3) the anchor's own feature is not context either
    let bump = Tensor::cat(
        &[
            taps.narrow(0, 0, a).unwrap(),
            (taps.narrow(0, a, 1).unwrap() + 5.0).unwrap(),
            taps.narrow(0, a + 1, l - a - 1).unwrap(),
        ],
        0,
    )
    .unwrap();
    let f4 = dflash_train::loss::Features {
        taps: bump.unsqueeze(0).unwrap(),
        target_logits: None,
    };
    let out4 = block_loss(&td.drafter, &lt.target, &s, &f4, &[a], obj(LossKind::Ce)).unwrap();
    let d = max_abs(&out4.draft_logits, &base.draft_logits).unwrap();
    assert!(d <= 1e-6, "the anchor's own feature leaked by {d}");
}

/// Packing changes no number: two sequences side by side give each sequence's own target
/// features, block logits and loss terms (the pack's loss is their weight-averaged mean).
#[test]
fn packed_rows_equal_their_sequences_alone() {
    let (lt, td) = setup(DType::F32);
    let seqs = vec![sequence(4, 5, 15), sequence(5, 3, 12)];
    let row = &pack(&seqs, &[0, 1], 64)[0];
    assert_eq!(row.segs.starts(), &[0, 20]);
    let taps = &td.drafter.target_layer_ids;
    let fp = target_features(&lt.target, taps, row, true).unwrap();
    let (a0, a1) = (vec![5usize, 9, 17], vec![3usize, 8, 12]);
    let packed_anchors: Vec<usize> = a0
        .iter()
        .copied()
        .chain(a1.iter().map(|a| a + 20))
        .collect();
    let outp = block_loss(
        &td.drafter,
        &lt.target,
        row,
        &fp,
        &packed_anchors,
        obj(LossKind::Kl),
    )
    .unwrap();
    let (mut num, mut den) = (0.0, 0.0);
    let mut logits = Vec::new();
    for (s, (a, off)) in seqs.iter().zip([(&a0, 0usize), (&a1, 20)]) {
        let alone = TrainingRow::single(s.clone());
        let f = target_features(&lt.target, taps, &alone, true).unwrap();
        let n = s.ids.len();
        let d = max_abs(&f.taps, &fp.taps.narrow(1, off, n).unwrap()).unwrap();
        assert!(d < 1e-4, "target features differ by {d}");
        let out = block_loss(&td.drafter, &lt.target, &alone, &f, a, obj(LossKind::Kl)).unwrap();
        num += out.loss.to_scalar::<f32>().unwrap() as f64 * out.weight_sum;
        den += out.weight_sum;
        logits.push(out.draft_logits);
    }
    let d = max_abs(&Tensor::cat(&logits, 0).unwrap(), &outp.draft_logits).unwrap();
    assert!(d < 1e-4, "block logits differ by {d}");
    let want = num / den;
    let got = outp.loss.to_scalar::<f32>().unwrap() as f64;
    assert!(
        (got - want).abs() < 1e-5 * want.abs().max(1.0),
        "loss {got} vs {want}"
    );
    assert!((outp.weight_sum - den).abs() < 1e-9);
}

/// The drafter's written backward (the taped forward, `dflash_model::models::drafter::Tape`)
/// gives every trained weight the gradient candle's autograd gives through the traced forward:
/// f32, a full-attention and a sliding-window layer, attention biases, two sequences packed
/// in one row, and a loss that weights every hidden value.
#[test]
fn the_written_backward_equals_autograd() {
    let (lt, base) = setup(DType::F32);
    let mut cfg = base.drafter.config.clone();
    cfg.layer_types = Some(vec!["full_attention".into(), "sliding_attention".into()]);
    cfg.sliding_window = Some(6);
    cfg.attention_bias = Some(true);
    let mut w = base.weights();
    let dev = candle_core::Device::Cpu;
    for l in 0..2 {
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            let name = format!("layers.{l}.self_attn.{p}");
            let out = w[&format!("{name}.weight")].dim(0).unwrap();
            let b = (Tensor::arange(0f32, out as f32, &dev).unwrap() * (0.3 + l as f64))
                .unwrap()
                .sin()
                .unwrap();
            w.insert(format!("{name}.bias"), (b * 0.2).unwrap());
        }
    }
    let td = TrainableDrafter::new(cfg, &w, &lt.target).unwrap();
    let compared = tape_matches_autograd(&lt, &td);
    assert_eq!(
        compared,
        2 * 15 + 3,
        "weights and biases of 2 layers, fc and 2 norms"
    );
}

/// The same for a DFlash2 drafter: each layer's two dynamic convolutions (kernel 3 over blocks
/// of 4: every shift inside a block) have their backward written out too; the candidate
/// selector is not part of the layers.
#[test]
fn the_written_backward_equals_autograd_through_the_convs() {
    let params = dflash_core::config::Dflash2Params {
        conv_kernel_size: 3,
        conv_group_size: 16,
        selector_rank: 8,
        selector_top_k: 64,
    };
    let (lt, td) = signal_drafter("obj-d2", DType::F32, Some(params));
    let compared = tape_matches_autograd(&lt, &td);
    // 2 layers × (11 weights + 2 convs × 2), fc and 2 norms; the selector has no gradient here
    assert_eq!(compared, 2 * 15 + 3);
}

/// Every parameter's gradient of `Σ hidden ⊙ W` through the taped forward and the written
/// backward against candle's autograd through the traced forward (rel. err ≤ 1e-5), on two
/// sequences packed in one row with four anchors; returns how many were compared (those with
/// a gradient from autograd).
fn tape_matches_autograd(
    lt: &dflash_model::io::loader::LoadedTarget,
    td: &TrainableDrafter,
) -> usize {
    use dflash_model::models::drafter::DraftLayout;
    assert!(td.drafter.tapes());
    let dev = candle_core::Device::Cpu;
    let seqs = [sequence(3, 5, 11), sequence(4, 4, 9)];
    let row = &pack(&seqs, &[0, 1], 29)[0];
    let f = target_features(&lt.target, &td.drafter.target_layer_ids, row, false).unwrap();
    let anchors = [3usize, 9, 17, 22];
    let block = td.drafter.block_size;
    let toks: Vec<u32> = anchors
        .iter()
        .flat_map(|&a| td.drafter.block_tokens(row.seq.ids[a], block))
        .collect();
    let emb = td.drafter.embed_block(&lt.target, &toks).unwrap();
    let layout = DraftLayout::Training {
        segs: &row.segs,
        anchors: &anchors,
        block,
    };
    let h = emb.dim(2).unwrap();
    let weight = Tensor::arange(0f32, (anchors.len() * block * h) as f32, &dev)
        .unwrap()
        .affine(0.013, 0.2)
        .unwrap()
        .cos()
        .unwrap()
        .reshape((1, anchors.len() * block, h))
        .unwrap();
    let autograd = (td.drafter.forward(&f.taps, &emb, layout, None).unwrap() * &weight)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let tape = td.drafter.forward_taped(&f.taps, &emb, layout).unwrap();
    let mut taped = (&tape.hidden * &weight)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let d = taped.remove(&tape.hidden).unwrap();
    tape.backward(&d, &mut taped).unwrap();
    let mut compared = 0;
    for (name, p) in &td.params {
        let Some(want) = autograd.get(p.as_tensor()) else {
            assert!(
                taped.get(p.as_tensor()).is_none(),
                "{name}: a gradient from the tape only"
            );
            continue;
        };
        let got = taped
            .get(p.as_tensor())
            .unwrap_or_else(|| panic!("taped: no gradient for {name}"));
        let e = dflash_model::ops::compare::rel_err(got, want).unwrap();
        assert!(e <= 1e-5, "{name}: rel err {e}");
        compared += 1;
    }
    compared
}

/// The written backward reports each drafter layer as soon as its weights' gradients are final
/// (what the ranks start their sums on): the last layer first, before any layer below it has a
/// gradient, each layer's gradients then as the whole backward leaves them.
#[test]
fn the_written_backward_reports_each_layer_when_it_is_done() {
    let (lt, td) = setup(DType::F32);
    let layers = td.drafter.config.num_hidden_layers;
    assert!(layers >= 2, "the test drafter has {layers} layer(s)");
    let s = TrainingRow::single(sequence(1, 6, 20));
    let f = target_features(&lt.target, &td.drafter.target_layer_ids, &s, false).unwrap();
    let out = block_loss(
        &td.drafter,
        &lt.target,
        &s,
        &f,
        &[6, 9, 14],
        obj(LossKind::Ce),
    )
    .unwrap();
    assert!(out.tape.is_some(), "the drafter trains taped");
    let of_layer = |l: usize| {
        td.params
            .iter()
            .filter(move |(n, _)| n.starts_with(&format!("layers.{l}.")))
    };
    let mut seen = Vec::new();
    let g = out
        .backward_each_over(2.0, &mut |l, g| {
            for below in 0..l {
                for (n, p) in of_layer(below) {
                    assert!(
                        g.get(p.as_tensor()).is_none(),
                        "{n} before layer {l} was done"
                    );
                }
            }
            let snap: Vec<Vec<f32>> = of_layer(l)
                .map(|(_, p)| g.get(p.as_tensor()).unwrap().flatten_all()?.to_vec1())
                .collect::<candle_core::Result<_>>()?;
            seen.push((l, snap));
            Ok(())
        })
        .unwrap();
    let order: Vec<usize> = seen.iter().map(|(l, _)| *l).collect();
    assert_eq!(order, (0..layers).rev().collect::<Vec<_>>());
    for (l, snap) in seen {
        let end: Vec<Vec<f32>> = of_layer(l)
            .map(|(_, p)| {
                g.get(p.as_tensor())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        assert!(
            !end.is_empty() && snap == end,
            "layer {l}'s gradients changed after it reported"
        );
    }
    // the same gradients as the plain backward of loss / 2
    let plain = out.backward_over(2.0).unwrap();
    for (n, p) in &td.params {
        let a = plain.get(p.as_tensor()).unwrap();
        let b = g.get(p.as_tensor()).unwrap();
        assert_eq!(max_abs(a, b).unwrap(), 0.0, "{n}");
    }
}
