//! A random tiny Qwen3 built by transformers (tests/reference/target_reference.py): logits,
//! taps and greedy decode must match; mask, cache truncate and keep-rows semantics.

use candle_core::{DType, Device, Tensor};
use dflash_core::visibility::{causal, Visibility};
use dflash_model::io::loader::load_hf_weights;
use dflash_model::{Rows, Target};
use dflash_testkit::*;

fn reference() -> (serde_json::Value, std::collections::HashMap<String, Tensor>) {
    let dir = fixtures().join("qwen3-tiny");
    (
        json(&dir.join("reference.json")),
        load_ref(&dir.join("reference.safetensors")),
    )
}

#[test]
fn logits_and_taps_match_transformers() {
    let t = tiny();
    let (meta, r) = reference();
    let toks = ids(&meta["ids"]);
    let taps: Vec<usize> = ids(&meta["taps"]).iter().map(|&x| x as usize).collect();
    let pos: Vec<usize> = (0..toks.len()).collect();
    let mut cache = t.new_cache();
    let out = t
        .forward(
            &toks,
            &pos,
            &causal(0, toks.len()),
            &mut cache,
            &taps,
            &Rows::All,
        )
        .unwrap();
    let logits = out.logits.unwrap();
    let e = rel_err(&logits, &r["logits"]);
    assert!(e <= 1e-4, "logits rel err {e}");
    for (i, tap) in out.taps.iter().enumerate() {
        let e = rel_err(tap, &r["taps"].get(i).unwrap());
        assert!(e <= 1e-4, "tap {} rel err {e}", taps[i]);
    }
}

#[test]
fn greedy_decode_matches_transformers() {
    let t = tiny();
    let (meta, _) = reference();
    let want = ids(&meta["greedy_ids"]);
    assert_eq!(greedy(&t, &ids(&meta["ids"]), want.len()), want);
}

#[test]
fn prefill_then_decode_equals_one_prefill() {
    let t = tiny();
    let (meta, _) = reference();
    let toks = ids(&meta["ids"]);
    let n = toks.len();
    let mut full = t.new_cache();
    let pos: Vec<usize> = (0..n).collect();
    let want = t
        .forward(&toks, &pos, &causal(0, n), &mut full, &[1], &Rows::All)
        .unwrap();
    let mut c = t.new_cache();
    let k = 7;
    t.forward(
        &toks[..k],
        &pos[..k],
        &causal(0, k),
        &mut c,
        &[1],
        &Rows::All,
    )
    .unwrap();
    let got = t
        .forward(
            &toks[k..],
            &pos[k..],
            &causal(k, n - k),
            &mut c,
            &[1],
            &Rows::All,
        )
        .unwrap();
    let d = max_abs(
        &got.logits.unwrap(),
        &want.logits.unwrap().narrow(0, k, n - k).unwrap(),
    );
    assert!(d <= 1e-5, "logits differ by {d}");
    let d = max_abs(&got.taps[0], &want.taps[0].narrow(0, k, n - k).unwrap());
    assert!(d <= 1e-5, "taps differ by {d}");
    // the caches are the same rows
    let (ka, _) = full.layer(2).unwrap().unwrap();
    let (kb, _) = c.layer(2).unwrap().unwrap();
    assert!(max_abs(&ka, &kb) <= 1e-5);
}

/// A tree over [cache 5 | block 4]: context tokens `toks[..5]`, block `toks[5..]` with
/// parents `[root, 0, 0, 2]` at positions 5, 6, 6, 7.
struct TreeCase {
    toks: Vec<u32>,
    c: usize,
    n: usize,
    parents: [Option<usize>; 4],
    vis: Visibility,
    block_pos: [usize; 4],
}

fn tree_case() -> TreeCase {
    let parents = [None, Some(0), Some(0), Some(2)];
    TreeCase {
        toks: vec![5, 17, 99, 3, 250, 7, 42, 42, 8],
        c: 5,
        n: 4,
        parents,
        vis: dflash_core::visibility::tree(5, &parents),
        block_pos: [5, 6, 6, 7],
    }
}

