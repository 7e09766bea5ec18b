//! A decoder layer's residual add and the RMSNorm after it, as one kernel on a GPU:
//! `s = x + h` (rounded to the storage type, as the unfused add stores it) and `norm(s) · w`,
//! one block per row reading `x` and `h` once. Unfused that is an add and a norm kernel, each
//! a launch per residual of every layer (two per layer): [`add_rms_norm`] falls back to them
//! (the CPU's path and the kernel's twin, compared by `check device`). Zero-centred weights
//! (qwen3_5: `norm(s) · (1 + w)`) get the same kernel, and their norm alone one kernel too
//! ([`zero_centred_norm`]): composed, such a norm is about eleven kernels (casts, square,
//! mean, add, sqrt, divide, the weight's `1 + w`, multiply).
//!
//! Example: SmolLM2-135M's 30 layers: 60 adds and 60 norms per forward become 60 kernels;
//! Qwen3.6-27B's 64 layers: 128 adds and 129 zero-centred norms become 129 kernels.

use candle_core::{DType, Result, Tensor};

use crate::layers::norm::RmsNorm;

/// `(x + h, norm(x + h))`: one kernel where [`serves`], else the add and [`RmsNorm::forward`].
pub fn add_rms_norm(x: &Tensor, h: &Tensor, norm: &RmsNorm) -> Result<(Tensor, Tensor)> {
    if serves(x, h, norm) {
        let x = x.contiguous()?;
        let h = h.contiguous()?;
        // a zero-centred weight stays f32 (`RmsNorm::zero_centred`), the kernel adds the 1
        let w = match norm.one_plus {
            true => norm.weight.clone(),
            false => norm.weight.to_dtype(x.dtype())?,
        };
        let op = AddNorm {
            eps: norm.eps as f32,
            one_plus: norm.one_plus,
        };
        let y = x.apply_op3_no_bwd(&h, &w, &op)?;
        let width = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / width.max(1);
        let y = y.reshape((2, rows, width))?;
        let shape = x.shape().clone();
        return Ok((y.get(0)?.reshape(&shape)?, y.get(1)?.reshape(&shape)?));
    }
    let s = (x + h)?;
    let n = norm.forward(&s)?;
    Ok((s, n))
}

/// A zero-centred norm's `norm(x) · (1 + w)` as one kernel where [`serves_alone`]; `None`
/// otherwise (the caller composes it: [`RmsNorm::forward_composed`]).
pub fn zero_centred_norm(x: &Tensor, norm: &RmsNorm) -> Result<Option<Tensor>> {
    if !norm.one_plus || !serves_alone(x, norm) {
        return Ok(None);
    }
    let x = x.contiguous()?;
    let op = Norm1p {
        eps: norm.eps as f32,
    };
    Ok(Some(x.apply_op2_no_bwd(&norm.weight, &op)?))
}

/// A GPU, f32 or bf16, one shape and dtype, a weight of the last dim's width (at most 8,192;
/// f32 where zero-centred), nothing differentiated. `DFLASH_DISABLED_KERNELS=add-norm` turns it off.
pub fn serves(x: &Tensor, h: &Tensor, norm: &RmsNorm) -> bool {
    h.dtype() == x.dtype() && h.shape() == x.shape() && !h.track_op() && serves_alone(x, norm)
}

/// [`serves`] without the residual: the conditions on `x` and the weight.
fn serves_alone(x: &Tensor, norm: &RmsNorm) -> bool {
    let off = dflash_core::runtime::off(dflash_core::runtime::Kernel::AddNorm);
    !off && x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && (!norm.one_plus || norm.weight.dtype() == DType::F32)
        && x.rank() > 0
        && norm.weight.dims() == [x.dims()[x.rank() - 1]]
        && x.dims()[x.rank() - 1] <= 8192
        && !x.track_op()
        && !norm.weight.track_op()
}

/// Threads per row: ≤ 8 values per thread (`serves`: width ≤ 8,192), at least 4 where the
/// row allows.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn threads(width: usize) -> u32 {
    (width.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Norm1p {
    eps: f32,
}

impl candle_core::CustomOp2 for Norm1p {
    fn name(&self) -> &'static str {
        "rms-norm-1p"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("the zero-centred RMSNorm kernel is CUDA's: the CPU composes it")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &candle_core::Layout,
        ws: &candle_core::CudaStorage,
        wl: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use crate::cuda::ptx::{alloc, by_float, launch, rows, view};
        use candle_core::backend::BackendStorage;
        let dev = xs.device().clone();
        let width = *xl.dims().last().unwrap_or(&1);
        let n = xl.shape().elem_count();
        let (w_, eps) = (width as i32, self.eps);
        let out = by_float!(xs.dtype(), "rms_norm_1p", |T, dt| {
            let x = view::<T>(xs, xl, "x")?;
            let w = view::<f32>(ws, wl, "weight")?;
            let y = alloc::<T>(&dev, n)?;
            let cfg = rows(n / width.max(1), threads(width));
            launch!(dev, "rms_norm_1p", dt, cfg, x, w, y, w_, eps);
            candle_core::CudaStorage::wrap_cuda_slice(y, dev)
        });
        Ok((out, xl.shape().clone()))
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct AddNorm {
    eps: f32,
    /// A zero-centred, f32 weight: `add_rms_norm_1p_*`.
    one_plus: bool,
}

impl candle_core::CustomOp3 for AddNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("the fused add + RMSNorm is a CUDA kernel: the CPU adds and norms")
    }

    /// Out: `[2, rows, width]`, the sums then the normed rows.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &candle_core::Layout,
        hs: &candle_core::CudaStorage,
        hl: &candle_core::Layout,
        ws: &candle_core::CudaStorage,
        wl: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use crate::cuda::ptx::{alloc, by_float, launch, rows, view};
        use candle_core::backend::BackendStorage;
        let dev = xs.device().clone();
        let width = *xl.dims().last().unwrap_or(&1);
        let n = xl.shape().elem_count();
        let r = n / width.max(1);
        let (w_, eps, cfg) = (width as i32, self.eps, rows(r, threads(width)));
        let out = by_float!(xs.dtype(), "add_rms_norm", |T, dt| {
            let (x, h) = (view::<T>(xs, xl, "x")?, view::<T>(hs, hl, "h")?);
            let y = alloc::<T>(&dev, 2 * n)?;
            if self.one_plus {
                let w = view::<f32>(ws, wl, "weight")?;
                launch!(dev, "add_rms_norm_1p", dt, cfg, x, h, w, y, w_, eps);
            } else {
                let w = view::<T>(ws, wl, "weight")?;
                launch!(dev, "add_rms_norm", dt, cfg, x, h, w, y, w_, eps);
            }
            candle_core::CudaStorage::wrap_cuda_slice(y, dev)
        });
        Ok((out, candle_core::Shape::from((2, r, width))))
    }
}
