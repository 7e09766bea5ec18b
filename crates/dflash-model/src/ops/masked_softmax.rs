//! The softmax of [`crate::layers::attention::attend`] under an additive mask, as one kernel on
//! a GPU: `p = softmax(scores · scale + mask)` per row, the scores `[b, hkv, g · n, t]` in the
//! model's dtype, the mask `[n, t]` (one sequence) or `[b, 1, 1, n, t]` broadcast over K/V heads
//! and grouped query heads, the sums in f32, `p` in the scores' dtype. Unfused that is a scale,
//! two casts, the broadcast add, the softmax and a cast back (six kernels per attention: the
//! draft block's layers, a tree's verify). Nothing differentiated: the composed ops (the CPU's
//! path and the kernel's twin, compared by `check device`) carry gradients.
//!
//! Example: a DDTree-8 verify of Qwen3-8B's shape (32 / 8 heads) over 640 columns: scores
//! `[1, 8, 36, 640]`, mask `[9, 640]`; score row 13 (group 1, tree row 4) adds mask row 4.

use candle_core::{DType, Result, Tensor};

/// Whether the kernel takes `scores` and `mask` (see the module docs): a GPU, f32 or bf16
/// scores, an f32 or same-dtype mask of `n` rows (or `b · n`) over the scores' columns,
/// contiguous, nothing differentiated. `DFLASH_DISABLED_KERNELS=masked-softmax` turns it off.
pub fn serves(scores: &Tensor, mask: &Tensor, n: usize) -> bool {
    let off = dflash_core::runtime::off(dflash_core::runtime::Kernel::MaskedSoftmax);
    let Ok((b, _, _, t)) = scores.dims4() else {
        return false;
    };
    let mask_rows = mask.elem_count() / t.max(1);
    !off && scores.device().is_cuda()
        && matches!(scores.dtype(), DType::F32 | DType::BF16)
        && (mask.dtype() == scores.dtype() || mask.dtype() == DType::F32)
        && mask.dims().last() == Some(&t)
        && (mask_rows == n || mask_rows == b * n)
        && scores.is_contiguous()
        && mask.is_contiguous()
        && !scores.track_op()
        && !mask.track_op()
}

/// `softmax(scores · scale + mask)` per row, the mask row of score row `r` being `r mod n`
/// (of its sequence). Only where [`serves`].
pub fn fused(scores: &Tensor, mask: &Tensor, n: usize, scale: f64) -> Result<Tensor> {
    if !serves(scores, mask, n) {
        candle_core::bail!(
            "masked softmax: scores {:?} and mask {:?} do not fit the kernel",
            scores.dims(),
            mask.dims()
        );
    }
    let mask = mask.to_dtype(scores.dtype())?;
    scores.apply_op2_no_bwd(
        &mask,
        &Op {
            n,
            scale: scale as f32,
        },
    )
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Op {
    n: usize,
    scale: f32,
}

impl candle_core::CustomOp2 for Op {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("the masked softmax kernel is CUDA's: the CPU composes the ops")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &candle_core::Layout,
        ms: &candle_core::CudaStorage,
        ml: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use crate::cuda::ptx::{alloc, by_float, launch, rows, view};
        use candle_core::backend::BackendStorage;
        let dev = ss.device().clone();
        let (b, _, _, t) = sl.shape().dims4()?;
        let total = sl.shape().elem_count();
        let nrows = total / t.max(1);
        let per_seq = nrows / b.max(1);
        let batched = ml.shape().elem_count() == b * self.n * t && b > 1;
        let (t_, n_, ps_, bat_, sc) = (
            t as i32,
            self.n as i32,
            per_seq as i32,
            i32::from(batched),
            self.scale,
        );
        let out = by_float!(ss.dtype(), "masked softmax", |T, dt| {
            let (s, m) = (view::<T>(ss, sl, "scores")?, view::<T>(ms, ml, "mask")?);
            let p = alloc::<T>(&dev, total)?;
            launch!(
                dev,
                "masked_softmax",
                dt,
                rows(nrows, 256),
                s,
                m,
                p,
                t_,
                n_,
                ps_,
                bat_,
                sc
            );
            candle_core::CudaStorage::wrap_cuda_slice(p, dev)
        });
        Ok((out, sl.shape().clone()))
    }
}