#[test]
fn additive_mask_equals_rows_done_separately() {
    // An arbitrary (tree-like) mask over [cache 5 | block 4]: each row must equal a forward of
    // exactly the keys it sees, in order, at the same positions.
    let t = tiny();
    let TreeCase {
        toks,
        c,
        n,
        vis,
        block_pos,
        ..
    } = tree_case();
    let mut cache = t.new_cache();
    let ctx_pos: Vec<usize> = (0..c).collect();
    t.forward(
        &toks[..c],
        &ctx_pos,
        &causal(0, c),
        &mut cache,
        &[],
        &Rows::None,
    )
    .unwrap();
    let out = t
        .forward(&toks[c..], &block_pos, &vis, &mut cache, &[3], &Rows::All)
        .unwrap();
    let logits = out.logits.unwrap();
    for r in 0..n {
        // the visible keys of row r, as a plain causal sequence
        let seen: Vec<usize> = (0..c + n).filter(|&k| vis.get(r, k)).collect();
        let seq: Vec<u32> = seen.iter().map(|&k| toks[k]).collect();
        let pos: Vec<usize> = seen
            .iter()
            .map(|&k| if k < c { k } else { block_pos[k - c] })
            .collect();
        let mut fresh = t.new_cache();
        let o = t
            .forward(
                &seq,
                &pos,
                &causal(0, seq.len()),
                &mut fresh,
                &[3],
                &Rows::Last,
            )
            .unwrap();
        let d = max_abs(&o.logits.unwrap(), &logits.narrow(0, r, 1).unwrap());
        assert!(d <= 1e-5, "row {r} differs by {d}");
    }
}

/// On the CPU in f32, a tree verify row's logits are bit-identical to those of the AR step
/// that decodes the same tokens (`row_attention`: each row over its own keys in order;
/// `panels`: a row's products the same alone and in a block), so a verify never disagrees
/// with AR over a rounding difference.
#[test]
fn tree_rows_equal_ar_steps_bit_for_bit() {
    let t = tiny();
    let TreeCase {
        toks,
        c,
        n,
        parents,
        vis,
        block_pos,
    } = tree_case();
    let ctx_pos: Vec<usize> = (0..c).collect();
    let prefill = |cache: &mut dflash_model::KvCache| {
        t.forward(&toks[..c], &ctx_pos, &causal(0, c), cache, &[], &Rows::None)
            .unwrap();
    };
    let mut cache = t.new_cache();
    prefill(&mut cache);
    let tree = t
        .forward(&toks[c..], &block_pos, &vis, &mut cache, &[], &Rows::All)
        .unwrap()
        .logits
        .unwrap();
    for r in 0..n {
        // the path root → r, decoded one AR step at a time after the same prefill
        let mut path = vec![r];
        while let Some(p) = parents[*path.last().unwrap()] {
            path.push(p);
        }
        path.reverse();
        let mut ar = t.new_cache();
        prefill(&mut ar);
        let mut last = None;
        for (i, &node) in path.iter().enumerate() {
            last = t
                .forward(
                    &[toks[c + node]],
                    &[c + i],
                    &causal(c + i, 1),
                    &mut ar,
                    &[],
                    &Rows::Last,
                )
                .unwrap()
                .logits;
        }
        let want: Vec<f32> = last.unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let got: Vec<f32> = tree
            .narrow(0, r, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, want, "row {r}");
    }
}

