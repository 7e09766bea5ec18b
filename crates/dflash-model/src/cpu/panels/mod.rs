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

use crate::cpu::q8::IntKind;
use crate::cpu::quant::{Q4_1_BYTES, Q8_0_BYTES, QBLOCK};
pub use crate::cpu::Isa;

mod kernels;
mod matmul;
mod pack;
mod rows;
#[cfg(test)]
pub(crate) mod tests;

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
/// ([`kernels::Stream`]); each a transparent `u8`.
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
