//! A weight matrix re-laid as panels of 16 output columns, and the AVX-512 kernel that
//! multiplies any number of rows by it, for CPU inference.
//!
//! Decoding on a CPU multiplies a handful of rows by each weight matrix: 1 row per AR step,
//! 16 per DFlash verify, 9 per DDTree-8 verify. Reading the weights from memory is the floor
//! of the cost, and a kernel that reads each weight once, at the memory's speed, while it
//! multiplies makes 16 rows cost little more than 1. The `[out, in]` layout of the safetensors
//! does not allow it: a dot product per output needs a horizontal sum per output and four
//! weight rows read as four streams. Here `W` `[n, k]` is stored as `⌈n / 16⌉` panels, panel
//! `p` holding `W[16p .. 16p + 16, :]` transposed (`k` groups of 16 consecutive floats, the
//! last panel padded with zeros): one forward stream, one 16-lane vector per `k` step, used by
//! every input row (`acc[r] += x[r][kk] · panel[kk]`), with a software prefetch 4 KiB ahead.
//!
//! Each output is `Σ_kk x[r][kk] · W[j][kk]` summed in the order `kk = 0, 1, …` in one f32
//! accumulator lane, whatever the number of rows and however they are split into blocks: a row
//! gets bit-identical outputs alone (an AR step) and among 15 others (a verify), which candle's
//! matmul does not promise.
//!
//! Example: SmolLM2's `up_proj` `W` `[1536, 576]` → 96 panels of `576 × 16` floats (36 KiB
//! each); a 16-row verify `x` `[16, 576]` runs 96 panels × 576 steps × 16 FMAs of 16 lanes;
//! 20 rows run as a block of 16 and a block of 4 on each panel (the panel then comes from L1/L2).

use crate::cpu::quant::{QuantBlocks, QuantKind, Q4_1_BYTES, Q8_0_BYTES, QBLOCK};

/// Output columns per panel: one AVX-512 vector of f32.
pub const PANEL: usize = 16;

/// Rows per block: 16 accumulators, one weight vector, within AVX-512's 32 registers.
const BLOCK_ROWS: usize = 16;

/// Below this many multiply-adds a product runs on the calling thread alone: waking the pool
/// costs more (a tiny test model's 64 × 64 projection is 4,096 per row; SmolLM2's smallest,
/// `k_proj` `[192, 576]`, 110,592 per row).
pub(crate) const INLINE_FMAS: usize = 1 << 16;

/// `W` `[n, k]` as panels (see the module doc).
#[derive(Debug)]
pub struct Panels {
    data: PanelData,
    n: usize,
    k: usize,
}

/// The panels' values: f32, or their upper halves when every weight is a bf16 value (a
/// drafter shipped in bf16, loaded as f32): the kernel widens them back exactly (a bf16 is
/// the upper 16 bits of its f32), so the products are bit-identical while the weights stream
/// at half the bytes. Example: 0.5f32 = 0x3F00_0000 → stored 0x3F00.
///
/// Or a GGUF weight's Q4_1 blocks ([`crate::cpu::quant`]), per panel and per block of 32 `k`
/// steps: the 16 columns' `d` then `m` as f16 (64 bytes), then for each of the 32 steps the
/// 16 columns' 4-bit values in 8 bytes (byte `i`: column `i` in the low nibble, column `i + 8`
/// in the high one): 320 bytes per 512 weights, the GGUF's 5 bits per weight. The kernel
/// dequantizes each step's 16 values as the loader does (`q · d + m`, f32, two roundings), so
/// the products are bit-identical to the f32 panels of the dequantized weight.
/// Example: columns 0 and 8 of step 3 with q = 5 and 9 → byte 3 · 8 + 0 = 0x95.
///
/// Or Q8_0 blocks: per panel and block of 32 steps the 16 columns' `d` as f16 (32 bytes),
/// then for each step the 16 columns' i8 values (16 bytes): 544 bytes per 512 weights.
///
/// K-quants keep their sub-blocks' scales as the f32 products the loader computes: Q4_K per 32
/// steps `d1` and `−m1` as f32 (128 bytes) then the 32 steps' 4-bit values as for Q4_1 (384
/// bytes per 512 weights); Q6_K per 16 steps `d · sc` as f32 (64 bytes) then the 16 steps' i8
/// values (320 bytes per 256 weights).
#[derive(Debug)]
enum PanelData {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    Q4_1(Vec<Q41>),
    Q8_0(Vec<Q80>),
    Q4K(Vec<Q4Kb>),
    Q6K(Vec<Q6Kb>),
}

