//! Scaled dot-product attention with an explicit additive mask and grouped K/V.
//!
//! K/V are never expanded: the `hq / hkv` query heads that share a K/V head are stacked
//! along the row axis, so each K/V head is read once (`transformers.repeat_kv` semantics:
//! query head h uses K/V head h / (hq / hkv)).

use candle_core::{DType, Device, Result, Tensor};
use dflash_core::visibility::Visibility;

use crate::layers::norm::compute_dtype;
use crate::ops::interval_softmax::{interval_softmax, RowIntervals};

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

/// The drafter's softmax (fused forward, closed-form backward): [`crate::ops::softmax`].
pub use crate::ops::softmax::softmax_last;

/// `q: [b, hq, n, d]`, `k, v: [b, hkv, t, d]`, `mask: [n, t]` (or `[b, 1, 1, n, t]`)
/// additive → `[b, n, hq * d]`. The target and the drafter both attend through here (one
/// fused softmax launch; a backward only where the inputs carry a graph: the drafter's).
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    grouped(q, k, v, |scores, g, n| {
        if crate::ops::masked_softmax::serves(scores, mask, n) {
            return crate::ops::masked_softmax::fused(scores, mask, n, scale);
        }
        let (b, hkv, _, t) = scores.dims4()?;
        let dtype = scores.dtype();
        let cd = compute_dtype(dtype);
        let scores = (scores * scale)?
            .to_dtype(cd)?
            .reshape((b, hkv, g, n, t))?
            .broadcast_add(&mask.to_dtype(cd)?)?;
        softmax_last(&scores)?
            .to_dtype(dtype)?
            .reshape((b, hkv, g * n, t))
    })
}

/// [`attend`] with one interval of keys per query row (`iv`, from the same visibility rule):
/// on a GPU where they serve, one kernel ([`crate::ops::interval_attention`] for a few rows per
/// sequence, [`crate::ops::prefill_attention`] for many, the tree kernel for a tree's windows);
/// else the two
/// matmuls and one fused pass ([`crate::ops::interval_softmax`]) instead of scale, cast, mask
/// add, softmax and cast. The fused softmax has no backward: inputs that carry a graph
/// (never the target's) are refused.
pub fn attend_intervals(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    iv: &RowIntervals,
    scale: f64,
) -> Result<Tensor> {
    if q.track_op() || k.track_op() || v.track_op() {
        candle_core::bail!("attend_intervals has no backward: attend with a mask for gradients");
    }
    if iv.window {
        // a tree's verify: the tree kernel where it serves, else the twin (the CPU's path; on a
        // GPU the interval softmax refuses windows by name)
        if crate::ops::interval_attention::serves_tree(q, k, v) {
            return crate::ops::interval_attention::fused_tree(q, k, v, iv, scale);
        }
        return attend_intervals_unfused(q, k, v, iv, scale);
    }
    if crate::ops::interval_attention::serves(q, k, v) {
        return crate::ops::interval_attention::fused(q, k, v, iv, scale);
    }
    if crate::ops::prefill_attention::serves(q, k, v) {
        return crate::ops::prefill_attention::fused(q, k, v, iv, scale);
    }
    attend_intervals_unfused(q, k, v, iv, scale)
}

/// [`attend_intervals`] as two matmuls around the interval softmax: the CPU's path and the
/// twin of the fused CUDA kernel ([`crate::ops::interval_attention`]).
pub fn attend_intervals_unfused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    iv: &RowIntervals,
    scale: f64,
) -> Result<Tensor> {
    grouped(q, k, v, |scores, _, _| interval_softmax(scores, iv, scale))
}

/// Grouped attention around `probs`: `q [b, hq, n, d]` stacked per K/V head as
/// `[b, hkv, g·n, d]` (`g = hq / hkv`), `scores = q · kᵀ` `[b, hkv, g·n, t]`, then
/// `probs(scores, g, n) · v` → `[b, n, hq·d]`.
fn grouped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    probs: impl FnOnce(&Tensor, usize, usize) -> Result<Tensor>,
) -> Result<Tensor> {
    let (b, hq, n, d) = q.dims4()?;
    let hkv = k.dim(1)?;
    let g = hq / hkv;
    let q = q.contiguous()?.reshape((b, hkv, g * n, d))?;
    let k = matmul_operand(k)?;
    let v = matmul_operand(v)?;
    let p = probs(&q.matmul(&k.t()?)?, g, n)?;
    let out = p.matmul(&v)?.reshape((b, hq, n, d))?; // [b, hkv, g*n, d] as [b, hq, n, d]
    let out = crate::ops::permute::swap_rows_heads(&out)?; // rows first
    out.reshape((b, n, hq * d))
}

