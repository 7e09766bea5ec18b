//! The kernels' launches (forward; the backward's dot, dQ, dK/dV and cast kernels) and the
//! split of the dK/dV kernel's work into blocks.

use std::ops::Range;

#[cfg(feature = "cuda")]
use candle_core::DType;
use candle_core::Result;

use super::{Backward, Forward, KEY_TILE};

/// Query rows per block of the forward and the dQ kernel (4 warps of 16).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const ROW_TILE: usize = 64;

/// Query rows per tile that the dK/dV kernel walks (`BC` of `train_attn_dkv_*`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const DKV_ROWS: usize = 32;

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
