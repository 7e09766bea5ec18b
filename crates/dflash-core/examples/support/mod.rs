//! What the host-side examples share: their numeric arguments, a median, and drafter-like rows
//! of logits (a few confident tokens over a noisy floor).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The command line's numbers, in order.
pub fn numeric_args() -> Vec<usize> {
    std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("numbers"))
        .collect()
}

/// `rows` rows of `vocab` logits from seed 0: uniform noise in [0, 4), one token raised by 14
/// and seven by 6–10.
pub fn drafter_like_rows(rows: usize, vocab: usize) -> Vec<Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    (0..rows)
        .map(|_| {
            let mut r: Vec<f32> = (0..vocab).map(|_| rng.random::<f32>() * 4.0).collect();
            let top1 = rng.random_range(0..vocab);
            r[top1] += 14.0;
            for _ in 0..7 {
                let i = rng.random_range(0..vocab);
                r[i] += 6.0 + 4.0 * rng.random::<f32>();
            }
            r
        })
        .collect()
}