/// A draft head over a vocabulary subset gives, for each of its tokens, the full LM head's
/// logit bit for bit.
#[test]
fn draft_head_columns_equal_the_full_lm_heads() {
    use dflash_model::models::draft_vocab::{DraftHead, DraftVocab};
    let t = tiny();
    let h = Tensor::arange(0f32, (3 * t.config.hidden_size) as f32, &Device::Cpu)
        .unwrap()
        .affine(0.01, -0.5)
        .unwrap()
        .sin()
        .unwrap()
        .reshape((1, 3, t.config.hidden_size))
        .unwrap();
    let ids = vec![0u32, 3, 17, 100, (t.config.vocab_size - 1) as u32];
    let v = DraftVocab {
        token_ids: ids.clone(),
        source: "test".into(),
        coverage: None,
    };
    let head = DraftHead::new(&t, &v).unwrap();
    let full = t
        .lm_head(&h)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let sub = head
        .logits(&t, &h)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (r, row) in sub.iter().enumerate() {
        for (j, &x) in row.iter().enumerate() {
            assert_eq!(
                x.to_bits(),
                full[r][ids[j] as usize].to_bits(),
                "row {r} token {}",
                ids[j]
            );
            assert_eq!(head.token(j as u32), ids[j]);
        }
    }
    // on the device: columns to tokens, and rows over the columns spread over the vocabulary
    let cols = Tensor::new(&[4u32, 0, 2], &Device::Cpu).unwrap();
    let toks = head.tokens_of(&cols).unwrap().to_vec1::<u32>().unwrap();
    assert_eq!(toks, vec![ids[4], ids[0], ids[2]]);
    let rows = Tensor::new(&[[0.1f32, 0.2, 0.3, 0.15, 0.25]], &Device::Cpu).unwrap();
    let dense = head.spread(&rows).unwrap().to_vec2::<f32>().unwrap();
    let mut want = vec![0.0f32; t.config.vocab_size];
    for (j, &id) in ids.iter().enumerate() {
        want[id as usize] = [0.1, 0.2, 0.3, 0.15, 0.25][j];
    }
    assert_eq!(dense, vec![want]);
    let bad = DraftVocab {
        token_ids: vec![t.config.vocab_size as u32],
        ..v
    };
    assert!(DraftHead::new(&t, &bad).is_err());
}

#[test]
fn truncate_and_keep_rows() {
    let t = tiny();
    let toks: Vec<u32> = (0..10).map(|i| (i * 23 % 256) as u32).collect();
    let pos: Vec<usize> = (0..10).collect();
    let mut a = t.new_cache();
    t.forward(&toks, &pos, &causal(0, 10), &mut a, &[], &Rows::None)
        .unwrap();
    // truncate(6) == prefill of 6
    let mut b = a.clone();
    b.truncate(6).unwrap();
    let mut six = t.new_cache();
    t.forward(
        &toks[..6],
        &pos[..6],
        &causal(0, 6),
        &mut six,
        &[],
        &Rows::None,
    )
    .unwrap();
    assert_eq!(b.len(), 6);
    assert!(
        max_abs(
            &b.layer(0).unwrap().unwrap().0,
            &six.layer(0).unwrap().unwrap().0
        ) <= 1e-6
    );
    // keep_rows selects exactly those rows, in order
    let mut k = a.clone();
    k.keep_rows(&[0, 1, 2, 5, 9]).unwrap();
    let (full_k, _) = a.layer(1).unwrap().unwrap();
    let idx = Tensor::new(&[0u32, 1, 2, 5, 9], &Device::Cpu).unwrap();
    let want = full_k.contiguous().unwrap().index_select(&idx, 2).unwrap();
    assert_eq!(max_abs(&k.layer(1).unwrap().unwrap().0, &want), 0.0);
    assert!(
        k.keep_rows(&[7]).is_err(),
        "row past the length must be refused"
    );
    // appending after keep_rows continues from the compacted length
    let out = t.forward(&[1], &[5], &causal(5, 1), &mut k, &[], &Rows::Last);
    assert!(out.is_ok());
    assert_eq!(k.len(), 6);
}

#[test]
fn bad_mask_shape_is_an_error() {
    let t = tiny();
    let mut cache = t.new_cache();
    let err = t
        .forward(
            &[1, 2],
            &[0, 1],
            &Visibility::new(2, 3),
            &mut cache,
            &[],
            &Rows::Last,
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("mask is 2x3"), "{err}");
    let err = t
        .forward(&[1], &[0], &causal(0, 1), &mut cache, &[9], &Rows::Last)
        .err()
        .unwrap();
    assert!(err.to_string().contains("tap 9"), "{err}");
}

