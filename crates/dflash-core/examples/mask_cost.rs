//! Benchmark: host cost of building masks (boolean rule + additive f32), the part of every
//! forward that does not depend on the device.
//! `cargo run --release -p dflash-core --example mask_cost`

use std::time::Instant;

use dflash_core::segments::Segments;
use dflash_core::visibility::{
    draft_training, draft_training_parts, packed, right_aligned, DraftRule,
};

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
    for (slots, cache) in [(128usize, 1600usize), (512, 1600)] {
        time(
            &format!("batched step: {slots} sequences x {cache} cache"),
            5,
            || {
                (0..slots)
                    .map(|s| right_aligned(s * cache / slots, cache, 1, 1).additive())
                    .collect::<Vec<_>>()
            },
        );
    }
    let segs = Segments::from_lengths(&[400; 5]);
    time("packed target mask: 5 x 400 rows, + additive", 3, || {
        packed(&[], &segs.owners()).additive()
    });
    for (anchors, seq) in [(64usize, 400usize), (256, 400), (256, 2048), (512, 2048)] {
        let a: Vec<usize> = (0..anchors).map(|i| i * seq / anchors).collect();
        let segs = Segments::single(seq);
        // what training builds: one context interval per row and the own-block cells
        time(
            &format!("training mask parts: {anchors} anchors x 16, seq {seq}"),
            3,
            || draft_training_parts(DraftRule::FULL, &segs, &a, 16),
        );
        // the dense mask (the reference the tests compare with), as an additive mask
        time("  dense reference + additive", 3, || {
            draft_training(DraftRule::FULL, &segs, &a, 16).additive()
        });
    }
}
