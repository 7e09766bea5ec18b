//! A weight matrix re-laid as panels of 16 output columns, and the kernel (AVX-512, or AVX2 +
//! FMA + F16C as two 8-lane halves) that multiplies any number of rows by it, for CPU inference.
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

use crate::cpu::q8::{self, IntKind};
use crate::cpu::quant::{QuantBlocks, QuantKind, Q4_1_BYTES, Q8_0_BYTES, QBLOCK};
pub use crate::cpu::Isa;

/// Output columns per panel: one AVX-512 vector of f32, two AVX2 ones.
pub const PANEL: usize = 16;

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
    /// An LM head's column bounds ([`crate::cpu::screen`]): the integer products then keep the
    /// exact products' arg-max.
    screen: Option<Vec<f32>>,
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
///
/// Or, for the integer products ([`crate::cpu::q8`], `DFLASH_CPU_QUANT=q8`), Q4_1 and Q8_0
/// (Q4_0, Q5_0) blocks re-laid for `vpdpbusd`: the same bytes per weight, 4 steps per lane.
#[derive(Debug)]
enum PanelData {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    Q4_1(Vec<Q41>),
    Q8_0(Vec<Q80>),
    Q4K(Vec<Q4Kb>),
    Q6K(Vec<Q6Kb>),
    Int(IntKind, Vec<u8>),
}

/// The byte types of the quantized panels: one per layout, so that each picks its kernel
/// ([`Stream`]); each a transparent `u8`.
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
panel_byte!(Q41: "Q4_1", Q80: "Q8_0 (and Q4_0, Q5_0)", Q4Kb: "Q4_K", Q6Kb: "Q6_K");

/// Bytes of one Q4_1 panel block (16 columns × 32 steps).
const Q4_1_PANEL_BLOCK: usize = 64 + 32 * 8;
/// Bytes of one Q8_0 panel block.
const Q8_0_PANEL_BLOCK: usize = 32 + 32 * 16;
/// Bytes of one Q4_K panel block (16 columns × 32 steps, f32 scales).
const Q4K_PANEL_BLOCK: usize = 128 + 32 * 8;
/// Bytes of one Q6_K panel block (16 columns × 16 steps, f32 scales).
const Q6K_PANEL_BLOCK: usize = 64 + 16 * 16;

impl Panels {
    /// Whether the kernels run here: [`Isa::detect`] names an ISA (AVX-512F, or AVX2 + FMA +
    /// F16C).
    pub fn supported() -> bool {
        Isa::detect().is_some()
    }

