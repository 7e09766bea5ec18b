//! `exp` over 16 f32 lanes at once (AVX-512F), for the CPU kernels that exponentiate many
//! values: [`crate::row_attention`]'s softmax and [`crate::log_softmax`]. Each lane is computed
//! alone by the same instructions, so a value's `exp` does not depend on its lane or
//! neighbours (the kernels' bit-identity across row layouts relies on it).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// `exp(x)` per lane for `x ≤ 0` (Cephes' `expf`: `x = n ln 2 + r`, `|r| ≤ ln 2 / 2`, a
    /// degree-7 polynomial in `r`, times `2ⁿ`; within 2 ulp; 0 below −104 and for −∞).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp(x: __m512) -> __m512 {
        // −∞ (and anything below −104) → exactly 0; NaN stays NaN
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(-104.0));
        let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let p = _mm512_fmadd_ps(
            _mm512_mul_ps(p, r),
            r,
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n))
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_is_within_two_ulp() {
        if !crate::panels::Panels::supported() {
            return;
        }
        let xs: Vec<f32> = (0..20000).map(|i| -(i as f32) * 0.0051).collect();
        for c in xs.chunks(16) {
            let mut buf = [0f32; 16];
            buf[..c.len()].copy_from_slice(c);
            let mut got = [0f32; 16];
            // SAFETY: AVX-512F checked above
            unsafe {
                use std::arch::x86_64::*;
                _mm512_storeu_ps(
                    got.as_mut_ptr(),
                    super::avx512::exp(_mm512_loadu_ps(buf.as_ptr())),
                );
            }
            for (x, g) in buf.iter().zip(got) {
                let want = (*x as f64).exp();
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!(
                    (g as f64 - want).abs() <= 2.0 * ulp as f64 + f32::MIN_POSITIVE as f64,
                    "exp({x}) = {g}, want {want}"
                );
            }
        }
    }
}
