//! The tiny Qwen3's fixed-shape forwards (the layouts a CUDA graph captures): `prepare` then
//! `forward_prepared`, the fixed-capacity cache layout, `GraphedForward` and `GraphedBatch`,
//! each against the plain forward (which `qwen3_tiny.rs` anchors to transformers).

use candle_core::Tensor;
use dflash_core::visibility::causal;
use dflash_model::Rows;
use dflash_testkit::*;

/// The split a CUDA graph captures: `prepare` (host copies) then `forward_prepared` (device
/// work) gives `forward`'s logits bit for bit, and inputs prepared for another cache length
/// are refused by name instead of attending over the wrong columns.
#[test]
fn prepared_forward_equals_forward_and_refuses_another_cache_length() {
    let t = tiny();
    let mut a = t.new_cache();
    let mut b = t.new_cache();
    t.forward_causal(&[3, 4, 5], &mut a, &[], &Rows::None)
        .unwrap();
    t.forward_causal(&[3, 4, 5], &mut b, &[], &Rows::None)
        .unwrap();
    let whole = t
        .forward(&[6, 7], &[3, 4], &causal(3, 2), &mut a, &[0], &Rows::All)
        .unwrap();
    let inputs = t
        .prepare(&[6, 7], &[3, 4], &[causal(3, 2)], 3, None)
        .unwrap();
    let split = t
        .forward_prepared(&inputs, &mut b, &[0], &Rows::All)
        .unwrap();
    let v = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(
        v(whole.logits.as_ref().unwrap()),
        v(split.logits.as_ref().unwrap())
    );
    assert_eq!(v(&whole.taps[0]), v(&split.taps[0]));
    assert_eq!(b.len(), 5);
    let err = t
        .forward_prepared(&inputs, &mut b, &[], &Rows::All)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("prepared for a 3-row cache"),
        "{err}"
    );
}

/// The fixed layout (`prepare` with a capacity: K/V written through a device index into a cache of
/// exactly `cap` rows, attention over all of them with the extra columns masked) gives the
/// append layout's logits, taps and cache rows; and its limits are named.
#[test]
fn fixed_layout_forward_equals_append_forward() {
    let t = tiny();
    let meta = json(&fixtures().join("qwen3-tiny/reference.json"));
    let toks = ids(&meta["ids"]);
    let (k, n) = (7, toks.len() - 7);
    let pos: Vec<usize> = (0..toks.len()).collect();
    let mut a = t.new_cache();
    let mut f = t.new_cache();
    for c in [&mut a, &mut f] {
        t.forward_causal(&toks[..k], c, &[], &Rows::None).unwrap();
    }
    let cap = toks.len() + 5;
    f.reserve_exact(cap).unwrap();
    let want = t
        .forward(
            &toks[k..],
            &pos[k..],
            &causal(k, n),
            &mut a,
            &[1],
            &Rows::All,
        )
        .unwrap();
    let inputs = t
        .prepare(&toks[k..], &pos[k..], &[causal(k, n)], k, Some(cap))
        .unwrap();
    let got = t
        .forward_prepared(&inputs, &mut f, &[1], &Rows::All)
        .unwrap();
    let d = max_abs(&got.logits.unwrap(), &want.logits.unwrap());
    assert!(d <= 1e-5, "logits differ by {d}");
    assert!(max_abs(&got.taps[0], &want.taps[0]) <= 1e-5);
    assert_eq!(f.len(), a.len());
    for layer in 0..2 {
        let (ka, va) = a.layer(layer).unwrap().unwrap();
        let (kf, vf) = f.layer(layer).unwrap().unwrap();
        assert!(max_abs(&ka, &kf) <= 1e-6 && max_abs(&va, &vf) <= 1e-6);
    }
    // past the capacity, and a cache of another capacity, are refused by name
    let err = t
        .prepare(&[1, 2], &[k, k + 1], &[causal(k, 2)], k, Some(k + 1))
        .err()
        .unwrap();
    assert!(err.to_string().contains("capacity of 8 rows"), "{err}");
    let mut small = t.new_cache();
    t.forward_causal(&toks[..k], &mut small, &[], &Rows::None)
        .unwrap();
    let one = t
        .prepare(&[1], &[k], &[causal(k, 1)], k, Some(cap))
        .unwrap();
    let err = t
        .forward_prepared(&one, &mut small, &[], &Rows::All)
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("reserve_exact first"),
        "{err:#}"
    );
}

