//! The integer kernels (AVX-512 VNNI, AVX2) of one panel against a block of quantized rows,
//! and their scalar twin.

use super::{IntKind, Q8Rows, QB};
use crate::cpu::Isa;

/// The integer kernels' ISA: AVX-512 with VNNI, else AVX2 (also what an AVX-512 CPU without
/// VNNI runs), following [`Isa::detect`] (`DFLASH_CPU_ISA=avx2` selects AVX2 here too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntIsa {
    Vnni512,
    Avx2,
}

impl IntIsa {
    /// The integer kernels for the panels' `isa`.
    pub fn for_isa(isa: Isa) -> IntIsa {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vnni")
        {
            return IntIsa::Vnni512;
        }
        let _ = isa;
        IntIsa::Avx2
    }

    /// Rows per block of the kernel (accumulators in registers).
    pub fn block_rows(self) -> usize {
        match self {
            IntIsa::Vnni512 => 16,
            IntIsa::Avx2 => 4,
        }
    }
}

/// The scalar twin of the kernels: rows `r0 .. r0 + rows` of `a` against one panel (`k / 32`
/// blocks of `kind`), `y[r · ldy + c]` for the first `cols` columns. The kernels give these
/// bits.
#[allow(clippy::too_many_arguments)]
pub fn block_scalar(
    kind: IntKind,
    a: &Q8Rows,
    r0: usize,
    rows: usize,
    panel: &[u8],
    y: &mut [f32],
    ldy: usize,
    cols: usize,
) {
    let (k, per) = (a.k, kind.block_bytes());
    let nb = k / QB;
    for r in 0..rows {
        let row = r0 + r;
        for c in 0..cols {
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &panel[b * per..][..per];
                let i = row * nb + b;
                // the integer sums of the two 16-step halves (one scale each for Q6_K)
                let mut dot = [0i32; 2];
                for j in 0..QB {
                    let (w, _, _) = kind.value(blk, c, j);
                    dot[j / 16] += w * a.q[row * k + b * QB + j] as i32;
                }
                let (_, d_lo, m) = kind.value(blk, c, 0);
                let (_, d_hi, _) = kind.value(blk, c, 16);
                if kind == IntKind::Signed16 {
                    acc = (dot[0] as f32).mul_add(d_lo * a.d[i], acc);
                    acc = (dot[1] as f32).mul_add(d_hi * a.d[i], acc);
                } else {
                    acc = ((dot[0] + dot[1]) as f32).mul_add(d_lo * a.d[i], acc);
                }
                if kind.nibbles() {
                    acc = m.mul_add(a.s[i], acc);
                }
            }
            y[r * ldy + c] = acc;
        }
    }
}

