//! What dflash-rs's own kernels ([`crate::ops::block_softmax`], [`crate::ops::cross_entropy`],
//! [`crate::ops::interval_softmax`]) read besides their tensors: a CPU input's contiguous values
//! (the CPU twins), small u32 tables (the intervals) kept on the host and on the GPU, and a
//! matrix as a kernel reading strided rows takes it.

use candle_core::{CpuStorage, Device, Layout, Result, Tensor, WithDType};

/// A small u32 table a kernel reads (one interval, or two, per row): on the host for the CPU
/// twins and the checks, and uploaded once to a GPU device. Example: the intervals of 8,192
/// block rows, 32 KiB, one upload per training forward and layer rule.
#[derive(Debug, Clone)]
pub(crate) struct KernelTable {
    pub host: Vec<u32>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    device: Option<Tensor>,
}

impl KernelTable {
    pub fn new(host: Vec<u32>, device: &Device) -> Result<Self> {
        let device = match device {
            Device::Cpu => None,
            d => Some(Tensor::from_vec(host.clone(), host.len(), d)?),
        };
        Ok(Self { host, device })
    }

    /// Copy `self` into `dst` in place (the same length): the host values and the device
    /// buffer a captured CUDA graph reads.
    pub fn write_into(&self, dst: &mut KernelTable) -> Result<()> {
        if self.host.len() != dst.host.len() {
            candle_core::bail!(
                "a table of {} values cannot be written into one of {}",
                self.host.len(),
                dst.host.len()
            );
        }
        dst.host.copy_from_slice(&self.host);
        if let (Some(s), Some(d)) = (&self.device, &dst.device) {
            d.slice_set(s, 0, 0)?;
        }
        Ok(())
    }

    /// `f` on the table's GPU copy; `what` names the table in the error.
    #[cfg(feature = "cuda")]
    pub fn with_cuda_view<R>(
        &self,
        what: &str,
        f: impl FnOnce(candle_core::cuda_backend::cudarc::driver::CudaView<'_, u32>) -> Result<R>,
    ) -> Result<R> {
        let Some(t) = &self.device else {
            candle_core::bail!("{what}: not on the GPU of the op")
        };
        let (s, l) = t.storage_and_layout();
        match &*s {
            candle_core::Storage::Cuda(c) => f(crate::cuda::ptx::view::<u32>(c, l, what)?),
            _ => candle_core::bail!("{what}: not on the GPU of the op"),
        }
    }
}

/// `t` as a kernel reading strided rows takes it ([`crate::cuda::ptx::rows_view`]): on a GPU a
/// matrix whose rows are evenly strided with unit column stride as it is (e.g. a column range
/// of a stacked product), anything else contiguous. Example: columns 0..10,240 of `[1, 16,480]`
/// rows stay a view; a transposed matrix is copied.
pub(crate) fn rows_in_place(t: &Tensor) -> Result<Tensor> {
    let (d, s) = (t.dims(), t.stride());
    let rows = d.len() == 2 && (d[1] <= 1 || s[1] == 1) && (d[0] <= 1 || s[0] >= d[1]);
    match t.device().is_cuda() && rows {
        true => Ok(t.clone()),
        false => t.contiguous(),
    }
}

/// The `l.shape().elem_count()` values of a contiguous input, from its offset; `what` names it
/// in the error. Example: a `[2, 3]` narrow of rows 1..3 of a `[3, 3]` tensor → values 3..9.
pub(crate) fn cpu_slice<'a, T: WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    if !l.is_contiguous() {
        candle_core::bail!("{what}: contiguous input expected");
    }
    let o = l.start_offset();
    Ok(&s.as_slice::<T>()?[o..o + l.shape().elem_count()])
}

/// A CPU input's values as f32 (f32 or bf16 storage): what the CPU twins of the f32-arithmetic
/// kernels read.
pub(crate) fn f32_values(s: &CpuStorage, l: &Layout, what: &str) -> Result<Vec<f32>> {
    use candle_core::backend::BackendStorage;
    Ok(match s.dtype() {
        candle_core::DType::F32 => cpu_slice::<f32>(s, l, what)?.to_vec(),
        candle_core::DType::BF16 => cpu_slice::<half::bf16>(s, l, what)?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        other => candle_core::bail!("{what}: {other:?} is not supported (f32, bf16)"),
    })
}

/// f32 values as a CPU storage of `dtype` (f32, or bf16 rounded to nearest).
pub(crate) fn f32_storage(
    v: Vec<f32>,
    dtype: candle_core::DType,
    what: &str,
) -> Result<CpuStorage> {
    Ok(match dtype {
        candle_core::DType::F32 => CpuStorage::F32(v),
        candle_core::DType::BF16 => {
            CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect())
        }
        other => candle_core::bail!("{what}: {other:?} is not supported (f32, bf16)"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_docs_example() {
        let t = Tensor::arange(0f32, 9.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 3))
            .unwrap()
            .narrow(0, 1, 2)
            .unwrap();
        let (s, l) = t.storage_and_layout();
        let candle_core::Storage::Cpu(c) = &*s else {
            unreachable!()
        };
        let v = cpu_slice::<f32>(c, l, "x").unwrap();
        assert_eq!(v, &[3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        let tt = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        let (s, l) = tt.storage_and_layout();
        let candle_core::Storage::Cpu(c) = &*s else {
            unreachable!()
        };
        let err = cpu_slice::<f32>(c, l, "x").unwrap_err();
        assert!(
            err.to_string().contains("x: contiguous input expected"),
            "{err}"
        );
    }
}
