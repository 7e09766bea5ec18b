//! Which keys a query sees: the one place where every attention mask comes from.
//!
//! The rules live here and nowhere else:
//! - **target (causal)**: a target query at absolute position `p` sees every key at position
//!   `<= p` (cache rows and earlier new rows). Verify of a chain block is this rule.
//! - **draft**: a drafter query in the block anchored at `a` (rows at positions `a .. a+B`)
//!   sees the context keys strictly before the anchor and every key of its own block
//!   (bidirectional). Anchor at 37, B = 16: context rows 0..=36 visible, block rows 37..=52
//!   visible, the context feature at 37 (the anchor's own hidden state) is NOT visible.
//!   Training (many blocks of one sequence, one mask) and inference (one block on top of the
//!   draft KV cache) both build their masks from [`DraftRule::sees`].
//! - **tree**: a tree node sees every committed cache row and its ancestors (itself included),
//!   nothing else; see [`tree`].
//! - **packed**: the target rule applied per sequence when several independent sequences
//!   share one cache row and one forward (packed training sequences); see [`packed`].
//! - **right-aligned**: the target rule for one sequence of a batched cache (batched data
//!   regeneration); see [`right_aligned`].
//!
//! Masks are boolean matrices here; the model turns them into additive masks (0 / -inf).

use std::ops::Range;

use crate::segments::Segments;

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

/// Target rule over `[cache | new rows]`: new row `i` (position `cache_len + i`) sees keys
/// `0 ..= cache_len + i`. Example: cache 3, new 2 → row 0 sees cols 0..=3, row 1 sees 0..=4.
pub fn causal(cache_len: usize, new_len: usize) -> Visibility {
    let mut v = Visibility::new(new_len, cache_len + new_len);
    for r in 0..new_len {
        for c in 0..=cache_len + r {
            v.set(r, c, true);
        }
    }
    v
}

/// Tree rule over `[cache | root, node_1 … node_N]`: `parents[i]` is the parent row of tree
/// row `i` (`None` for the root, row 0). Every row sees all cache rows, itself and its
/// ancestors. Example: parents `[None, Some(0), Some(0), Some(1)]` → row 3 sees rows 0, 1, 3.
pub fn tree(cache_len: usize, parents: &[Option<usize>]) -> Visibility {
    let n = parents.len();
    let mut v = Visibility::new(n, cache_len + n);
    for r in 0..n {
        for c in 0..cache_len {
            v.set(r, c, true);
        }
        let mut cur = Some(r);
        while let Some(i) = cur {
            v.set(r, cache_len + i, true);
            cur = parents[i];
        }
    }
    v
}

/// `v` (`[n, cache_len + n]`) padded to `rows` new rows: each padding row sees the cache and
/// itself, like a tree root; no row sees a padding row. The real rows compute exactly what
/// they compute without the padding (a fixed-shape forward pads a short verify to the shape it
/// was captured with, then drops the padding's outputs and rows).
/// Example: cache 2, causal 2 rows padded to 3 → rows 0, 1 as before (cols 0..=2, 0..=3), row 2
/// sees cols 0, 1, 4.
pub fn pad_rows(v: &Visibility, cache_len: usize, rows: usize) -> Visibility {
    padded(v, cache_len, rows, |p, r| {
        for c in 0..cache_len {
            p.set(r, c, true);
        }
        p.set(r, cache_len + r, true);
    })
}

/// `v` (`[n, cache_len + n]`) grown to `rows` new rows, `pad_row` setting padding row r's keys.
fn padded(
    v: &Visibility,
    cache_len: usize,
    rows: usize,
    pad_row: impl Fn(&mut Visibility, usize),
) -> Visibility {
    let n = v.rows;
    let mut p = Visibility::new(rows.max(n), cache_len + rows.max(n));
    for r in 0..n {
        for c in 0..v.cols {
            p.set(r, c, v.get(r, c));
        }
    }
    for r in n..p.rows {
        pad_row(&mut p, r);
    }
    p
}

/// [`pad_rows`] for a chain: each padding row continues the chain (it sees the cache, every
/// new row before it and itself), so that every row of a causal `v` still sees one interval of
/// keys (what the interval attention reads). No real row sees a padding row; the real rows
/// compute exactly what they compute without the padding.
/// Example: cache 2, causal 2 rows padded to 4 → rows 0..4 see cols 0..=2, 0..=3, 0..=4, 0..=5.
pub fn pad_rows_causal(v: &Visibility, cache_len: usize, rows: usize) -> Visibility {
    padded(v, cache_len, rows, |p, r| {
        for c in 0..=cache_len + r {
            p.set(r, c, true);
        }
    })
}

