//! The arg-max of each row, computed where the rows are: a verify's logits stay on the device
//! and only one index per row comes back (at T = 0 the walk needs nothing else). The rule is the
//! host's [`dflash_core::sampling::argmax`] exactly — the first index of the largest value, NaN
//! never chosen except that a row starting with NaN gives 0 — so that every mode (AR included,
//! which walks the same way) picks the same token as transformers' `argmax` on ties. Example:
//! rows [[1, 3, 3], [NaN, 5, 2]] → [1, 0].

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::ops::kernel_io::cpu_slice;

/// The arg-max of every row of `x` `[rows, v]` (any float dtype), one transfer of `rows` indices.
pub fn argmax_rows(x: &Tensor) -> Result<Vec<u32>> {
    argmax_rows_kept(x)?.to_vec1::<u32>()
}

/// [`argmax_rows`] left where `x` is: `[rows]` u32 on `x`'s device, nothing transferred (a
/// chain's drafts become the verify's tokens on the device).
pub fn argmax_rows_kept(x: &Tensor) -> Result<Tensor> {
    let (_, v) = x.dims2()?;
    if v == 0 {
        candle_core::bail!("argmax: rows of no values");
    }
    x.to_dtype(candle_core::DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&ArgmaxRows)
}

struct ArgmaxRows;

impl CustomOp1 for ArgmaxRows {
    fn name(&self) -> &'static str {
        "argmax-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l.shape().dims2()?;
        let x = cpu_slice::<f32>(s, l, "argmax input")?;
        let out: Vec<u32> = x.chunks(v).map(dflash_core::sampling::argmax).collect();
        Ok((CpuStorage::U32(out), Shape::from(n)))
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
        let x = view::<f32>(s, l, "argmax input")?;
        let out = alloc::<u32>(&dev, n)?;
        let vi = v as i32;
        launch!(
            dev,
            "argmax_rows",
            candle_core::DType::F32,
            rows(n, 256),
            x,
            out,
            vi
        );
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(n),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_module_example_and_the_host_rule() {
        let x = Tensor::new(&[[1f32, 3.0, 3.0], [f32::NAN, 5.0, 2.0]], &Device::Cpu).unwrap();
        assert_eq!(argmax_rows(&x).unwrap(), vec![1, 0]);
        let rows = [
            vec![0.0f32, -0.0, 0.0],
            vec![-1.0, f32::NAN, 4.0, 4.0],
            vec![f32::NEG_INFINITY; 3],
            vec![2.0, 7.0, f32::INFINITY, f32::NAN],
        ];
        for r in rows {
            let t = Tensor::new(r.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            assert_eq!(
                argmax_rows(&t).unwrap(),
                vec![dflash_core::sampling::argmax(&r)],
                "{r:?}"
            );
        }
    }
}
