//! A decoder layer's residual add and the RMSNorm after it, as one kernel on a GPU:
//! `s = x + h` (rounded to the storage type, as the unfused add stores it) and `norm(s) · w`,
//! one block per row reading `x` and `h` once. Unfused that is an add and a norm kernel, each
//! a launch per residual of every layer (two per layer): [`add_rms_norm`] falls back to them
//! (the CPU's path and the kernel's twin, compared by `check device`).
//!
//! Example: SmolLM2-135M's 30 layers: 60 adds and 60 norms per forward become 60 kernels.

use candle_core::{DType, Result, Tensor};

use crate::layers::norm::RmsNorm;

/// `(x + h, norm(x + h))`: one kernel where [`serves`], else the add and [`RmsNorm::forward`].
pub fn add_rms_norm(x: &Tensor, h: &Tensor, norm: &RmsNorm) -> Result<(Tensor, Tensor)> {
    if serves(x, h, norm) {
        let x = x.contiguous()?;
        let h = h.contiguous()?;
        let w = norm.weight.to_dtype(x.dtype())?;
        let y = x.apply_op3_no_bwd(
            &h,
            &w,
            &AddNorm {
                eps: norm.eps as f32,
            },
        )?;
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

/// A GPU, f32 or bf16, one shape and dtype, a plain (not zero-centred) weight of the last
/// dim's width (at most 8,192), nothing differentiated. `DFLASH_DISABLED_KERNELS=add-norm` turns it off.
pub fn serves(x: &Tensor, h: &Tensor, norm: &RmsNorm) -> bool {
    let off = dflash_core::runtime::off(dflash_core::runtime::Kernel::AddNorm);
    !off && x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && h.dtype() == x.dtype()
        && h.shape() == x.shape()
        && !norm.one_plus
        && x.rank() > 0
        && norm.weight.dims() == [x.dims()[x.rank() - 1]]
        && x.dims()[x.rank() - 1] <= 8192
        && !x.track_op()
        && !h.track_op()
        && !norm.weight.track_op()
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct AddNorm {
    eps: f32,
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
        // ≤ 8 values per thread (`serves`: width ≤ 8,192), at least 4 where the row allows
        let threads = (width.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
        let (w_, eps) = (width as i32, self.eps);
        let out = by_float!(xs.dtype(), "add_rms_norm", |T, dt| {
            let (x, h) = (view::<T>(xs, xl, "x")?, view::<T>(hs, hl, "h")?);
            let w = view::<T>(ws, wl, "weight")?;
            let y = alloc::<T>(&dev, 2 * n)?;
            launch!(
                dev,
                "add_rms_norm",
                dt,
                rows(r, threads),
                x,
                h,
                w,
                y,
                w_,
                eps
            );
            candle_core::CudaStorage::wrap_cuda_slice(y, dev)
        });
        Ok((out, candle_core::Shape::from((2, r, width))))
    }
}
