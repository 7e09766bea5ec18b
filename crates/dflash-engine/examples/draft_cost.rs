//! Benchmark: cost of one inference draft (the bundled SmolLM2 drafter, its draft vocabulary,
//! 8-bit products as `generate` loads it) against the positions it reads, on a warm draft cache.
//! `cargo run --release -p dflash-engine --example draft_cost -- [context=512] [reps=201]`
//! Each repeat drafts a 16-block anchored at `context` from 3 new context rows (a typical
//! round's), the positions interleaved; prints the median ms per draft. Run it with and without
//! `DFLASH_DISABLED_KERNELS=draft-last-rows` (the last layer on the whole block) to see what reading fewer rows
//! saves (bench/draft_last_rows.sh).

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use dflash_model::io::loader::{bundled_drafter, load_target};
use dflash_model::models::draft_vocab::DraftHead;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_model::{Rows, Target};

fn main() -> Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let context: usize = a.first().map(|s| s.parse()).transpose()?.unwrap_or(512);
    let reps: usize = a.get(1).map(|s| s.parse()).transpose()?.unwrap_or(201);
    let lt = load_target("smollm2-135m", DType::F32, &Device::Cpu)?;
    let t = &lt.target;
    let dir = bundled_drafter("smollm2-135m").context("the bundled drafter")?;
    let d = dflash_model::cpu::q8::with_choice(true, || Drafter::load_dir(&dir, t))?;
    let head = d
        .draft_vocab
        .as_ref()
        .map(|v| DraftHead::new(t, v))
        .transpose()?;
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| 200 + (i * 7919) % 20000)
        .collect();
    let mut tc = t.new_cache();
    let out = t.forward_causal(&prompt, &mut tc, &d.target_layer_ids, &Rows::None)?;
    let taps = Target::concat_taps(&out.taps)?.unsqueeze(0)?;
    let mut cache = d.new_cache();
    let warm = context - 3;
    let at = |positions| BlockAt {
        token: prompt[context - 1],
        anchor: context,
        block: d.block_size,
        positions,
    };
    // the draft cache of the first context rows, then rounds of the last 3
    d.draft(
        t,
        head.as_ref(),
        &mut cache,
        &taps.narrow(1, 0, context)?,
        at(1),
    )?;
    cache.truncate(warm)?;
    let new_rows = taps.narrow(1, warm, 3)?;
    let cases = [1usize, 3, 4, 8, 15];
    let mut times = vec![Vec::with_capacity(reps); cases.len()];
    for _ in 0..reps {
        for (i, &p) in cases.iter().enumerate() {
            let s = Instant::now();
            d.draft(t, head.as_ref(), &mut cache, &new_rows, at(p))?;
            times[i].push(s.elapsed().as_secs_f64() * 1e3);
            cache.truncate(warm)?;
        }
    }
    let whole = dflash_core::runtime::off(dflash_core::runtime::Kernel::DraftLastRows);
    println!(
        "draft cost, context {context}, block {}, last layer on {}, median of {reps}",
        d.block_size,
        if whole {
            "the whole block"
        } else {
            "the rows read"
        }
    );
    println!("| positions | ms / draft |");
    println!("|---|---|");
    for (p, mut ts) in cases.iter().zip(times) {
        ts.sort_by(f64::total_cmp);
        println!("| {p} | {:.3} |", ts[ts.len() / 2]);
    }
    Ok(())
}
