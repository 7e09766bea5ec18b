//! Time `x · Wᵀ` for few rows: candle's matmul (candle_nn's `Linear`) against dflash-rs's
//! [`dflash_model::layers::linear::Linear`] at SmolLM2-135M's shapes, f32, CPU.
//!
//! `RAYON_NUM_THREADS=2 cargo run --release -p dflash-model --example linear_probe`
//!
//! Each shape cycles through enough distinct weight matrices (≈ 400 MB) that they come from
//! memory, not from the cache, as in a forward of the whole model. GB/s = weight bytes / time;
//! GFMA/s = rows × weight elements / time. With `HOT=1` one matrix is reused, so that it stays
//! in the caches: the kernel's arithmetic alone.

use candle_core::{Device, Module, Tensor};
use std::time::Instant;

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let hot = std::env::var("HOT").is_ok_and(|v| v == "1");
    println!(
        "| W | rows | candle ms | candle GB/s | dflash-rs ms | dflash-rs GB/s | dflash-rs GFMA/s |"
    );
    println!("|---|---|---|---|---|---|---|");
    // up_proj, down_proj, the LM head
    for &(n, k, copies) in &[
        (1536usize, 576usize, 120usize),
        (576, 1536, 120),
        (49152, 576, 4),
    ] {
        let reps = copies * 4;
        let copies = if hot { 1 } else { copies };
        let ws: Vec<Tensor> = (0..copies)
            .map(|_| Tensor::randn(0f32, 1., (n, k), &dev))
            .collect::<candle_core::Result<_>>()?;
        let ours: Vec<_> = ws
            .iter()
            .map(|w| dflash_model::layers::linear::Linear::new(w.clone(), None))
            .collect();
        let theirs: Vec<_> = ws
            .iter()
            .map(|w| candle_nn::Linear::new(w.clone(), None))
            .collect();
        // the first call of a Linear re-lays its weights as panels: not part of the timing
        let x1 = Tensor::randn(0f32, 1., (1, 1, k), &dev)?;
        for l in &ours {
            l.forward(&x1)?;
        }
        let gbs = |secs: f64| (n * k * 4) as f64 / secs / 1e9;
        for &m in &[1usize, 2, 4, 8, 9, 16, 32, 64, 256] {
            let x = Tensor::randn(0f32, 1., (1, m, k), &dev)?;
            let t = Instant::now();
            for r in 0..reps {
                theirs[r % copies].forward(&x)?;
            }
            let c = t.elapsed().as_secs_f64() / reps as f64;
            let t = Instant::now();
            for r in 0..reps {
                ours[r % copies].forward(&x)?;
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "| [{n}, {k}] | {m} | {:.3} | {:.1} | {:.3} | {:.1} | {:.1} |",
                c * 1e3,
                gbs(c),
                s * 1e3,
                gbs(s),
                (m * n * k) as f64 / s / 1e9
            );
        }
    }
    Ok(())
}
