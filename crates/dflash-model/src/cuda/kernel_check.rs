//! dflash-rs's own kernels on a device against their CPU twins: the block attention
//! ([`crate::ops::block_attention::attend_blocks`] with [`crate::ops::block_softmax`]) and the cross-entropy
//! ([`crate::ops::cross_entropy`]), values and gradients, on fixed pseudo-random inputs of the
//! drafter's shape (9/3 heads of 64, B = 16, several windows, two packed sequences); and the
//! target's interval softmax ([`crate::ops::interval_softmax`]) on a batch of right-aligned rows.
//! `check device` and `bench train` run it before trusting a GPU's numbers.

use candle_core::{DType, Device, Result, Tensor, Var};
use dflash_core::segments::Segments;
use dflash_core::visibility::{causal, draft_training_parts, right_aligned, DraftRule};

use crate::ops::block_attention::{attend_blocks, context_windows};
use crate::ops::compare::rel_err;
use crate::ops::cross_entropy::cross_entropy_rows;
use crate::ops::interval_softmax::{interval_softmax, RowIntervals};

/// One comparison: `max |device − CPU| / max |CPU|` against its tolerance.
#[derive(Debug, Clone)]
pub struct KernelCheck {
    pub name: String,
    pub rel_err: f64,
    pub tolerance: f64,
}

impl KernelCheck {
    pub fn passed(&self) -> bool {
        self.rel_err <= self.tolerance
    }
}

fn fill(shape: &[usize], seed: u64, amp: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let x = ((i as u64 + 1).wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 10007;
            (x as f32 / 10007.0 * 2.0 - 1.0) * amp
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// Outputs and gradients of the block attention and the cross-entropy on `dev` in `dtype`
/// and the interval softmax (`[out, dq, dk, dv, ce, dlogits, interval softmax]`, as f32 on the
/// CPU).
fn run(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let (hq, hkv, d, block) = (9, 3, 64, 16);
    let segs = Segments::from_lengths(&[180, 140]);
    let anchors: Vec<usize> = vec![3, 40, 77, 120, 150, 181, 200, 260, 300];
    let (m, r) = (segs.len(), anchors.len() * block);
    let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    let q = Var::from_tensor(&on(fill(&[1, hq, r, d], 1, 1.0)?)?)?;
    let k = Var::from_tensor(&on(fill(&[1, hkv, m + r, d], 2, 1.0)?)?)?;
    let v = Var::from_tensor(&on(fill(&[1, hkv, m + r, d], 3, 1.0)?)?)?;
    let (c, o) = draft_training_parts(DraftRule::FULL, &segs, &anchors, block);
    let group: Vec<usize> = anchors.iter().map(|&a| segs.segment_of(a)).collect();
    let windows = context_windows(&c, &o, block, &group, 4 * block * 64, m, dev)?;
    let out = attend_blocks(
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        m,
        &windows,
        block,
        0.125,
    )?;
    let w = on(fill(&[1, r, hq * d], 4, 1.0)?)?;
    let g = (out.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
        .sum_all()?
        .backward()?;
    let (n, vocab) = (48, 3001);
    let logits = Var::from_tensor(&on(fill(&[n, vocab], 5, 8.0)?)?)?;
    let labels: Vec<u32> = (0..n as u32)
        .map(|i| (i * 977 + 5) % vocab as u32)
        .collect();
    let (ce, _) = cross_entropy_rows(logits.as_tensor(), &labels)?;
    let rw = on(fill(&[n], 6, 1.0)?)?.to_dtype(ce.dtype())?;
    let gce = (&ce * rw)?.sum_all()?.backward()?;
    let grad = |g: &candle_core::backprop::GradStore, x: &Var| -> Result<Tensor> {
        g.get(x.as_tensor())
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))
    };
    let masks = [
        right_aligned(40, 100, 7, 7),
        causal(100, 7),
        right_aligned(0, 100, 3, 7),
    ];
    let iv = RowIntervals::from_visibilities(&masks, dev)?
        .ok_or_else(|| candle_core::Error::Msg("right-aligned rows are intervals".into()))?;
    let scores = on(fill(&[3, 3, 3 * 7, 107], 7, 6.0)?)?;
    let isoft = interval_softmax(&scores, &iv, 0.125)?;
    [
        out,
        grad(&g, &q)?,
        grad(&g, &k)?,
        grad(&g, &v)?,
        ce,
        grad(&gce, &logits)?,
        isoft,
    ]
    .into_iter()
    .map(|t| t.to_dtype(DType::F32)?.to_device(&Device::Cpu))
    .collect()
}

/// The inputs of an attention case: `q` `[b, hq, n, d]`, and K and V as the first `t` rows of
/// `[b, hkv, cap, d]` buffers (a cache's view), filled from `seed` on `dev` in `dtype`.
fn attention_inputs(
    dev: &Device,
    dtype: DType,
    (b, hq, hkv, d, n, t, cap): (usize, usize, usize, usize, usize, usize, usize),
    seed: u64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
    let q = on(fill(&[b, hq, n, d], seed, 1.0)?)?;
    let kbuf = on(fill(&[b, hkv, cap, d], seed + 1, 1.0)?)?;
    let vbuf = on(fill(&[b, hkv, cap, d], seed + 2, 1.0)?)?;
    Ok((q, kbuf.narrow(2, 0, t)?, vbuf.narrow(2, 0, t)?))
}

/// The attention of a case as f32 on the CPU: the twin (the matmuls around the interval softmax)
/// on the CPU; on a GPU `attend_intervals`, refused unless `served` (the kernel under test takes
/// it) or `off` (its switch is off: the rows then compare the matmul path on the device).
fn attend_case(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    iv: &RowIntervals,
    served: bool,
    off: bool,
    what: &str,
) -> Result<Tensor> {
    use crate::layers::attention::{attend_intervals, attend_intervals_unfused};
    let o = if q.device().is_cpu() {
        attend_intervals_unfused(q, k, v, iv, 0.125)?
    } else {
        if !served && !off {
            candle_core::bail!("{what} is not served by its kernel");
        }
        attend_intervals(q, k, v, iv, 0.125)?
    };
    o.to_dtype(DType::F32)?.to_device(&Device::Cpu)
}

/// The fused interval attention ([`crate::ops::interval_attention`]) on `dev` in `dtype`, or its
/// twin (the matmuls around the interval softmax) on the CPU, as f32 on the CPU: (1) 7 slots
/// decoding one row each over a 300-column view of a 400-row cache buffer (SmolLM2's 9/3 heads
/// of 64; several splits merged), (2) 100 such slots over 120 columns,
/// (3) a 16-row chain verify of one sequence over 700 columns (Qwen3-8B's 32/8 heads of 128:
/// 64 rows per K/V head in 4 groups), (4) SmolLM2's 16-row verify over 500 columns (48 rows
/// per K/V head: 3 groups), (5) 5 slots of Qwen2.5-Coder-1.5B's heads (12/2 of 128: the
/// decode kernel's 8-head build with 6 heads, queries from shared memory) over 900 of 1,000
/// columns, (6) one sequence's AR step over all 700 columns with Qwen3-8B's heads (4 per K/V
/// head, many splits), (7) 3 slots of 4/4 heads of 64 over 60 columns (one query head per K/V
/// head: the 2-head build with one idle; one split, written directly), (8) 2 sequences
/// verifying 8 rows each over 100 columns, sequence 1 left-padded by 23 (4/2 heads of 128: 16
/// rows per K/V head, one warp's worth), (9) 2 sequences of 5 rows over 50 columns, sequence 1
/// seeing from column 10 and its row 0 nothing (9/3 heads of 64: one key tile, one split,
/// written directly; the empty row gives zeros). Cases 1, 2, 5 and 7 run the decode kernel
/// (several sequences), 6 the interval kernel, 3, 4, 8 and 9 the verify kernel in bf16 and the
/// interval kernel in f32.
fn interval_attention_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::ops::interval_attention::{serves, switched_off};
    use std::ops::Range;
    let mut outs = Vec::new();
    for (case, shape) in [
        (7, 9, 3, 64, 1, 300, 400),
        (100, 9, 3, 64, 1, 120, 128),
        (1, 32, 8, 128, 16, 700, 720),
        (1, 9, 3, 64, 16, 500, 512),
        (5, 12, 2, 128, 1, 900, 1000),
        (1, 32, 8, 128, 1, 700, 720),
        (3, 4, 4, 64, 1, 60, 64),
        (2, 4, 2, 128, 8, 100, 128),
        (2, 9, 3, 64, 5, 50, 64),
    ]
    .into_iter()
    .enumerate()
    {
        let (b, n, t) = (shape.0, shape.4, shape.5);
        let (q, k, v) = attention_inputs(dev, dtype, shape, 20 + 3 * case as u64)?;
        let iv = if case >= 7 {
            let (pad, empty) = if case == 7 { (23, false) } else { (10, true) };
            let rows: Vec<Range<usize>> = (0..b * n)
                .map(|e| match (e / n, e % n) {
                    (1, 0) if empty => 0..0,
                    (s, r) => pad * s..t - n + r + 1,
                })
                .collect();
            RowIntervals::from_rows(&rows, b, n, t, dev)?
        } else {
            let masks: Vec<_> = (0..b)
                .map(|s| {
                    if n == 1 && b > 1 {
                        // slot s holds (37 s mod (t − 1)) + 1 rows before its new one
                        right_aligned((37 * s) % (t - n) + 1, t - n, 1, 1)
                    } else {
                        causal(t - n, n)
                    }
                })
                .collect();
            RowIntervals::from_visibilities(&masks, dev)?
                .ok_or_else(|| candle_core::Error::Msg("right-aligned rows are intervals".into()))?
        };
        let what = format!("interval attention case {case}");
        outs.push(attend_case(
            &q,
            &k,
            &v,
            &iv,
            serves(&q, &k, &v),
            switched_off(),
            &what,
        )?);
    }
    Ok(outs)
}

