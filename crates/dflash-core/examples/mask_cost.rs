//! Benchmark: host cost of building masks (boolean rule + additive f32), the part of every
//! forward that does not depend on the device.
//! `cargo run --release -p dflash-core --example mask_cost`

use std::time::Instant;

use dflash_core::visibility::{draft_training, packed, DraftRule};

fn time<T>(label: &str, reps: usize, mut f: impl FnMut() -> T) {
    let t = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(f());
    }
    println!(
        "{label:<48} {:>9.2} ms",
        t.elapsed().as_secs_f64() * 1e3 / reps as f64
    );
}

fn main() {
    for (slots, per_seq) in [(64usize, 400usize), (128, 400)] {
        let owners: Vec<usize> = (0..slots * per_seq).map(|r| r % slots).collect();
        let ids: Vec<usize> = (0..slots).collect();
        time(
            &format!("packed step: {slots} rows x {} cache", owners.len()),
            5,
            || packed(&owners, &ids),
        );
        let v = packed(&owners, &ids);
        time("  + additive", 5, || v.additive());
    }
    for (anchors, seq) in [(64usize, 400usize), (256, 400), (256, 2048)] {
        let a: Vec<usize> = (0..anchors).map(|i| i * seq / anchors).collect();
        time(
            &format!("training mask: {anchors} anchors x 16, seq {seq}"),
            3,
            || draft_training(DraftRule::FULL, seq, &a, 16),
        );
        let v = draft_training(DraftRule::FULL, seq, &a, 16);
        time("  + additive", 3, || v.additive());
    }
}
