//! The RMSNorm backward in three kernels instead of a dozen element-wise passes: for rows of
//! width `h`, `y = x · r · w` with `r = 1 / sqrt(mean(x²) + eps)`,
//! - `r` per row (one read of `x`),
//! - `dx = (g·w − x·r·m) · r` with `m = r · Σ(g·w·x) / h` (one read of `x` and `g`, one write),
//! - `dw = Σ_rows g·x·r`: partial column sums over fixed chunks of rows, then summed over the
//!   chunks in order (deterministic: no atomics).
//!
//! All arithmetic in f32 for f32 and bf16 inputs. Composed of candle ops (broadcast multiplies,
//! casts, reductions) each norm's backward reads and writes its rows many times over
//! (`docs/BENCHMARKS.md`, the kernel profile of a training step). The CPU twin is the same loops
//! (the kernels' check); CPU training keeps the composed form ([`crate::layers::norm`]).
//! Example: x = [3, 4], w = [1, 1], eps = 0, g = [1, 0] → r = 1/√12.5, m = 1.5·r,
//! dx = [(1 − 4.5/12.5)·r, −(6/12.5)·r] ≈ [0.1810, −0.1358], dw = [3·r, 0] ≈ [0.8485, 0].

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

use crate::ops::kernel_io::{cpu_slice, f32_storage, f32_values};

/// The dtypes the kernels take (x and g share one).
pub fn serves(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16)
}

/// `(dx, dw)` of `y = rms_norm(x, w, eps)` for the upstream gradient `g` (x's shape); `dx` in
/// x's dtype, `dw` in w's shape and dtype. x and g: f32 or bf16, one dtype.
pub fn rms_norm_grad(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let h = x.dim(D::Minus1)?;
    if !serves(x.dtype()) || g.dtype() != x.dtype() || g.shape() != x.shape() {
        candle_core::bail!(
            "rms_norm_grad: x and g of one shape in f32 or bf16 expected, got {:?} {:?} and {:?} {:?}",
            x.dtype(),
            x.dims(),
            g.dtype(),
            g.dims()
        );
    }
    if w.elem_count() != h {
        candle_core::bail!(
            "rms_norm_grad: a weight of {} for rows of {h}",
            w.elem_count()
        );
    }
    let rows = x.elem_count() / h.max(1);
    let x2 = x.contiguous()?.reshape((rows, h))?;
    let g2 = g.contiguous()?.reshape((rows, h))?;
    let r = x2.apply_op1_no_bwd(&RmsInv { eps: eps as f32 })?; // [rows] f32
    let aux = Tensor::cat(&[&w.flatten_all()?.to_dtype(DType::F32)?, &r], 0)?;
    let dx = x2.apply_op3_no_bwd(&g2, &aux, &RmsDx)?.reshape(x.shape())?;
    let per = rows_per_chunk(rows, h);
    let part = x2.apply_op3_no_bwd(&g2, &r, &RmsDw { per })?; // [chunks, h] f32
    let dw = part.sum(0)?.reshape(w.shape())?.to_dtype(w.dtype())?;
    Ok((dx, dw))
}

/// Threads per row of the row kernels (`r`, `dx`): about four values per thread, one warp at
/// least, 256 at most. Example: rows of 128 (a per-head norm) → one warp; of 4,096 → 256.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn row_threads(h: usize) -> usize {
    (h / 4).next_multiple_of(32).clamp(32, 256)
}

/// Columns per block of the `dw` kernel.
fn dw_threads(h: usize) -> usize {
    h.next_multiple_of(32).min(256)
}

/// Rows per partial sum of `dw`: about 2,048 blocks over the columns and chunks. Example:
/// 8,192 rows of 4,096 → 16 column blocks × 128 chunks of 64 rows; 262,144 rows of 128 (a
/// per-head norm) → 2,048 chunks of 128 rows.
fn rows_per_chunk(rows: usize, h: usize) -> usize {
    let col_blocks = h.div_ceil(dw_threads(h)).max(1);
    let chunks = (2048 / col_blocks).clamp(1, rows.max(1));
    rows.div_ceil(chunks).max(1)
}

struct RmsInv {
    eps: f32,
}
struct RmsDx;
struct RmsDw {
    per: usize,
}

/// Row sums in the kernels' spirit (f32, in index order).
fn dot(a: impl Iterator<Item = f32>) -> f32 {
    a.fold(0f32, |s, v| s + v)
}

