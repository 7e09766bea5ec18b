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
        use crate::cuda::ptx::{alloc, view, with_held};
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
        let sizes = BackwardSizes {
            hq,
            hkv,
            n,
            t,
            d,
            scale: self.scale as f32,
            chunk,
            blocks,
        };
        with_held::<bf16, _>(&self.q, "q", |q| {
            with_held::<bf16, _>(&self.k, "k", |k| {
                with_held::<bf16, _>(&self.v, "v", |v| {
                    with_held::<bf16, _>(&self.out, "attention out", |out| {
                        with_held::<f32, _>(&self.lse, "lse", |lse| {
                            self.iv
                                .rows
                                .with_cuda_view("training attention intervals", |iv| {
                                    self.iv.key_rows.with_cuda_view("key tiles' rows", |kr| {
                                        let views = BackwardViews {
                                            q,
                                            k,
                                            v,
                                            out,
                                            lse,
                                            iv,
                                            kr,
                                            dout: &dout,
                                        };
                                        let bufs = BackwardBufs {
                                            dd: &dd,
                                            packed: &packed,
                                            dkv32: &dkv32,
                                            work: &work,
                                        };
                                        launch_backward(&dev, &views, &bufs, &sizes)
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

/// The sizes of the backward's kernels (their integer arguments and launch shapes).
#[cfg(feature = "cuda")]
struct BackwardSizes {
    hq: usize,
    hkv: usize,
    n: usize,
    t: usize,
    d: usize,
    scale: f32,
    /// Row tiles per item of the dK/dV kernel's work, and its blocks.
    chunk: usize,
    blocks: usize,
}

/// What the backward's kernels read: the forward's inputs and outputs and dO.
#[cfg(feature = "cuda")]
struct BackwardViews<'a> {
    q: candle_core::cuda_backend::cudarc::driver::CudaView<'a, half::bf16>,
    k: candle_core::cuda_backend::cudarc::driver::CudaView<'a, half::bf16>,
    v: candle_core::cuda_backend::cudarc::driver::CudaView<'a, half::bf16>,
    out: candle_core::cuda_backend::cudarc::driver::CudaView<'a, half::bf16>,
    lse: candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>,
    iv: candle_core::cuda_backend::cudarc::driver::CudaView<'a, u32>,
    kr: candle_core::cuda_backend::cudarc::driver::CudaView<'a, u32>,
    dout: &'a candle_core::cuda_backend::cudarc::driver::CudaView<'a, half::bf16>,
}

/// What the backward's kernels write: each row's dO·O, the packed dQ | dK | dV (bf16), the
/// dK/dV splits' f32 sums, and the dK/dV kernel's work items.
#[cfg(feature = "cuda")]
struct BackwardBufs<'a> {
    dd: &'a candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    packed: &'a candle_core::cuda_backend::cudarc::driver::CudaSlice<half::bf16>,
    dkv32: &'a candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    work: &'a candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
}

/// The backward's four launches: dO·O per row, dQ per row tile, dK/dV per work item (f32
/// atomics), and the cast of dK/dV into the packed gradient.
#[cfg(feature = "cuda")]
fn launch_backward(
    dev: &candle_core::CudaDevice,
    x: &BackwardViews<'_>,
    o: &BackwardBufs<'_>,
    s: &BackwardSizes,
) -> Result<()> {
    use crate::cuda::ptx::{elementwise, launch};
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    let d = s.d;
    let (nq, nk) = (s.hq * s.n * d, s.hkv * s.t * d);
    let (hq, hkv, n, t) = (s.hq as i32, s.hkv as i32, s.n as i32, s.t as i32);
    let (hs, sc, ch) = ((s.t * d) as i64, s.scale, s.chunk as i32);
    let blocks = |grid: (u32, u32, u32), smem: usize| LaunchConfig {
        grid_dim: grid,
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let cfg = blocks(((s.n * s.hq).div_ceil(4) as u32, 1, 1), 0);
    let dot = format!("train_attn_dot_d{d}");
    launch!(dev, &dot, DType::BF16, cfg, x.out, *x.dout, *o.dd, hq, n);
    // the kernels write disjoint parts of the fresh buffer
    let (dq, dkv) = (o.packed.slice(0..nq), o.packed.slice(nq..));
    let (dk, dv) = (o.dkv32.slice(0..nk), o.dkv32.slice(nk..));
    let cfg = blocks((s.n.div_ceil(ROW_TILE) as u32, s.hq as u32, 1), 0);
    let name = format!("train_attn_dq_d{d}");
    launch!(
        dev,
        &name,
        DType::BF16,
        cfg,
        x.q,
        x.k,
        x.v,
        *x.dout,
        x.lse,
        *o.dd,
        x.iv,
        dq,
        hq,
        hkv,
        n,
        hs,
        sc
    );
    let cfg = blocks((s.blocks as u32, s.hkv as u32, 1), dkv_smem(d));
    let name = format!("train_attn_dkv_d{d}");
    launch!(
        dev,
        &name,
        DType::BF16,
        cfg,
        x.q,
        x.k,
        x.v,
        *x.dout,
        x.lse,
        *o.dd,
        x.iv,
        x.kr,
        *o.work,
        dk,
        dv,
        hq,
        hkv,
        n,
        t,
        hs,
        sc,
        ch
    );
    let len = (2 * nk) as i64;
    let cfg = elementwise(2 * nk as u64);
    launch!(dev, "train_attn_cast", DType::BF16, cfg, *o.dkv32, dkv, len);
    Ok(())
}
