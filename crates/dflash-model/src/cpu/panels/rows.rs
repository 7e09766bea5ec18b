//! Reading rows back out of the panels: a subset of rows as panels of their own, one row's
//! values, the whole weight.

use super::{
    PanelData, Panels, QuantByte, PANEL, Q4K_PANEL_BLOCK, Q4_1_PANEL_BLOCK, Q6K_PANEL_BLOCK, Q80,
    Q8_0_PANEL_BLOCK,
};
use crate::cpu::quant::QBLOCK;

impl Panels {
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
}

/// A quantized panel's bytes as `u8`.
fn as_bytes<T: QuantByte>(d: &[T]) -> &[u8] {
    // SAFETY: every QuantByte is a `#[repr(transparent)]` u8
    unsafe { std::slice::from_raw_parts(d.as_ptr() as *const u8, d.len()) }
}
