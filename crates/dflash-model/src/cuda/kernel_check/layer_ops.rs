//! A layer's fused inference kernels against their CPU twins: SwiGLU of a stacked gate/up
//! product, the residual add with its RMSNorm, the one-row product, the cache writes through an
//! index, a tree path's moves, and the attention's per-head norms, RoPE and cache writes.

use candle_core::{DType, Device, Result, Tensor};

use super::{compare_rows, fill, KernelCheck};

/// The attention's per-head work after its projections ([`crate::ops::qkv_rope::apply`]) on
/// `dev` in `dtype` (the fused kernel on a GPU, the unfused ops on the CPU), as f32 on the CPU
/// `[q, K, V]` per case: (1) Qwen3's shape in small (4 query / 2 K/V heads of 128, q and k
/// normed per head), a 16-row verify written through the fixed layout's index at rows 20..36
/// of a 64-row cache, q, k and v column ranges of one stacked product; (2) SmolLM2's heads (9 /
/// 3 of 64, no norms), 3 sequences appending one row each after 5, one RoPE table per
/// sequence, three separate products; (3) a draft block: 32 new K/V rows (16 of context, 16 of
/// the block) and queries from the block's 16, with their own RoPE rows, through the index;
/// (4) a batched prefill: 2 sequences appending 13 rows each after 5 (Qwen3's heads in small,
/// normed: two warps per row, 4 rows per block, the last block part-filled), one table per
/// sequence; (5) the draft block of (3) with Qwen2.5-Coder-0.5B's heads (14 / 2 of 64).
fn qkv_rope_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::cache::kv_cache::KvCache;
    use crate::layers::norm::RmsNorm;
    use crate::layers::rope::Rope;
    use crate::ops::qkv_rope::{Heads, Projections, Rows, Tables};
    let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    let mut outs = Vec::new();
    for case in 0..5 {
        let (b, hq, hkv, d, n, len) = match case {
            0 => (1, 4, 2, 128, 16, 20),
            1 => (3, 9, 3, 64, 1, 5),
            2 => (1, 4, 2, 128, 32, 20),
            3 => (2, 4, 2, 128, 13, 5),
            _ => (1, 14, 2, 64, 32, 20),
        };
        let block = matches!(case, 2 | 4);
        let heads = Heads {
            q: hq,
            kv: hkv,
            dim: d,
        };
        let seed = 60 + 10 * case as u64;
        let mut cache = KvCache::new(1);
        let old = |s| on(fill(&[b, hkv, len, d], s, 1.0)?);
        cache.append(0, &old(seed)?, &old(seed + 1)?)?;
        cache.commit(len);
        let rope = Rope::new(d, 10_000.0);
        let positions: Vec<usize> = (0..b * n).map(|i| len + i % n + 3 * (i / n)).collect();
        let mut tables = rope.tables(&positions, dtype, dev)?;
        if b > 1 {
            tables.cos = tables.cos.reshape((b, n, d / 2))?;
            tables.sin = tables.sin.reshape((b, n, d / 2))?;
        }
        let norm = |s| -> Result<RmsNorm> {
            Ok(RmsNorm::new(
                on(fill(&[d], s, 1.0)?.affine(0.5, 1.0)?)?,
                1e-6,
            ))
        };
        let (qn, kn) = (norm(seed + 2)?, norm(seed + 3)?);
        let (q, k, v, norms, index, cap);
        // case 2 (the drafter's block): queries from the last 16 of the 32 new rows, rotated
        // at those rows' positions
        let qtables = block.then(|| tables.narrow(16, 16)).transpose()?;
        if block {
            let x = |w, rows, s| on(fill(&[b, rows, w * d], s, 2.0)?);
            (q, k, v) = (
                x(hq, 16, seed + 4)?,
                x(hkv, n, seed + 5)?,
                x(hkv, n, seed + 6)?,
            );
            norms = (Some(&qn), Some(&kn));
            cache.reserve_exact(64)?;
            index = Some(KvCache::fixed_index((b, hkv, n, d), len, dev)?);
            cap = Some(64);
        } else if case == 0 {
            let y = on(fill(&[b, n, (hq + 2 * hkv) * d], seed + 4, 2.0)?)?;
            (q, k, v) = (
                y.narrow(2, 0, hq * d)?,
                y.narrow(2, hq * d, hkv * d)?,
                y.narrow(2, (hq + hkv) * d, hkv * d)?,
            );
            norms = (Some(&qn), Some(&kn));
            cache.reserve_exact(64)?;
            index = Some(KvCache::fixed_index((b, hkv, n, d), len, dev)?);
            cap = Some(64);
        } else {
            let x = |w, s| on(fill(&[b, n, w * d], s, 2.0)?);
            (q, k, v) = (x(hq, seed + 4)?, x(hkv, seed + 5)?, x(hkv, seed + 6)?);
            // case 3 (a batched prefill): normed, 26 rows over blocks of 4
            norms = if case == 3 {
                (Some(&qn), Some(&kn))
            } else {
                (None, None)
            };
            (index, cap) = (None, None);
        }
        let p = Projections::plain(&q, &k, &v);
        let rows = Rows {
            index: index.as_ref(),
            cap,
        };
        let tabs = Tables {
            q: qtables.as_ref().unwrap_or(&tables),
            kv: &tables,
        };
        let what = format!("case {case}");
        outs.extend(qkv_applied(
            dev, p, heads, norms, tabs, rows, &mut cache, &what,
        )?);
    }
    Ok(outs)
}

