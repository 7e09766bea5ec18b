//! A GGUF weight kept in its quantized blocks for the CPU panels ([`crate::cpu::panels`]),
//! which stream them and dequantize in registers with the operations of the loader's own
//! dequantization, so that every product is bit-identical to the f32 panels' (and every logit,
//! tap and decoded token to the f32 path's) while the weights stream at their GGUF size.
//!
//! Blocks of 32 weights of one row (ggml), dequantized in f32 as candle's `to_float`:
//! - Q4_1 `{d: f16, m: f16, qs: [u8; 16]}` (20 bytes): weight `j` = `q · d + m` (one product,
//!   one sum), `q = qs[j] & 15` for `j < 16` and `qs[j − 16] >> 4` after;
//! - Q8_0 `{d: f16, qs: [i8; 32]}` (34 bytes): weight `j` = `qs[j] · d`;
//! - Q4_0 `{d: f16, qs: [u8; 16]}` (18 bytes): weight `j` = `(q − 8) · d`, `q` the low nibble
//!   of `qs[j]` for `j < 16` and the high nibble of `qs[j − 16]` after (held as a Q8_0 value);
//! - Q5_0 `{d: f16, qh: u32, qs: [u8; 16]}` (22 bytes): weight `j` = `q · d`, `q` the low or
//!   high nibble of `qs[j mod 16]` with bit `j` of `qh` as its fifth bit, minus 16 (the panels
//!   hold it as a Q8_0 value: the same product);
//! - Q4_K super-blocks of 256 `{d, dmin: f16, scales: [u8; 12], qs: [u8; 128]}` (144 bytes):
//!   sub-block `s` of 32 has `d1 = d · sc_s`, `m1 = dmin · m_s` (f32 products) and weight
//!   `d1 · q − m1`, the panels' `q · d1 + (−m1)` (the same two roundings);
//! - Q6_K super-blocks of 256 `{ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16}` (210
//!   bytes): sub-block `s` of 16 has `s_d = d · sc_s` and weight `s_d · q`, `q` of 6 bits − 32.
//!
//! Example: Q4_1 d = 0.5, m = −1, qs[0] = 0x73 → weight 0 = 3 · 0.5 − 1 = 0.5, weight 16 =
//! 7 · 0.5 − 1 = 2.5; Q8_0 d = 0.25, qs[0] = −6 → weight 0 = −1.5.

use anyhow::{bail, Result};

/// Weights per block (every format here).
pub const QBLOCK: usize = 32;
/// Bytes per Q4_1 block.
pub const Q4_1_BYTES: usize = 20;
/// Bytes per Q8_0 block.
pub const Q8_0_BYTES: usize = 34;
/// Bytes per Q4_0 block.
pub const Q4_0_BYTES: usize = 18;
/// Bytes per Q5_0 block.
pub const Q5_0_BYTES: usize = 22;
/// Weights per K-quant super-block.
pub const QK_K: usize = 256;

/// The quantized formats the panels stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    Q4_1,
    Q8_0,
    Q4_0,
    Q5_0,
    Q4K,
    Q6K,
}

