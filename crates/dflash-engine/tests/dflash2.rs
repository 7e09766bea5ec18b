//! DFlash2 drafters against z-lab's own `DFlash2DraftModel` (tests/reference/dflash2_reference.py):
//! block hidden rows and logits without and with a draft cache, the selector's greedy
//! proposals and the q of a sampled walk, greedy `dflash_generate` round by round (the tiny
//! Qwen3 and SmolLM2); and at T > 0 the output distribution of a DFlash2 chain equals AR's.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use dflash_core::config::DrafterConfig;
use dflash_core::sampling::SamplingParams;
use dflash_core::selector::{walk_greedy, SelectorStep};
use dflash_engine::decode::Acceptance;
use dflash_engine::Mode;
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_model::models::drafter_init::random_weights;
use dflash_model::Target;
use dflash_testkit::*;

fn reference() -> (serde_json::Value, HashMap<String, Tensor>) {
    let dir = fixtures().join("dflash2");
    (
        json(&dir.join("reference.json")),
        load_ref(&dir.join("reference.safetensors")),
    )
}

/// The case's target: the tiny Qwen3, or SmolLM2 from the asset cache.
fn target_of(case: &str) -> Target {
    if case == "smollm2" {
        smollm2().target
    } else {
        tiny()
    }
}

fn drafter(t: &Target, case: &str) -> Drafter {
    Drafter::load_dir(&fixtures().join("dflash2").join(case), t).unwrap()
}

fn ctx_taps(t: &Target, d: &Drafter, tokens: &[u32]) -> Tensor {
    prefill_taps(t, &d.target_layer_ids, tokens)
}

/// One block on a fresh draft cache: the hidden rows, logits and the selector's steps.
fn block(
    t: &Target,
    d: &Drafter,
    ctx: &[u32],
    anchor_tok: u32,
) -> (Tensor, Tensor, Vec<SelectorStep>) {
    let (h, l) = fresh_block(t, d, ctx, anchor_tok, d.block_size);
    let steps = d
        .selector
        .as_ref()
        .unwrap()
        .steps(&h, &l, anchor_tok, |j| j)
        .unwrap();
    (h, l, steps)
}

#[test]
fn block_and_selector_match_zlab() {
    let (meta, r) = reference();
    for name in ["tiny-full", "tiny-sliding", "smollm2"] {
        let t = target_of(name);
        let d = drafter(&t, name);
        assert!(d.config.is_dflash2() && d.selector.is_some());
        let case = &meta["cases"][name];
        let ctx = ids(&case["ctx_ids"]);
        let blk = ids(&case["nocache_block"]);
        assert_eq!(
            blk,
            d.block_tokens(blk[0], blk.len()),
            "{name}: block layout"
        );
        // f32 throughout; SmolLM2's 30 layers and 49k-column head allow a little more
        let tol = if name == "smollm2" { 2e-4 } else { 1e-4 };
        let taps = ctx_taps(&t, &d, &ctx);
        let e = rel_err(&taps, &r[&format!("{name}.nocache.ctx")]);
        assert!(e <= tol, "{name}: context taps rel err {e}");
        let (h, l, steps) = block(&t, &d, &ctx, blk[0]);
        let e = rel_err(&h, &r[&format!("{name}.nocache.hidden")]);
        assert!(e <= tol, "{name}: block hidden rel err {e}");
        let cols = case["logit_columns"].as_u64().unwrap() as usize;
        let e = rel_err(
            &l.narrow(1, 0, cols).unwrap(),
            &r[&format!("{name}.nocache.logits")],
        );
        assert!(e <= tol, "{name}: draft logits rel err {e}");
        // the selector: the same candidate sets, the same greedy walk
        let sel = &case["selector"];
        let want_cands = sel["greedy_candidates"].as_array().unwrap();
        for (p, (s, w)) in steps.iter().zip(want_cands).enumerate() {
            let mut a = s.tokens.clone();
            let mut b = ids(w);
            a.sort();
            b.sort();
            assert_eq!(a, b, "{name}: candidates at position {p}");
        }
        assert_eq!(
            walk_greedy(&steps),
            ids(&sel["greedy"]),
            "{name}: greedy proposals"
        );
        // the sampled walk's q: along z-lab's path, each position's softmax(scores / T) over
        // the candidates after the drawn predecessor
        let temp = sel["sampled_temperature"].as_f64().unwrap() as f32;
        let path = ids(&sel["sampled_path"]);
        let cands = sel["sampled_candidates"].as_array().unwrap();
        let q_ref = r[&format!("{name}.nocache.sampled_q")]
            .to_vec2::<f32>()
            .unwrap();
        let mut prev = 0;
        for (p, s) in steps.iter().enumerate() {
            let sc = s.scores(prev);
            let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = sc.iter().map(|&x| ((x - m) / temp).exp()).sum();
            for (k, &tok) in ids(&cands[p]).iter().enumerate() {
                let i = s.index_of(tok).unwrap();
                let q = ((sc[i] - m) / temp).exp() / z;
                assert!(
                    (q - q_ref[p][k]).abs() <= 1e-4,
                    "{name}: q at position {p}, token {tok}: {q} vs {}",
                    q_ref[p][k]
                );
            }
            prev = s.index_of(path[p]).unwrap();
        }
    }
}

