//! The target's attention for a few query rows per sequence, each row over one interval of a
//! cache's keys (AR steps of many slots in data regeneration, a chain's verify, a single
//! sequence's decode), as one kernel that reads each visible K/V row once and never writes the
//! scores: `q · kᵀ`, the interval softmax and `p · v` of
//! [`crate::layers::attention::attend_intervals`] (its CPU twin, and the path everywhere the
//! kernel does not serve) fused in the manner of flash-decoding.
//!
//! Example: 256 slots of SmolLM2 (9 query heads over 3 K/V heads, head dim 64) decoding one
//! token each, slot 0 holding 40 rows and slot 1 holding 700 of a 1,000-column cache: slot 0's
//! block reads columns 960..1000 and slot 1's 300..1000; the matmul path reads all 1,000 of
//! both and writes and reads `256 · 9 · 1,000` scores per layer.
//!
//! Three kernels (in `src/ops/interval_attention.cu`, the tensor-core one in
//! `src/ops/mma_attention.cu`), each with an online softmax in f32 per row and the splits of the
//! keys merged in a second kernel when there are several:
//! - one query row in each of several sequences and at most 8 query heads per K/V head (the
//!   AR steps of a regeneration's slots), `decode_attn_*`: a block per
//!   (sequence, K/V head, split), K/V rows loaded straight into registers with several loads in
//!   flight per lane; `DFLASH_DISABLED_KERNELS=decode-attention` hands these to the last kernel;
//! - in bf16, more than 4 query rows per K/V head (a verify), `verify_attn_*`
//!   (tensor cores): a block per (sequence, K/V head, split) holds all the K/V head's
//!   `hq / hkv · n` rows and multiplies on the tensor cores; `DFLASH_DISABLED_KERNELS=verify-attention` hands
//!   these to the last kernel;
//! - otherwise (a single sequence's AR step, f32), `interval_attn_*`: a
//!   block per (sequence, K/V head, group of up to 16 of the rows that share the K/V head,
//!   split), K/V staged in shared memory as f32 tile by tile, scalar dot products.
//!
//! A tree's verify (DDTree) has rows that see an interval and a window of 64 columns past it
//! ([`RowIntervals::tree_widened`]): in bf16 with more than 4 and at most [`MAX_TREE_ROWS`] query
//! rows per K/V head, `verify_tree_attn_*` ([`fused_tree`]), the verify kernel reading four
//! words per row, unless `DFLASH_DISABLED_KERNELS=tree-attention` ([`tree_switched_on`]) hands these back to
//! the additive mask's path. One sequence's rows of one interval each that are more than the
//! verify kernel's 64 per K/V head and at most 128 ([`eight_warp_rows`]: Qwen2.5-Coder's 16-row
//! verifies) take the same kernel with empty windows.
//! Example: Qwen3-8B's DDTree-8 verify after 512 cached rows: 9 rows × 4 query heads = 36 rows
//! per K/V head, the node at depth 2 under the root's second child seeing columns 0..513 and
//! the bits of columns 514 and 515.
//!
//! Its op also launches the prefill kernel (more rows per K/V head, bf16:
//! [`crate::ops::prefill_attention`], which decides when).
//!
//! They serve head dims 64 and 128, at most 64 query rows per K/V head, f32 and bf16, and K/V
//! whose rows are read in place ([`crate::layers::attention`]'s `matmul_operand` layout).
//! `DFLASH_DISABLED_KERNELS=attention` turns both off (the matmul path).

use candle_core::{DType, Result, Tensor};

use crate::ops::interval_softmax::RowIntervals;

/// The most query rows per K/V head the kernel takes (four groups of 16, each group a block).
pub const MAX_ROWS: usize = 64;

/// The most query rows per K/V head the tree kernel takes (eight warps of 16 rows).
pub const MAX_TREE_ROWS: usize = 128;

/// Whether the environment turns the fused kernels off (`DFLASH_DISABLED_KERNELS=attention`; read once:
/// this runs at every attention layer of every forward).
pub fn switched_off() -> bool {
    dflash_core::runtime::off(dflash_core::runtime::Kernel::IntervalAttention)
}

/// Whether the fused kernel takes this attention: a CUDA device, head dim 64 or 128, at most
/// [`MAX_ROWS`] query rows per K/V head, f32 or bf16, K and V read in place with one layout.
pub fn serves(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    !switched_off()
        && matches!(q.dtype(), DType::F32 | DType::BF16)
        && rows_per_kv_head(q, k, v).is_some_and(|r| r <= MAX_ROWS)
}

