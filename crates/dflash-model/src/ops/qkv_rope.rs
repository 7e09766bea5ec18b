//! An attention layer's work between its projections and its attention (the target's, and the
//! drafter's block), as one kernel on a GPU: each head of the new rows split from the
//! projections, the per-head RMSNorm of Qwen3's queries and keys (zero-centred for Qwen3.5/3.6,
//! whose queries come gated and whose RoPE rotates part of each head), RoPE at each row's
//! position, the queries laid out head-major for the attention and the keys and values written
//! into the cache's buffers at their rows.
//! Unfused that is three head transposes, two norms, two RoPEs and two cache writes per layer
//! (nine small kernels, each launched and each reading its rows again), [`unfused`]: the CPU's path and the kernel's twin (`check device` compares them).
//!
//! Example: Qwen3-8B (32 query heads, 8 K/V heads of 128), a 16-row verify after 500 cached
//! rows: from `q [1, 16, 4096]`, `k, v [1, 16, 1024]` (views of one fused QKV product or three
//! products) to `q [1, 32, 16, 128]` normed and rotated, and K/V rows 500..516 of each of the 8
//! heads written, in one launch of 16 × 48 blocks.

use candle_core::{DType, Result, Tensor};

use crate::cache::kv_cache::KvCache;
use crate::layers::norm::RmsNorm;
use crate::layers::rope::RopeTables;
use crate::ops::permute::swap_rows_heads;

/// Query heads, K/V heads and the head dim of an attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub q: usize,
    pub kv: usize,
    pub dim: usize,
}

/// Where a forward's new K/V rows go: after the cache's rows in buffers that grow (`cap`
/// `None`), or through the fixed layout's device index into buffers of exactly `cap` rows
/// (`index` `[b, hkv, n, dim]` u32, every element of row j naming the same cache row).
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub index: Option<&'a Tensor>,
    pub cap: Option<usize>,
}

impl<'a> Rows<'a> {
    /// After the cache's rows, in buffers that grow.
    pub const APPEND: Rows<'static> = Rows {
        index: None,
        cap: None,
    };

    /// Through the fixed layout's `index` into buffers of exactly `cap` rows.
    pub fn fixed(index: &'a Tensor, cap: usize) -> Self {
        Self {
            index: Some(index),
            cap: Some(cap),
        }
    }
}

/// The projections of the new rows: `q [b, nq, heads · dim]` (`[b, nq, heads · 2 · dim]` where
/// `gated`: `[query | gate]` per head, qwen3_5, of which the queries are read), `k`, `v` `[b, n,
/// kv_heads · dim]` (views whose rows are evenly strided, e.g. column ranges of one fused
/// product). The target: `nq = n`; the drafter: queries from the block's rows, keys and values
/// from the context's and the block's. Example (Qwen3.6-27B, 24 heads of 256, gated): `q` of
/// 12,288 columns, head 1's queries at columns 512..768.
#[derive(Debug, Clone, Copy)]
pub struct Projections<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub gated: bool,
}

impl<'a> Projections<'a> {
    /// Projections whose queries are not gated.
    pub fn plain(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor) -> Self {
        Self {
            q,
            k,
            v,
            gated: false,
        }
    }

    /// Query head h's start in a row of `q`: `h · dim`, or `h · 2 · dim` where gated (with
    /// `dim` 1: the query row's width in heads).
    fn q_head_stride(&self, dim: usize) -> usize {
        if self.gated {
            2 * dim
        } else {
            dim
        }
    }
}

/// Half `part` (0: the queries, 1: the gates) of gated projections `[b, n, heads · 2 · dim]`
/// (`[query | gate]` per head), a view `[b, n, heads, dim]`. Example: 24 heads of 256 → the
/// gates of head 1 are columns 768..1,024.
fn gated_half(q: &Tensor, heads: Heads, part: usize) -> Result<Tensor> {
    let (b, n, _) = q.dims3()?;
    q.reshape((b, n, heads.q, 2 * heads.dim))?
        .narrow(3, part * heads.dim, heads.dim)
}

