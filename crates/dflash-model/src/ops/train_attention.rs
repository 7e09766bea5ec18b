//! The drafter's training attention as flash-style tensor-core kernels, forward and backward,
//! scores never written: each of the `R = nb · B` block rows sees its context keys and its own
//! block's (the draft rule's two parts, [`dflash_core::visibility::draft_training_parts`]), one
//! online softmax over both; the backward recomputes the probabilities from each row's saved
//! log-sum-exp (`train_attn_fwd_*` in `src/cuda/mma_attn.cuh`, `train_attn_dq_*`,
//! `train_attn_dkv_*` and `train_attn_dot_*` in `src/cuda/train_attn.cuh`). Its twin, and the
//! path wherever it does not serve (the CPU, f32, other head dims), is
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

/// Keys per block of the dK/dV kernel (4 warps of 16): [`TrainIntervals`] lists, per tile of
/// this many keys, the rows that may see it.
pub const KEY_TILE: usize = 64;

/// Query rows per block of the forward and the dQ kernel (4 warps of 16).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const ROW_TILE: usize = 64;

/// Query rows per tile that the dK/dV kernel walks (`BC` of `train_attn_dkv_*`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const DKV_ROWS: usize = 32;

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

/// Blocks of the dK/dV kernel to aim for over all K/V heads, unless `DFLASH_DKV_BLOCKS` says
/// otherwise: each block adds its part of dK and dV into f32 buffers (atomics), so fewer,
/// longer blocks add less, and more, shorter ones balance better.
pub const DKV_BLOCKS: usize = 2048;

/// [`DKV_BLOCKS`], or the runtime configuration's `tuning.dkv_blocks` (`DFLASH_DKV_BLOCKS`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn dkv_blocks() -> usize {
    dflash_core::runtime::current()
        .tuning
        .dkv_blocks
        .unwrap_or(DKV_BLOCKS)
}

/// The dK/dV kernel's work items (each run by one block per K/V head): `(chunk, work)`, `work`
/// holding for each item its key tile and the first of the at most `chunk` row tiles it walks
/// (of the tile's `g · ⌈rows / 32⌉`, `g` the query heads per K/V head), `chunk` chosen for about
/// `blocks` blocks over the `hkv` K/V heads and at least 16 row tiles each; a key tile that no
/// row sees gets no item.
/// Example: Qwen3-8B's layer (g = 4, 8 K/V heads) with anchors every 4 tokens of a 2,048-token
/// row: the 32 context tiles have 1,024, 992, … 32 row tiles, the 128 own-block tiles 8 each,
/// 17,920 in all; for 2,048 blocks, chunks of 70 and 385 items (15 for the first context tile,
/// one per own-block tile), 3,080 blocks.
pub fn dkv_work(
    key_rows: impl Iterator<Item = Range<usize>>,
    g: usize,
    hkv: usize,
    blocks: usize,
) -> (usize, Vec<u32>) {
    let tiles: Vec<usize> = key_rows.map(|r| g * r.len().div_ceil(DKV_ROWS)).collect();
    let chunk = (tiles.iter().sum::<usize>() * hkv)
        .div_ceil(blocks.max(1))
        .max(16);
    let mut work = Vec::new();
    for (k, &n) in tiles.iter().enumerate() {
        for i0 in (0..n).step_by(chunk) {
            work.extend([k as u32, i0 as u32]);
        }
    }
    (chunk, work)
}

/// Dynamic shared memory of `train_attn_dkv_*` for head dim `d`: K and V of [`KEY_TILE`] keys,
/// two buffers each of Q and dO ([`DKV_ROWS`] rows, rows padded by 8 values), two of the rows'
/// (lse, dd) and intervals. Example: head dim 128 → 71,168 bytes.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn dkv_smem(d: usize) -> usize {
    (2 * KEY_TILE + 4 * DKV_ROWS) * (d + 8) * 2 + 2 * DKV_ROWS * (2 * 4 + 4 * 4)
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

const CPU: &str =
    "the training attention kernels are CUDA's: the CPU attends through attend_blocks";

impl candle_core::CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        "training-attention"
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
        candle_core::bail!("{CPU}")
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
        use crate::cuda::ptx::{alloc, launch, view, with_held};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        use half::bf16;
        let (_, hq, n, d) = ql.shape().dims4()?;
        let (_, hkv, t, _) = kl.shape().dims4()?;
        let dev = qs.device.clone();
        let (q, k, v) = (
            view::<bf16>(qs, ql, "q")?,
            view::<bf16>(ks, kl, "k")?,
            view::<bf16>(vs, vl, "v")?,
        );
        let out = alloc::<bf16>(&dev, n * hq * d)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(ROW_TILE) as u32, hq as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (hq_, hkv_, n_, hs, sc) = (
            hq as i32,
            hkv as i32,
            n as i32,
            (t * d) as i64,
            self.scale as f32,
        );
        let name = format!("train_attn_fwd_d{d}");
        self.iv
            .rows
            .with_cuda_view("training attention intervals", |iv| {
                with_held::<f32, _>(&self.lse, "training attention lse", |lse| {
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
                        lse,
                        hq_,
                        hkv_,
                        n_,
                        hs,
                        sc
                    );
                    Ok(())
                })
            })?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            candle_core::Shape::from((1, n, hq * d)),
        ))
    }
}

