//! Attention of a few query rows on the CPU (f32 inference: an AR step, a chain's or a tree's
//! verify), each row over its own visible keys, packed into one list.
//!
//! candle's path multiplies every query by every cache key (two general matmuls, a masked
//! softmax over all columns), most of which a tree's rows do not see. Here each (query head,
//! row) gets the scores of its visible keys only, in key order, then their max, `exp`, sum and
//! `Σ eⱼ vⱼ / Σ eⱼ` over that same list; a job is a block of such rows of one K/V head, which
//! read each key once.
//!
//! A row's result depends only on its query and the values of its visible keys in order, not
//! on where they sit in the cache nor on the other rows: a tree node at depth 2 over cache 37
//! (parent at column 37, itself at 39, a sibling of the parent at 38) sees keys
//! `0..38, 39` — the same 39 K/V rows, in the same order, as the AR step that decodes the same
//! tokens at columns `0..39` — so the verify row and the AR step get bit-identical outputs
//! (with [`crate::cpu::panels`] for the projections, a whole forward does; `tests/` check it).
//!
//! Example: `q` `[1, 9, 9, 64]` (SmolLM2, 9 tree rows), `k, v` `[1, 3, 521, 64]` → 81 jobs, each
//! a dot product with ≤ 521 keys, the three query heads of a K/V head reading the same keys.

use std::ops::Range;

use candle_core::{DType, Device, Result, Storage, Tensor};
use dflash_core::visibility::Visibility;

use crate::cpu::panels::{SyncPtr, INLINE_FMAS};
use crate::layers::attention::matmul_operand;

/// The most query rows a forward sends through here: above it (a prefill) the matmuls win.
pub const MAX_ROWS: usize = 64;

/// Each query row's visible key columns as runs ([`Visibility::row_runs`]).
#[derive(Debug, Clone)]
pub struct KeyRuns {
    rows: Vec<Vec<Range<usize>>>,
    /// Key columns of the visibility they came from.
    pub cols: usize,
}

impl KeyRuns {
    pub fn new(v: &Visibility) -> Self {
        Self::from_masks(std::slice::from_ref(v))
    }

    /// Several sequences' rows, sequence-major, from each one's visibility over the same
    /// columns.
    pub fn from_masks(masks: &[Visibility]) -> Self {
        Self {
            rows: masks
                .iter()
                .flat_map(|v| (0..v.rows).map(|r| v.row_runs(r)))
                .collect(),
            cols: masks.first().map_or(0, |v| v.cols),
        }
    }

    /// Several sequences' rows, each one interval of keys (`rows[s][r]`, sequence-major), over
    /// `cols` columns of their caches. Example: two AR steps over a 41-column batched cache →
    /// rows `[28..41]` and `[10..41]`.
    pub fn from_intervals(rows: &[Vec<Range<usize>>], cols: usize) -> Self {
        Self {
            rows: rows.iter().flatten().map(|r| vec![r.clone()]).collect(),
            cols,
        }
    }

