//! Scaled dot-product attention with an explicit additive mask and grouped K/V.
//!
//! K/V are never expanded: the `hq / hkv` query heads that share a K/V head are stacked
//! along the row axis, so each K/V head is read once (`transformers.repeat_kv` semantics:
//! query head h uses K/V head h / (hq / hkv)).

use std::ops::Range;

use candle_core::{DType, Device, Result, Tensor};
use dflash_core::visibility::Visibility;

use crate::norm::compute_dtype;

/// The additive mask tensor `[rows, cols]` (0 visible, -inf hidden) of a visibility matrix.
pub fn mask_tensor(v: &Visibility, dtype: DType, device: &Device) -> Result<Tensor> {
    mask_tensor_cols(v, v.cols, dtype, device)
}

/// [`mask_tensor`] widened to `cols ≥ v.cols` columns, the extra ones hidden (a fixed-capacity
/// cache: rows past the new ones). Example: a 1×3 all-visible matrix at 5 columns →
/// `[0 0 0 -inf -inf]`.
pub fn mask_tensor_cols(
    v: &Visibility,
    cols: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    if cols < v.cols {
        candle_core::bail!(
            "a {}x{} mask cannot be narrowed to {cols} columns",
            v.rows,
            v.cols
        );
    }
    let mut data = Vec::with_capacity(v.rows * cols);
    for row in v.additive().chunks(v.cols.max(1)) {
        data.extend_from_slice(row);
        data.resize(data.len() + cols - v.cols, f32::NEG_INFINITY);
    }
    Tensor::from_vec(data, (v.rows, cols), device)?.to_dtype(dtype)
}

/// The additive mask `[rows, cols]` of one visible interval per row (`ranges[r]`: 0 inside,
/// -inf outside), built on the device from two numbers per row: the draft training context
/// mask ([`dflash_core::visibility::draft_training_parts`]) without building or moving
/// `rows × cols` cells on the host. Example: ranges [0..2, 1..3], cols 4 → rows
/// [0 0 -inf -inf], [-inf 0 0 -inf].
pub fn range_mask(
    ranges: &[std::ops::Range<usize>],
    cols: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let rows = ranges.len();
    let bound = |f: fn(&std::ops::Range<usize>) -> usize| {
        Tensor::from_vec(
            ranges.iter().map(|r| f(r) as u32).collect::<Vec<_>>(),
            (rows, 1),
            device,
        )
    };
    let (lo, hi) = (bound(|r| r.start)?, bound(|r| r.end)?);
    let c = Tensor::arange(0u32, cols as u32, device)?.reshape((1, cols))?;
    let inside = (c.broadcast_ge(&lo)? * c.broadcast_lt(&hi)?)?;
    let zeros = Tensor::zeros((rows, cols), dtype, device)?;
    let hidden = Tensor::full(f32::NEG_INFINITY, (rows, cols), device)?.to_dtype(dtype)?;
    inside.where_cond(&zeros, &hidden)
}

/// The additive masks of `b` sequences' visibility matrices (each `[n, t]`), as one
/// `[b, 1, 1, n, t]` tensor that [`attend`] broadcasts over K/V heads and grouped query heads
/// (one sequence: `[n, t]`).
pub fn mask_tensors(masks: &[Visibility], dtype: DType, device: &Device) -> Result<Tensor> {
    if let [one] = masks {
        return mask_tensor(one, dtype, device);
    }
    let (n, t) = (masks[0].rows, masks[0].cols);
    let data: Vec<f32> = masks.iter().flat_map(|m| m.additive()).collect();
    Tensor::from_vec(data, (masks.len(), 1, 1, n, t), device)?.to_dtype(dtype)
}

/// The drafter's softmax (fused forward, closed-form backward): [`crate::softmax`].
pub use crate::softmax::softmax_last;

/// `q: [b, hq, n, d]`, `k, v: [b, hkv, t, d]`, `mask: [n, t]` (or `[b, 1, 1, n, t]`)
/// additive → `[b, n, hq * d]`. The target and the drafter both attend through here (one
/// fused softmax launch; a backward only where the inputs carry a graph: the drafter's).
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, hq, n, d) = q.dims4()?;
    let (_, hkv, t, _) = k.dims4()?;
    let g = hq / hkv;
    let dtype = q.dtype();
    let q = q.contiguous()?.reshape((b, hkv, g * n, d))?;
    let k = k.contiguous()?;
    let v = v.contiguous()?;
    let cd = compute_dtype(dtype);
    let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(cd)?;
    let scores = scores
        .reshape((b, hkv, g, n, t))?
        .broadcast_add(&mask.to_dtype(cd)?)?;
    let probs = softmax_last(&scores)?
        .to_dtype(dtype)?
        .reshape((b, hkv, g * n, t))?;
    let out = probs.matmul(&v)?; // [b, hkv, g*n, d]
    out.reshape((b, hq, n, d))?
        .transpose(1, 2)?
        .reshape((b, n, hq * d))
}

