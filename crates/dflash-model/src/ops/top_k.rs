//! The top k of each row, computed where the rows are: DDTree's per-depth candidates from the
//! drafter's log-probabilities, with only `rows × k` indices and values leaving the device (not
//! `rows × vocab`; on the GPU in two stages: each segment of 4,096 values, then the segments'
//! picks). The order is [`dflash_core::tree::top_k_sorted`]'s exactly — value descending
//! by the IEEE total order, ties by token id ascending — which the CPU twin calls. Example:
//! rows [[1, 3, 2, 3]], k 3 → [[(1, 3), (3, 3), (2, 2)]].

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use crate::ops::kernel_io::cpu_slice;

/// The top `k` (token, value) of every row of `x` `[rows, v]` (f32), best first.
pub fn top_k_rows(x: &Tensor, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
    let (n, v) = x.dims2()?;
    let k = k.min(v);
    if k == 0 || n == 0 {
        return Ok(vec![Vec::new(); n]);
    }
    let x = x.to_dtype(DType::F32)?.contiguous()?;
    let idx = top_k_indices(&x, k)?;
    let vals = x.gather(&idx, 1)?.to_vec2::<f32>()?;
    let idx = idx.to_vec2::<u32>()?;
    Ok(idx
        .into_iter()
        .zip(vals)
        .map(|(i, v)| i.into_iter().zip(v).collect())
        .collect())
}

/// The indices of the top `k` (1 ≤ k ≤ v) of every row of `x` `[rows, v]` (f32), best first:
/// `[rows, k]` u32, left where `x` is.
pub fn top_k_indices(x: &Tensor, k: usize) -> Result<Tensor> {
    let (_, v) = x.dims2()?;
    if k == 0 || k > v {
        candle_core::bail!("top_k_indices: k {k} of rows of {v}");
    }
    x.to_dtype(DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&TopK(k))
}

struct TopK(usize);

impl CustomOp1 for TopK {
    fn name(&self) -> &'static str {
        "top-k-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l.shape().dims2()?;
        let x = cpu_slice::<f32>(s, l, "top-k input")?;
        let out: Vec<u32> = x
            .chunks(v)
            .flat_map(|r| {
                dflash_core::tree::top_k_sorted(r, self.0)
                    .into_iter()
                    .map(|(i, _)| i)
            })
            .collect();
        Ok((CpuStorage::U32(out), Shape::from((n, self.0))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        use candle_core::backend::BackendStorage;
        let (n, v) = l.shape().dims2()?;
        let dev = s.device().clone();
        let x = view::<f32>(s, l, "top-k input")?;
        // stage 1: the top k of every segment of 4,096 values; stage 2: of the segments' picks
        const SEG: usize = 4096;
        let nseg = v.div_ceil(SEG);
        let cand = alloc::<u32>(&dev, n * nseg * self.0)?;
        let (vi, ki) = (v as i32, self.0 as i32);
        let cfg = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
            grid_dim: (n as u32, nseg as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(dev, "top_k_seg", DType::F32, cfg, x, cand, vi, ki);
        let out = alloc::<u32>(&dev, n * self.0)?;
        let nc = (nseg * self.0) as i32;
        launch!(
            dev,
            "top_k_merge",
            DType::F32,
            rows(n, 256),
            x,
            cand,
            out,
            vi,
            nc,
            ki
        );
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((n, self.0)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_module_example_and_the_host_order() {
        let x = Tensor::new(&[[1f32, 3.0, 2.0, 3.0]], &Device::Cpu).unwrap();
        assert_eq!(
            top_k_rows(&x, 3).unwrap(),
            vec![vec![(1, 3.0), (3, 3.0), (2, 2.0)]]
        );
        // k past the row, and a k of 0
        assert_eq!(top_k_rows(&x, 9).unwrap()[0].len(), 4);
        assert!(top_k_rows(&x, 0).unwrap()[0].is_empty());
    }
}