/// The gates of gated projections (see [`Projections`]): a view `[b, n, heads, dim]`, read
/// where it is.
pub fn gates(q: &Tensor, heads: Heads) -> Result<Tensor> {
    gated_half(q, heads, 1)
}

/// The queries of gated projections as `[b, n, heads · dim]` (contiguous).
fn gated_queries(q: &Tensor, heads: Heads) -> Result<Tensor> {
    let (b, n, _) = q.dims3()?;
    gated_half(q, heads, 0)?
        .contiguous()?
        .reshape((b, n, heads.q * heads.dim))
}

/// RoPE tables of the query rows and of the key rows (the target: the same table twice).
#[derive(Debug, Clone, Copy)]
pub struct Tables<'a> {
    pub q: &'a RopeTables,
    pub kv: &'a RopeTables,
}

/// Queries `[b, heads, nq, dim]` normed (where the layer norms them) and rotated, and the
/// layer's K/V as attention reads them ([`KvCache::wrote`]), with this forward's rows written.
/// The fused kernel where [`serves`], else [`unfused`].
pub fn apply(
    p: Projections,
    heads: Heads,
    norms: (Option<&RmsNorm>, Option<&RmsNorm>),
    rope: Tables,
    rows: Rows,
    cache: &mut KvCache,
    layer: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    if serves(p, heads, norms, rope, rows) {
        fused(p, heads, norms, rope, rows, cache, layer)
    } else {
        unfused(p, heads, norms, rope, rows, cache, layer)
    }
}

/// The composed form of [`apply`]: each projection as heads (normed per head where the layer
/// does), transposed head-major, RoPE, and the cache's `append` or `write_fixed`.
pub fn unfused(
    p: Projections,
    heads: Heads,
    (q_norm, k_norm): (Option<&RmsNorm>, Option<&RmsNorm>),
    rope: Tables,
    rows: Rows,
    cache: &mut KvCache,
    layer: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let queries;
    let p = match p.gated {
        true => {
            queries = gated_queries(p.q, heads)?;
            Projections {
                q: &queries,
                gated: false,
                ..p
            }
        }
        false => p,
    };
    let (q, k, v) = heads_rotated(p, heads, (q_norm, k_norm), rope)?;
    let (k, v) = match (rows.index, rows.cap) {
        (Some(index), Some(cap)) => cache.write_fixed(layer, &k, &v, index, cap)?,
        (None, None) => cache.append(layer, &k, &v)?,
        _ => candle_core::bail!("K/V rows: a fixed layout needs both its index and its capacity"),
    };
    Ok((q, k, v))
}

/// The composed per-head work without a cache (training's drafter forward, and [`unfused`]'s
/// first half): each projection as heads `[b, h, rows, dim]`, normed per head where the layer
/// does, q and k rotated with their tables.
pub fn heads_rotated(
    p: Projections,
    heads: Heads,
    (q_norm, k_norm): (Option<&RmsNorm>, Option<&RmsNorm>),
    rope: Tables,
) -> Result<(Tensor, Tensor, Tensor)> {
    if p.gated {
        candle_core::bail!("heads_rotated takes the queries apart from their gates");
    }
    let b = p.q.dim(0)?;
    let split = |t: &Tensor, h: usize, norm: Option<&RmsNorm>| -> Result<Tensor> {
        let n = t.dim(1)?;
        let t = t.reshape((b, n, h, heads.dim))?;
        let t = match norm {
            Some(nm) => nm.forward(&t)?,
            None => t,
        };
        swap_rows_heads(&t)
    };
    let q = rope.q.apply(&split(p.q, heads.q, q_norm)?)?;
    let k = rope.kv.apply(&split(p.k, heads.kv, k_norm)?)?;
    let v = split(p.v, heads.kv, None)?;
    Ok((q, k, v))
}