/// The byte types of the quantized panels: one per layout, so that each picks its kernel
/// (`avx512::Stream`); each a transparent `u8`.
macro_rules! panel_byte {
    ($($t:ident: $what:literal),*) => {$(
        #[doc = concat!("A byte of ", $what, " panels.")]
        #[derive(Debug, Clone, Copy, Default)]
        #[repr(transparent)]
        pub(crate) struct $t(u8);
        impl QuantByte for $t {}
    )*};
}
/// A byte type of the quantized panels (a transparent `u8`).
trait QuantByte: Copy {}
panel_byte!(Q41: "Q4_1", Q80: "Q8_0 (and Q5_0)", Q4Kb: "Q4_K", Q6Kb: "Q6_K");

/// Bytes of one Q4_1 panel block (16 columns × 32 steps).
const Q4_1_PANEL_BLOCK: usize = 64 + 32 * 8;
/// Bytes of one Q8_0 panel block.
const Q8_0_PANEL_BLOCK: usize = 32 + 32 * 16;
/// Bytes of one Q4_K panel block (16 columns × 32 steps, f32 scales).
const Q4K_PANEL_BLOCK: usize = 128 + 32 * 8;
/// Bytes of one Q6_K panel block (16 columns × 16 steps, f32 scales).
const Q6K_PANEL_BLOCK: usize = 64 + 16 * 16;

