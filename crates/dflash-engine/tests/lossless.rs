//! Losslessness of the chain loop: T = 0 output equals AR (SmolLM2 with a random drafter,
//! and a tiny Qwen3 with a drafter that gets long acceptances); T > 0 sampling distribution
//! equals AR's (seeded chi-square); edges (short budgets, stop tokens inside accepted runs,
//! B = 2) and drafters that do not fit.

use candle_core::{DType, Device};
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, Acceptance, DecodeOptions, GraphCache, Mode};
use dflash_model::io::loader::load_target;
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter::Drafter;
use dflash_testkit::*;

#[test]
fn smollm2_random_drafter_is_lossless_at_t0() {
    let lt = smollm2();
    let d = dflash_model::models::drafter_init::random_drafter(&lt, 2, 8, Some(256), 7).unwrap();
    let prompts = [
        "What is 2 + 2?",
        "Name a color.",
        "Write a haiku about rain.",
        "Who wrote Hamlet?",
        "Translate 'hello' into French.",
        "What is the boiling point of water?",
        "Give me a synonym for happy.",
        "How many legs does a spider have?",
        "Say something nice.",
        "What is the largest planet?",
    ];
    for (i, p) in prompts.iter().enumerate() {
        let ids = lt.tokenizer.prompt_ids(p, true).unwrap();
        let r = req(&ids, 12, SamplingParams::default(), &lt.tokenizer.stop_ids);
        let ar = decode(&lt.target, None, Mode::Ar, &r);
        let block = [8, 4, 2][i % 3];
        let sp = decode(&lt.target, Some(&d), Mode::Chain { block }, &r);
        assert_eq!(sp.new_tokens, ar.new_tokens, "prompt {p:?}, block {block}");
        let committed: usize = sp.rounds.iter().map(|r| r.tau_round).sum();
        assert_eq!(
            committed + 1,
            sp.new_tokens.len(),
            "τ accounting: first token + committed"
        );
    }
}

#[test]
fn tiny_target_long_acceptances_are_lossless() {
    let t = tiny();
    let d = quiet(&t);
    let r = req(&tiny_prompt(), 48, SamplingParams::default(), &[]);
    let ar = decode(&t, None, Mode::Ar, &r);
    for b in [2, 3, 5, 8] {
        let sp = decode(&t, Some(&d), Mode::Chain { block: b }, &r);
        assert_eq!(sp.new_tokens, ar.new_tokens, "block {b}");
        assert!(sp.rounds.iter().all(|r| r.tau_round <= b));
    }
    let sp = decode(&t, Some(&d), Mode::Chain { block: 8 }, &r);
    assert!(
        sp.rounds.iter().any(|r| r.accepted >= 5),
        "the fixture drafter must get long acceptances"
    );
}

/// The fixed-shape verify forwards and draft blocks that CUDA graphs replay (`DecodeOptions::cuda_graphs`; on
/// the CPU the same fixed layout and in-place input buffers, without graphs) decode exactly
/// what the plain loop does, in AR, chain and tree modes, and the same rounds; including
/// generations whose last rounds are shorter than the block (another row count).
#[test]
fn fixed_shape_verify_decodes_like_the_plain_loop() {
    let t = tiny();
    let d = quiet(&t);
    let opts = DecodeOptions {
        cuda_graphs: true,
        ..Default::default()
    };
    for (mode, n) in [
        (Mode::Ar, 20),
        (Mode::Chain { block: 8 }, 45),
        (
            Mode::Tree {
                block: 5,
                budget: 6,
                top_k: 0,
            },
            31,
        ),
    ] {
        let r = req(&tiny_prompt(), n, SamplingParams::default(), &[]);
        let d = (mode != Mode::Ar).then_some(&d);
        let plain = decode(&t, d, mode, &r);
        let fixed = generate(&t, d, mode, &r, opts, None).unwrap();
        assert_eq!(fixed.new_tokens, plain.new_tokens, "{}", mode.name());
        let acc = |g: &dflash_engine::Generation| -> Vec<usize> {
            g.rounds.iter().map(|r| r.accepted).collect()
        };
        assert_eq!(acc(&fixed), acc(&plain), "{}", mode.name());
    }
}