/// AR through `GraphedForward` (on the CPU: the fixed layout on one set of input buffers,
/// rewritten in place every step, as a GPU graph replay reads them) equals plain greedy AR,
/// and the buffers are reused (one slot for n = 1).
#[test]
fn graphed_forward_decodes_like_plain_ar() {
    use dflash_model::cuda::graphed::GraphedForward;
    let t = tiny();
    let meta = json(&fixtures().join("qwen3-tiny/reference.json"));
    let prompt = ids(&meta["ids"]);
    let steps = 12;
    let want = greedy(&t, &prompt, steps);
    let mut cache = t.new_cache();
    let o = t
        .forward_causal(&prompt, &mut cache, &[], &Rows::Last)
        .unwrap();
    let first = |o: &dflash_model::TargetOutput, row: usize| -> u32 {
        let l = o.logits.as_ref().unwrap();
        let r = l.get(l.dim(0).unwrap() - 1 - row).unwrap();
        dflash_core::sampling::argmax(&r.to_vec1::<f32>().unwrap())
    };
    let mut got = vec![first(&o, 0)];
    let mut g = GraphedForward::new(&mut cache, prompt.len() + steps, 1).unwrap();
    while got.len() < steps {
        let c = cache.len();
        let o = g
            .forward(
                &t,
                &[*got.last().unwrap()],
                &[c],
                &causal(c, 1),
                &mut cache,
                &[],
            )
            .unwrap();
        got.push(first(&o, 0));
    }
    assert_eq!(got, want);
    assert_eq!(g.captured_rows(), vec![1]);
    assert_eq!(g.eager_calls, 0);
}

/// Forwards shorter than `pad_to` run padded to it (padding rows that only see the cache
/// and themselves; for chains, padding that continues the chain and each row's interval of
/// keys instead of the mask) and give the unpadded forward's logits, taps and cache length:
/// one slot serves every verify length of a decoding loop.
#[test]
fn graphed_forward_pads_short_forwards_to_one_shape() {
    for chains in [false, true] {
        pad_short_forwards(chains);
    }
}

fn pad_short_forwards(chains: bool) {
    use dflash_model::cuda::graphed::GraphedForward;
    let t = tiny();
    let meta = json(&fixtures().join("qwen3-tiny/reference.json"));
    let prompt = ids(&meta["ids"]);
    let mut plain = t.new_cache();
    let mut fixed = t.new_cache();
    for c in [&mut plain, &mut fixed] {
        t.forward_causal(&prompt, c, &[], &Rows::None).unwrap();
    }
    let g = GraphedForward::new(&mut fixed, prompt.len() + 20, 6).unwrap();
    let mut g = if chains { g.chains() } else { g };
    for n in [6usize, 4, 1, 3] {
        let c = plain.len();
        let toks: Vec<u32> = (0..n as u32).map(|i| 7 + 11 * i).collect();
        let pos: Vec<usize> = (c..c + n).collect();
        let want = t
            .forward(&toks, &pos, &causal(c, n), &mut plain, &[1], &Rows::All)
            .unwrap();
        let got = g
            .forward(&t, &toks, &pos, &causal(c, n), &mut fixed, &[1])
            .unwrap();
        let (gl, wl) = (got.logits.unwrap(), want.logits.unwrap());
        assert_eq!(gl.dims(), wl.dims(), "{n} rows");
        assert!(max_abs(&gl, &wl) <= 1e-5, "{n} rows");
        assert!(max_abs(&got.taps[0], &want.taps[0]) <= 1e-5, "{n} rows");
        assert_eq!(fixed.len(), plain.len(), "{n} rows");
    }
    assert_eq!(g.captured_rows(), vec![6]);
    assert_eq!(g.eager_calls, 0, "chains {chains}");
    // no tokens, or a mask of another shape, is an error, not a panic
    let c = fixed.len();
    let err = g
        .forward(&t, &[], &[], &causal(c, 0), &mut fixed, &[1])
        .err()
        .unwrap();
    assert!(err.to_string().contains("a forward of 0 tokens"), "{err}");
    let err = g
        .forward(&t, &[1, 2], &[c, c + 1], &causal(c, 3), &mut fixed, &[1])
        .err()
        .unwrap();
    assert!(err.to_string().contains("needs a 2x"), "{err}");
}

