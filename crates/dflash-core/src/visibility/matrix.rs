//! The boolean visibility matrix, and its rows read as the fused kernels take them (one
//! interval, an interval and a window of bits, runs).

use std::ops::Range;

use super::causal;

/// The columns past a row's interval that [`Visibility::row_window`] describes by bits: a tree
/// of up to 65 nodes (the root always in the interval) fits.
pub const WINDOW: usize = 64;

/// Whether a row given as [`Visibility::row_window`]'s interval `iv` and window `bits` sees
/// column `c`: `c` in `iv`, or `c = iv.end + i` with bit `i` set. Example: `(0..6, 0b110)` sees
/// columns 0–5, 7 and 8.
pub fn window_sees(iv: &Range<usize>, bits: u64, c: usize) -> bool {
    iv.contains(&c) || (c >= iv.end && c - iv.end < WINDOW && bits >> (c - iv.end) & 1 == 1)
}

/// A boolean visibility matrix, row-major `[rows, cols]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visibility {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<bool>,
}

impl Visibility {
    pub fn new(rows: usize, cols: usize) -> Self {
        Self {
            rows,
            cols,
            data: vec![false; rows * cols],
        }
    }
    pub fn get(&self, r: usize, c: usize) -> bool {
        self.data[r * self.cols + c]
    }
    pub fn set(&mut self, r: usize, c: usize, v: bool) {
        self.data[r * self.cols + c] = v;
    }
    /// The additive mask: 0 where visible, -inf where hidden.
    pub fn additive(&self) -> Vec<f32> {
        self.data
            .iter()
            .map(|&v| if v { 0.0 } else { f32::NEG_INFINITY })
            .collect()
    }
    /// Row `r`'s visible columns when they form one interval (`0..0` when none); `None`
    /// otherwise. Fused kernels take a row's visibility as an interval. Example: causal(2, 2)
    /// row 1 → `Some(0..4)`; a tree row seeing columns 0 and 2 only → `None`.
    pub fn row_interval(&self, r: usize) -> Option<Range<usize>> {
        let row = &self.data[r * self.cols..(r + 1) * self.cols];
        let Some(lo) = row.iter().position(|&v| v) else {
            return Some(0..0);
        };
        let hi = lo + row[lo..].iter().take_while(|&&v| v).count();
        row[hi..].iter().all(|&v| !v).then_some(lo..hi)
    }
    /// Row `r`'s visible columns as one interval `lo..hi` (its first run; `0..0` when it sees
    /// none) and a window of the [`WINDOW`] columns from `hi` (bit `i` = column `hi + i`), or
    /// `None` when a visible column lies past the window. The tree kernels take a tree's verify
    /// row this way: the committed cache and the first ancestors as the interval, the other
    /// ancestors as bits. Example: tree(5, [None, Some(0), Some(0), Some(2)]) row 3 (column 8,
    /// parent at 7 under the root at 5) → `(0..6, 0b110)`; a causal row → `(0..hi, 0)`.
    pub fn row_window(&self, r: usize) -> Option<(Range<usize>, u64)> {
        let row = &self.data[r * self.cols..(r + 1) * self.cols];
        let Some(lo) = row.iter().position(|&v| v) else {
            return Some((0..0, 0));
        };
        let hi = lo + row[lo..].iter().take_while(|&&v| v).count();
        let mut bits = 0u64;
        for (i, _) in row[hi..].iter().enumerate().filter(|(_, &v)| v) {
            if i >= WINDOW {
                return None;
            }
            bits |= 1 << i;
        }
        Some((lo..hi, bits))
    }
    /// Row `r`'s visible columns as maximal runs, in column order. Example: a tree node at
    /// depth 2 over cache 5 whose parent sits at column 5 and itself at 7 (a sibling of the
    /// parent at 6) → `[0..6, 7..8]`; a causal row → one run.
    pub fn row_runs(&self, r: usize) -> Vec<Range<usize>> {
        let row = &self.data[r * self.cols..(r + 1) * self.cols];
        let mut runs: Vec<Range<usize>> = Vec::new();
        for (c, _) in row.iter().enumerate().filter(|(_, &v)| v) {
            match runs.last_mut() {
                Some(last) if last.end == c => last.end = c + 1,
                _ => runs.push(c..c + 1),
            }
        }
        runs
    }
    /// Rows `r` of this matrix, every column kept: the visibility of those queries alone (the
    /// keys they see do not depend on which other queries run). Example: the draft rule at
    /// anchor 37, B = 16, rows 1..5 → 4 rows over the same 53 columns, row 0 of the result
    /// being the block's row 1 (context 0..=36 and block 37..=52 visible).
    pub fn select_rows(&self, r: Range<usize>) -> Visibility {
        Visibility {
            rows: r.len(),
            cols: self.cols,
            data: self.data[r.start * self.cols..r.end * self.cols].to_vec(),
        }
    }
    /// True when this is exactly the causal mask over `[cache | new rows]`, in which case a
    /// model may use a cheaper causal path.
    pub fn is_causal(&self) -> bool {
        let cache = self.cols.saturating_sub(self.rows);
        self.cols >= self.rows && *self == causal(cache, self.rows)
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Range;

    use crate::segments::Segments;
    use crate::visibility::*;

    #[test]
    fn selected_rows_keep_their_keys() {
        let v = draft_inference(DraftRule::FULL, 37, 16);
        let s = v.select_rows(1..5);
        assert_eq!((s.rows, s.cols), (4, 53));
        for r in 0..4 {
            for c in 0..53 {
                assert_eq!(s.get(r, c), v.get(r + 1, c), "row {r} col {c}");
            }
        }
        // the block's row 1: context 0..=36 and the whole block 37..=52
        assert_eq!(s.row_runs(0), vec![0..53]);
        assert_eq!(v.select_rows(3..3).rows, 0);
    }

    #[test]
    fn row_runs_of_a_tree_and_a_causal_row() {
        // cache 5; nodes: 0 root-child (col 5), 1 its sibling (col 6), 2 child of node 0 (col 7)
        let v = tree(5, &[None, None, Some(0)]);
        assert_eq!(v.row_runs(2), vec![0..6, 7..8]);
        assert_eq!(v.row_runs(1), vec![0..5, 6..7]);
        assert_eq!(causal(3, 2).row_runs(1), vec![0..5]);
        assert_eq!(
            Visibility::new(1, 4).row_runs(0),
            Vec::<Range<usize>>::new()
        );
    }

    /// Every row of a tree's verify (padded too) is its interval and window, and the window
    /// gives back exactly the row's visible columns; a column past the window has none.
    #[test]
    fn row_windows_give_back_the_rows() {
        let v = tree(5, &[None, Some(0), Some(0), Some(2)]);
        assert_eq!(v.row_window(3), Some((0..6, 0b110)));
        assert_eq!(v.row_window(0), Some((0..6, 0)));
        assert_eq!(causal(3, 2).row_window(1), Some((0..5, 0)));
        assert_eq!(Visibility::new(1, 4).row_window(0), Some((0..0, 0)));
        // a chain under the root's second child (column 7): row 64 sees 0..6 (cache, root) and
        // columns 7..=69, bits 1..=63; row 65 sees column 70, past the window
        let mut parents = vec![None, Some(0), Some(0)];
        parents.extend((3..66).map(|i| Some(i - 1)));
        let deep = tree(5, &parents);
        assert_eq!(deep.row_window(64).map(|w| w.1.leading_zeros()), Some(0));
        assert_eq!(deep.row_window(65), None, "column 70 is past the window");
        let padded = pad_rows(&tree(2, &[None, Some(0), None]), 2, 6);
        for r in 0..padded.rows {
            let (iv, bits) = padded.row_window(r).unwrap();
            for c in 0..padded.cols {
                assert_eq!(
                    window_sees(&iv, bits, c),
                    padded.get(r, c),
                    "row {r} column {c}"
                );
            }
        }
    }

    #[test]
    fn row_intervals() {
        let c = causal(2, 2);
        assert_eq!(c.row_interval(1), Some(0..4));
        assert_eq!(c.row_interval(0), Some(0..3));
        let t = tree(0, &[None, Some(0), Some(0)]); // row 2 sees 0 and 2, not 1
        assert_eq!(t.row_interval(2), None);
        assert_eq!(Visibility::new(1, 3).row_interval(0), Some(0..0));
        // every training row's own-block visibility is one interval, for both rules
        let segs = Segments::single(12);
        for rule in [DraftRule::FULL, DraftRule::for_layer(Some(2))] {
            let (_, own) = draft_training_parts(rule, &segs, &[0, 4, 9], 4);
            assert!(
                (0..own.rows).all(|r| own.row_interval(r).is_some()),
                "{rule:?}"
            );
        }
    }
}