/// A greedy chain whose drafts stay on the device (the verify reads them there; one read of
/// the device per round) decodes what the same chain with its drafts read back after the
/// draft decodes, round for round, with and without the fixed-shape forwards; both equal AR.
#[test]
fn drafts_kept_on_the_device_decode_like_drafts_read_back() {
    let t = tiny();
    let d = quiet(&t);
    let r = req(&tiny_prompt(), 45, SamplingParams::default(), &[]);
    let ar = decode(&t, None, Mode::Ar, &r);
    for cuda_graphs in [false, true] {
        for block in [2, 8] {
            let mode = Mode::Chain { block };
            let run = |drafts_to_host| {
                let opts = DecodeOptions {
                    cuda_graphs,
                    drafts_to_host,
                    ..Default::default()
                };
                generate(&t, Some(&d), mode, &r, opts, None).unwrap()
            };
            let (kept, read) = (run(false), run(true));
            let rounds = |g: &dflash_engine::Generation| -> Vec<(usize, Option<u32>)> {
                g.rounds.iter().map(|r| (r.accepted, r.bonus)).collect()
            };
            let what = format!("block {block}, graphs {cuda_graphs}");
            assert_eq!(kept.new_tokens, ar.new_tokens, "{what}");
            assert_eq!(read.new_tokens, ar.new_tokens, "{what}");
            assert_eq!(rounds(&kept), rounds(&read), "{what}");
            // long acceptances: the drafts the verify read on the device decided rounds
            let long = (block - 1).min(3);
            assert!(kept.rounds.iter().any(|r| r.accepted >= long), "{what}");
        }
    }
}

/// Fixed-shape forwards kept from one generation to the next (`generate` with a `GraphCache`,
/// as `eval` runs its prompts) decode what fresh ones decode, round for round; a generation
/// that does not fit the kept capacity makes a new set, and a later one that fits reuses it.
#[test]
fn kept_fixed_shape_forwards_decode_like_fresh_ones() {
    let t = tiny();
    let d = quiet(&t);
    let opts = DecodeOptions {
        cuda_graphs: true,
        ..Default::default()
    };
    for mode in [
        Mode::Ar,
        Mode::Chain { block: 8 },
        Mode::Tree {
            block: 5,
            budget: 6,
            top_k: 0,
        },
    ] {
        let d = (mode != Mode::Ar).then_some(&d);
        let mut graphs = GraphCache::default();
        // capacities (rounded to 128 rows): 128, then 256 (does not fit 128), then 128 ≤ 256
        for (prompt, n) in [
            (tiny_prompt(), 30),
            (loop_prompt(), 120),
            (tiny_prompt()[..5].to_vec(), 40),
        ] {
            let r = req(&prompt, n, SamplingParams::default(), &[]);
            let fresh = generate(&t, d, mode, &r, opts, None).unwrap();
            let kept = generate(&t, d, mode, &r, opts, Some(&mut graphs)).unwrap();
            assert_eq!(kept.new_tokens, fresh.new_tokens, "{}", mode.name());
            let acc = |g: &dflash_engine::Generation| -> Vec<usize> {
                g.rounds.iter().map(|r| r.accepted).collect()
            };
            assert_eq!(acc(&kept), acc(&fresh), "{}", mode.name());
        }
        assert_eq!(graphs.reused, 1, "{}", mode.name());
    }
}

#[test]
fn max_new_tokens_below_block_size() {
    let t = tiny();
    let d = quiet(&t);
    for n in 1..=7 {
        let r = req(&tiny_prompt(), n, SamplingParams::default(), &[]);
        let ar = decode(&t, None, Mode::Ar, &r);
        let sp = decode(&t, Some(&d), Mode::Chain { block: 8 }, &r);
        assert_eq!(sp.new_tokens.len(), n);
        assert_eq!(sp.new_tokens, ar.new_tokens, "max_new_tokens {n}");
        assert!(
            sp.rounds.iter().all(|r| r.drafted < n),
            "the block shrinks near the end"
        );
    }
}

