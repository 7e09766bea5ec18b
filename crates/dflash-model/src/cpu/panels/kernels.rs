//! The panel kernels (AVX-512, and AVX2 + FMA + F16C as two 8-lane halves), written once for
//! both ISAs, and the kernel each panel kind runs.

use super::{
    Q4Kb, Q6Kb, PANEL, Q41, Q4K_PANEL_BLOCK, Q4_1_PANEL_BLOCK, Q6K_PANEL_BLOCK, Q80,
    Q8_0_PANEL_BLOCK,
};

/// The kernel a panel kind runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    F32,
    Bf16,
    /// 4-bit values, f16 (`false`) or f32 (`true`) scales: Q4_1, Q4_K.
    Nibbles(bool),
    /// Signed bytes, one scale per `.0` steps, f16 or f32: Q8_0 (and Q4_0, Q5_0), Q6_K.
    Signed(usize, bool),
}

/// A panel's values as the kernels read them: its length for `k` steps and its kernel.
pub(super) trait Stream: Copy + Sync {
    const KERNEL: Kernel;
    fn panel_len(k: usize) -> usize;
}

impl Stream for f32 {
    const KERNEL: Kernel = Kernel::F32;
    fn panel_len(k: usize) -> usize {
        k * PANEL
    }
}

impl Stream for u16 {
    const KERNEL: Kernel = Kernel::Bf16;
    fn panel_len(k: usize) -> usize {
        k * PANEL
    }
}

macro_rules! byte_stream {
    ($($t:ident: $steps:literal, $block:ident, $kernel:expr);*) => {$(
        impl Stream for $t {
            const KERNEL: Kernel = $kernel;
            fn panel_len(k: usize) -> usize {
                k / $steps * $block
            }
        }
    )*};
}
byte_stream!(
    Q41: 32, Q4_1_PANEL_BLOCK, Kernel::Nibbles(false);
    Q4Kb: 32, Q4K_PANEL_BLOCK, Kernel::Nibbles(true);
    Q80: 32, Q8_0_PANEL_BLOCK, Kernel::Signed(32, false);
    Q6Kb: 16, Q6K_PANEL_BLOCK, Kernel::Signed(16, true)
);

