//! Packed training rows: several sequences concatenated into one row, each a segment with its
//! own positions. Every rule sees a packed row as its segments side by side: the target rule
//! per segment ([`crate::visibility::packed`]), the draft rule with context keys from the
//! anchor's own segment only ([`crate::visibility::draft_training_parts`]), labels up to the
//! anchor's segment end.
//!
//! Example: sequences of 5 and 3 tokens → starts [0, 5], length 8; row 6 is in segment 1, at
//! position 1; an anchor at 6 sees context rows 5 only, and its labels stop at row 7.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segments {
    /// The first row of each segment, ascending, starting at 0.
    starts: Vec<usize>,
    len: usize,
}

impl Segments {
    /// One sequence of `len` rows (no packing): positions are row indices.
    pub fn single(len: usize) -> Self {
        Self {
            starts: vec![0],
            len,
        }
    }

    /// Segments of these lengths, side by side. Example: [5, 3] → starts [0, 5], length 8.
    pub fn from_lengths(lengths: &[usize]) -> Self {
        let mut starts = Vec::with_capacity(lengths.len());
        let mut at = 0;
        for &l in lengths {
            starts.push(at);
            at += l;
        }
        if starts.is_empty() {
            starts.push(0);
        }
        Self { starts, len: at }
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn count(&self) -> usize {
        self.starts.len()
    }
    pub fn starts(&self) -> &[usize] {
        &self.starts
    }

    /// The segment of row `i`.
    pub fn segment_of(&self, i: usize) -> usize {
        self.starts.partition_point(|&s| s <= i) - 1
    }
    /// Rows `start .. end` of the segment holding row `i`.
    pub fn bounds(&self, i: usize) -> (usize, usize) {
        let k = self.segment_of(i);
        let end = self.starts.get(k + 1).copied().unwrap_or(self.len);
        (self.starts[k], end)
    }
    /// The position of row `i` inside its own sequence.
    pub fn position(&self, i: usize) -> usize {
        i - self.bounds(i).0
    }
    /// The positions of every row.
    pub fn positions(&self) -> Vec<usize> {
        (0..self.len).map(|i| self.position(i)).collect()
    }
    /// The segment of every row (the owners of [`crate::visibility::packed`]).
    pub fn owners(&self) -> Vec<usize> {
        (0..self.len).map(|i| self.segment_of(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_docs_example() {
        let s = Segments::from_lengths(&[5, 3]);
        assert_eq!(s.starts(), &[0, 5]);
        assert_eq!(s.len(), 8);
        assert_eq!(
            (s.segment_of(6), s.position(6), s.bounds(6)),
            (1, 1, (5, 8))
        );
        assert_eq!(s.positions(), vec![0, 1, 2, 3, 4, 0, 1, 2]);
        assert_eq!(s.owners(), vec![0, 0, 0, 0, 0, 1, 1, 1]);
        assert_eq!(Segments::single(4).positions(), vec![0, 1, 2, 3]);
        assert_eq!(Segments::single(4).bounds(3), (0, 4));
    }
}
