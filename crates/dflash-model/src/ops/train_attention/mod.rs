//! The drafter's training attention as flash-style tensor-core kernels, forward and backward,
//! scores never written: each of the `R = nb · B` block rows sees its context keys and its own
//! block's (the draft rule's two parts, [`dflash_core::visibility::draft_training_parts`]), one
//! online softmax over both; the backward recomputes the probabilities from each row's saved
//! log-sum-exp (`train_attn_fwd_*` in `src/ops/mma_attention.cu`, `train_attn_dq_*`,
//! `train_attn_dkv_*` and `train_attn_dot_*` in `kernels.cu` beside `kernels.rs`). Its twin, and
//! the path wherever it does not serve (the CPU, f32, other head dims), is
//! [`crate::ops::block_attention::attend_blocks`]: the windowed matmuls around the block
//! softmax with their written backward. Q, K and V are read in place (no head transposes, no
//! per-window copies) and GQA's K/V heads are never expanded.
//!
//! Example: anchors 37 and 90 of one sequence of 200 context rows, B = 16 → row 0 (block 0,
//! position 37) sees keys 0..37 and 200..216; row 16 (block 1, position 90) sees keys 0..90 and
//! 216..232. The 64-key tile of keys 0..64 is seen by rows 0..32, the tile 64..128 by rows
//! 16..32, the tile 192..256 (context 192..200, blocks 0 and 1) by rows 0..32.
//!
//! `DFLASH_DISABLED_KERNELS=train-attention` (or `DFLASH_DISABLED_KERNELS=attention`) turns it off.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use dflash_core::visibility::Visibility;

use crate::ops::kernel_io::KernelTable;
use crate::ops::with_grad::{with_grad3, Grad3};

mod kernels;
#[cfg(test)]
mod tests;

pub use kernels::{dkv_work, DKV_BLOCKS};

/// Keys per block of the dK/dV kernel (4 warps of 16): [`TrainIntervals`] lists, per tile of
/// this many keys, the rows that may see it.
pub const KEY_TILE: usize = 64;

/// Whether the runtime configuration turns the kernels off (`--disable-kernels train-attention`
/// or `attention`).
pub fn switched_off() -> bool {
    dflash_core::runtime::off(dflash_core::runtime::Kernel::TrainAttention)
}

/// Whether the kernels will take a training layout's attention of `dtype` on `device` with
/// heads of `head_dim`: bf16 on a CUDA device, head dim 64 or 128, not switched off. The
/// drafter builds [`TrainIntervals`] only then (and the windows of
/// [`crate::ops::block_attention`] otherwise).
pub fn takes(device: &Device, dtype: DType, head_dim: usize) -> bool {
    device.is_cuda() && dtype == DType::BF16 && matches!(head_dim, 64 | 128) && !switched_off()
}

/// Whether the kernels serve `q: [1, hq, R, d]`, `k, v: [1, hkv, t, d]` (see [`takes`]; grouped
/// heads, one layout for K and V).
pub fn serves(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    takes(q.device(), q.dtype(), q.dim(3).unwrap_or(0))
        && q.dim(0).is_ok_and(|b| b == 1)
        && crate::ops::interval_attention::rows_per_kv_head(q, k, v).is_some()
}

/// The training layout's visibility as the kernels read it: per query row its two key
/// intervals over `[m context keys | R block keys]` (context, then its own block's), and per
/// [`KEY_TILE`] keys the rows `lo..hi` that may see one of them (every row that does lies
/// inside; rows inside that see none of them are hidden by their intervals).
/// Example: see the module's.
#[derive(Debug, Clone)]
pub struct TrainIntervals {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    rows: Arc<KernelTable>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    key_rows: Arc<KernelTable>,
    /// query rows
    pub n: usize,
    /// keys: context then block rows
    pub t: usize,
}

impl TrainIntervals {
    /// From the rule's two parts: `context[row]` the context keys row `row` sees (within
    /// `0..m`) and `own` (`[rows, block]`) the own-block columns, one interval per row.
    pub fn new(
        context: &[Range<usize>],
        own: &Visibility,
        block: usize,
        m: usize,
        device: &Device,
    ) -> Result<Self> {
        let n = context.len();
        if own.rows != n || own.cols != block || block == 0 || !n.is_multiple_of(block) {
            candle_core::bail!(
                "training attention: {n} context ranges and an own-block mask of {} × {} do not fit B = {block}",
                own.rows,
                own.cols
            );
        }
        let t = m + n;
        let tiles = t.div_ceil(KEY_TILE);
        let (mut lo, mut hi) = (vec![u32::MAX; tiles], vec![0u32; tiles]);
        let mut rows = Vec::with_capacity(4 * n);
        for (r, ctx) in context.iter().enumerate() {
            if ctx.end > m {
                candle_core::bail!("training attention: row {r} sees context keys {ctx:?} past the {m} context rows");
            }
            let o = own.row_interval(r).ok_or_else(|| {
                candle_core::Error::Msg(format!("own-block row {r} is not one interval"))
            })?;
            let base = m + (r / block) * block;
            let o = if o.is_empty() {
                0..0
            } else {
                base + o.start..base + o.end
            };
            for iv in [ctx, &o] {
                rows.extend([iv.start as u32, iv.end as u32]);
                if iv.is_empty() {
                    continue;
                }
                for tile in iv.start / KEY_TILE..=(iv.end - 1) / KEY_TILE {
                    lo[tile] = lo[tile].min(r as u32);
                    hi[tile] = hi[tile].max(r as u32 + 1);
                }
            }
        }
        let key_rows: Vec<u32> = lo
            .iter()
            .zip(&hi)
            .flat_map(|(&l, &h)| if l < h { [l, h] } else { [0, 0] })
            .collect();
        Ok(Self {
            rows: Arc::new(KernelTable::new(rows, device)?),
            key_rows: Arc::new(KernelTable::new(key_rows, device)?),
            n,
            t,
        })
    }

