//! An LM head's integer products that keep the exact products' arg-max
//! (`--cpu-products q8`): every logit comes from the 8-bit rows ([`crate::cpu::q8`]), then
//! the columns that could be a row's largest exact logit are recomputed exactly, so a row's
//! arg-max — the token at T = 0 — is the exact products' own, bit for bit.
//!
//! **The bound.** For a row `x` quantized per block `b` of 32 steps with scale `dₓ,b`
//! (`|x − dₓ q| ≤ 0.501 dₓ` per step, `|x| ≤ 127 dₓ`) and a signed weight column of scale
//! `d_b` and values `w` (Q8_0, Q4_0, Q5_0), the integer logit `z̃` and the exact products'
//! f32 logit `z` (an FMA chain over the `k` steps of `x · (w · d)`,
//! [`crate::cpu::panels`]) differ by at most
//! `F · Σ_b |d_b| A_b dₓ,b ≤ F · T · Σ_b dₓ,b = B`, where `A_b = Σ |w|` over the block,
//! `T = max_b |d_b| A_b` (the column's bound, made once at load: [`column_bounds`]) and
//! `F = 0.501 + 127.1 (γ_k + γ_{k/32 + 1} + 2u)` (`u = 2⁻²⁴`, `γ_n = n u / (1 − n u)`: the
//! two f32 sums' rounding). A column can hold the row's largest exact logit only if
//! `z̃ + B ≥ max_c (z̃_c − B_c)`; those columns get their exact logit ([`exact_column`]), the
//! others keep `z̃` (below the largest exact logit by construction). A row whose quantization
//! or logits are not finite gets every column exactly.
//!
//! Each row's logits depend only on that row (its quantization, its bound, its candidates), so
//! an AR step and a verify row get the same bits, as everywhere on the CPU.
//!
//! Example (SmolLM2's tied Q8_0 head, 49,152 columns, `k` = 576, `F` ≈ 0.506): a verify row
//! whose bounds `B` are ≈ 0.2 logits and whose best integer logit leads by 1.5 has one
//! candidate, recomputed in 576 FMAs; the other 49,151 logits stay within 0.2 of the exact ones.

use crate::cpu::q8::{IntKind, Q8Rows, QB};
use crate::cpu::quant::{QuantBlocks, QuantKind};

/// Each column's bound `T = max_b |d_b| Σ |w|` over its 32-step blocks (see the module doc), for
/// a signed kind (Q8_0, Q4_0, Q5_0); `None` for another kind or a scale that is not finite.
pub fn column_bounds(q: &QuantBlocks) -> Option<Vec<f32>> {
    if !matches!(q.kind, QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0) {
        return None;
    }
    let (bytes, blocks) = (q.kind.block_bytes(), q.k / QB);
    (0..q.n)
        .map(|c| {
            let mut t = 0f32;
            for b in 0..blocks {
                let (d, v) = q
                    .kind
                    .signed_block(&q.bytes[(c * blocks + b) * bytes..][..bytes]);
                let d = half::f16::from_le_bytes(d).to_f32().abs();
                let a: i32 = v.iter().map(|&x| (x as i32).abs()).sum();
                t = t.max(d * a as f32);
            }
            t.is_finite().then_some(t)
        })
        .collect()
}

/// `F` of the module doc for rows of `k` steps, raised by 0.1 % for the f32 rounding of `B`
/// itself.
fn factor(k: usize) -> f32 {
    let u = 2f64.powi(-24);
    let gamma = |n: usize| n as f64 * u / (1.0 - n as f64 * u);
    ((0.501 + 127.1 * (gamma(k) + gamma(k / QB + 1) + 2.0 * u)) * 1.001) as f32
}

/// The exact products' logit of column `c` for one row `x` (`k` steps) from a signed integer
/// panel (`panel`: the column's panel, `k / 32` blocks of [`IntKind::Signed`]): the FMA chain
/// `acc = x_j · (w_j · d) + acc` over the steps in order, as the exact kernels compute it.
pub fn exact_column(panel: &[u8], c: usize, x: &[f32]) -> f32 {
    let mut out = [0f32; 1];
    exact_columns::<1>([panel], [c], x, &mut out);
    out[0]
}

