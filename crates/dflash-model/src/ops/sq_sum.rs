//! The sum of squares of a tensor's values in f32, read once: the gradient clip's global norm
//! on the GPU (`dflash_train::optim::clip_scale`) without a cast, a square and a sum as three
//! passes. bf16 values are widened in registers. Example: [3, 4] → 25; a bf16 [0.5; 4] → 1.
//!
//! The kernel (`sq_sum_{f32,bf16}` in `src/ops/sq_sum.cu`) writes one partial sum per block of a
//! grid-stride loop, and the partials are summed after; the CPU twin sums in f64 (one partial),
//! so the two agree to f32 rounding, not bit for bit.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use crate::ops::kernel_io::f32_values;

/// Σ x² over every value of `t` (f32 or bf16), accumulated in f32 (f64 on the CPU): a 0-dim f32
/// tensor on `t`'s device.
pub fn sq_sum(t: &Tensor) -> Result<Tensor> {
    if !matches!(t.dtype(), DType::F32 | DType::BF16) {
        candle_core::bail!("sq_sum: f32 or bf16 values expected, got {:?}", t.dtype());
    }
    if t.elem_count() == 0 {
        return Tensor::zeros((), DType::F32, t.device());
    }
    t.flatten_all()?
        .contiguous()?
        .apply_op1_no_bwd(&SqSum)?
        .sum_all()
}

/// Most blocks the kernel launches (256 threads each).
#[cfg(feature = "cuda")]
const MAX_BLOCKS: u64 = 1024;

struct SqSum;

impl CustomOp1 for SqSum {
    fn name(&self) -> &'static str {
        "sq-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_values(s, l, "sq_sum input")?;
        let total: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
        Ok((CpuStorage::F32(vec![total as f32]), Shape::from(1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, by_float, launch, view};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let n = l.shape().elem_count() as u64;
        let dev = s.device().clone();
        let blocks = n.div_ceil(256).clamp(1, MAX_BLOCKS);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let out = alloc::<f32>(&dev, blocks as usize)?;
        by_float!(s.dtype(), "sq_sum", |T, dt| {
            let x = view::<T>(s, l, "sq_sum input")?;
            launch!(dev, "sq_sum", dt, cfg, x, out, n);
        });
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(blocks as usize),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_module_examples() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[3f32, 4.0], &dev).unwrap();
        assert_eq!(sq_sum(&x).unwrap().to_scalar::<f32>().unwrap(), 25.0);
        let h = Tensor::new(&[0.5f32; 4], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        assert_eq!(sq_sum(&h).unwrap().to_scalar::<f32>().unwrap(), 1.0);
        let e = Tensor::zeros((0, 3), DType::F32, &dev).unwrap();
        assert_eq!(sq_sum(&e).unwrap().to_scalar::<f32>().unwrap(), 0.0);
        let i = Tensor::new(&[1u32], &dev).unwrap();
        assert!(sq_sum(&i).is_err());
    }
}
