//! The drafter's training attention: many blocks of one training row at once, each query row
//! seeing its context keys (the draft rule: keys strictly before its anchor, of its own
//! sequence) and its own block, never the other blocks. Rows are grouped into windows
//! ([`window_bounds`]) that score only the context keys their rows may see; scale, mask and
//! softmax run fused ([`crate::ops::block_softmax`]), and the backward is written out. This is
//! the path on the CPU and in f32, and the twin of the tensor-core kernels that take bf16 on a
//! GPU ([`crate::ops::train_attention`]).
//! Example: anchors 37 and 90 of one sequence, B = 16 → block 0's rows (positions 37..52) see
//! context keys 0..37 and block 0; block 1's rows (90..105) see 0..90 and block 1.

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};
use dflash_core::visibility::Visibility;

use crate::ops::block_softmax::{block_softmax, block_softmax_bwd, BlockGeometry, Intervals};
use crate::ops::permute::{contiguous, permuted};
use crate::ops::with_grad::{with_grad3, Grad3};

/// One window of the training layout: the block rows `rows` (whole blocks) score only the
/// context keys `keys`, which hold every context key any of those rows may see; `intervals`
/// are the rule inside the window (each row's visible context keys, window-local, and its
/// visible own-block columns). Example: a packed row with segments [0..400, 400..900] and
/// anchors in both → the first segment's blocks get keys 0..(its last anchor), the second's
/// 400..(its last anchor), each widened to a multiple of [`KEY_ALIGN`] keys: no row sees the
/// other sequence or keys at or after its anchor (the intervals hide the few widened keys).
pub struct ContextWindow {
    pub rows: Range<usize>,
    pub keys: Range<usize>,
    pub intervals: Intervals,
}

/// The rows and keys of the windows of a training layout: blocks grouped by `group_of_block`
/// (their sequence in a packed row), each window's keys the union of its rows' context ranges
/// (`ranges[row]`, from the draft rule), a window grown block by block while its rows × keys
/// stay within `max_cells` (at least one block). Few large windows launch few kernels (the GPU's
/// cost); many small ones skip more hidden cells (keys at or after a window's last anchor).
/// Example: B = 2, ranges [0..3, 0..3, 0..5, 0..5, 6..9, 6..9], groups [0, 0, 1]: unbounded →
/// windows rows 0..4 keys 0..5, rows 4..6 keys 6..9; `max_cells` 0 → one block per window.
pub fn window_bounds(
    ranges: &[Range<usize>],
    block: usize,
    group_of_block: &[usize],
    max_cells: usize,
) -> Vec<(Range<usize>, Range<usize>)> {
    // the key span of some rows: (min start of the non-empty ranges, max end)
    let grow = |(lo, hi): (usize, usize), rows: Range<usize>| {
        ranges[rows].iter().fold((lo, hi), |(lo, hi), r| {
            (
                if r.is_empty() { lo } else { lo.min(r.start) },
                hi.max(r.end),
            )
        })
    };
    let keys = |(lo, hi): (usize, usize)| if lo < hi { lo..hi } else { 0..0 };
    let mut out = Vec::new();
    let mut j = 0;
    while j < group_of_block.len() {
        let mut span = grow((usize::MAX, 0), j * block..(j + 1) * block);
        let mut e = j + 1;
        while e < group_of_block.len() && group_of_block[e] == group_of_block[j] {
            let wider = grow(span, e * block..(e + 1) * block);
            if ((e + 1 - j) * block).saturating_mul(keys(wider).len()) > max_cells {
                break;
            }
            span = wider;
            e += 1;
        }
        out.push((j * block..e * block, keys(span)));
        j = e;
    }
    out
}

/// Key spans are widened to a multiple of this many keys: the score matrices' rows then start
/// 16-byte aligned in bf16, which cuBLAS's fast tensor-core GEMMs need (an unaligned window,
/// e.g. 1,037 keys, falls back to a much slower kernel).
pub const KEY_ALIGN: usize = 8;

