//! A random tiny Qwen3.5 hybrid (Gated DeltaNet + gated attention, Hv ≠ Hk, partial RoPE, conv
//! kernel 4) against transformers' torch fallback (tests/reference/hybrid_reference.py): full
//! prefill, prefill + multi-token forward from the cached states, token-by-token decode; the
//! chunked and recurrent paths agree; rollback (accept none / a prefix / all) and tree verify.

use candle_core::{DType, Device, Tensor};
use dflash_core::visibility::{causal, tree};
use dflash_model::io::loader::load_hf_weights;
use dflash_model::{Rows, Target};
use dflash_testkit::*;

fn hybrid(chunk_min_rows: usize) -> Target {
    let (cfg, store) =
        load_hf_weights(&fixtures().join("qwen35-tiny"), DType::F32, &Device::Cpu).unwrap();
    let mut t = Target::load(cfg, &store).unwrap();
    t.gdn_chunk_min_rows = chunk_min_rows;
    t
}
fn reference() -> (
    Vec<u32>,
    Vec<usize>,
    std::collections::HashMap<String, Tensor>,
) {
    let dir = fixtures().join("qwen35-tiny");
    let meta = json(&dir.join("reference.json"));
    let taps = ids(&meta["taps"]).iter().map(|&x| x as usize).collect();
    (
        ids(&meta["ids"]),
        taps,
        load_ref(&dir.join("reference.safetensors")),
    )
}
fn prefill(
    t: &Target,
    toks: &[u32],
    taps: &[usize],
) -> (dflash_model::TargetOutput, dflash_model::KvCache) {
    let mut c = t.new_cache();
    let pos: Vec<usize> = (0..toks.len()).collect();
    let o = t
        .forward(toks, &pos, &causal(0, toks.len()), &mut c, taps, &Rows::All)
        .unwrap();
    (o, c)
}

#[test]
fn full_prefill_matches_transformers_on_both_paths() {
    let (toks, taps, r) = reference();
    assert!(hybrid(64).is_hybrid());
    for chunk_min in [1usize, 1000] {
        // 1: the chunked algorithm (as transformers used for this prefill); 1000: the recurrent one
        let (o, _) = prefill(&hybrid(chunk_min), &toks, &taps);
        let e = rel_err(&o.logits.unwrap(), &r["full.logits"]);
        assert!(e <= 1e-4, "chunk_min {chunk_min}: logits rel err {e}");
        for (i, tap) in o.taps.iter().enumerate() {
            let e = rel_err(tap, &r["full.taps"].get(i).unwrap());
            assert!(e <= 1e-4, "chunk_min {chunk_min}: tap {i} rel err {e}");
        }
    }
}

#[test]
fn cached_multi_token_forward_and_decode_match() {
    let (toks, taps, r) = reference();
    let t = hybrid(8);
    let p = 12;
    // prefill(12) (chunked) then ONE forward of 8 from the cached conv and recurrent states
    // (our recurrent path; transformers ran its chunked one here)
    let (_, mut c) = prefill(&t, &toks[..p], &taps);
    let pos: Vec<usize> = (p..toks.len()).collect();
    let o = t
        .forward(
            &toks[p..],
            &pos,
            &causal(p, toks.len() - p),
            &mut c,
            &taps,
            &Rows::All,
        )
        .unwrap();
    let logits = o.logits.unwrap();
    let e = rel_err(&logits, &r["verify.logits"]);
    assert!(e <= 1e-4, "verify logits rel err {e}");
    for (i, tap) in o.taps.iter().enumerate() {
        assert!(
            rel_err(tap, &r["verify.taps"].get(i).unwrap()) <= 1e-4,
            "verify tap {i}"
        );
    }
    // prefill(N) + forward(M) equals prefill(N + M)
    let (full, _) = prefill(&t, &toks, &taps);
    let d = max_abs(
        &logits,
        &full.logits.unwrap().narrow(0, p, toks.len() - p).unwrap(),
    );
    assert!(d <= 1e-5, "prefill(12)+forward(8) vs prefill(20): {d}");
    // token-by-token decode (the recurrent path)
    let (_, mut c) = prefill(&t, &toks[..p], &taps);
    for (s, i) in (p..toks.len()).enumerate() {
        let o = t
            .forward(
                &toks[i..i + 1],
                &[i],
                &causal(i, 1),
                &mut c,
                &[],
                &Rows::Last,
            )
            .unwrap();
        let e = rel_err(
            &o.logits.unwrap().squeeze(0).unwrap(),
            &r["decode.logits"].get(s).unwrap(),
        );
        assert!(e <= 1e-4, "decode step {s}: rel err {e}");
    }
}