/// `GraphedBatch`'s steps: logits of the plain batched forward (two sequences, right-aligned),
/// and a cache reallocated under it (its captured buffers gone) refused by name; a prefill
/// from key intervals equals the one from dense masks bit for bit.
#[test]
fn graphed_batch_steps_like_the_plain_batched_forward() {
    use dflash_core::visibility::{right_aligned, right_aligned_rows};
    use dflash_model::cuda::graphed::GraphedBatch;
    let t = tiny();
    let prefill = |c: &mut dflash_model::KvCache| {
        // sequence 0 holds 3 rows, sequence 1 holds 2 (left-padded)
        t.forward_batch(
            &[3, 4, 5, 3, 8, 9],
            &[0, 1, 2, 0, 0, 1],
            &[right_aligned(0, 0, 3, 3), right_aligned(0, 0, 2, 3)],
            c,
            &[],
            &Rows::None,
        )
        .unwrap();
    };
    let (mut plain, mut fixed) = (
        t.new_batched_cache(2, 8).unwrap(),
        t.new_batched_cache(2, 8).unwrap(),
    );
    prefill(&mut plain);
    prefill(&mut fixed);
    // the same prefill from key intervals gives the same logits and cache, bit for bit
    let mut third = t.new_batched_cache(2, 8).unwrap();
    let dense = t
        .forward_batch(
            &[3, 4, 5, 3, 8, 9],
            &[0, 1, 2, 0, 0, 1],
            &[right_aligned(0, 0, 3, 3), right_aligned(0, 0, 2, 3)],
            &mut t.new_batched_cache(2, 8).unwrap(),
            &[],
            &Rows::All,
        )
        .unwrap();
    let iv: Vec<_> = [3, 2]
        .iter()
        .map(|&f| right_aligned_rows(0, 0, f, 3).unwrap())
        .collect();
    let sparse = t
        .forward_batch_intervals(
            &[3, 4, 5, 3, 8, 9],
            &[0, 1, 2, 0, 0, 1],
            &iv,
            &mut third,
            &[],
            &Rows::All,
        )
        .unwrap();
    let (a, b) = (dense.logits.unwrap(), sparse.logits.unwrap());
    assert_eq!(dflash_model::ops::compare::max_abs(&a, &b).unwrap(), 0.0);
    let (kp, _) = plain.layer(0).unwrap().unwrap();
    let (k3, _) = third.layer(0).unwrap().unwrap();
    assert_eq!(dflash_model::ops::compare::max_abs(&kp, &k3).unwrap(), 0.0);
    let mut g = GraphedBatch::new(&mut fixed, 16).unwrap();
    let (mut held, mut toks) = ([3usize, 2], [6u32, 7]);
    // the step's key intervals, from the rule the dense masks come from
    let rows = |held: [usize; 2], n: usize| -> Vec<Vec<std::ops::Range<usize>>> {
        held.iter()
            .map(|&h| right_aligned_rows(h, n, 1, 1).unwrap())
            .collect()
    };
    for _ in 0..3 {
        let n = plain.len();
        let masks = [
            right_aligned(held[0], n, 1, 1),
            right_aligned(held[1], n, 1, 1),
        ];
        let want = t
            .forward_batch(&toks, &held, &masks, &mut plain, &[], &Rows::All)
            .unwrap()
            .logits
            .unwrap()
            .squeeze(1)
            .unwrap();
        let got = g
            .step(&t, &toks, &held, &rows(held, n), &mut fixed)
            .unwrap();
        assert!(dflash_model::ops::compare::max_abs(&got, &want).unwrap() < 1e-5);
        held = [held[0] + 1, held[1] + 1];
        toks = [toks[0] + 1, toks[1] + 1];
    }
    fixed.grow_front(20).unwrap(); // past the 16 columns: new buffers
    let n = fixed.len();
    let e = g
        .step(&t, &toks, &held, &rows(held, n), &mut fixed)
        .unwrap_err();
    assert!(e.to_string().contains("reallocated"), "{e}");
}

