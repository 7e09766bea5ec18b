//! The drafters that ship (`assets/drafters/smollm2-135m-b16` and
//! `assets/drafters/qwen2.5-coder-0.5b-b16`, trained by dflash-rs on an H200 or H100) with their
//! targets on the CPU: DFlash and DDTree-8 equal AR at T = 0 on fixed prompts, and the pooled τ
//! stays above a floor. A regression in the target engine, the drafter forward, the
//! tap convention or the loader drops τ to ≈ 1 (a broken drafter still decodes losslessly),
//! which this test catches. Floors: measured τ (see the drafter's README) minus a margin.
//! Also DDTree's claim on a trained drafter: τ(DDTree-8) ≥ τ(DFlash chain).

use dflash_core::sampling::SamplingParams;
use dflash_core::stats::summarize;
use dflash_engine::Mode;
use dflash_model::models::drafter::Drafter;
use dflash_testkit::*;

/// Chat prompts like the training data's (ShareGPT / evals first turns), not from it.
const PROMPTS: &[&str] = &[
    "Write a short poem about the ocean.",
    "What are the benefits of regular exercise?",
    "Explain what a variable is in programming.",
    "Give me three tips for learning a new language.",
    // the shipped weights' last run trained on math and code problems
    "A baker makes 24 muffins and sells them in boxes of 4. Each box costs $6. How much money does the baker make if she sells all the muffins?",
    "Write a Python function that checks whether a string is a palindrome.",
];
/// Pooled τ floors at T = 0, 64 new tokens (CPU, f32). The shipped weights (run 12) measure
/// DFlash 1.862 and DDTree-8 2.172 here (drafting from their 8,192-token `draft_vocab.json` and
/// each prompt's tokens; 1.844 / 2.172 from the 8,192 alone); the weights shipped before them
/// (run 9, the 8,192 alone) measure 1.835 / 2.160, run 7's 1.688 / 2.148; a random drafter
/// gives 1.00–1.02.
const CHAIN_FLOOR: f64 = 1.79;
const TREE8_FLOOR: f64 = 2.12;
/// The same with the integer products, whose AR output is another text: DFlash 1.909 and
/// DDTree-8 2.224 measured here (1.899 / 2.211 from the 8,192 alone; run 9's weights: 1.826 /
/// 2.160).
const CHAIN_FLOOR_Q8: f64 = 1.85;
const TREE8_FLOOR_Q8: f64 = 2.16;

#[test]
fn bundled_drafter_is_lossless_and_above_its_tau_floor() {
    check(false);
}

/// The same with the CPU's integer products (`DFLASH_CPU_QUANT=q8`: the target's projections
/// and the drafter's multiply 8-bit rows): AR's own output is another one, and DFlash and
/// DDTree-8 equal it token for token; τ above their floors.
#[test]
fn bundled_drafter_with_integer_products_too() {
    check(true);
}

/// The Qwen2.5-Coder-0.5B drafter's problems: like its training data (math and code problems),
/// not from it.
const CODER_PROMPTS: &[&str] = &[
    "A train travels 180 miles in 3 hours. At the same speed, how far does it travel in 5 hours?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Tom has 3 times as many marbles as Sara. Together they have 48 marbles. How many does Sara have?",
    "Write a Python function that removes duplicates from a list while keeping the order.",
];
/// Pooled τ floors at T = 0, 64 new tokens (CPU, f32) for the Coder drafter: DFlash 3.405 and
/// DDTree-8 3.706 measured here (its `draft_vocab.json` and each prompt's tokens); a random
/// 3-layer drafter (`drafter init --seed 0`) gives 1.00 on the second prompt.
const CODER_CHAIN_FLOOR: f64 = 3.25;
const CODER_TREE8_FLOOR: f64 = 3.55;