/// [`exact_column`] of `N` columns at once (`panels[i]`, column `cols[i]` of it): `N`
/// independent chains, which the CPU overlaps.
#[inline(always)]
fn exact_columns<const N: usize>(
    panels: [&[u8]; N],
    cols: [usize; N],
    x: &[f32],
    out: &mut [f32; N],
) {
    let per = IntKind::Signed.block_bytes();
    let scales = IntKind::Signed.scale_bytes();
    let mut acc = [0f32; N];
    for (b, xb) in x.chunks_exact(QB).enumerate() {
        let blk: [&[u8]; N] = std::array::from_fn(|i| &panels[i][b * per..][..per]);
        let d: [f32; N] = std::array::from_fn(|i| {
            half::f16::from_le_bytes([blk[i][2 * cols[i]], blk[i][2 * cols[i] + 1]]).to_f32()
        });
        for (j, &xj) in xb.iter().enumerate() {
            // step j of column c: byte 4c + j % 4 of group j / 4, the value + 128
            let at = scales + (j / 4) * 64 + j % 4;
            for i in 0..N {
                let w = (blk[i][at + 4 * cols[i]] as i32 - 128) as f32 * d[i];
                acc[i] = xj.mul_add(w, acc[i]);
            }
        }
    }
    *out = acc;
}

/// Rows `y` (`rows × n` integer logits, rewritten in place) settled as the module doc says:
/// `a` the rows' quantization, `x` the rows, `bounds` the columns' [`column_bounds`],
/// `panel(c)` the integer panel of column `c` and its column in it. Rows in parallel (each
/// row's work is its own).
pub fn settle<'p>(
    y: &mut [f32],
    a: &Q8Rows,
    x: &[f32],
    bounds: &[f32],
    panel: &(dyn Fn(usize) -> (&'p [u8], usize) + Sync),
) {
    let (n, k) = (bounds.len(), a.k);
    let rows = y.len().checked_div(n).unwrap_or(0);
    let out = crate::cpu::panels::SyncPtr(y.as_mut_ptr());
    // read on this thread: the helpers run the caller's ISA (`Isa::with` is per thread)
    let isa = crate::cpu::Isa::detect();
    let row = |r: usize| {
        // SAFETY: row r's n logits are this call's alone
        let yr = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(r * n), n) };
        let (dx, xr) = (&a.d[r * (k / QB)..][..k / QB], &x[r * k..][..k]);
        settle_row_on(isa, yr, dx, xr, bounds, panel);
    };
    if rows > 1 {
        crate::cpu::helpers::for_each_chunk(rows, &row);
    } else {
        (0..rows).for_each(row);
    }
}

