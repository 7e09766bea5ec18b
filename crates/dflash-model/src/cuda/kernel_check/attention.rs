//! The attention kernels of inference against their CPU twins (the matmuls around the
//! softmaxes): the interval attention's decode, verify and interval kernels, the tree kernel,
//! the prefill attention and the attention under an additive mask.

use candle_core::{DType, Device, Result, Tensor};
use dflash_core::visibility::{causal, right_aligned};

use super::{compare_rows, fill, push_rows, KernelCheck};
use crate::ops::interval_softmax::RowIntervals;

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

/// The outputs [`check_masked_attention`] compares, on `dev` in `dtype`, as f32 on the CPU.
fn masked_attention_rows(dev: &Device, dtype: DType) -> Result<Vec<Tensor>> {
    use crate::layers::attention::attend;
    let mut outs = Vec::new();
    for (b, hq, hkv, d, n, t, seed) in [(1, 8, 2, 128, 9, 40, 81u64), (2, 9, 3, 64, 5, 33, 85)] {
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
}

/// The fused interval attention against the matmuls around the interval softmax
pub(super) fn check_interval_attention(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
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
        push_rows(checks, &names, &got, &want, dtype, tol)?;
    }
    Ok(())
}

/// The tree kernel (bf16 only) against the matmuls around the interval softmax's windows
pub(super) fn check_tree_attention(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    let want = tree_attention_rows(&Device::Cpu, DType::F32)?;
    let got = tree_attention_rows(dev, DType::BF16)?;
    let names = [
        "tree attention, Qwen3-8B's DDTree-8 verify (36 rows per K/V head)",
        "tree attention, SmolLM2's 20-node tree padded to 33 rows, a fixed capacity (8 warps)",
        "tree attention, 65 rows, the window's last bit (8 warps)",
        "tree attention, an AR step of 7 heads per K/V head",
        "tree attention, a 16-row chain verify of 7 heads per K/V head (8 warps, empty windows)",
    ];
    push_rows(checks, &names, &got, &want, DType::BF16, 3e-2)?;
    Ok(())
}

/// The prefill attention (bf16 only) against the matmuls around the interval softmax
pub(super) fn check_prefill_attention(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    let want = prefill_attention_rows(&Device::Cpu, DType::F32)?;
    let got = prefill_attention_rows(dev, DType::BF16)?;
    let names = [
        "prefill attention, causal prefill of 300 rows, head dim 128",
        "prefill attention, 3 sequences of 70 rows, left-padded, head dim 64",
        "prefill attention, a packed row of two segments",
        "prefill attention, causal prefill of 150 rows, 7 heads per K/V head",
    ];
    push_rows(checks, &names, &got, &want, DType::BF16, 3e-2)?;
    Ok(())
}

/// Attention under an additive mask (tree verifies, the draft block) against the composed ops
pub(super) fn check_masked_attention(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &[
            "masked attention, a 9-row tree",
            "masked attention, 2 sequences of 5 rows",
        ],
        &[(DType::F32, 1e-5), (DType::BF16, 3e-2)],
        masked_attention_rows,
    )
}
