//! SwiGLU's gate `y = silu(g) · u` on the CPU, in one pass on the calling thread with the
//! kernels' vector `exp` ([`crate::cpu::vexp`]), for inference's few rows: candle's `silu` and
//! multiply are two passes, each waking its thread pool, which for a few rows costs more than
//! the arithmetic (`docs/BENCHMARKS.md`, the one-pass SwiGLU).
//!
//! Per element, with `e = exp(−|g|)` (≤ 1, the argument `exp` serves): `s = 1 / (1 + e)` for
//! `g ≥ 0`, `e / (1 + e)` below, and `y = (g · s) · u`. Each lane is computed alone by the same
//! instructions (a partial last vector is loaded masked or padded), so an element's result does
//! not depend on its neighbours: a row gets the same bits alone and among others.
//! Example: g = 0, u = 3 → e = 1, s = ½, y = 0; g = ln 3, u = 1 → e = ⅓, s = ¾, y = ¾ ln 3.

use candle_core::{DType, Device, Result, Tensor};

use crate::cpu::Isa;

/// Whether [`silu_mul`] serves `x`'s MLP: an f32 CPU input that nothing differentiates, on a
/// CPU with a kernel ISA.
pub fn serves(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32 && !x.track_op() && Isa::detect().is_some()
}

/// `silu(g) · u` of two f32 CPU tensors of one shape (see the module doc).
pub fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    let isa = Isa::detect();
    if g.shape() != u.shape() || g.dtype() != DType::F32 || u.dtype() != DType::F32 {
        candle_core::bail!(
            "swiglu: gate {:?} {:?} and up {:?} {:?}",
            g.dims(),
            g.dtype(),
            u.dims(),
            u.dtype()
        );
    }
    let (gv, uv): (Vec<f32>, Vec<f32>) = (g.flatten_all()?.to_vec1()?, u.flatten_all()?.to_vec1()?);
    let mut y = vec![0f32; gv.len()];
    match isa {
        Some(isa) => silu_mul_on(isa, &gv, &uv, &mut y),
        None => candle_core::bail!("swiglu: no kernel ISA on this CPU"),
    }
    Tensor::from_vec(y, g.shape(), &Device::Cpu)
}

/// [`silu_mul`] of slices on `isa`, which the CPU must run. Panics if the lengths differ.
pub fn silu_mul_on(isa: Isa, g: &[f32], u: &[f32], y: &mut [f32]) {
    assert!(g.len() == u.len() && u.len() == y.len(), "swiglu: lengths");
    assert!(Isa::available().contains(&isa), "swiglu: no {isa:?} here");
    // SAFETY: the CPU runs `isa` (checked above); the lengths agree
    #[cfg(target_arch = "x86_64")]
    unsafe {
        match isa {
            Isa::Avx512 => avx512(g, u, y),
            Isa::Avx2 => avx2(g, u, y),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512(g: &[f32], u: &[f32], y: &mut [f32]) {
    use crate::cpu::vexp::avx512::exp;
    use std::arch::x86_64::*;
    let (zero, one) = (_mm512_setzero_ps(), _mm512_set1_ps(1.0));
    for i in (0..g.len()).step_by(16) {
        let left = g.len() - i;
        let m: __mmask16 = if left >= 16 { 0xffff } else { (1 << left) - 1 };
        let gv = _mm512_maskz_loadu_ps(m, g.as_ptr().add(i));
        let uv = _mm512_maskz_loadu_ps(m, u.as_ptr().add(i));
        let e = exp(_mm512_sub_ps(zero, _mm512_abs_ps(gv)));
        let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(gv, zero);
        let s = _mm512_div_ps(_mm512_mask_blend_ps(below, one, e), _mm512_add_ps(one, e));
        let yv = _mm512_mul_ps(_mm512_mul_ps(gv, s), uv);
        _mm512_mask_storeu_ps(y.as_mut_ptr().add(i), m, yv);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(g: &[f32], u: &[f32], y: &mut [f32]) {
    use crate::cpu::vexp::avx2::exp;
    use std::arch::x86_64::*;
    let (zero, one) = (_mm256_setzero_ps(), _mm256_set1_ps(1.0));
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    for i in (0..g.len()).step_by(8) {
        let left = (g.len() - i).min(8);
        let (mut gb, mut ub, mut yb) = ([0f32; 8], [0f32; 8], [0f32; 8]);
        gb[..left].copy_from_slice(&g[i..i + left]);
        ub[..left].copy_from_slice(&u[i..i + left]);
        let (gv, uv) = (_mm256_loadu_ps(gb.as_ptr()), _mm256_loadu_ps(ub.as_ptr()));
        let e = exp(_mm256_sub_ps(zero, _mm256_and_ps(gv, abs)));
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(gv, zero);
        let s = _mm256_div_ps(_mm256_blendv_ps(one, e, below), _mm256_add_ps(one, e));
        _mm256_storeu_ps(yb.as_mut_ptr(), _mm256_mul_ps(_mm256_mul_ps(gv, s), uv));
        y[i..i + left].copy_from_slice(&yb[..left]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On every ISA the CPU runs: the module doc's example; every value within 4e-7 relative
    /// of f64's `g · u / (1 + e^−g)` over ±90 (and 0, ±∞ → 0·u, ∞·u; NaN → NaN); each element
    /// alone gives its bits in a run of 37 (the partial last vector).
    #[test]
    fn silu_mul_is_f64_silu_within_rounding_and_alone_the_same() {
        let g: Vec<f32> = (0..37)
            .map(|i| (i as f32 - 18.0) * 5.0 + 0.37)
            .chain([
                0.0,
                3f32.ln(),
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -1e-30,
            ])
            .collect();
        let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 5) as f32 * 0.5).collect();
        for isa in Isa::available() {
            let mut y = vec![0f32; g.len()];
            silu_mul_on(isa, &g, &u, &mut y);
            for (i, (&gi, &ui)) in g.iter().zip(&u).enumerate() {
                let mut alone = [0f32];
                silu_mul_on(isa, &[gi], &[ui], &mut alone);
                assert_eq!(
                    alone[0].to_bits(),
                    y[i].to_bits(),
                    "{isa:?}: element {i} alone"
                );
                let want = gi as f64 * ui as f64 / (1.0 + (-(gi as f64)).exp());
                if gi.is_nan() || gi == f32::NEG_INFINITY {
                    assert!(y[i].is_nan(), "{isa:?}: silu({gi})");
                } else if gi == f32::INFINITY {
                    assert_eq!(y[i], f32::INFINITY);
                } else {
                    let err = (y[i] as f64 - want).abs();
                    assert!(
                        err <= 4e-7 * want.abs() + 1e-38,
                        "{isa:?}: g {gi}: {} vs {want}",
                        y[i]
                    );
                }
            }
            let mut ex = [0f32; 2];
            silu_mul_on(isa, &[0.0, 3f32.ln()], &[3.0, 1.0], &mut ex);
            assert_eq!(ex[0], 0.0);
            assert!((ex[1] as f64 - 0.75 * 3f64.ln()).abs() < 1e-6);
        }
    }
}