/// [`settle_row`] compiled for `isa` (its FMAs in instructions, not calls).
fn settle_row_on<'p>(
    isa: Option<crate::cpu::Isa>,
    yr: &mut [f32],
    dx: &[f32],
    xr: &[f32],
    bounds: &[f32],
    panel: &(dyn Fn(usize) -> (&'p [u8], usize) + Sync),
) {
    #[cfg(target_arch = "x86_64")]
    {
        /// `settle_row` compiled with the features `$f`.
        macro_rules! compiled_for {
            ($name:ident, $f:literal) => {
                #[target_feature(enable = $f)]
                unsafe fn $name<'p>(
                    yr: &mut [f32],
                    dx: &[f32],
                    xr: &[f32],
                    b: &[f32],
                    p: &(dyn Fn(usize) -> (&'p [u8], usize) + Sync),
                ) {
                    settle_row(yr, dx, xr, b, p)
                }
            };
        }
        compiled_for!(avx512, "avx512f,fma");
        compiled_for!(avx2, "avx2,fma");
        // SAFETY: the CPU runs the ISA detected (an AVX-512F CPU has FMA; `Isa::available`
        // checks it for AVX2)
        match isa {
            Some(crate::cpu::Isa::Avx512) => return unsafe { avx512(yr, dx, xr, bounds, panel) },
            Some(crate::cpu::Isa::Avx2) => return unsafe { avx2(yr, dx, xr, bounds, panel) },
            None => {}
        }
    }
    settle_row(yr, dx, xr, bounds, panel)
}

/// One row of [`settle`]: `dx` its blocks' scales. The same bits on every ISA (IEEE f32
/// operations; `mul_add` rounds once wherever it runs).
#[inline(always)]
fn settle_row<'p>(
    yr: &mut [f32],
    dx: &[f32],
    xr: &[f32],
    bounds: &[f32],
    panel: &(dyn Fn(usize) -> (&'p [u8], usize) + Sync),
) {
    let n = yr.len();
    let dsum: f32 = dx.iter().sum();
    // column c's bound is fb · bounds[c], with room for the rounding of z̃ ± B
    let fb = factor(xr.len()) * dsum * 1.0001;
    let bound = |t: f32, z: f32| fb * t + 1e-6 * z.abs() + f32::MIN_POSITIVE;
    let (lo, hi) = (
        |c: usize| yr[c] - bound(bounds[c], yr[c]),
        |c: usize| yr[c] + bound(bounds[c], yr[c]),
    );
    let max = |m: f32, v: f32| if v > m { v } else { m };
    // one pass, 16 columns at a time: the running max of z̃ − B (lane-wise, then per chunk),
    // and the columns whose z̃ + B reaches the running max so far — a superset of those that
    // reach the final one, which only grows (kept below); non-finite values noted
    let (mut lanes, mut floor, mut finite) =
        ([f32::NEG_INFINITY; 16], f32::NEG_INFINITY, dsum.is_finite());
    let mut maybe = Vec::new();
    for (i, (z, t)) in yr.chunks_exact(16).zip(bounds.chunks_exact(16)).enumerate() {
        let (mut reach, mut ok) = (false, true);
        for l in 0..16 {
            let b = bound(t[l], z[l]);
            lanes[l] = max(lanes[l], z[l] - b);
            reach |= z[l] + b >= floor;
            ok &= z[l].is_finite();
        }
        finite &= ok;
        if reach {
            floor = lanes.iter().copied().fold(floor, max);
            maybe.extend((16 * i..16 * i + 16).filter(|&c| hi(c) >= floor));
        }
    }
    let tail = n - n % 16..n;
    finite &= tail.clone().all(|c| yr[c].is_finite());
    let floor = tail.clone().map(lo).chain(lanes).fold(floor, max);
    maybe.extend(tail);
    let candidates: Vec<usize> = match finite {
        true => maybe.into_iter().filter(|&c| hi(c) >= floor).collect(),
        false => (0..n).collect(),
    };
    for group in candidates.chunks(8) {
        let at = |i: usize| group[i.min(group.len() - 1)];
        let mut v = [0f32; 8];
        let cols: [(&[u8], usize); 8] = std::array::from_fn(|i| panel(at(i)));
        exact_columns::<8>(cols.map(|c| c.0), cols.map(|c| c.1), xr, &mut v);
        for (i, &c) in group.iter().enumerate() {
            yr[c] = v[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::panels::tests::values as uniform;
    use crate::cpu::panels::Panels;
    use crate::cpu::Isa;
    use dflash_core::sampling::argmax;

    /// A Q8_0 head `[n, k]` of 4 near-copies of each base column (one weight of a copy moved by
    /// a few thousandths): exact logits a hair apart, which 8-bit rows can reorder.
    fn near_tied_head(n: usize, k: usize) -> QuantBlocks {
        let base = uniform(n / 4 * k, 7);
        let mut w = Vec::with_capacity(n * k);
        for c in 0..n {
            let mut col = base[c / 4 * k..][..k].to_vec();
            col[(c * 37) % k] += 0.004 * (c % 4) as f32;
            w.extend(col);
        }
        QuantBlocks::quantize_q8_0(&w, n, k)
    }

    /// Rows with a few large values, as the hidden states before an LM head have.
    fn rows(rows: usize, k: usize, seed: u32) -> Vec<f32> {
        let mut x = uniform(rows * k, seed);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 41 == 3 {
                *v *= 12.0;
            }
        }
        x
    }

    /// [`exact_column`] from the integer panels equals the exact kernels' product of every
    /// column bit for bit, on every ISA.
    #[test]
    fn exact_column_is_the_exact_kernels_column() {
        let (n, k, r) = (37, 96, 5);
        let q = near_tied_head(40, k);
        let q = QuantBlocks::new(q.kind, n, k, q.bytes[..n * k / QB * 34].to_vec()).unwrap();
        let x = rows(r, k, 3);
        let int = Panels::pack_integer(&q);
        let (_, bytes) = int.int_bytes().unwrap();
        let len = k / QB * IntKind::Signed.block_bytes();
        for isa in Isa::available() {
            let exact = Panels::pack_exact(&q).matmul_on(isa, &x, r);
            for row in 0..r {
                for c in 0..n {
                    let got =
                        exact_column(&bytes[c / 16 * len..][..len], c % 16, &x[row * k..][..k]);
                    assert_eq!(
                        got.to_bits(),
                        exact[row * n + c].to_bits(),
                        "{isa:?} row {row} col {c}"
                    );
                }
            }
        }
    }

    /// The screened head's arg-max is the exact products' on every row (where the integer
    /// products alone pick another column on some), each logit is the exact one or the integer
    /// one, a row alone gets the bits it gets among others, and a row with a NaN gets the exact
    /// products' NaNs.
    #[test]
    fn a_screened_head_keeps_the_exact_arg_max() {
        let (n, k, r) = (252, 128, 48);
        let q = near_tied_head(n, k);
        let mut x = rows(r, k, 11);
        x[(r - 1) * k + 5] = f32::NAN;
        let screened = Panels::pack_screened(&q).unwrap();
        assert!(screened.is_screened());
        for isa in Isa::available() {
            let exact = Panels::pack_exact(&q).matmul_on(isa, &x, r);
            let int = Panels::pack_integer(&q).matmul_on(isa, &x, r);
            let got = screened.matmul_on(isa, &x, r);
            let mut flips = 0;
            for row in 0..r - 1 {
                let (e, i, g) = (
                    &exact[row * n..][..n],
                    &int[row * n..][..n],
                    &got[row * n..][..n],
                );
                assert_eq!(argmax(g), argmax(e), "{isa:?} row {row}");
                flips += usize::from(argmax(i) != argmax(e));
                for c in 0..n {
                    assert!(
                        g[c].to_bits() == e[c].to_bits() || g[c].to_bits() == i[c].to_bits(),
                        "{isa:?} row {row} col {c}: {} (exact {}, integer {})",
                        g[c],
                        e[c],
                        i[c]
                    );
                }
                let alone = screened.matmul_on(isa, &x[row * k..][..k], 1);
                assert_eq!(alone, g.to_vec(), "{isa:?} row {row} alone");
            }
            assert!(
                flips > 0,
                "{isa:?}: the integer products alone keep every arg-max here"
            );
            let last = (r - 1) * n;
            assert!((0..n).all(|c| got[last + c].is_nan() == exact[last + c].is_nan()));
        }
    }

    /// A head of another kind, or with a scale that is not finite, is not screened.
    #[test]
    fn only_finite_signed_heads_are_screened() {
        let q = near_tied_head(32, 64);
        assert!(column_bounds(&q).is_some_and(|b| b.iter().all(|t| *t > 0.0)));
        let mut bad = q.bytes.clone();
        bad[0..2].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
        let bad = QuantBlocks::new(QuantKind::Q8_0, 32, 64, bad).unwrap();
        assert!(column_bounds(&bad).is_none() && Panels::pack_screened(&bad).is_none());
    }
}