    /// Re-lays `w` (`n × k`, row-major, as in the safetensors), panels in parallel; with
    /// `DFLASH_CPU_QUANT=q8` ([`q8::enabled`]) a weight whose `k` is a multiple of 32 is
    /// quantized to Q8_0 blocks ([`QuantBlocks::quantize_q8_0`]) for the integer products.
    /// Example: n = 18, k = 2 → 2 panels; panel 1 = `[w[16][0], w[17][0], 0 × 14, w[16][1],
    /// w[17][1], 0 × 14]`.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        if q8::enabled() && k.is_multiple_of(QBLOCK) && k > 0 {
            return Self::pack_integer(&QuantBlocks::quantize_q8_0(w, n, k));
        }
        Self::pack_f32(w, n, k)
    }

    /// [`Self::pack`] without the integer products: f32 or bf16 panels.
    pub fn pack_f32(w: &[f32], n: usize, k: usize) -> Self {
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
        Self {
            data,
            n,
            k,
            screen: None,
        }
    }

    /// Re-lays a weight's quantized blocks (see [`PanelData`]), panels in parallel; the
    /// padding columns of the last panel are zeros (d = m = 0). Each source block (32 weights,
    /// or a K-quant's 256) of column `c` is decoded once and written into its panel blocks
    /// ([`write_block`]). With `DFLASH_CPU_QUANT=q8` ([`q8::enabled`]) Q4_1 and Q8_0 (Q4_0,
    /// Q5_0) weights are laid out for the integer products instead ([`Self::pack_integer`]).
    pub fn pack_quantized(q: &QuantBlocks) -> Self {
        if q8::enabled() {
            return Self::pack_integer(q);
        }
        Self::pack_exact(q)
    }

    /// The panels of the exact products (see [`Self::pack_quantized`]).
    pub fn pack_exact(q: &QuantBlocks) -> Self {
        use rayon::prelude::*;
        let (n, k) = (q.n, q.k);
        let (per_block, steps) = match q.kind {
            QuantKind::Q4_1 => (Q4_1_PANEL_BLOCK, QBLOCK),
            QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => (Q8_0_PANEL_BLOCK, QBLOCK),
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
            QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => {
                PanelData::Q8_0(data.into_iter().map(Q80).collect())
            }
            QuantKind::Q4K => PanelData::Q4K(data.into_iter().map(Q4Kb).collect()),
            QuantKind::Q6K => PanelData::Q6K(data.into_iter().map(Q6Kb).collect()),
        };
        Self {
            data,
            n,
            k,
            screen: None,
        }
    }

    /// A GGUF weight's blocks laid out for the integer products ([`crate::cpu::q8`]: 4 steps of
    /// a column per 32-bit lane): Q4_1, Q8_0 (Q4_0, Q5_0), and the K-quants' sub-blocks (Q4_K's
    /// 32-step ones with their f32 `d1` and `−m1`, Q6_K's 16-step ones paired in a block with
    /// their two f32 scales). Panels in parallel; the last panel's padding columns are zeros.
    pub fn pack_integer(q: &QuantBlocks) -> Self {
        use rayon::prelude::*;
        let kind = match q.kind {
            QuantKind::Q4_1 => IntKind::Nibbles,
            QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => IntKind::Signed,
            QuantKind::Q4K => IntKind::NibblesF32,
            QuantKind::Q6K => IntKind::Signed16,
        };
        let (n, k, per) = (q.n, q.k, kind.block_bytes());
        let (src_bytes, src_weights) = (q.kind.block_bytes(), q.kind.block_weights());
        let (blocks, src_blocks) = (k / QBLOCK, k / src_weights);
        let mut data = vec![0u8; n.div_ceil(PANEL) * blocks * per];
        data.par_chunks_mut((blocks * per).max(1))
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..PANEL.min(n - p * PANEL) {
                    let row = p * PANEL + c;
                    for sb in 0..src_blocks {
                        let src = &q.bytes[(row * src_blocks + sb) * src_bytes..][..src_bytes];
                        // the source block's 32-step blocks: (scales, minimum, values)
                        let parts: Vec<([f32; 2], f32, [i32; QBLOCK])> = match q.kind {
                            QuantKind::Q4_1 | QuantKind::Q4K => q
                                .kind
                                .affine_block(src)
                                .into_iter()
                                .map(|(d, m, v)| ([d, d], m, v.map(|x| x as i32)))
                                .collect(),
                            QuantKind::Q6K => QuantKind::q6k_block(src)
                                .chunks(2)
                                .map(|h| {
                                    let mut v = [0i32; QBLOCK];
                                    for (j, x) in h[0].1.iter().chain(&h[1].1).enumerate() {
                                        v[j] = *x as i32;
                                    }
                                    ([h[0].0, h[1].0], 0.0, v)
                                })
                                .collect(),
                            _ => {
                                let (d, v) = q.kind.signed_block(src);
                                let d = half::f16::from_le_bytes(d).to_f32();
                                vec![([d, d], 0.0, v.map(|x| x as i32))]
                            }
                        };
                        let first = sb * (src_weights / QBLOCK);
                        for (t, (d, m, v)) in parts.iter().enumerate() {
                            kind.put(&mut panel[(first + t) * per..][..per], c, *d, *m, v);
                        }
                    }
                }
                // padding columns: weight 0 (a signed panel stores it as 128)
                for c in PANEL.min(n - p * PANEL)..PANEL {
                    for b in 0..blocks {
                        let blk = &mut panel[b * per..][..per];
                        kind.put(blk, c, [0.0; 2], 0.0, &[0; QBLOCK]);
                    }
                }
            });
        Self {
            data: PanelData::Int(kind, data),
            n,
            k,
            screen: None,
        }
    }

    /// An LM head's integer products that keep the exact products' arg-max
    /// ([`crate::cpu::screen`]): [`Self::pack_integer`]'s panels with each column's bound; `None`
    /// for a kind other than Q8_0, Q4_0 and Q5_0 (or a scale that is not finite).
    pub fn pack_screened(q: &QuantBlocks) -> Option<Self> {
        let bounds = crate::cpu::screen::column_bounds(q)?;
        let mut p = Self::pack_integer(q);
        p.screen = Some(bounds);
        Some(p)
    }

    /// The integer panels' kind and bytes (tests of the kernels' twins).
    #[cfg(test)]
    pub(crate) fn int_bytes(&self) -> Option<(IntKind, &[u8])> {
        match &self.data {
            PanelData::Int(kind, d) => Some((*kind, d)),
            _ => None,
        }
    }

    /// Whether the integer products keep the exact arg-max ([`Self::pack_screened`]).
    pub fn is_screened(&self) -> bool {
        self.screen.is_some()
    }

    /// The panels of rows `ids` of `W` (a drafter's vocabulary head over a quantized LM head):
    /// the same blocks, so the same values and products, at the quantized size; `None` for
    /// layouts other than Q8_0's (the caller dequantizes the rows). The rows of a screened head
    /// ([`Self::pack_screened`]) multiply exactly, as every drafter head does. Panics if an id
    /// is not a row (callers check).
    pub fn select_rows(&self, ids: &[u32]) -> Option<Panels> {
        let (k, nb) = (self.k, self.k / QBLOCK);
        let (src, per) = match &self.data {
            PanelData::Q8_0(d) => (as_bytes(d), Q8_0_PANEL_BLOCK),
            PanelData::Int(kind, d) => (d.as_slice(), kind.block_bytes()),
            _ => return None,
        };
        // integer rows stay integer, but a screened head's become exact Q8_0 panels
        let int_out = match &self.data {
            PanelData::Int(kind, _) if self.screen.is_none() => Some(*kind),
            _ => None,
        };
        let out_per = int_out.map_or(Q8_0_PANEL_BLOCK, |kind| kind.block_bytes());
        let mut out = vec![0u8; ids.len().div_ceil(PANEL) * nb * out_per];
        for (j, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert!(id < self.n, "Panels::select_rows: row {id} of {}", self.n);
            let (sp, sc, dp, dc) = (id / PANEL, id % PANEL, j / PANEL, j % PANEL);
            for b in 0..nb {
                let s = &src[(sp * nb + b) * per..][..per];
                let dst = &mut out[(dp * nb + b) * out_per..][..out_per];
                match (&self.data, int_out) {
                    (PanelData::Int(kind, _), Some(_)) => {
                        let mut vals = [0i32; QBLOCK];
                        for (step, v) in vals.iter_mut().enumerate() {
                            *v = kind.value(s, sc, step).0;
                        }
                        let ((_, d, m), (_, d_hi, _)) =
                            (kind.value(s, sc, 0), kind.value(s, sc, 16));
                        kind.put(dst, dc, [d, d_hi], m, &vals);
                    }
                    (PanelData::Int(kind, _), None) => {
                        // a signed block's f16 scale and i8 values in the exact layout
                        let d = kind.value(s, sc, 0).1;
                        dst[2 * dc..2 * dc + 2]
                            .copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                        for step in 0..QBLOCK {
                            dst[32 + step * 16 + dc] = kind.value(s, sc, step).0 as i8 as u8;
                        }
                    }
                    _ => {
                        dst[2 * dc..2 * dc + 2].copy_from_slice(&s[2 * sc..2 * sc + 2]);
                        for step in 0..QBLOCK {
                            dst[32 + step * 16 + dc] = s[32 + step * 16 + sc];
                        }
                    }
                }
            }
        }
        let data = match int_out {
            Some(kind) => PanelData::Int(kind, out),
            None => PanelData::Q8_0(out.into_iter().map(Q80).collect()),
        };
        Some(Panels {
            data,
            n: ids.len(),
            k,
            screen: None,
        })
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
            PanelData::Int(kind, d) => bytes(d, kind.block_bytes(), QBLOCK, out, &|b, s| {
                let (q, d, m) = kind.value(b, c, s);
                if kind.nibbles() {
                    q as f32 * d + m
                } else {
                    q as f32 * d
                }
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
        (match &self.data {
            PanelData::F32(d) => d.len() * 4,
            PanelData::Bf16(d) => d.len() * 2,
            PanelData::Q4_1(d) => d.len(),
            PanelData::Q8_0(d) => d.len(),
            PanelData::Q4K(d) => d.len(),
            PanelData::Q6K(d) => d.len(),
            PanelData::Int(_, d) => d.len(),
        }) + self.screen.as_ref().map_or(0, |b| b.len() * 4)
    }

    /// Bytes one product reads from the weights (panel padding aside): 4, 2, 0.625 (Q4_1) or
    /// 1.0625 (Q8_0) per weight.
    pub fn stream_bytes(&self) -> usize {
        let w = self.n * self.k;
        match self.data {
            PanelData::F32(_) => w * 4,
            PanelData::Bf16(_) => w * 2,
            PanelData::Q4_1(_) => w / QBLOCK * Q4_1_BYTES,
            PanelData::Q8_0(_) => w / QBLOCK * Q8_0_BYTES, // Q4_0 and Q5_0 too, held as Q8_0
            PanelData::Q4K(_) => w / (QBLOCK * 16) * Q4K_PANEL_BLOCK,
            PanelData::Q6K(_) => w / (16 * 16) * Q6K_PANEL_BLOCK,
            PanelData::Int(kind, _) => w / QBLOCK * kind.block_bytes() / PANEL,
        }
    }

    /// The panels' value format: "f32", "bf16", "Q4_1", "Q8_0" (Q4_0 and Q5_0 too), "Q4_K" or
    /// "Q6_K"; "Q4_1 q8" or "Q8_0 q8" for the integer products.
    pub fn format(&self) -> &'static str {
        if self.screen.is_some() {
            return "Q8_0 q8 screened";
        }
        match self.data {
            PanelData::F32(_) => "f32",
            PanelData::Bf16(_) => "bf16",
            PanelData::Q4_1(_) => "Q4_1",
            PanelData::Q8_0(_) => "Q8_0",
            PanelData::Q4K(_) => "Q4_K",
            PanelData::Q6K(_) => "Q6_K",
            PanelData::Int(IntKind::Nibbles, _) => "Q4_1 q8",
            PanelData::Int(IntKind::Signed, _) => "Q8_0 q8",
            PanelData::Int(IntKind::NibblesF32, _) => "Q4_K q8",
            PanelData::Int(IntKind::Signed16, _) => "Q6_K q8",
        }
    }

    /// Whether the products quantize their input rows ([`crate::cpu::q8`]).
    pub fn is_integer(&self) -> bool {
        matches!(self.data, PanelData::Int(..))
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

    /// `y[rows, n] = x[rows, k] · Wᵀ` on [`Isa::detect`]'s kernels, panels split over the
    /// calling thread and [`crate::cpu::helpers`].
    /// Panics if the CPU runs no kernel ([`Self::supported`]) or the lengths disagree (callers
    /// check both).
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let isa = Isa::detect().expect("Panels::matmul needs AVX-512F or AVX2 + FMA + F16C");
        self.matmul_on(isa, x, rows)
    }

    /// [`Self::matmul`] on the kernels of `isa`, which the CPU must run ([`Isa::available`]).
    pub fn matmul_on(&self, isa: Isa, x: &[f32], rows: usize) -> Vec<f32> {
        assert!(
            Isa::available().contains(&isa),
            "Panels::matmul_on: no {isa:?} here"
        );
        assert_eq!(x.len(), rows * self.k, "Panels::matmul: input length");
        match &self.data {
            PanelData::F32(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Bf16(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Q4_1(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Q8_0(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Q4K(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Q6K(d) => self.matmul_of(isa, d, x, rows),
            PanelData::Int(kind, d) => self.matmul_int(isa, *kind, d, x, rows),
        }
    }

    /// The integer products ([`crate::cpu::q8`]): the rows quantized once, then each panel's
    /// blocks of rows on [`q8::IntIsa::for_isa`]'s kernel.
    fn matmul_int(&self, isa: Isa, kind: IntKind, data: &[u8], x: &[f32], rows: usize) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let a = q8::quantize_rows(x, rows, k);
        let ii = q8::IntIsa::for_isa(isa);
        let mut y = vec![0f32; rows * n];
        let out = SyncPtr(y.as_mut_ptr());
        let len = k / QBLOCK * kind.block_bytes();
        let run = |range: std::ops::Range<usize>| {
            let y = out.ptr();
            for p in range {
                let cols = PANEL.min(n - p * PANEL);
                let panel = &data[p * len..][..len];
                let mut r0 = 0;
                while r0 < rows {
                    let r = ii.block_rows().min(rows - r0);
                    let y = y.wrapping_add(r0 * n + p * PANEL);
                    // SAFETY: the CPU runs `isa` (checked by matmul_on) and so `ii`; the block
                    // writes y[r0..r0+r, 16p..16p+cols] only, disjoint from every other chunk's
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        q8::block(ii, kind, &a, r0, r, panel, y, n, cols)
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    {
                        let _ = (y, panel, cols, &a);
                    }
                    r0 += r;
                }
            }
        };
        self.over_panels(rows, &run);
        if let Some(bounds) = &self.screen {
            crate::cpu::screen::settle(&mut y, &a, x, bounds, &|c| {
                (&data[c / PANEL * len..][..len], c % PANEL)
            });
        }
        y
    }

    /// `run` over every panel: on the calling thread for a small product, else in chunks of
    /// panels (≈ 8 per thread) on the calling thread and [`crate::cpu::helpers`].
    fn over_panels(&self, rows: usize, run: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let panels = self.n.div_ceil(PANEL);
        if rows * self.n * self.k < INLINE_FMAS {
            run(0..panels);
        } else {
            let chunk = panels
                .div_ceil(rayon::current_num_threads().max(1) * 8)
                .max(1);
            crate::cpu::helpers::for_each_chunk(panels.div_ceil(chunk), &|c| {
                run(c * chunk..((c + 1) * chunk).min(panels))
            });
        }
    }

    fn matmul_of<E: Stream>(&self, isa: Isa, data: &[E], x: &[f32], rows: usize) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let mut y = vec![0f32; rows * n];
        let out = SyncPtr(y.as_mut_ptr());
        // rows per block: 16 accumulators and a weight vector within AVX-512's 32 registers;
        // 6 × 2 halves and a weight's 2 within AVX2's 16
        let block_rows = match isa {
            Isa::Avx512 => 16,
            Isa::Avx2 => 6,
        };
        let run = |range: std::ops::Range<usize>| {
            let y = out.ptr();
            for p in range {
                let cols = PANEL.min(n - p * PANEL);
                let len = E::panel_len(k);
                let panel = &data[p * len..][..len];
                let mut r0 = 0;
                while r0 < rows {
                    let r = block_rows.min(rows - r0);
                    let x = &x[r0 * k..(r0 + r) * k];
                    let y = y.wrapping_add(r0 * n + p * PANEL);
                    // SAFETY: the CPU runs `isa` (checked above); the block writes
                    // y[r0..r0+r, 16p..16p+cols] only, inside y (rows × n) and disjoint from
                    // every other chunk's columns
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        match isa {
                            Isa::Avx512 => avx512::block(x, r, k, panel, y, n, cols),
                            Isa::Avx2 => avx2::block(x, r, k, panel, y, n, cols),
                        }
                    };
                    #[cfg(not(target_arch = "x86_64"))]
                    let _ = (x, y, panel, cols);
                    r0 += r;
                }
            }
        };
        self.over_panels(rows, &run);
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
        QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => {
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

/// The kernel a panel kind runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    F32,
    Bf16,
    /// 4-bit values, f16 (`false`) or f32 (`true`) scales: Q4_1, Q4_K.
    Nibbles(bool),
    /// Signed bytes, one scale per `.0` steps, f16 or f32: Q8_0 (and Q4_0, Q5_0), Q6_K.
    Signed(usize, bool),
}

/// A panel's values as the kernels read them: its length for `k` steps and its kernel.
trait Stream: Copy + Sync {
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
        /// panel (measured on the development VM with f32 panels and AVX-512: 32–128 lines
        /// within 5 %, none 1.3× slower at 16 rows).
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
mod avx512 {
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
mod avx2 {
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

#[cfg(test)]
pub(crate) mod tests {
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

    /// Every GGUF block kind the panels stream.
    const KINDS: [QuantKind; 6] = [
        QuantKind::Q4_1,
        QuantKind::Q8_0,
        QuantKind::Q4_0,
        QuantKind::Q5_0,
        QuantKind::Q4K,
        QuantKind::Q6K,
    ];

    /// `len` values in [−0.5, 0.5) from a seeded linear congruential stream.
    pub(crate) fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / 16_777_216.0 - 0.5
            })
            .collect()
    }

    /// Asserts that the panels' rows ([`Panels::dense`]) are the loader's values of `q`, bit for
    /// bit, and returns those values (`[n, k]` row-major).
    fn dense_is_the_loaders(p: &Panels, q: &QuantBlocks) -> Vec<f32> {
        let w: Vec<f32> = (0..q.n)
            .flat_map(|r| (0..q.k).map(move |c| (r, c)))
            .map(|(r, c)| q.value(r, c))
            .collect();
        assert!(
            p.dense()
                .iter()
                .zip(&w)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{:?}: dense",
            q.kind
        );
        w
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
                QuantKind::Q4_0 => 16,
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

    /// Quantized panels (Q4_1, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K) give the f32 panels' outputs of the dequantized weight
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
        for kind in KINDS {
            let q = match kind {
                QuantKind::Q4K | QuantKind::Q6K => k_quantized(kind, 37, 512, 5),
                _ => quantized(kind, 37, 96, 5),
            };
            let p = Panels::pack_quantized(&q);
            assert!(p.is_quantized());
            // the panels' rows are the loader's values (the embeddings and dense weight of a
            // layer that holds only its quantized panels)
            let w = dense_is_the_loaders(&p, &q);
            let f = Panels::pack(&w, q.n, q.k);
            assert!(f
                .dense()
                .iter()
                .zip(&w)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            // every ISA this CPU runs (none: the packing and the values only)
            for isa in Isa::available() {
                for rows in [1usize, 2, 7, 16, 17, 33] {
                    let x = values(rows * q.k, rows as u32 + 11);
                    let (a, b) = (p.matmul_on(isa, &x, rows), f.matmul_on(isa, &x, rows));
                    assert!(
                        a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()),
                        "{kind:?} on {isa:?}: {rows} rows differ"
                    );
                }
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
        for isa in Isa::available() {
            reference_shapes(isa);
        }
    }

    fn reference_shapes(isa: Isa) {
        for &(n, k) in &[(37usize, 21usize), (64, 576), (5, 8), (16, 1)] {
            let w = values(n * k, 7);
            let p = Panels::pack(&w, n, k);
            for rows in [1usize, 2, 3, 9, 15, 16, 17, 32, 33, 40] {
                let x = values(rows * k, rows as u32);
                let got = p.matmul_on(isa, &x, rows);
                let want = naive(&x, &w, rows, n, k);
                let tol = 1e-5 * (k as f64).sqrt() + 1e-6;
                for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g as f64 - e).abs() < tol,
                        "{isa:?}: n {n} k {k} rows {rows} at {i}: {g} vs {e}"
                    );
                }
            }
        }
    }

    /// Weights that are all bf16 values are kept as bf16 and give the same bits as f32 panels
    /// of the same values (0.5 = 0x3F00_0000 → 0x3F00).
    #[test]
    fn bf16_weights_are_kept_as_bf16_and_give_the_same_bits() {
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
            screen: None,
        };
        assert!(!Panels::pack(&[0.5, 0.1], 1, 2).is_bf16());
        let PanelData::Bf16(half_bits) = &Panels::pack(&[0.5], 1, 1).data else {
            panic!("0.5 is a bf16 value")
        };
        assert_eq!(half_bits[0], 0x3F00);
        for isa in Isa::available() {
            for rows in [1usize, 9, 17] {
                let x = values(rows * k, 9);
                let (a, b) = (half.matmul_on(isa, &x, rows), full.matmul_on(isa, &x, rows));
                assert_eq!(a, b, "{isa:?}: rows {rows}");
            }
        }
    }

    /// The integer products ([`q8`]): the panels hold the loader's values (their rows, for
    /// embeddings); on every ISA the CPU runs, every block of rows gives the scalar twin's bits
    /// (and so a row the same bits alone and among others); the outputs are the exact
    /// products within the 8-bit rows' rounding (half a step of each block's scale per input,
    /// times Σ |w| of the block) plus f32 rounding; every GGUF format here (Q4_1, Q8_0, Q4_0,
    /// Q5_0, Q4_K, Q6_K).
    #[test]
    fn integer_panels_equal_their_scalar_twin() {
        for kind in KINDS {
            let (n, q) = match kind {
                QuantKind::Q4K | QuantKind::Q6K => (37usize, k_quantized(kind, 37, 512, 9)),
                _ => (37, quantized(kind, 37, 96, 9)),
            };
            let k = q.k;
            let p = Panels::pack_integer(&q);
            assert!(p.is_quantized() && p.is_integer());
            let w = dense_is_the_loaders(&p, &q);
            let PanelData::Int(ik, data) = &p.data else {
                panic!("integer panels")
            };
            let len = k / QBLOCK * ik.block_bytes();
            for rows in [1usize, 3, 4, 5, 16, 17, 33] {
                let mut x = values(rows * k, rows as u32 + 5);
                x[..QBLOCK].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
                let a = q8::quantize_rows(&x, rows, k);
                let mut twin = vec![0f32; rows * n];
                for pp in 0..n.div_ceil(PANEL) {
                    let cols = PANEL.min(n - pp * PANEL);
                    let mut t = vec![0f32; rows * PANEL];
                    q8::block_scalar(
                        *ik,
                        &a,
                        0,
                        rows,
                        &data[pp * len..][..len],
                        &mut t,
                        PANEL,
                        cols,
                    );
                    for r in 0..rows {
                        twin[r * n + pp * PANEL..][..cols].copy_from_slice(&t[r * PANEL..][..cols]);
                    }
                }
                // rows of W (a vocabulary head) keep their blocks: the same columns' bits
                let ids = [36u32, 0, 17, 16];
                let sel = p.select_rows(&ids).unwrap();
                assert!(sel.is_integer() && sel.resident_bytes() == len);
                for isa in Isa::available() {
                    let got = p.matmul_on(isa, &x, rows);
                    assert!(
                        got.iter()
                            .zip(&twin)
                            .all(|(u, v)| u.to_bits() == v.to_bits()),
                        "{kind:?} on {isa:?}: {rows} rows differ from the twin"
                    );
                    let part = sel.matmul_on(isa, &x, rows);
                    for r in 0..rows {
                        for (j, &id) in ids.iter().enumerate() {
                            let (a, b) = (part[r * ids.len() + j], got[r * n + id as usize]);
                            assert_eq!(a.to_bits(), b.to_bits(), "{kind:?}: row {id}");
                        }
                    }
                }
                let exact = naive(&x, &w, rows, n, k);
                for r in 0..rows {
                    for j in 0..n {
                        let mut bound = 0f64;
                        let mut mag = 0f64;
                        for b in 0..k / QBLOCK {
                            let xs = &x[r * k + b * QBLOCK..][..QBLOCK];
                            let ws = &w[j * k + b * QBLOCK..][..QBLOCK];
                            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                            let wsum: f64 = ws.iter().map(|v| v.abs() as f64).sum();
                            bound += amax / 254.0 * 1.0001 * wsum;
                            mag += xs
                                .iter()
                                .zip(ws)
                                .map(|(a, b)| (a * b).abs() as f64)
                                .sum::<f64>();
                        }
                        let err = (twin[r * n + j] as f64 - exact[r * n + j]).abs();
                        assert!(
                            err <= bound + 1e-5 * mag + 1e-6,
                            "{kind:?} [{r}, {j}]: error {err} over the bound {bound}"
                        );
                    }
                }
            }
        }
    }

    /// A row's outputs are bit-identical alone and among others (AR step vs verify rows).
    #[test]
    fn a_row_gets_the_same_bits_alone_and_in_a_block() {
        let (n, k) = (100usize, 576usize);
        let w = values(n * k, 3);
        let p = Panels::pack(&w, n, k);
        let x = values(20 * k, 11);
        for isa in Isa::available() {
            let all = p.matmul_on(isa, &x, 20);
            for r in [0usize, 5, 6, 15, 16, 19] {
                let alone = p.matmul_on(isa, &x[r * k..(r + 1) * k], 1);
                assert_eq!(alone, all[r * n..(r + 1) * n].to_vec(), "{isa:?}: row {r}");
            }
        }
    }

    /// Both ISAs sum each output in the same order with fused multiply-adds: the same bits
    /// (not required of them, but what the kernels do; it keeps the two comparable).
    #[test]
    fn the_isas_give_the_same_bits() {
        let isas = Isa::available();
        if isas.len() < 2 {
            return;
        }
        let (n, k) = (37usize, 96usize);
        let q = quantized(QuantKind::Q4_1, n, k, 9);
        let p = Panels::pack_quantized(&q);
        let x = values(17 * k, 4);
        let want = p.matmul_on(isas[0], &x, 17);
        for &isa in &isas[1..] {
            assert_eq!(p.matmul_on(isa, &x, 17), want, "{isa:?}");
        }
    }
}
