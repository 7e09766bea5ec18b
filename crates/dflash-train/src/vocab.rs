//! A drafter's vocabulary subset from the training data: the most frequent supervised tokens
//! ([`dflash_model::models::draft_vocab`]).
//!
//! Example: supervised tokens `7 7 7 3 3 9`, size 2 → `[3, 7]` (ascending), coverage 5 / 6.

use std::collections::HashMap;

use crate::data::Sequence;

/// The `size` most frequent supervised tokens of `seqs` (ties: the lower id), ascending, and
/// the share of supervised tokens they hold.
pub fn frequent_tokens(seqs: &[Sequence], size: usize) -> (Vec<u32>, f64) {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for s in seqs {
        for (&t, &m) in s.ids.iter().zip(&s.loss_mask) {
            if m != 0 {
                *counts.entry(t).or_default() += 1;
            }
        }
    }
    let total: usize = counts.values().sum();
    let mut ranked: Vec<(u32, usize)> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.truncate(size);
    let kept: usize = ranked.iter().map(|&(_, c)| c).sum();
    let mut ids: Vec<u32> = ranked.into_iter().map(|(t, _)| t).collect();
    ids.sort_unstable();
    (ids, kept as f64 / total.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_docs_example() {
        let s = Sequence {
            ids: vec![1, 7, 7, 7, 3, 3, 9],
            loss_mask: vec![0, 1, 1, 1, 1, 1, 1],
        };
        let (ids, cov) = frequent_tokens(&[s], 2);
        assert_eq!(ids, vec![3, 7]);
        assert!((cov - 5.0 / 6.0).abs() < 1e-12);
        // prompt tokens do not count; a tie keeps the lower id
        let s = Sequence {
            ids: vec![4, 4, 4, 8, 6],
            loss_mask: vec![0, 0, 0, 1, 1],
        };
        assert_eq!(frequent_tokens(&[s], 1).0, vec![6]);
    }
}