/// The Qwen2.5-Coder-0.5B drafter (3 layers) with its target: lossless and above its floors.
#[test]
fn bundled_coder_drafter_is_lossless_and_above_its_tau_floor() {
    let lt = load(
        &asset(
            "models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "qwen2.5-coder",
        ),
        candle_core::DType::F32,
    );
    let dir = dflash_model::io::loader::bundled_drafter("qwen2.5-coder-0.5b")
        .expect("assets/drafters/qwen2.5-coder-0.5b-b16 is part of the repository");
    let d = Drafter::load_dir(&dir, &lt.target).unwrap();
    assert_eq!((d.block_size, d.num_layers()), (16, 3));
    let (chain, tree) = taus(&lt, &d, CODER_PROMPTS);
    eprintln!("bundled Coder drafter: DFlash τ {chain:.3}, DDTree-8 τ {tree:.3}");
    assert!(
        chain >= CODER_CHAIN_FLOOR,
        "DFlash τ {chain:.3} < floor {CODER_CHAIN_FLOOR}"
    );
    assert!(
        tree >= CODER_TREE8_FLOOR,
        "DDTree-8 τ {tree:.3} < floor {CODER_TREE8_FLOOR}"
    );
    assert!(tree >= chain, "DDTree-8 τ {tree:.3} < DFlash τ {chain:.3}");
}

fn check(integer: bool) {
    // the weights are laid out at load time, on this thread: both with the integer products,
    // or as the process chose (exact unless `DFLASH_CPU_QUANT=q8`)
    let load = || {
        let lt = smollm2();
        let dir = dflash_model::io::loader::bundled_drafter("smollm2-135m")
            .expect("assets/drafters/smollm2-135m-b16 is part of the repository");
        let d = Drafter::load_dir(&dir, &lt.target).unwrap();
        (lt, d)
    };
    let (lt, d) = match integer {
        true => dflash_model::cpu::q8::with_choice(true, load),
        false => load(),
    };
    if integer && dflash_model::cpu::panels::Panels::supported() {
        let formats = lt.target.bytes_read_by_format();
        assert!(formats.iter().any(|(f, _)| f.contains("q8")), "{formats:?}");
    }
    assert_eq!((d.block_size, d.num_layers()), (16, 5));
    let (chain_tau, tree_tau) = taus(&lt, &d, PROMPTS);
    let (chain_floor, tree_floor) = match integer {
        false => (CHAIN_FLOOR, TREE8_FLOOR),
        true => (CHAIN_FLOOR_Q8, TREE8_FLOOR_Q8),
    };
    eprintln!(
        "bundled drafter (integer products: {integer}): DFlash τ {chain_tau:.3}, DDTree-8 τ {tree_tau:.3}"
    );
    assert!(
        chain_tau >= chain_floor,
        "DFlash τ {chain_tau:.3} < floor {chain_floor}"
    );
    assert!(
        tree_tau >= tree_floor,
        "DDTree-8 τ {tree_tau:.3} < floor {tree_floor}"
    );
    // DDTree's point: on a trained drafter the best tree of 8 nodes commits at least as much
    // as the argmax chain (budgets 4 … 64 on GSM8K: docs/eval/smollm2-135m-b16)
    assert!(
        tree_tau >= chain_tau,
        "DDTree-8 τ {tree_tau:.3} < DFlash τ {chain_tau:.3}"
    );
}

/// Pooled τ of DFlash and DDTree-8 over `prompts` (64 new tokens each, T = 0), both asserted
/// equal to AR token for token.
fn taus(lt: &dflash_model::io::loader::LoadedTarget, d: &Drafter, prompts: &[&str]) -> (f64, f64) {
    let (mut chain_rounds, mut tree_rounds) = (Vec::new(), Vec::new());
    for p in prompts {
        let ids = lt.tokenizer.prompt_ids(p, true).unwrap();
        let r = req(&ids, 64, SamplingParams::default(), &lt.tokenizer.stop_ids);
        let ar = decode(&lt.target, None, Mode::Ar, &r);
        let chain = decode(&lt.target, Some(d), Mode::Chain { block: 16 }, &r);
        assert_eq!(
            chain.new_tokens, ar.new_tokens,
            "DFlash differs from AR on {p:?}"
        );
        let tree = decode(
            &lt.target,
            Some(d),
            Mode::Tree {
                block: 16,
                budget: 8,
                top_k: 0,
            },
            &r,
        );
        assert_eq!(
            tree.new_tokens, ar.new_tokens,
            "DDTree-8 differs from AR on {p:?}"
        );
        chain_rounds.push(chain.rounds);
        tree_rounds.push(tree.rounds);
    }
    // the one τ definition (dflash_core::stats), pooled over the prompts
    let pooled = |r: &[Vec<dflash_core::stats::RoundOutcome>]| {
        summarize(&r.iter().map(|x| x.as_slice()).collect::<Vec<_>>()).tau_pooled
    };
    (pooled(&chain_rounds), pooled(&tree_rounds))
}
