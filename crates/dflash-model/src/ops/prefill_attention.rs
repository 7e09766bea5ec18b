//! The target's attention for many query rows per sequence, each row over one interval of keys
//! (a causal prefill, a training row's target features over packed segments, a regeneration's
//! batched prefill), as one tensor-core kernel that never writes the scores: `q · kᵀ`, the
//! interval softmax and `p · v` of [`crate::layers::attention::attend_intervals_unfused`] (its
//! twin, and the path wherever this kernel does not serve) fused in the manner of
//! flash-attention (`prefill_attn_*` in `src/ops/mma_attention.cu`).
//!
//! Example: Qwen3-8B's features on a 2,048-token row (32 query heads over 8 K/V heads of 128):
//! the matmul path writes and reads `32 · 2,048 · 2,048` bf16 scores per layer (268 MB) and
//! computes the hidden half of them; the kernel walks each 64-row tile's keys `0..=last row`
//! once, 32 at a time, in registers.
//!
//! It serves bf16 on a CUDA device, head dims 64 and 128, K/V read in place with one layout, and
//! more query rows per K/V head than [`crate::ops::interval_attention`] takes (its
//! [`MAX_ROWS`]); f32 keeps the matmul path. `DFLASH_DISABLED_KERNELS=prefill-attention` (or
//! `DFLASH_DISABLED_KERNELS=attention`) turns it off. It launches through the interval attention's op,
//! which picks the kernel by the rows per K/V head.

use candle_core::{DType, Result, Tensor};

use crate::ops::interval_attention::{apply, rows_per_kv_head, Op, MAX_ROWS};
use crate::ops::interval_softmax::RowIntervals;

/// Query rows per block of the kernel (4 warps of 16).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const TILE_ROWS: usize = 64;

/// Whether the environment turns the kernel off (`DFLASH_DISABLED_KERNELS=prefill-attention` or
/// `DFLASH_DISABLED_KERNELS=attention`).
pub fn switched_off() -> bool {
    dflash_core::runtime::off(dflash_core::runtime::Kernel::PrefillAttention)
}

/// Whether the prefill kernel takes this attention: a CUDA device, bf16, head dim 64 or 128,
/// more than [`MAX_ROWS`] query rows per K/V head, K and V read in place with one layout.
/// Example: SmolLM2 (9 / 3 heads of 64) prefilling 30 rows → 90 rows per K/V head: served; its
/// 16-row verify (48) is the interval kernel's.
pub fn serves(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    !switched_off()
        && q.dtype() == DType::BF16
        && rows_per_kv_head(q, k, v).is_some_and(|r| r > MAX_ROWS)
}

/// `q: [b, hq, n, d]`, `k, v: [b, hkv, t, d]` (read in place), one key interval per query row
/// (`iv`: `b` sequences × `n` rows over `t` columns) → `[b, n, hq · d]`, as
/// [`crate::layers::attention::attend_intervals_unfused`] computes it. Only where [`serves`].
pub fn fused(q: &Tensor, k: &Tensor, v: &Tensor, iv: &RowIntervals, scale: f64) -> Result<Tensor> {
    apply(
        q,
        k,
        v,
        iv,
        serves(q, k, v) && !iv.window,
        "prefill attention",
        &Op { iv, scale },
    )
}
