//! SwiGLU's gate `y = silu(g) · u` in one pass, with a written backward in one pass:
//! with `s = 1 / (1 + e^−g)`, `dg = dy · u · s · (1 + g·(1 − s))` and `du = dy · g · s`.
//!
//! candle composes it as `silu` then a multiply, and its autograd as a dozen element-wise
//! kernels (exp, reciprocal, negation, affine, products) and their gradient accumulations,
//! each reading and writing the MLP's widest tensors (`docs/BENCHMARKS.md`, the kernel profile
//! of a training step). On CUDA (f32, bf16) the MLP
//! takes this op; elsewhere candle's ops ([`silu_mul`]), so CPU decoding and CPU training are
//! unchanged. The CPU twin is the same arithmetic in f32 (the kernels' check).
//! Example: g = 0, u = 3 → s = ½, y = 0; dy = 1 → dg = 3 · ½ · (1 + 0) = 1.5, du = 0.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use crate::ops::kernel_io::{f32_storage, f32_values};

/// Whether the fused op serves `g` and `u`: on a GPU, f32 or bf16, one dtype and shape.
pub fn serves(g: &Tensor, u: &Tensor) -> bool {
    !g.device().is_cpu()
        && matches!(g.dtype(), DType::F32 | DType::BF16)
        && g.dtype() == u.dtype()
        && g.shape() == u.shape()
}

/// `silu(g) · u`: fused where it [`serves`], else candle's `silu` and multiply.
pub fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if serves(g, u) {
        fused(g, u)
    } else {
        g.silu()? * u
    }
}

/// `silu(g) · u` of a stacked gate/up product `gu` `[..., 2 · inter]` (gate columns first, as
/// [`crate::layers::linear::Linear::stack`] lays them out) → `[..., inter]`: on a GPU one kernel
/// reading both halves in place (no backward: the target's frozen MLP); elsewhere [`silu_mul`]
/// of the two column ranges (its twin). Example: a row `[g0, g1, u0, u1]` → `[silu(g0)·u0,
/// silu(g1)·u1]`.
pub fn silu_mul_stacked(gu: &Tensor, inter: usize) -> Result<Tensor> {
    let last = gu.rank().saturating_sub(1);
    if gu.dims().last() != Some(&(2 * inter)) {
        candle_core::bail!(
            "silu_mul_stacked: a last dim of 2 × {inter} expected, got {:?}",
            gu.dims()
        );
    }
    if !gu.device().is_cpu() && matches!(gu.dtype(), DType::F32 | DType::BF16) && !gu.track_op() {
        return gu.contiguous()?.apply_op1_no_bwd(&Stacked { inter });
    }
    silu_mul(&gu.narrow(last, 0, inter)?, &gu.narrow(last, inter, inter)?)
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Stacked {
    inter: usize,
}

impl candle_core::CustomOp1 for Stacked {
    fn name(&self) -> &'static str {
        "silu-mul-stacked"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("silu_mul_stacked's kernel is CUDA's: the CPU runs silu_mul")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gu: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, by_float, launch, view};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let dev = gu.device().clone();
        let n = l.shape().elem_count() / 2;
        // 256 columns per block, a row per block row (rows beyond 65,535 in a loop)
        let rows = n / self.inter.max(1);
        let cfg = LaunchConfig {
            grid_dim: (
                self.inter.div_ceil(256) as u32,
                rows.clamp(1, 65_535) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (nn, inter) = (n as u64, self.inter as u64);
        let mut dims = l.dims().to_vec();
        if let Some(d) = dims.last_mut() {
            *d = self.inter;
        }
        let out = by_float!(gu.dtype(), "silu_mul_stacked", |T, dt| {
            let x = view::<T>(gu, l, "gate/up")?;
            let y = alloc::<T>(&dev, n)?;
            launch!(dev, "silu_mul_stacked", dt, cfg, x, y, inter, nn);
            candle_core::CudaStorage::wrap_cuda_slice(y, dev)
        });
        Ok((out, Shape::from(dims)))
    }
}

/// The fused op on any device (the CPU runs the twin): one kernel forward, one backward where
/// `g` or `u` carries a graph.
pub fn fused(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.dtype() != u.dtype() || g.shape() != u.shape() {
        candle_core::bail!(
            "silu_mul: gate and up of one shape and dtype expected, got {:?} {:?} and {:?} {:?}",
            g.dtype(),
            g.dims(),
            u.dtype(),
            u.dims()
        );
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, SiluMul)
}

/// `(dg, du)` for the upstream gradient `dy`: the fused op (its CPU twin on the CPU) in f32
/// and bf16, the closed form of candle ops in other dtypes (f64: gradient checks).
pub fn grads(g: &Tensor, u: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    if !matches!(g.dtype(), DType::F32 | DType::BF16) {
        let (g, u, dy) = (g.detach(), u.detach(), dy.detach());
        let s = (g.neg()?.exp()? + 1.0)?.recip()?;
        let du = (&dy * (&g * &s)?)?;
        let ds = ((&g * (1.0 - &s)?)? + 1.0)?;
        let dg = ((dy * u)? * (s * ds)?)?;
        return Ok((dg, du));
    }
    let n = g.elem_count();
    let d = g.detach().contiguous()?.apply_op3_no_bwd(
        &u.detach().contiguous()?,
        &dy.contiguous()?,
        &SiluMulBwd,
    )?;
    Ok((
        d.narrow(0, 0, n)?.reshape(g.shape())?,
        d.narrow(0, n, n)?.reshape(g.shape())?,
    ))
}

struct SiluMul;
struct SiluMulBwd;

fn sig(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }
    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        u: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gv, uv) = (f32_values(g, lg, "gate")?, f32_values(u, lu, "up")?);
        let y = gv.iter().zip(&uv).map(|(&g, &u)| g * sig(g) * u).collect();
        Ok((f32_storage(y, g.dtype(), "silu_mul")?, lg.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        u: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, by_float, elementwise, launch, view};
        let dev = g.device().clone();
        let n = lg.shape().elem_count();
        let (nn, cfg) = (n as u64, elementwise(n as u64));
        let out = by_float!(g.dtype(), "silu_mul", |T, dt| {
            let (gv, uv) = (view::<T>(g, lg, "gate")?, view::<T>(u, lu, "up")?);
            let y = alloc::<T>(&dev, n)?;
            launch!(dev, "silu_mul_fwd", dt, cfg, gv, uv, y, nn);
            candle_core::CudaStorage::wrap_cuda_slice(y, dev)
        });
        Ok((out, lg.shape().clone()))
    }
    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = grads(g, u, dy)?;
        Ok((Some(dg), Some(du)))
    }
}