impl Panels {
    /// Whether this CPU runs the kernel (AVX-512F), detected once.
    pub fn supported() -> bool {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                std::is_x86_feature_detected!("avx512f")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        })
    }

    /// Re-lays `w` (`n × k`, row-major, as in the safetensors), panels in parallel.
    /// Example: n = 18, k = 2 → 2 panels; panel 1 = `[w[16][0], w[17][0], 0 × 14, w[16][1],
    /// w[17][1], 0 × 14]`.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        use rayon::prelude::*;
        assert_eq!(
            w.len(),
            n * k,
            "Panels::pack: {} values for [{n}, {k}]",
            w.len()
        );
        let mut data = vec![0f32; n.div_ceil(PANEL) * k * PANEL];
        data.par_chunks_mut((k * PANEL).max(1))
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..PANEL.min(n - p * PANEL) {
                    let row = &w[(p * PANEL + c) * k..][..k];
                    for (kk, &v) in row.iter().enumerate() {
                        panel[kk * PANEL + c] = v;
                    }
                }
            });
        let data = if data.par_iter().all(|v| v.to_bits() & 0xffff == 0) {
            PanelData::Bf16(
                data.par_iter()
                    .map(|v| (v.to_bits() >> 16) as u16)
                    .collect(),
            )
        } else {
            PanelData::F32(data)
        };
        Self { data, n, k }
    }

    /// Re-lays a weight's quantized blocks (see [`PanelData`]), panels in parallel; the
    /// padding columns of the last panel are zeros (d = m = 0). Each source block (32 weights,
    /// or a K-quant's 256) of column `c` is decoded once and written into its panel blocks
    /// ([`write_block`]).
    pub fn pack_quantized(q: &QuantBlocks) -> Self {
        use rayon::prelude::*;
        let (n, k) = (q.n, q.k);
        let (per_block, steps) = match q.kind {
            QuantKind::Q4_1 => (Q4_1_PANEL_BLOCK, QBLOCK),
            QuantKind::Q8_0 | QuantKind::Q5_0 => (Q8_0_PANEL_BLOCK, QBLOCK),
            QuantKind::Q4K => (Q4K_PANEL_BLOCK, QBLOCK),
            QuantKind::Q6K => (Q6K_PANEL_BLOCK, 16),
        };
        let (src_bytes, src_weights) = (q.kind.block_bytes(), q.kind.block_weights());
        let blocks = k / src_weights;
        let panel_bytes = k / steps * per_block;
        let mut data = vec![0u8; n.div_ceil(PANEL) * panel_bytes];
        data.par_chunks_mut(panel_bytes.max(1))
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..PANEL.min(n - p * PANEL) {
                    let row = p * PANEL + c;
                    for b in 0..blocks {
                        let src = &q.bytes[(row * blocks + b) * src_bytes..][..src_bytes];
                        let first = b * (src_weights / steps) * per_block;
                        write_block(q.kind, src, c, &mut panel[first..], per_block);
                    }
                }
            });
        let data = match q.kind {
            QuantKind::Q4_1 => PanelData::Q4_1(data.into_iter().map(Q41).collect()),
            QuantKind::Q8_0 | QuantKind::Q5_0 => {
                PanelData::Q8_0(data.into_iter().map(Q80).collect())
            }
            QuantKind::Q4K => PanelData::Q4K(data.into_iter().map(Q4Kb).collect()),
            QuantKind::Q6K => PanelData::Q6K(data.into_iter().map(Q6Kb).collect()),
        };
        Self { data, n, k }
    }

    /// Row `j` of `W` (`k` values) as the products use it: the f32 or bf16 value, or the
    /// quantized one dequantized as the kernels do (`q · d + m` or `q · d` in f32), which is the
    /// loader's dequantization bit for bit. Example: Q8_0 with `d` = 0.25 and `q` = −6 → −1.5.
    /// Panics if `j ≥ n` or `out` is not `k` long (callers check).
    pub fn row_into(&self, j: usize, out: &mut [f32]) {
        assert!(
            j < self.n && out.len() == self.k,
            "Panels::row_into: row {j}"
        );
        let (p, c, k) = (j / PANEL, j % PANEL, self.k);
        let f16 = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        let f32_at =
            |b: &[u8], at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let nibble = |b: &[u8], at: usize| {
            let v = b[at + c % 8];
            (if c < 8 { v & 15 } else { v >> 4 }) as f32
        };
        // the panel's bytes, and each block of `steps` steps' values
        let bytes = |d: &[u8],
                     per: usize,
                     steps: usize,
                     out: &mut [f32],
                     f: &dyn Fn(&[u8], usize) -> f32| {
            let panel = &d[p * (k / steps * per)..][..k / steps * per];
            for (kk, o) in out.iter_mut().enumerate() {
                *o = f(&panel[kk / steps * per..][..per], kk % steps);
            }
        };
        match &self.data {
            PanelData::F32(d) => {
                for (kk, o) in out.iter_mut().enumerate() {
                    *o = d[(p * k + kk) * PANEL + c];
                }
            }
            PanelData::Bf16(d) => {
                for (kk, o) in out.iter_mut().enumerate() {
                    *o = f32::from_bits((d[(p * k + kk) * PANEL + c] as u32) << 16);
                }
            }
            PanelData::Q4_1(d) => bytes(as_bytes(d), Q4_1_PANEL_BLOCK, QBLOCK, out, &|b, s| {
                nibble(b, 64 + s * 8) * f16(b, 2 * c) + f16(b, 32 + 2 * c)
            }),
            PanelData::Q8_0(d) => bytes(as_bytes(d), Q8_0_PANEL_BLOCK, QBLOCK, out, &|b, s| {
                (b[32 + s * 16 + c] as i8) as f32 * f16(b, 2 * c)
            }),
            PanelData::Q4K(d) => bytes(as_bytes(d), Q4K_PANEL_BLOCK, QBLOCK, out, &|b, s| {
                nibble(b, 128 + s * 8) * f32_at(b, 4 * c) + f32_at(b, 64 + 4 * c)
            }),
            PanelData::Q6K(d) => bytes(as_bytes(d), Q6K_PANEL_BLOCK, 16, out, &|b, s| {
                (b[64 + s * 16 + c] as i8) as f32 * f32_at(b, 4 * c)
            }),
        }
    }

    /// `W` `[n, k]` row-major, each row as [`Self::row_into`] gives it (rows in parallel).
    pub fn dense(&self) -> Vec<f32> {
        use rayon::prelude::*;
        let mut w = vec![0f32; self.n * self.k];
        w.par_chunks_mut(self.k.max(1))
            .enumerate()
            .take(self.n)
            .for_each(|(j, row)| self.row_into(j, row));
        w
    }

    /// Bytes the panels hold.
    pub fn resident_bytes(&self) -> usize {
        match &self.data {
            PanelData::F32(d) => d.len() * 4,
            PanelData::Bf16(d) => d.len() * 2,
            PanelData::Q4_1(d) => d.len(),
            PanelData::Q8_0(d) => d.len(),
            PanelData::Q4K(d) => d.len(),
            PanelData::Q6K(d) => d.len(),
        }
    }

    /// Bytes one product reads from the weights (panel padding aside): 4, 2, 0.625 (Q4_1) or
    /// 1.0625 (Q8_0) per weight.
    pub fn stream_bytes(&self) -> usize {
        let w = self.n * self.k;
        match self.data {
            PanelData::F32(_) => w * 4,
            PanelData::Bf16(_) => w * 2,
            PanelData::Q4_1(_) => w / QBLOCK * Q4_1_BYTES,
            PanelData::Q8_0(_) => w / QBLOCK * Q8_0_BYTES, // Q5_0 too, held as Q8_0
            PanelData::Q4K(_) => w / (QBLOCK * 16) * Q4K_PANEL_BLOCK,
            PanelData::Q6K(_) => w / (16 * 16) * Q6K_PANEL_BLOCK,
        }
    }

    /// Whether the weights stream from quantized blocks.
    pub fn is_quantized(&self) -> bool {
        !matches!(self.data, PanelData::F32(_) | PanelData::Bf16(_))
    }

    /// Whether the weights are kept as bf16 (all of them are bf16 values).
    pub fn is_bf16(&self) -> bool {
        matches!(self.data, PanelData::Bf16(_))
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    pub fn in_features(&self) -> usize {
        self.k
    }

    /// `y[rows, n] = x[rows, k] · Wᵀ`, panels split over the calling thread and
    /// [`crate::cpu::helpers`].
    /// Panics if the CPU lacks AVX-512 ([`Self::supported`]) or the lengths disagree (callers
    /// check both).
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        assert!(Self::supported(), "Panels::matmul needs AVX-512F");
        assert_eq!(x.len(), rows * self.k, "Panels::matmul: input length");
        match &self.data {
            PanelData::F32(d) => self.matmul_of(d, x, rows),
            PanelData::Bf16(d) => self.matmul_of(d, x, rows),
            PanelData::Q4_1(d) => self.matmul_of(d, x, rows),
            PanelData::Q8_0(d) => self.matmul_of(d, x, rows),
            PanelData::Q4K(d) => self.matmul_of(d, x, rows),
            PanelData::Q6K(d) => self.matmul_of(d, x, rows),
        }
    }

    fn matmul_of<E: avx512::Stream>(&self, data: &[E], x: &[f32], rows: usize) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let mut y = vec![0f32; rows * n];
        let panels = n.div_ceil(PANEL);
        let out = SyncPtr(y.as_mut_ptr());
        let run = |range: std::ops::Range<usize>| {
            let y = out.ptr();
            for p in range {
                let cols = PANEL.min(n - p * PANEL);
                let len = E::panel_len(k);
                let panel = &data[p * len..][..len];
                let mut r0 = 0;
                while r0 < rows {
                    let r = BLOCK_ROWS.min(rows - r0);
                    // SAFETY: AVX-512F checked above; the block writes y[r0..r0+r, 16p..16p+cols]
                    // only, inside y (rows × n) and disjoint from every other chunk's columns
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        avx512::block(
                            &x[r0 * k..(r0 + r) * k],
                            r,
                            k,
                            panel,
                            y.add(r0 * n + p * PANEL),
                            n,
                            cols,
                        )
                    };
                    r0 += r;
                }
            }
        };
        if rows * n * k < INLINE_FMAS {
            run(0..panels);
        } else {
            // chunks of panels, ≈ 8 per thread, on the calling thread and the helpers
            let chunk = panels
                .div_ceil(rayon::current_num_threads().max(1) * 8)
                .max(1);
            crate::cpu::helpers::for_each_chunk(panels.div_ceil(chunk), &|c| {
                run(c * chunk..((c + 1) * chunk).min(panels))
            });
        }
        y
    }
}

