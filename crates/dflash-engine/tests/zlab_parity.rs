//! The drafter and the chain loop against z-lab's own package (tests/reference/dflash_reference.py):
//! (a) block forwards without and with the draft KV cache; (b) greedy `dflash_generate`
//! round by round; and the training (many blocks + mask) vs inference (one block + cache) path.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use dflash_model::io::loader::load_hf_weights;
use dflash_model::models::drafter::{BlockAt, DraftLayout, Drafter};
use dflash_model::Target;
use dflash_testkit::{fixtures, max_abs, prefill_taps, rel_err, replay_zlab_generation};

fn target() -> Target {
    let (cfg, store) =
        load_hf_weights(&fixtures().join("qwen3-tiny"), DType::F32, &Device::Cpu).unwrap();
    Target::load(cfg, &store).unwrap()
}
fn drafter(t: &Target, name: &str) -> Drafter {
    Drafter::load_dir(&fixtures().join("dflash-tiny").join(name), t).unwrap()
}
fn reference() -> (serde_json::Value, HashMap<String, Tensor>) {
    let dir = fixtures().join("dflash-tiny");
    let meta = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
        .unwrap();
    (
        meta,
        candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap(),
    )
}
fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
fn ctx_taps(t: &Target, d: &Drafter, tokens: &[u32]) -> Tensor {
    prefill_taps(t, &d.target_layer_ids, tokens)
}

#[test]
fn block_forward_matches_zlab() {
    let t = target();
    let (meta, r) = reference();
    for name in ["full", "sliding", "quiet"] {
        let d = drafter(&t, name);
        let case = &meta["cases"][name];
        let ctx_ids = ids(&case["ctx_ids"]);
        let taps = ctx_taps(&t, &d, &ctx_ids);
        let e = rel_err(&taps, &r[&format!("{name}.nocache.ctx")]);
        assert!(e <= 1e-4, "{name}: context taps rel err {e}");
        // no cache: context 0..12, anchor 12
        let block = ids(&case["nocache_block"]);
        assert_eq!(block, d.block_tokens(block[0], block.len()), "block layout");
        let mut cache = d.new_cache();
        let logits = d
            .draft(
                &t,
                None,
                &mut cache,
                &taps.unsqueeze(0).unwrap(),
                BlockAt {
                    token: block[0],
                    anchor: 12,
                    block: block.len(),
                    positions: block.len() - 1,
                },
            )
            .unwrap();
        let e = rel_err(&logits, &r[&format!("{name}.nocache.logits")]);
        assert!(e <= 1e-4, "{name}: draft logits rel err {e}");
        assert_eq!(cache.len(), 12, "the draft cache keeps the context only");
        if name == "sliding" {
            continue;
        }
        // with a cache: round 1 context 0..8 (anchor 8), round 2 context 8..12 (anchor 12)
        let mut cache = d.new_cache();
        let b1 = ids(&case["cache1_block"]);
        let l1 = d
            .draft(
                &t,
                None,
                &mut cache,
                &taps.narrow(0, 0, 8).unwrap().unsqueeze(0).unwrap(),
                BlockAt {
                    token: b1[0],
                    anchor: 8,
                    block: 8,
                    positions: 7,
                },
            )
            .unwrap();
        let e = rel_err(&l1, &r[&format!("{name}.cache1.logits")]);
        assert!(e <= 1e-4, "{name}: cached round 1 rel err {e}");
        let b2 = ids(&case["cache2_block"]);
        let l2 = d
            .draft(
                &t,
                None,
                &mut cache,
                &taps.narrow(0, 8, 4).unwrap().unsqueeze(0).unwrap(),
                BlockAt {
                    token: b2[0],
                    anchor: 12,
                    block: 8,
                    positions: 7,
                },
            )
            .unwrap();
        let e = rel_err(&l2, &r[&format!("{name}.cache2.logits")]);
        assert!(e <= 1e-4, "{name}: cached round 2 rel err {e}");
    }
}

