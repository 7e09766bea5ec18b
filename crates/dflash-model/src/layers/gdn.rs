//! Gated DeltaNet (linear attention) layers of Qwen3.5-style hybrid targets, with the state
//! handling speculative decoding needs.
//!
//! Per layer: `in_proj_qkv` → depthwise causal conv1d (kernel K, no bias) + SiLU over the qkv
//! channels, with a conv state of the last K-1 inputs; q, k L2-normalised in f32
//! (`x · rsqrt(Σx² + 1e-6)`), q scaled by dk^-½; β = sigmoid(b); g = -exp(A_log) ·
//! softplus(a + dt_bias); per value head h (key head h / (Hv/Hk), as `repeat_interleave`), with
//! state S ∈ R^{dk×dv} in f32: `S ← S·exp(g_t); kv = Sᵀk_t; δ = (v_t - kv)·β_t; S ← S + k_t δᵀ;
//! o_t = Sᵀq_t`; gated RMSNorm with a plain weight `w · rmsnorm(o) · SiLU(z)`; `out_proj`.
//!
//! **Rows and parents.** A forward's new rows form a chain (prefill, AR, chain verify) or a
//! tree (DDTree verify). The parent of new row i is its nearest visible earlier new row under
//! the forward's mask (the same ancestor-only mask attention uses); a row without one starts
//! from the committed state. Each row's conv window is its ancestor chain's inputs and its
//! recurrence starts from its parent's state. Example: tree parents [-, 0, 0, 1]: row 3 runs
//! from row 1's state with conv window [.., in0, in1, in3].
//!
//! **Rollback.** The recurrent path keeps the state after every row of the last forward;
//! `KvCache::truncate` / `keep_rows` then install the state after the last committed row (a
//! chain prefix, or a root-to-node tree path). A prefill (the first forward, a chain of ≥
//! `chunk_min_rows` rows) uses the chunked algorithm of transformers'
//! `torch_chunk_gated_delta_rule` (chunk 64; [`crate::ops::gdn_chunk`]) and keeps only its
//! final state.
//!
//! **Where it runs.** On the CPU every step runs on the host in f32 (the reference). On a GPU
//! the layer stays on the device, three kernels around the projections: the prep (the conv over
//! each row's window, SiLU, q/k norms, β and g; [`crate::ops::gdn_prep`]), the rule (chunked
//! for a prefill, [`crate::ops::gdn_chunk`]; recurrent otherwise,
//! [`crate::ops::gdn_recurrence`]) and the gated norm, each with its CPU twin (the host path's
//! own steps); the states live on the device and rollback selects the kept row's state there
//! (no host round trip).

use crate::layers::linear::Linear;
use crate::ops::gdn_chunk::{self, chunked_host, gdn_chunked};
use crate::ops::gdn_prep::{gated_norm, gated_norm_host, gdn_prep, prep_host, window_index};
use crate::ops::gdn_recurrence::{gdn_recurrence_with, recurrence_host, RecurrenceDims, NO_PARENT};
use anyhow::{bail, Result};
use candle_core::Module;
use candle_core::{DType, Device, Tensor};

use crate::io::weights::TensorStore;
use crate::layers::mlp::load_linear;

#[derive(Debug, Clone, Copy)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    pub kernel: usize,
}

impl GdnDims {
    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }
    fn state_len(&self) -> usize {
        self.hv * self.dk * self.dv
    }
    fn recurrence(&self) -> RecurrenceDims {
        RecurrenceDims {
            hk: self.hk,
            hv: self.hv,
            dk: self.dk,
            dv: self.dv,
        }
    }
}

/// The committed state of one layer, f32 on the layer's device: conv inputs of the last K-1
/// rows `[K-1, C]` (oldest first) and S `[Hv·dk·dv]`. Allocated once and then updated in place,
/// so that a captured forward (a CUDA graph) reads the current state at every replay.
#[derive(Debug, Clone)]
pub struct GdnState {
    pub conv: Tensor,
    pub rec: Tensor,
}