/// `t` (`[b, h, t, d]`) as it is when a matmul reads it in place — rows of `d` adjacent values,
/// heads at one stride, batches at `h` times it — else a contiguous copy. A cache's K/V are a
/// narrow of a longer buffer (`[b, h, cap, d]`, rows `0..t`): read in place, not copied whole
/// at every layer of every step. Example: rows 0..300 of a `[256, 3, 1024, 64]` buffer have
/// strides `[196608, 65536, 64, 1]`: in place.
pub(crate) fn matmul_operand(t: &Tensor) -> Result<Tensor> {
    let (dims, s) = (t.dims(), t.stride());
    let in_place =
        dims.len() == 4 && s[3] == 1 && s[2] == dims[3] && (dims[0] == 1 || s[0] == s[1] * dims[1]);
    if in_place {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_core::visibility::causal;

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

    /// A tree's verify through its rows' windows (`attend_intervals`, the tree kernel's twin on
    /// the CPU) equals the attention through its additive mask, grouped heads, over a fixed
    /// capacity's extra columns.
    #[test]
    fn a_trees_windows_attend_as_its_additive_mask() {
        use crate::ops::interval_softmax::RowIntervals;
        let dev = Device::Cpu;
        let (cache, cols) = (7, 20);
        let parents = [None, Some(0), Some(0), Some(1), Some(2), Some(2), Some(4)];
        let vis = dflash_core::visibility::tree(cache, &parents);
        let iv = RowIntervals::tree_widened(&vis, cols, &dev)
            .unwrap()
            .unwrap();
        let wave = |n: usize, a: f64| {
            Tensor::arange(0f32, n as f32, &dev)
                .unwrap()
                .affine(a, 0.1)
                .unwrap()
                .sin()
                .unwrap()
        };
        let (hq, hkv, n, d) = (6, 2, parents.len(), 8);
        let q = wave(hq * n * d, 0.31).reshape((1, hq, n, d)).unwrap();
        let k = wave(hkv * cols * d, 0.17)
            .reshape((1, hkv, cols, d))
            .unwrap();
        let v = wave(hkv * cols * d, 0.23)
            .reshape((1, hkv, cols, d))
            .unwrap();
        let got = attend_intervals(&q, &k, &v, &iv, 0.35).unwrap();
        let mask = mask_tensor_cols(&vis, cols, DType::F32, &dev).unwrap();
        let want = attend(&q, &k, &v, &mask, 0.35).unwrap();
        assert!(crate::ops::compare::max_abs(&got, &want).unwrap() < 1e-6);
    }

    /// A cache's narrowed K/V are read in place and give the same attention as a contiguous
    /// copy (batched, several heads; and a transposed view, which is copied).
    #[test]
    fn cache_views_are_read_in_place() {
        let dev = Device::Cpu;
        let buf = Tensor::arange(0f32, (2 * 3 * 10 * 4) as f32, &dev)
            .unwrap()
            .affine(0.01, -1.0)
            .unwrap()
            .sin()
            .unwrap()
            .reshape((2, 3, 10, 4))
            .unwrap();
        let view = buf.narrow(2, 0, 6).unwrap();
        assert!(!view.is_contiguous());
        let op = matmul_operand(&view).unwrap();
        assert_eq!(op.stride(), view.stride(), "read in place, not copied");
        let t = buf.transpose(2, 3).unwrap();
        assert!(
            matmul_operand(&t).unwrap().is_contiguous(),
            "a transposed view is copied"
        );
        let q = Tensor::arange(0f32, (2 * 6 * 2 * 4) as f32, &dev)
            .unwrap()
            .affine(0.02, 0.0)
            .unwrap()
            .cos()
            .unwrap()
            .reshape((2, 6, 2, 4))
            .unwrap();
        let mask = Tensor::zeros((2, 6), DType::F32, &dev).unwrap();
        let a = attend(&q, &view, &view, &mask, 0.5).unwrap();
        let c = view.contiguous().unwrap();
        let b = attend(&q, &c, &c, &mask, 0.5).unwrap();
        assert_eq!(crate::ops::compare::max_abs(&a, &b).unwrap(), 0.0);
    }
}
