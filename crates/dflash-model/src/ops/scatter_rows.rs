//! A fixed-layout cache write: `dst[s, h, index[s, h, i, e], e] = src[s, h, i, e]` for K/V
//! buffers `dst` `[b, h, cap, d]` and new rows `src` `[b, h, n, d]` (candle's `scatter_set`
//! along the rows). On a GPU one element-wise kernel (candle's scatter kernel serialises over
//! the index and costs a large share of a draft block, two writes per drafter layer). Elsewhere `scatter_set` (the twin, compared by `check device`).
//!
//! Example: `dst` `[1, 2, 8, 4]`, 2 new rows with index rows `[5, 6]` → rows 5 and 6 of both
//! heads are the new rows, the other six unchanged.

use candle_core::{DType, InplaceOp3, Layout, Result, Tensor};

/// Write `src`'s rows into `dst` at the rows `index` names (see the module docs).
pub fn scatter_rows(dst: &Tensor, src: &Tensor, index: &Tensor) -> Result<()> {
    let src = src.contiguous()?;
    let fits = dst.rank() == 4
        && src.rank() == 4
        && index.dims() == src.dims()
        && dst.dims()[..2] == src.dims()[..2]
        && dst.dims()[3] == src.dims()[3];
    if dst.device().is_cuda()
        && fits
        && matches!(dst.dtype(), DType::F32 | DType::BF16)
        && src.dtype() == dst.dtype()
        && index.dtype() == DType::U32
        && dst.is_contiguous()
        && index.is_contiguous()
    {
        return dst.inplace_op3(&src, index, &ScatterRows);
    }
    dst.scatter_set(index, &src, 2)
}

struct ScatterRows;

impl InplaceOp3 for ScatterRows {
    fn name(&self) -> &'static str {
        "scatter-rows"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        candle_core::bail!("scatter_rows's kernel is CUDA's: the CPU runs scatter_set")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        src: &candle_core::CudaStorage,
        sl: &Layout,
        ix: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<()> {
        use crate::cuda::ptx::{by_float, elementwise, launch, view};
        use candle_core::backend::BackendStorage;
        let dev = src.device().clone();
        let (_, _, n, d) = sl.shape().dims4()?;
        let cap = dl.dims()[2];
        let total = sl.shape().elem_count() as u64;
        let (n_, d_, cap_) = (n as u64, d as u64, cap as u64);
        let index = view::<u32>(ix, il, "index")?;
        by_float!(src.dtype(), "scatter_rows", |T, dt| {
            let s = view::<T>(src, sl, "rows")?;
            let o = dl.start_offset();
            let out = dst.as_cuda_slice::<T>()?.slice(o..);
            launch!(
                dev,
                "scatter_rows",
                dt,
                elementwise(total),
                s,
                index,
                out,
                n_,
                d_,
                cap_,
                total
            );
        });
        Ok(())
    }
}
