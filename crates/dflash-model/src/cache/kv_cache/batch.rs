//! Batched caches' column moves: dropping or inserting columns before every sequence's, and
//! copying a sequence in from another cache.

use candle_core::{Result, Tensor};

use super::KvCache;

impl KvCache {
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
    /// prefilled on its own moves into a freed batch slot). A linear-attention layer's slot
    /// takes the sequence's state whatever `n` (a one-sequence source: its committed state).
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
        self.copy_slot_states(seq, src, src_seq)?;
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
}

/// Slotted caches ([`crate::Target::forward_slots`]): length 0, each sequence's rows from
/// column 0, their counts kept by the caller.
impl KvCache {
    /// Copy the committed rows of `src` (one sequence, e.g. a prompt prefilled alone) into
    /// sequence `seq` at columns `0 .. src.len()`. Example: a 20-row prefill into slot 3 →
    /// slot 3's columns 0..20, the other slots untouched.
    pub fn place_sequence(&mut self, seq: usize, src: &KvCache) -> Result<()> {
        self.copy_slot(seq, src, 0, src.len)
    }

    /// Copy columns `0 .. n` of sequence `src_seq` of `src` into sequence `seq` at columns
    /// `0 .. n` (a slotted batch laid out over fewer slots). Example: slot 5 holding 30 rows
    /// → `copy_slot(0, old, 5, 30)`.
    pub fn copy_slot(&mut self, seq: usize, src: &KvCache, src_seq: usize, n: usize) -> Result<()> {
        self.refuse_gdn("copy_slot")?;
        let cap = self.capacity()?;
        if n > cap || n > src.capacity()? {
            candle_core::bail!("copy_slot: {n} rows do not fit {cap} columns");
        }
        for (dst, from) in self.layers.iter().zip(&src.layers) {
            if let (Some(d), Some(f)) = (dst, from) {
                let part = |t: &Tensor| -> Result<Tensor> {
                    t.narrow(0, src_seq, 1)?.narrow(2, 0, n)?.contiguous()
                };
                d.k.narrow(0, seq, 1)?.slice_set(&part(&f.k)?, 2, 0)?;
                d.v.narrow(0, seq, 1)?.slice_set(&part(&f.v)?, 2, 0)?;
            }
        }
        Ok(())
    }

    /// Give every sequence `cap` columns (at least the current ones), keeping all of them:
    /// what a slotted cache holds is not its length. Example: capacity 64 → `widen(128)`:
    /// columns 0..64 of every slot kept, 64..128 zero.
    pub fn widen(&mut self, cap: usize) -> Result<()> {
        for s in self.layers.iter_mut().flatten() {
            let (b, h, old, d) = s.k.dims4()?;
            if cap <= old {
                continue;
            }
            let wider = |t: &Tensor| -> Result<Tensor> {
                let fresh = Tensor::zeros((b, h, cap, d), t.dtype(), t.device())?;
                fresh.slice_set(t, 2, 0)?;
                Ok(fresh)
            };
            s.k = wider(&s.k)?;
            s.v = wider(&s.v)?;
        }
        Ok(())
    }
}
