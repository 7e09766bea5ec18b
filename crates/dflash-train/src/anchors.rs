//! Anchor sampling: positions `i` with `loss_mask[i]` and `loss_mask[i+1]` (the anchor is a
//! response token and the first label is supervised), up to `n`, without replacement, from
//! a seeded RNG. Example: mask [0,0,1,1,1,0] → candidates [2, 3].

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub fn candidates(loss_mask: &[u8]) -> Vec<usize> {
    (0..loss_mask.len().saturating_sub(1))
        .filter(|&i| loss_mask[i] != 0 && loss_mask[i + 1] != 0)
        .collect()
}

/// Up to `n` of these candidates as anchors, sorted, drawn with a ChaCha8 seeded by `seed`.
pub fn sample(mut c: Vec<usize>, n: usize, seed: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let k = n.min(c.len());
    for i in 0..k {
        let j = rng.random_range(i..c.len());
        c.swap(i, j);
    }
    c.truncate(k);
    c.sort_unstable();
    c
}

/// A per-(run, epoch, sequence) seed: anchors are resampled every epoch, reproducibly.
pub fn seed_for(seed: u64, epoch: usize, sequence: usize) -> u64 {
    let mut x = seed
        ^ 0x9E37_79B9_7F4A_7C15u64.wrapping_mul((epoch as u64).wrapping_add(1))
        ^ (sequence as u64).rotate_left(32);
    // splitmix64 finaliser
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_need_two_supervised_tokens() {
        assert_eq!(candidates(&[0, 0, 1, 1, 1, 0]), vec![2, 3]);
        let all = || candidates(&[1; 100]);
        let a = sample(all(), 10, 3);
        assert_eq!(a.len(), 10);
        assert_eq!(a, sample(all(), 10, 3));
        assert_ne!(a, sample(all(), 10, 4));
        assert!(a.windows(2).all(|w| w[0] < w[1]));
    }

    /// The trainer seeds its shuffles with `usize::MAX` as the epoch or sequence: the hash
    /// wraps instead of overflowing (a panic in debug builds before).
    #[test]
    fn seeds_at_the_extremes() {
        let a = seed_for(7, usize::MAX, usize::MAX);
        assert_ne!(a, seed_for(7, usize::MAX - 1, usize::MAX));
        assert_ne!(a, seed_for(7, 0, usize::MAX));
    }
}