/// The tree kernel ([`crate::ops::interval_attention::fused_tree`], bf16 on a GPU) or its twin
/// (the matmuls around the interval softmax over the same windows) on the CPU, as f32 on the
/// CPU; trees of `dflash_core::visibility::tree` with node `i`'s parent `(i − 1) / 2`, except
/// the last case: (1) Qwen3-8B's heads (32 / 8 of 128), a DDTree-8 verify (9 rows, 36 per K/V
/// head: 4 warps) after 500 cached rows over a 509-column view of a 600-row buffer; (2)
/// SmolLM2's heads (9 / 3 of 64), a 20-node tree padded to 33 rows
/// (`dflash_core::visibility::pad_rows`: 99 rows per K/V head, 8 warps) after 300 rows, over
/// the 1,000 columns of a fixed-capacity cache; (3) 2 / 2 heads of 128, a chain of 63 nodes
/// under the root's second child (65 rows, 8 warps; the deepest row's window ends at bit 63)
/// after 40 rows; (4) Qwen2.5-Coder-0.5B's heads (14 / 2 of 64), a one-row AR step after 77
/// rows (7 rows per K/V head, an empty window); (5) the same heads' 16-row chain verify after
/// 300 rows (112 rows per K/V head, 8 warps, every window empty: the rows
/// `Target::prepare` hands to this kernel past the verify kernel's 64).
fn tree_attention_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::ops::interval_attention::{fused_tree, serves_tree};
    use dflash_core::visibility::{pad_rows, tree};
    let mut outs = Vec::new();
    for (case, shape) in [
        (1, 32, 8, 128, 9, 509, 600),
        (1, 9, 3, 64, 33, 333, 1000),
        (1, 2, 2, 128, 65, 105, 128),
        (1, 14, 2, 64, 1, 78, 96),
        (1, 14, 2, 64, 16, 316, 320),
    ]
    .into_iter()
    .enumerate()
    {
        let (n, t, cap) = (shape.4, shape.5, shape.6);
        let cache = t - n;
        let heap = |m: usize| -> Vec<Option<usize>> {
            (0..m).map(|i| i.checked_sub(1).map(|p| p / 2)).collect()
        };
        let vis = match case {
            1 => pad_rows(&tree(cache, &heap(20)), cache, n),
            2 => {
                let mut parents = vec![None, Some(0), Some(0)];
                parents.extend((3..n).map(|i| Some(i - 1)));
                tree(cache, &parents)
            }
            4 => causal(cache, n),
            _ => tree(cache, &heap(n)),
        };
        // case 2 reads the cache's whole capacity; the others their view of t columns
        let cols = if case == 1 { cap } else { t };
        let (q, k, v) = attention_inputs(
            dev,
            dtype,
            (1, shape.1, shape.2, shape.3, n, cols, cap),
            110 + 3 * case as u64,
        )?;
        let iv = RowIntervals::tree_widened(&vis, cols, dev)?
            .ok_or_else(|| candle_core::Error::Msg(format!("tree case {case} fits no windows")))?;
        let o = if dev.is_cpu() {
            crate::layers::attention::attend_intervals_unfused(&q, &k, &v, &iv, 0.125)?
        } else if serves_tree(&q, &k, &v) {
            fused_tree(&q, &k, &v, &iv, 0.125)?
        } else {
            candle_core::bail!("tree attention case {case} is not served by its kernel");
        };
        outs.push(o.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
    }
    Ok(outs)
}

