//! The softmax of the drafter's training attention, fused: scale, the draft rule's mask, one
//! softmax over [context | own block], in one pass per row (and its backward in one more), on
//! scores laid out as the two matmuls produce them.
//!
//! A window of the training layout ([`crate::ops::block_attention::attend_blocks`]) has `rows` query rows
//! (whole blocks of `block`), `hkv` K/V heads with `g` query heads each and `keys` context keys:
//! - context scores `[hkv, g, rows, keys]`: row `(h, gi, r)` holds `q·k` for the window's keys;
//! - own-block scores `[hkv, rows / block, g, block, block]`: row `(h, gi, r)` holds `q·k` for
//!   the `block` rows of r's own block.
//!
//! Row r sees the context keys `ctx_lo..ctx_hi` and the own-block keys `blk_lo..blk_hi`
//! ([`Intervals`], from [`dflash_core::visibility::draft_training_parts`]). The probabilities
//! come back flat, the context part first, each part in its scores' layout.
//! Example: B = 2, anchors at 3 and 5 of one sequence, one window over keys 0..5 → block 0's rows
//! see context 0..3 and own-block columns 0..2, block 1's rows context 0..5 and columns 0..2;
//! row 0 of head 0 with scores ctx [1, 2, 3, 9, 9], blk [0, 0] at scale 1 gets
//! softmax([1, 2, 3, 0, 0]) over those five columns and 0 at context keys 3 and 4.
//!
//! On the CPU the rows run in Rust (the reference); with CUDA, `src/ops/block_softmax.cu`.

use std::ops::Range;

use candle_core::backend::BackendStorage;

use crate::ops::kernel_io::{cpu_slice, KernelTable};
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, WithDType,
};

/// The visible columns of each query row of a window: `[ctx_lo, ctx_hi, blk_lo, blk_hi]` per
/// row, on the host and (for the kernels) on the window's GPU.
#[derive(Debug, Clone)]
pub struct Intervals {
    table: KernelTable,
}

impl Intervals {
    /// From each row's context interval (window-local key indices) and own-block interval.
    pub fn new(ctx: &[Range<usize>], own: &[Range<usize>], device: &Device) -> Result<Self> {
        if ctx.len() != own.len() {
            candle_core::bail!(
                "intervals: {} context and {} own-block rows",
                ctx.len(),
                own.len()
            );
        }
        let host: Vec<u32> = ctx
            .iter()
            .zip(own)
            .flat_map(|(c, o)| {
                // an empty range as 0..0, whatever its bounds
                let c = if c.is_empty() { 0..0 } else { c.clone() };
                let o = if o.is_empty() { 0..0 } else { o.clone() };
                [c.start as u32, c.end as u32, o.start as u32, o.end as u32]
            })
            .collect();
        Ok(Self {
            table: KernelTable::new(host, device)?,
        })
    }

    pub fn rows(&self) -> usize {
        self.table.host.len() / 4
    }

    /// Row `r`: `[ctx_lo, ctx_hi, blk_lo, blk_hi]`.
    fn row(&self, r: usize) -> &[u32] {
        &self.table.host[4 * r..4 * r + 4]
    }
}

/// The shape of one window's scores (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockGeometry {
    pub hkv: usize,
    pub g: usize,
    pub rows: usize,
    pub keys: usize,
    pub block: usize,
    pub scale: f64,
}

impl BlockGeometry {
    /// Values of the context part.
    pub fn n_ctx(&self) -> usize {
        self.hkv * self.g * self.rows * self.keys
    }
    /// Values of the own-block part.
    pub fn n_blk(&self) -> usize {
        self.hkv * self.g * self.rows * self.block
    }
    fn score_rows(&self) -> usize {
        self.hkv * self.g * self.rows
    }
    /// Offsets of score row `row` (over `hkv · g · rows`) in the context and own-block parts.
    fn offsets(&self, row: usize) -> (usize, usize) {
        let r = row % self.rows;
        let hg = row / self.rows;
        let (gi, h) = (hg % self.g, hg / self.g);
        let nbw = self.rows / self.block;
        let b0 =
            (((h * nbw + r / self.block) * self.g + gi) * self.block + r % self.block) * self.block;
        (row * self.keys, b0)
    }
    /// Check an op's inputs against the geometry: the context scores (`ctx`: a one-value
    /// stand-in when there are no context keys, counted as 0), the own-block scores, and the
    /// probabilities (`p`, backward) or the intervals' rows (forward). Returns the context
    /// part's layout to read.
    fn validate(
        &self,
        what: &str,
        ctx: &Layout,
        blk: &Layout,
        p: Option<&Layout>,
        iv_rows: Option<usize>,
    ) -> Result<Layout> {
        let ctx = if self.n_ctx() == 0 {
            Layout::contiguous(Shape::from(0))
        } else {
            ctx.clone()
        };
        if self.block == 0 || !self.rows.is_multiple_of(self.block) {
            candle_core::bail!(
                "{what}: {} rows are not whole blocks of {}",
                self.rows,
                self.block
            );
        }
        if ctx.shape().elem_count() != self.n_ctx() || blk.shape().elem_count() != self.n_blk() {
            candle_core::bail!(
                "{what}: scores of {} and {} values, the geometry {self:?} needs {} and {}",
                ctx.shape().elem_count(),
                blk.shape().elem_count(),
                self.n_ctx(),
                self.n_blk()
            );
        }
        if let Some(n) = iv_rows.filter(|&n| n != self.rows) {
            candle_core::bail!(
                "{what}: intervals for {n} rows, the window has {}",
                self.rows
            );
        }
        let n = self.n_ctx() + self.n_blk();
        if let Some(c) = p.map(|p| p.shape().elem_count()).filter(|&c| c != n) {
            candle_core::bail!("{what}: {c} probabilities, {n} expected");
        }
        Ok(ctx)
    }

