//! A Gated DeltaNet layer's conv window after a forward's kept rows settle: the committed
//! window `[K−1, C]` becomes the last K−1 rows of `[window | the kept rows' inputs]`, in place
//! (a captured forward reads the same buffer). One kernel on a GPU; composed of an index
//! select, a concatenation and a copy elsewhere (the CPU's path and the kernel's twin, compared
//! by `check device`). Composed, that is five kernels and a host-to-device copy of the row
//! indices per layer and round.
//!
//! Example: K = 4, window [c0, c1, c2], a chain verify whose rows 0 and 1 are kept (tail
//! [0, 1]): the window becomes [c2, in0, in1].

use candle_core::{DType, InplaceOp2, Layout, Result, Tensor};

/// The most kept rows the kernel takes (K − 1 ≤ 8: every Gated DeltaNet has K = 4).
const MAX_TAIL: usize = 8;

/// `conv` `[k1, C]` ← the last k1 rows of `[conv | inputs[tail]]`, in place. `tail`: at most
/// k1 row indices of `inputs` `[n, C]` (the kept path's last rows, oldest first); f32.
pub fn settle_conv(conv: &Tensor, inputs: &Tensor, tail: &[usize]) -> Result<()> {
    if tail.is_empty() {
        return Ok(());
    }
    let (k1, c) = conv.dims2()?;
    let (n, width) = inputs.dims2()?;
    if tail.len() > k1 || width != c || tail.iter().any(|&r| r >= n) {
        candle_core::bail!(
            "gdn settle: kept rows {tail:?} of {n} rows of width {width} for a window of {k1} × {c}"
        );
    }
    if conv.device().is_cuda()
        && conv.dtype() == DType::F32
        && inputs.dtype() == DType::F32
        && conv.is_contiguous()
        && k1 <= MAX_TAIL
    {
        // a column range of the layer's stacked in-projection is read where it is
        let inputs = crate::ops::kernel_io::rows_in_place(inputs)?;
        return conv.inplace_op2(&inputs, &SettleConv(tail.to_vec()));
    }
    let idx: Vec<u32> = tail.iter().map(|&r| r as u32).collect();
    let inputs = inputs.contiguous()?;
    let picked = inputs.index_select(&Tensor::new(idx, inputs.device())?, 0)?;
    let window = Tensor::cat(&[conv, &picked], 0)?;
    let kept = window.narrow(0, window.dim(0)? - k1, k1)?.contiguous()?;
    conv.slice_set(&kept, 0, 0)
}

/// The kept rows' indices into the inputs.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct SettleConv(Vec<usize>);

impl InplaceOp2 for SettleConv {
    fn name(&self) -> &'static str {
        "gdn-settle-conv"
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        candle_core::bail!("the conv window's settle kernel is CUDA's: the CPU composes it")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        conv: &mut candle_core::CudaStorage,
        cl: &Layout,
        inputs: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<()> {
        use crate::cuda::ptx::{elementwise, launch, rows_view};
        use candle_core::backend::BackendStorage;
        let dev = inputs.device().clone();
        let (k1, c) = cl.shape().dims2()?;
        let (x, ld) = rows_view::<f32>(inputs, il, "inputs")?;
        let ld = ld as i32;
        let o = cl.start_offset();
        let w = conv.as_cuda_slice::<f32>()?.slice(o..o + k1 * c);
        let mut t = [0i32; MAX_TAIL];
        for (s, &r) in t.iter_mut().zip(&self.0) {
            *s = r as i32;
        }
        let (c_, k1_, m) = (c as i32, k1 as i32, self.0.len() as i32);
        let [t0, t1, t2, t3, t4, t5, t6, t7] = t;
        launch!(
            dev,
            "gdn_settle_conv",
            DType::F32,
            elementwise(c as u64),
            w,
            x,
            ld,
            c_,
            k1_,
            m,
            t0,
            t1,
            t2,
            t3,
            t4,
            t5,
            t6,
            t7
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The docs' example: window [c0, c1, c2], rows 0 and 1 kept → [c2, in0, in1]; a kept row
    /// past the inputs is refused, the window untouched.
    #[test]
    fn the_window_keeps_its_last_rows_and_refuses_a_row_past_the_inputs() {
        let conv = Tensor::new(&[[0f32, 0.5], [1.0, 1.5], [2.0, 2.5]], &Device::Cpu).unwrap();
        let inputs = Tensor::new(&[[10f32, 10.5], [11.0, 11.5]], &Device::Cpu).unwrap();
        settle_conv(&conv, &inputs, &[0, 1]).unwrap();
        let got = conv.to_vec2::<f32>().unwrap();
        assert_eq!(
            got,
            vec![vec![2.0, 2.5], vec![10.0, 10.5], vec![11.0, 11.5]]
        );
        let err = settle_conv(&conv, &inputs, &[2]).unwrap_err().to_string();
        assert!(err.contains("kept rows [2] of 2 rows"), "{err}");
        assert_eq!(conv.to_vec2::<f32>().unwrap(), got);
    }
}
