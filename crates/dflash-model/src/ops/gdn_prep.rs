//! A Gated DeltaNet layer's steps around its recurrence, fused where the rows are: before it,
//! the causal conv over each row's window + SiLU, q and k L2-normalised (q scaled by dk^-½),
//! β = sigmoid(b) and g = −exp(A_log) · softplus(a + dt_bias), packed as the recurrence's rows
//! ([`crate::ops::gdn_recurrence`]); after it, the gated RMSNorm `w · rmsnorm(o) · SiLU(z)`.
//! One CUDA kernel each on a GPU (a layer's ~40 small tensor ops become two launches); the CPU
//! twins ([`prep_host`], [`gated_norm_host`]) are the host path's own steps.
//!
//! **Windows.** A row's conv window is its ancestor chain, newest last, then the committed
//! inputs: [`window_index`] names, for row i and tap t (t = K−1 the row itself, K−2 its parent,
//! …), a row of `[committed (K−1 rows) | new rows (n) | a zero row]`. Example: K = 4, tree
//! parents [-, 0, 0, 1], no history beyond the committed rows: row 3's taps are (committed row
//! 2, new row 0, new row 1, new row 3) = indices (2, 3, 4, 6).
//!
//! # Shapes
//! - the rows the windows read, `[committed (K−1) | new rows (n)]` f32, as one buffer or as
//!   two (the committed inputs and the new rows' projections: no concatenation); the index one
//!   past the last row is the zero row, read as zeros and never stored (a batched step's rows
//!   are every slot's K−1 committed rows, then its new rows, [`crate::layers::gdn::slot_windows`]);
//!   `ba` `[n, 2·Hv]` (b | a), `idx` `[n, K]` u32;
//! - the layer's constants `[K·C + 2·Hv]`: the conv weight tap-major `[K, C]`, `dt_bias`,
//!   `−exp(A_log)`;
//! - out: rows `[n, 2·Hk·dk + Hv·dv + 2·Hv]` (q | k | v | β | g).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use crate::ops::gdn_recurrence::RecurrenceDims;
use crate::ops::kernel_io::{cpu_slice, rows_in_place};

