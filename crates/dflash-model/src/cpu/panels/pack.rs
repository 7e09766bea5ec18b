//! Re-laying a weight as panels: from f32 rows, from a GGUF weight's quantized blocks (the exact
//! products' layouts), or for the integer products.

use super::{
    PanelData, Panels, Q4Kb, Q6Kb, PANEL, Q41, Q4K_PANEL_BLOCK, Q4_1_PANEL_BLOCK, Q6K_PANEL_BLOCK,
    Q80, Q8_0_PANEL_BLOCK,
};
use crate::cpu::q8::{self, IntKind};
use crate::cpu::quant::{QuantBlocks, QuantKind, QBLOCK};

impl Panels {
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
