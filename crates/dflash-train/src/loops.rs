//! Stored responses cut where they start repeating themselves, by the rule of
//! [`dflash_core::loops`] (the one `data generate --loop-window` stops decoding by).
//!
//! Example: response `a b c d a b c d a b`, `w` = 3 → `a b c d a b c`.

pub use dflash_core::loops::keep_until_loop;

use crate::data::Sequence;

/// `s` cut after its response's first repeated `w`-token window (the prompt, every token
/// before the first supervised one, is kept whole). Returns the supervised tokens dropped.
pub fn cut_loop(s: &mut Sequence, w: usize) -> usize {
    let start = s.prompt_len();
    let keep = keep_until_loop(&s.ids[start..], w);
    let dropped = s.loss_mask[start + keep..]
        .iter()
        .filter(|&&m| m != 0)
        .count();
    s.ids.truncate(start + keep);
    s.loss_mask.truncate(start + keep);
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_keeps_its_prompt_and_the_first_repeat() {
        // prompt 3 tokens, response 1 2 1 2 1 2 (w = 2: "1 2" repeats at 2 → keep 4)
        let mut s = Sequence {
            ids: vec![7, 8, 9, 1, 2, 1, 2, 1, 2],
            loss_mask: vec![0, 0, 0, 1, 1, 1, 1, 1, 1],
        };
        assert_eq!(cut_loop(&mut s, 2), 2);
        assert_eq!(s.ids, vec![7, 8, 9, 1, 2, 1, 2]);
        assert_eq!(s.loss_mask, vec![0, 0, 0, 1, 1, 1, 1]);
    }
}