/// The last forward's rows, kept for rollback (on the layer's device).
#[derive(Debug, Clone)]
pub struct GdnRows {
    /// The conv inputs of the rows, `[n, C]`.
    pub inputs: Tensor,
    pub parents: Vec<Option<usize>>,
    /// State after each row `[n, S]` (recurrent path), or only after the last `[1, S]`.
    pub states: Tensor,
    pub per_row: bool,
}

/// A forward's new rows as the Gated DeltaNet layers read them: each row's parent (host), and
/// the same on the device, prepared before the forward so that a captured forward (a CUDA
/// graph) reads them from fixed buffers: parents `[n]` u32 ([`NO_PARENT`] for none) and each
/// row's conv window `[n, K]` u32 ([`window_index`]).
/// Example: parents [-, 0, 0, 1], K = 4 → `parents_dev` [MAX, 0, 0, 1], row 3's window
/// (committed row 2, new rows 0, 1, 3) = [2, 3, 4, 6].
#[derive(Debug, Clone)]
pub struct GdnRowsInput {
    pub parents: Vec<Option<usize>>,
    parents_dev: Tensor,
    windows: Tensor,
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
        Ok(())
    }
}

/// Cloning copies the committed state (updated in place, so a clone must not share it); the
/// pending rows are shared (never written in place, except a captured forward's, which its
/// next replay overwrites).
#[derive(Debug)]
pub struct GdnCache {
    pub dims: GdnDims,
    device: Device,
    /// `None` until the first forward: the empty state (zeros).
    committed: Option<GdnState>,
    pub last: Option<GdnRows>,
    /// False until the first forward (a prefill from the empty state).
    pub started: bool,
}

impl Clone for GdnCache {
    fn clone(&self) -> Self {
        let committed = self.committed.as_ref().map(|c| GdnState {
            conv: c.conv.copy().expect("copying a linear-attention state"),
            rec: c.rec.copy().expect("copying a linear-attention state"),
        });
        Self {
            dims: self.dims,
            device: self.device.clone(),
            committed,
            last: self.last.clone(),
            started: self.started,
        }
    }
}

impl GdnCache {
    pub fn new(dims: GdnDims, device: &Device) -> Self {
        Self {
            dims,
            device: device.clone(),
            committed: None,
            last: None,
            started: false,
        }
    }

    /// The committed state (zeros before the first forward).
    pub fn committed(&mut self) -> Result<GdnState> {
        if self.committed.is_none() {
            let d = self.dims;
            self.committed = Some(GdnState {
                conv: Tensor::zeros((d.kernel - 1, d.conv_dim()), DType::F32, &self.device)?,
                rec: Tensor::zeros(d.state_len(), DType::F32, &self.device)?,
            });
        }
        Ok(self.committed.clone().expect("set above"))
    }

    /// Rows appended by the last forward that are not settled yet.
    pub fn pending(&self) -> usize {
        self.last.as_ref().map(|l| l.parents.len()).unwrap_or(0)
    }

    /// Keep the root-to-node path `path` (indices into the last forward's rows, each the
    /// child of the one before, the first a root) and drop the other rows.
    pub fn settle_path(&mut self, path: &[usize]) -> Result<()> {
        let Some(rows) = self.last.take() else {
            if path.is_empty() {
                return Ok(());
            }
            bail!("linear-attention state: no pending rows to keep");
        };
        if path.is_empty() {
            return Ok(());
        }
        for (j, &r) in path.iter().enumerate() {
            let want = if j == 0 { None } else { Some(path[j - 1]) };
            if r >= rows.parents.len() || rows.parents[r] != want {
                bail!("linear-attention state: kept rows {path:?} are not a root-to-node path of the last forward");
            }
        }
        let end = *path.last().unwrap();
        let rec = if rows.per_row {
            rows.states.get(end)?
        } else if end + 1 == rows.parents.len() {
            rows.states.get(0)?
        } else {
            bail!("linear-attention state: cannot roll back into a chunked (prefill) forward");
        };
        // the conv window: the committed inputs, then the path's, the last K-1 of them
        let k1 = self.dims.kernel - 1;
        let tail: Vec<u32> = path[path.len().saturating_sub(k1)..]
            .iter()
            .map(|&r| r as u32)
            .collect();
        let picked = rows
            .inputs
            .index_select(&Tensor::new(tail, rows.inputs.device())?, 0)?;
        let state = self.committed()?;
        let window = Tensor::cat(&[&state.conv, &picked], 0)?;
        let conv = window.narrow(0, window.dim(0)? - k1, k1)?.contiguous()?;
        // in place: the committed state's buffers stay the ones a captured forward reads
        state.conv.slice_set(&conv, 0, 0)?;
        state.rec.slice_set(&rec.contiguous()?, 0, 0)?;
        Ok(())
    }