/// The query rows per K/V head (`hq / hkv · n`) when `q`, `k`, `v` have the layout the fused
/// attention kernels read (this module's and [`crate::ops::prefill_attention`]'s): a CUDA
/// device, one dtype, head dim 64 or 128, grouped heads, K and V rows of `d` adjacent values
/// with one layout, batches `hkv` heads apart. Example: Qwen3-8B's 16-row verify (32 / 8 heads
/// of 128 over a cache view) → 64.
pub(crate) fn rows_per_kv_head(q: &Tensor, k: &Tensor, v: &Tensor) -> Option<usize> {
    let (Ok((b, hq, n, d)), Ok((kb, hkv, _, kd))) = (q.dims4(), k.dims4()) else {
        return None;
    };
    let (ks, vs) = (k.stride(), v.stride());
    let fits = q.device().is_cuda()
        && matches!(d, 64 | 128)
        && kd == d
        && kb == b
        && hkv > 0
        && hq % hkv == 0
        && k.dtype() == q.dtype()
        && v.dtype() == q.dtype()
        && k.dims() == v.dims()
        && ks == vs
        && ks[3] == 1
        && ks[2] == d
        && (b == 1 || ks[0] == ks[1] * hkv);
    fits.then_some(hq / hkv * n)
}

/// Whether `n` rows of `hq / hkv` query heads per K/V head of `d`, each row one interval of
/// keys, are the tree kernel's with empty windows (8 warps): more rows per K/V head than the
/// verify kernel's 4 warps take ([`MAX_ROWS`]), at most [`MAX_TREE_ROWS`], head dim 64 or 128.
/// The prefill kernel would take them in row tiles of 64, one block per tile and K/V head,
/// none split over the keys.
/// Example: Qwen2.5-Coder-0.5B's 16-row verify (14 / 2 heads of 64) → 112 rows: true;
/// SmolLM2's (9 / 3) → 48: false (the verify kernel's).
pub fn eight_warp_rows(hq: usize, hkv: usize, d: usize, n: usize) -> bool {
    hkv > 0
        && hq.is_multiple_of(hkv)
        && matches!(d, 64 | 128)
        && (MAX_ROWS + 1..=MAX_TREE_ROWS).contains(&(hq / hkv * n))
}

/// Whether a target's layers hand a tree's verify to the tree kernel: unless
/// `DFLASH_DISABLED_KERNELS=tree-attention`, `DFLASH_DISABLED_KERNELS=verify-attention` or `DFLASH_DISABLED_KERNELS=attention` (read
/// once).
pub fn tree_switched_on() -> bool {
    !switched_off()
        && !dflash_core::runtime::off(dflash_core::runtime::Kernel::TreeAttention)
        && !dflash_core::runtime::off(dflash_core::runtime::Kernel::VerifyAttention)
}

/// Whether the tree kernel can take this attention: [`rows_per_kv_head`] more than 4 and at
/// most [`MAX_TREE_ROWS`], bf16. Example: SmolLM2's DDTree-16 verify (17 rows × 3 heads = 51)
/// and Qwen3-8B's DDTree-24 (25 × 4 = 100) can; an AR step (4 rows per K/V head) cannot.
pub fn serves_tree(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    q.dtype() == DType::BF16
        && rows_per_kv_head(q, k, v).is_some_and(|r| r > 4 && r <= MAX_TREE_ROWS)
}

/// [`fused`] for a tree's verify: `iv` from [`RowIntervals::tree_widened`] (each row an
/// interval and a window), as [`crate::layers::attention::attend_intervals_unfused`] computes
/// it over the same rows. Only where [`serves_tree`].
pub fn fused_tree(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    iv: &RowIntervals,
    scale: f64,
) -> Result<Tensor> {
    apply(
        q,
        k,
        v,
        iv,
        iv.window && serves_tree(q, k, v),
        "fused tree attention",
        &Op { iv, scale },
    )
}

/// `q: [b, hq, n, d]`, `k, v: [b, hkv, t, d]` (a cache's view, read in place), one key
/// interval per query row (`iv`: `b` sequences × `n` rows over `t` columns) → `[b, n, hq · d]`,
/// as [`crate::layers::attention::attend_intervals`] computes it. Only where [`serves`].
pub fn fused(q: &Tensor, k: &Tensor, v: &Tensor, iv: &RowIntervals, scale: f64) -> Result<Tensor> {
    apply(
        q,
        k,
        v,
        iv,
        serves(q, k, v) && !iv.window,
        "fused interval attention",
        &Op { iv, scale },
    )
}

