//! Row-wise log-softmax of draft logits on the CPU: DDTree's per-position log-probabilities.
//!
//! candle's `log_softmax` makes several passes over `[rows, vocab]` with a scalar `exp`, a
//! visible share of a DDTree round on the CPU. Here each row is three vector passes: its max, `Σ exp(x − max)`, then
//! `x − max − ln Σ`, rows spread over [`crate::cpu::helpers`].
//!
//! Example: a row `[0, ln 3]` → `[ln ¼, ln ¾]` = `[−1.386, −0.288]`.

use candle_core::{DType, Device, Result, Storage, Tensor, D};

use crate::cpu::panels::SyncPtr;

/// `log_softmax` over the last dimension of a `[rows, n]` tensor, in f32.
pub fn log_softmax_rows(logits: &Tensor) -> Result<Tensor> {
    let x = logits.to_dtype(DType::F32)?;
    let fast = matches!(x.device(), Device::Cpu)
        && x.rank() == 2
        && !x.track_op()
        && crate::cpu::Isa::detect() == Some(crate::cpu::Isa::Avx512);
    if !fast {
        return candle_nn::ops::log_softmax(&x, D::Minus1);
    }
    let x = x.contiguous()?;
    let (rows, n) = x.dims2()?;
    let (s, l) = x.storage_and_layout();
    let Storage::Cpu(s) = &*s else {
        candle_core::bail!("log_softmax_rows: CPU tensor expected");
    };
    let xs = &s.as_slice::<f32>()?[l.start_offset()..][..rows * n];
    let mut out = vec![0f32; rows * n];
    let dst = SyncPtr(out.as_mut_ptr());
    let row = |r: usize| {
        // SAFETY: AVX-512F checked above; row r writes out[r·n .. r·n + n] only
        #[cfg(target_arch = "x86_64")]
        unsafe {
            avx512::row(
                &xs[r * n..][..n],
                std::slice::from_raw_parts_mut(dst.ptr().add(r * n), n),
            )
        }
    };
    if rows * n < crate::cpu::panels::INLINE_FMAS {
        (0..rows).for_each(row);
    } else {
        crate::cpu::helpers::for_each_chunk(rows, &row);
    }
    Tensor::from_vec(out, (rows, n), &Device::Cpu)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::cpu::vexp::avx512::exp;

    /// `out = x − max − ln Σ exp(x − max)`; the tail past a multiple of 16 masked.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn row(x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let tail = |c: usize| -> __mmask16 {
            if n - c >= 16 {
                0xffff
            } else {
                (1u16 << (n - c)) - 1
            }
        };
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut vmax = ninf;
        for c in (0..n).step_by(16) {
            vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, tail(c), x.as_ptr().add(c)));
        }
        let mx = _mm512_reduce_max_ps(vmax);
        let vmx = _mm512_set1_ps(mx);
        let mut vsum = _mm512_setzero_ps();
        for c in (0..n).step_by(16) {
            let v = _mm512_mask_loadu_ps(ninf, tail(c), x.as_ptr().add(c));
            vsum = _mm512_add_ps(vsum, exp(_mm512_sub_ps(v, vmx)));
        }
        let shift = _mm512_set1_ps(mx + _mm512_reduce_add_ps(vsum).ln());
        for c in (0..n).step_by(16) {
            let m = tail(c);
            let v = _mm512_maskz_loadu_ps(m, x.as_ptr().add(c));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), m, _mm512_sub_ps(v, shift));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_docs_example_and_candles_log_softmax() {
        let t = Tensor::new(&[[0f32, 3f32.ln()]], &Device::Cpu).unwrap();
        let got = log_softmax_rows(&t).unwrap().to_vec2::<f32>().unwrap();
        assert!((got[0][0] - 0.25f32.ln()).abs() < 1e-6 && (got[0][1] - 0.75f32.ln()).abs() < 1e-6);
        // rows of a vocabulary's width and a ragged width, against candle's
        for n in [49152usize, 1001] {
            let x = Tensor::arange(0f32, (3 * n) as f32, &Device::Cpu)
                .unwrap()
                .affine(0.013, -7.0)
                .unwrap()
                .sin()
                .unwrap()
                .affine(9.0, 0.0)
                .unwrap()
                .reshape((3, n))
                .unwrap();
            let want = candle_nn::ops::log_softmax(&x, D::Minus1).unwrap();
            let got = log_softmax_rows(&x).unwrap();
            let err = crate::ops::compare::max_abs(&want, &got).unwrap();
            assert!(err < 2e-5, "width {n}: {err}");
        }
    }
}