#[test]
fn chunked_and_recurrent_paths_agree_on_a_long_sequence() {
    let toks: Vec<u32> = (0..150u32)
        .map(|i| (i.wrapping_mul(2654435761u32) >> 7) % 256)
        .collect();
    let (a, _) = prefill(&hybrid(1), &toks, &[1]);
    let (b, _) = prefill(&hybrid(100_000), &toks, &[1]);
    let d = max_abs(&a.logits.unwrap(), &b.logits.unwrap());
    assert!(d <= 1e-4, "chunked vs recurrent logits differ by {d}");
    let d = max_abs(&a.taps[0], &b.taps[0]);
    assert!(d <= 1e-4, "chunked vs recurrent taps differ by {d}");
}

#[test]
fn rollback_installs_the_state_after_the_accepted_rows() {
    let (toks, _, _) = reference();
    let t = hybrid(8);
    let p = 12;
    for keep in [1usize, 4, 8] {
        // verify 8 rows, keep `keep` of them (accept none = the anchor only; a prefix; all)
        let (_, mut c) = prefill(&t, &toks[..p], &[]);
        let pos: Vec<usize> = (p..p + 8).collect();
        t.forward(
            &toks[p..p + 8],
            &pos,
            &causal(p, 8),
            &mut c,
            &[],
            &Rows::None,
        )
        .unwrap();
        c.truncate(p + keep).unwrap();
        let next = 77u32;
        let o = t
            .forward(
                &[next],
                &[p + keep],
                &causal(p + keep, 1),
                &mut c,
                &[],
                &Rows::Last,
            )
            .unwrap();
        // reference: prefill of the committed sequence, then the same token
        let seq: Vec<u32> = [&toks[..p + keep], &[next][..]].concat();
        let (want, _) = prefill(&t, &seq, &[]);
        let d = max_abs(
            &o.logits.unwrap(),
            &want.logits.unwrap().narrow(0, seq.len() - 1, 1).unwrap(),
        );
        assert!(d <= 1e-5, "keep {keep}: next-step logits differ by {d}");
    }
    // rolling back past the last forward is refused, not silently wrong
    let (_, mut c) = prefill(&t, &toks[..p], &[]);
    t.forward(
        &toks[p..p + 2],
        &[p, p + 1],
        &causal(p, 2),
        &mut c,
        &[],
        &Rows::None,
    )
    .unwrap();
    assert!(c.truncate(p - 1).is_err());
}

#[test]
fn tree_verify_equals_per_path_forwards_and_compacts() {
    let (toks, _, _) = reference();
    let t = hybrid(8);
    let p = 12;
    // root x → {a, b}, b → {c, d}, d → {e}
    let parents = [None, Some(0), Some(0), Some(2), Some(2), Some(4)];
    let depth = [0usize, 1, 1, 2, 2, 3];
    let nodes: Vec<u32> = vec![toks[p], 11, 12, 13, 14, 15];
    let (_, mut c) = prefill(&t, &toks[..p], &[]);
    let pos: Vec<usize> = depth.iter().map(|d| p + d).collect();
    let o = t
        .forward(&nodes, &pos, &tree(p, &parents), &mut c, &[], &Rows::All)
        .unwrap();
    let logits = o.logits.unwrap();
    for i in 0..nodes.len() {
        let mut path = vec![i];
        while let Some(q) = parents[*path.last().unwrap()] {
            path.push(q);
        }
        path.reverse();
        let seq: Vec<u32> = toks[..p]
            .iter()
            .copied()
            .chain(path.iter().map(|&j| nodes[j]))
            .collect();
        let (want, _) = prefill(&t, &seq, &[]);
        let d = max_abs(
            &logits.narrow(0, i, 1).unwrap(),
            &want.logits.unwrap().narrow(0, seq.len() - 1, 1).unwrap(),
        );
        assert!(
            d <= 1e-5,
            "node {i}: tree logits differ from its path's by {d}"
        );
    }
    // compact to the path x, b, d and continue: equals the prefill of that sequence
    let rows: Vec<usize> = (0..p).chain([p, p + 2, p + 4]).collect();
    c.keep_rows(&rows).unwrap();
    let o = t
        .forward(&[15], &[p + 3], &causal(p + 3, 1), &mut c, &[], &Rows::Last)
        .unwrap();
    let seq: Vec<u32> = toks[..p]
        .iter()
        .copied()
        .chain([nodes[0], 12, 14, 15])
        .collect();
    let (want, _) = prefill(&t, &seq, &[]);
    let d = max_abs(
        &o.logits.unwrap(),
        &want.logits.unwrap().narrow(0, seq.len() - 1, 1).unwrap(),
    );
    assert!(d <= 1e-5, "after compaction: {d}");
    // a kept set that is not a root-to-node path is refused
    let (_, mut c) = prefill(&t, &toks[..p], &[]);
    t.forward(&nodes, &pos, &tree(p, &parents), &mut c, &[], &Rows::None)
        .unwrap();
    let bad: Vec<usize> = (0..p).chain([p, p + 1, p + 3]).collect();
    assert!(c.keep_rows(&bad).is_err());
}