/// [`crate::ops::qkv_rope::apply`] of one case, refused on a GPU where the fused kernel does
/// not serve it: `[q, K, V]` as f32 on the CPU.
#[allow(clippy::too_many_arguments)]
fn qkv_applied(
    dev: &Device,
    p: crate::ops::qkv_rope::Projections,
    heads: crate::ops::qkv_rope::Heads,
    norms: (
        Option<&crate::layers::norm::RmsNorm>,
        Option<&crate::layers::norm::RmsNorm>,
    ),
    tabs: crate::ops::qkv_rope::Tables,
    rows: crate::ops::qkv_rope::Rows,
    cache: &mut crate::cache::kv_cache::KvCache,
    what: &str,
) -> Result<Vec<Tensor>> {
    use crate::ops::qkv_rope::{apply, serves};
    if dev.is_cuda() && !serves(p, heads, norms, tabs, rows) {
        candle_core::bail!("the fused QKV kernel does not serve {what}");
    }
    let (q, k, v) = apply(p, heads, norms, tabs, rows, cache, 0)?;
    [q, k, v]
        .into_iter()
        .map(|t| t.to_dtype(DType::F32)?.to_device(&Device::Cpu))
        .collect()
}

/// The outputs [`check_stacked_silu`] compares, on `dev` in `dtype`, as f32 on the CPU.
fn stacked_silu_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let gu = fill(&[2, 150, 1400], 31, 4.0)?
        .to_dtype(dtype)?
        .to_device(dev)?;
    let y = crate::ops::silu_mul::silu_mul_stacked(&gu, 700)?;
    Ok(vec![y.to_dtype(DType::F32)?.to_device(&Device::Cpu)?])
}

