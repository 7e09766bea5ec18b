//! `--mode auto` in the decoding loop: whatever budgets it chooses and whether it drafts, the
//! output is AR's at T = 0 and AR's distribution at T > 0; a drafter that is never right is
//! soon not asked, and the run reports its choices.

use dflash_core::sampling::SamplingParams;
use dflash_engine::decode::Acceptance;
use dflash_engine::{Mode, Request};
use dflash_model::models::drafter::Drafter;
use dflash_testkit::*;

#[test]
fn auto_is_lossless_on_the_tiny_target() {
    let t = tiny();
    let d = quiet(&t);
    let r = req(&tiny_prompt(), 48, SamplingParams::default(), &[]);
    let ar = decode(&t, None, Mode::Ar, &r);
    for max_budget in [1, 4, 8] {
        let g = decode(
            &t,
            Some(&d),
            Mode::Auto {
                block: 8,
                max_budget,
            },
            &r,
        );
        assert_eq!(g.new_tokens, ar.new_tokens, "max budget {max_budget}");
        assert!(g.rounds.iter().all(|r| r.tree_size.unwrap() <= max_budget));
        let stats = g.auto.expect("auto reports its choices");
        let drafted: usize = stats.budgets.iter().sum();
        assert_eq!(drafted + stats.undrafted, g.rounds.len());
    }
}

/// The bundled SmolLM2 drafter on a math question (its domain: trees pay) and a random drafter
/// (never right: after the first rounds most are AR steps without a draft); both equal AR.
#[test]
fn smollm2_auto_is_lossless_and_stops_asking_a_drafter_that_is_never_right() {
    let lt = smollm2();
    let dir = dflash_model::io::loader::bundled_drafter("smollm2-135m").unwrap();
    let bundled = Drafter::load_dir(&dir, &lt.target).unwrap();
    let random =
        dflash_model::models::drafter_init::random_drafter(&lt, 1, 16, Some(128), 3).unwrap();
    let ids = lt
        .tokenizer
        .prompt_ids("A baker makes 24 muffins in the morning and twice as many in the afternoon. She sells 50 of them. How many muffins are left?", true)
        .unwrap();
    let r = Request {
        prompt_ids: ids,
        max_new_tokens: 96,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        loop_window: 0,
    };
    let ar = decode(&lt.target, None, Mode::Ar, &r);
    let auto = Mode::Auto {
        block: 16,
        max_budget: 15,
    };
    let g = decode(&lt.target, Some(&bundled), auto, &r);
    assert_eq!(g.new_tokens, ar.new_tokens, "bundled drafter");
    let s = g.auto.unwrap();
    assert!(
        s.observed_accepted > 48,
        "the bundled drafter's trees pay here: {s:?}"
    );
    let g = decode(&lt.target, Some(&random), auto, &r);
    assert_eq!(g.new_tokens, ar.new_tokens, "random drafter");
    let s = g.auto.unwrap();
    assert!(
        s.undrafted > 3 * g.rounds.len() / 4,
        "a drafter that is never right is soon not asked: {s:?}"
    );
}

/// At T = 0.7 the second and third new tokens of 3,000 seeded generations are distributed as
/// AR's (auto walks its greedy trees by the exact match, whatever acceptance is asked for).
#[test]
fn auto_sampling_distribution_equals_ar() {
    let t = tiny();
    let d = quiet(&t);
    let n = 3000u64;
    let (ar, _, _) = sampled_counts(&t, None, Mode::Ar, Acceptance::Residual, (0.7, 0, n));
    let auto = Mode::Auto {
        block: 8,
        max_budget: 8,
    };
    let (got, rounds, accepted) = sampled_counts(
        &t,
        Some(&d),
        auto,
        Acceptance::Residual,
        (0.7, 5_000_000, n),
    );
    assert!(rounds > 0 && accepted > 0, "auto drafted and was accepted");
    assert_distributed_alike(&ar, &got, "auto at T 0.7 against AR");
}

/// At T > 0 the exact match draws each verify row with the number of the token it decides
/// (`Sampler::seek`): a seeded auto generation commits AR's seeded draws, whatever budgets its
/// timings chose (up to a draw within rounding of a boundary between two tokens, which these
/// prompts do not meet), the bundled drafter and the tree kinds alike.
#[test]
fn seeded_auto_at_t_above_0_draws_ars_tokens() {
    let lt = smollm2();
    let dir = dflash_model::io::loader::bundled_drafter("smollm2-135m").unwrap();
    let bundled = Drafter::load_dir(&dir, &lt.target).unwrap();
    for (i, prompt) in [
        "Write a haiku about autumn rain.",
        "Tom has 3 boxes of 12 pencils and gives away 9 pencils. How many are left?",
    ]
    .iter()
    .enumerate()
    {
        let ids = lt.tokenizer.prompt_ids(prompt, true).unwrap();
        let sampling = SamplingParams::new(0.8, 0.95, 0, 11 + i as u64).unwrap();
        let r = req(&ids, 64, sampling, &lt.tokenizer.stop_ids);
        let ar = decode(&lt.target, None, Mode::Ar, &r);
        for mode in [
            Mode::Auto {
                block: 16,
                max_budget: 15,
            },
            Mode::Tree {
                block: 16,
                budget: 4,
                top_k: 0,
            },
        ] {
            let opts = dflash_engine::DecodeOptions {
                acceptance: Acceptance::ExactMatch,
                ..Default::default()
            };
            let g =
                dflash_engine::generate(&lt.target, Some(&bundled), mode, &r, opts, None).unwrap();
            assert_eq!(g.new_tokens, ar.new_tokens, "{} on prompt {i}", mode.name());
        }
    }
}
