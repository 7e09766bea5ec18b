//! The drafter's rule ([`DraftRule`]) and the masks built from it: one inference block, its
//! fixed-shape placement, and the training row of many blocks.

use std::ops::Range;

use super::Visibility;
use crate::segments::Segments;

/// A key as a drafter query sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKey {
    /// The context feature (target taps) of the committed token at this absolute position.
    Context(usize),
    /// A row of the query's own block, at this absolute position.
    OwnBlock(usize),
    /// A row of another block (training only): never visible.
    OtherBlock,
}

/// The draft visibility rule of one drafter layer.
///
/// `sliding_window = Some(W)` (layers with `layer_types[i] == "sliding_attention"`) follows
/// z-lab's `dflash==0.1.0` exactly: a query at position `q` sees a key at position `k` only
/// when `q - k < W`, and, when the layer is not causal, `k - q < W`. `causal` (the config's
/// top-level `is_causal`; absent: sliding layers causal, full layers not, see
/// [`crate::config::DrafterConfig::layer_rule`]) hides block rows after the query.
/// Example: W = 4, causal, anchor 10, query at 12 sees context 9 (12 - 9 = 3) but not 8, and
/// block rows 10..=12; not causal, it also sees block rows 13..=15.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DraftRule {
    pub sliding_window: Option<usize>,
    pub causal: bool,
}

impl DraftRule {
    /// The full-attention drafter rule: context strictly before the anchor, whole own block.
    pub const FULL: DraftRule = DraftRule {
        sliding_window: None,
        causal: false,
    };

    /// z-lab's rule for a layer with the given sliding window (None = full attention).
    pub fn for_layer(sliding_window: Option<usize>) -> Self {
        match sliding_window {
            None => Self::FULL,
            Some(w) => DraftRule {
                sliding_window: Some(w),
                causal: true,
            },
        }
    }

    /// Does the query at absolute position `query_pos`, in the block anchored at `anchor`,
    /// see `key`? Context keys: exactly [`DraftRule::context_range`] of a lone sequence.
    pub fn sees(&self, anchor: usize, query_pos: usize, key: DraftKey) -> bool {
        match key {
            DraftKey::Context(k) => self.context_range(anchor, query_pos, 0).contains(&k),
            DraftKey::OwnBlock(k) => {
                let ahead_in_window = self.sliding_window.is_none_or(|w| k < query_pos + w);
                (if self.causal {
                    k <= query_pos
                } else {
                    ahead_in_window
                }) && k >= self.window_start(query_pos)
            }
            DraftKey::OtherBlock => false,
        }
    }

    /// The context keys the query at `query_pos` in the block anchored at `anchor` sees: one
    /// interval ending at the anchor (strictly before it, inside the window), cut to keys at
    /// or after `from` (the first row of the query's own sequence in a packed row). The
    /// training masks are built from it with two numbers per row. Example: W = 4, anchor 10,
    /// query 12, from 0 → 9..10; full attention, anchor 10, from 4 → 4..10.
    pub fn context_range(&self, anchor: usize, query_pos: usize, from: usize) -> Range<usize> {
        self.window_start(query_pos).max(from).min(anchor)..anchor
    }

    /// The first key position inside the query's window (`q - k < W`), 0 without a window.
    fn window_start(&self, query_pos: usize) -> usize {
        self.sliding_window
            .map_or(0, |w| (query_pos + 1).saturating_sub(w))
    }
}

/// Inference mask for one block anchored at `anchor`: columns are the `anchor` context keys
/// (draft KV cache rows plus the new context features: positions `0 .. anchor`), then the
/// `block` block keys (positions `anchor .. anchor + block`). Rows are the block's rows.
pub fn draft_inference(rule: DraftRule, anchor: usize, block: usize) -> Visibility {
    let mut v = Visibility::new(block, anchor + block);
    for r in 0..block {
        let q = anchor + r;
        for c in 0..anchor {
            v.set(r, c, rule.sees(anchor, q, DraftKey::Context(c)));
        }
        for j in 0..block {
            v.set(
                r,
                anchor + j,
                rule.sees(anchor, q, DraftKey::OwnBlock(anchor + j)),
            );
        }
    }
    v
}