    /// Sequence `s`'s `n` rows.
    fn sequence(&self, s: usize, n: usize) -> Self {
        Self {
            rows: self.rows[s * n..(s + 1) * n].to_vec(),
            cols: self.cols,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows.len()
    }
}

/// Whether forwards of `b` sequences × `n` rows on `device` in `dtype` attend here (CPU, f32,
/// at most [`MAX_ROWS`] rows per sequence, AVX-512F or AVX2 + FMA: [`Isa`]): callers build
/// [`KeyRuns`] only then. Several sequences (batched decoding) attend one after the other, each
/// row over its own keys, so a sequence gets the bits it gets alone.
pub fn serves(device: &Device, dtype: DType, b: usize, n: usize) -> bool {
    matches!(device, Device::Cpu)
        && dtype == DType::F32
        && b >= 1
        && n <= MAX_ROWS
        && Isa::detect().is_some()
}

/// Whether [`attend_rows`] runs `q` (`[b, hq, n, d]`): [`serves`] its forward, `d` a multiple
/// of 16 up to 128, no graph.
pub fn applies(q: &Tensor) -> bool {
    let Ok((b, _, n, d)) = q.dims4() else {
        return false;
    };
    serves(q.device(), q.dtype(), b, n) && d % 16 == 0 && (16..=128).contains(&d) && !q.track_op()
}

/// `q` `[b, hq, n, d]`, `k, v` `[b, hkv, t, d]` (rows of `d` adjacent values, e.g. a cache's
/// narrowed buffer), row `r` of sequence `s` seeing the keys `keys.rows[s · n + r]` →
/// `[b, n, hq · d]`, query head `h` reading K/V head `h / (hq / hkv)`; sequences one after the
/// other. Callers check [`applies`].
pub fn attend_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keys: &KeyRuns,
    scale: f64,
) -> Result<Tensor> {
    let Some(isa) = Isa::detect() else {
        candle_core::bail!("attend_rows: no vector ISA");
    };
    let (b, n) = (q.dim(0)?, q.dim(2)?);
    if b == 1 {
        return attend_rows_on(isa, q, k, v, keys, scale);
    }
    if keys.rows() != b * n {
        candle_core::bail!(
            "attend_rows: key runs for {} rows, {b} × {n} asked",
            keys.rows()
        );
    }
    let outs = (0..b)
        .map(|s| {
            let one = |x: &Tensor| x.narrow(0, s, 1);
            attend_rows_on(
                isa,
                &one(q)?,
                &one(k)?,
                &one(v)?,
                &keys.sequence(s, n),
                scale,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&outs, 0)
}

/// [`attend_rows`] on the kernels of `isa` (one of [`Isa::available`]).
pub fn attend_rows_on(
    isa: Isa,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keys: &KeyRuns,
    scale: f64,
) -> Result<Tensor> {
    if !Isa::available().contains(&isa) {
        candle_core::bail!("attend_rows: this CPU does not run {isa:?}");
    }
    let (_, hq, n, d) = q.dims4()?;
    let (_, hkv, t, dk) = k.dims4()?;
    if !applies(q) || dk != d || v.dims4()? != (1, hkv, t, d) || hkv == 0 || hq % hkv != 0 {
        candle_core::bail!(
            "attend_rows: q {:?}, k {:?}, v {:?} (f32 CPU, one sequence, ≤ {MAX_ROWS} rows)",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if keys.rows() != n || keys.cols > t {
        candle_core::bail!(
            "attend_rows: key runs for {} rows over {} columns, attention of {n} rows over {t}",
            keys.rows(),
            keys.cols
        );
    }
    let q = q.contiguous()?;
    // a cache's K/V are read in place, anything else (a transposed view) copied
    let (k, v) = (matmul_operand(k)?, matmul_operand(v)?);
    let g = hq / hkv;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(qs), Storage::Cpu(ks), Storage::Cpu(vs)) = (&*qs, &*ks, &*vs) else {
        candle_core::bail!("attend_rows: CPU tensors expected");
    };
    let qv = &qs.as_slice::<f32>()?[ql.start_offset()..][..hq * n * d];
    let kk = Rows::of(ks.as_slice::<f32>()?, kl, d, "k")?;
    let vv = Rows::of(vs.as_slice::<f32>()?, vl, d, "v")?;
    let mut out = vec![0f32; n * hq * d];
    let dst = SyncPtr(out.as_mut_ptr());
    // a job: one K/V head and a block of up to `per` of its g·n (query head, row) pairs,
    // which read each key once
    let per = rows_per_block(d / 16);
    let blocks = (g * n).div_ceil(per);
    let job = |j: usize| {
        let (hk, b) = (j / blocks, j % blocks);
        let o = dst.ptr();
        let pairs: Vec<QueryRow> = (b * per..((b + 1) * per).min(g * n))
            .map(|u| {
                let (h, r) = (hk * g + u / n, u % n);
                QueryRow {
                    q: &qv[(h * n + r) * d..][..d],
                    runs: keys.rows[r].as_slice(),
                    // SAFETY: inside out (n × hq × d); pair (h, r) owns out[r, h·d .. h·d + d]
                    out: unsafe { o.add((r * hq + h) * d) },
                }
            })
            .collect();
        // SAFETY: the CPU runs `isa` (checked above); each pair writes its own d outputs only
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match isa {
                Isa::Avx512 => avx512::block(&pairs, &kk, &vv, hk, scale as f32),
                Isa::Avx2 => avx2::block(&pairs, &kk, &vv, hk, scale as f32),
            }
        };
    };
    let jobs = hkv * blocks;
    if hq * n * t * d < INLINE_FMAS {
        (0..jobs).for_each(job);
    } else {
        crate::cpu::helpers::for_each_chunk(jobs, &job);
    }
    Tensor::from_vec(out, (1, n, hq * d), &Device::Cpu)
}

/// Query rows per block when a row is `c` vectors of 16 (`d = 16 c`): the block's `c` query
/// vectors and `c` accumulators per row stay in registers.
const fn rows_per_block(c: usize) -> usize {
    match c {
        1 | 2 => 8,
        3 | 4 => 4,
        _ => 2,
    }
}

/// One (query head, row) of a block: its query, its visible key runs, where its `d` outputs go.
struct QueryRow<'a> {
    q: &'a [f32],
    runs: &'a [Range<usize>],
    out: *mut f32,
}

/// K or V rows in place: row `j` of head `h` at `data[h · head + j · d ..][..d]`.
struct Rows<'a> {
    data: &'a [f32],
    head: usize,
}

