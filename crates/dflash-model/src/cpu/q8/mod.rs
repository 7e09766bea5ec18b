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

use dflash_core::runtime::{self, CpuProducts, RuntimeConfig};

mod kernels;
mod quantize;
#[cfg(test)]
mod tests;

#[cfg(target_arch = "x86_64")]
pub use kernels::block;
pub use kernels::{block_scalar, IntIsa};
pub use quantize::{quantize_block_scalar, quantize_rows, Q8Rows};

/// Values per block of the rule (every format here).
pub const QB: usize = 32;
/// Bytes of an integer Q4_1 panel block: 16 f16 scales, 16 f16 minimums, 8 groups of 32.
pub const Q41_BLOCK: usize = 64 + 8 * 32;
/// Bytes of an integer Q8_0 panel block: 16 f16 scales, 8 groups of 64.
pub const Q80_BLOCK: usize = 32 + 8 * 64;

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
