//! One row through a projection on a GPU, `y = x · Wᵀ` for `x` `[1, in]` and `W` `[out, in]`
//! (an AR step's every projection and its LM head), as one kernel that streams the weight once:
//! a warp per output feature, 16-byte loads of its weight row (four in flight per lane), the
//! row of `x` read through the L1 cache, a warp reduction in f32. cuBLAS runs several of these
//! products as split-K GEMMs followed by a reduction kernel, below the memory's bandwidth
//! (`docs/BENCHMARKS.md`, the kernel profile of an AR step). Elsewhere candle's
//! matmul, which is also the kernel's twin (`check device` compares them).
//!
//! Example: Qwen3-8B's down projection, `[1, 12288] · [4096, 12288]ᵀ`: 4,096 warps (512 blocks
//! of 8), each reading one 24 KiB weight row in 48 loads per lane.

use candle_core::{DType, Layout, Result, Shape, Tensor};

/// Whether the kernel takes `x` `[.., in]` (one row in all) times `w` `[out, in]`: a GPU, f32
/// or bf16 for both, nothing differentiated, contiguous operands whose rows start on 16-byte
/// boundaries (`in` a multiple of 8 values). `DFLASH_DISABLED_KERNELS=gemv` turns it off.
pub fn serves(x: &Tensor, w: &Tensor) -> bool {
    let off = dflash_core::runtime::off(dflash_core::runtime::Kernel::Gemv);
    let aligned = |t: &Tensor| {
        let (_, l) = t.storage_and_layout();
        (l.start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
    };
    !off && x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && w.dtype() == x.dtype()
        && w.rank() == 2
        && x.rank() >= 1
        && x.elem_count() == w.dim(1).unwrap_or(0)
        && w.dim(1).is_ok_and(|k| k.is_multiple_of(8))
        && x.is_contiguous()
        && w.is_contiguous()
        && !x.track_op()
        && !w.track_op()
        && aligned(x)
        && aligned(w)
}

/// `x · wᵀ` → `[.., out]` (x's leading dims kept). Only where [`serves`].
pub fn gemv(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !serves(x, w) {
        candle_core::bail!(
            "gemv: x {:?} {:?} and w {:?} {:?} do not fit the kernel",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    launch(x, w, false)
}

/// [`gemv`] of bf16 operands written as f32: each value rounded to bf16 first, so the result
/// equals `gemv(x, w)?.to_dtype(F32)` in one kernel (the Gated DeltaNet in-projection, whose
/// rows the layer's f32 kernels read). Only where [`serves`] bf16 operands.
pub fn gemv_widened(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !serves(x, w) || x.dtype() != DType::BF16 {
        candle_core::bail!(
            "gemv_widened: x {:?} {:?} does not fit",
            x.dims(),
            x.dtype()
        );
    }
    launch(x, w, true)
}

/// The op on `x` and `w`, shaped `[.., out]` (x's leading dims kept).
fn launch(x: &Tensor, w: &Tensor, widened: bool) -> Result<Tensor> {
    let mut shape = x.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = w.dim(0)?;
    }
    x.apply_op2_no_bwd(w, &Gemv { widened })?.reshape(shape)
}

/// The kernel as an op; `widened`: f32 output (bf16 operands).
struct Gemv {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    widened: bool,
}

impl candle_core::CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "gemv"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("gemv is a CUDA kernel: the CPU multiplies with matmul")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, by_float, launch, view};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let dev = xs.device().clone();
        let (out, k) = wl.shape().dims2()?;
        let cfg = LaunchConfig {
            grid_dim: (out.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (k_, o_) = (k as i32, out as i32);
        if self.widened {
            let (x, w) = (
                view::<half::bf16>(xs, xl, "x")?,
                view::<half::bf16>(ws, wl, "w")?,
            );
            let y = alloc::<f32>(&dev, out)?;
            launch!(dev, "gemv_wide", DType::BF16, cfg, x, w, y, k_, o_);
            let y = candle_core::CudaStorage::wrap_cuda_slice(y, dev);
            return Ok((y, Shape::from(out)));
        }
        let y = by_float!(xs.dtype(), "gemv", |T, dt| {
            let (x, w) = (view::<T>(xs, xl, "x")?, view::<T>(ws, wl, "w")?);
            let y = alloc::<T>(&dev, out)?;
            launch!(dev, "gemv", dt, cfg, x, w, y, k_, o_);
            candle_core::CudaStorage::wrap_cuda_slice(y, dev)
        });
        Ok((y, Shape::from(out)))
    }
}