    /// The kernels' geometry arguments `(g, rw, kw, bs, nbw, scale)` and launch shape (one
    /// block of 128 threads per score row).
    #[cfg(feature = "cuda")]
    fn kernel_args(
        &self,
    ) -> (
        (i32, i32, i32, i32, i32, f32),
        candle_core::cuda_backend::cudarc::driver::LaunchConfig,
    ) {
        let i = |x: usize| x as i32;
        (
            (
                i(self.g),
                i(self.rows),
                i(self.keys),
                i(self.block),
                i(self.rows / self.block),
                self.scale as f32,
            ),
            crate::cuda::ptx::rows(self.score_rows(), 128),
        )
    }
}

/// The probabilities (flat: context part, then own-block part) of one window's scores.
pub fn block_softmax(
    ctx: &Tensor,
    blk: &Tensor,
    iv: &Intervals,
    geo: BlockGeometry,
) -> Result<Tensor> {
    if let Some(r) = (0..iv.rows()).find(|&r| {
        let h = iv.row(r);
        h[0] > h[1] || h[1] as usize > geo.keys || h[2] > h[3] || h[3] as usize > geo.block
    }) {
        candle_core::bail!(
            "block softmax: row {r}'s intervals {:?} fall outside {} context keys and a block of {}",
            iv.row(r),
            geo.keys,
            geo.block
        );
    }
    let ctx = if geo.n_ctx() == 0 {
        // no context keys: a one-value stand-in the kernel never reads
        Tensor::zeros(1, blk.dtype(), blk.device())?
    } else {
        ctx.contiguous()?
    };
    ctx.apply_op2_no_bwd(&blk.contiguous()?, &Fwd { iv, geo })
}

/// The scores' gradient (flat, as [`block_softmax`]'s output) from the probabilities `p` and
/// their gradient in the two parts' layouts: `dS = scale · P ⊙ (dP − Σ_row P ⊙ dP)`.
pub fn block_softmax_bwd(
    p: &Tensor,
    dctx: &Tensor,
    dblk: &Tensor,
    geo: BlockGeometry,
) -> Result<Tensor> {
    let dctx = if geo.n_ctx() == 0 {
        Tensor::zeros(1, dblk.dtype(), dblk.device())?
    } else {
        dctx.contiguous()?
    };
    p.contiguous()?
        .apply_op3_no_bwd(&dctx, &dblk.contiguous()?, &Bwd { geo })
}

struct Fwd<'a> {
    iv: &'a Intervals,
    geo: BlockGeometry,
}

struct Bwd {
    geo: BlockGeometry,
}

fn fwd_rows<T: WithDType>(ctx: &[T], blk: &[T], iv: &[u32], geo: &BlockGeometry) -> Vec<T> {
    let n_ctx = geo.n_ctx();
    let mut p = vec![T::zero(); n_ctx + geo.n_blk()];
    let scale = geo.scale;
    for row in 0..geo.score_rows() {
        let (a0, b0) = geo.offsets(row);
        let r = row % geo.rows;
        let (c, k) = (
            iv[4 * r] as usize..iv[4 * r + 1] as usize,
            iv[4 * r + 2] as usize..iv[4 * r + 3] as usize,
        );
        let xc = |i: usize| ctx[a0 + i].to_f64() * scale;
        let xb = |i: usize| blk[b0 + i].to_f64() * scale;
        let m = c
            .clone()
            .map(xc)
            .chain(k.clone().map(xb))
            .fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = c
            .clone()
            .map(|i| (xc(i) - m).exp())
            .chain(k.clone().map(|i| (xb(i) - m).exp()))
            .sum();
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        for i in c {
            p[a0 + i] = T::from_f64((xc(i) - m).exp() * inv);
        }
        for i in k {
            p[n_ctx + b0 + i] = T::from_f64((xb(i) - m).exp() * inv);
        }
    }
    p
}

