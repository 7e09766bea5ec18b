//! The linear-attention layers' states (hybrid targets) in the cache: set, reached, settled,
//! their pending rows kept and restored.

use candle_core::Result;

use super::KvCache;
use crate::layers::gdn::{GdnCache, GdnRows, GdnSlots};

impl KvCache {
    /// Make `layer` a linear-attention layer with this (empty) state.
    pub fn set_gdn(&mut self, layer: usize, c: GdnCache) {
        self.gdn[layer] = Some(c);
    }

    /// Make `layer` of a batched cache a linear-attention layer with these slots' states.
    pub fn set_gdn_slots(&mut self, layer: usize, s: GdnSlots) {
        self.slots[layer] = Some(s);
    }

    /// The slots' states of `layer` in a batched cache (`None`: a one-sequence cache).
    pub fn gdn_slots_mut(&mut self, layer: usize) -> Option<&mut GdnSlots> {
        self.slots[layer].as_mut()
    }

    /// Whether this batched cache keeps linear-attention states per slot.
    pub(super) fn has_slots(&self) -> bool {
        self.slots.iter().any(|s| s.is_some())
    }

    pub fn gdn_mut(&mut self, layer: usize) -> Result<&mut GdnCache> {
        match self.gdn[layer].as_mut() {
            Some(g) => Ok(g),
            None => candle_core::bail!("layer {layer} has no linear-attention state in this cache"),
        }
    }

    /// The first row of the last forward, as linear-attention layers see it.
    pub(super) fn gdn_base(&self) -> usize {
        let pending = self
            .gdn
            .iter()
            .flatten()
            .map(|g| g.pending())
            .max()
            .unwrap_or(0);
        self.len - pending.min(self.len)
    }

    pub(super) fn has_gdn(&self) -> bool {
        self.gdn.iter().any(|g| g.is_some())
    }

    /// `f` on every linear-attention layer's cache, its error as candle's.
    pub(super) fn each_gdn(
        &mut self,
        f: impl Fn(&mut GdnCache) -> anyhow::Result<()>,
    ) -> Result<()> {
        for g in self.gdn.iter_mut().flatten() {
            f(g).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        }
        Ok(())
    }

    /// Settle the linear-attention layers' pending rows (they must form a chain), as the
    /// start of a forward does; a replayed forward (a CUDA graph) runs no host code, so its
    /// caller settles first.
    pub fn settle_linear(&mut self) -> Result<()> {
        self.each_gdn(|g| g.settle_all())
    }

    /// The linear-attention layers' pending rows (per layer, `None` for attention layers).
    pub fn linear_rows(&self) -> Vec<Option<GdnRows>> {
        self.gdn
            .iter()
            .map(|g| g.as_ref().and_then(|g| g.last.clone()))
            .collect()
    }

    /// Make `rows` (from [`KvCache::linear_rows`] after a captured forward: the graph's
    /// buffers) the pending rows again, with this replay's `parents`.
    pub fn set_linear_rows(
        &mut self,
        rows: &[Option<GdnRows>],
        parents: &[Option<usize>],
    ) -> Result<()> {
        for (g, r) in self.gdn.iter_mut().zip(rows) {
            if let (Some(g), Some(r)) = (g.as_mut(), r) {
                if r.parents.len() != parents.len() {
                    candle_core::bail!(
                        "linear-attention rows: {} parents for {} captured rows",
                        parents.len(),
                        r.parents.len()
                    );
                }
                g.last = Some(GdnRows {
                    parents: parents.to_vec(),
                    ..r.clone()
                });
            }
        }
        Ok(())
    }

    pub(super) fn refuse_gdn(&self, op: &str) -> Result<()> {
        if self.has_gdn() {
            candle_core::bail!("{op}: a cache with linear-attention state holds one sequence");
        }
        Ok(())
    }

    /// A batched cache's slot states cannot go back to an earlier row (they keep no rows).
    pub(super) fn refuse_slots(&self, op: &str) -> Result<()> {
        if self.has_slots() {
            candle_core::bail!(
                "{op}: the linear-attention states of a batched cache keep no rows to roll back to"
            );
        }
        Ok(())
    }

    /// Slot `seq`'s linear-attention states from sequence `src_seq` of `src`: a one-sequence
    /// cache's committed state (sequence 0, its last forward settled) or another batched
    /// cache's slot.
    pub(super) fn copy_slot_states(
        &mut self,
        seq: usize,
        src: &KvCache,
        src_seq: usize,
    ) -> Result<()> {
        let err = |e: anyhow::Error| candle_core::Error::Msg(format!("{e:#}"));
        for (i, dst) in self.slots.iter_mut().enumerate() {
            let Some(dst) = dst.as_mut() else { continue };
            match (&src.slots[i], &src.gdn[i]) {
                (Some(s), _) => dst.copy_slot(seq, s, src_seq).map_err(err)?,
                (None, Some(g)) if src_seq == 0 => dst.place(seq, g).map_err(err)?,
                _ => candle_core::bail!(
                    "copy_sequence: layer {i} of the source keeps no linear-attention state for sequence {src_seq}"
                ),
            }
        }
        Ok(())
    }
}