/// Key intervals that do not fit the forward are refused by name: another number of rows per
/// sequence, an interval past the columns.
#[test]
#[allow(clippy::single_range_in_vec_init)] // one row, one interval
fn key_interval_forwards_check_their_rows() {
    let t = tiny();
    let e = t
        .prepare_intervals(&[3, 4], &[0, 1], &[vec![0..1]], 0, None)
        .err()
        .expect("refused");
    assert!(
        e.to_string()
            .contains("1 key intervals for a sequence of 2"),
        "{e}"
    );
    let e = t
        .prepare_intervals(&[3, 4], &[0, 1], &[vec![0..1, 0..3]], 0, None)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("does not lie in 2 columns"), "{e}");
}

/// The draft block's fixed-shape forward (what `GraphedDraft` captures: context rows padded
/// to the block, K/V written through an index into a cache of exactly `cap` rows, the rule's
/// mask moved to those columns) drafts what the eager draft drafts, round after round, for
/// full-attention and sliding-window drafters; rounds it cannot take (the prompt's context
/// rows, another block) run eagerly on the same buffers.
#[test]
fn graphed_draft_drafts_like_the_eager_draft() {
    use dflash_model::cuda::graphed_draft::GraphedDraft;
    use dflash_model::models::drafter::{BlockAt, Drafter};
    let t = tiny();
    for name in ["quiet", "sliding"] {
        let d = Drafter::load_dir(&fixtures().join("dflash-tiny").join(name), &t).unwrap();
        let prompt = loop_prompt();
        let mut cache = t.new_cache();
        let out = t
            .forward_causal(&prompt, &mut cache, &d.target_layer_ids, &Rows::None)
            .unwrap();
        let taps = dflash_model::Target::concat_taps(&out.taps)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let (block, cap) = (d.block_size, 128);
        let mut eager = d.new_cache();
        let mut fixed = d.new_cache();
        let mut g = GraphedDraft::new(&mut fixed, cap, block).unwrap();
        // (context rows this round, block): the prompt, then rounds as a decoding loop
        // commits them, one with a shorter block (a generation's last), then back
        let rounds = [
            (prompt.len(), block),
            (3, block),
            (1, block),
            (block, block),
            (5, 7),
            (2, block),
        ];
        let mut anchor = 0;
        for (i, &(m, b)) in rounds.iter().enumerate() {
            let rows = taps.narrow(1, i % 4, m.min(prompt.len() - 4)).unwrap();
            let rows = if m > rows.dim(1).unwrap() {
                Tensor::cat(
                    &[&rows, &taps.narrow(1, 0, m - rows.dim(1).unwrap()).unwrap()],
                    1,
                )
                .unwrap()
            } else {
                rows
            };
            anchor += m;
            let at = BlockAt {
                token: 7 + i as u32,
                anchor,
                block: b,
                positions: b - 1,
            };
            let (he, le) = d.draft_rows(&t, None, &mut eager, &rows, at).unwrap();
            let (hf, lf) = g.draft_rows(&d, &t, None, &mut fixed, &rows, at).unwrap();
            for (x, y, what) in [(&hf, &he, "hidden"), (&lf, &le, "logits")] {
                let e = dflash_model::ops::compare::rel_err(x, y).unwrap();
                assert!(e <= 1e-5, "{name} round {i}: {what} rel err {e}");
            }
            assert_eq!(fixed.len(), eager.len(), "{name} round {i}: cache rows");
            assert_eq!(fixed.len(), anchor);
        }
        assert_eq!(
            g.eager_calls, 2,
            "{name}: the prompt's round and the short block"
        );
        assert!(g.captured());
    }
}