/// The drafter's training attention ([`crate::ops::train_attention`]'s kernels, bf16 on a GPU)
/// or its twin ([`attend_blocks`], the windowed matmuls, on the CPU), as f32 on the CPU: the
/// output and the gradients of `Σ out · w` for q, K and V (`[out, dq, dk, dv]` per case). (1)
/// SmolLM2's heads (9 / 3 of 64), two packed sequences (180 + 140), 9 anchors out of order, the
/// full rule; (2) Qwen3's heads in small (8 / 2 of 128), sequences of 300 and 212, 20 anchors, a
/// sliding window of 90 keys (five row tiles, thirteen key tiles, the last part-filled); (3)
/// Qwen2.5-Coder-0.5B's heads (14 / 2 of 64: 7 query heads per K/V head), sequences of 230 and
/// 160, 12 anchors. With `DFLASH_DISABLED_KERNELS=train-attention` a GPU runs the twin.
fn train_attention_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::ops::train_attention::{attend, serves, switched_off, TrainIntervals};
    let mut outs = Vec::new();
    // (heads, K/V heads, head dim), segment lengths, anchors, sliding window
    type Case = ((usize, usize, usize), Vec<usize>, Vec<usize>, Option<usize>);
    let cases: [Case; 3] = [
        (
            (9, 3, 64),
            vec![180, 140],
            vec![3, 40, 77, 150, 120, 181, 200, 260, 300],
            None,
        ),
        (
            (8, 2, 128),
            vec![300, 212],
            (0..20).map(|i| (i * 97 + 11) % 510).collect(),
            Some(90),
        ),
        (
            (14, 2, 64),
            vec![230, 160],
            (0..12).map(|i| (i * 61 + 5) % 389).collect(),
            None,
        ),
    ];
    for (case, ((hq, hkv, d), lens, anchors, window)) in cases.into_iter().enumerate() {
        let block = 16;
        let segs = Segments::from_lengths(&lens);
        let (m, r) = (segs.len(), anchors.len() * block);
        let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
        let seed = 60 + 5 * case as u64;
        let q = Var::from_tensor(&on(fill(&[1, hq, r, d], seed, 1.0)?)?)?;
        let k = Var::from_tensor(&on(fill(&[1, hkv, m + r, d], seed + 1, 1.0)?)?)?;
        let v = Var::from_tensor(&on(fill(&[1, hkv, m + r, d], seed + 2, 1.0)?)?)?;
        let rule = DraftRule {
            sliding_window: window,
            causal: false,
        };
        let (c, o) = draft_training_parts(rule, &segs, &anchors, block);
        let scale = 1.0 / (d as f64).sqrt();
        let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
        let out = if dev.is_cpu() || switched_off() {
            let group: Vec<usize> = anchors.iter().map(|&a| segs.segment_of(a)).collect();
            let windows = context_windows(&c, &o, block, &group, 4 * block * 64, m, dev)?;
            attend_blocks(qt, kt, vt, m, &windows, block, scale)?
        } else if serves(qt, kt, vt) {
            attend(
                qt,
                kt,
                vt,
                &TrainIntervals::new(&c, &o, block, m, dev)?,
                scale,
            )?
        } else {
            candle_core::bail!("training attention case {case} is not served by its kernels");
        };
        let w = on(fill(&[1, r, hq * d], seed + 3, 1.0)?)?;
        let g = (out.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        outs.push(out);
        for x in [&q, &k, &v] {
            outs.push(
                g.get(x.as_tensor())
                    .cloned()
                    .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?,
            );
        }
    }
    outs.into_iter()
        .map(|t| t.to_dtype(DType::F32)?.to_device(&Device::Cpu))
        .collect()
}

/// The prefill attention ([`crate::ops::prefill_attention`], bf16 on a GPU) or its twin (the
/// matmuls around the interval softmax), as f32 on the CPU: (1) one sequence's causal prefill of
/// 300 rows over a 300-row view of a 320-row buffer (Qwen3-8B's 32 / 8 heads of 128: five row
/// tiles, the last part-filled; tiles of 32 keys); (2) 3 sequences prefilling 70 rows each
/// after 30 cache rows, sequence s left-padded by 17·s keys and the first 5 rows of sequence 2
/// seeing nothing (SmolLM2's 9 / 3 heads of 64: tiles of 64 keys; empty rows give zeros); (3) a
/// packed training row of 200 tokens in two segments (0..90, 90..200), each row seeing its own
/// segment up to itself (4 / 2 heads of 128); (4) one sequence's causal prefill of 150 rows with
/// Qwen2.5-Coder-0.5B's heads (14 / 2 of 64: 7 query heads per K/V head).
fn prefill_attention_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::ops::prefill_attention::{serves, switched_off};
    use std::ops::Range;
    let mut outs = Vec::new();
    for (case, shape) in [
        (1, 32, 8, 128, 300, 300, 320),
        (3, 9, 3, 64, 70, 100, 100),
        (1, 4, 2, 128, 200, 200, 200),
        (1, 14, 2, 64, 150, 150, 160),
    ]
    .into_iter()
    .enumerate()
    {
        let (b, n, t) = (shape.0, shape.4, shape.5);
        let (q, k, v) = attention_inputs(dev, dtype, shape, 90 + 3 * case as u64)?;
        let rows: Vec<Range<usize>> = (0..b * n)
            .map(|e| {
                let (s, r) = (e / n, e % n);
                match case {
                    0 => 0..r + 1,
                    1 if s == 2 && r < 5 => 0..0,
                    1 => 17 * s..t - n + r + 1,
                    3 => 0..r + 1,
                    _ => (if r < 90 { 0 } else { 90 })..r + 1,
                }
            })
            .collect();
        let iv = RowIntervals::from_rows(&rows, b, n, t, dev)?;
        let what = format!("prefill attention case {case}");
        outs.push(attend_case(
            &q,
            &k,
            &v,
            &iv,
            serves(&q, &k, &v),
            switched_off(),
            &what,
        )?);
    }
    Ok(outs)
}

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
    use crate::ops::qkv_rope::{apply, serves, Heads, Projections, Rows, Tables};
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
        let p = Projections {
            q: &q,
            k: &k,
            v: &v,
        };
        let rows = Rows {
            index: index.as_ref(),
            cap,
        };
        let tabs = Tables {
            q: qtables.as_ref().unwrap_or(&tables),
            kv: &tables,
        };
        if dev.is_cuda() && !serves(p, heads, norms, tabs, rows) {
            candle_core::bail!("the fused QKV kernel does not serve case {case}");
        }
        let (q, k, v) = apply(p, heads, norms, tabs, rows, &mut cache, 0)?;
        for t in [q, k, v] {
            outs.push(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
        }
    }
    Ok(outs)
}

/// Three AdamW steps of a `[64, 300]` parameter on `dev` (f32 master weights; the second one
/// with a clip scale), from f32 gradients or from bf16 ones (a bf16 compute copy's): the weights,
/// the moments `[2, n]` and the bf16 compute copy (written by the step's kernel on a GPU, cast
/// from the weights on the CPU), as f32 on the CPU.
fn adamw(dev: &Device, grads: DType) -> Result<Vec<Tensor>> {
    use crate::ops::adamw::{adamw_step_copy, AdamStep};
    let w = fill(&[64, 300], 8, 1.0)?.to_device(dev)?;
    let st = Tensor::zeros((2, 64 * 300), DType::F32, dev)?;
    let copy = Tensor::zeros((64, 300), DType::BF16, dev)?;
    let mut written = false;
    for t in 1..=3i32 {
        let g = fill(&[64, 300], 9 + t as u64, 0.1)?
            .to_dtype(grads)?
            .to_device(dev)?;
        // step 2 clipped: the gradient scaled inside the moments kernel
        let s = AdamStep::at(
            t,
            (0.9, 0.95),
            1e-8,
            6e-4,
            1.0 - 6e-4 * 0.01,
            (t == 2).then_some(0.37),
        );
        written = adamw_step_copy(&w, &st, &g, s, Some(&copy))?;
    }
    if dev.is_cuda() && !written {
        candle_core::bail!("adamw: the GPU's step did not write the compute copy");
    }
    let copy = if written {
        copy
    } else {
        w.to_dtype(DType::BF16)?
    };
    [w, st, copy.to_dtype(DType::F32)?]
        .into_iter()
        .map(|t| t.to_device(&Device::Cpu))
        .collect()
}