/// `keys` widened to a multiple of [`KEY_ALIGN`] keys inside `0..context` (upward first, then
/// downward; as it is when `context` is too short). The extra keys are hidden from every row by
/// the window's intervals. Example: context 2,048: 0..1037 → 0..1040, 2043..2047 → 2040..2048;
/// context 5: 0..3 → 0..5.
pub fn aligned_keys(keys: Range<usize>, context: usize) -> Range<usize> {
    if keys.is_empty() || keys.end > context {
        return keys;
    }
    let want = keys.len().next_multiple_of(KEY_ALIGN).min(context);
    let end = (keys.start + want).min(context);
    end - want..end
}

/// The [`ContextWindow`]s of a training layout ([`window_bounds`], key spans widened by
/// [`aligned_keys`] within the `context` keys) with the rule's intervals: `ranges[row]` the
/// context keys row `row` sees, `own` (`[rows, block]`) the own-block columns (one interval
/// per row, as every draft rule makes them).
pub fn context_windows(
    ranges: &[Range<usize>],
    own: &Visibility,
    block: usize,
    group_of_block: &[usize],
    max_cells: usize,
    context: usize,
    device: &Device,
) -> Result<Vec<ContextWindow>> {
    let own: Vec<Range<usize>> = (0..own.rows)
        .map(|r| {
            own.row_interval(r).ok_or_else(|| {
                candle_core::Error::Msg(format!("own-block row {r} is not one interval"))
            })
        })
        .collect::<Result<_>>()?;
    window_bounds(ranges, block, group_of_block, max_cells)
        .into_iter()
        .map(|(rows, keys)| {
            let keys = aligned_keys(keys, context);
            let local: Vec<Range<usize>> = ranges[rows.clone()]
                .iter()
                .map(|r| {
                    if r.is_empty() {
                        0..0
                    } else {
                        r.start - keys.start..r.end - keys.start
                    }
                })
                .collect();
            let intervals = Intervals::new(&local, &own[rows.clone()], device)?;
            Ok(ContextWindow {
                rows,
                keys,
                intervals,
            })
        })
        .collect()
}

/// Masked attention for the training layout, without the always-hidden cells: each of the
/// `R = nb · block` query rows sees context keys (through its [`ContextWindow`]) and keys of
/// its own block, one softmax over both ([`crate::ops::block_softmax`]: scale, mask and softmax in
/// one pass). Equal to [`attend`] over `[context | all blocks]` with the dense training mask,
/// at `O(Σ window rows · window keys + R · block)` memory and work instead of `O(R · (m + R))`.
/// The backward is written out (matmuls and the fused softmax backward over the saved
/// probabilities), not traced op by op.
/// `q: [1, hq, R, d]`, `k, v: [1, hkv, m + R, d]` (the `m` context rows, then the block rows)
/// → `[1, R, hq·d]`.
pub fn attend_blocks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    m: usize,
    windows: &[ContextWindow],
    block: usize,
    scale: f64,
) -> Result<Tensor> {
    let (y, bwd) = attend_blocks_saving(q, k, v, m, windows, block, scale)?;
    with_grad3(q, k, v, y, "block-attention", bwd)
}