impl CustomOp3 for SiluMulBwd {
    fn name(&self) -> &'static str {
        "silu-mul-bwd"
    }
    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        u: &CpuStorage,
        lu: &Layout,
        dy: &CpuStorage,
        ld: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gv, uv) = (f32_values(g, lg, "gate")?, f32_values(u, lu, "up")?);
        let dv = f32_values(dy, ld, "gradient")?;
        let n = gv.len();
        let mut d = Vec::with_capacity(2 * n);
        d.extend((0..n).map(|i| {
            let s = sig(gv[i]);
            dv[i] * uv[i] * s * (1.0 + gv[i] * (1.0 - s))
        }));
        d.extend((0..n).map(|i| dv[i] * gv[i] * sig(gv[i])));
        Ok((f32_storage(d, g.dtype(), "silu_mul")?, Shape::from(2 * n)))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        u: &candle_core::CudaStorage,
        lu: &Layout,
        dy: &candle_core::CudaStorage,
        ld: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, by_float, elementwise, launch, view};
        let dev = g.device().clone();
        let n = lg.shape().elem_count();
        let (nn, cfg) = (n as u64, elementwise(n as u64));
        let out = by_float!(g.dtype(), "silu_mul", |T, dt| {
            let (gv, uv) = (view::<T>(g, lg, "gate")?, view::<T>(u, lu, "up")?);
            let dv = view::<T>(dy, ld, "gradient")?;
            let d = alloc::<T>(&dev, 2 * n)?;
            launch!(dev, "silu_mul_bwd", dt, cfg, gv, uv, dv, d, nn);
            candle_core::CudaStorage::wrap_cuda_slice(d, dev)
        });
        Ok((out, Shape::from(2 * n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn the_docs_example() {
        let dev = Device::Cpu;
        let g = Var::from_vec(vec![0f32], 1, &dev).unwrap();
        let u = Var::from_vec(vec![3f32], 1, &dev).unwrap();
        let y = fused(g.as_tensor(), u.as_tensor()).unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), vec![0.0]);
        let gr = y.sum_all().unwrap().backward().unwrap();
        assert_eq!(
            gr.get(g.as_tensor()).unwrap().to_vec1::<f32>().unwrap(),
            vec![1.5]
        );
        assert_eq!(
            gr.get(u.as_tensor()).unwrap().to_vec1::<f32>().unwrap(),
            vec![0.0]
        );
    }

    /// The fused op and its backward equal candle's composed `silu(g) · u` and its autograd.
    #[test]
    fn equals_the_composed_op_and_its_autograd() {
        let dev = Device::Cpu;
        let vals = |seed: f32| -> Vec<f32> {
            (0..24)
                .map(|i| ((i as f32 + seed) * 0.7).sin() * 3.0)
                .collect()
        };
        let (g0, u0, w) = (vals(0.0), vals(1.3), vals(2.9));
        let run = |fuse: bool| {
            let g = Var::from_vec(g0.clone(), (4, 6), &dev).unwrap();
            let u = Var::from_vec(u0.clone(), (4, 6), &dev).unwrap();
            let y = if fuse {
                fused(g.as_tensor(), u.as_tensor()).unwrap()
            } else {
                (g.as_tensor().silu().unwrap() * u.as_tensor()).unwrap()
            };
            let wt = Tensor::from_vec(w.clone(), (4, 6), &dev).unwrap();
            let gr = (&y * wt).unwrap().sum_all().unwrap().backward().unwrap();
            let get = |v: &Var| gr.get(v.as_tensor()).unwrap().clone();
            (y, get(&g), get(&u))
        };
        let (a, b) = (run(true), run(false));
        for (name, x, y) in [("y", &a.0, &b.0), ("dg", &a.1, &b.1), ("du", &a.2, &b.2)] {
            let e = crate::ops::compare::max_abs(x, y).unwrap();
            assert!(e < 1e-5, "{name}: max diff {e}");
        }
    }

    #[test]
    fn mismatched_inputs_are_named() {
        let dev = Device::Cpu;
        let g = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        let u = Tensor::zeros((3, 2), DType::F32, &dev).unwrap();
        let e = fused(&g, &u).unwrap_err().to_string();
        assert!(e.contains("gate and up of one shape"), "{e}");
        assert!(!serves(&g, &g), "the CPU keeps candle's ops");
    }
}
