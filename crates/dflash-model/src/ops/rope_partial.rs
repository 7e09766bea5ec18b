//! Partial RoPE (qwen3_5's: the first quarter of each head's features rotate) as one kernel on
//! a GPU. Composed ([`RopeTables::apply_composed`], the CPU's path and the kernel's twin), it is
//! four products, a sum, a difference and a concatenation per projection: for a gated attention
//! layer's q and k about eighteen kernels a forward.
//!
//! Example: head_dim 256, tables of 32 (64 features rotate): features 0..32 pair with
//! 32..64, 64..256 pass through.

use candle_core::{CustomOp3, DType, Layout, Result, Shape, Tensor};

use crate::layers::rope::RopeTables;

/// `x` `[b, h, t, d]` rotated over its first `2 · half` features by `tables` (`[t, half]` or
/// `[b, t, half]`), one kernel, where it serves: a GPU, f32 or bf16 with tables of the same
/// dtype, contiguous, nothing differentiated. `None` otherwise (the caller composes).
pub fn rope_partial(x: &Tensor, tables: &RopeTables) -> Result<Option<Tensor>> {
    let (cos, sin) = (&tables.cos, &tables.sin);
    let serves = x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && cos.dtype() == x.dtype()
        && sin.dtype() == x.dtype()
        && cos.is_contiguous()
        && sin.is_contiguous()
        && cos.dims() == sin.dims()
        && x.rank() == 4
        && (cos.rank() == 2 || cos.rank() == 3)
        && x.elem_count() < u32::MAX as usize
        && !x.track_op();
    if !serves {
        return Ok(None);
    }
    let (b, _, t, d) = x.dims4()?;
    let half = cos.dim(candle_core::D::Minus1)?;
    let rows = cos.elem_count() / half.max(1);
    let want = if cos.rank() == 3 { b * t } else { t };
    if rows != want || 2 * half > d {
        candle_core::bail!(
            "partial RoPE: tables {:?} for rows {:?}",
            cos.dims(),
            x.dims()
        );
    }
    Ok(Some(x.contiguous()?.apply_op3_no_bwd(
        cos,
        sin,
        &RopePartial,
    )?))
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RopePartial;

impl CustomOp3 for RopePartial {
    fn name(&self) -> &'static str {
        "rope-partial"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("the partial RoPE kernel is CUDA's: the CPU composes it")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, by_float, elementwise, launch, view};
        use candle_core::backend::BackendStorage;
        let dev = xs.device().clone();
        let (_, h, t, d) = xl.shape().dims4()?;
        let half = *cl.dims().last().unwrap_or(&0);
        let total = xl.shape().elem_count();
        let batched = i32::from(cl.dims().len() == 3);
        let (h_, t_, d_, half_, n) = (h as u32, t as u32, d as u32, half as u32, total as u64);
        let out = by_float!(xs.dtype(), "rope_partial", |T, dt| {
            let x = view::<T>(xs, xl, "x")?;
            let (c, s) = (view::<T>(cs, cl, "cos")?, view::<T>(ss, sl, "sin")?);
            let y = alloc::<T>(&dev, total)?;
            launch!(
                dev,
                "rope_partial",
                dt,
                elementwise(n),
                x,
                c,
                s,
                y,
                h_,
                t_,
                d_,
                half_,
                batched,
                n
            );
            candle_core::CudaStorage::wrap_cuda_slice(y, dev)
        });
        Ok((out, xl.shape().clone()))
    }
}