/// [`attend_blocks`]'s value and its written backward `dO ↦ (dq, dk, dv)`, the windows'
/// operands and probabilities kept for it; no graph is attached (the drafter's taped backward
/// calls it).
pub fn attend_blocks_saving(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    m: usize,
    windows: &[ContextWindow],
    block: usize,
    scale: f64,
) -> Result<(Tensor, Grad3)> {
    let (b, hq, r, d) = q.dims4()?;
    let (_, hkv, t, _) = k.dims4()?;
    let covered: usize = windows.iter().map(|w| w.rows.len()).sum();
    if b != 1 || t != m + r || covered != r || windows.iter().any(|w| w.rows.len() % block != 0) {
        candle_core::bail!(
            "attend_blocks: batch 1, {m} context + {r} block keys and windows covering the {r} rows in whole blocks expected"
        );
    }
    let g = hq / hkv;
    // [hkv, g, R, d] and [hkv, m + R, d], without a graph
    let qd = contiguous(&q.detach())?.reshape((hkv, g, r, d))?;
    let kd = contiguous(&k.detach())?.squeeze(0)?;
    let vd = contiguous(&v.detach())?.squeeze(0)?;
    // each window's operands and probabilities, kept for the backward
    let mut outs = Vec::with_capacity(windows.len());
    let mut saved = Vec::with_capacity(windows.len());
    for w in windows {
        let win = Window::new(&qd, &kd, &vd, m, w, block, scale)?;
        let (o, p) = win.forward(&w.intervals)?;
        outs.push(o);
        saved.push((win, p));
    }
    let o = cat_rows(&outs)?; // [hkv, g, R, d]
    let y = permuted(&o.reshape((1, hq, r, d))?, &[0, 2, 1, 3])?.reshape((1, r, hq * d))?;
    let (dtype, device) = (qd.dtype(), qd.device().clone());
    let bwd = move |grad: &Tensor| {
        // dO [1, R, hq·d] → [hkv, g, R, d]
        let dout =
            permuted(&grad.reshape((1, r, hq, d))?, &[0, 2, 1, 3])?.reshape((hkv, g, r, d))?;
        let (mut dq, mut dk_blk, mut dv_blk) = (Vec::new(), Vec::new(), Vec::new());
        let dk_ctx = Tensor::zeros((hkv, m, d), DType::F32, &device)?;
        let dv_ctx = Tensor::zeros((hkv, m, d), DType::F32, &device)?;
        for (w, p) in &saved {
            let (rows, keys) = (&w.rows, &w.keys);
            let gr = w.backward(&dout.narrow(2, rows.start, rows.len())?, p)?;
            dq.push(gr.dq);
            dk_blk.push(gr.dk_blk);
            dv_blk.push(gr.dv_blk);
            if let (Some(dk), Some(dv)) = (gr.dk_ctx, gr.dv_ctx) {
                add_rows(&dk_ctx, &dk, keys)?;
                add_rows(&dv_ctx, &dv, keys)?;
            }
        }
        let dq = cat_rows(&dq)?.reshape((1, hq, r, d))?;
        let dk = Tensor::cat(&[&dk_ctx.to_dtype(dtype)?, &Tensor::cat(&dk_blk, 1)?], 1)?;
        let dv = Tensor::cat(&[&dv_ctx.to_dtype(dtype)?, &Tensor::cat(&dv_blk, 1)?], 1)?;
        Ok((dq, dk.unsqueeze(0)?, dv.unsqueeze(0)?))
    };
    Ok((y, Box::new(bwd)))
}

/// `[hkv, g, rows_i, d]` pieces along the rows.
fn cat_rows(parts: &[Tensor]) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts[0].clone());
    }
    Tensor::cat(parts, 2)
}

/// `acc [hkv, m, d]` (f32, fresh: no other tensor shares it) plus `part [hkv, keys.len(), d]`
/// at rows `keys`, in place: one add and one strided copy.
fn add_rows(acc: &Tensor, part: &Tensor, keys: &Range<usize>) -> Result<()> {
    let sum = (acc.narrow(1, keys.start, keys.len())? + part.to_dtype(DType::F32)?)?;
    acc.slice_set(&sum, 1, keys.start)
}

/// One window's operands: `q [hkv, g·rows, d]` (rows in head-major order), its context keys
/// and values `[hkv, keys, d]`, and its blocks' queries, keys and values in the batched
/// per-block layout `[hkv·nbw, g·block, d]` / `[hkv·nbw, block, d]`; built once, used by the
/// forward and kept for the backward.
struct Window {
    rows: Range<usize>,
    keys: Range<usize>,
    q: Tensor,
    qb: Tensor,
    kc: Option<Tensor>,
    vc: Option<Tensor>,
    kb: Tensor,
    vb: Tensor,
    geo: BlockGeometry,
}

struct WindowGrads {
    dq: Tensor,
    dk_ctx: Option<Tensor>,
    dv_ctx: Option<Tensor>,
    dk_blk: Tensor,
    dv_blk: Tensor,
}