/// `op` over `q` (made contiguous), `k`, `v` when `served` and the intervals fit `q` and `k`;
/// else an error naming `what` and the shapes.
pub(crate) fn apply(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    iv: &RowIntervals,
    served: bool,
    what: &str,
    op: &impl candle_core::CustomOp3,
) -> Result<Tensor> {
    let (b, _, n, _) = q.dims4()?;
    let t = k.dim(2)?;
    if !served || iv.b != b || iv.n != n || iv.cols != t {
        candle_core::bail!(
            "{what}: q {:?}, k {:?} and intervals of {} × {} rows over {} keys do not fit",
            q.dims(),
            k.dims(),
            iv.b,
            iv.n,
            iv.cols
        );
    }
    q.contiguous()?.apply_op3_no_bwd(k, v, op)
}

/// The decode kernel for `b` sequences of `n` query rows, `rows` per K/V head: several sequences
/// of one query row and at most 8 heads per K/V head, unless `DFLASH_DISABLED_KERNELS=decode-attention`; the
/// head count it is built for (2, 4 or 8; fewer heads run with the rest idle). A single
/// sequence's AR step keeps the interval kernel: with one sequence the decode kernel has too
/// few blocks to gain over it (`docs/BENCHMARKS.md`, the decode attention kernel). Example: 256 SmolLM2 slots (9 / 3 heads) → 4;
/// a 16-row verify → none (the interval kernel's row groups).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn decode_heads(b: usize, n: usize, rows: usize) -> Option<usize> {
    let off = dflash_core::runtime::off(dflash_core::runtime::Kernel::DecodeAttention);
    (b > 1 && n == 1 && rows <= 8 && !off).then(|| rows.next_power_of_two().max(2))
}

/// The tensor-core verify kernel's splits of the keys for `blocks` (sequence, K/V head) pairs of
/// `rows` query rows each in `dtype` over `t` columns of head dim `d`, or `None` where it does not
/// serve (f32, at most 4 rows per K/V head, or `DFLASH_DISABLED_KERNELS=verify-attention`). About 128 blocks
/// or at most 4 tiles per split, at most 32 splits, each a whole number of key tiles (64 keys
/// for head dim 64, 32 for 128) and none left empty.
/// Example: Qwen3-8B's 16-row verify (8 K/V heads) over 528 columns: 17 tiles of 32, 16 splits
/// wanted, 2 tiles each → 9 splits, 72 blocks.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn verify_splits(dtype: DType, blocks: usize, rows: usize, t: usize, d: usize) -> Option<usize> {
    let off = dflash_core::runtime::off(dflash_core::runtime::Kernel::VerifyAttention);
    if dtype != DType::BF16 || rows <= 4 || off {
        return None;
    }
    let tiles = t.div_ceil(if d == 64 { 64 } else { 32 }).max(1);
    let want = 128usize
        .div_ceil(blocks)
        .max(tiles.div_ceil(4))
        .clamp(1, 32);
    let per = tiles.div_ceil(want);
    Some(tiles.div_ceil(per))
}

/// The fused attention as one op for the four kernels; the launch picks by rows per K/V head,
/// batch and dtype (prefill, decode, verify, interval).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Op<'a> {
    pub(crate) iv: &'a RowIntervals,
    pub(crate) scale: f64,
}

