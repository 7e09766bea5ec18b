//! The gated delta rule's recurrence over a forward's new rows (a chain or a tree), where the
//! rows are: one CUDA kernel per layer on a GPU, its CPU twin ([`recurrence_host`], the
//! host implementation every device is checked against) on the CPU.
//!
//! Per value head h (key head `h / (Hv / Hk)`) and row i, from its parent's state (the
//! committed state for a row without a parent): `S ← S·exp(g); δ = (v − Sᵀk)·β; S ← S + k δᵀ;
//! o = Sᵀq`, with S ∈ R^{dk×dv} in f32. With `keep_all` the state after every row comes back
//! (a verify: rollback installs the accepted row's state); without, only the state after the
//! last row (a prefill, a chain). Example: tree parents [-, 0, 0, 1]: row 3 starts from row
//! 1's state; rows 1 and 2 both from row 0's.
//!
//! # Shapes
//! - `rows` `[n, 2·Hk·dk + Hv·dv + 2·Hv]` f32: q (L2-normalised and scaled) | k | v | β | g;
//! - `init` `[Hv·dk·dv]` f32, the committed state;
//! - `parents` `[n]` u32, `u32::MAX` for none (a parent precedes its child);
//! - out: `o` `[n, Hv·dv]` and the states `[n or 1, Hv·dk·dv]`.
//!
//! **Several sequences** ([`gdn_recurrence_seqs`], batched decoding): `b` sequences of the same
//! `n` rows and parents, each from its own committed state (`init` `[b, S]`); out: `o`
//! `[b·n, Hv·dv]` and the states `[b·(n or 1), S]`, sequence-major. On a GPU one launch (a
//! grid of `b` layers of blocks). Example: 3 slots of one AR step each → rows `[3, W]`, `init`
//! `[3, S]`, parents `[-]`: slot 1's row starts from `init[1]`, its state comes back as row 1.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use crate::ops::kernel_io::cpu_slice;

/// Head counts and sizes of one linear-attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecurrenceDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl RecurrenceDims {
    pub fn state_len(&self) -> usize {
        self.hv * self.dk * self.dv
    }
    /// Values per packed row.
    pub fn row_len(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv + 2 * self.hv
    }
}

/// No parent (the row starts from the committed state).
pub const NO_PARENT: u32 = u32::MAX;

/// The recurrence over `rows` (see the module doc): `(o [n, Hv·dv], states [n or 1, S])`.
pub fn gdn_recurrence(
    rows: &Tensor,
    init: &Tensor,
    parents: &[Option<usize>],
    dims: RecurrenceDims,
    keep_all: bool,
) -> Result<(Tensor, Tensor)> {
    let p: Vec<u32> = parents
        .iter()
        .map(|p| p.map_or(NO_PARENT, |x| x as u32))
        .collect();
    let p = Tensor::from_vec(p, parents.len(), rows.device())?;
    gdn_recurrence_with(rows, init, parents, &p, dims, keep_all)
}

/// [`gdn_recurrence`] with the parents already on the device (`parents_dev` `[n]` u32, the
/// same as `parents`): what a captured forward uses, reading them from a fixed buffer.
pub fn gdn_recurrence_with(
    rows: &Tensor,
    init: &Tensor,
    parents: &[Option<usize>],
    parents_dev: &Tensor,
    dims: RecurrenceDims,
    keep_all: bool,
) -> Result<(Tensor, Tensor)> {
    gdn_recurrence_seqs(rows, init, parents, parents_dev, dims, keep_all, 1)
}

/// [`gdn_recurrence_with`] over `seqs` sequences of `parents.len()` rows each (see the module
/// doc): `rows` `[seqs · n, W]`, `init` `[seqs, S]`.
pub fn gdn_recurrence_seqs(
    rows: &Tensor,
    init: &Tensor,
    parents: &[Option<usize>],
    parents_dev: &Tensor,
    dims: RecurrenceDims,
    keep_all: bool,
    seqs: usize,
) -> Result<(Tensor, Tensor)> {
    let n = parents.len();
    if seqs == 0
        || rows.dims2()? != (seqs * n, dims.row_len())
        || init.elem_count() != seqs * dims.state_len()
        || parents_dev.dims() != [n]
    {
        candle_core::bail!(
            "gdn recurrence: rows {:?} / state {:?} / parents {:?} do not fit {seqs} × {n} rows of {dims:?}",
            rows.dims(),
            init.dims(),
            parents_dev.dims()
        );
    }
    if !keep_all
        && parents
            .iter()
            .enumerate()
            .any(|(i, p)| *p != i.checked_sub(1))
    {
        candle_core::bail!("gdn recurrence: only a chain may keep just its last state");
    }
    let out = rows.to_dtype(DType::F32)?.contiguous()?.apply_op3_no_bwd(
        &init.to_dtype(DType::F32)?.flatten_all()?.contiguous()?,
        parents_dev,
        &Recurrence {
            dims,
            keep_all,
            seqs,
        },
    )?;
    let vd = dims.hv * dims.dv;
    let m = seqs * if keep_all { n } else { 1 };
    let o = out.narrow(0, 0, seqs * n * vd)?.reshape((seqs * n, vd))?;
    let s = out
        .narrow(0, seqs * n * vd, m * dims.state_len())?
        .reshape((m, dims.state_len()))?;
    Ok((o, s))
}

