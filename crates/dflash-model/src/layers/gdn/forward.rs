//! A forward through the layer: its new rows as the layer reads them, and the two paths (the
//! host's reference in f32, the device's kernels).

use anyhow::{bail, Result};
use candle_core::{Device, Module, Tensor};

use super::{host, GatedDeltaNet, GdnCache, GdnRows};
use crate::ops::gdn_chunk::{self, chunked_host, gdn_chunked};
use crate::ops::gdn_prep::{gated_norm, gated_norm_host, gdn_prep, prep_host, window_index};
use crate::ops::gdn_recurrence::{gdn_recurrence_with, recurrence_host, NO_PARENT};

/// A forward's new rows as the Gated DeltaNet layers read them: each row's parent (host), and
/// the same on the device, prepared before the forward so that a captured forward (a CUDA
/// graph) reads them from fixed buffers: parents `[n]` u32 ([`NO_PARENT`] for none) and each
/// row's conv window `[n, K]` u32 ([`window_index`]).
/// Example: parents [-, 0, 0, 1], K = 4 → `parents_dev` [MAX, 0, 0, 1], row 3's window
/// (committed row 2, new rows 0, 1, 3) = [2, 3, 4, 6].
#[derive(Debug, Clone)]
pub struct GdnRowsInput {
    pub parents: Vec<Option<usize>>,
    pub(super) parents_dev: Tensor,
    pub(super) windows: Tensor,
    /// Several sequences of several rows (a batched prefill): each sequence's first row of its
    /// chain, the rows before it padding ([`GdnRowsInput::slot_chains`]).
    pub(super) starts: Option<Vec<usize>>,
}

impl GdnRowsInput {
    pub fn new(parents: &[Option<usize>], kernel: usize, device: &Device) -> Result<Self> {
        let n = parents.len();
        let p: Vec<u32> = parents
            .iter()
            .map(|p| p.map_or(NO_PARENT, |x| x as u32))
            .collect();
        Ok(Self {
            parents: parents.to_vec(),
            parents_dev: Tensor::from_vec(p, n, device)?,
            windows: Tensor::from_vec(window_index(parents, kernel), (n, kernel), device)?,
            starts: None,
        })
    }

    /// The rows of a batched AR step: one row per slot without a parent, each slot's window
    /// over its own committed inputs ([`super::slot_windows`]). With one slot this is
    /// [`GdnRowsInput::new`] of one row.
    pub fn slots(slots: usize, kernel: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            parents: vec![None],
            parents_dev: Tensor::from_vec(vec![NO_PARENT], 1, device)?,
            windows: Tensor::from_vec(super::slot_windows(slots, kernel), (slots, kernel), device)?,
            starts: None,
        })
    }

    /// The rows of a batched prefill: `n` rows per sequence, sequence `s`'s from `starts[s]`
    /// on a chain continuing its slot's state, the rows before it left padding (their outputs
    /// zero). Example: 2 sequences of 5 rows, prompts of 5 and 3 tokens → starts [0, 2].
    pub fn slot_chains(
        starts: Vec<usize>,
        n: usize,
        kernel: usize,
        device: &Device,
    ) -> Result<Self> {
        let chain: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        Ok(Self {
            starts: Some(starts),
            ..Self::new(&chain, kernel, device)?
        })
    }

    /// Copy these rows into `dst`'s buffers in place (same row count).
    pub fn write_into(&self, dst: &mut GdnRowsInput) -> Result<()> {
        if self.parents.len() != dst.parents.len() {
            bail!(
                "linear-attention rows: {} rows into buffers of {}",
                self.parents.len(),
                dst.parents.len()
            );
        }
        dst.parents_dev.slice_set(&self.parents_dev, 0, 0)?;
        dst.windows.slice_set(&self.windows, 0, 0)?;
        dst.parents.clone_from(&self.parents);
        dst.starts.clone_from(&self.starts);
        Ok(())
    }
}