#[test]
fn cached_rounds_match_zlab() {
    let (meta, r) = reference();
    let name = "tiny-full";
    let t = tiny();
    let d = drafter(&t, name);
    let case = &meta["cases"][name];
    let ctx = ids(&case["ctx_ids"]);
    let taps = ctx_taps(&t, &d, &ctx);
    let mut cache = d.new_cache();
    for (round, (from, len, key)) in [(0, 8, "cache1"), (8, 4, "cache2")].iter().enumerate() {
        let b = ids(&case[format!("{key}_block")]);
        let l = d
            .draft(
                &t,
                None,
                &mut cache,
                &taps.narrow(0, *from, *len).unwrap().unsqueeze(0).unwrap(),
                BlockAt {
                    token: b[0],
                    anchor: from + len,
                    block: b.len(),
                    positions: b.len() - 1,
                },
            )
            .unwrap();
        let e = rel_err(&l, &r[&format!("{name}.{key}.logits")]);
        assert!(e <= 1e-4, "cached round {} rel err {e}", round + 1);
        assert_eq!(
            cache.len(),
            from + len,
            "the draft cache keeps the context only"
        );
    }
}

/// Greedy `dflash_generate` with a DFlash2 drafter: the same output and acceptance lengths,
/// and every round's drafts (re-drafted on the committed prefix) equal z-lab's verify blocks.
#[test]
fn greedy_generation_matches_zlab_round_by_round() {
    let (meta, _) = reference();
    for name in ["tiny-full", "smollm2"] {
        let t = target_of(name);
        let d = drafter(&t, name);
        let g = &meta["cases"][name]["generate"];
        let (prompt, out, want_acc) = replay_zlab_generation(&t, &d, g, name);
        let all: Vec<u32> = [prompt.clone(), out.new_tokens.clone()].concat();
        let mut anchor = prompt.len();
        for (i, (b, &acc)) in g["verify_blocks"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&want_acc)
            .enumerate()
        {
            let b = ids(b);
            if b.len() == d.block_size {
                let (_, _, steps) = block(&t, &d, &all[..anchor], all[anchor]);
                assert_eq!(walk_greedy(&steps), b[1..], "{name}: round {i} drafts");
            }
            anchor += acc;
        }
        assert_eq!(anchor, all.len() - 1);
    }
}

/// A DFlash2 drafter that gets drafts accepted on the tiny target: z-lab's "quiet" DFlash
/// drafter (tests/fixtures/dflash-tiny/quiet) with DFlash2's convs and selector added (seeded,
/// [`random_weights`], with small dynamic taps and codebooks scaled to N(0, 1)), its selector over the
/// top 64 so that a spread-out target distribution still meets its candidates.
fn quiet_dflash2(t: &Target) -> Drafter {
    let dir = fixtures().join("dflash-tiny/quiet");
    let mut cfg: DrafterConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg.architectures = vec!["DFlash2DraftModel".into()];
    for (k, v) in [
        ("conv_kernel_size", 2),
        ("conv_group_size", 16),
        ("selector_rank", 8),
        ("selector_top_k", 64),
    ] {
        cfg.dflash_config.extra.insert(k.into(), v.into());
    }
    let mut w =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    for (k, v) in random_weights(&cfg, 3).unwrap() {
        // small dynamic taps (random_weights starts them at 0): the convs stay close to the
        // identity, so the drafter keeps the quiet drafter's long acceptances; the codebooks
        // ~ N(0, 1), so that the edge term moves the selector's q
        if k.contains("kernel_projection") {
            let n = v.elem_count();
            let taps: Vec<f32> = (0..n).map(|i| 0.002 * (i as f32 * 0.61).sin()).collect();
            w.insert(k, Tensor::from_vec(taps, v.shape(), &Device::Cpu).unwrap());
        } else if k.contains("codebook") {
            w.insert(k, (v * 50.0).unwrap());
        } else if k.contains("conv") || k.starts_with("candidate_selector") {
            w.insert(k, v);
        }
    }
    Drafter::load(cfg, &TensorStore::new(w, DType::F32, Device::Cpu), t).unwrap()
}