/// [`draft_inference`] laid out for a fixed-shape draft forward (one CUDA graph for every
/// round) of `cols` key columns: the context keys stay at columns `0 .. anchor`, the block's
/// keys sit at columns `block_at ..` (after the round's context rows padded to a fixed count),
/// every other column is hidden. Each query sees exactly the keys it sees in
/// [`draft_inference`], at their new columns.
/// Example: anchor 3, block 2, [`DraftRule::FULL`], block_at 5, cols 8 → both rows see columns 0,
/// 1, 2, 5 and 6; columns 3, 4 (padding) and 7 are hidden.
pub fn draft_inference_placed(
    rule: DraftRule,
    anchor: usize,
    block: usize,
    block_at: usize,
    cols: usize,
) -> Visibility {
    assert!(
        anchor <= block_at && block_at + block <= cols,
        "draft_inference_placed: the block at {block_at} must follow the {anchor} context keys within {cols} columns"
    );
    let v = draft_inference(rule, anchor, block);
    let mut p = Visibility::new(block, cols);
    for r in 0..block {
        for c in 0..anchor {
            p.set(r, c, v.get(r, c));
        }
        for j in 0..block {
            p.set(r, block_at + j, v.get(r, anchor + j));
        }
    }
    p
}

/// Training mask for many blocks of one training row of `seq_len = segs.len()` tokens:
/// columns are the `seq_len` context features, then the blocks' rows in order (block `j`'s row
/// `r` at column `seq_len + j * block + r`). Rows are the blocks' rows in the same order.
/// Blocks never see each other; context follows [`DraftRule::sees`], from the anchor's own
/// segment only (a packed row holds several sequences, see [`crate::segments`]).
/// Example: anchors [3, 5], B = 2, one segment of 8 → row 0 (block 0, pos 3) sees context
/// 0..=2 and columns 8, 9; row 2 (block 1, pos 5) sees context 0..=4 and columns 10, 11.
/// Packed as segments [0..4, 4..8], row 2 (anchor 5 in segment 1) sees context 4 only.
pub fn draft_training(
    rule: DraftRule,
    segs: &Segments,
    anchors: &[usize],
    block: usize,
) -> Visibility {
    let seq_len = segs.len();
    // other blocks' columns stay hidden (`sees(.., OtherBlock)` is false by the rule); the
    // visible cells are exactly the two parts, placed block-diagonally
    debug_assert!(!rule.sees(0, 0, DraftKey::OtherBlock));
    let (ctx, own) = draft_training_parts(rule, segs, anchors, block);
    let n = anchors.len() * block;
    let mut v = Visibility::new(n, seq_len + n);
    for (row, range) in ctx.into_iter().enumerate() {
        let j = row / block;
        for c in range {
            v.set(row, c, true);
        }
        v.data[row * v.cols + seq_len + j * block..row * v.cols + seq_len + (j + 1) * block]
            .copy_from_slice(&own.data[row * block..(row + 1) * block]);
    }
    v
}

/// The training mask in the two parts that can be visible, for an attention that never
/// computes the always-hidden other-block cells: `context[row]` is the interval of context
/// keys row `j·B + r` sees (the first `seq_len` columns of [`draft_training`], see
/// [`DraftRule::context_range`]) and `own_block` is `[rows, block]`, row `j·B + r` column `c`
/// = may block j's row r see block j's row c. Both from the rule.
/// Example: anchors [3, 5], B = 2, one segment of 8 → context[2] (block 1, pos 5) = 0..5;
/// own_block row 2 sees columns 0 and 1 (positions 5 and 6).
pub fn draft_training_parts(
    rule: DraftRule,
    segs: &Segments,
    anchors: &[usize],
    block: usize,
) -> (Vec<Range<usize>>, Visibility) {
    let n = anchors.len() * block;
    let mut ctx = Vec::with_capacity(n);
    let mut own = Visibility::new(n, block);
    for (j, &a) in anchors.iter().enumerate() {
        // positions are translation-invariant for the rule: row indices inside the segment
        let (start, _) = segs.bounds(a);
        for r in 0..block {
            let row = j * block + r;
            let q = a + r;
            ctx.push(rule.context_range(a, q, start));
            for c in 0..block {
                own.set(row, c, rule.sees(a, q, DraftKey::OwnBlock(a + c)));
            }
        }
    }
    (ctx, own)
}

#[cfg(test)]
mod tests {
    use crate::segments::Segments;
    use crate::visibility::*;