/// A draft of fewer positions than the block's runs the last layer on those rows alone
/// (`LastRows`): its logits are still z-lab's rows of the whole block, and the draft cache it
/// leaves drafts the next round as the whole block's would.
#[test]
fn fewer_positions_give_zlabs_first_rows() {
    let t = target();
    let (meta, r) = reference();
    for name in ["full", "sliding", "quiet"] {
        let d = drafter(&t, name);
        let case = &meta["cases"][name];
        let taps = ctx_taps(&t, &d, &ids(&case["ctx_ids"]));
        let block = ids(&case["nocache_block"]);
        let want = &r[&format!("{name}.nocache.logits")];
        for p in [1, 3, block.len() - 2] {
            let mut cache = d.new_cache();
            let at = BlockAt {
                token: block[0],
                anchor: 12,
                block: block.len(),
                positions: p,
            };
            let l = d
                .draft(&t, None, &mut cache, &taps.unsqueeze(0).unwrap(), at)
                .unwrap();
            assert_eq!(l.dim(0).unwrap(), p, "{name}: rows for {p} positions");
            let e = rel_err(&l, &want.narrow(0, 0, p).unwrap());
            assert!(e <= 1e-4, "{name}, {p} positions: draft logits rel err {e}");
            assert_eq!(
                cache.len(),
                12,
                "{name}: the draft cache keeps the context only"
            );
        }
        if name == "sliding" {
            continue;
        }
        // two cached rounds of 2 then 3 positions against z-lab's whole blocks
        let mut cache = d.new_cache();
        for (i, (from, m, anchor, p)) in [(0, 8, 8, 2), (8, 4, 12, 3)].into_iter().enumerate() {
            let b = ids(&case[&format!("cache{}_block", i + 1)]);
            let at = BlockAt {
                token: b[0],
                anchor,
                block: 8,
                positions: p,
            };
            let ctx = taps.narrow(0, from, m).unwrap().unsqueeze(0).unwrap();
            let l = d.draft(&t, None, &mut cache, &ctx, at).unwrap();
            let want = r[&format!("{name}.cache{}.logits", i + 1)]
                .narrow(0, 0, p)
                .unwrap();
            let e = rel_err(&l, &want);
            assert!(e <= 1e-4, "{name}: cached round {} rel err {e}", i + 1);
        }
    }
}

#[test]
fn greedy_generation_matches_zlab_round_by_round() {
    let t = target();
    let (meta, _) = reference();
    for name in ["full", "quiet"] {
        let d = drafter(&t, name);
        let g = &meta["cases"][name]["generate"];
        let (prompt, out, want_acc) = replay_zlab_generation(&t, &d, g, name);
        // the drafted tokens of every round: verify block = [anchor, drafts…]
        let blocks = g["verify_blocks"].as_array().unwrap();
        assert_eq!(blocks.len(), out.rounds.len());
        let mut anchor_pos = prompt.len();
        let all: Vec<u32> = [prompt.clone(), out.new_tokens.clone()].concat();
        for (i, (b, r)) in blocks.iter().zip(&out.rounds).enumerate() {
            let b = ids(b);
            assert_eq!(b[0], all[anchor_pos], "{name}: round {i} anchor");
            assert_eq!(b.len() - 1, r.drafted, "{name}: round {i} block size");
            anchor_pos += r.tau_round;
        }
        if name == "quiet" {
            assert!(
                want_acc.iter().any(|&a| a > 2),
                "the fixture must exercise long acceptances"
            );
        }
    }
}