/// Packed rule over `[cache | new rows]` for several independent sequences decoded in one
/// forward (batch data regeneration): every cache row and every new row belongs to one
/// sequence (`cache_owner`, `new_owner`); a new row sees the cache rows of its own sequence and
/// the earlier-or-same new rows of its own sequence, nothing of any other sequence. Within one
/// sequence this is exactly the target rule [`causal`], provided each sequence's rows are
/// appended in position order (they are: prefill, then one row per step).
/// Example: cache owners [0, 0, 1], new owners [0, 1] → row 0 (seq 0) sees cols 0, 1, 3;
/// row 1 (seq 1) sees cols 2, 4.
pub fn packed(cache_owner: &[usize], new_owner: &[usize]) -> Visibility {
    let c = cache_owner.len();
    let mut v = Visibility::new(new_owner.len(), c + new_owner.len());
    for (r, &o) in new_owner.iter().enumerate() {
        for (col, &co) in cache_owner.iter().enumerate() {
            if co == o {
                v.set(r, col, true);
            }
        }
        for (j, &no) in new_owner[..=r].iter().enumerate() {
            if no == o {
                v.set(r, c + j, true);
            }
        }
    }
    v
}

/// Batched rule, for one sequence of a batched cache whose sequences are right-aligned (each
/// sequence's rows end at the last column; the columns before them are padding or an earlier
/// sequence's leftovers): the sequence holds the last `held` of the `cache_len` cache columns,
/// and its new rows are the last `fresh` of the `new_len` new rows (the first
/// `new_len - fresh` are padding). A sequence row sees its sequence's earlier rows and itself,
/// i.e. the target rule [`causal`] on its own rows; a padding row sees only itself (its
/// softmax stays finite, nothing reads it).
/// Examples: held 2, cache 5, fresh 1 of 1 → row 0 sees cols 3, 4, 5.
/// Prefill of a 2-token prompt padded to 4: held 0, cache 0, fresh 2 of 4 → rows 0 and 1 see
/// only themselves, row 2 sees col 2, row 3 sees cols 2, 3.
pub fn right_aligned(held: usize, cache_len: usize, fresh: usize, new_len: usize) -> Visibility {
    let mut v = Visibility::new(new_len, cache_len + new_len);
    for (r, runs) in right_aligned_runs(held, cache_len, fresh, new_len)
        .into_iter()
        .enumerate()
    {
        for c in runs.into_iter().flatten() {
            v.set(r, c, true);
        }
    }
    v
}

/// The rule of [`right_aligned`], written once: each row's visible columns as two runs, its
/// sequence's cache rows and its new rows (a padding row: itself, and an empty cache run).
fn right_aligned_runs(
    held: usize,
    cache_len: usize,
    fresh: usize,
    new_len: usize,
) -> Vec<[Range<usize>; 2]> {
    assert!(
        held <= cache_len && fresh <= new_len,
        "right_aligned: held {held} of {cache_len}, fresh {fresh} of {new_len}"
    );
    let first_new = new_len - fresh;
    (0..new_len)
        .map(|r| {
            if r < first_new {
                [cache_len..cache_len, cache_len + r..cache_len + r + 1]
            } else {
                [
                    cache_len - held..cache_len,
                    cache_len + first_new..cache_len + r + 1,
                ]
            }
        })
        .collect()
}