impl candle_core::CustomOp3 for Op<'_> {
    fn name(&self) -> &'static str {
        "interval-attention"
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
            "the fused attention kernels are CUDA's: the CPU attends through attend_intervals"
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
        let rows = hq / hkv * n;
        let blocks = b * hkv;
        let (name, splits, cfg) = launch_plan(self.iv.window, qs.dtype(), (b, hq, hkv, n, t, d))?;
        let dev = qs.device().clone();
        let (hq_, hkv_, n_, hs_, sc) = (
            hq as i32,
            hkv as i32,
            n as i32,
            hs as i64,
            self.scale as f32,
        );
        // the K/V buffers from the view's first element to the end of the last row read
        let span = (blocks - 1) * hs + t * d;
        let merge = format!("interval_attn_merge_d{d}");
        self.iv
            .table
            .with_cuda_view("interval attention intervals", |iv| {
                macro_rules! run {
                    ($ty:ty, $dt:expr) => {{
                        let q = view::<$ty>(qs, ql, "q")?;
                        let k = ks
                            .as_cuda_slice::<$ty>()?
                            .slice(kl.start_offset()..kl.start_offset() + span);
                        let v = vs
                            .as_cuda_slice::<$ty>()?
                            .slice(vl.start_offset()..vl.start_offset() + span);
                        let out = alloc::<$ty>(&dev, b * n * hq * d)?;
                        let part = alloc::<f32>(
                            &dev,
                            if splits > 1 {
                                blocks * splits * rows * (d + 2)
                            } else {
                                1
                            },
                        )?;
                        launch!(
                            dev, &name, $dt, cfg, q, k, v, iv, out, part, hq_, hkv_, n_, hs_, sc
                        );
                        if splits > 1 {
                            let mcfg = LaunchConfig {
                                grid_dim: ((blocks * rows) as u32, 1, 1),
                                block_dim: (d as u32, 1, 1),
                                shared_mem_bytes: 0,
                            };
                            let sp = splits as i32;
                            launch!(dev, &merge, $dt, mcfg, part, out, hq_, hkv_, n_, sp);
                        }
                        candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone())
                    }};
                }
                let out = match qs.dtype() {
                    DType::F32 => run!(f32, DType::F32),
                    DType::BF16 => run!(half::bf16, DType::BF16),
                    other => candle_core::bail!("interval attention: no CUDA kernel for {other:?}"),
                };
                Ok((out, candle_core::Shape::from((b, n, hq * d))))
            })
    }
}

/// Which attention kernel a forward of `b` sequences × `hq` query heads × `n` rows over `t` key
/// columns (`hkv` K/V heads of `d`) launches, its key splits and its launch shape; `window`: a
/// tree's verify (its rows' windows).
#[cfg(feature = "cuda")]
fn launch_plan(
    window: bool,
    dtype: DType,
    (b, hq, hkv, n, t, d): (usize, usize, usize, usize, usize, usize),
) -> Result<(
    String,
    usize,
    candle_core::cuda_backend::cudarc::driver::LaunchConfig,
)> {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    let rows = hq / hkv * n;
    let blocks = b * hkv;
    Ok(if window {
        // a tree's verify (`verify_tree_attn_*`): the verify kernel's blocks, 4 or 8 warps
        let Some(splits) = verify_splits(dtype, blocks, rows, t, d) else {
            candle_core::bail!(
                "the tree kernel takes bf16 verifies of more than 4 rows per K/V head"
            );
        };
        let warps = if rows <= MAX_ROWS { 4 } else { 8 };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, splits as u32, 1),
            block_dim: (32 * warps, 1, 1),
            shared_mem_bytes: 0,
        };
        (format!("verify_tree_attn_d{d}_w{warps}"), splits, cfg)
    } else if rows > MAX_ROWS {
        // many rows (`crate::ops::prefill_attention`, bf16 only: `prefill_attn_*`): a block
        // per (64-row tile, query head, sequence), no splits.
        // Example: Qwen3-8B's 2,048-row features: 32 tiles × 32 heads.
        let tiles = n.div_ceil(crate::ops::prefill_attention::TILE_ROWS);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, hq as u32, b as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        (format!("prefill_attn_d{d}"), 1, cfg)
    } else if let Some(heads) = decode_heads(b, n, rows) {
        // one query row in each of several sequences (`decode_attn_*`): a block per
        // (sequence, K/V head, split), K/V read into registers; about 2,048 blocks, each
        // split at least 64 keys.
        // Example: 256 SmolLM2 slots (3 K/V heads) over 1,300 columns: 768 × 3 splits.
        let splits = 2048usize.div_ceil(blocks).clamp(1, t.div_ceil(64).max(1));
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, splits as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        (format!("decode_attn_d{d}_g{heads}"), splits, cfg)
    } else if let Some(splits) = verify_splits(dtype, blocks, rows, t, d) {
        // a verify in bf16 (`verify_attn_*`): a block per (sequence · K/V head, split) holds
        // the K/V head's rows; no dynamic shared memory.
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, splits as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        (format!("verify_attn_d{d}"), splits, cfg)
    } else {
        // up to 4 rows: one block of 4 warps, a row each, tiles of 64 keys; more: groups
        // of 16 rows (4 per warp), tiles of 32 keys. About 1,024 blocks over (sequence, K/V
        // head, group, split) (a few per SM, their loads in flight together), each split at
        // least one tile. Example: a 16-row verify of Qwen3-8B (32 / 8 heads) over 512
        // keys: 8 heads × 4 groups × 16 splits = 512 blocks, where one 64-row group gave 128.
        let (rw, tile) = if rows <= 4 { (1, 64) } else { (4, 32) };
        let groups = rows.div_ceil(4 * rw);
        let splits = 1024usize
            .div_ceil(blocks * groups)
            .clamp(1, t.div_ceil(tile).clamp(1, 64));
        let smem = (tile * (d + 1) + tile * d + rows.min(4 * rw) * d) * 4;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, splits as u32, groups as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        (format!("interval_attn_d{d}_r{rw}"), splits, cfg)
    })
}

