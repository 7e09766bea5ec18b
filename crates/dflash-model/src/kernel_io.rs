//! The CPU twins' view of a custom op's input ([`crate::block_softmax`],
//! [`crate::cross_entropy`], [`crate::interval_softmax`]): its contiguous values from its offset.

use candle_core::{CpuStorage, Layout, Result, WithDType};

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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

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