#[test]
fn stop_token_inside_an_accepted_run() {
    let t = tiny();
    let d = quiet(&t);
    // the tiny target loops on 180 and the drafter accepts long runs of it
    let r = req(&tiny_prompt(), 48, SamplingParams::default(), &[180]);
    let ar = decode(&t, None, Mode::Ar, &r);
    let sp = decode(&t, Some(&d), Mode::Chain { block: 8 }, &r);
    assert_eq!(sp.new_tokens, ar.new_tokens);
    assert_eq!(*sp.new_tokens.last().unwrap(), 180);
    assert!(sp.stopped_by_token);
    let last = sp.rounds.last().unwrap();
    assert!(
        last.accepted + 1 > last.tau_round,
        "the stop cut an accepted run: {last:?}"
    );
}

#[test]
fn drafter_for_another_target_is_refused() {
    let t = tiny();
    let home = dflash_model::io::loader::dflash_home();
    let lt = load_target(
        home.join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
            .to_str()
            .unwrap(),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let err = Drafter::load_dir(&fixtures().join("dflash-tiny/quiet"), &lt.target)
        .err()
        .unwrap();
    assert!(err.to_string().contains("hidden_size"), "{err}");
    // a config that claims another target depth
    let dir = fixtures().join("dflash-tiny/quiet");
    let mut cfg: dflash_core::config::DrafterConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg.num_target_layers = 30;
    let store =
        TensorStore::from_safetensors(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu)
            .unwrap();
    let err = Drafter::load(cfg, &store, &t).err().unwrap();
    assert!(err.to_string().contains("num_target_layers"), "{err}");
}

#[test]
fn missing_or_extra_drafter_tensors_are_refused() {
    let t = tiny();
    let dir = fixtures().join("dflash-tiny/quiet");
    let cfg: dflash_core::config::DrafterConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let mut w =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let fc = w.remove("fc.weight").unwrap();
    let err = Drafter::load(
        cfg.clone(),
        &TensorStore::new(w.clone(), DType::F32, Device::Cpu),
        &t,
    )
    .err()
    .unwrap();
    assert!(
        err.to_string().contains("missing tensor 'fc.weight'"),
        "{err}"
    );
    w.insert("fc.weight".into(), fc);
    w.insert(
        "lm_head.weight".into(),
        candle_core::Tensor::zeros((256, 64), DType::F32, &Device::Cpu).unwrap(),
    );
    let err = Drafter::load(cfg, &TensorStore::new(w, DType::F32, Device::Cpu), &t)
        .err()
        .unwrap();
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
}

/// At a plain temperature (no top-k, no top-p) a chain's round stays on the device: its drafts
/// drawn, judged and the bonus drawn by `ops::sample_rows` (here their CPU twins), with the
/// round's uniform numbers drawn up front. The second and third new tokens of 4,000 seeded
/// generations are distributed as AR's on the host's path, and as the chain's on the host's path.
#[test]
fn a_round_sampled_on_the_device_gives_the_target_distribution() {
    let t = tiny();
    let d = quiet(&t);
    let n = 4000u64;
    let counts = |mode: Mode, drafts_to_host: bool, seed0: u64| {
        let opts = DecodeOptions {
            drafts_to_host,
            ..Default::default()
        };
        sampled_counts_with(&t, Some(&d), mode, opts, (0.7, 1.0, 0), (seed0, n))
    };
    let chain = Mode::Chain { block: 8 };
    let (ar, _, _) = counts(Mode::Ar, true, 0);
    let (host, _, _) = counts(chain, true, 2_000_000);
    let (dev, rounds, _) = counts(chain, false, 1_000_000);
    assert!(
        rounds > n as usize / 10,
        "too few accepted drafts ({rounds}) to test the accept path"
    );
    assert_distributed_alike(&ar, &dev, "the device's round against AR");
    assert_distributed_alike(&host, &dev, "the device's round against the host's chain");
}

/// A drafter with a vocabulary head keeps its T > 0 rounds on the device too: its drafts drawn
/// over the head's columns (ascending token ids) and its distributions spread over the
/// vocabulary there. The head here holds two thirds of the tiny vocabulary (every token of the
/// loop prompt among them); 4,000 seeded generations' second and third tokens are distributed
/// as AR's.
#[test]
fn a_vocabulary_head_samples_on_the_device_as_ar_does() {
    let t = tiny();
    let mut d = quiet(&t);
    d.draft_vocab = Some(loop_prompt_head());
    let n = 4000u64;
    let host = DecodeOptions {
        drafts_to_host: true,
        ..Default::default()
    };
    let (ar, _, _) = sampled_counts_with(&t, None, Mode::Ar, host, (0.7, 1.0, 0), (0, n));
    let chain = Mode::Chain { block: 8 };
    let opts = DecodeOptions::default();
    let (dev, rounds, _) =
        sampled_counts_with(&t, Some(&d), chain, opts, (0.7, 1.0, 0), (3_000_000, n));
    assert!(
        rounds > n as usize / 10,
        "too few accepted drafts ({rounds}) to test the accept path"
    );
    assert_distributed_alike(&ar, &dev, "the head's rounds against AR");
}

/// The exact match at a plain temperature draws the target's tokens on the device: a chain's
/// round stays there (greedy drafts, then the target's draw at every verify row, read back once
/// with the drafts), and a DDTree-8's verify draws one token per row there before its walk
/// (`ops::sample_rows::draw_rows`, here its CPU twin). 3,000 seeded generations' second and
/// third new tokens are distributed as AR's on the host's path, for both, at T = 0.02 (the
/// drafts are mostly kept: the accept path decides) and T = 0.7 (the draws' bonuses decide most).
#[test]
fn the_exact_match_draws_on_the_device_as_ar_does() {
    let t = tiny();
    let d = quiet(&t);
    let n = 3000u64;
    let host = DecodeOptions {
        drafts_to_host: true,
        ..Default::default()
    };
    let exact = DecodeOptions {
        acceptance: Acceptance::ExactMatch,
        ..Default::default()
    };
    let tree = Mode::Tree {
        block: 8,
        budget: 8,
        top_k: 0,
    };
    for temperature in [0.02, 0.7] {
        let (ar, _, _) =
            sampled_counts_with(&t, None, Mode::Ar, host, (temperature, 1.0, 0), (0, n));
        for (mode, seed0) in [(Mode::Chain { block: 8 }, 4_000_000), (tree, 6_000_000)] {
            let (dev, _, accepted) =
                sampled_counts_with(&t, Some(&d), mode, exact, (temperature, 1.0, 0), (seed0, n));
            if temperature < 0.1 {
                assert!(
                    accepted > n as usize / 10,
                    "{mode:?} at T {temperature}: too few accepted drafts ({accepted}) to test the accept path"
                );
            }
            let what = format!("{mode:?} at T {temperature}: the device's draws against AR");
            assert_distributed_alike(&ar, &dev, &what);
        }
    }
}

/// Top-k and top-p sample where the logits are (`ops::sample_rows::rule_probs`, here on the
/// CPU): a chain's round under the residual rule (the drafts drawn from the drafter's rule,
/// judged against the target's) and AR's draws. 4,000 seeded generations' second and third new
/// tokens at T 0.9 under top-k 5 with top-p 0.8 and under top-p 0.7 alone are distributed as
/// AR's on the host's path (which ranks and draws each row there), for the chain and for AR on
/// the device's path.
#[test]
fn top_k_and_top_p_sample_on_the_device_as_on_the_host() {
    let t = tiny();
    let d = quiet(&t);
    let n = 4000u64;
    let host = DecodeOptions {
        drafts_to_host: true,
        ..Default::default()
    };
    let dev = DecodeOptions::default();
    for rule in [(0.9, 0.8, 5), (0.9, 0.7, 0)] {
        let (ar_host, _, _) = sampled_counts_with(&t, None, Mode::Ar, host, rule, (0, n));
        let (ar_dev, _, _) = sampled_counts_with(&t, None, Mode::Ar, dev, rule, (7_000_000, n));
        let chain = Mode::Chain { block: 8 };
        let (chain_dev, rounds, _) =
            sampled_counts_with(&t, Some(&d), chain, dev, rule, (8_000_000, n));
        assert!(
            rounds > n as usize / 10,
            "{rule:?}: too few accepted drafts ({rounds}) to test the accept path"
        );
        for (what, counts) in [("AR", &ar_dev), ("the chain", &chain_dev)] {
            let what = format!("{rule:?}: {what} on the device's path against AR on the host's");
            assert_distributed_alike(&ar_host, counts, &what);
        }
    }
}

#[test]
fn chi_square_helper_detects_a_difference() {
    // the test below can fail: a clearly different distribution gives a tiny p-value
    let a = [2500usize, 2500, 0];
    let b = [2000usize, 2500, 500];
    assert!(chi_square_p(&a, &b) < 1e-6);
    assert!(chi_square_p(&a, &a) > 0.99);
    assert!((gamma_q(1.0, 2.0) - (-2.0f64).exp()).abs() < 1e-10);
}

/// The second and third new tokens' distributions, 4,000 seeded generations each, a DFlash
/// chain against AR: under the residual rule distributed alike, under the exact match equal to
/// AR's generations of the same seeds. The prefix is where the tiny target settles
/// into its loop and the drafter's drafts get accepted, so the accept path (not only the bonus
/// path) decides many samples; at T = 0.7 the drafts are drawn from a spread-out q, so the
/// residual rule's rejections and residual draws decide many others.
#[test]
fn sampling_distribution_equals_ar() {
    let t = tiny();
    let d = quiet(&t);
    let n = 4000u64;
    let counts = |temperature: f64, seed0: u64, mode: Mode, acceptance: Acceptance| {
        let (c, rounds, _) =
            sampled_counts(&t, Some(&d), mode, acceptance, (temperature, seed0, n));
        (c, rounds)
    };
    let chain = Mode::Chain { block: 8 };
    for temperature in [0.02, 0.7] {
        let (ar, _) = counts(temperature, 0, Mode::Ar, Acceptance::Residual);
        let mut accepted_by = Vec::new();
        for acceptance in [Acceptance::Residual, Acceptance::ExactMatch] {
            let (sp, accepted) = counts(temperature, 1_000_000, chain, acceptance);
            if acceptance == Acceptance::ExactMatch {
                // the exact match draws each row with its token's number (`Sampler::seek`):
                // every generation is AR's of the same seed, which is stronger than alike
                let (ar_same_seeds, _) = counts(temperature, 1_000_000, Mode::Ar, acceptance);
                assert_eq!(sp, ar_same_seeds, "T {temperature}: exact match against AR");
                eprintln!("T {temperature}, {acceptance}: accepted rounds {accepted}");
                accepted_by.push(accepted);
                if temperature < 0.1 {
                    assert!(
                        accepted > n as usize / 10,
                        "T {temperature}: too few accepted drafts ({accepted})"
                    );
                }
                continue;
            }
            eprintln!("T {temperature}, {acceptance}: accepted rounds {accepted}");
            accepted_by.push(accepted);
            // at T = 0.7 the target rarely samples exactly the greedy draft: the exact match
            // accepts little there, which is what the residual rule is for
            if acceptance == Acceptance::Residual || temperature < 0.1 {
                assert!(
                    accepted > n as usize / 10,
                    "T {temperature}, {acceptance}: too few accepted drafts ({accepted}) to test the accept path"
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
                accepted_by[0] > 10 * accepted_by[1],
                "T {temperature}: the residual rule should accept far more than the exact match: {accepted_by:?}"
            );
        }
    }
}