    /// The placed inference mask is the rule's own, moved: the same keys per query, the
    /// padding and the columns past the block hidden (full, sliding-window and causal rules).
    #[test]
    fn placed_inference_mask_moves_the_block_keys() {
        let p = draft_inference_placed(DraftRule::FULL, 3, 2, 5, 8);
        for r in 0..2 {
            let seen: Vec<usize> = (0..8).filter(|&c| p.get(r, c)).collect();
            assert_eq!(seen, vec![0, 1, 2, 5, 6]);
        }
        for rule in [
            DraftRule::FULL,
            DraftRule {
                sliding_window: Some(4),
                causal: false,
            },
            DraftRule {
                sliding_window: None,
                causal: true,
            },
        ] {
            let (anchor, block) = (9, 4);
            let v = draft_inference(rule, anchor, block);
            assert_eq!(
                draft_inference_placed(rule, anchor, block, anchor, anchor + block),
                v
            );
            let p = draft_inference_placed(rule, anchor, block, anchor + 3, anchor + 3 + block + 5);
            for r in 0..block {
                let moved: Vec<usize> = (0..p.cols)
                    .filter(|&c| p.get(r, c))
                    .map(|c| if c >= anchor + 3 { c - 3 } else { c })
                    .collect();
                let want: Vec<usize> = (0..v.cols).filter(|&c| v.get(r, c)).collect();
                assert_eq!(moved, want, "rule {rule:?} row {r}");
            }
        }
    }

    #[test]
    fn anchor_is_not_context() {
        let v = draft_inference(DraftRule::FULL, 37, 16);
        for r in 0..16 {
            assert!((0..37).all(|c| v.get(r, c)));
            assert!((37..53).all(|c| v.get(r, c)));
        }
        // anchor 0: no context at all, the block still sees itself
        let v0 = draft_inference(DraftRule::FULL, 0, 4);
        assert_eq!(v0.cols, 4);
        assert!(v0.data.iter().all(|&b| b));
    }

    #[test]
    fn training_blocks_are_isolated() {
        let v = draft_training(DraftRule::FULL, &Segments::single(8), &[3, 5], 2);
        assert_eq!((v.rows, v.cols), (4, 12));
        let row0: Vec<usize> = (0..12).filter(|&c| v.get(0, c)).collect();
        assert_eq!(row0, vec![0, 1, 2, 8, 9]);
        let row3: Vec<usize> = (0..12).filter(|&c| v.get(3, c)).collect();
        assert_eq!(row3, vec![0, 1, 2, 3, 4, 10, 11]);
    }

    #[test]
    fn packed_training_rows_see_their_own_segment_only() {
        // the docs' example: segments [0..4, 4..8], anchors [3, 5], B = 2
        let segs = Segments::from_lengths(&[4, 4]);
        let v = draft_training(DraftRule::FULL, &segs, &[3, 5], 2);
        let row = |r: usize| (0..12).filter(|&c| v.get(r, c)).collect::<Vec<_>>();
        assert_eq!(row(0), vec![0, 1, 2, 8, 9]);
        assert_eq!(row(2), vec![4, 10, 11]);
        assert_eq!(row(3), vec![4, 10, 11]);
        // a segment's blocks see exactly what they see when the segment is alone, shifted
        for rule in [DraftRule::FULL, DraftRule::for_layer(Some(3))] {
            let packed = draft_training(rule, &segs, &[5], 2);
            let alone = draft_training(rule, &Segments::single(4), &[1], 2);
            for r in 0..2 {
                for c in 0..4 {
                    assert!(!packed.get(r, c), "segment 0 is hidden from segment 1");
                    assert_eq!(packed.get(r, 4 + c), alone.get(r, c));
                }
                for c in 0..2 {
                    assert_eq!(packed.get(r, 8 + c), alone.get(r, 4 + c));
                }
            }
        }
    }