impl CustomOp1 for RmsInv {
    fn name(&self) -> &'static str {
        "rms-inv"
    }
    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, h) = lx.shape().dims2()?;
        let xv = f32_values(x, lx, "rms-inv")?;
        let r = (0..rows)
            .map(|i| {
                let row = &xv[i * h..][..h];
                1.0 / (dot(row.iter().map(|v| v * v)) / h as f32 + self.eps).sqrt()
            })
            .collect();
        Ok((CpuStorage::F32(r), Shape::from(rows)))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows as row_cfg, view};
        let (rows, h) = lx.shape().dims2()?;
        let dev = x.device().clone();
        let r = alloc::<f32>(&dev, rows)?;
        let cfg = row_cfg(rows, row_threads(h) as u32);
        let (hi, eps) = (h as i32, self.eps);
        match x.dtype() {
            DType::F32 => {
                let xv = view::<f32>(x, lx, "x")?;
                launch!(dev, "rms_inv", DType::F32, cfg, xv, r, hi, eps);
            }
            _ => {
                let xv = view::<half::bf16>(x, lx, "x")?;
                launch!(dev, "rms_inv", DType::BF16, cfg, xv, r, hi, eps);
            }
        }
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(r, dev),
            Shape::from(rows),
        ))
    }
}

impl CustomOp3 for RmsDx {
    fn name(&self) -> &'static str {
        "rms-dx"
    }
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
        a: &CpuStorage,
        la: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, h) = lx.shape().dims2()?;
        let (xv, gv) = (f32_values(x, lx, "rms-dx")?, f32_values(g, lg, "rms-dx")?);
        let aux = cpu_slice::<f32>(a, la, "rms-dx")?;
        let (w, r) = aux.split_at(h);
        let mut dx = Vec::with_capacity(rows * h);
        for i in 0..rows {
            let (xr, gr) = (&xv[i * h..][..h], &gv[i * h..][..h]);
            let s = dot((0..h).map(|j| gr[j] * w[j] * xr[j]));
            let m = r[i] * s / h as f32;
            dx.extend((0..h).map(|j| (gr[j] * w[j] - xr[j] * r[i] * m) * r[i]));
        }
        Ok((
            f32_storage(dx, x.dtype(), "rms_norm_grad")?,
            lx.shape().clone(),
        ))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        a: &candle_core::CudaStorage,
        la: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows as row_cfg, view};
        let (rows, h) = lx.shape().dims2()?;
        let dev = x.device().clone();
        let aux = view::<f32>(a, la, "w and r")?;
        let cfg = row_cfg(rows, row_threads(h) as u32);
        let hi = h as i32;
        let out = match x.dtype() {
            DType::F32 => {
                let (xv, gv) = (view::<f32>(x, lx, "x")?, view::<f32>(g, lg, "g")?);
                let dx = alloc::<f32>(&dev, rows * h)?;
                launch!(dev, "rms_dx", DType::F32, cfg, xv, gv, aux, dx, hi);
                candle_core::CudaStorage::wrap_cuda_slice(dx, dev)
            }
            _ => {
                let xv = view::<half::bf16>(x, lx, "x")?;
                let gv = view::<half::bf16>(g, lg, "g")?;
                let dx = alloc::<half::bf16>(&dev, rows * h)?;
                launch!(dev, "rms_dx", DType::BF16, cfg, xv, gv, aux, dx, hi);
                candle_core::CudaStorage::wrap_cuda_slice(dx, dev)
            }
        };
        Ok((out, lx.shape().clone()))
    }
}