    /// Keep only the first `keep` rows of the last forward pending (drop a padded forward's
    /// padding rows, which no real row descends from).
    pub fn trim_pending(&mut self, keep: usize) -> Result<()> {
        let Some(rows) = self.last.as_mut() else {
            return Ok(());
        };
        let n = rows.parents.len();
        if keep >= n {
            return Ok(());
        }
        if !rows.per_row {
            bail!("linear-attention state: cannot trim the rows of a chunked (prefill) forward");
        }
        rows.parents.truncate(keep);
        rows.inputs = rows.inputs.narrow(0, 0, keep)?;
        rows.states = rows.states.narrow(0, 0, keep)?;
        Ok(())
    }

    /// Keep the first `keep` rows of the last forward (a chain prefix).
    pub fn settle_prefix(&mut self, keep: usize) -> Result<()> {
        let path: Vec<usize> = (0..keep).collect();
        self.settle_path(&path)
    }

    /// Before a new forward: all pending rows become committed (they must form a chain).
    pub fn settle_all(&mut self) -> Result<()> {
        let n = self.pending();
        if n > 0
            && !self
                .last
                .as_ref()
                .unwrap()
                .parents
                .iter()
                .enumerate()
                .all(|(i, p)| *p == i.checked_sub(1))
        {
            bail!("a tree verify must be compacted (keep_rows) before the next forward");
        }
        self.settle_prefix(n)
    }
}

#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    out_proj: Linear,
    norm: Vec<f32>,
    eps: f32,
    pub dims: GdnDims,
    /// The prep's constants as one f32 tensor on the layer's device (`[K·C + 2·Hv]`: the conv
    /// tap-major, `dt_bias`, `−exp(A_log)`; [`crate::ops::gdn_prep`]) and the norm weight.
    consts: Tensor,
    norm_w: Tensor,
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}
impl GatedDeltaNet {
    pub fn load(
        store: &TensorStore,
        p: &str,
        hidden: usize,
        dims: GdnDims,
        eps: f64,
    ) -> Result<Self> {
        let c = dims.conv_dim();
        let vd = dims.hv * dims.dv;
        let f32_of = |name: &str, shape: &[usize]| -> Result<Tensor> {
            Ok(store
                .get(&format!("{p}.{name}"), shape)?
                .to_dtype(DType::F32)?)
        };
        let consts = Tensor::cat(
            &[
                f32_of("conv1d.weight", &[c, 1, dims.kernel])?
                    .reshape((c, dims.kernel))?
                    .t()?
                    .flatten_all()?,
                f32_of("dt_bias", &[dims.hv])?,
                f32_of("A_log", &[dims.hv])?.exp()?.neg()?,
            ],
            0,
        )?
        .contiguous()?;
        let norm_w = f32_of("norm.weight", &[dims.dv])?;
        Ok(Self {
            in_proj_qkv: load_linear(store, &format!("{p}.in_proj_qkv"), c, hidden, false)?,
            in_proj_z: load_linear(store, &format!("{p}.in_proj_z"), vd, hidden, false)?,
            in_proj_b: load_linear(store, &format!("{p}.in_proj_b"), dims.hv, hidden, false)?,
            in_proj_a: load_linear(store, &format!("{p}.in_proj_a"), dims.hv, hidden, false)?,
            out_proj: load_linear(store, &format!("{p}.out_proj"), hidden, vd, false)?,
            norm: host(&store.get(&format!("{p}.norm.weight"), &[dims.dv])?)?,
            eps: eps as f32,
            dims,
            consts,
            norm_w,
        })
    }

