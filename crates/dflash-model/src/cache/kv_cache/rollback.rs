//! Rolling the cache back: keeping its first rows (a chain's rejected drafts, a padded
//! forward's padding) or selected rows (a tree's committed path).

use candle_core::{Result, Tensor};

use super::KvCache;

impl KvCache {
    /// Keep the first `len` rows (rollback after a partially accepted chain). Linear-attention
    /// layers install the state after row `len - 1`, which must lie in the last forward.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.cut(len, true)
    }

    /// Drop the rows of the last forward from `len` on, as padding (a padded fixed-shape
    /// forward's extra rows): like [`KvCache::truncate`] for attention layers, while
    /// linear-attention layers keep the remaining rows of the last forward pending (to be
    /// settled by the next rollback or forward) instead of settling them.
    /// Example: a 16-row padded verify of 5 real rows at cache 40 → 45 rows, 5 pending.
    pub fn drop_padding(&mut self, len: usize) -> Result<()> {
        self.cut(len, false)
    }

    /// [`KvCache::truncate`] (`settle`) or [`KvCache::drop_padding`].
    fn cut(&mut self, len: usize, settle: bool) -> Result<()> {
        let len = self.len.min(len);
        if len < self.len {
            self.refuse_slots("truncate")?;
        }
        if self.has_gdn() {
            let base = self.gdn_base();
            if len < base {
                candle_core::bail!("cannot cut linear-attention state back to {len} rows: the last forward started at row {base}");
            }
            self.each_gdn(|g| {
                if settle {
                    g.settle_prefix(len - base)
                } else {
                    g.trim_pending(len - base)
                }
            })?;
        }
        self.len = len;
        self.pending = 0;
        Ok(())
    }

    /// Keep only `rows` (ascending or not), in that order (tree compaction). Rows already in
    /// place (the leading `rows[i] == i`) are not touched: only the rest moves, after them
    /// ([`crate::ops::keep_rows`]: on a GPU one launch for every layer's K and V).
    /// Example: len 14 after a 4-node tree verify at row 10, rows `[0..10, 10, 12]` → row 12
    /// moves to 11, rows 0..11 stay where they are, len 12.
    pub fn keep_rows(&mut self, rows: &[usize]) -> Result<()> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= self.len) {
            candle_core::bail!("keep_rows: row {bad} is past the cache length {}", self.len);
        }
        self.refuse_slots("keep_rows")?;
        if self.has_gdn() {
            // linear attention: the rows before the last forward stay whole; the kept rows of
            // the last forward must be a root-to-node path of its tree
            let base = self.gdn_base();
            if rows.len() < base || rows[..base].iter().enumerate().any(|(i, &r)| i != r) {
                candle_core::bail!("keep_rows: linear-attention layers cannot drop rows before the last forward (row {base})");
            }
            let path: Vec<usize> = rows[base..].iter().map(|&r| r - base).collect();
            self.each_gdn(|g| g.settle_path(&path))?;
        }
        let fixed = rows
            .iter()
            .enumerate()
            .take_while(|(i, &r)| *i == r)
            .count();
        let moved: Vec<u32> = rows[fixed..].iter().map(|&r| r as u32).collect();
        let buffers: Vec<&Tensor> = self
            .layers
            .iter()
            .flatten()
            .flat_map(|s| [&s.k, &s.v])
            .collect();
        crate::ops::keep_rows::keep_rows(&buffers, fixed, &moved)?;
        self.len = rows.len();
        self.pending = 0;
        Ok(())
    }
}