/// The rows of [`right_aligned`] as their key intervals, without the dense matrix (the
/// batched engine's prefills and steps): `None` when a row sees two runs (a sequence with cache
/// rows, padding rows and new rows: `held > 0` and `0 < fresh < new_len`).
/// Examples: held 2, cache 5, fresh 1 of 1 → `[3..6]`; held 0, cache 0, fresh 2 of 4 →
/// `[0..1, 1..2, 2..3, 2..4]`.
pub fn right_aligned_rows(
    held: usize,
    cache_len: usize,
    fresh: usize,
    new_len: usize,
) -> Option<Vec<Range<usize>>> {
    right_aligned_runs(held, cache_len, fresh, new_len)
        .into_iter()
        .map(|[c, n]| match (c.is_empty(), c.end == n.start) {
            (true, _) => Some(n),
            (false, true) => Some(c.start..n.end),
            (false, false) => None,
        })
        .collect()
}

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

    #[test]
    fn causal_padding_continues_the_chain() {
        let p = pad_rows_causal(&causal(2, 2), 2, 4);
        assert_eq!(p, causal(2, 4));
        assert!((0..4).all(|r| p.row_interval(r).is_some()));
        // nothing to pad is the same matrix; the real rows never see the padding
        assert_eq!(pad_rows_causal(&causal(3, 5), 3, 5), causal(3, 5));
        let t = tree(1, &[None, Some(0), Some(0)]);
        let pt = pad_rows_causal(&t, 1, 5);
        for r in 0..3 {
            for c in 0..4 {
                assert_eq!(pt.get(r, c), t.get(r, c));
            }
            assert!(!pt.get(r, 4) && !pt.get(r, 5));
        }
    }

    #[test]
    fn padding_rows_are_roots_no_one_sees() {
        let p = pad_rows(&causal(2, 2), 2, 3);
        let rows: Vec<Vec<usize>> = (0..3)
            .map(|r| (0..5).filter(|&c| p.get(r, c)).collect())
            .collect();
        assert_eq!(rows, vec![vec![0, 1, 2], vec![0, 1, 2, 3], vec![0, 1, 4]]);
        // a tree's rows keep their ancestors; nothing to pad is the same matrix
        let t = tree(1, &[None, Some(0), Some(0)]);
        assert_eq!(pad_rows(&t, 1, 3), t);
        let padded = pad_rows(&t, 1, 5);
        assert_eq!(padded, tree(1, &[None, Some(0), Some(0), None, None]));
    }

    use super::*;

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

    #[test]
    fn packed_sequences_are_isolated_and_causal() {
        let v = packed(&[0, 0, 1], &[0, 1]);
        let row0: Vec<usize> = (0..5).filter(|&c| v.get(0, c)).collect();
        let row1: Vec<usize> = (0..5).filter(|&c| v.get(1, c)).collect();
        assert_eq!(row0, vec![0, 1, 3]);
        assert_eq!(row1, vec![2, 4]);
        // one sequence alone is the target rule
        assert_eq!(packed(&[7, 7, 7], &[7, 7]), causal(3, 2));
        assert_eq!(packed(&[], &[0; 5]), causal(0, 5));
        // a prefill of sequence 2 after two others: causal among its own rows only
        let p = packed(&[0, 1, 0], &[2, 2, 2]);
        for r in 0..3 {
            let cols: Vec<usize> = (0..6).filter(|&c| p.get(r, c)).collect();
            assert_eq!(cols, (3..=3 + r).collect::<Vec<_>>());
        }
    }

    #[test]
    fn right_aligned_is_causal_on_the_sequence_rows() {
        // the docs' examples
        let v = right_aligned(2, 5, 1, 1);
        assert_eq!(
            (0..6).filter(|&c| v.get(0, c)).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        let v = right_aligned(0, 0, 2, 4);
        let seen = |r: usize| (0..4).filter(|&c| v.get(r, c)).collect::<Vec<_>>();
        assert_eq!(
            (0..4).map(seen).collect::<Vec<_>>(),
            vec![vec![0], vec![1], vec![2], vec![2, 3]]
        );
        // with no padding and the whole cache held it is exactly the target rule
        assert_eq!(right_aligned(7, 7, 3, 3), causal(7, 3));
    }

    #[test]
    fn tree_sees_ancestors_only() {
        let v = tree(2, &[None, Some(0), Some(0), Some(1)]);
        let row3: Vec<usize> = (0..6).filter(|&c| v.get(3, c)).collect();
        assert_eq!(row3, vec![0, 1, 2, 3, 5]);
        assert!(causal(3, 2).is_causal());
        assert!(!v.is_causal());
    }

    /// `right_aligned_rows` is `right_aligned` read row by row: the same interval for every row,
    /// and `None` exactly where a row of the dense rule is not one interval.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one row, one interval
    fn right_aligned_rows_are_the_dense_rules_intervals() {
        assert_eq!(right_aligned_rows(2, 5, 1, 1), Some(vec![3..6]));
        assert_eq!(
            right_aligned_rows(0, 0, 2, 4),
            Some(vec![0..1, 1..2, 2..3, 2..4])
        );
        for cache in 0..5 {
            for held in 0..=cache {
                for new in 1..5 {
                    for fresh in 0..=new {
                        let dense = right_aligned(held, cache, fresh, new);
                        let rows: Option<Vec<_>> =
                            (0..new).map(|r| dense.row_interval(r)).collect();
                        assert_eq!(
                            right_aligned_rows(held, cache, fresh, new),
                            rows,
                            "held {held}, cache {cache}, fresh {fresh} of {new}"
                        );
                    }
                }
            }
        }
    }
}