/// The kernels, written once for both ISAs: expanded inside a module that defines `V` (16 f32
/// lanes: one AVX-512 vector or two AVX2 ones) and its operations, all compiled for
/// `$feature`: `zero`, `fma(acc, x, w)` (`acc + x · w`, `x` broadcast, fused), `mul`, `add`,
/// `load_f32` and `load_bf16` (16 values), `load_f16` (16 f16 from 32 bytes), `nibbles` (8
/// bytes → their 8 low nibbles then their 8 high ones), `signed` (16 i8) and `store` (the
/// first `cols` lanes). `$r` lists the row counts of a block (1 ..= the ISA's block rows).
///
/// Each output lane is `Σ_kk x[r][kk] · w[kk]` summed in the order `kk = 0, 1, …` by fused
/// multiply-adds into one accumulator lane, in both ISAs, and every panel kind dequantizes its
/// 16 values per step with the loader's operations before the same multiply-adds: a quantized
/// panel's outputs are the f32 panel's bits on either ISA.
#[cfg(target_arch = "x86_64")]
macro_rules! panel_kernels {
    ($feature:literal, $($r:literal)*) => {
        use super::{Kernel, Stream};

        /// Prefetch distance: 4 KiB ahead in the panel stream, which runs on into the next
        /// panel: far enough to hide the memory's latency at a few rows, and the exact distance
        /// matters little while prefetching at all matters much.
        const AHEAD_BYTES: usize = 4096;

        /// `y[r, 0..cols]` (row stride `ldy`) for the `rows` rows of `x` (`rows × k`, `rows`
        /// one of `$r`) against one panel (`E::panel_len(k)` values).
        /// # Safety
        /// The CPU runs `$feature`; `y` writable for `rows` rows of stride `ldy`, `cols ≤ 16`.
        #[target_feature(enable = $feature)]
        pub unsafe fn block<E: Stream>(
            x: &[f32],
            rows: usize,
            k: usize,
            panel: &[E],
            y: *mut f32,
            ldy: usize,
            cols: usize,
        ) {
            debug_assert!(x.len() == rows * k && panel.len() == E::panel_len(k));
            let p = panel.as_ptr() as *const u8;
            match rows {
                $($r => match E::KERNEL {
                    Kernel::F32 => plain::<$r, 4>(x, k, p, y, ldy, cols),
                    Kernel::Bf16 => plain::<$r, 2>(x, k, p, y, ldy, cols),
                    Kernel::Nibbles(f32_scales) => nibbles_rows::<$r>(x, k, p, f32_scales, y, ldy, cols),
                    Kernel::Signed(group, f32_scales) => {
                        signed_rows::<$r>(x, k, p, group, f32_scales, y, ldy, cols)
                    }
                },)*
                _ => unreachable!("a block of {rows} rows"),
            }
        }

        /// f32 (`BYTES` 4) or bf16 (`BYTES` 2, widened exactly) panel values.
        #[inline]
        #[target_feature(enable = $feature)]
        unsafe fn plain<const R: usize, const BYTES: usize>(
            x: &[f32],
            k: usize,
            p: *const u8,
            y: *mut f32,
            ldy: usize,
            cols: usize,
        ) {
            let xp = x.as_ptr();
            let mut acc = [zero(); R];
            for kk in 0..k {
                let at = kk * 16 * BYTES;
                let w = if BYTES == 4 {
                    load_f32(p.add(at) as *const f32)
                } else {
                    load_bf16(p.add(at) as *const u16)
                };
                // a hint: past the end of the weights it fetches nothing useful, never faults
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at + AHEAD_BYTES) as *const i8);
                fma_rows(&mut acc, xp, k, kk, w);
            }
            store_rows(&acc, y, ldy, cols);
        }

        /// `acc[r] += x[r][kk] · w` for every row: the one multiply-add order of every kind.
        #[inline]
        #[target_feature(enable = $feature)]
        unsafe fn fma_rows<const R: usize>(
            acc: &mut [V; R],
            xp: *const f32,
            k: usize,
            kk: usize,
            w: V,
        ) {
            for (r, a) in acc.iter_mut().enumerate() {
                *a = fma(*a, *xp.add(r * k + kk), w);
            }
        }

        /// The rows' first `cols` outputs to `y` (row stride `ldy`).
        #[inline]
        #[target_feature(enable = $feature)]
        unsafe fn store_rows<const R: usize>(acc: &[V; R], y: *mut f32, ldy: usize, cols: usize) {
            for (r, a) in acc.iter().enumerate() {
                store(y.add(r * ldy), *a, cols);
            }
        }

        /// A Q4_1 panel (f16 scales) or a Q4_K one (f32 scales): per block of 32 steps the 16
        /// columns' `d` and `m` (widened from f16 exactly, or read), per step the 16 values
        /// unpacked from 8 bytes and dequantized as `q · d + m` (a product, then a sum: the
        /// loader's two roundings).
        #[inline]
        #[target_feature(enable = $feature)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn nibbles_rows<const R: usize>(
            x: &[f32],
            k: usize,
            pp: *const u8,
            f32_scales: bool,
            y: *mut f32,
            ldy: usize,
            cols: usize,
        ) {
            let (block, scales) = if f32_scales {
                (super::Q4K_PANEL_BLOCK, 128)
            } else {
                (super::Q4_1_PANEL_BLOCK, 64)
            };
            let xp = x.as_ptr();
            let mut acc = [zero(); R];
            for b in 0..k / 32 {
                let base = pp.add(b * block);
                for line in 0..block.div_ceil(64) {
                    let at = b * block + AHEAD_BYTES + 64 * line;
                    _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(at) as *const i8);
                }
                let (d, m) = if f32_scales {
                    (load_f32(base as *const f32), load_f32(base.add(64) as *const f32))
                } else {
                    (load_f16(base), load_f16(base.add(32)))
                };
                for j in 0..32 {
                    let w = add(mul(nibbles(base.add(scales + j * 8)), d), m);
                    fma_rows(&mut acc, xp, k, b * 32 + j, w);
                }
            }
            store_rows(&acc, y, ldy, cols);
        }

        /// A panel of signed values with one scale per `group` steps: Q8_0 / Q4_0 / Q5_0 (32 steps,
        /// f16 scales) or Q6_K (16 steps, f32 scales). Per step the 16 i8 values widened and
        /// dequantized as `q · d` (the loader's one rounding).
        #[inline]
        #[target_feature(enable = $feature)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn signed_rows<const R: usize>(
            x: &[f32],
            k: usize,
            pp: *const u8,
            group: usize,
            f32_scales: bool,
            y: *mut f32,
            ldy: usize,
            cols: usize,
        ) {
            let scales = if f32_scales { 64 } else { 32 };
            let block = scales + group * 16;
            let xp = x.as_ptr();
            let mut acc = [zero(); R];
            for b in 0..k / group {
                let base = pp.add(b * block);
                let d = if f32_scales {
                    load_f32(base as *const f32)
                } else {
                    load_f16(base)
                };
                for j in 0..group {
                    if j % 4 == 0 {
                        let at = b * block + scales + j * 16 + AHEAD_BYTES;
                        _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(at) as *const i8);
                    }
                    let w = mul(signed(base.add(scales + j * 16)), d);
                    fma_rows(&mut acc, xp, k, b * group + j, w);
                }
            }
            store_rows(&acc, y, ldy, cols);
        }
    };
}

