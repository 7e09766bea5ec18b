//! Vectors of f32 lanes for the CPU kernels (AVX-512F: 16 lanes, AVX2 + FMA: 8), with `exp`:
//! each module gives the vector type `V`, its width `W`, the lane operations the kernels are
//! written in (`zero`, `ld`, `st`, `set1`, `fma`, `add`, `sub`, `mul`, `max`, `hsum`, `hmax`)
//! and `exp`, all compiled for its ISA, so that one kernel body serves both
//! ([`crate::cpu::row_attention`]; [`crate::ops::log_softmax`] uses the AVX-512 `exp`).
//!
//! `exp` computes each lane alone by the same instructions, so a value's `exp` does not
//! depend on its lane or neighbours (the kernels' bit-identity across row layouts relies on
//! it); the horizontal sums and maxima reduce in one fixed order.
//!
//! `exp(x)` for `x ≤ 0` (Cephes' `expf`): `x = n ln 2 + r`, `|r| ≤ ln 2 / 2`, a degree-7
//! polynomial in `r`, times `2ⁿ`; within 2 ulp; 0 below −104 and for −∞. Example: `exp(−ln 2)`
//! = `n = −1`, `r = 0` → `1 · 2⁻¹ = 0.5`.

/// The Cephes `expf` polynomial coefficients, highest degree first after `P0`.
#[cfg(target_arch = "x86_64")]
const P0: f32 = 1.987_569_1e-4;
#[cfg(target_arch = "x86_64")]
const PS: [f32; 5] = [
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];
/// `ln 2` split in two for an exact `x − n ln 2`.
#[cfg(target_arch = "x86_64")]
const LN2_HI: f32 = 0.693_359_4;
#[cfg(target_arch = "x86_64")]
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this `exp` is 0.
#[cfg(target_arch = "x86_64")]
const EXP_MIN: f32 = -104.0;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    pub(crate) use std::arch::x86_64::__m512 as V;
    use std::arch::x86_64::*;

    pub(crate) const W: usize = 16;

    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn zero() -> V {
        _mm512_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn ld(p: *const f32) -> V {
        _mm512_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn st(p: *mut f32, v: V) {
        _mm512_storeu_ps(p, v)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn set1(x: f32) -> V {
        _mm512_set1_ps(x)
    }
    /// `a · b + c`
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn fma(a: V, b: V, c: V) -> V {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn add(a: V, b: V) -> V {
        _mm512_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn sub(a: V, b: V) -> V {
        _mm512_sub_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn mul(a: V, b: V) -> V {
        _mm512_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn max(a: V, b: V) -> V {
        _mm512_max_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn hsum(v: V) -> f32 {
        _mm512_reduce_add_ps(v)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn hmax(v: V) -> f32 {
        _mm512_reduce_max_ps(v)
    }

    /// `exp(x)` per lane for `x ≤ 0` (the module doc's rule).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp(x: V) -> V {
        // −∞ (and anything below −104) → exactly 0
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(super::EXP_MIN));
        let x = _mm512_max_ps(x, _mm512_set1_ps(super::EXP_MIN));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(super::LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(super::LN2_LO), r);
        let mut p = _mm512_set1_ps(super::P0);
        for c in super::PS {
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

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    pub(crate) use std::arch::x86_64::__m256 as V;
    use std::arch::x86_64::*;

    pub(crate) const W: usize = 8;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn zero() -> V {
        _mm256_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn ld(p: *const f32) -> V {
        _mm256_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn st(p: *mut f32, v: V) {
        _mm256_storeu_ps(p, v)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn set1(x: f32) -> V {
        _mm256_set1_ps(x)
    }
    /// `a · b + c`
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn fma(a: V, b: V, c: V) -> V {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn add(a: V, b: V) -> V {
        _mm256_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn sub(a: V, b: V) -> V {
        _mm256_sub_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn mul(a: V, b: V) -> V {
        _mm256_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn max(a: V, b: V) -> V {
        _mm256_max_ps(a, b)
    }
    /// The 8 lanes summed: halves, then pairs, then the last two (one fixed order).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn hsum(v: V) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn hmax(v: V) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// `2^n` for integral `n` in `[−126, 127]`, from the exponent bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pow2(n: V) -> V {
        let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
    }

    /// `exp(x)` per lane for `x ≤ 0` (the module doc's rule). AVX2 has no `scalef`: `2ⁿ`
    /// (n ≥ −150) is applied as two factors `2^⌊n/2⌋ · 2^(n − ⌊n/2⌋)`, each a normal float.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp(x: V) -> V {
        // −∞ (and anything below −104) → exactly 0
        let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(x, _mm256_set1_ps(super::EXP_MIN));
        let x = _mm256_max_ps(x, _mm256_set1_ps(super::EXP_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(super::LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(super::LN2_LO), r);
        let mut p = _mm256_set1_ps(super::P0);
        for c in super::PS {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(
            _mm256_mul_ps(p, r),
            r,
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let n1 = _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            n,
            _mm256_set1_ps(0.5),
        ));
        let y = _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(_mm256_sub_ps(n, n1)));
        _mm256_and_ps(y, keep)
    }
}

#[cfg(test)]
mod tests {
    /// Every ISA this CPU has: `exp` within 2 ulp of f64's over [−102, 0], and 0 for −∞.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_is_within_two_ulp() {
        let xs: Vec<f32> = (0..20000).map(|i| -(i as f32) * 0.0051).collect();
        let check = |x: f32, g: f32| {
            let want = (x as f64).exp();
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                (g as f64 - want).abs() <= 2.0 * ulp as f64 + f32::MIN_POSITIVE as f64,
                "exp({x}) = {g}, want {want}"
            );
        };
        let mut ran = 0;
        if std::is_x86_feature_detected!("avx512f") {
            ran += 1;
            for c in xs.chunks(16) {
                let mut buf = [f32::NEG_INFINITY; 16];
                buf[..c.len()].copy_from_slice(c);
                let mut got = [1f32; 16];
                // SAFETY: AVX-512F checked above
                unsafe {
                    use super::avx512::*;
                    st(got.as_mut_ptr(), exp(ld(buf.as_ptr())));
                }
                buf.iter().zip(got).for_each(|(x, g)| check(*x, g));
            }
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            ran += 1;
            for c in xs.chunks(8) {
                let mut buf = [f32::NEG_INFINITY; 8];
                buf[..c.len()].copy_from_slice(c);
                let mut got = [1f32; 8];
                // SAFETY: AVX2 and FMA checked above
                unsafe {
                    use super::avx2::*;
                    st(got.as_mut_ptr(), exp(ld(buf.as_ptr())));
                }
                buf.iter().zip(got).for_each(|(x, g)| check(*x, g));
            }
        }
        assert!(ran > 0, "an x86-64 CI machine has AVX2 at least");
    }
}