/// The outputs [`check_add_norm`] compares, on `dev` in `dtype`, as f32 on the CPU: plain
/// weights after the add, then a zero-centred weight (f32, as qwen3_5's are kept) after the
/// add and alone.
fn add_norm_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::layers::norm::RmsNorm;
    let mut outs = Vec::new();
    let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    let cases = [
        (vec![3, 7, 576], 41u64, false),
        (vec![1, 2, 4096], 43, false),
    ];
    let centred = [(vec![2, 3, 5120], 45u64, true)];
    for (shape, seed, one_plus) in cases.into_iter().chain(centred) {
        let x = on(fill(&shape, seed, 3.0)?)?;
        let h = on(fill(&shape, seed + 1, 1.0)?)?;
        let norm = match one_plus {
            true => RmsNorm::zero_centred(fill(&shape[2..], seed + 2, 0.5)?.to_device(dev)?, 1e-6)?,
            false => RmsNorm::new(
                on(fill(&shape[2..], seed + 2, 0.5)?.affine(1.0, 1.0)?)?,
                1e-5,
            ),
        };
        if dev.is_cuda() && !crate::ops::add_norm::serves(&x, &h, &norm) {
            candle_core::bail!("the fused add + RMSNorm does not serve {shape:?}");
        }
        let (s, n) = crate::ops::add_norm::add_rms_norm(&x, &h, &norm)?;
        let alone = match one_plus {
            true => vec![norm.forward(&x)?],
            false => vec![],
        };
        for t in [s, n].into_iter().chain(alone) {
            outs.push(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
        }
    }
    // a gated attention's per-head q norm: rows of 256, zero-centred
    let x = on(fill(&[3, 24, 256], 47, 2.0)?)?;
    let norm = RmsNorm::zero_centred(fill(&[256], 48, 0.5)?.to_device(dev)?, 1e-6)?;
    if dev.is_cuda() && crate::ops::add_norm::zero_centred_norm(&x, &norm)?.is_none() {
        candle_core::bail!("the zero-centred RMSNorm kernel does not serve rows of 256");
    }
    outs.push(
        norm.forward(&x)?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?,
    );
    Ok(outs)
}

/// The outputs [`check_partial_rope`] compares, on `dev` in `dtype`, as f32 on the CPU: q of
/// a gated attention layer (24 heads of 256, 64 features rotating) at one table, then k (4
/// heads) of 3 sequences at their own tables.
fn partial_rope_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::layers::rope::{Rope, RopeTables};
    let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    let rope = Rope::new(64, 1e7);
    let one = rope.tables(&[5, 6, 7, 9, 9], dtype, dev)?;
    let x = on(fill(&[1, 24, 5, 256], 81, 2.0)?)?;
    let k = on(fill(&[3, 4, 4, 256], 82, 2.0)?)?;
    let pos: Vec<usize> = (0..3 * 4).map(|i| 100 * (i / 4) + i % 4).collect();
    let t = rope.tables(&pos, dtype, dev)?;
    let batched = RopeTables {
        cos: t.cos.reshape((3, 4, 32))?,
        sin: t.sin.reshape((3, 4, 32))?,
    };
    let served = |t: &Tensor, tables: &RopeTables| {
        crate::ops::rope_partial::rope_partial(t, tables).map(|y| y.is_some())
    };
    if dev.is_cuda() && !(served(&x, &one)? && served(&k, &batched)?) {
        candle_core::bail!(
            "the partial RoPE kernel does not serve q at one table or k of 3 sequences"
        );
    }
    [one.apply(&x)?, batched.apply(&k)?]
        .into_iter()
        .map(|t| t.to_dtype(DType::F32)?.to_device(&Device::Cpu))
        .collect()
}

/// Partial RoPE in one kernel against the composed rotation
pub(super) fn check_partial_rope(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &[
            "partial RoPE: q, 24 heads of 256, 64 rotating",
            "partial RoPE: k of 3 sequences at their own positions",
        ],
        &[(DType::F32, 1e-5), (DType::BF16, 2e-2)],
        partial_rope_rows,
    )
}

/// The outputs [`check_gemv`] compares, on `dev` in `dtype`, as f32 on the CPU.
fn gemv_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let mut outs = Vec::new();
    for (rows_in, out, k, seed) in [(vec![1, 1], 3000, 4096, 71u64), (vec![1], 1536, 576, 73)] {
        let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
        let mut xs = rows_in.clone();
        xs.push(k);
        let x = on(fill(&xs, seed, 1.0)?)?;
        let w = on(fill(&[out, k], seed + 1, 0.05)?)?;
        if dev.is_cuda() && !crate::ops::gemv::serves(&x, &w) {
            candle_core::bail!("the one-row product kernel does not serve {out} × {k}");
        }
        let y = crate::layers::linear::matmul_t(&x, &w)?;
        outs.push(y.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
    }
    Ok(outs)
}