    /// `x`: `[1, n, hidden]`; `parents[i]`: the parent row of new row i (see the module doc).
    /// On the CPU the host path, elsewhere the device path.
    pub fn forward(
        &self,
        x: &Tensor,
        rows: &GdnRowsInput,
        cache: &mut GdnCache,
        chunk_min_rows: usize,
    ) -> Result<Tensor> {
        if x.device().is_cpu() {
            self.forward_host(x, &rows.parents, cache, chunk_min_rows)
        } else {
            self.forward_device(x, rows, cache, chunk_min_rows)
        }
    }

    /// Whether this forward runs the recurrence keeping every row's state: everything but a
    /// prefill (the first forward, a chain of ≥ `chunk_min_rows` rows), which keeps the last.
    fn keeps_every_state(
        parents: &[Option<usize>],
        cache: &mut GdnCache,
        chunk_min_rows: usize,
    ) -> bool {
        let is_chain = parents
            .iter()
            .enumerate()
            .all(|(i, p)| *p == i.checked_sub(1));
        let fresh = !cache.started;
        cache.started = true;
        !(is_chain && fresh && parents.len() >= chunk_min_rows)
    }

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
        let mut buf = committed_conv;
        buf.extend_from_slice(&mixed);
        buf.extend(std::iter::repeat_n(0f32, c));
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
            &buf,
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
        let (n, c, kk) = (parents.len(), d.conv_dim(), d.kernel);
        let vd = d.hv * d.dv;
        let dev = x.device();
        let proj = |l: &Linear| -> Result<Tensor> {
            Ok(l.forward(x)?.to_dtype(DType::F32)?.reshape((n, ()))?)
        };
        let p = tracing::info_span!(target: "phase", "gdn in-projections").entered();
        let mixed = proj(&self.in_proj_qkv)?; // [n, C]
        let z = proj(&self.in_proj_z)?;
        let ba = Tensor::cat(&[proj(&self.in_proj_b)?, proj(&self.in_proj_a)?], 1)?;
        drop(p);
        let p = tracing::info_span!(target: "phase", "gdn prep").entered();
        // 1-2. one kernel: the conv over each row's window [committed | new rows | zero], SiLU,
        // q and k normalised, β and g, packed as the recurrence's rows
        let state = cache.committed()?;
        let buf = Tensor::cat(
            &[
                &state.conv,
                &mixed,
                &Tensor::zeros((1, c), DType::F32, dev)?,
            ],
            0,
        )?;
        if input.windows.dims2()? != (n, kk) {
            bail!(
                "linear-attention rows: windows {:?} for {n} rows of kernel {kk}",
                input.windows.dims()
            );
        }
        let rows = gdn_prep(&buf, &ba, &input.windows, &self.consts, d.recurrence(), kk)?;
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
            gdn_chunked(&rows, &state.rec, d.recurrence())?
        };
        drop(p);
        // 4. gated RMSNorm per (row, value head), one kernel, then out_proj
        let _p = tracing::info_span!(target: "phase", "gdn norm + out-projection").entered();
        let normed = gated_norm(&o, &z, &self.norm_w, self.eps)?.reshape((1, n, vd))?;
        cache.last = Some(GdnRows {
            inputs: mixed,
            parents: parents.to_vec(),
            states,
            per_row: keep_all,
        });
        Ok(self.out_proj.forward(&normed.to_dtype(x.dtype())?)?)
    }

    /// Bytes of the projections' weights a forward reads.
    pub fn weight_bytes_read(&self) -> usize {
        [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
            &self.out_proj,
        ]
        .iter()
        .map(|l| l.weight_bytes_read())
        .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::compare::rel_err;
    use std::collections::HashMap;

    fn layer(dims: GdnDims, hidden: usize) -> GatedDeltaNet {
        let (c, vd) = (dims.conv_dim(), dims.hv * dims.dv);
        let mut seed = 1u64;
        let mut t = |shape: &[usize], amp: f32| -> Tensor {
            seed += 1;
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|i| ((i as f32 * 0.731 + seed as f32 * 1.37).sin()) * amp)
                .collect();
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
        };
        let mut w = HashMap::new();
        for (name, shape, amp) in [
            ("in_proj_qkv.weight", vec![c, hidden], 0.3),
            ("in_proj_z.weight", vec![vd, hidden], 0.3),
            ("in_proj_b.weight", vec![dims.hv, hidden], 0.3),
            ("in_proj_a.weight", vec![dims.hv, hidden], 0.3),
            ("out_proj.weight", vec![hidden, vd], 0.3),
            ("conv1d.weight", vec![c, 1, dims.kernel], 0.5),
            ("A_log", vec![dims.hv], 0.5),
            ("dt_bias", vec![dims.hv], 0.5),
            ("norm.weight", vec![dims.dv], 1.0),
        ] {
            w.insert(format!("l.{name}"), t(&shape, amp));
        }
        let store = TensorStore::new(w, DType::F32, Device::Cpu);
        GatedDeltaNet::load(&store, "l", hidden, dims, 1e-6).unwrap()
    }

    /// The device path (tensor ops and the recurrence op, here with its CPU twin) equals the
    /// host path through a prefill (chunked on the host, the kernel's keep-last mode on the
    /// device), a tree verify kept along one path, a chain verify cut short, and the next
    /// forward from the rolled-back state.
    #[test]
    fn device_path_equals_host_path() {
        let dims = GdnDims {
            hk: 2,
            hv: 4,
            dk: 8,
            dv: 12,
            kernel: 4,
        };
        let hidden = 16;
        let l = layer(dims, hidden);
        let x = |n: usize, s: f32| -> Tensor {
            let v: Vec<f32> = (0..n * hidden)
                .map(|i| (i as f32 * 0.37 + s).cos())
                .collect();
            Tensor::from_vec(v, (1, n, hidden), &Device::Cpu).unwrap()
        };
        let chain = |n: usize| -> Vec<Option<usize>> { (0..n).map(|i| i.checked_sub(1)).collect() };
        let mut ch = GdnCache::new(dims, &Device::Cpu);
        let mut cd = GdnCache::new(dims, &Device::Cpu);
        // (rows, their parents, the rows kept afterwards)
        type Step = (Tensor, Vec<Option<usize>>, Option<Vec<usize>>);
        let steps: Vec<Step> = vec![
            (x(20, 0.1), chain(20), None),
            (
                x(5, 0.7),
                vec![None, Some(0), Some(0), Some(1), Some(3)],
                Some(vec![0, 1, 3]),
            ),
            (x(4, 1.3), chain(4), Some(vec![0, 1])),
            (x(3, 2.1), chain(3), None),
        ];
        for (i, (xi, parents, keep)) in steps.iter().enumerate() {
            let oh = l.forward_host(xi, parents, &mut ch, 8).unwrap();
            let rows = GdnRowsInput::new(parents, l.dims.kernel, xi.device()).unwrap();
            let od = l.forward_device(xi, &rows, &mut cd, 8).unwrap();
            let e = rel_err(&od, &oh).unwrap();
            assert!(e <= 1e-5, "forward {i}: rel err {e}");
            if let Some(path) = keep {
                ch.settle_path(path).unwrap();
                cd.settle_path(path).unwrap();
                let (sh, sd) = (ch.committed().unwrap(), cd.committed().unwrap());
                let e = rel_err(&sd.rec, &sh.rec).unwrap();
                assert!(e <= 1e-5, "state after forward {i}: rel err {e}");
                assert_eq!(
                    sd.conv.to_vec2::<f32>().unwrap(),
                    sh.conv.to_vec2::<f32>().unwrap(),
                    "conv window after forward {i}"
                );
            }
        }
    }
}
