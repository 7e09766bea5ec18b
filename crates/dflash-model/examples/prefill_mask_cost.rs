//! The host side of a batched prefill's attention rule: 16 prompts of 1,024 − 13·i tokens,
//! left-padded to 1,024 rows, as dense boolean matrices (`right_aligned`) read into one key
//! interval per row (`RowIntervals`), against the intervals built directly
//! (`right_aligned_rows`, what the batched engine does).
//! Run: `cargo run --release -p dflash-model --example prefill_mask_cost`.
use dflash_core::visibility::{right_aligned, right_aligned_rows};
use dflash_model::ops::interval_softmax::RowIntervals;

fn main() -> anyhow::Result<()> {
    let p = 1024;
    let mut build = Vec::new();
    let mut scan = Vec::new();
    let mut direct = Vec::new();
    for _ in 0..5 {
        let t0 = std::time::Instant::now();
        let masks: Vec<_> = (0..16)
            .map(|i| right_aligned(0, 0, p - 13 * i, p))
            .collect();
        let t1 = t0.elapsed();
        let iv = RowIntervals::from_visibilities(&masks, &candle_core::Device::Cpu)?;
        anyhow::ensure!(iv.is_some(), "right-aligned rows are intervals");
        build.push(t1.as_secs_f64() * 1e3);
        scan.push((t0.elapsed() - t1).as_secs_f64() * 1e3);
        let t2 = std::time::Instant::now();
        let rows: Vec<_> = (0..16)
            .flat_map(|i| right_aligned_rows(0, 0, p - 13 * i, p).expect("intervals"))
            .collect();
        RowIntervals::from_rows(&rows, 16, p, p, &candle_core::Device::Cpu)?;
        direct.push(t2.elapsed().as_secs_f64() * 1e3);
    }
    direct.sort_by(f64::total_cmp);
    build.sort_by(f64::total_cmp);
    scan.sort_by(f64::total_cmp);
    println!(
        "16 prompts × {p} rows: dense masks {:.2} ms, intervals from them {:.2} ms; intervals built directly {:.3} ms (medians of 5)",
        build[2], scan[2], direct[2]
    );
    Ok(())
}