/// The outputs [`check_indexed_cache_write`] compares, on `dev` in `dtype`, as f32 on the CPU.
fn indexed_write_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    let dst = on(fill(&[2, 3, 40, 64], 51, 1.0)?)?;
    let src = on(fill(&[2, 3, 5, 64], 52, 2.0)?)?;
    let rows: Vec<u32> = (0..2 * 3 * 5)
        .flat_map(|r| std::iter::repeat_n((7 * r as u32 + 3) % 40, 64))
        .collect();
    let index = Tensor::from_vec(rows, (2, 3, 5, 64), &Device::Cpu)?.to_device(dev)?;
    crate::ops::scatter_rows::scatter_rows(&dst, &src, &index)?;
    Ok(vec![dst.to_dtype(DType::F32)?.to_device(&Device::Cpu)?])
}

/// The outputs [`check_tree_path_moves`] compares, on `dev` in `dtype`, as f32 on the CPU.
fn moved_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let buffers = (0..6)
        .map(|p| {
            fill(&[1, 3, 40, 64], 60 + p, 1.0)?
                .to_dtype(dtype)?
                .to_device(dev)
        })
        .collect::<Result<Vec<_>>>()?;
    crate::ops::keep_rows::keep_rows(&buffers.iter().collect::<Vec<_>>(), 20, &[21, 22, 26])?;
    Ok(vec![Tensor::cat(&buffers, 0)?
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?])
}

/// SwiGLU of a stacked gate/up product (the target's MLP on a GPU) against silu_mul's twin
pub(super) fn check_stacked_silu(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &["silu·up of a stacked gate/up"],
        &[(DType::F32, 1e-5), (DType::BF16, 2e-2)],
        stacked_silu_rows,
    )
}

/// The residual add and the RMSNorm after it in one kernel against the add and the norm
pub(super) fn check_add_norm(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &[
            "add + rms-norm: sum, rows of 576",
            "add + rms-norm: norm, rows of 576",
            "add + rms-norm: sum, rows of 4,096",
            "add + rms-norm: norm, rows of 4,096",
            "add + zero-centred rms-norm: sum, rows of 5,120",
            "add + zero-centred rms-norm: norm, rows of 5,120",
            "zero-centred rms-norm, rows of 5,120",
            "zero-centred rms-norm, per-head rows of 256",
        ],
        &[(DType::F32, 1e-5), (DType::BF16, 2e-2)],
        add_norm_rows,
    )
}

/// One row through a projection (the AR step's products) against candle's matmul
pub(super) fn check_gemv(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &[
            "one-row product, 3,000 × 4,096",
            "one-row product, 1,536 × 576",
        ],
        &[(DType::F32, 1e-5), (DType::BF16, 2e-2)],
        gemv_rows,
    )
}

/// The fixed layout's cache write against candle's scatter_set
pub(super) fn check_indexed_cache_write(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &["cache rows written through an index"],
        &[(DType::F32, 0.0), (DType::BF16, 1e-2)],
        indexed_write_rows,
    )
}

/// A tree's path moved down in six K/V buffers at once against the gather: rows 0..20
/// stay, then row 20 ← 21, 21 ← 22 (each read before the next move writes it), 22 ← 26
pub(super) fn check_tree_path_moves(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &["a tree's path moved in six K/V buffers"],
        &[(DType::F32, 0.0), (DType::BF16, 1e-2)],
        moved_rows,
    )
}

