//! Input rows quantized by the rule (see [`super`]): 8 bits per block of 32 values, on AVX2
//! where the CPU has it, else by the scalar twin (the same bits).

use super::QB;

/// Input rows quantized by the rule (see the module doc): per row and block, `q` (32 i8), the
/// scale `d`, the f32 sum `s` of the block's inputs, the integer sum of its `q` and of its first
/// 16 (Q6_K's half-blocks).
#[derive(Debug, Clone)]
pub struct Q8Rows {
    pub k: usize,
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub qsum: Vec<i32>,
    pub qsum_lo: Vec<i32>,
}

/// `rows × k` inputs (`k` a multiple of 32) quantized block by block (see the module doc),
/// on AVX2 where the CPU has it, else by [`quantize_block_scalar`] (the same bits). A
/// non-finite input makes its block's scale NaN and its `q` zero, so that the block's products
/// are NaN, as the f32 products would be.
pub fn quantize_rows(x: &[f32], rows: usize, k: usize) -> Q8Rows {
    assert!(
        k.is_multiple_of(QB) && x.len() == rows * k,
        "quantize_rows: {} values for {rows} rows of {k}",
        x.len()
    );
    let blocks = rows * k / QB;
    let mut out = Q8Rows {
        k,
        q: vec![0; rows * k],
        d: vec![0.0; blocks],
        s: vec![0.0; blocks],
        qsum: vec![0; blocks],
        qsum_lo: vec![0; blocks],
    };
    #[cfg(target_arch = "x86_64")]
    let simd = std::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    for (b, (xb, qb)) in x
        .chunks_exact(QB)
        .zip(out.q.chunks_exact_mut(QB))
        .enumerate()
    {
        let (d, s, qsum) = if simd {
            // SAFETY: the CPU runs AVX2 (checked above); 32 values in and out
            #[cfg(target_arch = "x86_64")]
            unsafe {
                quantize_block_avx2(xb, qb)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        } else {
            quantize_block_scalar(xb, qb)
        };
        (out.d[b], out.s[b], out.qsum[b]) = (d, s, qsum);
        out.qsum_lo[b] = qb[..QB / 2].iter().map(|&v| v as i32).sum();
    }
    out
}

/// One block of 32 inputs by the rule: `q` written, `(d, s, Σ q)` returned. `q` is `x · (1 /
/// d)` rounded to nearest, ties to even (the vector conversion's rounding); `s` is summed as 8
/// lanes of 4 — lane `i` is `(x[i] + x[i + 8]) + (x[i + 16] + x[i + 24])` — then lane `i` plus
/// lane `i + 4`, those plus the one 2 apart, and the last two. Example: x = [1.0, 0, …] → d =
/// 1/127, q[0] = 127, s = 1, Σ q = 127.
pub fn quantize_block_scalar(x: &[f32], q: &mut [i8]) -> (f32, f32, i32) {
    let bad = x.iter().any(|v| !v.is_finite());
    let lane = |i: usize| (x[i] + x[i + 8]) + (x[i + 16] + x[i + 24]);
    let l: Vec<f32> = (0..8).map(lane).collect();
    let t: Vec<f32> = (0..4).map(|i| l[i] + l[i + 4]).collect();
    let s = (t[0] + t[2]) + (t[1] + t[3]);
    if bad {
        q.fill(0);
        return (f32::NAN, s, 0);
    }
    let a = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = a / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut qsum = 0;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * inv).round_ties_even() as i8;
        qsum += *q as i32;
    }
    (d, s, qsum)
}

/// [`quantize_block_scalar`] on AVX2: the same bits.
/// # Safety
/// The CPU runs AVX2; `x` and `q` hold 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8]) -> (f32, f32, i32) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == QB && q.len() == QB);
    let p = x.as_ptr();
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let inf = _mm256_set1_ps(f32::INFINITY);
    let a = v.map(|v| _mm256_and_ps(v, abs_mask));
    // lanes that are NaN or infinite: not less than ∞
    let bad = a.iter().fold(0, |m, &a| {
        m | _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf))
    });
    let l = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
    let t = _mm_add_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps::<1>(l));
    let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    let s = _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps::<1>(u, u)));
    if bad != 0 {
        q.fill(0);
        return (f32::NAN, s, 0);
    }
    let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
    let d = amax / 127.0;
    let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
    // nearest, ties to even (MXCSR's default rounding)
    let i = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inv)));
    let sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    let s4 = _mm_add_epi32(
        _mm256_castsi256_si128(sum),
        _mm256_extracti128_si256::<1>(sum),
    );
    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    let qsum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2)));
    // i32 → i16 → i8 (values within ±127), the 128-bit lanes' interleaving undone
    let w = _mm256_packs_epi16(
        _mm256_packs_epi32(i[0], i[1]),
        _mm256_packs_epi32(i[2], i[3]),
    );
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, w);
    (d, s, qsum)
}
