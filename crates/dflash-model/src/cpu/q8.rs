//! Integer products for GGUF weights on the CPU (`--cpu-products q8`, `DFLASH_CPU_QUANT=q8`):
//! each input row is quantized to 8 bits per block of 32 values and every block's dot product
//! with a weight block is summed in integers (AVX-512 VNNI `vpdpbusd`, or AVX2 `vpmaddubsw` +
//! `vpmaddwd`), as llama.cpp computes its Q4_1 × Q8_1 and Q8_0 × Q8_0 products. A 16-row verify
//! is bound by multiply-adds ([`crate::cpu::panels`]'s exact f32 kernels need one per weight
//! and row); one `vpdpbusd` does 64 of them where an f32 FMA does 16.
//!
//! **The rule**, per input row and block `b` of 32 values `x`: `a = max |x|`, `d = a / 127`,
//! `q = x · (1 / d)` rounded to nearest, ties to even (all 0 when `a` = 0), `s = Σ x` (f32, in
//! the order of [`quantize_block_scalar`]). Against a weight block of scale `d_w`, values `w`
//! (and minimum `m_w` for the 4-bit kinds), each output adds, in block order,
//! `acc = fma(Σ q·w, d_w · d, acc)` then, for the 4-bit kinds, `acc = fma(m_w, s, acc)`; Q6_K's
//! blocks have a scale per 16 steps, and add the two halves' sums in turn. The integer sums are
//! exact, so every output depends only on its own row and column — a row gets the same bits
//! alone (an AR step) and among 15 others (a verify), on either ISA and in the scalar twin
//! ([`block_scalar`]), which is what keeps speculative decoding's output equal to AR's under
//! this rule. The outputs approximate the exact f32 products (the activations lose bits, the
//! weights none).
//!
//! **The panels.** 16 output columns as in [`crate::cpu::panels`], per block of 32 steps the
//! columns' scales (and minimums: [`IntKind`]), then 8 groups of 4 steps whose 64 values are
//! ordered column-major (value `e` = column `e / 4`, step `4g + e % 4`), the 4 bytes one
//! `vpdpbusd` lane multiplies by a broadcast 4-byte group of the row's `q`. 4-bit kinds (Q4_1,
//! Q4_K): two values per byte (value `e` in the low nibble of byte `e` for `e < 32`, in the high
//! nibble of byte `e − 32` after): 320 bytes per 512 weights for Q4_1, as the GGUF. Signed kinds
//! (Q8_0, Q4_0, Q5_0, Q6_K): one byte per value, `w + 128`, so that it is unsigned: 544 bytes
//! per 512 weights for Q8_0.
//!
//! Example: x = [0.5, −1.0, 0.25, 0, …] (rest 0) → a = 1, d = 1/127, q = [64, −127, 32, 0, …],
//! s = −0.25; against a Q8_0 column with d_w = 0.5 and w = [2, 1, −4, …] (rest 0): Σ q·w =
//! 128 − 127 − 128 = −127, output −127 · (0.5 / 127) = −0.5 (exactly −0.5 in f32: the true
//! product is 1 − 1 − 0.5 = −0.5).

use crate::cpu::Isa;

/// Values per block of the rule (every format here).
pub const QB: usize = 32;
/// Bytes of an integer Q4_1 panel block: 16 f16 scales, 16 f16 minimums, 8 groups of 32.
pub const Q41_BLOCK: usize = 64 + 8 * 32;
/// Bytes of an integer Q8_0 panel block: 16 f16 scales, 8 groups of 64.
pub const Q80_BLOCK: usize = 32 + 8 * 64;

use dflash_core::runtime::{self, CpuProducts, RuntimeConfig};

/// Whether weights laid out from now on (on this thread) multiply by 8-bit rows rather than
/// exactly: the runtime configuration's `cpu_products` ([`with_choice`]'s on this thread, else
/// the process's: `--cpu-products`, else `DFLASH_CPU_QUANT`).
pub fn enabled() -> bool {
    runtime::current().cpu_products == CpuProducts::Q8
}

/// `f()` with the weights it lays out on this thread multiplied by 8-bit rows (`integer`) or
/// exactly (f32 panels stay f32 panels), then this thread's choice as it was, even if `f`
/// panics (a drafter's products chosen apart from its target's). Example: `with_choice(true,
/// || Drafter::load_dir(dir, &target))` gives the drafter Q8_0 panels beside an exact target.
pub fn with_choice<T>(integer: bool, f: impl FnOnce() -> T) -> T {
    let now = runtime::current();
    let cpu_products = match (integer, now.cpu_products) {
        (true, _) => CpuProducts::Q8,
        (false, CpuProducts::Q8) => CpuProducts::Exact,
        (false, p) => p,
    };
    runtime::with_config(
        RuntimeConfig {
            cpu_products,
            ..now
        },
        f,
    )
}