/// A quantized panel's bytes as `u8`.
fn as_bytes<T: QuantByte>(d: &[T]) -> &[u8] {
    // SAFETY: every QuantByte is a `#[repr(transparent)]` u8
    unsafe { std::slice::from_raw_parts(d.as_ptr() as *const u8, d.len()) }
}

/// Column `c`'s part of the panel blocks of one source block `src` of `kind`: its sub-blocks'
/// scales and values, sub-block `i` in `dst[i · per_block ..]` (see [`PanelData`]).
fn write_block(kind: QuantKind, src: &[u8], c: usize, dst: &mut [u8], per_block: usize) {
    let f32_at =
        |dst: &mut [u8], at: usize, v: f32| dst[at..at + 4].copy_from_slice(&v.to_le_bytes());
    match kind {
        QuantKind::Q4_1 => {
            // the f16 scale and minimum as stored, widened by the kernel
            dst[2 * c..2 * c + 2].copy_from_slice(&src[0..2]);
            dst[32 + 2 * c..32 + 2 * c + 2].copy_from_slice(&src[2..4]);
            let (_, _, vals) = kind.affine_block(src)[0];
            put_nibbles(&mut dst[64..], c, &vals);
        }
        QuantKind::Q8_0 | QuantKind::Q5_0 => {
            let (d, vals) = kind.signed_block(src);
            dst[2 * c..2 * c + 2].copy_from_slice(&d);
            put_signed(&mut dst[32..], c, &vals);
        }
        QuantKind::Q4K => {
            for (i, (d, m, vals)) in kind.affine_block(src).into_iter().enumerate() {
                let blk = &mut dst[i * per_block..][..per_block];
                f32_at(blk, 4 * c, d);
                f32_at(blk, 64 + 4 * c, m);
                put_nibbles(&mut blk[128..], c, &vals);
            }
        }
        QuantKind::Q6K => {
            for (i, (d, vals)) in QuantKind::q6k_block(src).into_iter().enumerate() {
                let blk = &mut dst[i * per_block..][..per_block];
                f32_at(blk, 4 * c, d);
                put_signed(&mut blk[64..], c, &vals);
            }
        }
    }
}

/// Column `c`'s 4-bit values, step `j` in byte `j · 8 + c mod 8` (low nibble for columns
/// 0..8, high for 8..16).
fn put_nibbles(dst: &mut [u8], c: usize, vals: &[u8]) {
    for (j, v) in vals.iter().enumerate() {
        dst[j * 8 + c % 8] |= if c < 8 { *v } else { *v << 4 };
    }
}