/// The AVX-512 kernels: 16 lanes in one vector, blocks of up to 16 rows.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;
    type V = __m512;

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn zero() -> V {
        _mm512_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma(acc: V, x: f32, w: V) -> V {
        _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn mul(a: V, b: V) -> V {
        _mm512_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn add(a: V, b: V) -> V {
        _mm512_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_f32(p: *const f32) -> V {
        _mm512_loadu_ps(p)
    }
    /// bf16 bits widened exactly: the f32 with these upper 16 bits and zero lower ones.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_bf16(p: *const u16) -> V {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_f16(p: *const u8) -> V {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    /// Lanes 0..8 the low nibbles of the 8 bytes (columns 0..8), 8..16 the high ones.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn nibbles(p: *const u8) -> V {
        let low = _mm_set1_epi8(0x0f);
        let raw = _mm_loadl_epi64(p as *const __m128i);
        let lo = _mm_and_si128(raw, low);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), low);
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn signed(p: *const u8) -> V {
        let v = _mm_loadu_si128(p as *const __m128i);
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store(y: *mut f32, v: V, cols: usize) {
        let m: __mmask16 = if cols >= 16 {
            0xffff
        } else {
            (1u16 << cols) - 1
        };
        _mm512_mask_storeu_ps(y, m, v)
    }

    panel_kernels!("avx512f", 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
}

/// The AVX2 + FMA + F16C kernels: 16 lanes as two 8-lane halves, blocks of up to 6 rows.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;
    type V = [__m256; 2];

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn zero() -> V {
        [_mm256_setzero_ps(); 2]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fma(acc: V, x: f32, w: V) -> V {
        let x = _mm256_set1_ps(x);
        [
            _mm256_fmadd_ps(x, w[0], acc[0]),
            _mm256_fmadd_ps(x, w[1], acc[1]),
        ]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mul(a: V, b: V) -> V {
        [_mm256_mul_ps(a[0], b[0]), _mm256_mul_ps(a[1], b[1])]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn add(a: V, b: V) -> V {
        [_mm256_add_ps(a[0], b[0]), _mm256_add_ps(a[1], b[1])]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f32(p: *const f32) -> V {
        [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_bf16(p: *const u16) -> V {
        let half = |p: *const u16| {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        };
        [half(p), half(p.add(8))]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const u8) -> V {
        [
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
        ]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles(p: *const u8) -> V {
        let low = _mm_set1_epi8(0x0f);
        let raw = _mm_loadl_epi64(p as *const __m128i);
        let lo = _mm_and_si128(raw, low);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), low);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
        ]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn signed(p: *const u8) -> V {
        let v = _mm_loadu_si128(p as *const __m128i);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v))),
        ]
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store(y: *mut f32, v: V, cols: usize) {
        if cols >= 16 {
            _mm256_storeu_ps(y, v[0]);
            _mm256_storeu_ps(y.add(8), v[1]);
        } else {
            let mut t = [0f32; 16];
            _mm256_storeu_ps(t.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(t.as_mut_ptr().add(8), v[1]);
            std::ptr::copy_nonoverlapping(t.as_ptr(), y, cols);
        }
    }

    panel_kernels!("avx2,fma,f16c", 1 2 3 4 5 6);
}