/// For each row and tap, the row of `[committed | new rows | zero]` it reads (see the module
/// doc), `[n, K]` row-major.
pub fn window_index(parents: &[Option<usize>], kernel: usize) -> Vec<u32> {
    let (n, k1) = (parents.len(), kernel - 1);
    let zero_row = (k1 + n) as u32;
    let mut idx = Vec::with_capacity(n * kernel);
    for i in 0..n {
        // row i, its parent, its grandparent, … (at most K rows), newest first
        let mut chain = vec![i];
        while chain.len() < kernel {
            match parents[*chain.last().unwrap()] {
                Some(p) => chain.push(p),
                None => break,
            }
        }
        for tap in 0..kernel {
            let back = kernel - 1 - tap;
            idx.push(if back < chain.len() {
                (k1 + chain[back]) as u32
            } else {
                let old = back - chain.len(); // 0 = the newest committed input
                if old >= k1 {
                    zero_row
                } else {
                    (k1 - 1 - old) as u32
                }
            });
        }
    }
    idx
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The prep's CPU twin over host slices: rows `[n, W]`. The windows read the rows of `buf`
/// then those of `more` (see the module doc); the conv sums a row's taps newest first (the
/// row, its parent, …), the host path's order.
pub fn prep_host(
    d: RecurrenceDims,
    kernel: usize,
    (buf, more): (&[f32], &[f32]),
    ba: &[f32],
    idx: &[u32],
    consts: &[f32],
) -> Vec<f32> {
    let (kd, vd) = (d.hk * d.dk, d.hv * d.dv);
    let c = 2 * kd + vd;
    let n = idx.len() / kernel;
    let (conv_w, dt_bias, neg_a) = (
        &consts[..kernel * c],
        &consts[kernel * c..kernel * c + d.hv],
        &consts[kernel * c + d.hv..],
    );
    let (held, zero_row) = (buf.len() / c, (buf.len() + more.len()) / c);
    let mut rows = vec![0f32; n * d.row_len()];
    let mut conv = vec![0f32; c];
    for i in 0..n {
        conv.iter_mut().for_each(|x| *x = 0.0);
        for tap in (0..kernel).rev() {
            let r = idx[i * kernel + tap] as usize;
            if r == zero_row {
                continue;
            }
            let src = match r < held {
                true => &buf[r * c..(r + 1) * c],
                false => &more[(r - held) * c..(r - held + 1) * c],
            };
            for (ch, acc) in conv.iter_mut().enumerate() {
                *acc += conv_w[tap * c + ch] * src[ch];
            }
        }
        conv.iter_mut().for_each(|x| *x = silu(*x));
        let out = &mut rows[i * d.row_len()..(i + 1) * d.row_len()];
        for h in 0..d.hk {
            for off in [0usize, kd] {
                let src = &conv[off + h * d.dk..off + (h + 1) * d.dk];
                let inv = 1.0 / (src.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
                let scale = if off == 0 {
                    inv / (d.dk as f32).sqrt()
                } else {
                    inv
                };
                for (j, x) in src.iter().enumerate() {
                    out[off + h * d.dk + j] = x * scale;
                }
            }
        }
        out[2 * kd..2 * kd + vd].copy_from_slice(&conv[2 * kd..]);
        let (b, a) = (
            &ba[i * 2 * d.hv..i * 2 * d.hv + d.hv],
            &ba[i * 2 * d.hv + d.hv..(i + 1) * 2 * d.hv],
        );
        for h in 0..d.hv {
            out[2 * kd + vd + h] = 1.0 / (1.0 + (-b[h]).exp());
            out[2 * kd + vd + d.hv + h] = neg_a[h] * softplus(a[h] + dt_bias[h]);
        }
    }
    rows
}

/// The gated RMSNorm's CPU twin: `w · (o · rsqrt(mean(o²) + eps)) · SiLU(z)` per (row, value
/// head), `[n, Hv·dv]`.
pub fn gated_norm_host(o: &[f32], z: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dv = w.len();
    let mut out = vec![0f32; o.len()];
    for (base, (oh, zh)) in o.chunks(dv).zip(z.chunks(dv)).enumerate() {
        let inv = 1.0 / (oh.iter().map(|x| x * x).sum::<f32>() / dv as f32 + eps).sqrt();
        for j in 0..dv {
            out[base * dv + j] = w[j] * (oh[j] * inv) * silu(zh[j]);
        }
    }
    out
}

/// The fused prep (see the module doc): rows `[n, W]` f32 on the inputs' device. The windows
/// read `buf`'s rows, then `more`'s where given; the index one past them is the zero row.
/// On a GPU `more` and `ba` may be column ranges of a wider product (read where they are).
/// Example: K = 4, a chain step of one row: `buf` the 3 committed inputs, `more` the new row's
/// projection, window (0, 1, 2, 3).
pub fn gdn_prep(
    (buf, more): (&Tensor, Option<&Tensor>),
    ba: &Tensor,
    idx: &Tensor,
    consts: &Tensor,
    dims: RecurrenceDims,
    kernel: usize,
) -> Result<Tensor> {
    buf.contiguous()?.apply_op3_no_bwd(
        &rows_in_place(ba)?,
        &idx.contiguous()?,
        &Prep {
            dims,
            kernel,
            consts: consts.contiguous()?,
            more: more.map(rows_in_place).transpose()?,
        },
    )
}

/// The fused gated RMSNorm: `o`, `z` `[n, Hv·dv]` f32, `w` `[dv]` → `[n, Hv·dv]` in `out`
/// (f32 or bf16: the out-projection's input, rounded once). On a GPU `z` may be a view whose
/// rows are strided (columns of the layer's stacked in-projection: read where they are).
/// Example: n = 1 at Qwen3.6-27B's 48 value heads of 128: 48 blocks, z read from columns
/// 10,240..16,384 of the stacked row.
pub fn gated_norm(o: &Tensor, z: &Tensor, w: &Tensor, eps: f32, out: DType) -> Result<Tensor> {
    let y = o.contiguous()?.apply_op2_no_bwd(
        &rows_in_place(z)?,
        &GatedNorm {
            w: w.contiguous()?,
            eps,
            out: match out {
                DType::BF16 => DType::BF16,
                _ => DType::F32,
            },
        },
    )?;
    y.to_dtype(out)
}

/// The host values of a tensor the op holds (its constants, or the new rows apart): its CPU
/// twin's input.
fn consts_host(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

struct Prep {
    dims: RecurrenceDims,
    kernel: usize,
    consts: Tensor,
    /// The rows after the buffer's, `[m, C]` f32 (the new rows' projections), if apart.
    more: Option<Tensor>,
}

impl CustomOp3 for Prep {
    fn name(&self) -> &'static str {
        "gdn-prep"
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
        let buf = cpu_slice::<f32>(s1, l1, "gdn prep buffer")?;
        let ba = cpu_slice::<f32>(s2, l2, "gdn prep b|a")?;
        let idx = cpu_slice::<u32>(s3, l3, "gdn prep windows")?;
        let more = match &self.more {
            Some(m) => consts_host(m)?,
            None => Vec::new(),
        };
        let rows = prep_host(
            self.dims,
            self.kernel,
            (buf, &more),
            ba,
            idx,
            &consts_host(&self.consts)?,
        );
        let n = idx.len() / self.kernel;
        Ok((CpuStorage::F32(rows), Shape::from((n, self.dims.row_len()))))
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
        use crate::cuda::ptx::{alloc, launch, rows_view, view, with_held_view};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig};
        let d = self.dims;
        let n = l3.shape().elem_count() / self.kernel;
        let dev = s1.device().clone();
        let buf = view::<f32>(s1, l1, "gdn prep buffer")?;
        let (ba, ldba) = rows_view::<f32>(s2, l2, "gdn prep b|a")?;
        let ldba = ldba as i32;
        let idx = view::<u32>(s3, l3, "gdn prep windows")?;
        let out = alloc::<f32>(&dev, n * d.row_len())?;
        let (hk, hv, dk, dv, k) = (
            d.hk as i32,
            d.hv as i32,
            d.dk as i32,
            d.dv as i32,
            self.kernel as i32,
        );
        // the rows after the buffer's: the new rows' own tensor, or none (the buffer again,
        // never read); the index past both is the zero row, as the CPU twin reads it
        let held = l1.shape().dims()[0] as u32;
        let more_rows = match &self.more {
            Some(m) => m.dim(0)? as u32,
            None => 0,
        };
        let zero_row = held + more_rows;
        // a block per (row, head of q, k or v), and one for the row's β and g
        let segments = LaunchConfig {
            grid_dim: (n as u32, (2 * d.hk + d.hv + 1) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let run = |more: CudaView<'_, f32>, ldm: usize| -> Result<()> {
            let ldm = ldm as i32;
            with_held_view(&self.consts, "gdn prep constants", |consts| {
                launch!(
                    dev,
                    "gdn_prep",
                    DType::F32,
                    segments,
                    buf,
                    more,
                    ldm,
                    held,
                    ba,
                    ldba,
                    idx,
                    consts,
                    out,
                    hk,
                    hv,
                    dk,
                    dv,
                    k,
                    zero_row
                );
                Ok(())
            })
        };
        match &self.more {
            Some(m) => {
                let (ms, ml) = m.storage_and_layout();
                let candle_core::Storage::Cuda(ms) = &*ms else {
                    candle_core::bail!("gdn prep new rows: not on the GPU");
                };
                let (more, ldm) = rows_view::<f32>(ms, ml, "gdn prep new rows")?;
                run(more, ldm)?
            }
            None => run(
                view::<f32>(s1, l1, "gdn prep buffer")?,
                d.row_len() - 2 * d.hv,
            )?,
        }
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((n, d.row_len())),
        ))
    }
}

