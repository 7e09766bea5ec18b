//! Scaled dot-product attention with an explicit additive mask and grouped K/V.
//!
//! K/V are never expanded: the `hq / hkv` query heads that share a K/V head are stacked
//! along the row axis, so each K/V head is read once (`transformers.repeat_kv` semantics:
//! query head h uses K/V head h / (hq / hkv)).

use candle_core::{DType, Device, Result, Tensor, D};
use dflash_core::visibility::Visibility;

use crate::norm::compute_dtype;

/// The additive mask tensor `[rows, cols]` (0 visible, -inf hidden) of a visibility matrix.
pub fn mask_tensor(v: &Visibility, dtype: DType, device: &Device) -> Result<Tensor> {
    Tensor::from_vec(v.additive(), (v.rows, v.cols), device)?.to_dtype(dtype)
}

/// Numerically stable softmax over the last axis, from differentiable ops.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&s)
}

/// `q: [b, hq, n, d]`, `k, v: [b, hkv, t, d]`, `mask: [n, t]` additive → `[b, n, hq * d]`.
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