fn bwd_rows<T: WithDType>(p: &[T], dctx: &[T], dblk: &[T], geo: &BlockGeometry) -> Vec<T> {
    let (n_ctx, kw, bs) = (geo.n_ctx(), geo.keys, geo.block);
    let mut ds = vec![T::zero(); n_ctx + geo.n_blk()];
    for row in 0..geo.score_rows() {
        let (a0, b0) = geo.offsets(row);
        let s: f64 = (0..kw)
            .map(|i| p[a0 + i].to_f64() * dctx[a0 + i].to_f64())
            .chain((0..bs).map(|i| p[n_ctx + b0 + i].to_f64() * dblk[b0 + i].to_f64()))
            .sum();
        for i in 0..kw {
            ds[a0 + i] = T::from_f64(geo.scale * p[a0 + i].to_f64() * (dctx[a0 + i].to_f64() - s));
        }
        for i in 0..bs {
            let j = n_ctx + b0 + i;
            ds[j] = T::from_f64(geo.scale * p[j].to_f64() * (dblk[b0 + i].to_f64() - s));
        }
    }
    ds
}

impl CustomOp2 for Fwd<'_> {
    fn name(&self) -> &'static str {
        "block-softmax"
    }
    fn cpu_fwd(
        &self,
        c: &CpuStorage,
        lc: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let geo = &self.geo;
        let lc = geo.validate("block softmax", lc, lb, None, Some(self.iv.rows()))?;
        let n = geo.n_ctx() + geo.n_blk();
        macro_rules! run {
            ($t:ty) => {{
                let c = if geo.n_ctx() == 0 {
                    &[][..]
                } else {
                    cpu_slice::<$t>(c, &lc, "block softmax")?
                };
                let v = fwd_rows(
                    c,
                    cpu_slice::<$t>(b, lb, "block softmax")?,
                    &self.iv.table.host,
                    geo,
                );
                <$t as WithDType>::to_cpu_storage_owned(v)
            }};
        }
        let out = match b.dtype() {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            DType::BF16 => run!(half::bf16),
            other => candle_core::bail!("block softmax: {other:?} scores are not supported"),
        };
        Ok((out, Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, view};
        let geo = &self.geo;
        let lc = geo.validate("block softmax", lc, lb, None, Some(self.iv.rows()))?;
        let dev = b.device().clone();
        let n = geo.n_ctx() + geo.n_blk();
        let ((g, rw, kw, bs, nbw, scale), cfg) = geo.kernel_args();
        self.iv
            .table
            .with_cuda_view("block softmax intervals", |iv| {
                macro_rules! run {
                    ($t:ty, $dt:expr) => {{
                        // an empty context part: the own-block scores stand in (never read)
                        let cs = if geo.n_ctx() == 0 {
                            view::<$t>(b, lb, "scores")?
                        } else {
                            view::<$t>(c, &lc, "scores")?
                        };
                        let bv = view::<$t>(b, lb, "scores")?;
                        let p = alloc::<$t>(&dev, n)?;
                        launch!(
                            dev,
                            "block_softmax_fwd",
                            $dt,
                            cfg,
                            cs,
                            bv,
                            p,
                            iv,
                            g,
                            rw,
                            kw,
                            bs,
                            nbw,
                            scale
                        );
                        candle_core::CudaStorage::wrap_cuda_slice(p, dev.clone())
                    }};
                }
                let out = match b.dtype() {
                    DType::F32 => run!(f32, DType::F32),
                    DType::BF16 => run!(half::bf16, DType::BF16),
                    other => {
                        candle_core::bail!("block softmax: no CUDA kernel for {other:?} scores")
                    }
                };
                Ok((out, Shape::from(n)))
            })
    }
}