struct GatedNorm {
    w: Tensor,
    eps: f32,
    /// The output's dtype on a GPU (the CPU writes f32, cast after).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    out: DType,
}

impl CustomOp2 for GatedNorm {
    fn name(&self) -> &'static str {
        "gdn-gated-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let o = cpu_slice::<f32>(s1, l1, "gated norm input")?;
        let z = cpu_slice::<f32>(s2, l2, "gated norm gate")?;
        let out = gated_norm_host(o, z, &consts_host(&self.w)?, self.eps);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, by_float, launch, rows, rows_view, view, with_held_view};
        use candle_core::backend::BackendStorage;
        let dev = s1.device().clone();
        let o = view::<f32>(s1, l1, "gated norm input")?;
        // z: [n, Hv·dv] with rows `ldz` apart (a view of the stacked in-projection)
        let (n, zc) = l2.shape().dims2()?;
        if l1.shape().elem_count() != n * zc {
            candle_core::bail!(
                "gated norm: gate {:?} for input {:?}",
                l2.shape(),
                l1.shape()
            );
        }
        let (z, ldz) = rows_view::<f32>(s2, l2, "gated norm gate")?;
        let ldz = ldz as i32;
        let dv = self.w.elem_count();
        let heads = l1.shape().elem_count() / dv;
        let (dvi, hv, eps) = (dv as i32, (zc / dv) as i32, self.eps);
        let out = by_float!(self.out, "gated norm output", |T, dt| {
            let out = alloc::<T>(&dev, heads * dv)?;
            with_held_view(&self.w, "gated norm weight", |w| {
                launch!(
                    dev,
                    "gated_norm",
                    dt,
                    rows(heads, 128),
                    o,
                    z,
                    w,
                    out,
                    dvi,
                    hv,
                    ldz,
                    eps
                );
                Ok(())
            })?;
            candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone())
        });
        Ok((out, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_index_of_the_module_example() {
        let idx = window_index(&[None, Some(0), Some(0), Some(1)], 4);
        // zero row = 3 + 4 = 7; committed rows 0..3; new rows at 3..7
        assert_eq!(&idx[12..16], &[2, 3, 4, 6]);
        assert_eq!(
            &idx[0..4],
            &[0, 1, 2, 3],
            "row 0: three committed inputs, then itself"
        );
    }
}