/// Whether the fused kernel takes this layer's rows: a CUDA device, f32 or bf16 throughout,
/// an even head dim of at most 512 rotated whole or in part (an even number of its first
/// features), RMSNorm weights of one kind (plain in the storage type, or zero-centred in f32),
/// projections whose rows are evenly strided with unit column stride, RoPE tables of one row
/// per new row (or per sequence row), and a well-formed cache destination.
/// `DFLASH_DISABLED_KERNELS=qkv-rope` turns it off.
pub fn serves(
    p: Projections,
    heads: Heads,
    (q_norm, k_norm): (Option<&RmsNorm>, Option<&RmsNorm>),
    rope: Tables,
    rows: Rows,
) -> bool {
    let off = dflash_core::runtime::off(dflash_core::runtime::Kernel::QkvRope);
    if off || !p.q.device().is_cuda() {
        return false;
    }
    let dt = p.q.dtype();
    let (Ok((b, nq, _)), Ok(n)) = (p.q.dims3(), p.k.dim(1)) else {
        return false;
    };
    let strided_rows = |t: &Tensor, n: usize, h: usize| {
        t.dims() == [b, n, h * heads.dim]
            && t.dtype() == dt
            && t.stride()[2] == 1
            && (b == 1 || t.stride()[0] == n * t.stride()[1])
            && !t.track_op()
    };
    let one_plus = q_norm.or(k_norm).is_some_and(|nm| nm.one_plus);
    let norm_ok = |nm: Option<&RmsNorm>| {
        nm.is_none_or(|nm| {
            nm.one_plus == one_plus
                && nm.weight.dims() == [heads.dim]
                && (!one_plus || nm.weight.dtype() == DType::F32)
        })
    };
    let width = rotated_half(rope.q);
    let table = |t: &RopeTables, n: usize| {
        let rows = t.cos.elem_count() / width.max(1);
        t.cos.dtype() == dt
            && t.sin.dtype() == dt
            && rotated_half(t) == width
            && t.cos.is_contiguous()
            && t.sin.is_contiguous()
            && t.sin.dims() == t.cos.dims()
            && (rows == n || rows == b * n)
    };
    matches!(dt, DType::F32 | DType::BF16)
        && heads.dim.is_multiple_of(2)
        && heads.dim <= 512
        && width > 0
        && 2 * width <= heads.dim
        && heads.kv > 0
        && heads.q.is_multiple_of(heads.kv)
        && strided_rows(p.q, nq, heads.q * p.q_head_stride(1))
        && strided_rows(p.k, n, heads.kv)
        && strided_rows(p.v, n, heads.kv)
        && norm_ok(q_norm)
        && norm_ok(k_norm)
        && table(rope.q, nq)
        && table(rope.kv, n)
        && tables_agree(rope, b, nq, n, width)
        && match (rows.index, rows.cap) {
            (Some(ix), Some(_)) => {
                ix.dims() == [b, heads.kv, n, heads.dim]
                    && ix.dtype() == DType::U32
                    && ix.is_contiguous()
            }
            (None, None) => true,
            _ => false,
        }
}

/// Half the features a table rotates (its rows' width; `dim / 2` rotated whole, `dim / 8` at
/// Qwen3.6's partial factor 0.25), or 0 for a table of no dimensions.
fn rotated_half(t: &RopeTables) -> usize {
    t.cos.dims().last().copied().unwrap_or(0)
}

/// Whether both tables are laid out alike: each one table per sequence (`b · rows` rows), or
/// each one table for every sequence (the kernel reads both the same way).
fn tables_agree(rope: Tables, b: usize, nq: usize, n: usize, width: usize) -> bool {
    let per_seq = |t: &RopeTables, rows: usize| t.cos.elem_count() == b * rows * width;
    b == 1 || per_seq(rope.q, nq) == per_seq(rope.kv, n)
}

/// [`apply`] as one kernel (`src/ops/qkv_rope.cu`, `qkv_rope_*`): a block per (group of rows, head
/// of the `heads + 2 · kv_heads`), `dim / 2` active threads per row, each the pair of features
/// RoPE rotates together. Only where [`serves`].
fn fused(
    p: Projections,
    heads: Heads,
    norms: (Option<&RmsNorm>, Option<&RmsNorm>),
    rope: Tables,
    rows: Rows,
    cache: &mut KvCache,
    layer: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, n, _) = p.k.dims3()?;
    let (kb, vb) = cache.buffers_for(
        layer,
        (b, heads.kv, n, heads.dim),
        p.q.dtype(),
        p.q.device(),
        rows.cap,
    )?;
    let q = p.q.apply_op1_no_bwd(&Op {
        p,
        heads,
        norms,
        rope,
        rows,
        kv: (&kb, &vb),
        first: cache.len(),
    })?;
    let (k, v) = cache.wrote(layer, n, rows.cap)?;
    Ok((q, k, v))
}

