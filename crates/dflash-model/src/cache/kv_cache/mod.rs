//! The target's (and the drafter's) KV cache: per layer K and V of shape `[1, hkv, len, d]`,
//! stored post-norm and post-RoPE. Preallocated with doubling growth; supports
//! truncate-to-length (chain rollback) and keep-selected-rows (tree compaction).
//!
//! Fixed layout (CUDA graphs): `reserve_exact(cap)` gives the buffers exactly `cap` rows and
//! `write_fixed` writes a forward's rows through a device index, returning the whole buffers,
//! so no shape depends on the cache length.
//!
//! Example: after prefill of 10 tokens and a verify of 16 with 4 accepted, `truncate(15)`
//! keeps rows 0..15 (prompt + anchor + 4 drafts); after a tree verify whose committed path is
//! tree rows [0, 2, 5] starting at row 10, `keep_rows(&[0..10, 10, 12, 15])` compacts it.

use candle_core::{Result, Tensor};

use crate::layers::gdn::{GdnCache, GdnSlots};

mod batch;
mod linear;
mod rollback;
#[cfg(test)]
mod tests;
mod write;

#[derive(Debug, Clone)]
struct LayerKv {
    k: Tensor,
    v: Tensor,
}

#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    /// Linear-attention layers (hybrid targets) keep a state instead of K/V rows: one
    /// sequence's (with its last forward's rows, for rollback), or in a batched cache every
    /// slot's committed state.
    gdn: Vec<Option<GdnCache>>,
    slots: Vec<Option<GdnSlots>>,
    len: usize,
    pending: usize,
}

/// A deep copy: the buffers are written in place, so clones must not share storage.
impl Clone for KvCache {
    fn clone(&self) -> Self {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                l.as_ref().map(|s| LayerKv {
                    k: s.k.copy().expect("copying a KV buffer"),
                    v: s.v.copy().expect("copying a KV buffer"),
                })
            })
            .collect();
        Self {
            layers,
            gdn: self.gdn.clone(),
            slots: self.slots.clone(),
            len: self.len,
            pending: 0,
        }
    }
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            gdn: vec![None; num_layers],
            slots: (0..num_layers).map(|_| None).collect(),
            len: 0,
            pending: 0,
        }
    }

    /// An empty batched cache of `b` sequences: every layer given as `Some((hkv, d))` gets
    /// zero K/V buffers `[b, hkv, cap, d]` (length 0), so that sequences can be copied in
    /// ([`KvCache::grow_front`], [`KvCache::copy_sequence`]) before any forward.
    pub fn batched(
        layers: &[Option<(usize, usize)>],
        b: usize,
        cap: usize,
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let mut c = Self::new(layers.len());
        for (slot, shape) in c.layers.iter_mut().zip(layers) {
            if let Some((h, d)) = *shape {
                let z = || Tensor::zeros((b, h, cap.max(1), d), dtype, device);
                *slot = Some(LayerKv { k: z()?, v: z()? });
            }
        }
        Ok(c)
    }

    /// Rows the attention layers' K/V buffers hold (committed or not; 0 before the first
    /// write). Example: a batched cache of 4 columns grown to 6 with `grow_front(2)` on
    /// buffers of 64 rows keeps 64.
    pub fn capacity(&self) -> Result<usize> {
        match self.layers.iter().flatten().next() {
            Some(s) => s.k.dim(2),
            None => Ok(0),
        }
    }

    /// Rows committed to the cache (visible to the next forward as its first columns).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Make the `n` rows of the last forward part of the cache.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
        self.pending = 0;
    }

    /// K and V of `layer`, committed rows only (tests and diagnostics).
    pub fn layer(&self, layer: usize) -> Result<Option<(Tensor, Tensor)>> {
        match &self.layers[layer] {
            None => Ok(None),
            Some(s) => Ok(Some((
                s.k.narrow(2, 0, self.len)?,
                s.v.narrow(2, 0, self.len)?,
            ))),
        }
    }
}