    /// Row `r`'s two intervals (context keys, own-block keys), as the kernels read them.
    pub fn row(&self, r: usize) -> (Range<usize>, Range<usize>) {
        let p = &self.rows.host[4 * r..4 * r + 4];
        (p[0] as usize..p[1] as usize, p[2] as usize..p[3] as usize)
    }

    /// The rows that may see a key of tile `tile` (keys `tile · KEY_TILE ..`).
    pub fn key_rows(&self, tile: usize) -> Range<usize> {
        let p = &self.key_rows.host[2 * tile..2 * tile + 2];
        p[0] as usize..p[1] as usize
    }
}

/// `q: [1, hq, R, d]`, `k, v: [1, hkv, t, d]` (`t` = m context + R block keys) → `[1, R, hq·d]`,
/// the attention of [`crate::ops::block_attention::attend_blocks`] over the intervals `iv`,
/// with the kernels' backward attached where an input carries a graph. Only where [`serves`].
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    iv: &TrainIntervals,
    scale: f64,
) -> Result<Tensor> {
    let (y, bwd) = attend_saving(q, k, v, iv, scale)?;
    with_grad3(q, k, v, y, "training-attention", bwd)
}

/// [`attend`]'s value and its backward `dO ↦ (dq, dk, dv)` (bf16), the inputs and the rows'
/// log-sum-exp kept for it; no graph is attached (the drafter's taped backward calls it).
pub fn attend_saving(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    iv: &TrainIntervals,
    scale: f64,
) -> Result<(Tensor, Grad3)> {
    let (_, hq, r, d) = q.dims4()?;
    let (_, hkv, t, _) = k.dims4()?;
    if !serves(q, k, v) || iv.n != r || iv.t != t {
        candle_core::bail!(
            "training attention kernels: q {:?}, k {:?} ({:?}) and intervals of {} rows over {} keys do not fit",
            q.dims(),
            k.dims(),
            q.dtype(),
            iv.n,
            iv.t
        );
    }
    let qd = q.detach().contiguous()?;
    let kd = k.detach().contiguous()?;
    let vd = v.detach().contiguous()?;
    let lse = Tensor::zeros((hq, r), DType::F32, q.device())?;
    let y = qd.apply_op3_no_bwd(
        &kd,
        &vd,
        &Forward {
            iv: iv.clone(),
            lse: lse.clone(),
            scale,
        },
    )?;
    let (iv, out) = (iv.clone(), y.clone());
    let bwd = move |grad: &Tensor| {
        if grad.dtype() != DType::BF16 {
            candle_core::bail!(
                "training attention backward: a bf16 gradient expected, got {:?}",
                grad.dtype()
            );
        }
        let packed = grad.contiguous()?.apply_op1_no_bwd(&Backward {
            q: qd.clone(),
            k: kd.clone(),
            v: vd.clone(),
            out: out.clone(),
            lse: lse.clone(),
            iv: iv.clone(),
            scale,
        })?;
        let (nq, nk) = (hq * r * d, hkv * t * d);
        Ok((
            packed.narrow(0, 0, nq)?.reshape((1, hq, r, d))?,
            packed.narrow(0, nq, nk)?.reshape((1, hkv, t, d))?,
            packed.narrow(0, nq + nk, nk)?.reshape((1, hkv, t, d))?,
        ))
    };
    Ok((y, Box::new(bwd)))
}

/// The forward kernel: `q` (contiguous), `k`, `v` (contiguous) → `[1, R, hq·d]`; each row's
/// log-sum-exp into `lse` (`[hq, R]` f32, created for it).
struct Forward {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    iv: TrainIntervals,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    lse: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    scale: f64,
}

/// The backward kernels: `dO` `[1, R, hq·d]` → `[dq | dk | dv]` flat (bf16), from the forward's
/// inputs, output and log-sum-exp.
struct Backward {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    q: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    k: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    v: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    out: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    lse: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    iv: TrainIntervals,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    scale: f64,
}