/// The kernel as a custom op on the queries' projection (the other inputs and the cache
/// buffers it writes held by the op).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Op<'a> {
    p: Projections<'a>,
    heads: Heads,
    norms: (Option<&'a RmsNorm>, Option<&'a RmsNorm>),
    rope: Tables<'a>,
    rows: Rows<'a>,
    kv: (&'a Tensor, &'a Tensor),
    first: usize,
}

impl Op<'_> {
    /// The q and k norm weights as the kernel reads them (plain: the storage type; zero-centred:
    /// f32, then `true`), and the fixed layout's index, with stand-ins the kernel never reads
    /// (the flags say so): for an absent weight the K buffer or one f32, for an absent index
    /// (appending: eager forwards only) one u32.
    #[cfg(feature = "cuda")]
    fn weights_and_index(&self) -> Result<(Tensor, Tensor, Tensor, bool)> {
        let (q_norm, k_norm) = self.norms;
        let (kb, dev) = (self.kv.0, self.p.q.device());
        let one_plus = q_norm.or(k_norm).is_some_and(|m| m.one_plus);
        let w_dtype = if one_plus {
            DType::F32
        } else {
            self.p.q.dtype()
        };
        let weight = |nm: Option<&RmsNorm>| match (nm, one_plus) {
            (Some(m), _) => m.weight.to_dtype(w_dtype),
            (None, true) => Tensor::zeros(1, DType::F32, dev),
            (None, false) => Ok(kb.clone()),
        };
        let index = match self.rows.index {
            Some(ix) => ix.clone(),
            None => Tensor::zeros(1, DType::U32, dev)?,
        };
        Ok((weight(q_norm)?, weight(k_norm)?, index, one_plus))
    }
}