impl<'a> Rows<'a> {
    fn of(s: &'a [f32], l: &candle_core::Layout, d: usize, what: &str) -> Result<Self> {
        let (dims, st) = (l.dims(), l.stride());
        if st[3] != 1 || st[2] != d {
            candle_core::bail!("attend_rows: {what} rows of {d} adjacent values expected");
        }
        let (hkv, t) = (dims[1], dims[2]);
        let end = l.start_offset() + (hkv - 1) * st[1] + t * d;
        if end > s.len() {
            candle_core::bail!("attend_rows: {what} out of its storage");
        }
        Ok(Self {
            data: &s[l.start_offset()..end],
            head: st[1],
        })
    }

    fn row(&self, h: usize, j: usize, d: usize) -> &[f32] {
        &self.data[h * self.head + j * d..][..d]
    }
}

pub use crate::cpu::Isa;

/// The block kernel, written once for both ISAs: expanded inside a module that defines the
/// vector type `V` of `W` lanes and its operations (`zero`, `ld`, `st`, `set1`, `fma`, `add`,
/// `mul`, `max`, `hsum`, `hmax`, `exp`), all compiled for `$feature`.
///
/// `block(pairs, k, v, h, scale)`: a block of (query row, its visible key runs, its `d`
/// outputs) of one K/V head `h`: each row's `out = Σ eᵢ v[keyᵢ] / Σ eᵢ`,
/// `eᵢ = exp(sᵢ − max s)`, `sᵢ = scale · q · k[keyᵢ]` over its visible keys in order (`keyᵢ`:
/// the runs packed).
#[cfg(target_arch = "x86_64")]
macro_rules! block_kernel {
    ($feature:literal) => {
        use super::{rows_per_block as rpb, QueryRow, Rows};

        #[target_feature(enable = $feature)]
        pub unsafe fn block(pairs: &[QueryRow], k: &Rows, v: &Rows, h: usize, scale: f32) {
            let d = pairs[0].q.len();
            // `C` vectors of `W` lanes per row, blocks of rows sized by the 16-lane count
            match d / 16 {
                1 => block_cr::<{ 16 / W }, { rpb(1) }>(pairs, k, v, h, scale),
                2 => block_cr::<{ 32 / W }, { rpb(2) }>(pairs, k, v, h, scale),
                3 => block_cr::<{ 48 / W }, { rpb(3) }>(pairs, k, v, h, scale),
                4 => block_cr::<{ 64 / W }, { rpb(4) }>(pairs, k, v, h, scale),
                5 => block_cr::<{ 80 / W }, { rpb(5) }>(pairs, k, v, h, scale),
                6 => block_cr::<{ 96 / W }, { rpb(6) }>(pairs, k, v, h, scale),
                7 => block_cr::<{ 112 / W }, { rpb(7) }>(pairs, k, v, h, scale),
                8 => block_cr::<{ 128 / W }, { rpb(8) }>(pairs, k, v, h, scale),
                _ => unreachable!("head_dim {d} (applies() admits 16 … 128)"),
            }
        }

        /// [`block`] for `d = W C` and blocks of `R` rows (fewer rows: the last one repeated,
        /// its copies' outputs dropped). Every row's arithmetic is the same whatever the
        /// block: its scores are its own dot products (two accumulators over even and odd
        /// chunks, one fixed horizontal sum), its weighted sum one accumulator per chunk over
        /// its own packed keys in order; the block only shares the loads of the keys that all
        /// rows see from key 0 on.
        #[inline]
        #[target_feature(enable = $feature)]
        unsafe fn block_cr<const C: usize, const R: usize>(
            pairs: &[QueryRow],
            k: &Rows,
            v: &Rows,
            h: usize,
            scale: f32,
        ) {
            let d = C * W;
            let used = pairs.len();
            debug_assert!((1..=R).contains(&used));
            let row = |i: usize| &pairs[i.min(used - 1)];
            // 1. every row's scores over the keys 0 .. cols (the last visible key of any row + 1)
            let cols = (0..used)
                .filter_map(|i| row(i).runs.last().map(|r| r.end))
                .max()
                .unwrap_or(0);
            let mut qv = [[zero(); C]; R];
            for (i, q) in qv.iter_mut().enumerate() {
                for (c, x) in q.iter_mut().enumerate() {
                    *x = ld(row(i).q.as_ptr().add(c * W));
                }
            }
            let mut all = vec![0f32; R * cols];
            for j in 0..cols {
                let kj = k.row(h, j, d).as_ptr();
                let mut kv = [zero(); C];
                for (c, x) in kv.iter_mut().enumerate() {
                    *x = ld(kj.add(c * W));
                }
                for (i, q) in qv.iter().enumerate() {
                    let (mut a0, mut a1) = (zero(), zero());
                    for c in (0..C).step_by(2) {
                        a0 = fma(q[c], kv[c], a0);
                        if c + 1 < C {
                            a1 = fma(q[c + 1], kv[c + 1], a1);
                        }
                    }
                    *all.get_unchecked_mut(i * cols + j) = hsum(add(a0, a1)) * scale;
                }
            }
            // 2. per row: its visible scores packed, max, exp (in place) and 1 / sum
            let mut e: Vec<Vec<f32>> = Vec::with_capacity(R);
            let mut inv = [zero(); R];
            for (i, inv) in inv.iter_mut().enumerate() {
                let runs = row(i).runs;
                let m: usize = runs.iter().map(|r| r.len()).sum();
                let mut s = vec![f32::NEG_INFINITY; m.next_multiple_of(W)];
                let mut p = 0;
                for r in runs {
                    s[p..p + r.len()].copy_from_slice(&all[i * cols + r.start..i * cols + r.end]);
                    p += r.len();
                }
                *inv = softmax_weights(&mut s);
                e.push(s);
            }
            // 3. Σ eᵢ v[keyᵢ]: the keys 0 .. shared that every row sees first, loaded once,
            // then each row's remaining keys
            let shared = (0..used)
                .map(|i| match row(i).runs.first() {
                    Some(r) if r.start == 0 => r.end,
                    _ => 0,
                })
                .min()
                .unwrap_or(0);
            let mut acc = [[zero(); C]; R];
            for j in 0..shared {
                let vj = v.row(h, j, d).as_ptr();
                let mut vv = [zero(); C];
                for (c, x) in vv.iter_mut().enumerate() {
                    *x = ld(vj.add(c * W));
                }
                for (i, a) in acc.iter_mut().enumerate() {
                    let w = set1(*e[i].get_unchecked(j));
                    for c in 0..C {
                        a[c] = fma(w, vv[c], a[c]);
                    }
                }
            }
            for (i, a) in acc.iter_mut().enumerate().take(used) {
                // the row's packed keys from `shared` on: packed key `p` of the run `r` that
                // starts at packed index `at` is column `r.start + p − at`
                let mut at = 0;
                for r in row(i).runs {
                    for p in shared.max(at)..at + r.len() {
                        let (w, vj) = (set1(e[i][p]), v.row(h, r.start + p - at, d).as_ptr());
                        for (c, x) in a.iter_mut().enumerate() {
                            *x = fma(w, ld(vj.add(c * W)), *x);
                        }
                    }
                    at += r.len();
                }
                let out = row(i).out;
                for (c, x) in a.iter().enumerate() {
                    st(out.add(c * W), mul(*x, inv[i]));
                }
            }
        }

        /// Scores (padded with −∞ to a multiple of `W`) → `exp(s − max s)` in place, `W` at
        /// a time from the start; returns `1 / Σ` broadcast (0 for an empty row: its outputs
        /// stay 0).
        #[inline]
        #[target_feature(enable = $feature)]
        unsafe fn softmax_weights(s: &mut [f32]) -> V {
            if s.is_empty() {
                return zero();
            }
            let mut vmax = set1(f32::NEG_INFINITY);
            for c in (0..s.len()).step_by(W) {
                vmax = max(vmax, ld(s.as_ptr().add(c)));
            }
            let vmax = set1(hmax(vmax));
            let mut vsum = zero();
            for c in (0..s.len()).step_by(W) {
                let e = exp(sub(ld(s.as_ptr().add(c)), vmax));
                st(s.as_mut_ptr().add(c), e);
                vsum = add(vsum, e);
            }
            set1(1.0 / hsum(vsum))
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::cpu::vexp::avx512::*;
    block_kernel!("avx512f");
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::cpu::vexp::avx2::*;
    block_kernel!("avx2,fma");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::{attend, mask_tensor};
    use dflash_core::visibility::{causal, tree};

    fn values(shape: (usize, usize, usize, usize), seed: f64) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        Tensor::arange(0f32, n as f32, &Device::Cpu)
            .unwrap()
            .affine(0.37, seed)
            .unwrap()
            .sin()
            .unwrap()
            .reshape(shape)
            .unwrap()
    }

    /// Equals the masked-softmax attention (candle's matmuls) on causal and tree masks, with
    /// grouped heads and K/V read in place from a longer buffer, on every ISA the CPU runs:
    /// head dims of 16 to 128, one row to a 16-row verify over 500 cached keys, tree rows
    /// whose own keys come after the shared ones.
    #[test]
    fn equals_the_masked_attention() {
        for isa in Isa::available() {
            for (cache, v, d) in [
                (0, causal(0, 5), 32),
                (40, causal(40, 1), 32),
                (37, causal(37, 16), 32),
                (37, tree(37, &[None, None, Some(0), Some(2), Some(1)]), 32),
                (3, causal(3, 1), 16),
                (21, causal(21, 9), 48),
                (500, causal(500, 16), 64),
                (9, tree(9, &[None, Some(0), Some(0), Some(1)]), 128),
            ] {
                let (n, t) = (v.rows, v.cols);
                let q = values((1, 6, n, d), 0.1);
                let buf = values((1, 2, t + 7, d), 0.4);
                let k = buf.narrow(2, 0, t).unwrap();
                let vv = values((1, 2, t + 7, d), 0.9).narrow(2, 0, t).unwrap();
                let want = attend(
                    &q,
                    &k,
                    &vv,
                    &mask_tensor(&v, DType::F32, &Device::Cpu).unwrap(),
                    0.125,
                )
                .unwrap();
                let got = attend_rows_on(isa, &q, &k, &vv, &KeyRuns::new(&v), 0.125).unwrap();
                let err = crate::ops::compare::max_abs(&want, &got).unwrap();
                assert!(err < 2e-6, "{isa:?} cache {cache} d {d}: {err}");
            }
        }
    }

    /// A tree row gets the same bits as the row that sees the same keys contiguously (the AR
    /// step of the same tokens), and a verify row among 15 others the bits of that row alone,
    /// on every ISA.
    #[test]
    fn a_row_gets_the_ar_rows_bits() {
        for isa in Isa::available() {
            // tree over cache 20: node 0 (col 20), sibling 1 (col 21), node 2 child of 0 (col 22)
            let tv = tree(20, &[None, None, Some(0)]);
            let k = values((1, 1, 23, 64), 0.2);
            let v = values((1, 1, 23, 64), 0.7);
            let q = values((1, 3, 3, 64), 0.3);
            let got = attend_rows_on(isa, &q, &k, &v, &KeyRuns::new(&tv), 0.125).unwrap();
            // the AR layout: keys 0..20, node 0, node 2 at columns 0..22
            let idx =
                Tensor::new((0u32..21).chain([22]).collect::<Vec<_>>(), &Device::Cpu).unwrap();
            let (ka, va) = (
                k.index_select(&idx, 2).unwrap(),
                v.index_select(&idx, 2).unwrap(),
            );
            let qa = q.narrow(2, 2, 1).unwrap();
            let ar =
                attend_rows_on(isa, &qa, &ka, &va, &KeyRuns::new(&causal(21, 1)), 0.125).unwrap();
            // got [1, 3 rows, 3 heads · 64]: row 2 against the AR step's only row
            let bits = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(got.narrow(1, 2, 1).unwrap()), bits(ar), "{isa:?}");
            // a 16-row verify over a 100-row cache (3 query heads per K/V head: 48 rows in
            // two blocks), row 11 against the AR step at column 111
            let k = values((1, 2, 116, 64), 0.5);
            let v = values((1, 2, 116, 64), 0.6);
            let q = values((1, 6, 16, 64), 0.8);
            let got =
                attend_rows_on(isa, &q, &k, &v, &KeyRuns::new(&causal(100, 16)), 0.125).unwrap();
            let ar = attend_rows_on(
                isa,
                &q.narrow(2, 11, 1).unwrap(),
                &k.narrow(2, 0, 112).unwrap(),
                &v.narrow(2, 0, 112).unwrap(),
                &KeyRuns::new(&causal(111, 1)),
                0.125,
            )
            .unwrap();
            assert_eq!(bits(got.narrow(1, 11, 1).unwrap()), bits(ar), "{isa:?}");
        }
    }
}