impl Window {
    /// The operands of window `w` from `q [hkv, g, R, d]` and `k, v [hkv, m + R, d]`.
    fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        m: usize,
        w: &ContextWindow,
        block: usize,
        scale: f64,
    ) -> Result<Self> {
        let (rows, keys) = (w.rows.clone(), w.keys.clone());
        let (hkv, g, _, d) = q.dims4()?;
        let rn = rows.len();
        let nbw = rn / block;
        let q = contiguous(&q.narrow(2, rows.start, rn)?)?; // [hkv, g, rn, d]
        let qb = per_block(&q, block)?;
        let (kc, vc) = if keys.is_empty() {
            (None, None)
        } else {
            // read in place by the matmuls (rows of d adjacent values, heads at one stride)
            let part = |t: &Tensor| t.narrow(1, keys.start, keys.len());
            (Some(part(k)?), Some(part(v)?))
        };
        let blk = |t: &Tensor| {
            contiguous(&t.narrow(1, m + rows.start, rn)?)?.reshape((hkv * nbw, block, d))
        };
        let geo = BlockGeometry {
            hkv,
            g,
            rows: rn,
            keys: keys.len(),
            block,
            scale,
        };
        Ok(Self {
            q: q.reshape((hkv, g * rn, d))?,
            kb: blk(k)?,
            vb: blk(v)?,
            rows,
            keys,
            qb,
            kc,
            vc,
            geo,
        })
    }

    /// The probabilities' two parts as matmul operands: `[hkv, g·rows, keys]`, `[hkv·nbw, g·block, block]`.
    fn parts(&self, flat: &Tensor) -> Result<(Tensor, Tensor)> {
        let BlockGeometry {
            hkv,
            g,
            rows,
            keys,
            block,
            ..
        } = self.geo;
        let n_ctx = self.geo.n_ctx();
        Ok((
            flat.narrow(0, 0, n_ctx)?.reshape((hkv, g * rows, keys))?,
            flat.narrow(0, n_ctx, self.geo.n_blk())?.reshape((
                hkv * (rows / block),
                g * block,
                block,
            ))?,
        ))
    }

    /// `O [hkv, g, rows, d]` and the probabilities (flat, for the backward).
    fn forward(&self, iv: &Intervals) -> Result<(Tensor, Tensor)> {
        let BlockGeometry { hkv, g, rows, .. } = self.geo;
        let d = self.q.dim(2)?;
        let s_ctx = match &self.kc {
            Some(kc) => self.q.matmul(&kc.t()?)?,
            None => Tensor::zeros(1, self.q.dtype(), self.q.device())?,
        };
        let s_blk = self.qb.matmul(&self.kb.t()?)?;
        let p = block_softmax(&s_ctx, &s_blk, iv, self.geo)?;
        let (p_ctx, p_blk) = self.parts(&p)?;
        let mut o = from_blocks(&p_blk.matmul(&self.vb)?, hkv, g, self.geo.block)?;
        if let Some(vc) = &self.vc {
            o = (o + p_ctx.matmul(vc)?.reshape((hkv, g, rows, d))?)?;
        }
        Ok((o, p))
    }

    /// The gradients from `dout [hkv, g, rows, d]` and the saved probabilities.
    fn backward(&self, dout: &Tensor, p: &Tensor) -> Result<WindowGrads> {
        let BlockGeometry {
            hkv,
            g,
            rows,
            block,
            ..
        } = self.geo;
        let d = self.q.dim(2)?;
        let dout = contiguous(dout)?;
        let do_ctx = dout.reshape((hkv, g * rows, d))?;
        let do_blk = per_block(&dout, block)?;
        let (p_ctx, p_blk) = self.parts(p)?;
        let dp_ctx = match &self.vc {
            Some(vc) => do_ctx.matmul(&vc.t()?)?,
            None => Tensor::zeros(1, dout.dtype(), dout.device())?,
        };
        let dp_blk = do_blk.matmul(&self.vb.t()?)?;
        let ds = block_softmax_bwd(p, &dp_ctx, &dp_blk, self.geo)?;
        let (ds_ctx, ds_blk) = self.parts(&ds)?;
        let mut dq = from_blocks(&ds_blk.matmul(&self.kb)?, hkv, g, block)?;
        let (mut dk_ctx, mut dv_ctx) = (None, None);
        if let (Some(kc), Some(_)) = (&self.kc, &self.vc) {
            dq = (dq + ds_ctx.matmul(kc)?.reshape((hkv, g, rows, d))?)?;
            dk_ctx = Some(ds_ctx.t()?.matmul(&self.q)?);
            dv_ctx = Some(p_ctx.t()?.matmul(&do_ctx)?);
        }
        let nbw = rows / block;
        let to_rows = |t: Tensor| t.reshape((hkv, nbw * block, d));
        Ok(WindowGrads {
            dq,
            dk_ctx,
            dv_ctx,
            dk_blk: to_rows(ds_blk.t()?.matmul(&self.qb)?)?,
            dv_blk: to_rows(p_blk.t()?.matmul(&do_blk)?)?,
        })
    }
}