/// Column `c`'s i8 values, step `j` in byte `j · 16 + c`.
fn put_signed(dst: &mut [u8], c: usize, vals: &[i8]) {
    for (j, v) in vals.iter().enumerate() {
        dst[j * 16 + c] = *v as u8;
    }
}

/// An output shared by the workers of a kernel, each writing its own part.
pub(crate) struct SyncPtr<T = f32>(pub(crate) *mut T);
// SAFETY: the kernels' chunks (Panels::matmul, linear's few_rows_into, the interval softmax's
// CPU twin) write disjoint parts
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// Through a method, so that closures capture the `Sync` wrapper, not the raw pointer.
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx512 {
    /// A panel's values (the kernel exists on x86_64 only; `supported()` is false elsewhere).
    pub trait Stream: Copy + Sync {
        fn panel_len(k: usize) -> usize;
    }
    impl Stream for f32 {
        fn panel_len(k: usize) -> usize {
            k * 16
        }
    }
    impl Stream for u16 {
        fn panel_len(k: usize) -> usize {
            k * 16
        }
    }
    macro_rules! byte_stream {
        ($t:ident, $steps:expr, $block:ident) => {
            impl Stream for super::$t {
                fn panel_len(k: usize) -> usize {
                    k / $steps * super::$block
                }
            }
        };
    }
    byte_stream!(Q41, 32, Q4_1_PANEL_BLOCK);
    byte_stream!(Q80, 32, Q8_0_PANEL_BLOCK);
    byte_stream!(Q4Kb, 32, Q4K_PANEL_BLOCK);
    byte_stream!(Q6Kb, 16, Q6K_PANEL_BLOCK);
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Prefetch distance: 4 KiB ahead in the panel stream, which runs on into the next panel
    /// (measured on the development VM with f32 panels: 32–128 lines within 5 %, none 1.3×
    /// slower at 16 rows).
    const AHEAD_BYTES: usize = 4096;

    /// A panel value: 16 of them load as one f32 vector.
    pub trait Weight: Copy + Sync {
        /// # Safety
        /// AVX-512F; `p .. p + 16` readable.
        unsafe fn load16(p: *const Self) -> __m512;
    }

    impl Weight for f32 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }

    /// bf16 bits, widened exactly: the f32 with these upper 16 bits and zero lower ones.
    impl Weight for u16 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(p: *const u16) -> __m512 {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    /// A panel's values as the kernel reads them: its length for `k` steps and its rows'
    /// products ([`rows_r`] for plain values, the quantized kernels for blocks).
    pub trait Stream: Copy + Sync {
        fn panel_len(k: usize) -> usize;
        /// # Safety
        /// AVX-512F; `x` is `R × k`, `panel` [`Self::panel_len`]`(k)`, `y` writable for `R`
        /// rows of stride `ldy` and `cols ≤ 16` columns.
        unsafe fn rows<const R: usize>(
            x: &[f32],
            k: usize,
            panel: &[Self],
            y: *mut f32,
            ldy: usize,
            cols: usize,
        );
    }

    impl<E: Weight> Stream for E {
        fn panel_len(k: usize) -> usize {
            k * 16
        }
        #[inline]
        unsafe fn rows<const R: usize>(
            x: &[f32],
            k: usize,
            panel: &[E],
            y: *mut f32,
            ldy: usize,
            cols: usize,
        ) {
            rows_r::<E, R>(x, k, panel, y, ldy, cols)
        }
    }

    /// The quantized panels' byte streams (see `PanelData`), each a transparent `u8`, and the
    /// kernel that reads them: Q4_1 and Q4_K the 4-bit kernel (f16 or f32 scales), Q8_0 (and
    /// Q5_0) and Q6_K the signed one (32 steps per f16 scale, or 16 per f32 one).
    macro_rules! byte_stream {
        ($t:ident, $steps:expr, $block:ident, $kernel:ident, $($arg:expr),*) => {
            impl Stream for super::$t {
                fn panel_len(k: usize) -> usize {
                    k / $steps * super::$block
                }
                #[inline]
                unsafe fn rows<const R: usize>(
                    x: &[f32],
                    k: usize,
                    panel: &[super::$t],
                    y: *mut f32,
                    ldy: usize,
                    cols: usize,
                ) {
                    let bytes =
                        std::slice::from_raw_parts(panel.as_ptr() as *const u8, panel.len());
                    $kernel::<R, $({ $arg }),*>(x, k, bytes, y, ldy, cols)
                }
            }
        };
    }
    byte_stream!(Q41, 32, Q4_1_PANEL_BLOCK, rows_r_q4_1, false);
    byte_stream!(Q4Kb, 32, Q4K_PANEL_BLOCK, rows_r_q4_1, true);
    byte_stream!(Q80, 32, Q8_0_PANEL_BLOCK, rows_r_q8_0, 32, false);
    byte_stream!(Q6Kb, 16, Q6K_PANEL_BLOCK, rows_r_q8_0, 16, true);

    /// `y[r, 0..cols]` (row stride `ldy`) for the `rows ≤ 16` rows of `x` (`rows × k`) against
    /// one panel (`k × 16` values).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn block<E: Stream>(
        x: &[f32],
        rows: usize,
        k: usize,
        panel: &[E],
        y: *mut f32,
        ldy: usize,
        cols: usize,
    ) {
        macro_rules! rows_dispatch {
            ($($r:literal)*) => {
                match rows {
                    $($r => E::rows::<$r>(x, k, panel, y, ldy, cols),)*
                    _ => unreachable!("block of {rows} rows"),
                }
            };
        }
        rows_dispatch!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_r<E: Weight, const R: usize>(
        x: &[f32],
        k: usize,
        panel: &[E],
        y: *mut f32,
        ldy: usize,
        cols: usize,
    ) {
        debug_assert!(x.len() == R * k && panel.len() == k * 16);
        let (xp, pp) = (x.as_ptr(), panel.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        let ahead = AHEAD_BYTES / std::mem::size_of::<E>();
        for kk in 0..k {
            let w = E::load16(pp.add(kk * 16));
            // a hint: past the end of the weights it fetches nothing useful, and never faults
            _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(kk * 16 + ahead) as *const i8);
            fma_rows(&mut acc, xp, k, kk, w);
        }
        store_rows(&acc, y, ldy, cols);
    }

    /// `acc[r] += x[r][kk] · w` for every row: the one multiply-add order of every panel kind.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma_rows<const R: usize>(
        acc: &mut [__m512; R],
        xp: *const f32,
        k: usize,
        kk: usize,
        w: __m512,
    ) {
        for (r, a) in acc.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(_mm512_set1_ps(*xp.add(r * k + kk)), w, *a);
        }
    }

    /// The rows' first `cols` outputs to `y` (row stride `ldy`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_rows<const R: usize>(acc: &[__m512; R], y: *mut f32, ldy: usize, cols: usize) {
        let m: __mmask16 = if cols >= 16 {
            0xffff
        } else {
            (1u16 << cols) - 1
        };
        for (r, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(y.add(r * ldy), m, *a);
        }
    }

    /// [`rows_r`] over a Q4_1 panel (f16 scales) or a Q4_K one (f32 scales): per block of 32
    /// steps the 16 columns' `d` and `m` (widened from f16 exactly, or read), per step the 16
    /// values unpacked from 8 bytes and dequantized as `q · d + m` (a product, then a sum: the
    /// loader's two roundings), then the same multiply-adds in the same order as the f32 panels.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_r_q4_1<const R: usize, const F32_SCALES: bool>(
        x: &[f32],
        k: usize,
        panel: &[u8],
        y: *mut f32,
        ldy: usize,
        cols: usize,
    ) {
        let (block, scales) = if F32_SCALES {
            (super::Q4K_PANEL_BLOCK, 128)
        } else {
            (super::Q4_1_PANEL_BLOCK, 64)
        };
        debug_assert!(x.len() == R * k && panel.len() == k / 32 * block);
        let (xp, pp) = (x.as_ptr(), panel.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        let low = _mm_set1_epi8(0x0f);
        for b in 0..k / 32 {
            let base = pp.add(b * block);
            for line in 0..block.div_ceil(64) {
                let at = b * block + AHEAD_BYTES + 64 * line;
                _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(at) as *const i8);
            }
            let (d, m) = if F32_SCALES {
                (
                    _mm512_loadu_ps(base as *const f32),
                    _mm512_loadu_ps(base.add(64) as *const f32),
                )
            } else {
                (
                    _mm512_cvtph_ps(_mm256_loadu_si256(base as *const __m256i)),
                    _mm512_cvtph_ps(_mm256_loadu_si256(base.add(32) as *const __m256i)),
                )
            };
            for j in 0..32 {
                let raw = _mm_loadl_epi64(base.add(scales + j * 8) as *const __m128i);
                let lo = _mm_and_si128(raw, low);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), low);
                // lanes 0..8 the low nibbles (columns 0..8), 8..16 the high ones
                let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
                let w = _mm512_add_ps(_mm512_mul_ps(q, d), m);
                fma_rows(&mut acc, xp, k, b * 32 + j, w);
            }
        }
        store_rows(&acc, y, ldy, cols);
    }

    /// [`rows_r`] over a panel of signed values with one scale per `GROUP` steps: Q8_0 / Q5_0
    /// (32 steps, f16 scales) or Q6_K (16 steps, f32 scales). Per step the 16 i8 values widened
    /// and dequantized as `q · d` (the loader's one rounding).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_r_q8_0<const R: usize, const GROUP: usize, const F32_SCALES: bool>(
        x: &[f32],
        k: usize,
        panel: &[u8],
        y: *mut f32,
        ldy: usize,
        cols: usize,
    ) {
        let scales = if F32_SCALES { 64 } else { 32 };
        let block = scales + GROUP * 16;
        debug_assert!(x.len() == R * k && panel.len() == k / GROUP * block);
        let (xp, pp) = (x.as_ptr(), panel.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..k / GROUP {
            let base = pp.add(b * block);
            let d = if F32_SCALES {
                _mm512_loadu_ps(base as *const f32)
            } else {
                _mm512_cvtph_ps(_mm256_loadu_si256(base as *const __m256i))
            };
            for j in 0..GROUP {
                if j % 4 == 0 {
                    let at = b * block + scales + j * 16 + AHEAD_BYTES;
                    _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(at) as *const i8);
                }
                let v = _mm_loadu_si128(base.add(scales + j * 16) as *const __m128i);
                let w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), d);
                fma_rows(&mut acc, xp, k, b * GROUP + j, w);
            }
        }
        store_rows(&acc, y, ldy, cols);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], rows: usize, n: usize, k: usize) -> Vec<f64> {
        let mut y = vec![0f64; rows * n];
        for r in 0..rows {
            for j in 0..n {
                y[r * n + j] = (0..k)
                    .map(|t| x[r * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
            }
        }
        y
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / 16_777_216.0 - 0.5
            })
            .collect()
    }

    /// Random blocks (`d` and `m` of either sign, every 4-bit or 8-bit value).
    fn quantized(kind: QuantKind, n: usize, k: usize, seed: u32) -> QuantBlocks {
        let v = values(n * k / QBLOCK * 3, seed);
        let mut bytes = Vec::new();
        for (b, s) in v.chunks(3).enumerate() {
            bytes.extend_from_slice(&half::f16::from_f32(s[0] * 0.1).to_le_bytes());
            let len = match kind {
                QuantKind::Q4_1 => {
                    bytes.extend_from_slice(&half::f16::from_f32(s[1]).to_le_bytes());
                    16u32
                }
                QuantKind::Q8_0 => 32,
                QuantKind::Q5_0 => 20,
                QuantKind::Q4K | QuantKind::Q6K => unreachable!("k_quantized"),
            };
            for j in 0..len {
                let h = (b as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(j * 97 + seed);
                bytes.push((h >> 7) as u8 ^ (s[2].to_bits() >> (j % 8)) as u8);
            }
        }
        QuantBlocks::new(kind, n, k, bytes).unwrap()
    }

    /// Random K-quant super-blocks: random bytes, the f16 scales set to finite values.
    fn k_quantized(kind: QuantKind, n: usize, k: usize, seed: u32) -> QuantBlocks {
        let per = kind.block_bytes();
        let count = n * k / crate::cpu::quant::QK_K;
        let v = values(count * per, seed);
        let mut bytes: Vec<u8> = v.iter().map(|x| (x.to_bits() >> 11) as u8).collect();
        for b in 0..count {
            let blk = &mut bytes[b * per..(b + 1) * per];
            let at = if kind == QuantKind::Q6K { per - 2 } else { 0 };
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01 + v[b] * 0.01).to_le_bytes());
            if kind == QuantKind::Q4K {
                blk[2..4].copy_from_slice(&half::f16::from_f32(0.02 - v[b] * 0.01).to_le_bytes());
            }
        }
        QuantBlocks::new(kind, n, k, bytes).unwrap()
    }

    /// Quantized panels (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) give the f32 panels' outputs of the dequantized weight
    /// bit for bit, for every block of rows and a width that is not a multiple of 16; the Q4_1
    /// packing puts column 0 in the low and column 8 in the high nibble of a step's first byte
    /// (the doc's example).
    #[test]
    fn quantized_panels_equal_the_f32_panels_bit_for_bit() {
        let q = quantized(QuantKind::Q4_1, 37, 96, 3);
        let p = Panels::pack_quantized(&q);
        let PanelData::Q4_1(data) = &p.data else {
            panic!("Q4_1 panels")
        };
        assert_eq!(data.len(), 3 * 3 * Q4_1_PANEL_BLOCK);
        let byte = data[64 + 3 * 8].0;
        let nib = |row: usize, col: usize| {
            let blk = &q.bytes[(row * 3 + col / 32) * Q4_1_BYTES..];
            let j = col % 32;
            if j < 16 {
                blk[4 + j] & 15
            } else {
                blk[4 + j - 16] >> 4
            }
        };
        assert_eq!(byte, nib(0, 3) | nib(8, 3) << 4);
        if !Panels::supported() {
            eprintln!("skipped the products: no AVX-512F on this CPU");
            return;
        }
        for kind in [
            QuantKind::Q4_1,
            QuantKind::Q8_0,
            QuantKind::Q5_0,
            QuantKind::Q4K,
            QuantKind::Q6K,
        ] {
            let q = match kind {
                QuantKind::Q4K | QuantKind::Q6K => k_quantized(kind, 37, 512, 5),
                _ => quantized(kind, 37, 96, 5),
            };
            let p = Panels::pack_quantized(&q);
            assert!(p.is_quantized());
            let w: Vec<f32> = (0..q.n)
                .flat_map(|r| (0..q.k).map(move |c| (r, c)))
                .map(|(r, c)| q.value(r, c))
                .collect();
            // the panels' rows are the loader's values (the embeddings and dense weight of a
            // layer that holds only its quantized panels)
            assert!(
                p.dense()
                    .iter()
                    .zip(&w)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kind:?}: dense"
            );
            let f = Panels::pack(&w, q.n, q.k);
            assert!(f
                .dense()
                .iter()
                .zip(&w)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            for rows in [1usize, 2, 7, 16, 17, 33] {
                let x = values(rows * q.k, rows as u32 + 11);
                let (a, b) = (p.matmul(&x, rows), f.matmul(&x, rows));
                assert!(
                    a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()),
                    "{kind:?}: {rows} rows differ"
                );
            }
        }
    }

    #[test]
    fn the_docs_packing_example() {
        let w: Vec<f32> = (0..36).map(|v| v as f32).collect(); // n = 18, k = 2
        let w: Vec<f32> = w.iter().map(|v| v + 0.001).collect(); // not bf16 values: kept f32
        let p = Panels::pack(&w, 18, 2);
        let PanelData::F32(data) = &p.data else {
            panic!("f32 weights that are not bf16 values are kept as f32")
        };
        assert_eq!(data.len(), 2 * 2 * 16);
        let panel1 = &data[32..];
        assert_eq!(&panel1[..3], &[32.001, 34.001, 0.]);
        assert_eq!(&panel1[16..19], &[33.001, 35.001, 0.]);
        assert_eq!(&data[..2], &[0.001, 2.001]); // panel 0, kk = 0: w[0][0], w[1][0]
    }

    /// Against an f64 reference: rows 1..=40 (blocks of 16 and the rest), widths not a
    /// multiple of 16 (the masked last panel) and odd depths.
    #[test]
    fn equals_the_reference_for_every_block_shape() {
        if !Panels::supported() {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        for &(n, k) in &[(37usize, 21usize), (64, 576), (5, 8), (16, 1)] {
            let w = values(n * k, 7);
            let p = Panels::pack(&w, n, k);
            for rows in [1usize, 2, 3, 9, 15, 16, 17, 32, 33, 40] {
                let x = values(rows * k, rows as u32);
                let got = p.matmul(&x, rows);
                let want = naive(&x, &w, rows, n, k);
                let tol = 1e-5 * (k as f64).sqrt() + 1e-6;
                for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g as f64 - e).abs() < tol,
                        "n {n} k {k} rows {rows} at {i}: {g} vs {e}"
                    );
                }
            }
        }
    }

    /// Weights that are all bf16 values are kept as bf16 and give the same bits as f32 panels
    /// of the same values (0.5 = 0x3F00_0000 → 0x3F00).
    #[test]
    fn bf16_weights_are_kept_as_bf16_and_give_the_same_bits() {
        if !Panels::supported() {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let (n, k) = (37usize, 100usize);
        let w: Vec<f32> = values(n * k, 5)
            .iter()
            .map(|v| f32::from_bits(v.to_bits() & 0xffff_0000))
            .collect();
        let half = Panels::pack(&w, n, k);
        assert!(half.is_bf16());
        let PanelData::Bf16(h) = &half.data else {
            unreachable!()
        };
        let full = Panels {
            data: PanelData::F32(
                h.iter()
                    .map(|&b| f32::from_bits((b as u32) << 16))
                    .collect(),
            ),
            n,
            k,
        };
        assert!(!Panels::pack(&[0.5, 0.1], 1, 2).is_bf16());
        let PanelData::Bf16(half_bits) = &Panels::pack(&[0.5], 1, 1).data else {
            panic!("0.5 is a bf16 value")
        };
        assert_eq!(half_bits[0], 0x3F00);
        for rows in [1usize, 9, 17] {
            let x = values(rows * k, 9);
            assert_eq!(half.matmul(&x, rows), full.matmul(&x, rows), "rows {rows}");
        }
    }

    /// A row's outputs are bit-identical alone and among others (AR step vs verify rows).
    #[test]
    fn a_row_gets_the_same_bits_alone_and_in_a_block() {
        if !Panels::supported() {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let (n, k) = (100usize, 576usize);
        let w = values(n * k, 3);
        let p = Panels::pack(&w, n, k);
        let x = values(20 * k, 11);
        let all = p.matmul(&x, 20);
        for r in [0usize, 5, 15, 16, 19] {
            let alone = p.matmul(&x[r * k..(r + 1) * k], 1);
            assert_eq!(alone, all[r * n..(r + 1) * n].to_vec(), "row {r}");
        }
    }
}