#[test]
fn drafted_tokens_match_zlab() {
    // Re-draft each recorded round with our drafter on the committed prefix and compare the
    // drafts themselves, not only their consequences.
    let t = target();
    let (meta, _) = reference();
    let d = drafter(&t, "quiet");
    let g = &meta["cases"]["quiet"]["generate"];
    let prompt = ids(&g["prompt_ids"]);
    let out = ids(&g["output_ids"]);
    let acc: Vec<usize> = ids(&g["acceptance_lengths"])
        .iter()
        .map(|&x| x as usize)
        .collect();
    let mut anchor = prompt.len();
    for (i, b) in g["verify_blocks"].as_array().unwrap().iter().enumerate() {
        let b = ids(b);
        let taps = ctx_taps(&t, &d, &out[..anchor]).unsqueeze(0).unwrap();
        let mut cache = d.new_cache();
        let logits = d
            .draft(
                &t,
                None,
                &mut cache,
                &taps,
                BlockAt {
                    token: out[anchor],
                    anchor,
                    block: b.len(),
                    positions: b.len() - 1,
                },
            )
            .unwrap();
        assert_eq!(
            Drafter::argmax_rows(&logits).unwrap(),
            b[1..],
            "round {i} drafts"
        );
        // a shorter draft (DDTree's: the LM head on the first rows only) = the full one's rows
        let k = 3.min(b.len() - 1);
        let mut cache = d.new_cache();
        let first = d
            .draft(
                &t,
                None,
                &mut cache,
                &taps,
                BlockAt {
                    token: out[anchor],
                    anchor,
                    block: b.len(),
                    positions: k,
                },
            )
            .unwrap();
        assert_eq!(first.dims(), &[k, logits.dim(1).unwrap()]);
        let diff = max_abs(&first, &logits.narrow(0, 0, k).unwrap());
        assert!(diff <= 1e-5, "round {i}: first {k} rows differ by {diff}");
        assert_eq!(
            cache.len(),
            anchor,
            "round {i}: the cache holds the context only"
        );
        anchor += acc[i];
    }
}

#[test]
fn training_path_equals_inference_path() {
    // Many blocks of one sequence in one masked forward == one block at a time with the
    // cache, for anchors including 0 (empty context) and overlapping blocks; DFlash2's convs
    // included (per block in both layouts).
    let t = target();
    for name in [
        "dflash-tiny/full",
        "dflash-tiny/sliding",
        "dflash2/tiny-full",
        "dflash2/tiny-sliding",
    ] {
        let d = Drafter::load_dir(&fixtures().join(name), &t).unwrap();
        let seq: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 256).collect();
        let taps = ctx_taps(&t, &d, &seq);
        let b = d.block_size;
        let anchors = [0usize, 3, 5, 11];
        let blocks: Vec<u32> = anchors
            .iter()
            .flat_map(|&a| d.block_tokens(seq[a], b))
            .collect();
        let emb = d.embed_block(&t, &blocks).unwrap();
        let h = d
            .forward(
                &taps.unsqueeze(0).unwrap(),
                &emb,
                DraftLayout::Training {
                    segs: &dflash_core::segments::Segments::single(seq.len()),
                    anchors: &anchors,
                    block: b,
                },
                None,
            )
            .unwrap();
        for (j, &a) in anchors.iter().enumerate() {
            let train_logits = d
                .logits(&t, &h.narrow(1, j * b + 1, b - 1).unwrap())
                .unwrap()
                .squeeze(0)
                .unwrap();
            let mut cache = d.new_cache();
            // feed the context in two pieces to exercise the cache
            let split = a / 2;
            if split > 0 {
                let first = taps.narrow(0, 0, split).unwrap().unsqueeze(0).unwrap();
                d.draft(
                    &t,
                    None,
                    &mut cache,
                    &first,
                    BlockAt {
                        token: seq[split],
                        anchor: split,
                        block: b,
                        positions: b - 1,
                    },
                )
                .unwrap();
            }
            let rest = taps
                .narrow(0, split, a - split)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let infer_logits = d
                .draft(
                    &t,
                    None,
                    &mut cache,
                    &rest,
                    BlockAt {
                        token: seq[a],
                        anchor: a,
                        block: b,
                        positions: b - 1,
                    },
                )
                .unwrap();
            let diff = max_abs(&train_logits, &infer_logits);
            assert!(
                diff <= 1e-5,
                "{name}: anchor {a}: train vs infer logits differ by {diff}"
            );
        }
    }
}
