//! Forwards over a slotted cache, the speculative batch's layout: every slot's sequence starts
//! at column 0 of batched buffers of a fixed capacity, and a forward writes slot `s`'s `n` new
//! rows at its own columns `firsts[s] .. firsts[s] + n` (the slots' lengths differ), each row
//! attending over one interval of its slot's columns. A slot that commits fewer rows than it
//! wrote moves nothing: its next forward overwrites the rejected rows, which no row sees.
//!
//! Example: capacity 64, slots holding 10 and 25 rows, a 4-row chain each → slot 0 writes
//! columns 10..14 and its row 2 sees columns 0..13; slot 1 writes 25..29. Slot 0 keeps 2 of
//! its rows (12 held), slot 1 all 4 (29 held): the next forward writes 12.. and 29...

use std::ops::Range;

use anyhow::{bail, Result};

use super::{CacheLayout, Rows, Target, TargetOutput};
use crate::cache::kv_cache::KvCache;

impl Target {
    /// One forward of `firsts.len()` slots of `n` rows each over a slotted `cache` (a batched
    /// cache of fixed capacity, [`Target::new_batched_cache`], whose length stays 0): `tokens`
    /// and `positions` are slot-major, `rows[s][r]` is row `r`'s key interval over slot `s`'s
    /// columns ([`dflash_core::visibility::causal_rows`] over the slot's held rows), and slot
    /// `s`'s rows are written at columns `firsts[s] ..`. Logits `[b, n, vocab]` of `out_rows`,
    /// taps `[b, n, hidden]`. Attention-only targets (a linear-attention state would follow
    /// every row written, rejected or not).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_slots(
        &self,
        tokens: &[u32],
        positions: &[usize],
        rows: &[Vec<Range<usize>>],
        firsts: &[usize],
        cache: &mut KvCache,
        taps: &[usize],
        out_rows: &Rows,
    ) -> Result<TargetOutput> {
        if self.is_hybrid() {
            bail!("a slotted cache takes attention-only targets: a hybrid target's linear-attention state cannot drop rejected rows");
        }
        if !cache.is_empty() {
            bail!(
                "a slotted cache keeps length 0, this one has {} rows",
                cache.len()
            );
        }
        let cap = cache.capacity()?;
        let n = rows.first().map_or(0, |r| r.len());
        if firsts.len() != rows.len() {
            bail!(
                "{} slots' key intervals for {} slots",
                rows.len(),
                firsts.len()
            );
        }
        if let Some(&f) = firsts.iter().find(|&&f| f + n > cap) {
            bail!("a slot's {n} rows from column {f} do not fit the slotted cache's {cap} columns");
        }
        if let Some(r) = rows.iter().flatten().find(|r| r.end > cap) {
            bail!("a key interval {r:?} reaches past the slotted cache's {cap} columns");
        }
        let mut inputs = self.prepare_intervals(tokens, positions, rows, 0, Some(cap))?;
        inputs.layout = CacheLayout::Fixed {
            index: self.fixed_index(n, firsts)?,
            cap,
        };
        let out = self.forward_prepared(&inputs, cache, taps, out_rows)?;
        // the rows stay where they were written; what each slot holds is its owner's count
        cache.truncate(0)?;
        Ok(out)
    }
}