impl candle_core::CustomOp1 for Backward {
    fn name(&self) -> &'static str {
        "training-attention-backward"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("{CPU}")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use crate::cuda::ptx::{alloc, elementwise, launch, view, with_held};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        use half::bf16;
        let (_, hq, n, d) = self.q.dims4()?;
        let (_, hkv, t, _) = self.k.dims4()?;
        let dev = gs.device.clone();
        let dout = view::<bf16>(gs, gl, "dO")?;
        let (nq, nk) = (hq * n * d, hkv * t * d);
        let packed = alloc::<bf16>(&dev, nq + 2 * nk)?;
        let dd = alloc::<f32>(&dev, hq * n)?;
        // the dK/dV splits' sums, then rounded into `packed`
        let dkv32 = dev.alloc_zeros::<f32>(2 * nk)?;
        let tiles = t.div_ceil(KEY_TILE);
        let rows = (0..tiles).map(|i| self.iv.key_rows(i));
        let (chunk, work) = dkv_work(rows, hq / hkv, hkv, dkv_blocks());
        let blocks = work.len() / 2;
        let work = dev.clone_htod(&work)?;
        let (hq_, hkv_, n_, t_, hs, sc) = (
            hq as i32,
            hkv as i32,
            n as i32,
            t as i32,
            (t * d) as i64,
            self.scale as f32,
        );
        let row_tiles = n.div_ceil(ROW_TILE) as u32;
        with_held::<bf16, _>(&self.q, "q", |q| {
            with_held::<bf16, _>(&self.k, "k", |k| {
                with_held::<bf16, _>(&self.v, "v", |v| {
                    with_held::<bf16, _>(&self.out, "attention out", |out| {
                        with_held::<f32, _>(&self.lse, "lse", |lse| {
                            self.iv
                                .rows
                                .with_cuda_view("training attention intervals", |iv| {
                                    self.iv.key_rows.with_cuda_view("key tiles' rows", |kr| {
                                        let warps = (n * hq).div_ceil(4) as u32;
                                        let cfg = LaunchConfig {
                                            grid_dim: (warps, 1, 1),
                                            block_dim: (128, 1, 1),
                                            shared_mem_bytes: 0,
                                        };
                                        let dot = format!("train_attn_dot_d{d}");
                                        launch!(
                                            dev,
                                            &dot,
                                            DType::BF16,
                                            cfg,
                                            out,
                                            dout,
                                            dd,
                                            hq_,
                                            n_
                                        );
                                        // the kernels write disjoint parts of the fresh buffer
                                        let dq = packed.slice(0..nq);
                                        let dkv = packed.slice(nq..);
                                        let dk = dkv32.slice(0..nk);
                                        let dv = dkv32.slice(nk..);
                                        let cfg = LaunchConfig {
                                            grid_dim: (row_tiles, hq as u32, 1),
                                            block_dim: (128, 1, 1),
                                            shared_mem_bytes: 0,
                                        };
                                        let name = format!("train_attn_dq_d{d}");
                                        launch!(
                                            dev,
                                            &name,
                                            DType::BF16,
                                            cfg,
                                            q,
                                            k,
                                            v,
                                            dout,
                                            lse,
                                            dd,
                                            iv,
                                            dq,
                                            hq_,
                                            hkv_,
                                            n_,
                                            hs,
                                            sc
                                        );
                                        let cfg = LaunchConfig {
                                            grid_dim: (blocks as u32, hkv as u32, 1),
                                            block_dim: (128, 1, 1),
                                            shared_mem_bytes: dkv_smem(d) as u32,
                                        };
                                        let name = format!("train_attn_dkv_d{d}");
                                        let ch = chunk as i32;
                                        launch!(
                                            dev,
                                            &name,
                                            DType::BF16,
                                            cfg,
                                            q,
                                            k,
                                            v,
                                            dout,
                                            lse,
                                            dd,
                                            iv,
                                            kr,
                                            work,
                                            dk,
                                            dv,
                                            hq_,
                                            hkv_,
                                            n_,
                                            t_,
                                            hs,
                                            sc,
                                            ch
                                        );
                                        let len = (2 * nk) as i64;
                                        let cfg = elementwise(2 * nk as u64);
                                        launch!(
                                            dev,
                                            "train_attn_cast",
                                            DType::BF16,
                                            cfg,
                                            dkv32,
                                            dkv,
                                            len
                                        );
                                        Ok(())
                                    })
                                })
                        })
                    })
                })
            })
        })?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(packed, dev),
            candle_core::Shape::from(nq + 2 * nk),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_core::segments::Segments;
    use dflash_core::visibility::{draft_training, draft_training_parts, DraftRule};

