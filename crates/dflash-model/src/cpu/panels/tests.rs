//! The panels' tests: packing, every kernel against a reference or its scalar twin, the same
//! bits alone and in a block, on every ISA.

use super::*;
use crate::cpu::q8;
use crate::cpu::quant::{QuantBlocks, QuantKind};

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