/// A forward from key intervals of one sequence (the batched engine's prefill of a prompt)
/// gives the dense causal forward's logits bit for bit; two left-padded sequences prefilled
/// together into a batched cache give each one's logits alone (their Gated DeltaNet layers start
/// at each one's first real row), and on a one-sequence cache they are refused by name.
#[test]
fn key_interval_forwards_of_a_hybrid_target() {
    let t = hybrid(4);
    let toks: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 256).collect();
    let pos: Vec<usize> = (0..9).collect();
    for split in [0usize, 3] {
        // `split` rows prefilled first, then the rest from intervals / from the causal mask
        let mut c1 = t.new_cache();
        let mut c2 = t.new_cache();
        if split > 0 {
            let head = &toks[..split];
            t.forward_causal(head, &mut c1, &[], &Rows::None).unwrap();
            t.forward_causal(head, &mut c2, &[], &Rows::None).unwrap();
        }
        let n = toks.len() - split;
        let iv: Vec<std::ops::Range<usize>> = (0..n).map(|r| 0..split + r + 1).collect();
        let a = t
            .forward_batch_intervals(
                &toks[split..],
                &pos[split..],
                &[iv],
                &mut c1,
                &[],
                &Rows::All,
            )
            .unwrap();
        let b = t
            .forward_causal(&toks[split..], &mut c2, &[], &Rows::All)
            .unwrap();
        let (a, b) = (a.logits.unwrap(), b.logits.unwrap());
        assert_eq!(max_abs(&a, &b), 0.0, "split {split}");
    }
    // sequences of 9 and 6 tokens, the second left-padded by 3 rows (each padding row sees
    // only itself)
    let short = &toks[3..];
    let tokens: Vec<u32> = toks
        .iter()
        .chain([0u32; 3].iter())
        .chain(short)
        .copied()
        .collect();
    let positions: Vec<usize> = pos
        .iter()
        .chain(&[0; 3])
        .chain(&pos[..6])
        .copied()
        .collect();
    let padded: Vec<std::ops::Range<usize>> = (0..9)
        .map(|r| if r < 3 { r..r + 1 } else { 3..r + 1 })
        .collect();
    let rows = [(0..9).map(|r| 0..r + 1).collect::<Vec<_>>(), padded];
    let mut batched = t.new_batched_cache(2, 16).unwrap();
    let got = t
        .forward_batch_intervals(&tokens, &positions, &rows, &mut batched, &[], &Rows::Last)
        .unwrap()
        .logits
        .unwrap();
    for (s, seq) in [&toks[..], short].iter().enumerate() {
        let alone = t
            .forward_causal(seq, &mut t.new_cache(), &[], &Rows::Last)
            .unwrap();
        let e = rel_err(&got.get(s).unwrap(), &alone.logits.unwrap());
        assert!(e <= 1e-5, "sequence {s}: rel err {e}");
    }
    let e = t
        .forward_batch_intervals(
            &tokens,
            &positions,
            &rows,
            &mut t.new_cache(),
            &[],
            &Rows::Last,
        )
        .err()
        .expect("refused");
    assert!(e.to_string().contains("batched cache"), "{e}");
}
