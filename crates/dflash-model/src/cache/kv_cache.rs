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

use crate::layers::gdn::{GdnCache, GdnRows};

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

    /// Write `k, v` (`[1, hkv, n, d]`) after the current rows of `layer` and return the
    /// layer's full K/V (`len + n` rows). Every layer of one forward appends the same `n`;
    /// call [`KvCache::commit`] after the forward.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (kb, vb) = self.buffers_for(layer, k.dims4()?, k.dtype(), k.device(), None)?;
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.wrote(layer, k.dim(2)?, None)
    }

    /// The K and V buffers `[b, h, rows, d]` of `layer` ready for a forward's `n` new rows
    /// (`dims` = `(b, h, n, d)`), written by the caller at rows `len .. len + n` of each
    /// sequence; then [`KvCache::wrote`]. `cap` `None` (append): the buffers grow (doubling, at
    /// least 64 rows, the committed rows kept). `Some(cap)` (fixed layout): buffers of exactly
    /// `cap` rows, made at the layer's first write. Example: len 60, a 64-row buffer, n 16,
    /// append → a 128-row buffer with rows 0..60 copied.
    pub fn buffers_for(
        &mut self,
        layer: usize,
        (b, h, n, d): (usize, usize, usize, usize),
        dtype: candle_core::DType,
        device: &candle_core::Device,
        cap: Option<usize>,
    ) -> Result<(Tensor, Tensor)> {
        let need = self.len + n;
        let len = self.len;
        let slot = &mut self.layers[layer];
        let have = slot.as_ref().map(|s| s.k.dim(2)).transpose()?;
        match cap {
            Some(cap) => {
                if need > cap {
                    candle_core::bail!(
                        "write_fixed: {n} rows after {len} do not fit a capacity of {cap}"
                    );
                }
                match have {
                    None => {
                        let z = || Tensor::zeros((b, h, cap, d), dtype, device);
                        *slot = Some(LayerKv { k: z()?, v: z()? });
                    }
                    Some(rows) if rows != cap => candle_core::bail!(
                        "write_fixed: the buffers of layer {layer} hold {rows} rows, not {cap} (reserve_exact first)"
                    ),
                    Some(_) => {}
                }
            }
            None => {
                let have = have.unwrap_or(0);
                if need > have {
                    let new_cap = need.max(have * 2).max(64);
                    let grow = |old: Option<&Tensor>| -> Result<Tensor> {
                        let fresh = Tensor::zeros((b, h, new_cap, d), dtype, device)?;
                        if let Some(old) = old {
                            if len > 0 {
                                fresh.slice_set(&old.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
                            }
                        }
                        Ok(fresh)
                    };
                    let nk = grow(slot.as_ref().map(|s| &s.k))?;
                    let nv = grow(slot.as_ref().map(|s| &s.v))?;
                    *slot = Some(LayerKv { k: nk, v: nv });
                }
            }
        }
        let s = slot.as_ref().unwrap();
        Ok((s.k.clone(), s.v.clone()))
    }

    /// After a forward wrote its `n` rows into [`KvCache::buffers_for`]'s buffers: the K/V
    /// attention reads (append: rows `0 .. len + n`; fixed: the whole `cap`-row buffers, the
    /// mask hiding the rows past the new ones). [`KvCache::commit`] after the forward.
    pub fn wrote(
        &mut self,
        layer: usize,
        n: usize,
        cap: Option<usize>,
    ) -> Result<(Tensor, Tensor)> {
        let Some(s) = self.layers[layer].as_ref() else {
            candle_core::bail!("layer {layer} has no K/V buffers to have written")
        };
        let out = match cap {
            Some(_) => (s.k.clone(), s.v.clone()),
            None => {
                let need = self.len + n;
                (s.k.narrow(2, 0, need)?, s.v.narrow(2, 0, need)?)
            }
        };
        self.pending = n;
        Ok(out)
    }

    /// Give every attention layer's K/V buffers exactly `cap` rows (the committed rows kept),
    /// for fixed-shape forwards ([`KvCache::write_fixed`]); layers without buffers yet get them
    /// at their first fixed write. Example: len 20, buffers of 64 rows, cap 300 → buffers of
    /// 300 rows, rows 0..20 copied.
    pub fn reserve_exact(&mut self, cap: usize) -> Result<()> {
        if cap < self.len {
            candle_core::bail!(
                "reserve_exact: {cap} rows is less than the {} committed",
                self.len
            );
        }
        let len = self.len;
        for s in self.layers.iter_mut().flatten() {
            let (b, h, old, d) = s.k.dims4()?;
            if old == cap {
                continue;
            }
            let resize = |t: &Tensor| -> Result<Tensor> {
                let fresh = Tensor::zeros((b, h, cap, d), t.dtype(), t.device())?;
                if len > 0 {
                    fresh.slice_set(&t.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
                }
                Ok(fresh)
            };
            *s = LayerKv {
                k: resize(&s.k)?,
                v: resize(&s.v)?,
            };
        }
        Ok(())
    }

    /// The write index of [`KvCache::write_fixed`] for `rows` new rows from cache row
    /// `first` of `b` sequences: `[b, hkv, rows, head_dim]` u32, every element of new row j
    /// naming row `first + j`. Example: b 1, hkv 2, rows 2, head_dim 3, first 40 → each head
    /// `[[40, 40, 40], [41, 41, 41]]`.
    pub fn fixed_index(
        (b, hkv, rows, head_dim): (usize, usize, usize, usize),
        first: usize,
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let index: Vec<u32> = (0..b * hkv)
            .flat_map(|_| {
                (0..rows).flat_map(move |j| std::iter::repeat_n((first + j) as u32, head_dim))
            })
            .collect();
        Tensor::from_vec(index, (b, hkv, rows, head_dim), device)
    }

    /// The fixed-shape form of [`KvCache::append`]: write `k, v` (`[b, hkv, n, d]`) at the rows
    /// `index` names (`[b, hkv, n, d]` u32, built by `Target::prepare` with a capacity: rows `len ..
    /// len + n`) of buffers of exactly `cap` rows, and return the whole buffers (`cap` rows;
    /// the mask hides the rows past the new ones). No shape depends on the cache length.
    pub fn write_fixed(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        index: &Tensor,
        cap: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (kb, vb) = self.buffers_for(layer, k.dims4()?, k.dtype(), k.device(), Some(cap))?;
        crate::ops::scatter_rows::scatter_rows(&kb, k, index)?;
        crate::ops::scatter_rows::scatter_rows(&vb, v, index)?;
        self.wrote(layer, k.dim(2)?, Some(cap))
    }

    /// Make the `n` rows of the last forward part of the cache.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
        self.pending = 0;
    }

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

    /// `f` on every linear-attention layer's cache, its error as candle's.
    fn each_gdn(&mut self, f: impl Fn(&mut GdnCache) -> anyhow::Result<()>) -> Result<()> {
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

    /// Keep only `rows` (ascending or not), in that order (tree compaction). Rows already in
    /// place (the leading `rows[i] == i`) are not touched: only the rest moves, after them
    /// ([`crate::ops::keep_rows`]: on a GPU one launch for every layer's K and V).
    /// Example: len 14 after a 4-node tree verify at row 10, rows `[0..10, 10, 12]` → row 12
    /// moves to 11, rows 0..11 stay where they are, len 12.
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

    /// Batched caches (`[b, hkv, len, d]`, right-aligned sequences): drop the first `k` columns
    /// of every sequence. Example: len 10, k 4 → old columns 4..10 are now 0..6.
    pub fn drop_front(&mut self, k: usize) -> Result<()> {
        self.refuse_gdn("drop_front")?;
        let k = k.min(self.len);
        let keep = self.len - k;
        for s in self.layers.iter_mut().flatten() {
            if keep > 0 {
                let kk = s.k.narrow(2, k, keep)?.contiguous()?;
                let vv = s.v.narrow(2, k, keep)?.contiguous()?;
                s.k.slice_set(&kk, 2, 0)?;
                s.v.slice_set(&vv, 2, 0)?;
            }
        }
        self.len = keep;
        self.pending = 0;
        Ok(())
    }

    /// Batched caches: insert `k` zero columns before the current ones (room for a prompt
    /// longer than the cache). Example: len 3, k 2 → old columns 0..3 are now 2..5. In place
    /// when the buffers have room (a fixed capacity, [`KvCache::reserve_exact`], keeps its
    /// buffers: a captured forward reads them), else into larger buffers.
    pub fn grow_front(&mut self, k: usize) -> Result<()> {
        self.refuse_gdn("grow_front")?;
        let len = self.len;
        for s in self.layers.iter_mut().flatten() {
            let (b, h, old_cap, d) = s.k.dims4()?;
            if old_cap >= len + k {
                for t in [&s.k, &s.v] {
                    if len > 0 {
                        let moved = t.narrow(2, 0, len)?.contiguous()?;
                        t.slice_set(&moved, 2, k)?;
                    }
                    t.slice_set(&Tensor::zeros((b, h, k, d), t.dtype(), t.device())?, 2, 0)?;
                }
                continue;
            }
            let cap = old_cap.max(len + k);
            let fresh = |old: &Tensor| -> Result<Tensor> {
                let (b, h, _, d) = old.dims4()?;
                let t = Tensor::zeros((b, h, cap, d), old.dtype(), old.device())?;
                if len > 0 {
                    t.slice_set(&old.narrow(2, 0, len)?.contiguous()?, 2, k)?;
                }
                Ok(t)
            };
            s.k = fresh(&s.k)?;
            s.v = fresh(&s.v)?;
        }
        self.len += k;
        self.pending = 0;
        Ok(())
    }

    /// Batched caches: copy `n` committed columns of sequence `src_seq` of `src`, starting at
    /// column `src_col`, into sequence `seq` of this cache at columns `col .. col + n` (a prompt
    /// prefilled on its own moves into a freed batch slot).
    pub fn copy_sequence(
        &mut self,
        seq: usize,
        col: usize,
        src: &KvCache,
        src_seq: usize,
        src_col: usize,
        n: usize,
    ) -> Result<()> {
        self.refuse_gdn("copy_sequence")?;
        if col + n > self.len || src_col + n > src.len {
            candle_core::bail!(
                "copy_sequence: columns {col}..{} of {} / {src_col}..{} of {}",
                col + n,
                self.len,
                src_col + n,
                src.len
            );
        }
        for (dst, from) in self.layers.iter().zip(&src.layers) {
            if let (Some(d), Some(f)) = (dst, from) {
                let part = |t: &Tensor| -> Result<Tensor> {
                    t.narrow(0, src_seq, 1)?.narrow(2, src_col, n)?.contiguous()
                };
                d.k.narrow(0, seq, 1)?.slice_set(&part(&f.k)?, 2, col)?;
                d.v.narrow(0, seq, 1)?.slice_set(&part(&f.v)?, 2, col)?;
            }
        }
        Ok(())
    }

    fn refuse_gdn(&self, op: &str) -> Result<()> {
        if self.has_gdn() {
            candle_core::bail!("{op}: a cache with linear-attention state holds one sequence");
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A 2-sequence, 1-head, d = 1 cache whose value at (sequence s, column c) is 10·s + c.
    fn filled(cols: usize) -> KvCache {
        let mut c = KvCache::new(1);
        let data: Vec<f32> = (0..2)
            .flat_map(|s| (0..cols).map(move |i| (10 * s + i) as f32))
            .collect();
        let t = Tensor::from_vec(data, (2, 1, cols, 1), &Device::Cpu).unwrap();
        c.append(0, &t, &t).unwrap();
        c.commit(cols);
        c
    }
    fn values(c: &KvCache) -> Vec<Vec<f32>> {
        let (k, v) = c.layer(0).unwrap().unwrap();
        assert_eq!(
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        k.squeeze(3)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    }

    /// The buffers a forward writes into: append grows them (doubling, the committed rows
    /// kept) and `wrote` returns the `len + n` rows; the fixed layout refuses rows past its
    /// capacity and buffers of another size, naming them.
    #[test]
    fn buffers_for_grows_appends_and_checks_fixed_capacities() {
        let mut c = filled(60);
        let (k, _) = c
            .buffers_for(0, (2, 1, 16, 1), DType::F32, &Device::Cpu, None)
            .unwrap();
        assert_eq!(
            k.dims(),
            &[2, 1, 128, 1],
            "60 + 16 rows outgrow 64: doubled"
        );
        let (kw, _) = c.wrote(0, 16, None).unwrap();
        assert_eq!(kw.dims(), &[2, 1, 76, 1]);
        assert_eq!(
            values(&c)[1][59],
            69.0,
            "the committed rows survive the growth"
        );
        let mut f = filled(4);
        f.reserve_exact(8).unwrap();
        let e = f
            .buffers_for(0, (2, 1, 5, 1), DType::F32, &Device::Cpu, Some(8))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("5 rows after 4 do not fit a capacity of 8"),
            "{e}"
        );
        let e = f
            .buffers_for(0, (2, 1, 1, 1), DType::F32, &Device::Cpu, Some(16))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hold 8 rows, not 16"), "{e}");
        let (kf, _) = f
            .buffers_for(0, (2, 1, 4, 1), DType::F32, &Device::Cpu, Some(8))
            .unwrap();
        assert_eq!(kf.dims(), &[2, 1, 8, 1]);
        assert_eq!(f.wrote(0, 4, Some(8)).unwrap().0.dims(), &[2, 1, 8, 1]);
    }

    #[test]
    fn front_moves_keep_every_sequence_right_aligned() {
        let mut c = filled(4);
        c.drop_front(1).unwrap();
        assert_eq!(values(&c), vec![vec![1., 2., 3.], vec![11., 12., 13.]]);
        c.grow_front(2).unwrap();
        assert_eq!(
            values(&c),
            vec![vec![0., 0., 1., 2., 3.], vec![0., 0., 11., 12., 13.]]
        );
        // a sequence prefilled elsewhere moves into slot 0, ending at the last column
        let src = filled(3);
        c.copy_sequence(0, 3, &src, 1, 1, 2).unwrap();
        assert_eq!(
            values(&c),
            vec![vec![0., 0., 1., 11., 12.], vec![0., 0., 11., 12., 13.]]
        );
        assert!(c.copy_sequence(0, 4, &src, 1, 1, 2).is_err());
    }

    /// Front moves within the buffers keep them (a captured CUDA graph reads them); a grow past
    /// them reallocates, keeping every sequence right-aligned.
    #[test]
    fn front_moves_stay_in_place_within_the_capacity() {
        let mut c = filled(4);
        assert_eq!(c.capacity().unwrap(), 64);
        c.drop_front(1).unwrap();
        c.grow_front(60).unwrap(); // 3 + 60 ≤ 64
        assert_eq!((c.len(), c.capacity().unwrap()), (63, 64));
        assert_eq!(&values(&c)[1][59..], &[0., 11., 12., 13.]);
        c.grow_front(2).unwrap(); // 65 > 64
        assert_eq!((c.len(), c.capacity().unwrap()), (65, 65));
        assert_eq!(&values(&c)[1][61..], &[0., 11., 12., 13.]);
        assert_eq!(KvCache::new(2).capacity().unwrap(), 0);
    }
}
