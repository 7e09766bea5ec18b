//! DDTree in the decoding loop: lossless at T = 0 against AR for several budgets, the same
//! sampling distribution at T > 0, a forced chain reproduces DFlash round by round, and the
//! compacted cache equals a prefill of the committed sequence. (Tree-mask verify logits equal
//! per-path sequential forwards: `dflash-model/tests/qwen3_tiny.rs`,
//! `additive_mask_equals_rows_done_separately`.)

use dflash_core::sampling::SamplingParams;
use dflash_core::tree::DraftTree;
use dflash_core::visibility::causal;
use dflash_engine::decode::compact_cache;
use dflash_engine::decode::Acceptance;
use dflash_engine::{Mode, Request};
use dflash_model::Rows;
use dflash_testkit::*;

#[test]
fn tree_is_lossless_on_the_tiny_target() {
    let t = tiny();
    let d = quiet(&t);
    let r = req(&tiny_prompt(), 48, SamplingParams::default(), &[]);
    let ar = decode(&t, None, Mode::Ar, &r);
    for budget in [1, 4, 8, 32, 64] {
        let g = decode(
            &t,
            Some(&d),
            Mode::Tree {
                block: 8,
                budget,
                top_k: 0,
            },
            &r,
        );
        assert_eq!(g.new_tokens, ar.new_tokens, "budget {budget}");
        assert!(g.rounds.iter().all(|r| r.tree_size.unwrap() <= budget));
    }
}

#[test]
fn tree_tau_is_at_least_chain_tau_here() {
    let t = tiny();
    let d = quiet(&t);
    let r = req(&tiny_prompt(), 48, SamplingParams::default(), &[]);
    let chain = decode(&t, Some(&d), Mode::Chain { block: 8 }, &r);
    let tree = decode(
        &t,
        Some(&d),
        Mode::Tree {
            block: 8,
            budget: 64,
            top_k: 0,
        },
        &r,
    );
    assert!(
        tree.rounds.len() <= chain.rounds.len(),
        "tree {} rounds vs chain {}",
        tree.rounds.len(),
        chain.rounds.len()
    );
}

#[test]
fn smollm2_tree_is_lossless() {
    let lt = smollm2();
    let d = dflash_model::models::drafter_init::random_drafter(&lt, 1, 6, Some(128), 3).unwrap();
    for (p, budget) in [("Name three fruits.", 8), ("What is 7 times 6?", 16)] {
        let ids = lt.tokenizer.prompt_ids(p, true).unwrap();
        let r = Request {
            prompt_ids: ids,
            max_new_tokens: 10,
            sampling: SamplingParams::default(),
            stop_ids: lt.tokenizer.stop_ids.clone(),
            loop_window: 0,
        };
        let ar = decode(&lt.target, None, Mode::Ar, &r);
        let g = decode(
            &lt.target,
            Some(&d),
            Mode::Tree {
                block: 6,
                budget,
                top_k: 0,
            },
            &r,
        );
        assert_eq!(g.new_tokens, ar.new_tokens, "{p:?} budget {budget}");
    }
}

#[test]
fn forced_chain_reproduces_dflash_round_by_round() {
    let t = tiny();
    let d = quiet(&t);
    let r = req(&tiny_prompt(), 48, SamplingParams::default(), &[]);
    let chain = decode(&t, Some(&d), Mode::Chain { block: 8 }, &r);
    let tree = decode(
        &t,
        Some(&d),
        Mode::Tree {
            block: 8,
            budget: 7,
            top_k: 1,
        },
        &r,
    );
    assert_eq!(tree.new_tokens, chain.new_tokens);
    let a: Vec<(usize, usize, usize)> = chain
        .rounds
        .iter()
        .map(|r| (r.drafted, r.accepted, r.tau_round))
        .collect();
    let b: Vec<(usize, usize, usize)> = tree
        .rounds
        .iter()
        .map(|r| (r.drafted, r.accepted, r.tau_round))
        .collect();
    assert_eq!(a, b);
    assert!(
        a.iter().any(|x| x.1 > 0),
        "the comparison must include accepted drafts"
    );
}

