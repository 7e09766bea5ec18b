//! A batched prefill of a layer's slots: every sequence's new rows through the layer at once
//! (projections, the conv and prep, the chunked rule, the norm and out-projection each one
//! launch for all), each computed as that sequence's prefill alone computes it.
//!
//! The rows are left-padded to one length `n` (`starts[s]` is sequence s's first real row);
//! only the real rows go through the layer, packed in sequence order, and come back to their
//! places with zeros in the padding. Example: 2 sequences of n = 5 rows, starts [0, 2] → the
//! packed rows are x[0, 0..5] then x[1, 2..5] (8 rows); the chunked rule runs them as chains
//! of 5 and 3 rows from slots 0's and 1's states.

use anyhow::{bail, Result};
use candle_core::{Module, Tensor};

use super::{GatedDeltaNet, GdnCache, GdnRowsInput, GdnSlots};
use crate::ops::gdn_chunk::{gdn_chunked_seqs, ChunkMath};
use crate::ops::gdn_prep::{gated_norm, gdn_prep, window_index};

impl GatedDeltaNet {
    /// A batched prefill (`x` `[b, n, hidden]`, sequence s's rows from `starts[s]` continuing
    /// slot s's state): the sequences whose chain a prefill alone would run through the
    /// chunked rule (at least `chunk_min_rows` rows) go through the layer together; the others
    /// one by one (the recurrence keeps every row's state, which the chunked form does not).
    /// The slots' states are then those after each sequence's last row.
    pub(super) fn forward_slot_chains(
        &self,
        x: &Tensor,
        starts: &[usize],
        st: &mut GdnSlots,
        chunk_min_rows: usize,
    ) -> Result<Tensor> {
        let (b, n, h) = x.dims3()?;
        if starts.len() != b || st.slots()? != b || starts.iter().any(|&s| s >= n) {
            bail!("a batched linear-attention prefill: {} chain starts for {b} sequences of {n} rows in {} slots", starts.len(), st.slots()?);
        }
        let (together, alone): (Vec<usize>, Vec<usize>) =
            (0..b).partition(|&s| n - starts[s] >= chunk_min_rows);
        let mut index: Vec<u32> = Vec::new();
        let mut outs = Vec::new();
        if !together.is_empty() {
            let (idx, o) = self.prefill_together(x, starts, &together, st)?;
            index.extend(idx);
            outs.push(o);
        }
        for s in alone {
            let rows = n - starts[s];
            let chain: Vec<Option<usize>> = (0..rows).map(|i| i.checked_sub(1)).collect();
            let input = GdnRowsInput::new(&chain, self.dims.kernel, x.device())?;
            let mut one = GdnCache::from_state(self.dims, st.state_of(s)?);
            let xs = x.narrow(0, s, 1)?.narrow(1, starts[s], rows)?;
            let o = self.forward(&xs, &input, &mut one, chunk_min_rows)?;
            one.settle_all()?;
            st.place(s, &one)?;
            index.extend((s * n + starts[s]..(s + 1) * n).map(|i| i as u32));
            outs.push(o.reshape((rows, h))?);
        }
        let out = Tensor::cat(&outs, 0)?;
        let index = Tensor::new(index, x.device())?;
        let padded =
            Tensor::zeros((b * n, h), out.dtype(), x.device())?.index_add(&index, &out, 0)?;
        Ok(padded.reshape((b, n, h))?)
    }

    /// The sequences `seqs` through the layer at once: `(their rows' places in [b·n],
    /// the layer's output rows [Σ rows, hidden])`, their slots' states advanced.
    fn prefill_together(
        &self,
        x: &Tensor,
        starts: &[usize],
        seqs: &[usize],
        st: &mut GdnSlots,
    ) -> Result<(Vec<u32>, Tensor)> {
        let d = self.dims;
        let (b, n, h) = x.dims3()?;
        let (kk, k1, vd) = (d.kernel, d.kernel - 1, d.hv * d.dv);
        let dev = x.device();
        let lens: Vec<usize> = seqs.iter().map(|&s| n - starts[s]).collect();
        let index: Vec<u32> = seqs
            .iter()
            .flat_map(|&s| (s * n + starts[s]..(s + 1) * n).map(|i| i as u32))
            .collect();
        let r = index.len();
        let xr = x
            .reshape((b * n, h))?
            .index_select(&Tensor::new(index.as_slice(), dev)?, 0)?
            .unsqueeze(0)?;
        // [r, C], [r, Hv·dv], [r, 2·Hv]
        let (mixed, z, ba) = self.in_projections(&xr, r)?;
        // the conv buffer: each sequence's [slot's conv inputs | its rows' inputs], the index
        // past it the zero row; each row's window as a prefill alone reads it, moved to its block
        let zero_row = (seqs.len() * k1 + r) as u32;
        let (mut parts, mut windows) = (Vec::new(), Vec::with_capacity(r * kk));
        let (mut base, mut r0) = (0u32, 0);
        for (&s, &len) in seqs.iter().zip(&lens) {
            parts.push(st.conv.narrow(0, s * k1, k1)?);
            parts.push(mixed.narrow(0, r0, len)?);
            let chain: Vec<Option<usize>> = (0..len).map(|i| i.checked_sub(1)).collect();
            let own_zero = (k1 + len) as u32;
            windows.extend(window_index(&chain, kk).into_iter().map(|w| {
                if w == own_zero {
                    zero_row
                } else {
                    base + w
                }
            }));
            base += own_zero;
            r0 += len;
        }
        let buf = Tensor::cat(&parts, 0)?;
        let windows = Tensor::from_vec(windows, (r, kk), dev)?;
        let rows = gdn_prep(
            (&buf, None),
            &ba,
            &windows,
            &self.consts,
            d.recurrence(),
            kk,
        )?;
        let init = Tensor::cat(
            &seqs
                .iter()
                .map(|&s| st.rec.narrow(0, s, 1))
                .collect::<candle_core::Result<Vec<_>>>()?,
            0,
        )?;
        let math = ChunkMath::for_dtype(x.dtype());
        let (o, states) = gdn_chunked_seqs(&rows, &init, &lens, d.recurrence(), math)?;
        let normed = gated_norm(&o, &z, &self.norm_w, self.eps, x.dtype())?.reshape((1, r, vd))?;
        let out = self.out_proj.forward(&normed)?.reshape((r, h))?;
        // each slot's state after its last row: the last K-1 inputs of its block, its state
        let mut base = 0;
        for (j, (&s, &len)) in seqs.iter().zip(&lens).enumerate() {
            let conv = buf.narrow(0, base + len, k1)?.contiguous()?;
            st.conv.slice_set(&conv, 0, s * k1)?;
            st.rec
                .slice_set(&states.narrow(0, j, 1)?.contiguous()?, 0, s)?;
            base += k1 + len;
        }
        Ok((index, out))
    }
}