/// The panel kinds of the integer products: 4-bit values with a scale and a minimum, or signed
/// bytes with a scale, per 32-step block (per 16 steps for Q6_K); scales as the GGUF's f16 or
/// as the loader's f32 products (the K-quants' sub-block scales).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntKind {
    /// Q4_1: 4-bit values 0..=15, an f16 scale and minimum per block.
    Nibbles,
    /// Q4_K: 4-bit values, per 32-step sub-block the f32 `d1` and `−m1`.
    NibblesF32,
    /// Q8_0 (and Q4_0, Q5_0 as Q8_0): signed bytes, an f16 scale per block.
    Signed,
    /// Q6_K: 6-bit signed values as bytes, an f32 scale per 16 steps.
    Signed16,
}

impl IntKind {
    pub fn block_bytes(self) -> usize {
        self.scale_bytes() + 8 * self.group_bytes()
    }

    /// 4-bit values (with a minimum) rather than signed bytes.
    pub fn nibbles(self) -> bool {
        matches!(self, IntKind::Nibbles | IntKind::NibblesF32)
    }

    /// Scales (and minimums) stored as f32 rather than f16.
    pub fn f32_scales(self) -> bool {
        matches!(self, IntKind::NibblesF32 | IntKind::Signed16)
    }

    /// Bytes of the block's scales (and minimums) before its values: 16 columns' f16 or f32
    /// scales, then their minimums (4-bit kinds) or the second half's scales (Q6_K).
    pub fn scale_bytes(self) -> usize {
        match self {
            IntKind::Nibbles => 64,
            IntKind::NibblesF32 | IntKind::Signed16 => 128,
            IntKind::Signed => 32,
        }
    }

    fn group_bytes(self) -> usize {
        if self.nibbles() {
            32
        } else {
            64
        }
    }

    /// Column `c`'s weight of step `j` (0..32) in a block: its integer value as the kernels
    /// multiply it (the nibble, or the offset byte minus 128), its scale and its minimum.
    pub fn value(self, blk: &[u8], c: usize, j: usize) -> (i32, f32, f32) {
        let f16 = |at: usize| half::f16::from_le_bytes([blk[at], blk[at + 1]]).to_f32();
        let f32_at =
            |at: usize| f32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
        let e = c * 4 + j % 4;
        let vals = &blk[self.scale_bytes() + (j / 4) * self.group_bytes()..];
        let q = if self.nibbles() {
            (if e < 32 {
                vals[e] & 15
            } else {
                vals[e - 32] >> 4
            }) as i32
        } else {
            vals[e] as i32 - 128
        };
        match self {
            IntKind::Nibbles => (q, f16(2 * c), f16(32 + 2 * c)),
            IntKind::NibblesF32 => (q, f32_at(4 * c), f32_at(64 + 4 * c)),
            IntKind::Signed => (q, f16(2 * c), 0.0),
            IntKind::Signed16 => (q, f32_at((j / 16) * 64 + 4 * c), 0.0),
        }
    }