#[test]
fn compacted_cache_equals_prefill_of_the_committed_sequence() {
    let t = tiny();
    let p = tiny_prompt();
    let n = p.len();
    let mut cache = t.new_cache();
    let pos: Vec<usize> = (0..n).collect();
    t.forward(&p, &pos, &causal(0, n), &mut cache, &[], &Rows::None)
        .unwrap();
    // a branching tree: root x → {a, b}, b → {c, d}, d → {e}; commit the path x, b, d (rows 0, 2, 4)
    let tree = DraftTree {
        tokens: vec![7, 11, 12, 13, 14, 15],
        parents: vec![None, Some(0), Some(0), Some(2), Some(2), Some(4)],
        depths: vec![0, 1, 1, 2, 2, 3],
    };
    let cl = cache.len();
    t.forward(
        &tree.tokens,
        &tree.positions(n),
        &tree.visibility(cl),
        &mut cache,
        &[],
        &Rows::All,
    )
    .unwrap();
    compact_cache(&mut cache, cl, &[0, 2, 4]).unwrap();
    let committed: Vec<u32> = [p.clone(), vec![7, 12, 14]].concat();
    let mut fresh = t.new_cache();
    let pos: Vec<usize> = (0..committed.len()).collect();
    t.forward(
        &committed,
        &pos,
        &causal(0, committed.len()),
        &mut fresh,
        &[],
        &Rows::None,
    )
    .unwrap();
    assert_eq!(cache.len(), fresh.len());
    for layer in 0..t.num_layers() {
        let (ka, va) = cache.layer(layer).unwrap().unwrap();
        let (kb, vb) = fresh.layer(layer).unwrap().unwrap();
        let dk = max_abs(&ka, &kb);
        let dv = max_abs(&va, &vb);
        assert!(
            dk <= 1e-5 && dv <= 1e-5,
            "layer {layer}: K diff {dk}, V diff {dv}"
        );
    }
    // and the next forward on the compacted cache equals the fresh one
    let o1 = t
        .forward(
            &[15],
            &[n + 3],
            &causal(cache.len(), 1),
            &mut cache,
            &[],
            &Rows::Last,
        )
        .unwrap();
    let o2 = t
        .forward(
            &[15],
            &[n + 3],
            &causal(fresh.len(), 1),
            &mut fresh,
            &[],
            &Rows::Last,
        )
        .unwrap();
    let d = max_abs(&o1.logits.unwrap(), &o2.logits.unwrap());
    assert!(d <= 1e-5, "next-step logits differ by {d}");
}

/// As `lossless.rs::sampling_distribution_equals_ar`, with DDTree-8: the second and third new
/// tokens' distributions over 3,000 seeded generations against AR's, under both acceptance
/// rules, at T = 0.02 (the accept path decides most samples) and T = 0.7 (the sampled tree's
/// rejections and residual draws decide many), and the residual rule accepts far more nodes
/// than the exact match at T = 0.7.
#[test]
fn tree_sampling_distribution_equals_ar() {
    let t = tiny();
    let d = quiet(&t);
    let n = 3000u64;
    let tree = Mode::Tree {
        block: 8,
        budget: 8,
        top_k: 0,
    };
    let counts = |temperature: f64, seed0: u64, mode: Mode, acceptance: Acceptance| {
        let (c, _, drafts) =
            sampled_counts(&t, Some(&d), mode, acceptance, (temperature, seed0, n));
        (c, drafts)
    };
    for temperature in [0.02, 0.7] {
        let (ar, _) = counts(temperature, 0, Mode::Ar, Acceptance::Residual);
        let mut accepted_by = Vec::new();
        for acceptance in [Acceptance::Residual, Acceptance::ExactMatch] {
            let (sp, accepted) = counts(temperature, 5_000_000, tree, acceptance);
            eprintln!("T {temperature}, {acceptance}: accepted nodes {accepted}");
            accepted_by.push(accepted);
            if acceptance == Acceptance::Residual || temperature < 0.1 {
                assert!(
                    accepted > n as usize / 10,
                    "T {temperature}, {acceptance}: too few accepted nodes ({accepted})"
                );
            }
            assert_distributed_alike(
                &ar,
                &sp,
                &format!("T {temperature}, {acceptance} against AR"),
            );
        }
        if temperature > 0.1 {
            assert!(
                accepted_by[0] > 2 * accepted_by[1],
                "T {temperature}: the sampled tree should accept far more than the exact match: {accepted_by:?}"
            );
        }
    }
}

/// The residual rule's sampled tree drawn and walked where the logits are
/// (`ops::sampled_tree`, here its CPU twins: the default) and on the host's path
/// (`drafts_to_host`) gives AR's distribution: DDTree-8's second and third new tokens over
/// 3,000 seeded generations at T 0.7, on the host's path at T 0.7, on the device's under top-k 5
/// with top-p 0.8 at T 0.9, and with a vocabulary head (its distributions spread over the
/// vocabulary there) at T 0.7; each run accepts nodes.
#[test]
fn the_sampled_tree_on_the_device_gives_the_target_distribution() {
    use dflash_engine::decode::DecodeOptions;
    let t = tiny();
    let d = quiet(&t);
    let mut headed = quiet(&t);
    headed.draft_vocab = Some(loop_prompt_head());
    let n = 3000u64;
    let tree = Mode::Tree {
        block: 8,
        budget: 8,
        top_k: 0,
    };
    let host = DecodeOptions {
        drafts_to_host: true,
        ..Default::default()
    };
    let dev = DecodeOptions::default();
    let cases = [
        ("the device's path", &d, dev, (0.7, 1.0, 0), 7_000_000),
        ("the host's path", &d, host, (0.7, 1.0, 0), 8_000_000),
        ("top-k 5, top-p 0.8", &d, dev, (0.9, 0.8, 5), 9_000_000),
        ("a vocabulary head", &headed, dev, (0.7, 1.0, 0), 10_000_000),
    ];
    for (what, drafter, opts, rule, seed0) in cases {
        let (ar, _, _) = sampled_counts_with(&t, None, Mode::Ar, host, rule, (0, n));
        let (sp, _, accepted) =
            sampled_counts_with(&t, Some(drafter), tree, opts, rule, (seed0, n));
        assert!(
            accepted > n as usize / 10,
            "{what}: too few accepted nodes ({accepted}) to test the accept path"
        );
        assert_distributed_alike(&ar, &sp, &format!("{what} against AR"));
    }
}