#[test]
fn vision_language_wrapper_loads_the_text_model_and_reports_the_rest() {
    // text weights under model.language_model.*, config under text_config, a vision tower beside
    let src = fixtures().join("qwen3-tiny");
    let d = std::env::temp_dir().join(format!("dflash-vlm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let cfg = serde_json::json!({"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "text_config": text});
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let w = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut wrapped: std::collections::HashMap<String, Tensor> = w
        .into_iter()
        .map(|(k, v)| (k.replacen("model.", "model.language_model.", 1), v))
        .collect();
    wrapped.insert(
        "model.visual.patch_embed.weight".into(),
        Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&wrapped, d.join("model.safetensors")).unwrap();
    let (cfg, store) = load_hf_weights(&d, DType::F32, &Device::Cpu).unwrap();
    let t = Target::load(cfg, &store).unwrap();
    assert_eq!(
        t.ignored_tensors,
        vec!["model.visual.patch_embed.weight".to_string()]
    );
    // and it computes what the plain checkpoint computes
    let plain = tiny();
    let toks = [3u32, 1, 4, 1, 5];
    let pos: Vec<usize> = (0..5).collect();
    let a = t
        .forward(
            &toks,
            &pos,
            &causal(0, 5),
            &mut t.new_cache(),
            &[],
            &Rows::Last,
        )
        .unwrap();
    let b = plain
        .forward(
            &toks,
            &pos,
            &causal(0, 5),
            &mut plain.new_cache(),
            &[],
            &Rows::Last,
        )
        .unwrap();
    assert_eq!(max_abs(&a.logits.unwrap(), &b.logits.unwrap()), 0.0);
}

/// A batched forward (two right-aligned sequences of different lengths in one batched cache,
/// then one step each) gives each sequence the logits and taps it gets alone; the batch
/// anchors to the transformers reference through `logits_and_taps_match_transformers`.
#[test]
fn batched_forward_equals_each_sequence_alone() {
    use dflash_core::visibility::right_aligned;
    let t = tiny();
    let (meta, _) = reference();
    let toks = ids(&meta["ids"]);
    let seqs = [toks[..9].to_vec(), toks[3..8].to_vec()];
    let p = 9;
    // prefill: sequence 1 left-padded by 4
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    let mut masks = Vec::new();
    for s in &seqs {
        let pad = p - s.len();
        tokens.extend(std::iter::repeat_n(s[0], pad).chain(s.iter().copied()));
        positions.extend(std::iter::repeat_n(0, pad).chain(0..s.len()));
        masks.push(right_aligned(0, 0, s.len(), p));
    }
    let mut cache = t.new_cache();
    let pre = t
        .forward_batch(&tokens, &positions, &masks, &mut cache, &[1], &Rows::Last)
        .unwrap();
    // one step: each sequence feeds one more token at its own position
    let next = [17u32, 99];
    let masks: Vec<Visibility> = seqs
        .iter()
        .map(|s| right_aligned(s.len(), p, 1, 1))
        .collect();
    let positions: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
    let step = t
        .forward_batch(&next, &positions, &masks, &mut cache, &[1], &Rows::Last)
        .unwrap();
    for (i, s) in seqs.iter().enumerate() {
        let mut c = t.new_cache();
        let pos: Vec<usize> = (0..s.len()).collect();
        let a = t
            .forward(s, &pos, &causal(0, s.len()), &mut c, &[1], &Rows::Last)
            .unwrap();
        let b = t
            .forward(
                &[next[i]],
                &[s.len()],
                &causal(s.len(), 1),
                &mut c,
                &[1],
                &Rows::Last,
            )
            .unwrap();
        let pick = |x: &Tensor| x.get(i).unwrap();
        let pad = p - s.len();
        for (got, want) in [
            (
                pick(pre.logits.as_ref().unwrap()),
                a.logits.clone().unwrap(),
            ),
            (
                pick(step.logits.as_ref().unwrap()),
                b.logits.clone().unwrap(),
            ),
            (
                pick(&pre.taps[0]).narrow(0, pad, s.len()).unwrap(),
                a.taps[0].clone(),
            ),
            (pick(&step.taps[0]), b.taps[0].clone()),
        ] {
            let e = rel_err(&got, &want);
            assert!(e <= 1e-5, "sequence {i}: rel err {e}");
        }
    }
}
