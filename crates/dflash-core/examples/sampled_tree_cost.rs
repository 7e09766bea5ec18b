//! Benchmark: DDTree at T > 0 on the host, per round.
//! `cargo run --release -p dflash-core --example sampled_tree_cost -- [budget=8] [block=16] [vocab=49152] [reps=50]`
//! Times, median over `reps` rounds of drafter-like rows at T = 1: (1) `Sampler::sampled_tree`
//! (the shape from each depth's top-K, the draws without replacement) beside the same shape
//! ranked over the log of every token (what the builder computed before it ranked by `q`
//! itself), in the same run; (2) `Sampler::walk_sampled_tree` down the tree with the target's
//! rows (here the drafter's rows stand in), judging each node reached.

use std::time::Instant;

use dflash_core::sampling::{dense_probs, Sampler, SamplingParams};
use dflash_core::tree::{top_k_sorted, DraftTree};
#[path = "support/mod.rs"]
mod support;
use support::{drafter_like_rows, median, numeric_args};

fn main() {
    let a = numeric_args();
    let budget = *a.first().unwrap_or(&8);
    let block = *a.get(1).unwrap_or(&16);
    let vocab = *a.get(2).unwrap_or(&49_152);
    let reps = *a.get(3).unwrap_or(&50);
    let params = SamplingParams::new(1.0, 1.0, 0, 7).expect("valid");
    // drafter-like logits: a few confident tokens over a noisy floor
    let logits = drafter_like_rows(block - 1, vocab);
    let qs: Vec<Vec<f32>> = logits.iter().map(|l| dense_probs(l, &params)).collect();
    let top_k = budget.min(64);
    let mut sampler = Sampler::new(params);
    let (mut ours, mut logs, mut walks) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        let owned = qs.clone(); // the decoding loop hands its rows over
        let t = Instant::now();
        let st = sampler.sampled_tree(0, owned, budget, top_k);
        ours.push(t.elapsed().as_secs_f64());
        // the reference: the log of every token, ranked, then the same best-first build
        let t = Instant::now();
        let ranked: Vec<Vec<(u32, f32)>> = qs
            .iter()
            .map(|q| {
                let logq: Vec<f32> = q.iter().filter(|&&x| x > 0.0).map(|&x| x.ln()).collect();
                top_k_sorted(&logq, top_k)
                    .into_iter()
                    .enumerate()
                    .map(|(r, (_, l))| (r as u32, l))
                    .collect()
            })
            .collect();
        let shape = DraftTree::build(0, &ranked, budget);
        logs.push(t.elapsed().as_secs_f64());
        assert_eq!(shape.depths, st.tree.depths, "the same shape");
        let t = Instant::now();
        let walked = sampler.walk_sampled_tree(&st, |row| {
            Ok::<_, ()>(logits[st.tree.depths[row].min(block - 2)].clone())
        });
        walks.push(t.elapsed().as_secs_f64());
        assert!(walked.is_ok());
    }
    let (o, l, w) = (median(ours), median(logs), median(walks));
    println!(
        "sampled tree, budget {budget}, {} depths, vocab {vocab}, median of {reps} rounds (1 thread)\n",
        block - 1
    );
    println!("| part | ms per round |\n|---|---|");
    println!(
        "| `sampled_tree` (shape from each depth's top-{top_k} of q, draws) | {:.3} |",
        o * 1e3
    );
    println!(
        "| reference: the shape alone, ranked over ln q of every token | {:.3} |",
        l * 1e3
    );
    println!(
        "| `walk_sampled_tree` (the rows' softmax and the nodes' judgements) | {:.3} |",
        w * 1e3
    );
}
