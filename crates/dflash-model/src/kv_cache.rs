//! The target's (and the drafter's) KV cache: per layer K and V of shape `[1, hkv, len, d]`,
//! stored post-norm and post-RoPE. Preallocated with doubling growth; supports
//! truncate-to-length (chain rollback) and keep-selected-rows (tree compaction).
//!
//! Example: after prefill of 10 tokens and a verify of 16 with 4 accepted, `truncate(15)`
//! keeps rows 0..15 (prompt + anchor + 4 drafts); after a tree verify whose committed path is
//! tree rows [0, 2, 5] starting at row 10, `keep_rows(&[0..10, 10, 12, 15])` compacts it.

use candle_core::{Result, Tensor};

use crate::gdn::GdnCache;

#[derive(Debug, Clone)]
struct LayerKv {
    k: Tensor,
    v: Tensor,
}

#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    /// Linear-attention layers (hybrid targets) keep a state instead of K/V rows.
    gdn: Vec<Option<GdnCache>>,
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
            len: 0,
            pending: 0,
        }
    }

    /// Make `layer` a linear-attention layer with this (empty) state.
    pub fn set_gdn(&mut self, layer: usize, c: GdnCache) {
        self.gdn[layer] = Some(c);
    }

    pub fn gdn_mut(&mut self, layer: usize) -> Result<&mut GdnCache> {
        match self.gdn[layer].as_mut() {
            Some(g) => Ok(g),
            None => candle_core::bail!("layer {layer} has no linear-attention state in this cache"),
        }
    }

    /// The first row of the last forward, as linear-attention layers see it.
    fn gdn_base(&self) -> usize {
        let pending = self
            .gdn
            .iter()
            .flatten()
            .map(|g| g.pending())
            .max()
            .unwrap_or(0);
        self.len - pending.min(self.len)
    }

    fn has_gdn(&self) -> bool {
        self.gdn.iter().any(|g| g.is_some())
    }

    /// Rows committed to the cache (visible to the next forward as its first columns).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Write `k, v` (`[1, hkv, n, d]`) after the current rows of `layer` and return the
    /// layer's full K/V (`len + n` rows). Every layer of one forward appends the same `n`;
    /// call [`KvCache::commit`] after the forward.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(2)?;
        let need = self.len + n;
        let slot = &mut self.layers[layer];
        let cap = slot.as_ref().map(|s| s.k.dim(2)).transpose()?.unwrap_or(0);
        if need > cap {
            let new_cap = need.max(cap * 2).max(64);
            let (b, h, _, d) = k.dims4()?;
            let grow = |old: Option<&Tensor>, like: &Tensor| -> Result<Tensor> {
                let fresh = Tensor::zeros((b, h, new_cap, d), like.dtype(), like.device())?;
                if let Some(old) = old {
                    if self.len > 0 {
                        fresh.slice_set(&old.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                    }
                }
                Ok(fresh)
            };
            let nk = grow(slot.as_ref().map(|s| &s.k), k)?;
            let nv = grow(slot.as_ref().map(|s| &s.v), v)?;
            *slot = Some(LayerKv { k: nk, v: nv });
        }
        let s = slot.as_ref().unwrap();
        s.k.slice_set(&k.contiguous()?, 2, self.len)?;
        s.v.slice_set(&v.contiguous()?, 2, self.len)?;
        self.pending = n;
        Ok((s.k.narrow(2, 0, need)?, s.v.narrow(2, 0, need)?))
    }

    /// Make the `n` rows of the last forward part of the cache.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
        self.pending = 0;
    }

    /// Keep the first `len` rows (rollback after a partially accepted chain). Linear-attention
    /// layers install the state after row `len - 1`, which must lie in the last forward.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        let len = self.len.min(len);
        if self.has_gdn() {
            let base = self.gdn_base();
            if len < base {
                candle_core::bail!("cannot roll linear-attention state back to {len} rows: the last forward started at row {base}");
            }
            for g in self.gdn.iter_mut().flatten() {
                g.settle_prefix(len - base)
                    .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
            }
        }
        self.len = len;
        self.pending = 0;
        Ok(())
    }

    /// Keep only `rows` (ascending or not), in that order (tree compaction).
    pub fn keep_rows(&mut self, rows: &[usize]) -> Result<()> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= self.len) {
            candle_core::bail!("keep_rows: row {bad} is past the cache length {}", self.len);
        }
        if self.has_gdn() {
            // linear attention: the rows before the last forward stay whole; the kept rows of
            // the last forward must be a root-to-node path of its tree
            let base = self.gdn_base();
            if rows.len() < base || rows[..base].iter().enumerate().any(|(i, &r)| i != r) {
                candle_core::bail!("keep_rows: linear-attention layers cannot drop rows before the last forward (row {base})");
            }
            let path: Vec<usize> = rows[base..].iter().map(|&r| r - base).collect();
            for g in self.gdn.iter_mut().flatten() {
                g.settle_path(&path)
                    .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
            }
        }
        for s in self.layers.iter_mut().flatten() {
            let idx = Tensor::from_vec(
                rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
                rows.len(),
                s.k.device(),
            )?;
            let k =
                s.k.narrow(2, 0, self.len)?
                    .contiguous()?
                    .index_select(&idx, 2)?;
            let v =
                s.v.narrow(2, 0, self.len)?
                    .contiguous()?
                    .index_select(&idx, 2)?;
            s.k.slice_set(&k.contiguous()?, 2, 0)?;
            s.v.slice_set(&v.contiguous()?, 2, 0)?;
        }
        self.len = rows.len();
        self.pending = 0;
        Ok(())
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