    /// The kernels' intervals are the dense training mask: row r sees key c exactly when c lies
    /// in one of its two intervals, and every such row lies in its key tile's row range (full,
    /// sliding-window and causal rules; two packed segments; anchors unsorted).
    #[test]
    fn intervals_and_key_tiles_cover_the_training_mask() {
        let segs = Segments::from_lengths(&[150, 170]);
        let anchors = [3usize, 40, 149, 77, 155, 200, 260, 300];
        let block = 16;
        let rules = [
            DraftRule::FULL,
            DraftRule {
                sliding_window: Some(50),
                causal: false,
            },
            DraftRule {
                sliding_window: None,
                causal: true,
            },
        ];
        for rule in rules {
            let (c, o) = draft_training_parts(rule, &segs, &anchors, block);
            let dense = draft_training(rule, &segs, &anchors, block);
            let m = segs.len();
            let iv = TrainIntervals::new(&c, &o, block, m, &Device::Cpu).unwrap();
            assert_eq!((iv.n, iv.t), (dense.rows, dense.cols));
            for r in 0..dense.rows {
                let (a, b) = iv.row(r);
                for key in 0..dense.cols {
                    let seen = a.contains(&key) || b.contains(&key);
                    assert_eq!(seen, dense.get(r, key), "rule {rule:?} row {r} key {key}");
                    if seen {
                        assert!(iv.key_rows(key / KEY_TILE).contains(&r));
                    }
                }
            }
        }
    }

    /// The module's example: rows per 64-key tile, and each row's two intervals.
    #[test]
    fn the_example_holds() {
        let segs = Segments::from_lengths(&[200]);
        let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &[37, 90], 16);
        let iv = TrainIntervals::new(&c, &o, 16, 200, &Device::Cpu).unwrap();
        assert_eq!(iv.row(0), (0..37, 200..216));
        assert_eq!(iv.row(16), (0..90, 216..232));
        assert_eq!(iv.key_rows(0), 0..32);
        assert_eq!(iv.key_rows(1), 16..32);
        assert_eq!(iv.key_rows(2), 0..0);
        assert_eq!(iv.key_rows(3), 0..32);
    }

    /// The dK/dV kernel's blocks: the doc's Qwen3-8B example (anchors every 4 tokens), and a
    /// small layout in one chunk per seen key tile, the unseen tile left out.
    #[test]
    fn dkv_work_splits_the_seen_tiles() {
        let segs = Segments::from_lengths(&[2048]);
        let anchors: Vec<usize> = (0..512).map(|i| 4 * i).collect();
        let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &anchors, 16);
        let iv = TrainIntervals::new(&c, &o, 16, 2048, &Device::Cpu).unwrap();
        let rows = || (0..iv.t.div_ceil(KEY_TILE)).map(|k| iv.key_rows(k));
        let (chunk, work) = dkv_work(rows(), 4, 8, 2048);
        assert_eq!((chunk, work.len() / 2), (70, 385));
        let first: Vec<u32> = work.chunks(2).filter(|w| w[0] == 0).map(|w| w[1]).collect();
        assert_eq!(first.len(), 15);
        assert_eq!(&first[..3], &[0, 70, 140]);
        assert_eq!(work.chunks(2).filter(|w| w[0] == 40).count(), 1);
        // per K/V head's 1,024 blocks: chunks of 18, 1,081 items
        let (chunk, work) = dkv_work(rows(), 4, 8, 8 * 1024);
        assert_eq!((chunk, work.len() / 2), (18, 1081));

        let segs = Segments::from_lengths(&[200]);
        let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &[37, 90], 16);
        let iv = TrainIntervals::new(&c, &o, 16, 200, &Device::Cpu).unwrap();
        let (chunk, work) = dkv_work((0..4).map(|k| iv.key_rows(k)), 3, 1, DKV_BLOCKS);
        assert_eq!(chunk, 16);
        // tiles 0, 1 and 3 are seen (tile 2, keys 128..192, by no row)
        assert_eq!(work, vec![0, 0, 1, 0, 3, 0]);
    }

    /// Misfitting parts are refused by name.
    #[test]
    fn misfitting_parts_are_refused() {
        let segs = Segments::from_lengths(&[40]);
        let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &[5], 16);
        let e = TrainIntervals::new(&c, &o, 8, 40, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("do not fit B = 8"), "{e}");
        let e = TrainIntervals::new(&c, &o, 16, 3, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("past the 3 context rows"), "{e}");
    }
}
