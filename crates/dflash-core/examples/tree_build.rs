//! Benchmark: DDTree construction on the host.
//! `cargo run --release -p dflash-core --example tree_build -- [budget=512] [block=16] [vocab=151936] [reps=200]`
//! Times (1) the top-K selection over full-vocabulary rows (K = budget; the decoding loop gets
//! log-probabilities from the device) and (2) the best-first build from those top-K lists,
//! median over `reps`.

use std::time::Instant;

use dflash_core::tree::{top_k_sorted, DraftTree};
#[path = "support/mod.rs"]
mod support;
use support::{drafter_like_rows, median, numeric_args};

fn main() {
    let a = numeric_args();
    let budget = *a.first().unwrap_or(&512);
    let block = *a.get(1).unwrap_or(&16);
    let vocab = *a.get(2).unwrap_or(&151_936);
    let reps = *a.get(3).unwrap_or(&200);
    // drafter-like rows: a few confident tokens over a noisy floor
    let rows = drafter_like_rows(block - 1, vocab);
    let mut topk_t = Vec::new();
    let mut top = Vec::new();
    for _ in 0..reps.min(20) {
        let t = Instant::now();
        top = rows
            .iter()
            .map(|r| top_k_sorted(r, budget))
            .collect::<Vec<_>>();
        topk_t.push(t.elapsed().as_secs_f64());
    }
    let mut build_t = Vec::new();
    let mut tree = DraftTree::chain(0, &[]);
    for _ in 0..reps {
        let t = Instant::now();
        tree = DraftTree::build(1, &top, budget);
        build_t.push(t.elapsed().as_secs_f64());
    }
    let depth = tree.depths.iter().max().unwrap();
    println!(
        "budget {budget}, block {block}, vocab {vocab}: top-K on host {:.3} ms ({} rows), build {:.4} ms ({} nodes, depth {depth})",
        median(topk_t) * 1e3,
        block - 1,
        median(build_t) * 1e3,
        tree.len() - 1
    );
}