/// One window of the training layout: the block rows `rows` (whole blocks) score only the
/// context keys `keys`, which hold every context key any of those rows may see; `mask`
/// (`[rows.len(), keys.len()]`, additive) is the rule inside the window. Example: a packed row
/// with segments [0..400, 400..900] and anchors in both → the first segment's blocks get keys
/// 0..(its last anchor), the second's 400..(its last anchor): no row scores the other
/// sequence or keys at or after its anchor group's end.
pub struct ContextWindow {
    pub rows: Range<usize>,
    pub keys: Range<usize>,
    pub mask: Tensor,
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

/// The [`ContextWindow`]s of a training layout ([`window_bounds`]), each with the rule's mask
/// on its keys ([`range_mask`]).
pub fn context_windows(
    ranges: &[Range<usize>],
    block: usize,
    group_of_block: &[usize],
    max_cells: usize,
    dtype: DType,
    device: &Device,
) -> Result<Vec<ContextWindow>> {
    window_bounds(ranges, block, group_of_block, max_cells)
        .into_iter()
        .map(|(rows, keys)| {
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
            let mask = range_mask(&local, keys.len(), dtype, device)?;
            Ok(ContextWindow { rows, keys, mask })
        })
        .collect()
}

/// Masked attention for the training layout, without the always-hidden cells: each of the
/// `R = nb · block` query rows sees context keys (through its [`ContextWindow`]) and the
/// `block` keys of its own block (`mask_blk` `[R, block]`), one softmax over both. Equal to
/// [`attend`] over `[context | all blocks]` with the dense training mask, at
/// `O(Σ window rows · window keys + R · block)` instead of `O(R · (m + R))` memory and work.
/// `q: [1, hq, R, d]`, `k_ctx, v_ctx: [1, hkv, m, d]`, `k_blk, v_blk: [1, hkv, R, d]` → `[1, R, hq·d]`.
#[allow(clippy::too_many_arguments)]
pub fn attend_blocks(
    q: &Tensor,
    k_ctx: &Tensor,
    v_ctx: &Tensor,
    k_blk: &Tensor,
    v_blk: &Tensor,
    windows: &[ContextWindow],
    mask_blk: &Tensor,
    block: usize,
    scale: f64,
) -> Result<Tensor> {
    let r = q.dim(2)?;
    let covered: usize = windows.iter().map(|w| w.rows.len()).sum();
    if covered != r || windows.iter().any(|w| w.rows.len() % block != 0) {
        candle_core::bail!("attend_blocks: the windows must cover the {r} rows in whole blocks");
    }
    let outs = windows
        .iter()
        .map(|w| {
            let (r0, rn) = (w.rows.start, w.rows.len());
            let (k0, kn) = (w.keys.start, w.keys.len());
            attend_window(
                &q.narrow(2, r0, rn)?,
                &k_ctx.narrow(2, k0, kn)?,
                &v_ctx.narrow(2, k0, kn)?,
                &k_blk.narrow(2, r0, rn)?,
                &v_blk.narrow(2, r0, rn)?,
                &w.mask,
                &mask_blk.narrow(0, r0, rn)?,
                block,
                scale,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    if outs.len() == 1 {
        return Ok(outs.into_iter().next().unwrap());
    }
    Tensor::cat(&outs, 1)
}

/// [`attend_blocks`] for one window: every row scores all `m` keys of `k_ctx` (`mask_ctx`
/// `[R, m]`) and its own block.
#[allow(clippy::too_many_arguments)]
fn attend_window(
    q: &Tensor,
    k_ctx: &Tensor,
    v_ctx: &Tensor,
    k_blk: &Tensor,
    v_blk: &Tensor,
    mask_ctx: &Tensor,
    mask_blk: &Tensor,
    block: usize,
    scale: f64,
) -> Result<Tensor> {
    let (b, hq, r, d) = q.dims4()?;
    let (_, hkv, m, _) = k_ctx.dims4()?;
    if b != 1 || r % block != 0 {
        candle_core::bail!(
            "attend_blocks: batch 1 and whole blocks expected (got b {b}, {r} rows, block {block})"
        );
    }
    let (g, nb) = (hq / hkv, r / block);
    let dtype = q.dtype();
    let cd = compute_dtype(dtype);
    let q = q.contiguous()?;
    // context scores [1, hkv, g, R, m]
    let s_ctx = if m > 0 {
        let s = (q
            .reshape((1, hkv, g * r, d))?
            .matmul(&k_ctx.contiguous()?.t()?)?
            * scale)?;
        Some(
            s.to_dtype(cd)?
                .reshape((1, hkv, g, r, m))?
                .broadcast_add(&mask_ctx.to_dtype(cd)?)?,
        )
    } else {
        None
    };
    // own-block scores: per (kv head, block) a [g·B, B] product → [1, hkv, g, R, B]
    let qb = q
        .reshape((hkv, g, nb, block, d))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((hkv * nb, g * block, d))?;
    let kb = k_blk.contiguous()?.reshape((hkv * nb, block, d))?;
    let vb = v_blk.contiguous()?.reshape((hkv * nb, block, d))?;
    let s_blk = (qb.matmul(&kb.t()?)? * scale)?
        .to_dtype(cd)?
        .reshape((hkv, nb, g, block, block))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((1, hkv, g, r, block))?
        .broadcast_add(&mask_blk.to_dtype(cd)?)?;
    // one softmax over [context | own block]
    let scores = match &s_ctx {
        Some(s) => Tensor::cat(&[s, &s_blk], 4)?,
        None => s_blk,
    };
    let probs = softmax_last(&scores)?.to_dtype(dtype)?;
    let p_blk = probs
        .narrow(4, m, block)?
        .reshape((hkv, g, nb, block, block))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((hkv * nb, g * block, block))?;
    let mut out = p_blk
        .matmul(&vb)?
        .reshape((hkv, nb, g, block, d))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((1, hkv, g * r, d))?;
    if m > 0 {
        let p_ctx = probs
            .narrow(4, 0, m)?
            .contiguous()?
            .reshape((1, hkv, g * r, m))?;
        out = (out + p_ctx.matmul(&v_ctx.contiguous()?)?)?;
    }
    out.reshape((1, hq, r, d))?
        .transpose(1, 2)?
        .reshape((1, r, hq * d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_core::segments::Segments;
    use dflash_core::visibility::{causal, draft_training, draft_training_parts, DraftRule};

    #[test]
    fn a_widened_mask_hides_the_extra_columns() {
        let v = causal(1, 2); // [[1 1 0], [1 1 1]]
        let m = mask_tensor_cols(&v, 5, DType::F32, &Device::Cpu).unwrap();
        let ninf = f32::NEG_INFINITY;
        assert_eq!(
            m.to_vec2::<f32>().unwrap(),
            vec![
                vec![0.0, 0.0, ninf, ninf, ninf],
                vec![0.0, 0.0, 0.0, ninf, ninf]
            ]
        );
        assert_eq!(
            mask_tensor(&v, DType::F32, &Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap(),
            vec![vec![0.0, 0.0, ninf], vec![0.0, 0.0, 0.0]]
        );
        assert!(mask_tensor_cols(&v, 2, DType::F32, &Device::Cpu).is_err());
    }

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
                let ctx_mask = range_mask(&c, seq_len, DType::F32, &Device::Cpu).unwrap();
                // the device-built context mask is the dense mask's first seq_len columns
                let dense_ctx = mask_tensor(&dense, DType::F32, &Device::Cpu)
                    .unwrap()
                    .narrow(1, 0, seq_len)
                    .unwrap();
                assert_eq!(
                    ctx_mask.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    dense_ctx.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                );
                // one window per sequence, or windows of one block each
                let group: Vec<usize> = anchors.iter().map(|&a| segs.segment_of(a)).collect();
                for max_cells in [usize::MAX, 0] {
                    let windows =
                        context_windows(&c, block, &group, max_cells, DType::F32, &Device::Cpu)
                            .unwrap();
                    let got = attend_blocks(
                        &q,
                        &k.narrow(2, 0, seq_len).unwrap(),
                        &v.narrow(2, 0, seq_len).unwrap(),
                        &k.narrow(2, seq_len, r).unwrap(),
                        &v.narrow(2, seq_len, r).unwrap(),
                        &windows,
                        &mask_tensor(&o, DType::F32, &Device::Cpu).unwrap(),
                        block,
                        0.35,
                    )
                    .unwrap();
                    let err = crate::compare::max_abs(&want, &got).unwrap();
                    assert!(
                        err < 1e-6,
                        "seq {seq_len} {rule:?} windows of ≤ {max_cells} cells: max diff {err}"
                    );
                }
            }
        }
    }
}