    /// The inference mask equals z-lab 0.1.0's `_attention_mask` (indices into `[context |
    /// block]`, query i at `KL - L + i`) for every window and causality, block larger than the
    /// window included.
    #[test]
    fn inference_mask_is_zlab_attention_mask() {
        for w in [None, Some(1), Some(3), Some(6)] {
            for causal in [false, true] {
                let rule = DraftRule {
                    sliding_window: w,
                    causal,
                };
                let (anchor, block) = (7, 5);
                let v = draft_inference(rule, anchor, block);
                for i in 0..block {
                    let q = anchor + i;
                    for k in 0..anchor + block {
                        let mut vis = !causal || k <= q;
                        if let Some(w) = w {
                            vis &= q < k + w;
                            if !causal {
                                vis &= k < q + w;
                            }
                        }
                        // context strictly before the anchor: z-lab's keys there are the
                        // cache and the new context, all before the block
                        assert_eq!(v.get(i, k), vis, "{rule:?} query {q} key {k}");
                    }
                }
            }
        }
    }

    #[test]
    fn context_range_is_the_rule_written_out() {
        for rule in [
            DraftRule::FULL,
            DraftRule::for_layer(Some(1)),
            DraftRule::for_layer(Some(4)),
        ] {
            for anchor in 0..12 {
                for q in anchor..anchor + 5 {
                    for from in 0..=anchor {
                        let r = rule.context_range(anchor, q, from);
                        for c in 0..20 {
                            // z-lab's rule written out: before the anchor, inside the window
                            let in_window = rule.sliding_window.is_none_or(|w| q < c + w);
                            let want = from <= c && c < anchor && in_window;
                            assert_eq!(
                                rule.sees(anchor, q, DraftKey::Context(c)),
                                c < anchor && in_window
                            );
                            assert_eq!(
                                r.contains(&c),
                                want,
                                "{rule:?} a {anchor} q {q} from {from} c {c}"
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(
            DraftRule::for_layer(Some(4)).context_range(10, 12, 0),
            9..10
        );
        assert_eq!(DraftRule::FULL.context_range(10, 10, 4), 4..10);
    }

    #[test]
    fn sliding_rule_matches_zlab_example() {
        let rule = DraftRule::for_layer(Some(4));
        assert!(rule.sees(10, 12, DraftKey::Context(9)));
        assert!(!rule.sees(10, 12, DraftKey::Context(8)));
        assert!(rule.sees(10, 12, DraftKey::OwnBlock(12)));
        assert!(!rule.sees(10, 12, DraftKey::OwnBlock(13)));
    }

    #[test]
    fn training_mask_equals_the_rule_cell_by_cell() {
        // the fast fill must equal asking the rule about every cell, other blocks included
        for rule in [DraftRule::FULL, DraftRule::for_layer(Some(3))] {
            let (seq_len, anchors, block) = (12, [2usize, 5, 9], 3);
            let v = draft_training(rule, &Segments::single(seq_len), &anchors, block);
            for (j, &a) in anchors.iter().enumerate() {
                for r in 0..block {
                    let row = j * block + r;
                    for c in 0..seq_len {
                        assert_eq!(v.get(row, c), rule.sees(a, a + r, DraftKey::Context(c)));
                    }
                    for (jj, &aa) in anchors.iter().enumerate() {
                        for rr in 0..block {
                            let key = if jj == j {
                                DraftKey::OwnBlock(aa + rr)
                            } else {
                                DraftKey::OtherBlock
                            };
                            let col = seq_len + jj * block + rr;
                            assert_eq!(
                                v.get(row, col),
                                rule.sees(a, a + r, key),
                                "row {row} col {col}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn training_parts_are_the_visible_cells_of_the_dense_mask() {
        for rule in [DraftRule::FULL, DraftRule::for_layer(Some(3))] {
            let (seq_len, anchors, block) = (12, [0usize, 2, 5, 9], 3);
            let dense = draft_training(rule, &Segments::single(seq_len), &anchors, block);
            let (ctx, own) =
                draft_training_parts(rule, &Segments::single(seq_len), &anchors, block);
            for j in 0..anchors.len() {
                for r in 0..block {
                    let row = j * block + r;
                    for c in 0..seq_len {
                        assert_eq!(ctx[row].contains(&c), dense.get(row, c));
                    }
                    for c in 0..block {
                        assert_eq!(own.get(row, c), dense.get(row, seq_len + j * block + c));
                    }
                    // everything else in the dense row is hidden
                    let visible = (0..dense.cols).filter(|&c| dense.get(row, c)).count();
                    let parts = ctx[row].len() + (0..block).filter(|&c| own.get(row, c)).count();
                    assert_eq!(visible, parts);
                }
            }
        }
    }
}