impl QuantKind {
    /// Bytes of one block of 32 weights.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q4_1 => Q4_1_BYTES,
            QuantKind::Q8_0 => Q8_0_BYTES,
            QuantKind::Q4_0 => Q4_0_BYTES,
            QuantKind::Q5_0 => Q5_0_BYTES,
            QuantKind::Q4K => 144,
            QuantKind::Q6K => 210,
        }
    }

    /// Weights per block.
    pub fn block_weights(self) -> usize {
        match self {
            QuantKind::Q4K | QuantKind::Q6K => QK_K,
            _ => QBLOCK,
        }
    }

    /// A Q4_1 or Q4_K block as sub-blocks of 32: `(d, m, q)` with weight `j` = `q[j] · d + m`
    /// in f32 (Q4_K's `m` is `−m1`).
    pub fn affine_block(self, src: &[u8]) -> Vec<(f32, f32, [u8; QBLOCK])> {
        let f16 = |i: usize| half::f16::from_le_bytes([src[i], src[i + 1]]).to_f32();
        match self {
            QuantKind::Q4_1 => {
                let mut q = [0u8; QBLOCK];
                for j in 0..16 {
                    q[j] = src[4 + j] & 15;
                    q[j + 16] = src[4 + j] >> 4;
                }
                vec![(f16(0), f16(2), q)]
            }
            QuantKind::Q4K => {
                let (d, min) = (f16(0), f16(2));
                let scales = &src[4..16];
                let qs = &src[16..144];
                let scale_min = |j: usize| -> (u8, u8) {
                    if j < 4 {
                        (scales[j] & 63, scales[j + 4] & 63)
                    } else {
                        (
                            (scales[j + 4] & 0xf) | ((scales[j - 4] >> 6) << 4),
                            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
                        )
                    }
                };
                (0..8)
                    .map(|s| {
                        let (sc, m) = scale_min(s);
                        let half = &qs[(s / 2) * 32..(s / 2) * 32 + 32];
                        let mut q = [0u8; QBLOCK];
                        for (j, v) in q.iter_mut().enumerate() {
                            *v = if s % 2 == 0 {
                                half[j] & 0xf
                            } else {
                                half[j] >> 4
                            };
                        }
                        (d * sc as f32, -(min * m as f32), q)
                    })
                    .collect()
            }
            other => panic!("{other:?} blocks are not 4-bit values with a scale and a minimum"),
        }
    }

    /// A Q6_K super-block as 16 sub-blocks of 16: `(s_d, q)` with weight `j` = `q[j] · s_d`.
    pub fn q6k_block(src: &[u8]) -> Vec<(f32, [i8; 16])> {
        let (ql, qh) = (&src[0..128], &src[128..192]);
        let sc = &src[192..208];
        let d = half::f16::from_le_bytes([src[208], src[209]]).to_f32();
        let mut q = [0i8; QK_K];
        for n in 0..2 {
            let (ql, qh, y) = (&ql[64 * n..], &qh[32 * n..], &mut q[128 * n..]);
            for l in 0..32 {
                y[l] = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i8 - 32;
                y[l + 32] = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        (0..16)
            .map(|s| {
                let mut g = [0i8; 16];
                g.copy_from_slice(&q[16 * s..16 * s + 16]);
                (d * (sc[s] as i8) as f32, g)
            })
            .collect()
    }

    /// A Q8_0, Q4_0 or Q5_0 block as its scale's f16 bytes and 32 signed values (weight `j` =
    /// `q[j] · d`). Panics for Q4_1 (not of this form).
    pub fn signed_block(self, src: &[u8]) -> ([u8; 2], [i8; QBLOCK]) {
        let mut q = [0i8; QBLOCK];
        match self {
            QuantKind::Q8_0 => {
                for (j, v) in q.iter_mut().enumerate() {
                    *v = src[2 + j] as i8;
                }
            }
            QuantKind::Q4_0 => {
                for j in 0..16 {
                    q[j] = (src[2 + j] & 0x0f) as i8 - 8;
                    q[j + 16] = (src[2 + j] >> 4) as i8 - 8;
                }
            }
            QuantKind::Q5_0 => {
                let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
                for j in 0..16 {
                    let h0 = (((qh >> j) << 4) & 0x10) as u8;
                    let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                    q[j] = ((src[6 + j] & 0x0f) | h0) as i8 - 16;
                    q[j + 16] = ((src[6 + j] >> 4) | h1) as i8 - 16;
                }
            }
            other => panic!("{other:?} blocks are not 32 signed values times an f16 scale"),
        }
        ([src[0], src[1]], q)
    }
}

/// A weight `[n, k]` as its GGUF blocks, rows in the order the model uses (a llama GGUF's
/// permuted q/k rows already put back).
#[derive(Debug, Clone)]
pub struct QuantBlocks {
    pub kind: QuantKind,
    pub n: usize,
    pub k: usize,
    pub bytes: Vec<u8>,
}

impl QuantBlocks {
    pub fn new(kind: QuantKind, n: usize, k: usize, bytes: Vec<u8>) -> Result<Self> {
        let (per, bw) = (kind.block_bytes(), kind.block_weights());
        if !k.is_multiple_of(bw) || bytes.len() != n * k / bw * per {
            bail!(
                "{kind:?} weight [{n}, {k}]: {} bytes, expected {} (rows of {bw}-weight blocks)",
                bytes.len(),
                n * k.div_ceil(bw) * per
            );
        }
        Ok(Self { kind, n, k, bytes })
    }

    /// `w` (`n × k` f32, row-major, `k` a multiple of 32) quantized to Q8_0 blocks as
    /// llama.cpp's reference does: per 32 values `d = max |w| / 127` (stored as f16), `q =
    /// round(w · (1 / d))` with `d` in f32 (half away from zero; 0 where `d` = 0). Example:
    /// [127, −63.5, 0.5, 0, …] → d = 1, q = [127, −64, 1, 0, …].
    pub fn quantize_q8_0(w: &[f32], n: usize, k: usize) -> Self {
        assert!(
            k.is_multiple_of(QBLOCK) && w.len() == n * k,
            "quantize_q8_0: [{n}, {k}]"
        );
        let mut bytes = Vec::with_capacity(n * k / QBLOCK * Q8_0_BYTES);
        for blk in w.chunks_exact(QBLOCK) {
            let a = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = a / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            bytes.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
            bytes.extend(
                blk.iter()
                    .map(|&v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
            );
        }
        Self {
            kind: QuantKind::Q8_0,
            n,
            k,
            bytes,
        }
    }

    /// The same blocks with their rows reordered: row `i` of the result is row `from[i]`.
    pub fn with_rows(&self, from: &[usize]) -> Self {
        let row = self.k / self.kind.block_weights() * self.kind.block_bytes();
        let mut bytes = Vec::with_capacity(self.bytes.len());
        for &r in from {
            bytes.extend_from_slice(&self.bytes[r * row..(r + 1) * row]);
        }
        Self {
            bytes,
            ..self.clone()
        }
    }

    /// Every weight `[n, k]` row-major, [`Self::value`]'s values (each block decoded once).
    pub fn dequantize(&self) -> Vec<f32> {
        let (per, bw) = (self.kind.block_bytes(), self.kind.block_weights());
        let mut out = Vec::with_capacity(self.n * self.k);
        for blk in self.bytes.chunks_exact(per) {
            match self.kind {
                QuantKind::Q4_1 | QuantKind::Q4K => {
                    for (d, m, q) in self.kind.affine_block(blk) {
                        out.extend(q.iter().map(|&q| (q as f32) * d + m));
                    }
                }
                QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => {
                    let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    let (_, q) = self.kind.signed_block(blk);
                    out.extend(q.iter().map(|&q| (q as f32) * d));
                }
                QuantKind::Q6K => {
                    for (d, q) in QuantKind::q6k_block(blk) {
                        out.extend(q.iter().map(|&q| (q as f32) * d));
                    }
                }
            }
        }
        debug_assert_eq!(out.len(), self.n * self.k / bw * bw);
        out
    }

    /// Weight `(row, col)` as the loader dequantizes it (the reference of the tests).
    pub fn value(&self, row: usize, col: usize) -> f32 {
        let (per, bw) = (self.kind.block_bytes(), self.kind.block_weights());
        let blk = &self.bytes[(row * self.k / bw + col / bw) * per..][..per];
        let j = col % bw;
        match self.kind {
            QuantKind::Q4_1 | QuantKind::Q4K => {
                let (d, m, q) = self.kind.affine_block(blk)[j / QBLOCK];
                (q[j % QBLOCK] as f32) * d + m
            }
            QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let (_, q) = self.kind.signed_block(blk);
                (q[j] as f32) * d
            }
            QuantKind::Q6K => {
                let (d, q) = QuantKind::q6k_block(blk)[j / 16];
                (q[j % 16] as f32) * d
            }
        }
    }
}

/// Whether GGUF weights are streamed from their blocks on the CPU: unless the runtime
/// configuration's `cpu_products` is `f32` (the f32 panels, for comparisons); `q8` streams them
/// into integer products ([`crate::cpu::q8`]).
pub fn streaming() -> bool {
    dflash_core::runtime::current().cpu_products != dflash_core::runtime::CpuProducts::F32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_module_example() {
        let mut b = vec![0u8; Q4_1_BYTES];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(-1.0).to_le_bytes());
        b[4] = 0x73;
        let q = QuantBlocks::new(QuantKind::Q4_1, 1, 32, b).unwrap();
        assert_eq!(q.value(0, 0), 0.5);
        assert_eq!(q.value(0, 16), 2.5);
        assert_eq!(q.value(0, 1), -1.0);
        assert!(QuantBlocks::new(QuantKind::Q4_1, 1, 32, vec![0; 19]).is_err());
        let mut b = vec![0u8; Q8_0_BYTES];
        b[..2].copy_from_slice(&half::f16::from_f32(0.25).to_le_bytes());
        b[2] = (-6i8) as u8;
        let q = QuantBlocks::new(QuantKind::Q8_0, 1, 32, b).unwrap();
        assert_eq!(q.value(0, 0), -1.5);
        assert_eq!(q.value(0, 1), 0.0);
        // quantize_q8_0's example
        let mut w = vec![0f32; 64];
        w[..3].copy_from_slice(&[127.0, -63.5, 0.5]);
        w[32] = -0.25;
        let q = QuantBlocks::quantize_q8_0(&w, 2, 32);
        assert_eq!((q.n, q.k, q.bytes.len()), (2, 32, 2 * Q8_0_BYTES));
        assert_eq!(
            (0..4).map(|c| q.value(0, c)).collect::<Vec<_>>(),
            [127.0, -64.0, 1.0, 0.0]
        );
        // d = 0.25 / 127 is stored as an f16
        let d = half::f16::from_f32(0.25 / 127.0).to_f32();
        assert_eq!(q.value(1, 0), -127.0 * d);
    }

    /// Every format's values are candle's dequantization of the same bytes (the loader's
    /// reference), bit for bit: random blocks of 32-weight formats and super-blocks of the
    /// K-quants with finite f16 scales.
    #[test]
    fn values_equal_candles_dequantization() {
        use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
        let mut seed = 7u32;
        let mut byte = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 13) as u8
        };
        for (kind, dt) in [
            (QuantKind::Q4_1, GgmlDType::Q4_1),
            (QuantKind::Q8_0, GgmlDType::Q8_0),
            (QuantKind::Q4_0, GgmlDType::Q4_0),
            (QuantKind::Q5_0, GgmlDType::Q5_0),
            (QuantKind::Q4K, GgmlDType::Q4K),
            (QuantKind::Q6K, GgmlDType::Q6K),
        ] {
            let (n, k) = (3, 512);
            let per = kind.block_bytes();
            let blocks = n * k / kind.block_weights();
            let mut bytes: Vec<u8> = (0..blocks * per).map(|_| byte()).collect();
            // finite f16 scales where each format keeps them
            let scale_at: &[usize] = match kind {
                QuantKind::Q4_1 | QuantKind::Q4K => &[0, 2],
                QuantKind::Q6K => &[208],
                _ => &[0],
            };
            for b in 0..blocks {
                for &at in scale_at {
                    let v = 0.01 + (b % 7) as f32 * 0.003 - (at as f32) * 1e-5;
                    bytes[b * per + at..b * per + at + 2]
                        .copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }
            }
            let ours = QuantBlocks::new(kind, n, k, bytes.clone()).unwrap();
            let theirs = qtensor_from_ggml(dt, &bytes, vec![n, k], &candle_core::Device::Cpu)
                .unwrap()
                .dequantize(&candle_core::Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let got = ours.dequantize();
            assert_eq!(got.len(), theirs.len(), "{kind:?}");
            for (i, (a, b)) in got.iter().zip(&theirs).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{kind:?} weight {i}: {a} vs {b}");
                assert_eq!(
                    ours.value(i / k, i % k).to_bits(),
                    b.to_bits(),
                    "{kind:?} value {i}"
                );
            }
        }
    }
}
