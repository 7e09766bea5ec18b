//! A layer's states for batched decoding: one conv state and one recurrent state per slot of a
//! batched cache, advanced together by an AR step (one new row per slot).
//!
//! A slot's state is a sequence's committed [`GdnState`]: it is copied in when the sequence
//! joins the batch (its prefill ran alone, [`GdnSlots::place`]) and moved with it when the batch
//! is laid out again ([`GdnSlots::copy_slot`]). It does not depend on the cache's columns, so
//! dropping or inserting columns in front of every sequence leaves it as it is.
//! Example: 3 slots, kernel 4 → `conv` `[3·3, C]` (slot 1's window is rows 3..6, oldest first),
//! `rec` `[3, Hv·dk·dv]`; a step's row of slot 1 reads conv rows 3, 4, 5 and its own input,
//! and starts its recurrence from `rec[1]`.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};

use super::{GatedDeltaNet, GdnCache, GdnDims, GdnRowsInput, GdnState};
use crate::ops::gdn_prep::{gated_norm, gdn_prep};
use crate::ops::gdn_recurrence::gdn_recurrence_seqs;

/// Every slot's committed state of one layer, f32 on the layer's device. A step replaces the
/// buffers with the ones its kernels wrote (no copy of every slot's state per layer; batched
/// steps of a hybrid target are not captured into CUDA graphs, which would need them in place).
#[derive(Debug)]
pub struct GdnSlots {
    pub dims: GdnDims,
    /// `[slots · (K-1), C]`: each slot's last K-1 conv inputs, oldest first.
    pub(super) conv: Tensor,
    /// `[slots, Hv·dk·dv]`.
    pub(super) rec: Tensor,
}

/// A deep copy (placing a sequence writes into the buffers).
impl Clone for GdnSlots {
    fn clone(&self) -> Self {
        Self {
            dims: self.dims,
            conv: self.conv.copy().expect("copying a linear-attention state"),
            rec: self.rec.copy().expect("copying a linear-attention state"),
        }
    }
}

impl GdnSlots {
    /// `slots` empty (zero) states.
    pub fn new(dims: GdnDims, slots: usize, device: &Device) -> Result<Self> {
        let k1 = dims.kernel - 1;
        Ok(Self {
            dims,
            conv: Tensor::zeros((slots * k1, dims.conv_dim()), DType::F32, device)?,
            rec: Tensor::zeros((slots, dims.state_len()), DType::F32, device)?,
        })
    }

    pub fn slots(&self) -> Result<usize> {
        Ok(self.rec.dim(0)?)
    }

    /// Make slot `slot` the committed state of `from`, a one-sequence cache whose last forward
    /// is settled.
    pub fn place(&mut self, slot: usize, from: &GdnCache) -> Result<()> {
        if from.pending() > 0 {
            bail!("a sequence joins a batch with its linear-attention rows settled");
        }
        let k1 = self.dims.kernel - 1;
        let state = from.committed_or_zero()?;
        self.conv.slice_set(&state.conv, 0, slot * k1)?;
        self.rec
            .slice_set(&state.rec.reshape((1, self.dims.state_len()))?, 0, slot)?;
        Ok(())
    }

    /// Slot `slot`'s committed state (copies).
    pub(super) fn state_of(&self, slot: usize) -> Result<GdnState> {
        let k1 = self.dims.kernel - 1;
        // copies: the sequence's cache updates its state in place
        Ok(GdnState {
            conv: self.conv.narrow(0, slot * k1, k1)?.copy()?,
            rec: self
                .rec
                .narrow(0, slot, 1)?
                .copy()?
                .reshape(self.dims.state_len())?,
        })
    }

    /// Make slot `slot` a copy of slot `src_slot` of `src` (a batch laid out again).
    pub fn copy_slot(&mut self, slot: usize, src: &GdnSlots, src_slot: usize) -> Result<()> {
        let k1 = self.dims.kernel - 1;
        let conv = src.conv.narrow(0, src_slot * k1, k1)?.contiguous()?;
        self.conv.slice_set(&conv, 0, slot * k1)?;
        let rec = src.rec.narrow(0, src_slot, 1)?.contiguous()?;
        self.rec.slice_set(&rec, 0, slot)?;
        Ok(())
    }
}

/// Each slot's conv window in the prep's buffer `[conv of every slot | the new rows | zero]`.
/// Example: 2 slots, kernel 4 → `[0, 1, 2, 6, 3, 4, 5, 7]` (slot 1: its conv rows 3..6, then
/// its new row, the buffer's row 2·3 + 1). With one slot this is
/// [`crate::ops::gdn_prep::window_index`] of one row without a parent.
pub fn slot_windows(slots: usize, kernel: usize) -> Vec<u32> {
    let k1 = kernel - 1;
    (0..slots)
        .flat_map(|s| {
            (s * k1..(s + 1) * k1)
                .chain([slots * k1 + s])
                .map(|i| i as u32)
        })
        .collect()
}

impl GatedDeltaNet {
    /// One AR step of every slot: `x` `[slots, 1, hidden]`, `input` from
    /// [`GdnRowsInput::slots`] (prepared once per forward). Each slot's row is computed as the
    /// one-sequence forward computes that sequence's step (the same kernels, row by row; on the
    /// CPU their twins, bit for bit), and its state advanced.
    pub fn forward_slots(
        &self,
        x: &Tensor,
        input: &GdnRowsInput,
        st: &mut GdnSlots,
        chunk_min_rows: usize,
    ) -> Result<Tensor> {
        if let Some(starts) = &input.starts {
            return self.forward_slot_chains(x, starts, st, chunk_min_rows);
        }
        let windows = &input.windows;
        let d = self.dims;
        let (b, n, _) = x.dims3()?;
        let (c, kk, vd) = (d.conv_dim(), d.kernel, d.hv * d.dv);
        if n != 1 || st.slots()? != b || windows.dims2()? != (b, kk) {
            bail!(
                "a batched linear-attention step takes one row per slot: {b} × {n} rows, {} slots, windows {:?}",
                st.slots()?,
                windows.dims()
            );
        }
        let (mixed, z, ba) = self.in_projections(x, b)?; // [b, C], [b, Hv·dv], [b, 2·Hv]
        let bufs = (&st.conv, Some(&mixed));
        let rows = gdn_prep(bufs, &ba, windows, &self.consts, d.recurrence(), kk)?;
        let (o, states) = gdn_recurrence_seqs(
            &rows,
            &st.rec,
            &input.parents,
            &input.parents_dev,
            d.recurrence(),
            true,
            b,
        )?;
        // the new conv windows: each slot's last K-2 inputs, then its new one
        let k1 = kk - 1;
        let conv = Tensor::cat(
            &[&st.conv.reshape((b, k1, c))?, &mixed.reshape((b, 1, c))?],
            1,
        )?
        .narrow(1, 1, k1)?
        .contiguous()?
        .reshape((b * k1, c))?;
        (st.conv, st.rec) = (conv, states);
        let normed = gated_norm(&o, &z, &self.norm_w, self.eps, x.dtype())?.reshape((b, 1, vd))?;
        Ok(self.out_proj.forward(&normed)?)
    }
}
