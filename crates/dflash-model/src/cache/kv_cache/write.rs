//! Writing a forward's K/V rows: appended after the committed rows (the buffers growing), or
//! through the fixed layout's index into buffers of exactly `cap` rows.

use candle_core::{Result, Tensor};

use super::{KvCache, LayerKv};

impl KvCache {
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
        Self::slot_index((hkv, rows, head_dim), &vec![first; b], device)
    }

    /// [`KvCache::fixed_index`] with a first row per sequence (a slotted cache, whose
    /// sequences have their own lengths): `[firsts.len(), hkv, rows, head_dim]` u32, new row j
    /// of sequence s naming row `firsts[s] + j`. Example: firsts [10, 25], rows 2 → sequence 0
    /// writes rows 10, 11 and sequence 1 rows 25, 26.
    pub fn slot_index(
        (hkv, rows, head_dim): (usize, usize, usize),
        firsts: &[usize],
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let columns: Vec<usize> = firsts.iter().flat_map(|&f| f..f + rows).collect();
        Self::column_index((hkv, head_dim), firsts.len(), &columns, device)
    }

    /// The write index `[b, hkv, rows, head_dim]` u32 of `b` sequences whose new rows go to
    /// the cache columns `columns` (sequence-major, `rows` per sequence, any order). Example:
    /// b 2, columns [10, 11, 30, 25] → sequence 0 writes columns 10, 11, sequence 1 30 and 25.
    pub fn column_index(
        (hkv, head_dim): (usize, usize),
        b: usize,
        columns: &[usize],
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let rows = columns.len() / b.max(1);
        let index: Vec<u32> = columns
            .chunks(rows.max(1))
            .flat_map(|cols| {
                (0..hkv).flat_map(move |_| {
                    cols.iter()
                        .flat_map(move |&c| std::iter::repeat_n(c as u32, head_dim))
                })
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
}