impl GatedDeltaNet {
    /// The host path: every step in f32 on the host (the reference).
    pub fn forward_host(
        &self,
        x: &Tensor,
        parents: &[Option<usize>],
        cache: &mut GdnCache,
        chunk_min_rows: usize,
    ) -> Result<Tensor> {
        cache.settle_all()?;
        let d = self.dims;
        let (n, c) = (parents.len(), d.conv_dim());
        let state = cache.committed()?;
        let committed_conv = host(&state.conv)?;
        let committed_rec = host(&state.rec)?;
        let mixed = host(&self.in_proj_qkv.forward(x)?)?; // n × C
        let z = host(&self.in_proj_z.forward(x)?)?; // n × Hv·dv
        let b = host(&self.in_proj_b.forward(x)?)?; // n × Hv
        let a = host(&self.in_proj_a.forward(x)?)?;
        // 1-2. the conv over each row's window + SiLU, q and k normalised (q scaled), v, β, g
        let vd = d.hv * d.dv;
        let ba: Vec<f32> = (0..n)
            .flat_map(|i| {
                b[i * d.hv..(i + 1) * d.hv]
                    .iter()
                    .chain(&a[i * d.hv..(i + 1) * d.hv])
                    .copied()
            })
            .collect();
        let rows = prep_host(
            d.recurrence(),
            d.kernel,
            (&committed_conv, &mixed),
            &ba,
            &window_index(parents, d.kernel),
            &host(&self.consts)?,
        );
        // 3. the recurrence
        // the chunked algorithm keeps no per-row states: only for a prefill (a chain from the
        // empty state), which is never rolled back; verifies and trees run the recurrence
        let per_row = Self::keeps_every_state(parents, cache, chunk_min_rows);
        let (out, states) = if per_row {
            recurrence_host(d.recurrence(), &rows, &committed_rec, parents, true)
        } else {
            chunked_host(d.recurrence(), &rows, &committed_rec, n)
        };
        // 4. gated RMSNorm per (row, value head), then out_proj
        let normed = gated_norm_host(&out, &z, &self.norm, self.eps);
        let dev = x.device();
        let m = states.len() / d.state_len();
        cache.last = Some(GdnRows {
            inputs: Tensor::from_vec(mixed, (n, c), dev)?,
            parents: parents.to_vec(),
            states: Tensor::from_vec(states, (m, d.state_len()), dev)?,
            per_row,
        });
        let t = Tensor::from_vec(normed, (1, n, vd), dev)?.to_dtype(x.dtype())?;
        Ok(self.out_proj.forward(&t)?)
    }

    /// The device path: the same steps as tensor ops and the recurrence kernel, nothing read
    /// back (on the CPU it runs with the kernel's CPU twin: the tests compare it with the host
    /// path there).
    pub fn forward_device(
        &self,
        x: &Tensor,
        input: &GdnRowsInput,
        cache: &mut GdnCache,
        chunk_min_rows: usize,
    ) -> Result<Tensor> {
        cache.settle_all()?;
        let parents = &input.parents;
        let d = self.dims;
        let (n, kk) = (parents.len(), d.kernel);
        let vd = d.hv * d.dv;
        let dev = x.device();
        let p = tracing::info_span!(target: "phase", "gdn in-projections").entered();
        let (mixed, z, ba) = self.in_projections(x, n)?; // [n, C], [n, Hv·dv], [n, 2·Hv]
        drop(p);
        let p = tracing::info_span!(target: "phase", "gdn prep").entered();
        // 1-2. one kernel: the conv over each row's window [committed | new rows | zero], SiLU,
        // q and k normalised, β and g, packed as the recurrence's rows
        let state = cache.committed()?;
        if input.windows.dims2()? != (n, kk) {
            bail!(
                "linear-attention rows: windows {:?} for {n} rows of kernel {kk}",
                input.windows.dims()
            );
        }
        let bufs = (&state.conv, Some(&mixed));
        let rows = gdn_prep(bufs, &ba, &input.windows, &self.consts, d.recurrence(), kk)?;
        drop(p);
        // 3. the recurrence, one kernel
        let p = tracing::info_span!(target: "phase", "gdn recurrence").entered();
        let keep_all = Self::keeps_every_state(parents, cache, chunk_min_rows);
        // the chunked kernels take the usual head sizes; others keep the recurrent kernel
        let chunked = !keep_all && (dev.is_cpu() || gdn_chunk::cuda_supported(d.recurrence()));
        let (o, states) = if !chunked {
            gdn_recurrence_with(
                &rows,
                &state.rec,
                parents,
                &input.parents_dev,
                d.recurrence(),
                keep_all,
            )?
        } else {
            gdn_chunked(
                &rows,
                &state.rec,
                d.recurrence(),
                gdn_chunk::ChunkMath::for_dtype(x.dtype()),
            )?
        };
        drop(p);
        // 4. gated RMSNorm per (row, value head), one kernel, then out_proj
        let _p = tracing::info_span!(target: "phase", "gdn norm + out-projection").entered();
        let normed = gated_norm(&o, &z, &self.norm_w, self.eps, x.dtype())?.reshape((1, n, vd))?;
        cache.last = Some(GdnRows {
            inputs: mixed,
            parents: parents.to_vec(),
            states,
            per_row: keep_all,
        });
        Ok(self.out_proj.forward(&normed)?)
    }
}