/// The CPU twin: the recurrence as the host computes it, in f32, `(o, states)` flat.
pub fn recurrence_host(
    d: RecurrenceDims,
    rows: &[f32],
    init: &[f32],
    parents: &[Option<usize>],
    keep_all: bool,
) -> (Vec<f32>, Vec<f32>) {
    let (n, kd, vd, w, sl) = (
        parents.len(),
        d.hk * d.dk,
        d.hv * d.dv,
        d.row_len(),
        d.state_len(),
    );
    let group = d.hv / d.hk;
    let mut out = vec![0f32; n * vd];
    let mut states: Vec<Vec<f32>> = Vec::with_capacity(n);
    let mut delta = vec![0f32; d.dv];
    for i in 0..n {
        let r = &rows[i * w..(i + 1) * w];
        let (q, k, v) = (&r[..kd], &r[kd..2 * kd], &r[2 * kd..2 * kd + vd]);
        let (beta, g) = (
            &r[2 * kd + vd..2 * kd + vd + d.hv],
            &r[2 * kd + vd + d.hv..],
        );
        let mut s = match parents[i] {
            Some(p) => states[p].clone(),
            None => init.to_vec(),
        };
        for h in 0..d.hv {
            let kh = h / group;
            let qt = &q[kh * d.dk..(kh + 1) * d.dk];
            let kt = &k[kh * d.dk..(kh + 1) * d.dk];
            let vt = &v[h * d.dv..(h + 1) * d.dv];
            let st = &mut s[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
            let decay = g[h].exp();
            st.iter_mut().for_each(|x| *x *= decay);
            for (j, dl) in delta.iter_mut().enumerate() {
                let kv: f32 = (0..d.dk).map(|a| st[a * d.dv + j] * kt[a]).sum();
                *dl = (vt[j] - kv) * beta[h];
            }
            for a in 0..d.dk {
                for j in 0..d.dv {
                    st[a * d.dv + j] += kt[a] * delta[j];
                }
            }
            for j in 0..d.dv {
                out[i * vd + h * d.dv + j] = (0..d.dk).map(|a| st[a * d.dv + j] * qt[a]).sum();
            }
        }
        states.push(s);
    }
    let states = if keep_all {
        states.concat()
    } else {
        states.pop().unwrap_or_else(|| init.to_vec())
    };
    debug_assert_eq!(states.len() % sl.max(1), 0);
    (out, states)
}

struct Recurrence {
    dims: RecurrenceDims,
    keep_all: bool,
    /// Sequences of `n` rows each, every one from its own committed state.
    seqs: usize,
}

impl Recurrence {
    /// The output's length for sequences of `n` rows: every row's `o`, then the states.
    fn out_len(&self, n: usize) -> usize {
        let d = self.dims;
        self.seqs * (n * d.hv * d.dv + if self.keep_all { n } else { 1 } * d.state_len())
    }
}

impl CustomOp3 for Recurrence {
    fn name(&self) -> &'static str {
        "gdn-recurrence"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let rows = cpu_slice::<f32>(s1, l1, "gdn rows")?;
        let init = cpu_slice::<f32>(s2, l2, "gdn state")?;
        let parents: Vec<Option<usize>> = cpu_slice::<u32>(s3, l3, "gdn parents")?
            .iter()
            .map(|&p| (p != NO_PARENT).then_some(p as usize))
            .collect();
        let (n, d) = (parents.len(), self.dims);
        let (w, sl) = (d.row_len(), d.state_len());
        // each sequence as the one-sequence recurrence computes it
        let (mut o, mut s) = (Vec::new(), Vec::new());
        for q in 0..self.seqs {
            let (oq, sq) = recurrence_host(
                d,
                &rows[q * n * w..(q + 1) * n * w],
                &init[q * sl..(q + 1) * sl],
                &parents,
                self.keep_all,
            );
            o.extend(oq);
            s.extend(sq);
        }
        o.extend(s);
        Ok((CpuStorage::F32(o), Shape::from(self.out_len(n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, view};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let d = self.dims;
        let n = l3.shape().elem_count();
        let seqs = self.seqs as u32;
        let dev = s1.device().clone();
        let rows = view::<f32>(s1, l1, "gdn rows")?;
        let init = view::<f32>(s2, l2, "gdn state")?;
        let parents = view::<u32>(s3, l3, "gdn parents")?;
        let out = alloc::<f32>(&dev, self.out_len(n))?;
        // one block per (value head, 32 value columns); 4 × 32 threads; the state tile
        // [dk, 32] in shared memory with q and k
        const BV: usize = 32;
        if d.dk > 256 {
            candle_core::bail!("gdn recurrence kernel: dk <= 256 expected, got {d:?}");
        }
        let cfg = LaunchConfig {
            // grid z: the sequences (the kernel offsets its rows, state and outputs by it)
            grid_dim: (d.hv as u32, d.dv.div_ceil(BV) as u32, seqs),
            block_dim: (128, 1, 1),
            shared_mem_bytes: ((d.dk * BV + 2 * d.dk + 4 * BV + 2 * BV) * 4) as u32,
        };
        let (ni, hk, hv, dk, dv, keep) = (
            n as i32,
            d.hk as i32,
            d.hv as i32,
            d.dk as i32,
            d.dv as i32,
            self.keep_all as i32,
        );
        launch!(
            dev,
            "gdn_recurrence",
            DType::F32,
            cfg,
            rows,
            init,
            parents,
            out,
            ni,
            hk,
            hv,
            dk,
            dv,
            keep
        );
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(self.out_len(n)),
        ))
    }
}