/// `[hkv, g, rows, d]` → the batched per-block layout `[hkv·nbw, g·block, d]`.
fn per_block(t: &Tensor, block: usize) -> Result<Tensor> {
    let (hkv, g, rows, d) = t.dims4()?;
    let nbw = rows / block;
    permuted(&t.reshape((hkv, g, nbw, block, d))?, &[0, 2, 1, 3, 4])?.reshape((
        hkv * nbw,
        g * block,
        d,
    ))
}

/// The inverse of [`per_block`]: `[hkv·nbw, g·block, d]` → `[hkv, g, nbw·block, d]`.
fn from_blocks(t: &Tensor, hkv: usize, g: usize, block: usize) -> Result<Tensor> {
    let (hn, _, d) = t.dims3()?;
    let nbw = hn / hkv;
    permuted(&t.reshape((hkv, nbw, g, block, d))?, &[0, 2, 1, 3, 4])?.reshape((
        hkv,
        g,
        nbw * block,
        d,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::{attend, mask_tensor};
    use dflash_core::segments::Segments;
    use dflash_core::visibility::{draft_training, draft_training_parts, DraftRule};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        // a fixed pseudo-random fill (no RNG state shared between tests)
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let x = ((i as u64 + 1) * 2654435761 + seed * 40503) % 10007;
                x as f32 / 10007.0 * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn windows_cover_every_visible_key() {
        // the docs' example
        let ranges = [0..3, 0..3, 0..5, 0..5, 6..9, 6..9];
        assert_eq!(
            window_bounds(&ranges, 2, &[0, 0, 1], usize::MAX),
            vec![(0..4, 0..5), (4..6, 6..9)]
        );
        assert_eq!(
            window_bounds(&ranges, 2, &[0, 0, 1], 0),
            vec![(0..2, 0..3), (2..4, 0..5), (4..6, 6..9)]
        );
        // 4 rows × 5 keys = 20 cells: a budget of 19 splits the first sequence's blocks
        assert_eq!(window_bounds(&ranges, 2, &[0, 0, 1], 20).len(), 2);
        assert_eq!(window_bounds(&ranges, 2, &[0, 0, 1], 19).len(), 3);
        // a block with no context at all gets no keys
        assert_eq!(window_bounds(&[0..0, 0..0], 2, &[0], 8), vec![(0..2, 0..0)]);
    }

    #[test]
    fn key_spans_widen_to_aligned_lengths_inside_the_context() {
        // the docs' examples
        assert_eq!(aligned_keys(0..1037, 2048), 0..1040);
        assert_eq!(aligned_keys(2043..2047, 2048), 2040..2048);
        assert_eq!(aligned_keys(0..3, 5), 0..5);
        assert_eq!(aligned_keys(16..24, 2048), 16..24, "already aligned");
        assert_eq!(aligned_keys(0..0, 2048), 0..0, "no keys stay none");
        for (start, end, ctx) in [(3, 9, 100), (90, 97, 100), (0, 97, 100), (5, 6, 7)] {
            let a = aligned_keys(start..end, ctx);
            assert!(a.start <= start && a.end >= end && a.end <= ctx, "{a:?}");
            assert!(a.len().is_multiple_of(KEY_ALIGN) || a.len() == ctx, "{a:?}");
        }
    }

    #[test]
    fn block_attention_equals_dense_masked_attention() {
        let (hq, hkv, d, block) = (4, 2, 8, 3);
        // one sequence, two packed ones, no context at all
        let cases = [
            (Segments::single(10), vec![0usize, 3, 6]),
            (Segments::from_lengths(&[5, 5]), vec![0, 3, 6]),
            (Segments::single(0), vec![]),
        ];
        for (segs, anchors) in cases {
            let seq_len = segs.len();
            for rule in [DraftRule::FULL, DraftRule::for_layer(Some(2))] {
                let anchors: Vec<usize> = if seq_len == 0 {
                    vec![0, 0]
                } else {
                    anchors.clone()
                };
                let r = anchors.len() * block;
                let q = randn(&[1, hq, r, d], 1);
                let k = randn(&[1, hkv, seq_len + r, d], 2);
                let v = randn(&[1, hkv, seq_len + r, d], 3);
                let dense = draft_training(rule, &segs, &anchors, block);
                let want = attend(
                    &q,
                    &k,
                    &v,
                    &mask_tensor(&dense, DType::F32, &Device::Cpu).unwrap(),
                    0.35,
                )
                .unwrap();
                let (c, o) = draft_training_parts(rule, &segs, &anchors, block);
                // one window per sequence, or windows of one block each
                let group: Vec<usize> = anchors.iter().map(|&a| segs.segment_of(a)).collect();
                for max_cells in [usize::MAX, 0] {
                    let windows =
                        context_windows(&c, &o, block, &group, max_cells, seq_len, &Device::Cpu)
                            .unwrap();
                    let got = attend_blocks(&q, &k, &v, seq_len, &windows, block, 0.35).unwrap();
                    let err = crate::ops::compare::max_abs(&want, &got).unwrap();
                    assert!(
                        err < 1e-6,
                        "seq {seq_len} {rule:?} windows of ≤ {max_cells} cells: max diff {err}"
                    );
                }
            }
        }
    }

    /// The written-out backward of [`attend_blocks`] equals autograd through the dense masked
    /// attention, for q, k and v (and a loss that weights every output value differently).
    #[test]
    fn block_attention_gradients_equal_dense_autograd() {
        use candle_core::Var;
        let (hq, hkv, d, block) = (4, 2, 8, 3);
        let segs = Segments::from_lengths(&[7, 6]);
        let anchors = vec![0usize, 2, 4, 7, 9];
        let (m, r) = (segs.len(), anchors.len() * block);
        for rule in [DraftRule::FULL, DraftRule::for_layer(Some(2))] {
            let q0 = randn(&[1, hq, r, d], 4);
            let k0 = randn(&[1, hkv, m + r, d], 5);
            let v0 = randn(&[1, hkv, m + r, d], 6);
            let wout = randn(&[1, r, hq * d], 7);
            let grads = |dense: bool| {
                let (q, k, v) = (
                    Var::from_tensor(&q0).unwrap(),
                    Var::from_tensor(&k0).unwrap(),
                    Var::from_tensor(&v0).unwrap(),
                );
                let out = if dense {
                    let mask = draft_training(rule, &segs, &anchors, block);
                    let mask = mask_tensor(&mask, DType::F32, &Device::Cpu).unwrap();
                    attend(q.as_tensor(), k.as_tensor(), v.as_tensor(), &mask, 0.35).unwrap()
                } else {
                    let (c, o) = draft_training_parts(rule, &segs, &anchors, block);
                    let group: Vec<usize> = anchors.iter().map(|&a| segs.segment_of(a)).collect();
                    let w = context_windows(&c, &o, block, &group, 10, m, &Device::Cpu).unwrap();
                    assert!(w.len() > 2, "the test should span several windows");
                    attend_blocks(
                        q.as_tensor(),
                        k.as_tensor(),
                        v.as_tensor(),
                        m,
                        &w,
                        block,
                        0.35,
                    )
                    .unwrap()
                };
                let g = (&out * &wout)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let get = |x: &Var| g.get(x.as_tensor()).unwrap().clone();
                (out, get(&q), get(&k), get(&v))
            };
            let want = grads(true);
            let got = grads(false);
            for (name, a, b) in [
                ("out", &want.0, &got.0),
                ("dq", &want.1, &got.1),
                ("dk", &want.2, &got.2),
                ("dv", &want.3, &got.3),
            ] {
                let e = crate::ops::compare::max_abs(a, b).unwrap();
                assert!(e < 1e-5, "{rule:?} {name}: max diff {e}");
            }
        }
    }
}
