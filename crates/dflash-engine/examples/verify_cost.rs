//! Benchmark: cost of one target verify forward vs tree budget, on a warm cache.
//! `cargo run --release -p dflash-engine --example verify_cost -- [target=smollm2-135m] [cache=512] [reps=3] [max_rows]`
//! (`max_rows`: only the proposals of at most that many rows, e.g. 16 for profiling the chain;
//! `MIN_ROWS=5` in the environment: only those of at least that many, e.g. to profile one case).
//! Prints ms per forward for AR (1 row), a DFlash chain of 16 and DDTree budgets 4 … 512.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device};
use dflash_core::tree::DraftTree;
use dflash_model::io::loader::load_target;
use dflash_model::Rows;

fn main() -> Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let target = a.first().cloned().unwrap_or_else(|| "smollm2-135m".into());
    let cache_len: usize = a.get(1).map(|s| s.parse()).transpose()?.unwrap_or(512);
    let reps: usize = a.get(2).map(|s| s.parse()).transpose()?.unwrap_or(3);
    let max_rows: usize = a
        .get(3)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(usize::MAX);
    let lt = load_target(&target, DType::F32, &Device::Cpu)?;
    let t = &lt.target;
    let prompt: Vec<u32> = (0..cache_len as u32)
        .map(|i| 200 + (i * 7919) % 20000)
        .collect();
    let mut cache = t.new_cache();
    t.forward_causal(&prompt, &mut cache, &[], &Rows::None)?;
    let taps = [1usize, 8, 14, 20, 27].map(|x| x.min(t.num_layers() - 1));
    let mut cases: Vec<(String, DraftTree)> = vec![
        ("ar (1 row)".into(), DraftTree::chain(5, &[])),
        (
            "dflash chain B=16".into(),
            DraftTree::chain(5, &(0..15).map(|i| 300 + i).collect::<Vec<_>>()),
        ),
    ];
    for budget in [4usize, 8, 16, 32, 64, 128, 256, 512] {
        // a tree of typical shape: geometric-ish top-K over 15 depths
        let top: Vec<Vec<(u32, f32)>> = (0..15)
            .map(|d| {
                (0..budget.min(64))
                    .map(|r| (400 + (d * 64 + r) as u32, -0.3 * r as f32 - 0.05 * d as f32))
                    .collect()
            })
            .collect();
        cases.push((
            format!("ddtree budget {budget}"),
            DraftTree::build(5, &top, budget),
        ));
    }
    println!("target {target}, cache {cache_len} rows, f32 CPU, median of {reps}");
    println!("| proposal | rows | ms / verify forward |");
    println!("|---|---|---|");
    let min_rows: usize = std::env::var("MIN_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    for (name, tree) in cases
        .into_iter()
        .filter(|(_, t)| t.len() <= max_rows && t.len() >= min_rows)
    {
        let mut times = Vec::new();
        for _ in 0..reps {
            let tt = Instant::now();
            t.forward(
                &tree.tokens,
                &tree.positions(cache_len),
                &tree.visibility(cache_len),
                &mut cache,
                &taps,
                &Rows::All,
            )?;
            times.push(tt.elapsed().as_secs_f64() * 1e3);
            cache.truncate(cache_len)?;
        }
        times.sort_by(f64::total_cmp);
        println!("| {name} | {} | {:.1} |", tree.len(), times[reps / 2]);
    }
    Ok(())
}
