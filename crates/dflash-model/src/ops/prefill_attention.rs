//! The target's attention for many query rows per sequence, each row over one interval of keys
//! (a causal prefill, a training row's target features over packed segments, a regeneration's
//! batched prefill), as one tensor-core kernel that never writes the scores: `q · kᵀ`, the
//! interval softmax and `p · v` of [`crate::layers::attention::attend_intervals_unfused`] (its
//! twin, and the path wherever this kernel does not serve) fused in the manner of
//! flash-attention (`prefill_attn_*` in `src/cuda/prefill_attn.cuh`).
//!
//! Example: Qwen3-8B's features on a 2,048-token row (32 query heads over 8 K/V heads of 128):
//! the matmul path writes and reads `32 · 2,048 · 2,048` bf16 scores per layer (268 MB) and
//! computes the hidden half of them; the kernel walks each 64-row tile's keys `0..=last row`
//! once, 32 at a time, in registers.
//!
//! It serves bf16 on a CUDA device, head dims 64 and 128, K/V read in place with one layout, and
//! more query rows per K/V head than [`crate::ops::interval_attention`] takes (its
//! [`MAX_ROWS`]); f32 keeps the matmul path. `DFLASH_PREFILL_ATTENTION=0` (or
//! `DFLASH_FUSED_ATTENTION=0`) turns it off.

use candle_core::{DType, Result, Tensor};

use crate::ops::interval_attention::{apply, rows_per_kv_head, MAX_ROWS};
use crate::ops::interval_softmax::RowIntervals;

/// Query rows per block of the kernel (4 warps of 16).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const TILE_ROWS: usize = 64;

/// Whether the environment turns the kernel off (`DFLASH_PREFILL_ATTENTION=0` or
/// `DFLASH_FUSED_ATTENTION=0`).
pub fn switched_off() -> bool {
    crate::ops::switched_off!("DFLASH_PREFILL_ATTENTION")
        || crate::ops::switched_off!("DFLASH_FUSED_ATTENTION")
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
        serves(q, k, v),
        "prefill attention",
        &Op { iv, scale },
    )
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Op<'a> {
    iv: &'a RowIntervals,
    scale: f64,
}

impl candle_core::CustomOp3 for Op<'_> {
    fn name(&self) -> &'static str {
        "prefill-attention"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!(
            "the prefill attention is a CUDA kernel: the CPU attends through attend_intervals"
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &candle_core::Layout,
        ks: &candle_core::CudaStorage,
        kl: &candle_core::Layout,
        vs: &candle_core::CudaStorage,
        vl: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use crate::cuda::ptx::{alloc, launch, view};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let (b, hq, n, d) = ql.shape().dims4()?;
        let (_, hkv, t, _) = kl.shape().dims4()?;
        let hs = kl.stride()[1];
        // a block per (64-row tile, query head, sequence)
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(TILE_ROWS) as u32, hq as u32, b as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let dev = qs.device().clone();
        let (hq_, hkv_, n_, hs_, sc) = (
            hq as i32,
            hkv as i32,
            n as i32,
            hs as i64,
            self.scale as f32,
        );
        // the K/V buffers from the view's first element to the end of the last row read
        let span = (b * hkv - 1) * hs + t * d;
        let name = format!("prefill_attn_d{d}");
        self.iv
            .table
            .with_cuda_view("prefill attention intervals", |iv| {
                let q = view::<half::bf16>(qs, ql, "q")?;
                let k = ks
                    .as_cuda_slice::<half::bf16>()?
                    .slice(kl.start_offset()..kl.start_offset() + span);
                let v = vs
                    .as_cuda_slice::<half::bf16>()?
                    .slice(vl.start_offset()..vl.start_offset() + span);
                let out = alloc::<half::bf16>(&dev, b * n * hq * d)?;
                launch!(
                    dev,
                    &name,
                    DType::BF16,
                    cfg,
                    q,
                    k,
                    v,
                    iv,
                    out,
                    hq_,
                    hkv_,
                    n_,
                    hs_,
                    sc
                );
                Ok((
                    candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
                    candle_core::Shape::from((b, n, hq * d)),
                ))
            })
    }
}