impl CustomOp3 for RmsDw {
    fn name(&self) -> &'static str {
        "rms-dw"
    }
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
        r: &CpuStorage,
        lr: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, h) = lx.shape().dims2()?;
        let (xv, gv) = (f32_values(x, lx, "rms-dw")?, f32_values(g, lg, "rms-dw")?);
        let r = cpu_slice::<f32>(r, lr, "rms-dw")?;
        let chunks = rows.div_ceil(self.per);
        let mut part = vec![0f32; chunks * h];
        for (c, out) in part.chunks_mut(h).enumerate() {
            let rs = c * self.per..((c + 1) * self.per).min(rows);
            for (j, o) in out.iter_mut().enumerate() {
                *o = dot(rs.clone().map(|i| gv[i * h + j] * xv[i * h + j] * r[i]));
            }
        }
        Ok((CpuStorage::F32(part), Shape::from((chunks, h))))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        r: &candle_core::CudaStorage,
        lr: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, view};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let (rows, h) = lx.shape().dims2()?;
        let dev = x.device().clone();
        let chunks = rows.div_ceil(self.per);
        let threads = dw_threads(h);
        let cfg = LaunchConfig {
            grid_dim: (h.div_ceil(threads) as u32, chunks as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let rv = view::<f32>(r, lr, "r")?;
        let part = alloc::<f32>(&dev, chunks * h)?;
        let (ri, hi, per) = (rows as i32, h as i32, self.per as i32);
        match x.dtype() {
            DType::F32 => {
                let (xv, gv) = (view::<f32>(x, lx, "x")?, view::<f32>(g, lg, "g")?);
                launch!(
                    dev,
                    "rms_dw",
                    DType::F32,
                    cfg,
                    xv,
                    gv,
                    rv,
                    part,
                    ri,
                    hi,
                    per
                );
            }
            _ => {
                let xv = view::<half::bf16>(x, lx, "x")?;
                let gv = view::<half::bf16>(g, lg, "g")?;
                launch!(
                    dev,
                    "rms_dw",
                    DType::BF16,
                    cfg,
                    xv,
                    gv,
                    rv,
                    part,
                    ri,
                    hi,
                    per
                );
            }
        }
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(part, dev),
            Shape::from((chunks, h)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn row_threads_follow_the_width() {
        assert_eq!(row_threads(128), 32);
        assert_eq!(row_threads(4096), 256);
        assert_eq!(row_threads(1000), 256);
        assert_eq!(row_threads(8), 32);
    }

    #[test]
    fn the_docs_example() {
        let x = Tensor::new(&[[3f32, 4.0]], &Device::Cpu).unwrap();
        let w = Tensor::new(&[1f32, 1.0], &Device::Cpu).unwrap();
        let g = Tensor::new(&[[1f32, 0.0]], &Device::Cpu).unwrap();
        let (dx, dw) = rms_norm_grad(&x, &w, &g, 0.0).unwrap();
        let r = 1.0 / 12.5f32.sqrt();
        // n = x r, m = mean(g w n) = 3 r / 2, dx = (g w − n m) r
        let want_dx = [(1.0 - 3.0 * r * 1.5 * r) * r, (0.0 - 4.0 * r * 1.5 * r) * r];
        let got = dx.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in got.iter().zip(want_dx) {
            assert!((a - b).abs() < 1e-6, "{got:?}");
        }
        assert!((want_dx[0] - 0.1810).abs() < 1e-4 && (want_dx[1] + 0.1358).abs() < 1e-4);
        let dw = dw.to_vec1::<f32>().unwrap();
        assert!((dw[0] - 3.0 * r).abs() < 1e-6 && dw[1] == 0.0, "{dw:?}");
    }

    /// The twin against the composed backward CPU training runs (`layers::norm`), at the
    /// drafter's widths and a per-head width, for every chunking of `dw`.
    #[test]
    fn equals_the_composed_backward() {
        for (rows, h) in [(37usize, 64usize), (300, 128), (5, 4096)] {
            let fill = |seed: u64| {
                let v: Vec<f32> = (0..rows * h)
                    .map(|i| (((i as u64 * 2654435761) ^ seed) % 1009) as f32 / 504.5 - 1.0)
                    .collect();
                Tensor::from_vec(v, (1, rows, h), &Device::Cpu).unwrap()
            };
            let (x, g) = (fill(3), fill(7));
            let w = fill(11).flatten_all().unwrap().narrow(0, 0, h).unwrap();
            let want = crate::layers::norm::composed_grad(&x, &w, &g, 1e-6).unwrap();
            let got = rms_norm_grad(&x, &w, &g, 1e-6).unwrap();
            let e_dx = crate::ops::compare::rel_err(&got.0, &want.0).unwrap();
            let e_dw = crate::ops::compare::rel_err(&got.1, &want.1).unwrap();
            assert!(e_dx < 1e-5 && e_dw < 1e-5, "{rows}×{h}: {e_dx} {e_dw}");
            assert_eq!(got.0.dims(), x.dims());
            assert_eq!(got.1.dims(), w.dims());
        }
    }

    #[test]
    fn bad_shapes_are_named() {
        let x = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap();
        let err = rms_norm_grad(&x, &w, &x, 1e-6).unwrap_err().to_string();
        assert!(err.contains("a weight of 7 for rows of 8"), "{err}");
        let g = Tensor::zeros((2, 8), DType::F64, &Device::Cpu).unwrap();
        let w = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
        let err = rms_norm_grad(&x, &w, &g, 1e-6).unwrap_err().to_string();
        assert!(err.contains("one shape in f32 or bf16"), "{err}");
    }

    #[test]
    fn chunks_cover_the_rows() {
        assert_eq!(rows_per_chunk(8192, 4096), 64);
        assert_eq!(rows_per_chunk(262_144, 128), 128);
        assert_eq!(rows_per_chunk(3, 4096), 1);
        assert_eq!(rows_per_chunk(1, 7), 1);
    }
}