    /// Writes column `c`'s block into a panel block `dst` (zeroed before the first column): its
    /// scales `d` (steps 0..16 and 16..32: the same but for Q6_K), minimum `m` (4-bit kinds)
    /// and 32 values. An f16 kind stores `d` and `m` as f16 (exactly, for values read from
    /// f16).
    pub fn put(self, dst: &mut [u8], c: usize, d: [f32; 2], m: f32, vals: &[i32; QB]) {
        let mut f16 = |at: usize, v: f32| {
            dst[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes())
        };
        match self {
            IntKind::Nibbles => {
                f16(2 * c, d[0]);
                f16(32 + 2 * c, m);
            }
            IntKind::Signed => f16(2 * c, d[0]),
            IntKind::NibblesF32 => {
                dst[4 * c..4 * c + 4].copy_from_slice(&d[0].to_le_bytes());
                dst[64 + 4 * c..68 + 4 * c].copy_from_slice(&m.to_le_bytes());
            }
            IntKind::Signed16 => {
                dst[4 * c..4 * c + 4].copy_from_slice(&d[0].to_le_bytes());
                dst[64 + 4 * c..68 + 4 * c].copy_from_slice(&d[1].to_le_bytes());
            }
        }
        let (off, gb) = (self.scale_bytes(), self.group_bytes());
        for (j, &v) in vals.iter().enumerate() {
            let e = c * 4 + j % 4;
            let g = &mut dst[off + (j / 4) * gb..][..gb];
            if !self.nibbles() {
                g[e] = (v + 128) as u8;
            } else if e < 32 {
                g[e] |= v as u8 & 15;
            } else {
                g[e - 32] |= (v as u8 & 15) << 4;
            }
        }
    }
}

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
unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8]) -> (f32, f32, i32) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The module doc's example: the rule's `q`, `d`, `s` and the Q8_0 column's output.
    #[test]
    fn the_module_example() {
        let mut x = vec![0f32; QB];
        x[..3].copy_from_slice(&[0.5, -1.0, 0.25]);
        let a = quantize_rows(&x, 1, QB);
        assert_eq!(&a.q[..4], &[64, -127, 32, 0]);
        assert_eq!((a.d[0], a.s[0], a.qsum[0]), (1.0 / 127.0, -0.25, -31));
        let mut panel = vec![0u8; Q80_BLOCK];
        let mut w = [0i32; QB];
        w[..3].copy_from_slice(&[2, 1, -4]);
        IntKind::Signed.put(&mut panel, 0, [0.5; 2], 0.0, &w);
        // the other 15 columns: all weights 0 (byte 128)
        for c in 1..16 {
            IntKind::Signed.put(&mut panel, c, [0.0; 2], 0.0, &[0; QB]);
        }
        let mut y = vec![f32::NAN; 16];
        block_scalar(IntKind::Signed, &a, 0, 1, &panel, &mut y, 16, 16);
        assert_eq!(y[0], -0.5);
        assert!(y[1..].iter().all(|&v| v == 0.0));
    }

    /// The AVX2 quantizer gives the scalar twin's bits: random blocks of several scales, ties
    /// (x · (1/d) = k + 0.5), zeros, infinities and NaNs.
    #[test]
    fn the_quantizer_equals_its_scalar_twin() {
        let mut seed = 3u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / 16_777_216.0 - 0.5
        };
        let mut blocks: Vec<Vec<f32>> = (0..200)
            .map(|b| (0..QB).map(|_| next() * 10f32.powi(b % 7 - 3)).collect())
            .collect();
        // a = 127 → d = 1: 0.5, 1.5, 2.5, −0.5 are ties
        let mut ties = vec![0f32; QB];
        ties[..5].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -0.5]);
        blocks.push(ties);
        blocks.push(vec![0.0; QB]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut b = blocks[0].clone();
            b[17] = bad;
            blocks.push(b);
        }
        for x in &blocks {
            let (mut q1, mut q2) = ([0i8; QB], [1i8; QB]);
            let a = quantize_block_scalar(x, &mut q1);
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 checked; 32 values
                let b = unsafe { quantize_block_avx2(x, &mut q2) };
                assert_eq!(q1, q2, "{x:?}");
                assert_eq!(
                    (a.0.to_bits(), a.1.to_bits(), a.2),
                    (b.0.to_bits(), b.1.to_bits(), b.2),
                    "{x:?}"
                );
            }
        }
        let mut q = [0i8; QB];
        quantize_block_scalar(&blocks[200], &mut q);
        assert_eq!(&q[..5], &[127, 0, 2, 2, 0]);
    }

    /// [`with_choice`] decides for its call only, on its thread only, and keeps f32 panels.
    #[test]
    fn a_scoped_choice_is_this_threads_and_ends_with_its_scope() {
        let at = |p| RuntimeConfig {
            cpu_products: p,
            ..runtime::current()
        };
        runtime::with_config(at(CpuProducts::Exact), || {
            assert!(!enabled());
            assert!(with_choice(true, enabled));
            assert!(!enabled());
            // another thread sees the process's choice, not this thread's scoped one
            with_choice(true, || {
                assert!(enabled());
                let process = runtime::installed().cpu_products == CpuProducts::Q8;
                assert_eq!(std::thread::spawn(enabled).join().unwrap(), process);
            });
            // a panic inside the scope restores the choice before it
            let _ = std::panic::catch_unwind(|| with_choice(true, || panic!("inside the scope")));
            assert!(!enabled());
        });
        runtime::with_config(at(CpuProducts::Q8), || {
            assert!(!with_choice(false, enabled))
        });
        runtime::with_config(at(CpuProducts::F32), || {
            assert_eq!(
                with_choice(false, runtime::current).cpu_products,
                CpuProducts::F32
            );
        });
    }

    /// Zero rows give zero scales and products; a non-finite input makes its block's scale
    /// NaN; `q` stays within ±127.
    #[test]
    fn zeros_and_non_finite_inputs() {
        let mut x = vec![0f32; 2 * QB];
        x[QB] = f32::INFINITY;
        x[QB + 1] = -3.0;
        let a = quantize_rows(&x, 1, 2 * QB);
        assert_eq!((a.d[0], a.qsum[0]), (0.0, 0));
        assert!(a.d[1].is_nan());
        let x: Vec<f32> = (0..QB).map(|i| (i as f32 - 16.0) * 1e3).collect();
        let a = quantize_rows(&x, 1, QB);
        assert!(a.q.iter().all(|&q| (-127..=127).contains(&q)));
        assert_eq!(a.q[0], -127);
    }
}