impl CustomOp3 for Bwd {
    fn name(&self) -> &'static str {
        "block-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        p: &CpuStorage,
        lp: &Layout,
        c: &CpuStorage,
        lc: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let geo = &self.geo;
        let lc = geo.validate("block softmax backward", lc, lb, Some(lp), None)?;
        let n = geo.n_ctx() + geo.n_blk();
        macro_rules! run {
            ($t:ty) => {{
                let c = if geo.n_ctx() == 0 {
                    &[][..]
                } else {
                    cpu_slice::<$t>(c, &lc, "gradient")?
                };
                let v = bwd_rows(
                    cpu_slice::<$t>(p, lp, "probabilities")?,
                    c,
                    cpu_slice::<$t>(b, lb, "gradient")?,
                    geo,
                );
                <$t as WithDType>::to_cpu_storage_owned(v)
            }};
        }
        let out = match p.dtype() {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            DType::BF16 => run!(half::bf16),
            other => candle_core::bail!("block softmax backward: {other:?} is not supported"),
        };
        Ok((out, Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        lp: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, view};
        let geo = &self.geo;
        let lc = geo.validate("block softmax backward", lc, lb, Some(lp), None)?;
        let dev = p.device().clone();
        let n = geo.n_ctx() + geo.n_blk();
        let ((g, rw, kw, bs, nbw, scale), cfg) = geo.kernel_args();
        macro_rules! run {
            ($t:ty, $dt:expr) => {{
                let pv = view::<$t>(p, lp, "probabilities")?;
                let cs = if geo.n_ctx() == 0 {
                    view::<$t>(b, lb, "gradient")?
                } else {
                    view::<$t>(c, &lc, "gradient")?
                };
                let bv = view::<$t>(b, lb, "gradient")?;
                let ds = alloc::<$t>(&dev, n)?;
                launch!(
                    dev,
                    "block_softmax_bwd",
                    $dt,
                    cfg,
                    pv,
                    cs,
                    bv,
                    ds,
                    g,
                    rw,
                    kw,
                    bs,
                    nbw,
                    scale
                );
                candle_core::CudaStorage::wrap_cuda_slice(ds, dev.clone())
            }};
        }
        let out = match p.dtype() {
            DType::F32 => run!(f32, DType::F32),
            DType::BF16 => run!(half::bf16, DType::BF16),
            other => candle_core::bail!("block softmax backward: no CUDA kernel for {other:?}"),
        };
        Ok((out, Shape::from(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The module doc's example: B = 2, anchors 3 and 5, one window over context keys 0..5.
    #[test]
    fn the_docs_example() {
        let geo = BlockGeometry {
            hkv: 1,
            g: 1,
            rows: 4,
            keys: 5,
            block: 2,
            scale: 1.0,
        };
        let iv = Intervals::new(
            &[0..3, 0..3, 0..5, 0..5],
            &[0..2, 0..2, 0..2, 0..2],
            &Device::Cpu,
        )
        .unwrap();
        let mut ctx = vec![0f64; 20];
        ctx[..5].copy_from_slice(&[1.0, 2.0, 3.0, 9.0, 9.0]);
        let ctx = Tensor::from_vec(ctx, (1, 1, 4, 5), &Device::Cpu).unwrap();
        let blk = Tensor::zeros((1, 2, 1, 2, 2), DType::F64, &Device::Cpu).unwrap();
        let p = block_softmax(&ctx, &blk, &iv, geo)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        assert_eq!(p.len(), geo.n_ctx() + geo.n_blk());
        let z: f64 = [1f64, 2.0, 3.0, 0.0, 0.0].iter().map(|x| x.exp()).sum();
        let want = [1f64.exp() / z, 2f64.exp() / z, 3f64.exp() / z, 0.0, 0.0];
        for (a, b) in p[..5].iter().zip(&want) {
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
        // row 0's own-block part: the first two values of the block part
        assert!((p[20] - 1.0 / z).abs() < 1e-12 && (p[21] - 1.0 / z).abs() < 1e-12);
        // every row sums to 1
        for r in 0..4 {
            let s: f64 = p[r * 5..r * 5 + 5].iter().sum::<f64>() + p[20 + 2 * r] + p[21 + 2 * r];
            assert!((s - 1.0).abs() < 1e-12, "row {r}: {s}");
        }
        // the backward of a constant upstream gradient is zero (softmax rows sum to 1)
        let ones_c = Tensor::ones((1, 1, 4, 5), DType::F64, &Device::Cpu).unwrap();
        let ones_b = Tensor::ones((1, 2, 1, 2, 2), DType::F64, &Device::Cpu).unwrap();
        let pt = Tensor::from_vec(p, 28, &Device::Cpu).unwrap();
        let ds = block_softmax_bwd(&pt, &ones_c, &ones_b, geo)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        assert!(ds.iter().all(|x| x.abs() < 1e-12));
        // mismatched intervals are refused by name
        let one_row = |r: Range<usize>| std::iter::once(r).collect::<Vec<_>>();
        let bad = Intervals::new(&one_row(0..3), &one_row(0..2), &Device::Cpu).unwrap();
        let err = block_softmax(&ctx, &blk, &bad, geo).unwrap_err();
        assert!(err.to_string().contains("intervals for 1 rows"), "{err}");
        // and intervals past the window's keys
        let wide = Intervals::new(
            &[0..6, 0..3, 0..5, 0..5],
            &[0..2, 0..2, 0..2, 0..2],
            &Device::Cpu,
        )
        .unwrap();
        let err = block_softmax(&ctx, &blk, &wide, geo).unwrap_err();
        assert!(
            err.to_string().contains("fall outside 5 context keys"),
            "{err}"
        );
    }
}