/// Rows `r0 .. r0 + rows` (at most [`IntIsa::block_rows`]) of `a` against one panel on
/// `isa`'s kernel: [`block_scalar`]'s bits.
/// # Safety
/// The CPU runs `isa` ([`IntIsa::for_isa`] of an available [`Isa`]); `panel` holds `a.k / 32`
/// blocks of `kind`; `y` is writable for `rows` rows of stride `ldy`; `cols ≤ 16`.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
pub unsafe fn block(
    isa: IntIsa,
    kind: IntKind,
    a: &Q8Rows,
    r0: usize,
    rows: usize,
    panel: &[u8],
    y: *mut f32,
    ldy: usize,
    cols: usize,
) {
    debug_assert!(panel.len() == a.k / QB * kind.block_bytes() && rows <= isa.block_rows());
    macro_rules! dispatch {
        ($m:ident, $($r:literal)*) => {
            match rows {
                $($r => $m::rows::<$r>(kind, a, r0, panel.as_ptr(), y, ldy, cols),)*
                _ => unreachable!("a block of {rows} rows"),
            }
        };
    }
    match isa {
        IntIsa::Vnni512 => dispatch!(vnni512, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
        IntIsa::Avx2 => dispatch!(avx2, 1 2 3 4),
    }
}

/// Prefetch distance in the panel stream (as the exact kernels').
#[cfg(target_arch = "x86_64")]
const AHEAD_BYTES: usize = 4096;

/// A hint to fetch the panel bytes `AHEAD_BYTES` past block `b` (of `per` bytes): past the end
/// of the panels it fetches nothing useful and never faults.
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_block(p: *const u8, b: usize, per: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    for line in 0..per.div_ceil(64) {
        let at = b * per + AHEAD_BYTES + 64 * line;
        // SAFETY: a prefetch never faults, whatever the address
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at) as *const i8) };
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni512 {
    use super::{IntKind, Q8Rows, QB};
    use std::arch::x86_64::*;

    /// One `vpdpbusd` lane per column: 4 steps of a column's unsigned weights times a broadcast
    /// 4-byte group of the row's `q`, 8 groups per block; the integer sum scaled into one f32
    /// accumulator per row.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) unsafe fn rows<const R: usize>(
        kind: IntKind,
        a: &Q8Rows,
        r0: usize,
        p: *const u8,
        y: *mut f32,
        ldy: usize,
        cols: usize,
    ) {
        let (k, per) = (a.k, kind.block_bytes());
        let nb = k / QB;
        let nib = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); R];
        let mut w = [_mm512_setzero_si512(); 8];
        for b in 0..nb {
            let base = p.add(b * per);
            super::prefetch_block(p, b, per);
            let nibbles = kind.nibbles();
            let f32s = kind.f32_scales();
            let halves = kind == IntKind::Signed16;
            let scales = |at: usize| {
                if f32s {
                    _mm512_loadu_ps(base.add(4 * at) as *const f32)
                } else {
                    _mm512_cvtph_ps(_mm256_loadu_si256(base.add(2 * at) as *const __m256i))
                }
            };
            // the scales of steps 0..16 and 16..32 (the same but for Q6_K), the minimums
            let dw = scales(0);
            let dw_hi = if halves { scales(16) } else { dw };
            let mw = if nibbles {
                scales(16)
            } else {
                _mm512_setzero_ps()
            };
            let vals = base.add(kind.scale_bytes());
            if nibbles {
                for (g, wg) in w.iter_mut().enumerate() {
                    let raw = _mm256_loadu_si256(vals.add(32 * g) as *const __m256i);
                    let lo = _mm256_and_si256(raw, nib);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib);
                    *wg = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                }
            } else {
                for (g, wg) in w.iter_mut().enumerate() {
                    *wg = _mm512_loadu_si512(vals.add(64 * g) as *const __m512i);
                }
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = r0 + r;
                let i = row * nb + b;
                let xq = a.q.as_ptr().add(row * k + b * QB) as *const i32;
                // the two halves' integer sums (steps 0..16, 16..32)
                let mut s = [_mm512_setzero_si512(); 2];
                for (g, wg) in w.iter().enumerate() {
                    let x = _mm512_set1_epi32(xq.add(g).read_unaligned());
                    s[g / 4] = _mm512_dpbusd_epi32(s[g / 4], *wg, x);
                }
                let dx = _mm512_set1_ps(a.d[i]);
                if halves {
                    // the weights are w + 128: Σ (w + 128) q − 128 Σ q, per half
                    let lo = _mm512_sub_epi32(s[0], _mm512_set1_epi32(128 * a.qsum_lo[i]));
                    let hi =
                        _mm512_sub_epi32(s[1], _mm512_set1_epi32(128 * (a.qsum[i] - a.qsum_lo[i])));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(dw, dx), *acc);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(dw_hi, dx), *acc);
                } else {
                    let mut t = _mm512_add_epi32(s[0], s[1]);
                    if !nibbles {
                        t = _mm512_sub_epi32(t, _mm512_set1_epi32(128 * a.qsum[i]));
                    }
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dw, dx), *acc);
                }
                if nibbles {
                    *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[i]), *acc);
                }
            }
        }
        let m: __mmask16 = if cols >= 16 {
            0xffff
        } else {
            (1u16 << cols) - 1
        };
        for (r, v) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(y.add(r * ldy), m, *v);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{IntKind, Q8Rows, QB};
    use std::arch::x86_64::*;

    /// Columns 0..8 and 8..16 as two halves. A group's 4-step products by `vpmaddubsw`
    /// (unsigned × signed bytes → pairs summed in i16, which cannot saturate here: Q4_1's
    /// values are at most 15, and Q8_0's are taken as |w| times `q` with w's sign, at most
    /// 2 · 128 · 127) then `vpmaddwd` by ones into i32 lanes: the same integer sums as VNNI's.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows<const R: usize>(
        kind: IntKind,
        a: &Q8Rows,
        r0: usize,
        p: *const u8,
        y: *mut f32,
        ldy: usize,
        cols: usize,
    ) {
        let (k, per) = (a.k, kind.block_bytes());
        let nb = k / QB;
        let nib = _mm256_set1_epi8(0x0f);
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        // per group and half: the unsigned factor and (Q8_0) the signed weights
        let mut wu = [[_mm256_setzero_si256(); 2]; 8];
        let mut ws = [[_mm256_setzero_si256(); 2]; 8];
        let nibbles = kind.nibbles();
        for b in 0..nb {
            let base = p.add(b * per);
            super::prefetch_block(p, b, per);
            let f32s = kind.f32_scales();
            let halves = kind == IntKind::Signed16;
            // 16 columns' scales from `at` (in values) as two halves of 8
            let scales = |at: usize| {
                if f32s {
                    let p = base.add(4 * at) as *const f32;
                    [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
                } else {
                    let p = base.add(2 * at);
                    [
                        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                        _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
                    ]
                }
            };
            let dw = scales(0);
            let dw_hi = if halves { scales(16) } else { dw };
            let mw = if nibbles {
                scales(16)
            } else {
                [_mm256_setzero_ps(); 2]
            };
            let vals = base.add(kind.scale_bytes());
            for g in 0..8 {
                if nibbles {
                    let raw = _mm256_loadu_si256(vals.add(32 * g) as *const __m256i);
                    wu[g][0] = _mm256_and_si256(raw, nib);
                    wu[g][1] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib);
                } else {
                    for h in 0..2 {
                        let raw = _mm256_loadu_si256(vals.add(64 * g + 32 * h) as *const __m256i);
                        let w = _mm256_xor_si256(raw, flip);
                        ws[g][h] = w;
                        wu[g][h] = _mm256_abs_epi8(w);
                    }
                }
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = r0 + r;
                let i = row * nb + b;
                let xq = a.q.as_ptr().add(row * k + b * QB) as *const i32;
                // per 16-step half and column half: the integer sums
                let mut s = [[_mm256_setzero_si256(); 2]; 2];
                for g in 0..8 {
                    let x = _mm256_set1_epi32(xq.add(g).read_unaligned());
                    for h in 0..2 {
                        let xs = if nibbles {
                            x
                        } else {
                            _mm256_sign_epi8(x, ws[g][h])
                        };
                        let pairs = _mm256_maddubs_epi16(wu[g][h], xs);
                        s[g / 4][h] = _mm256_add_epi32(s[g / 4][h], _mm256_madd_epi16(pairs, ones));
                    }
                }
                let dx = _mm256_set1_ps(a.d[i]);
                for h in 0..2 {
                    if halves {
                        let lo = _mm256_cvtepi32_ps(s[0][h]);
                        let hi = _mm256_cvtepi32_ps(s[1][h]);
                        acc[h] = _mm256_fmadd_ps(lo, _mm256_mul_ps(dw[h], dx), acc[h]);
                        acc[h] = _mm256_fmadd_ps(hi, _mm256_mul_ps(dw_hi[h], dx), acc[h]);
                    } else {
                        let t = _mm256_cvtepi32_ps(_mm256_add_epi32(s[0][h], s[1][h]));
                        acc[h] = _mm256_fmadd_ps(t, _mm256_mul_ps(dw[h], dx), acc[h]);
                    }
                    if nibbles {
                        acc[h] = _mm256_fmadd_ps(mw[h], _mm256_set1_ps(a.s[i]), acc[h]);
                    }
                }
            }
        }
        for (r, v) in acc.iter().enumerate() {
            let yr = y.add(r * ldy);
            if cols >= 16 {
                _mm256_storeu_ps(yr, v[0]);
                _mm256_storeu_ps(yr.add(8), v[1]);
            } else {
                let mut t = [0f32; 16];
                _mm256_storeu_ps(t.as_mut_ptr(), v[0]);
                _mm256_storeu_ps(t.as_mut_ptr().add(8), v[1]);
                std::ptr::copy_nonoverlapping(t.as_ptr(), yr, cols);
            }
        }
    }
}