impl candle_core::CustomOp1 for Op<'_> {
    fn name(&self) -> &'static str {
        "qkv-rope"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("the fused QKV kernel is a CUDA kernel: the CPU runs qkv_rope::unfused")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use crate::cuda::ptx::{alloc, by_float, launch};
        use candle_core::backend::BackendStorage;
        use candle_core::{CudaStorage, Layout};
        let Self {
            p,
            heads,
            norms: (q_norm, k_norm),
            rope,
            rows,
            kv: (kb, vb),
            first,
        } = self;
        let (b, nq, _) = ql.shape().dims3()?;
        let n = p.k.dim(1)?;
        let d = heads.dim;
        let dev = qs.device().clone();
        let cap = kb.dim(2)?;
        let width = rotated_half(rope.kv);
        let batched_table = b > 1 && rope.kv.cos.elem_count() == b * n * width;
        let (ks, kl) = p.k.storage_and_layout();
        let (vs, vl) = p.v.storage_and_layout();
        let (cs, cl) = rope.kv.cos.storage_and_layout();
        let (ss, sl) = rope.kv.sin.storage_and_layout();
        let (qcs, qcl) = rope.q.cos.storage_and_layout();
        let (qss, qsl) = rope.q.sin.storage_and_layout();
        let (kbs, kbl) = kb.storage_and_layout();
        let (vbs, vbl) = vb.storage_and_layout();
        let (qw, kw, index, one_plus) = self.weights_and_index()?;
        let (qws, qwl) = qw.storage_and_layout();
        let (kws, kwl) = kw.storage_and_layout();
        let (ixs, ixl) = index.storage_and_layout();
        let eps = q_norm.or(*k_norm).map_or(1e-6, |m| m.eps) as f32;
        let flags = i32::from(q_norm.is_some())
            | (i32::from(k_norm.is_some()) << 1)
            | (i32::from(rows.index.is_some()) << 2)
            | (i32::from(batched_table) << 3);
        let all_rows = b * n.max(nq);
        let cfg = row_blocks(d, all_rows, heads.q + 2 * heads.kv);
        let ld = |l: &Layout| l.stride()[1] as i32;
        let (ldq, ldk, ldv) = (ld(ql), ld(kl), ld(vl));
        let (rows_, nq_, n_, hq_, hkv_, d_, cap_, first_) = (
            all_rows as i32,
            nq as i32,
            n as i32,
            heads.q as i32,
            heads.kv as i32,
            d as i32,
            cap as i32,
            *first as i32,
        );
        let (qhs, r) = (p.q_head_stride(d) as i32, 2 * width as i32);
        let out = by_float!(ql_dtype(qs), "fused QKV", |T, dt| {
            let q = slice_of::<T>(qs, ql)?;
            let (k, v) = (operand::<T>(&ks, kl, "k")?, operand::<T>(&vs, vl, "v")?);
            let (cos, sin) = (operand::<T>(&cs, cl, "cos")?, operand::<T>(&ss, sl, "sin")?);
            let (qcos, qsin) = (
                operand::<T>(&qcs, qcl, "query cos")?,
                operand::<T>(&qss, qsl, "query sin")?,
            );
            let (kc, vc) = (
                operand::<T>(&kbs, kbl, "K cache")?,
                operand::<T>(&vbs, vbl, "V cache")?,
            );
            let ix = operand::<u32>(&ixs, ixl, "index")?;
            let out = alloc::<T>(&dev, b * heads.q * nq * d)?;
            macro_rules! go {
                ($name:expr, $w:ty) => {{
                    let qw = operand::<$w>(&qws, qwl, "q_norm")?;
                    let kw = operand::<$w>(&kws, kwl, "k_norm")?;
                    launch!(
                        dev, $name, dt, cfg, q, k, v, ldq, ldk, ldv, qhs, qcos, qsin, cos, sin, qw,
                        kw, eps, ix, out, kc, vc, nq_, n_, hq_, hkv_, d_, r, cap_, first_, flags,
                        rows_
                    );
                }};
            }
            match one_plus {
                true => go!("qkv_rope_1p", f32),
                false => go!("qkv_rope", T),
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        });
        Ok((out, candle_core::Shape::from((b, heads.q, nq, d))))
    }
}

/// The fused QKV kernel's launch over `rows` rows of `heads` heads of `d`: a warp or two per
/// row (D/2 threads), 256 threads of several rows per block (a prefill's thousands of rows in
/// few blocks, each with many loads in flight).
#[cfg(feature = "cuda")]
fn row_blocks(
    d: usize,
    rows: usize,
    heads: usize,
) -> candle_core::cuda_backend::cudarc::driver::LaunchConfig {
    let threads = (d / 2).div_ceil(32) * 32;
    let per_block = (256 / threads).max(1);
    candle_core::cuda_backend::cudarc::driver::LaunchConfig {
        grid_dim: (rows.div_ceil(per_block) as u32, heads as u32, 1),
        block_dim: (threads as u32, per_block as u32, 1),
        shared_mem_bytes: 0,
    }
}

/// The CUDA storage of an operand, or an error naming it.
#[cfg(feature = "cuda")]
fn on<'s>(s: &'s candle_core::Storage, what: &str) -> Result<&'s candle_core::CudaStorage> {
    match s {
        candle_core::Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("fused QKV: {what} is not on the GPU"),
    }
}

/// An operand's device data from its layout's start.
#[cfg(feature = "cuda")]
fn slice_of<'s, W: candle_core::cuda_backend::CudaDType>(
    s: &'s candle_core::CudaStorage,
    l: &candle_core::Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'s, W>> {
    Ok(s.as_cuda_slice::<W>()?.slice(l.start_offset()..))
}

/// An operand's device data from its layout's start, or an error naming it.
#[cfg(feature = "cuda")]
fn operand<'s, W: candle_core::cuda_backend::CudaDType>(
    s: &'s candle_core::Storage,
    l: &candle_core::Layout,
    what: &str,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'s, W>> {
    slice_of(on(s, what)?, l)
}

#[cfg(feature = "cuda")]
fn ql_dtype(s: &candle_core::CudaStorage) -> DType {
    use candle_core::backend::BackendStorage;
    s.dtype()
}
