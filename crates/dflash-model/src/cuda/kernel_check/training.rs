//! The training kernels against their CPU twins: the block attention and the cross-entropy
//! (values and gradients, with the interval softmax), the drafter's training attention, the
//! RMSNorm backward, the training linear, SwiGLU's gate, the permuted copy, AdamW and the
//! clip's sum of squares.

use candle_core::{DType, Device, Result, Tensor, Var};
use dflash_core::segments::Segments;
use dflash_core::visibility::{causal, draft_training_parts, right_aligned, DraftRule};

use super::{compare_rows, fill, push_rows, value_and_grads, KernelCheck};
use crate::ops::block_attention::{attend_blocks, context_windows};
use crate::ops::cross_entropy::cross_entropy_rows;
use crate::ops::interval_softmax::{interval_softmax, RowIntervals};

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

/// The block attention and the cross-entropy, values and gradients, and the interval softmax
/// ([`run`]) on `dev` in f32 and bf16 against the CPU in f32.
pub(super) fn check_block_attention_cross_entropy(
    dev: &Device,
    checks: &mut Vec<KernelCheck>,
) -> Result<()> {
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
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
        let got = run(dev, dtype)?;
        push_rows(checks, &names, &got, &cpu, dtype, tol)?;
    }
    Ok(())
}

/// The training attention's kernels (bf16 only) against the windowed matmuls
pub(super) fn check_train_attention(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
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
    push_rows(checks, &names, &got, &want, DType::BF16, 3e-2)?;
    Ok(())
}

/// The RMSNorm backward of training (bf16 inputs rounded alike on both sides)
pub(super) fn check_rms_norm_backward(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
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
        push_rows(checks, &names, &got, &want, dtype, tol)?;
    }
    Ok(())
}

/// The training linear's written backward against candle's autograd on the CPU
pub(super) fn check_training_linear(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &[
            "training linear out",
            "training linear dx",
            "training linear dW",
        ],
        &[(DType::F32, 1e-5), (DType::BF16, 2e-2)],
        linear_grads,
    )
}

/// SwiGLU's fused gate and its written backward against candle's ops on the CPU
pub(super) fn check_silu_mul(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
    compare_rows(
        dev,
        checks,
        &["silu·up", "silu·up dgate", "silu·up dup"],
        &[(DType::F32, 1e-5), (DType::BF16, 2e-2)],
        silu_mul_grads,
    )
}

/// The permuted copy: the same values, bit for bit
pub(super) fn check_permuted_copy(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
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
        push_rows(checks, names, &got, &want, dtype, 0.0)?;
    }
    Ok(())
}

/// The AdamW kernels round every operation as their CPU twin does
/// (one pass on a GPU), and write the compute copy as a cast rounds (bit for bit)
pub(super) fn check_adamw(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
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
        push_rows(checks, &names[..2], &got[..2], &want[..2], DType::F32, 1e-6)?;
        push_rows(checks, &names[2..], &got[2..], &want[2..], DType::F32, 0.0)?;
    }
    Ok(())
}

/// The clip's sum of squares, each value read once (f32 and bf16; 300,000 values span the
/// kernel's largest grid)
pub(super) fn check_sum_of_squares(dev: &Device, checks: &mut Vec<KernelCheck>) -> Result<()> {
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
    push_rows(checks, &names, &got, &want, DType::F32, 1e-5)?;
    Ok(())
}