/// The RMSNorm backward ([`crate::ops::rms_norm_grad`]) at a hidden width (300 rows of 1,000:
/// the row loops' tails and several chunks of `dw`) and a per-head width (2,000 rows of 128):
/// `dx` and `dw` of each, on the CPU.
fn rms_norm_grads(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let mut outs = Vec::new();
    for (i, (rows, h)) in [(300usize, 1000usize), (2000, 128)].into_iter().enumerate() {
        let s = 20 + 3 * i as u64;
        let on = |t: Tensor| t.to_device(dev)?.to_dtype(dtype);
        let x = on(fill(&[rows, h], s, 2.0)?)?;
        let g = on(fill(&[rows, h], s + 1, 0.5)?)?;
        let w = on(fill(&[h], s + 2, 1.0)?)?;
        let (dx, dw) = crate::ops::rms_norm_grad::rms_norm_grad(&x, &w, &g, 1e-6)?;
        for t in [dx, dw] {
            outs.push(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
        }
    }
    Ok(outs)
}

/// `y` and the gradients of `Σ y · up` for `vars`, as f32 on the CPU (a check's outputs).
fn value_and_grads(y: Tensor, up: &Tensor, vars: &[&Var], what: &str) -> Result<Vec<Tensor>> {
    let g = (&y * up)?.sum_all()?.backward()?;
    let mut outs = vec![y];
    for v in vars {
        outs.push(
            g.get(v.as_tensor())
                .ok_or_else(|| candle_core::Error::Msg(format!("{what} check: no gradient")))?
                .clone(),
        );
    }
    outs.into_iter()
        .map(|t| t.to_dtype(DType::F32)?.to_device(&Device::Cpu))
        .collect()
}

/// One check row per `(name, got, want)`, named `{name} ({dtype:?})`.
fn push_rows(
    checks: &mut Vec<KernelCheck>,
    names: &[&str],
    got: &[Tensor],
    want: &[Tensor],
    dtype: DType,
    tolerance: f64,
) -> Result<()> {
    for ((name, a), b) in names.iter().zip(got).zip(want) {
        checks.push(KernelCheck {
            name: format!("{name} ({dtype:?})"),
            rel_err: rel_err(a, b)? as f64,
            tolerance,
        });
    }
    Ok(())
}

/// [`crate::ops::sample_rows`] on `dev`: `[probabilities at T = 0.8, draws, verdicts]` on the
/// CPU, for `rows` rows of `v` logits. The verdicts judge the second half's draws (from its
/// probabilities) against the first half's; one pair of rows is equal (its draft always kept).
fn sampling(dev: &Device, rows: usize, v: usize) -> Result<Vec<Tensor>> {
    use crate::ops::sample_rows::{draw_rows, judge_rows, temperature_probs, Uniforms};
    let mut x = fill(&[rows, v], 13, 8.0)?;
    let h = rows / 2;
    x = x.slice_assign(&[h..h + 1, 0..v], &x.narrow(0, 0, 1)?)?;
    let u: Vec<f32> = (0..3 * rows)
        .map(|i| (i as f32 * 0.618_034 + 0.1).fract())
        .collect();
    let u = Uniforms::new(&u, dev)?;
    let p = temperature_probs(&x.to_device(dev)?, 0.8)?;
    let drawn = draw_rows(&p, &u, 0)?;
    let (pp, q) = (p.narrow(0, 0, h)?, p.narrow(0, h, h)?);
    let verdicts = judge_rows(&pp, &q, &drawn.narrow(0, h, h)?, &u, rows, 2 * rows)?;
    [p, drawn, verdicts.flatten_all()?]
        .iter()
        .map(|t| t.to_device(&Device::Cpu))
        .collect()
}

/// [`crate::ops::sampled_tree`] on `dev`: 8 draws from each of 6 depths' distributions (T =
/// 0.8, rows of `v` values), and 4 walks (path length, bonus, path) down the tree of budget 12
/// shaped by their top 8 and given the CPU's draws (the same tree on both devices): two with
/// random target rows (rejections, residuals), two with each row equal to its children's draft
/// distribution (every first child kept), each with its own uniform numbers.
fn sampled_tree(dev: &Device, v: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    use crate::ops::sample_rows::{temperature_probs, Uniforms};
    use crate::ops::sampled_tree::{draw_distinct_rows, walk_tree_rows, TreeTable};
    use dflash_core::sampled_tree::{place_draws, sampled_shape};
    let (depths, k, budget) = (6, 8, 12);
    let q = temperature_probs(&fill(&[depths, v], 19, 8.0)?, 0.8)?;
    let u: Vec<f32> = (0..depths * k + 4 * (budget + 1))
        .map(|i| (i as f32 * 0.618_034 + 0.3).fract())
        .collect();
    let (ud, uc) = (Uniforms::new(&u, dev)?, Uniforms::new(&u, &Device::Cpu)?);
    let draws = draw_distinct_rows(&q.to_device(dev)?, &ud, 0, k)?.to_device(&Device::Cpu)?;
    let (mut tree, _) = sampled_shape(0, &crate::ops::top_k::top_k_rows(&q, k)?, budget);
    place_draws(
        &mut tree,
        &draw_distinct_rows(&q, &uc, 0, k)?.to_vec2::<u32>()?,
    );
    let n = tree.len();
    let random = temperature_probs(&fill(&[n, v], 23, 8.0)?, 0.8)?;
    let at: Vec<u32> = tree
        .depths
        .iter()
        .map(|&d| d.min(depths - 1) as u32)
        .collect();
    let same = q.index_select(&Tensor::new(at, &Device::Cpu)?, 0)?;
    let (table, qd) = (TreeTable::new(&tree, dev)?, q.to_device(dev)?);
    let mut walks = Vec::new();
    for (w, p) in [&random, &random, &same, &same].into_iter().enumerate() {
        let out = walk_tree_rows(&p.to_device(dev)?, &qd, &table, &ud, depths * k + w * n)?;
        walks.extend(out.to_vec1::<u32>()?);
    }
    Ok((draws.flatten_all()?.to_vec1::<u32>()?, walks))
}

/// A training linear `[1, 300, 96] · [80, 96]ᵀ` with both inputs tracked (on a GPU one node
/// with a written backward, on the CPU candle's autograd): the output, `dx` and `dW` on the CPU.
fn linear_grads(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let x = Var::from_tensor(
        &fill(&[1, 300, 96], 31, 1.0)?
            .to_device(dev)?
            .to_dtype(dtype)?,
    )?;
    let w = Var::from_tensor(&fill(&[80, 96], 32, 0.3)?.to_device(dev)?.to_dtype(dtype)?)?;
    let up = fill(&[1, 300, 80], 33, 1.0)?
        .to_device(dev)?
        .to_dtype(dtype)?;
    let y = crate::layers::linear::matmul_t(x.as_tensor(), w.as_tensor())?;
    value_and_grads(y, &up, &[&x, &w], "linear")
}

/// SwiGLU's gate `silu(g) · u` on `[300, 700]` with both inputs tracked (on a GPU the fused op
/// and its written backward, on the CPU candle's ops and autograd): `y`, `dg`, `du` on the CPU.
fn silu_mul_grads(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    let on = |t: Tensor| t.to_device(dev)?.to_dtype(dtype);
    let g = Var::from_tensor(&on(fill(&[300, 700], 41, 4.0)?)?)?;
    let u = Var::from_tensor(&on(fill(&[300, 700], 42, 1.0)?)?)?;
    let up = on(fill(&[300, 700], 43, 1.0)?)?;
    let y = crate::ops::silu_mul::silu_mul(g.as_tensor(), u.as_tensor())?;
    value_and_grads(y, &up, &[&g, &u], "silu-mul")
}

/// The permuted copy ([`crate::ops::permute`]) of a strided view (a narrow of a transposed
/// `[4, 70, 9, d]`: an offset and gaps) to the heads-first order, and the gradient of a
/// weighted sum through it (the inverse permutation): both on the CPU. `d` = 64 takes the
/// kernel's walk over 16-byte vectors, `d` = 7 its walk over values.
fn permute_rows(dev: &Device, dtype: DType, d: usize) -> Result<Vec<Tensor>> {
    use crate::ops::permute::permuted_twin;
    let base = Var::from_tensor(
        &fill(&[4, 70, 9, d], 51, 1.0)?
            .to_device(dev)?
            .to_dtype(dtype)?,
    )?;
    let view = base.as_tensor().transpose(1, 2)?.narrow(2, 5, 60)?; // [4, 9, 60, d]
    let y = permuted_twin(&view, &[0, 2, 1, 3])?; // [4, 60, 9, d]
    let w = fill(&[4, 60, 9, d], 52, 1.0)?
        .to_device(dev)?
        .to_dtype(dtype)?;
    value_and_grads(y, &w, &[&base], "permute")
}

/// The tree of the Gated DeltaNet rows (parents of 8 rows: two branches off the root, a
/// chain of three, a node with two children).
const CHECK_TREE: [Option<usize>; 8] = [
    None,
    Some(0),
    Some(0),
    Some(1),
    Some(3),
    Some(2),
    Some(4),
    Some(4),
];

/// Packed rows of the gated delta rule (`[n, row_len]`: q, k of unit scale as L2-normalised in
/// the model, v, β in (0, 1), g < 0) and a non-zero state, seeded, on the CPU.
pub(crate) fn gdn_rows(
    dims: crate::ops::gdn_recurrence::RecurrenceDims,
    n: usize,
    seed: u64,
) -> Result<(Tensor, Tensor)> {
    let (kd, vd) = (dims.hk * dims.dk, dims.hv * dims.dv);
    let qk = (fill(&[n, 2 * kd], seed, 1.0)? / (dims.dk as f64).sqrt())?;
    let v = fill(&[n, vd], seed + 1, 1.0)?;
    let beta = ((fill(&[n, dims.hv], seed + 2, 1.0)? + 1.0)? * 0.5)?;
    let g = ((fill(&[n, dims.hv], seed + 3, 1.0)? - 1.5)? * 0.3)?;
    let rows = Tensor::cat(&[&qk, &v, &beta, &g], 1)?;
    Ok((rows, fill(&[dims.state_len()], seed + 4, 0.5)?))
}

/// The gated delta rule's recurrence at the Qwen3.6-27B layer shape (16 key / 48 value heads
/// of 128) with a smaller one whose value heads are not a multiple of the kernel's 32-column
/// tile: a tree verify keeping every row's state, and a 96-row chain keeping the last (a
/// prefill). `[o, states]` per case, on the CPU.
fn gdn(dev: &Device) -> Result<Vec<Tensor>> {
    use crate::ops::gdn_recurrence::{gdn_recurrence, RecurrenceDims};
    let mut out = Vec::new();
    for (dims, seed) in [
        (
            RecurrenceDims {
                hk: 16,
                hv: 48,
                dk: 128,
                dv: 128,
            },
            20u64,
        ),
        (
            RecurrenceDims {
                hk: 2,
                hv: 6,
                dk: 24,
                dv: 40,
            },
            30,
        ),
    ] {
        let tree = CHECK_TREE.to_vec();
        let chain: Vec<Option<usize>> = (0..96).map(|i: usize| i.checked_sub(1)).collect();
        for (parents, keep) in [(tree, true), (chain, false)] {
            let (rows, init) = gdn_rows(dims, parents.len(), seed)?;
            let (o, st) = gdn_recurrence(
                &rows.to_device(dev)?,
                &init.to_device(dev)?,
                &parents,
                dims,
                keep,
            )?;
            out.push(o.to_device(&Device::Cpu)?);
            out.push(st.to_device(&Device::Cpu)?);
        }
    }
    Ok(out)
}

/// The chunked rule over a prefill at the Qwen3.6-27B layer shape (200 rows: 64 + 64 + 64 + 8)
/// and at the small shape (150 rows), from a non-zero state. `[o, state]` per case, on the CPU.
fn gdn_chunk(dev: &Device) -> Result<Vec<Tensor>> {
    use crate::ops::gdn_chunk::gdn_chunked;
    use crate::ops::gdn_recurrence::RecurrenceDims;
    let mut out = Vec::new();
    for (dims, n, seed) in [
        (
            RecurrenceDims {
                hk: 16,
                hv: 48,
                dk: 128,
                dv: 128,
            },
            200usize,
            40u64,
        ),
        (
            RecurrenceDims {
                hk: 2,
                hv: 6,
                dk: 24,
                dv: 40,
            },
            150,
            50,
        ),
    ] {
        let (rows, init) = gdn_rows(dims, n, seed)?;
        let (o, st) = gdn_chunked(&rows.to_device(dev)?, &init.to_device(dev)?, dims)?;
        out.push(o.to_device(&Device::Cpu)?);
        out.push(st.to_device(&Device::Cpu)?);
    }
    Ok(out)
}

/// A Gated DeltaNet layer's prep and gated norm at the Qwen3.6-27B layer shape: a tree of 8 rows
/// over 3 committed conv inputs (K = 4). `[rows, normed]`, on the CPU.
fn gdn_prep_and_norm(dev: &Device) -> Result<Vec<Tensor>> {
    use crate::ops::gdn_prep::{gated_norm, gdn_prep, window_index};
    use crate::ops::gdn_recurrence::RecurrenceDims;
    let d = RecurrenceDims {
        hk: 16,
        hv: 48,
        dk: 128,
        dv: 128,
    };
    let kk = 4;
    let parents = CHECK_TREE;
    let n = parents.len();
    let c = 2 * d.hk * d.dk + d.hv * d.dv;
    let buf = Tensor::cat(
        &[
            fill(&[kk - 1 + n, c], 40, 1.0)?,
            Tensor::zeros((1, c), DType::F32, &Device::Cpu)?,
        ],
        0,
    )?;
    let ba = fill(&[n, 2 * d.hv], 41, 3.0)?;
    let idx = Tensor::from_vec(window_index(&parents, kk), (n, kk), &Device::Cpu)?;
    let consts = Tensor::cat(
        &[
            fill(&[kk * c], 42, 0.5)?,
            fill(&[d.hv], 43, 1.0)?,
            (fill(&[d.hv], 44, 1.0)?.exp()?.neg())?,
        ],
        0,
    )?;
    let on = |t: &Tensor| t.to_device(dev);
    let rows = gdn_prep(&on(&buf)?, &on(&ba)?, &on(&idx)?, &on(&consts)?, d, kk)?;
    let vd = d.hv * d.dv;
    let o = fill(&[n, vd], 45, 1.0)?;
    let z = fill(&[n, vd], 46, 2.0)?;
    let w = fill(&[d.dv], 47, 1.0)?;
    let normed = gated_norm(&on(&o)?, &on(&z)?, &on(&w)?, 1e-6)?;
    [rows, normed]
        .into_iter()
        .map(|t| t.to_device(&Device::Cpu))
        .collect()
}

/// Compare `dev` (f32 and bf16) with the CPU (f32). Tolerances: 1e-4 relative in f32, 3e-2
/// in bf16 (inputs and outputs rounded to 8 bits of mantissa).
pub fn compare_with_cpu(dev: &Device) -> Result<Vec<KernelCheck>> {
    let cpu = run(&Device::Cpu, DType::F32)?;
    let names = [
        "attention out",
        "attention dq",
        "attention dk",
        "attention dv",
        "cross-entropy",
        "cross-entropy dlogits",
        "interval softmax",
    ];
    let mut checks = Vec::new();
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
        let got = run(dev, dtype)?;
        push_rows(&mut checks, &names, &got, &cpu, dtype, tol)?;
    }
    // the fused interval attention against the matmuls around the interval softmax
    let want = interval_attention_rows(&Device::Cpu, DType::F32)?;
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
        let got = interval_attention_rows(dev, dtype)?;
        let names = [
            "interval attention, 7 slots decoding (splits merged)",
            "interval attention, 100 slots decoding",
            "interval attention, 16-row verify, head dim 128 (bf16: verify kernel; f32: 4 row groups)",
            "interval attention, 16-row verify, head dim 64 (bf16: verify kernel; f32: 3 row groups)",
            "interval attention, 5 slots decoding, 6 heads per K/V head of 128",
            "interval attention, one sequence's AR step, 4 heads per K/V head of 128",
            "interval attention, 3 slots decoding, one head per K/V head",
            "interval attention, 2 sequences verifying 8 rows, one left-padded",
            "interval attention, 2 sequences of 5 rows, one split, an empty row",
        ];
        push_rows(&mut checks, &names, &got, &want, dtype, tol)?;
    }
    // the tree kernel (bf16 only) against the matmuls around the interval softmax's windows
    let want = tree_attention_rows(&Device::Cpu, DType::F32)?;
    let got = tree_attention_rows(dev, DType::BF16)?;
    let names = [
        "tree attention, Qwen3-8B's DDTree-8 verify (36 rows per K/V head)",
        "tree attention, SmolLM2's 20-node tree padded to 33 rows, a fixed capacity (8 warps)",
        "tree attention, 65 rows, the window's last bit (8 warps)",
        "tree attention, an AR step of 7 heads per K/V head",
        "tree attention, a 16-row chain verify of 7 heads per K/V head (8 warps, empty windows)",
    ];
    push_rows(&mut checks, &names, &got, &want, DType::BF16, 3e-2)?;
    // the prefill attention (bf16 only) against the matmuls around the interval softmax
    let want = prefill_attention_rows(&Device::Cpu, DType::F32)?;
    let got = prefill_attention_rows(dev, DType::BF16)?;
    let names = [
        "prefill attention, causal prefill of 300 rows, head dim 128",
        "prefill attention, 3 sequences of 70 rows, left-padded, head dim 64",
        "prefill attention, a packed row of two segments",
        "prefill attention, causal prefill of 150 rows, 7 heads per K/V head",
    ];
    push_rows(&mut checks, &names, &got, &want, DType::BF16, 3e-2)?;
    // the training attention's kernels (bf16 only) against the windowed matmuls
    let want = train_attention_rows(&Device::Cpu, DType::F32)?;
    let got = train_attention_rows(dev, DType::BF16)?;
    let mut names = Vec::new();
    for case in [
        "SmolLM2's heads, two sequences",
        "head dim 128, a sliding window",
        "7 heads per K/V head",
    ] {
        for part in ["out", "dq", "dk", "dv"] {
            names.push(format!("training attention kernels {part}, {case}"));
        }
    }
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    push_rows(&mut checks, &names, &got, &want, DType::BF16, 3e-2)?;
    // the RMSNorm backward of training (bf16 inputs rounded alike on both sides)
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        let (got, want) = (
            rms_norm_grads(dev, dtype)?,
            rms_norm_grads(&Device::Cpu, dtype)?,
        );
        let names = [
            "rms-norm backward dx, rows of 1,000",
            "rms-norm backward dw, rows of 1,000",
            "rms-norm backward dx, rows of 128",
            "rms-norm backward dw, rows of 128",
        ];
        push_rows(&mut checks, &names, &got, &want, dtype, tol)?;
    }
    // the training linear's written backward against candle's autograd on the CPU
    let want = linear_grads(&Device::Cpu, DType::F32)?;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let got = linear_grads(dev, dtype)?;
        push_rows(
            &mut checks,
            &[
                "training linear out",
                "training linear dx",
                "training linear dW",
            ],
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // the permuted copy: the same values, bit for bit
    for (dtype, d) in [
        (DType::F32, 64),
        (DType::BF16, 64),
        (DType::F32, 7),
        (DType::BF16, 7),
    ] {
        let (got, want) = (
            permute_rows(dev, dtype, d)?,
            permute_rows(&Device::Cpu, dtype, d)?,
        );
        let names: &[&str] = if d == 7 {
            &[
                "permuted copy, by value",
                "permuted copy backward, by value",
            ]
        } else {
            &["permuted copy", "permuted copy backward"]
        };
        push_rows(&mut checks, names, &got, &want, dtype, 0.0)?;
    }
    // SwiGLU of a stacked gate/up product (the target's MLP on a GPU) against silu_mul's twin
    let stacked = |dev: &Device, dtype: DType| -> Result<Vec<Tensor>> {
        let gu = fill(&[2, 150, 1400], 31, 4.0)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let y = crate::ops::silu_mul::silu_mul_stacked(&gu, 700)?;
        Ok(vec![y.to_dtype(DType::F32)?.to_device(&Device::Cpu)?])
    };
    let want = stacked(&Device::Cpu, DType::F32)?;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let got = stacked(dev, dtype)?;
        push_rows(
            &mut checks,
            &["silu·up of a stacked gate/up"],
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // the residual add and the RMSNorm after it in one kernel against the add and the norm
    let add_norm = |dev: &Device, dtype: DType| -> Result<Vec<Tensor>> {
        let mut outs = Vec::new();
        for (shape, seed) in [(vec![3, 7, 576], 41u64), (vec![1, 2, 4096], 43)] {
            let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
            let x = on(fill(&shape, seed, 3.0)?)?;
            let h = on(fill(&shape, seed + 1, 1.0)?)?;
            let w = on(fill(&shape[2..], seed + 2, 0.5)?.affine(1.0, 1.0)?)?;
            let norm = crate::layers::norm::RmsNorm::new(w, 1e-5);
            if dev.is_cuda() && !crate::ops::add_norm::serves(&x, &h, &norm) {
                candle_core::bail!("the fused add + RMSNorm does not serve {shape:?}");
            }
            let (s, n) = crate::ops::add_norm::add_rms_norm(&x, &h, &norm)?;
            for t in [s, n] {
                outs.push(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
            }
        }
        Ok(outs)
    };
    let want = add_norm(&Device::Cpu, DType::F32)?;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let got = add_norm(dev, dtype)?;
        push_rows(
            &mut checks,
            &[
                "add + rms-norm: sum, rows of 576",
                "add + rms-norm: norm, rows of 576",
                "add + rms-norm: sum, rows of 4,096",
                "add + rms-norm: norm, rows of 4,096",
            ],
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // one row through a projection (the AR step's products) against candle's matmul
    let gemv = |dev: &Device, dtype: DType| -> Result<Vec<Tensor>> {
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
    };
    let want = gemv(&Device::Cpu, DType::F32)?;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let got = gemv(dev, dtype)?;
        push_rows(
            &mut checks,
            &[
                "one-row product, 3,000 × 4,096",
                "one-row product, 1,536 × 576",
            ],
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // attention under an additive mask (tree verifies, the draft block) against the composed ops
    let masked = |dev: &Device, dtype: DType| -> Result<Vec<Tensor>> {
        use crate::layers::attention::attend;
        let mut outs = Vec::new();
        for (b, hq, hkv, d, n, t, seed) in [(1, 8, 2, 128, 9, 40, 81u64), (2, 9, 3, 64, 5, 33, 85)]
        {
            let on = |x: Tensor| x.to_dtype(dtype)?.to_device(dev);
            let q = on(fill(&[b, hq, n, d], seed, 1.0)?)?;
            let k = on(fill(&[b, hkv, t, d], seed + 1, 1.0)?)?;
            let v = on(fill(&[b, hkv, t, d], seed + 2, 1.0)?)?;
            // row i of sequence s sees the first t − n columns and its tree ancestors
            let vals: Vec<f32> = (0..b * n * t)
                .map(|e| {
                    let (s, i, c) = (e / (n * t), (e / t) % n, e % t);
                    let seen = c < t - n || (c - (t - n) <= i && (i + c + s) % 3 != 1);
                    if seen || c == t - n + i {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let shape: Vec<usize> = if b == 1 {
                vec![n, t]
            } else {
                vec![b, 1, 1, n, t]
            };
            let mask = on(Tensor::from_vec(vals, shape, &Device::Cpu)?)?;
            let o = attend(&q, &k, &v, &mask, 1.0 / (d as f64).sqrt())?;
            outs.push(o.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
        }
        Ok(outs)
    };
    let want = masked(&Device::Cpu, DType::F32)?;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 3e-2)] {
        let got = masked(dev, dtype)?;
        push_rows(
            &mut checks,
            &[
                "masked attention, a 9-row tree",
                "masked attention, 2 sequences of 5 rows",
            ],
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // the fixed layout's cache write against candle's scatter_set
    let scatter = |dev: &Device, dtype: DType| -> Result<Vec<Tensor>> {
        let on = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
        let dst = on(fill(&[2, 3, 40, 64], 51, 1.0)?)?;
        let src = on(fill(&[2, 3, 5, 64], 52, 2.0)?)?;
        let rows: Vec<u32> = (0..2 * 3 * 5)
            .flat_map(|r| std::iter::repeat_n((7 * r as u32 + 3) % 40, 64))
            .collect();
        let index = Tensor::from_vec(rows, (2, 3, 5, 64), &Device::Cpu)?.to_device(dev)?;
        crate::ops::scatter_rows::scatter_rows(&dst, &src, &index)?;
        Ok(vec![dst.to_dtype(DType::F32)?.to_device(&Device::Cpu)?])
    };
    let want = scatter(&Device::Cpu, DType::F32)?;
    for dtype in [DType::F32, DType::BF16] {
        let got = scatter(dev, dtype)?;
        let tol = if dtype == DType::F32 { 0.0 } else { 1e-2 };
        push_rows(
            &mut checks,
            &["cache rows written through an index"],
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // a tree's path moved down in six K/V buffers at once against the gather: rows 0..20
    // stay, then row 20 ← 21, 21 ← 22 (each read before the next move writes it), 22 ← 26
    let moves = |dev: &Device, dtype: DType| -> Result<Vec<Tensor>> {
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
    };
    let want = moves(&Device::Cpu, DType::F32)?;
    for dtype in [DType::F32, DType::BF16] {
        let got = moves(dev, dtype)?;
        let tol = if dtype == DType::F32 { 0.0 } else { 1e-2 };
        push_rows(
            &mut checks,
            &["a tree's path moved in six K/V buffers"],
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // the attention's per-head norms, RoPE and cache writes in one kernel against the ops
    let want = qkv_rope_rows(&Device::Cpu, DType::F32)?;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let got = qkv_rope_rows(dev, dtype)?;
        push_rows(
            &mut checks,
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
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // SwiGLU's fused gate and its written backward against candle's ops on the CPU
    let want = silu_mul_grads(&Device::Cpu, DType::F32)?;
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let got = silu_mul_grads(dev, dtype)?;
        push_rows(
            &mut checks,
            &["silu·up", "silu·up dgate", "silu·up dup"],
            &got,
            &want,
            dtype,
            tol,
        )?;
    }
    // the arg-max of each row: the same index, ties (the values repeat) and NaN included
    let mut x = fill(&[48, 3001], 5, 8.0)?;
    x = x.slice_assign(&[0..1, 0..1], &Tensor::new(&[[f32::NAN]], &Device::Cpu)?)?;
    x = x.slice_assign(&[1..2, 7..8], &Tensor::new(&[[f32::NAN]], &Device::Cpu)?)?;
    let (a, b) = (
        crate::ops::argmax::argmax_rows(&x.to_device(dev)?)?,
        crate::ops::argmax::argmax_rows(&x)?,
    );
    let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
    checks.push(KernelCheck {
        name: "argmax rows (F32), fraction of rows that differ".into(),
        rel_err: differ as f64 / b.len() as f64,
        tolerance: 0.0,
    });
    // the top k of each row (DDTree's candidates): the same tokens in the same order; rows of
    // 9,000 values span three segments of the GPU's first stage, the last shorter than k = 1000
    let long = fill(&[6, 9000], 11, 8.0)?;
    for (x, k) in [(&x, 40), (&x, 100), (&long, 1000)] {
        let (a, b) = (
            crate::ops::top_k::top_k_rows(&x.to_device(dev)?, k)?,
            crate::ops::top_k::top_k_rows(x, k)?,
        );
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(p, q)| p.iter().map(|t| t.0).ne(q.iter().map(|t| t.0)))
            .count();
        checks.push(KernelCheck {
            name: format!("top-{k} rows (F32), fraction of rows that differ"),
            rel_err: differ as f64 / b.len() as f64,
            tolerance: 0.0,
        });
    }
    // sampling at T > 0: probabilities, draws and verdicts (rows of 3,001 and of 151,936
    // values); draws and verdicts the same tokens
    for (rows, v) in [(48, 3001), (4, 151_936)] {
        let (got, want) = (sampling(dev, rows, v)?, sampling(&Device::Cpu, rows, v)?);
        push_rows(
            &mut checks,
            &[&format!("temperature probabilities, {v} values")],
            &got[..1],
            &want[..1],
            DType::F32,
            1e-5,
        )?;
        for (i, what) in [(1, "draws"), (2, "verdicts")] {
            let (a, b) = (got[i].to_vec1::<u32>()?, want[i].to_vec1::<u32>()?);
            let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            checks.push(KernelCheck {
                name: format!("sampled {what} of rows of {v} values (F32), fraction that differ"),
                rel_err: differ as f64 / b.len() as f64,
                tolerance: 0.0,
            });
        }
    }
    // a sampled tree's draws without replacement and its walks (`ops::sampled_tree`): the
    // same draws, the same paths and bonuses
    for v in [3001, 151_936] {
        let (got, want) = (sampled_tree(dev, v)?, sampled_tree(&Device::Cpu, v)?);
        for (what, a, b) in [("draws", &got.0, &want.0), ("walks", &got.1, &want.1)] {
            let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
            checks.push(KernelCheck {
                name: format!(
                    "sampled tree {what}, rows of {v} values (F32), fraction that differ"
                ),
                rel_err: differ as f64 / b.len() as f64,
                tolerance: 0.0,
            });
        }
    }
    // a top-k and top-p rule's probabilities (the bisected cuts of `rule_probs_f32`): the
    // host's rule within rounding, the same tokens kept; top-k alone, top-p alone, both
    for (rows, v, k, top_p) in [
        (48, 3001, 20, 0.9f32),
        (4, 151_936, 64, 1.0),
        (48, 3001, 0, 0.9),
        (4, 151_936, 500, 0.95),
    ] {
        let x = fill(&[rows, v], 17, 8.0)?;
        let probs = |d: &Device| -> Result<Tensor> {
            crate::ops::sample_rows::rule_probs(&x.to_device(d)?, 0.8, k, top_p)?
                .to_device(&Device::Cpu)
        };
        let (got, want) = (probs(dev)?, probs(&Device::Cpu)?);
        push_rows(
            &mut checks,
            &[&format!("top-{k} top-p {top_p} probabilities, {v} values")],
            std::slice::from_ref(&got),
            std::slice::from_ref(&want),
            DType::F32,
            1e-5,
        )?;
        let (a, b) = (
            got.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?,
        );
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| (**x > 0.0) != (**y > 0.0))
            .count();
        checks.push(KernelCheck {
            name: format!("top-{k} top-p {top_p} rows of {v} values, tokens kept that differ"),
            rel_err: differ as f64 / b.len() as f64,
            tolerance: 0.0,
        });
    }
    // the AdamW kernels round every operation as their CPU twin does
    // (one pass on a GPU), and write the compute copy as a cast rounds (bit for bit)
    for (grads, names) in [
        (
            DType::F32,
            ["adamw weights", "adamw moments", "adamw compute copy"],
        ),
        (
            DType::BF16,
            [
                "adamw weights, bf16 gradients",
                "adamw moments, bf16 gradients",
                "adamw compute copy, bf16 gradients",
            ],
        ),
    ] {
        let (got, want) = (adamw(dev, grads)?, adamw(&Device::Cpu, grads)?);
        push_rows(
            &mut checks,
            &names[..2],
            &got[..2],
            &want[..2],
            DType::F32,
            1e-6,
        )?;
        push_rows(
            &mut checks,
            &names[2..],
            &got[2..],
            &want[2..],
            DType::F32,
            0.0,
        )?;
    }
    // the clip's sum of squares, each value read once (f32 and bf16; 300,000 values span the
    // kernel's largest grid)
    let x = fill(&[300, 1000], 12, 3.0)?;
    let mut got = Vec::new();
    let mut want = Vec::new();
    for dt in [DType::F32, DType::BF16] {
        let v = x.to_dtype(dt)?;
        got.push(crate::ops::sq_sum::sq_sum(&v.to_device(dev)?)?.to_device(&Device::Cpu)?);
        want.push(crate::ops::sq_sum::sq_sum(&v)?);
    }
    let names = [
        "sum of squares of f32 values",
        "sum of squares of bf16 values",
    ];
    push_rows(&mut checks, &names, &got, &want, DType::F32, 1e-5)?;
    // the linear-attention recurrence (f32 state): every output and kept state
    let names = [
        "gdn 27B-shape tree o",
        "gdn 27B-shape tree states",
        "gdn 27B-shape chain o",
        "gdn 27B-shape chain last state",
        "gdn small tree o",
        "gdn small tree states",
        "gdn small chain o",
        "gdn small chain last state",
    ];
    let mut got = gdn(dev)?;
    got.extend(gdn_prep_and_norm(dev)?);
    got.extend(gdn_chunk(dev)?);
    let mut want = gdn(&Device::Cpu)?;
    want.extend(gdn_prep_and_norm(&Device::Cpu)?);
    want.extend(gdn_chunk(&Device::Cpu)?);
    let names: Vec<&str> = names
        .into_iter()
        .chain([
            "gdn prep (27B shape, tree windows)",
            "gdn gated norm (27B shape)",
            "gdn chunked 27B-shape prefill o",
            "gdn chunked 27B-shape prefill state",
            "gdn chunked small prefill o",
            "gdn chunked small prefill state",
        ])
        .collect();
    push_rows(&mut checks, &names, &got, &want, DType::F32, 1e-5)?;
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU the check compares the CPU with itself in f32 (exact) and in bf16 (within
    /// its tolerance): the harness runs and the bf16 paths agree with f32.
    #[test]
    fn the_cpu_agrees_with_itself() {
        let checks = compare_with_cpu(&Device::Cpu).unwrap();
        assert_eq!(checks.len(), 177);
        for c in &checks {
            assert!(c.passed(), "{c:?}");
            if c.name.ends_with("(F32)") {
                assert_eq!(c.rel_err, 0.0, "{c:?}");
            }
        }
    }
}
