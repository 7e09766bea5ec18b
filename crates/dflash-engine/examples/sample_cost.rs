//! Benchmark: the cost of drawing one token at T > 0 from a real target's logits.
//! `cargo run --release -p dflash-engine --example sample_cost -- [target=smollm2-135m] [reps=200]`
//! Prefills a chat prompt (f32, CPU), takes the target's logits at each of its positions and
//! times `Sampler::sample` (ranking only as far as the draw needs) against the full sort of
//! `sampling_probs` that defines it, at T = 1 (top-p 1) and T = 0.7 with top-p 0.9; both draw the
//! same token (checked on every row).

use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::{DType, Device};
use dflash_core::sampling::{draw, sampling_probs, Sampler, SamplingParams};
use dflash_model::io::loader::load_target;
use dflash_model::io::tokenizer::ChatMessage;
use dflash_model::Rows;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn main() -> Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let target = a.first().cloned().unwrap_or_else(|| "smollm2-135m".into());
    let reps: usize = a.get(1).map(|s| s.parse()).transpose()?.unwrap_or(200);
    let lt = load_target(&target, DType::F32, &Device::Cpu)?;
    let text = lt.tokenizer.apply_chat_template(&[ChatMessage {
        role: "user".into(),
        content:
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many \
                  clips in May. How many clips did Natalia sell altogether in April and May?"
                .into(),
    }])?;
    let ids = lt.tokenizer.encode(&text, false)?;
    let mut cache = lt.target.new_cache();
    let out = lt
        .target
        .forward_causal(&ids, &mut cache, &[], &Rows::All)?;
    let rows = out
        .logits
        .expect("logits of every row")
        .squeeze(0)?
        .to_vec2::<f32>()?;
    println!(
        "target {target}, {} logit rows of {} tokens, {reps} draws per row and method",
        rows.len(),
        rows[0].len()
    );
    // what the previous release normalised by: an f32 sum of the softmax weights in rank order
    let worst = rows
        .iter()
        .map(|r| {
            let max = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut w: Vec<f32> = r.iter().map(|&l| (l - max).exp()).collect();
            let exact: f64 = w.iter().map(|&x| x as f64).sum();
            w.sort_by(|a, b| b.total_cmp(a));
            let ranked: f32 = w.iter().sum();
            (ranked as f64 / exact - 1.0).abs()
        })
        .fold(0.0, f64::max);
    println!("the previous release's normaliser (f32, rank order) at T = 1: up to {worst:.1e} off");
    println!("| T | top-p | lazy ranking µs / draw | full sort µs / draw | ratio |");
    println!("|---|---|---|---|---|");
    for (t, top_p) in [(1.0, 1.0), (0.7, 0.9)] {
        let p = SamplingParams::new(t, top_p, 0, 1)?;
        let mut s = Sampler::new(p);
        let t0 = Instant::now();
        let lazy: Vec<u32> = (0..reps)
            .flat_map(|_| rows.iter().map(|r| s.sample(r)).collect::<Vec<_>>())
            .collect();
        let lazy_us = t0.elapsed().as_secs_f64() * 1e6 / (reps * rows.len()) as f64;
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let t0 = Instant::now();
        let full: Vec<u32> = (0..reps)
            .flat_map(|_| {
                rows.iter()
                    .map(|r| draw(&sampling_probs(r, &p), rng.random()))
                    .collect::<Vec<_>>()
            })
            .collect();
        let full_us = t0.elapsed().as_secs_f64() * 1e6 / (reps * rows.len()) as f64;
        ensure!(lazy == full, "the two methods drew different tokens");
        println!(
            "| {t} | {top_p} | {lazy_us:.0} | {full_us:.0} | {:.1}× |",
            full_us / lazy_us
        );
    }
    Ok(())
}