#[cfg(test)]
mod tests {
    use super::{decode_heads, eight_warp_rows, verify_splits};

    /// Several sequences of one query row with up to 8 heads per K/V head take the decode
    /// kernel, built for 2, 4 or 8 heads; a single sequence, several rows (a verify) or more
    /// heads take the interval kernel.
    #[test]
    fn the_decode_kernel_takes_batches_of_one_row_and_up_to_eight_heads() {
        assert_eq!(decode_heads(256, 1, 1), Some(2));
        assert_eq!(decode_heads(256, 1, 3), Some(4)); // SmolLM2: 9 / 3 heads
        assert_eq!(decode_heads(2, 1, 4), Some(4)); // Qwen3-8B: 32 / 8
        assert_eq!(decode_heads(256, 1, 6), Some(8)); // Qwen2.5-Coder-1.5B: 12 / 2
        assert_eq!(decode_heads(256, 1, 8), Some(8));
        assert_eq!(decode_heads(256, 1, 9), None);
        assert_eq!(decode_heads(1, 1, 4), None); // a single sequence's AR step
        assert_eq!(decode_heads(256, 2, 4), None);
        assert_eq!(decode_heads(1, 16, 48), None); // SmolLM2's 16-row verify
    }

    /// Rows per K/V head in 65..=128 go to the tree kernel's 8 warps: Qwen2.5-Coder-0.5B's
    /// 16-row verify (112) and -1.5B's (12 / 2 of 128: 96), not SmolLM2's (48), Qwen3-8B's
    /// (64), an AR step, 19 rows of 7 heads (133) or head dim 80.
    #[test]
    fn eight_warp_rows_are_the_verify_kernels_next_64() {
        assert!(eight_warp_rows(14, 2, 64, 16));
        assert!(eight_warp_rows(12, 2, 128, 16));
        assert!(eight_warp_rows(14, 2, 64, 10)); // 70
        assert!(!eight_warp_rows(9, 3, 64, 16));
        assert!(!eight_warp_rows(32, 8, 128, 16));
        assert!(!eight_warp_rows(14, 2, 64, 1));
        assert!(!eight_warp_rows(14, 2, 64, 19));
        assert!(!eight_warp_rows(14, 2, 80, 16));
        assert!(!eight_warp_rows(14, 0, 64, 16));
    }

    /// A verify in bf16 takes whole key tiles per split, about 128 blocks, none empty; f32 and
    /// AR steps (at most 4 rows per K/V head) are not the verify kernel's.
    #[test]
    fn the_verify_kernel_splits_whole_tiles_none_empty() {
        use candle_core::DType::{BF16, F32};
        // Qwen3-8B: 8 K/V heads, 528 keys, tiles of 32 → 17 tiles, 2 per split
        assert_eq!(verify_splits(BF16, 8, 64, 528, 128), Some(9));
        // SmolLM2: 3 K/V heads, 528 keys, tiles of 64 → 9 tiles, one per split
        assert_eq!(verify_splits(BF16, 3, 48, 528, 64), Some(9));
        // a long context: capped at 32 splits of 4 tiles
        assert_eq!(verify_splits(BF16, 8, 64, 4096, 128), Some(32));
        assert_eq!(verify_splits(BF16, 1, 64, 10, 128), Some(1));
        assert_eq!(verify_splits(F32, 8, 64, 528, 128), None);
        assert_eq!(verify_splits(BF16, 1, 4, 528, 128), None); // Qwen3-8B's AR step
    }
}