/// [`qkv_rope_rows`] for a gated attention layer (qwen3_5 in small: 4 query / 2 K/V heads of
/// 256, `[query | gate]` per query head, zero-centred f32 norm weights, 64 of 256 features
/// rotating): (1) a 9-row verify (DDTree-8) written through the fixed layout's index at rows
/// 20..29 of a 64-row cache, q, k and v column ranges of one stacked product; (2) 2 sequences
/// appending 13 rows each after 5, one table per sequence, three separate products.
fn qkv_rope_gated_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::cache::kv_cache::KvCache;
    use crate::layers::norm::RmsNorm;
    use crate::layers::rope::Rope;
    use crate::ops::qkv_rope::{Heads, Projections, Rows, Tables};
    let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    let heads = Heads {
        q: 4,
        kv: 2,
        dim: 256,
    };
    let (hq, hkv, d) = (heads.q, heads.kv, heads.dim);
    let mut outs = Vec::new();
    for (case, (b, n, len)) in [(1, 9, 20), (2, 13, 5)].into_iter().enumerate() {
        let seed = 120 + 10 * case as u64;
        let mut cache = KvCache::new(1);
        let old = |s| on(fill(&[b, hkv, len, d], s, 1.0)?);
        cache.append(0, &old(seed)?, &old(seed + 1)?)?;
        cache.commit(len);
        let positions: Vec<usize> = (0..b * n).map(|i| len + i % n + 3 * (i / n)).collect();
        let mut tables = Rope::new(64, 1e7).tables(&positions, dtype, dev)?;
        if b > 1 {
            tables = tables.reshape_rows(b, n)?;
        }
        let norm = |s| RmsNorm::zero_centred(fill(&[d], s, 0.5)?.to_device(dev)?, 1e-6);
        let (qn, kn) = (norm(seed + 2)?, norm(seed + 3)?);
        let (q, k, v, index, cap);
        if case == 0 {
            let y = on(fill(&[b, n, (2 * hq + 2 * hkv) * d], seed + 4, 2.0)?)?;
            (q, k, v) = (
                y.narrow(2, 0, 2 * hq * d)?,
                y.narrow(2, 2 * hq * d, hkv * d)?,
                y.narrow(2, (2 * hq + hkv) * d, hkv * d)?,
            );
            cache.reserve_exact(64)?;
            index = Some(KvCache::fixed_index((b, hkv, n, d), len, dev)?);
            cap = Some(64);
        } else {
            let x = |w, s| on(fill(&[b, n, w * d], s, 2.0)?);
            (q, k, v) = (x(2 * hq, seed + 4)?, x(hkv, seed + 5)?, x(hkv, seed + 6)?);
            (index, cap) = (None, None);
        }
        let p = Projections {
            q: &q,
            k: &k,
            v: &v,
            gated: true,
        };
        let rows = Rows {
            index: index.as_ref(),
            cap,
        };
        let tabs = Tables {
            q: &tables,
            kv: &tables,
        };
        let norms = (Some(&qn), Some(&kn));
        let what = format!("gated case {case}");
        outs.extend(qkv_applied(
            dev, p, heads, norms, tabs, rows, &mut cache, &what,
        )?);
    }
    Ok(outs)
}

/// The attention's per-head norms, RoPE and cache writes in one kernel against the ops
pub(super) fn check_qkv_rope(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &[
            "QKV: q, normed, rotated (verify, fixed layout)",
            "QKV: K cache (verify, fixed layout)",
            "QKV: V cache (verify, fixed layout)",
            "QKV: q, rotated (3 sequences appending)",
            "QKV: K cache (3 sequences appending)",
            "QKV: V cache (3 sequences appending)",
            "QKV: q of a draft block's 16 rows (context and block keys)",
            "QKV: K cache (a draft block: 16 context and 16 block rows)",
            "QKV: V cache (a draft block)",
            "QKV: q, normed, rotated (2 sequences appending 13 rows each)",
            "QKV: K cache (2 sequences appending 13 rows each)",
            "QKV: V cache (2 sequences appending 13 rows each)",
            "QKV: q of a draft block, 7 heads per K/V head of 64",
            "QKV: K cache (a draft block, 7 heads per K/V head of 64)",
            "QKV: V cache (a draft block, 7 heads per K/V head of 64)",
        ],
        &[(DType::F32, 1e-5), (DType::BF16, 2e-2)],
        qkv_rope_rows,
    )?;
    compare_rows(
        dev,
        checks,
        &[
            "QKV gated: q, zero-centred norm, partial RoPE (9-row verify, fixed layout)",
            "QKV gated: K cache (9-row verify, fixed layout)",
            "QKV gated: V cache (9-row verify, fixed layout)",
            "QKV gated: q (2 sequences appending 13 rows each)",
            "QKV gated: K cache (2 sequences appending 13 rows each)",
            "QKV gated: V cache (2 sequences appending 13 rows each)",
        ],
        &[(DType::F32, 1e-5), (DType::BF16, 2e-2)],
        qkv_rope_gated_rows,
    )
}