/// The second and third new tokens' distributions over 4,000 seeded generations: a DFlash2
/// chain (drafts from the selector's sampled walk, judged against its q by the residual rule)
/// against AR, at T = 0.7 where the selector's q is spread out.
#[test]
fn dflash2_sampling_distribution_equals_ar() {
    let t = tiny();
    let d = quiet_dflash2(&t);
    let n = 4000u64;
    let chain = Mode::Chain { block: 8 };
    let (ar, _, _) = sampled_counts(&t, None, Mode::Ar, Acceptance::Residual, (0.7, 0, n));
    let (sp, rounds, drafts) = sampled_counts(
        &t,
        Some(&d),
        chain,
        Acceptance::Residual,
        (0.7, 1_000_000, n),
    );
    eprintln!("DFlash2 chain at T 0.7: {rounds} rounds accepted drafts, {drafts} drafts");
    assert!(
        rounds > n as usize / 10,
        "too few accepted rounds: {rounds}"
    );
    for (pos, (a, b)) in ar.iter().zip(&sp).enumerate() {
        let p = chi_square_p(a, b);
        assert!(p > 0.01, "new token {} differs from AR: p = {p}", pos + 1);
    }
}

/// DDTree with a DFlash2 drafter (the tree from the selector's candidates, ranked after each
/// node's token) equals AR at T = 0, and its trees accept drafts (the compaction path); at
/// T > 0 it decodes (lossless by the sampled tree's own tests).
#[test]
fn ddtree_with_dflash2_equals_ar() {
    let t = tiny();
    let prompt = loop_prompt();
    let want = greedy(&t, &prompt, 40);
    for (name, d) in [
        ("tiny-full", drafter(&t, "tiny-full")),
        ("quiet", quiet_dflash2(&t)),
    ] {
        for budget in [1, 4, 12] {
            let mode = Mode::Tree {
                block: 8,
                budget,
                top_k: 0,
            };
            let g = decode(
                &t,
                Some(&d),
                mode,
                &req(&prompt, 40, SamplingParams::default(), &[]),
            );
            assert_eq!(g.new_tokens, want, "{name}, budget {budget}");
            if budget > 1 {
                assert!(
                    g.rounds.iter().any(|r| r.accepted > 0),
                    "{name}, budget {budget}: no draft accepted"
                );
            }
        }
        let sp = SamplingParams::new(1.0, 1.0, 0, 7).unwrap();
        let mode = Mode::Tree {
            block: 8,
            budget: 6,
            top_k: 0,
        };
        let g = decode(&t, Some(&d), mode, &req(&prompt, 12, sp, &[]));
        assert_eq!(g.new_tokens.len(), 12);
    }
}

/// A DFlash2 drafter under `cuda_graphs` (the draft block's fixed-shape forward with its
/// dynamic convs, the selector on its rows; kept from one generation to the next as `eval`
/// does) equals AR at T = 0 in chain and tree modes.
#[test]
fn dflash2_with_fixed_shapes_equals_ar() {
    use dflash_engine::{generate, DecodeOptions, GraphCache};
    let t = tiny();
    let d = quiet_dflash2(&t);
    let opts = DecodeOptions {
        cuda_graphs: true,
        ..Default::default()
    };
    for mode in [
        Mode::Chain { block: 8 },
        Mode::Tree {
            block: 8,
            budget: 6,
            top_k: 0,
        },
    ] {
        let mut kept = GraphCache::default();
        for prompt in [loop_prompt(), tiny_prompt()] {
            let r = req(&prompt, 30, SamplingParams::default(), &[]);
            let want = greedy(&t, &prompt, 30);
            let g = generate(&t, Some(&d), mode, &r, opts, None).unwrap();
            assert_eq!(g.new_tokens, want, "{}", mode.name());
            let k = generate(&t, Some(&d), mode, &r, opts, Some(&mut kept)).unwrap();
            assert_eq!(k.new_tokens, want, "{} kept", mode.name());
        }
    }
}
