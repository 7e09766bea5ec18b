//! dflash-rs's own kernels on a device against their CPU twins: the block attention
//! ([`crate::ops::block_attention::attend_blocks`] with [`crate::ops::block_softmax`]) and the cross-entropy
//! ([`crate::ops::cross_entropy`]), values and gradients, on fixed pseudo-random inputs of the
//! drafter's shape (9/3 heads of 64, B = 16, several windows, two packed sequences); and the
//! target's interval softmax ([`crate::ops::interval_softmax`]) on a batch of right-aligned rows.
//! `check device` and `bench train` run it before trusting a GPU's numbers.

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::ops::compare::rel_err;

mod attention;
mod gdn;
mod layer_ops;
mod sampling;
mod training;

/// The Gated DeltaNet rows of the checks, which the CPU tests of the chunked rule share.
#[cfg(test)]
pub(crate) use gdn::gdn_rows;

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

/// `rows(dev, dtype)` against `rows(CPU, f32)` at each `(dtype, tolerance)` of `dtypes`, one
/// check per name. Example: `&[(DType::F32, 1e-5), (DType::BF16, 2e-2)]` → each name twice.
fn compare_rows(
    dev: &Device,
    checks: &mut Vec<KernelCheck>,
    names: &[&str],
    dtypes: &[(DType, f64)],
    rows: impl Fn(&Device, DType) -> Result<Vec<Tensor>>,
) -> Result<()> {
    let want = rows(&Device::Cpu, DType::F32)?;
    for &(dtype, tolerance) in dtypes {
        push_rows(checks, names, &rows(dev, dtype)?, &want, dtype, tolerance)?;
    }
    Ok(())
}

/// One case of the check: it runs its kernels on the device and their twins on the CPU and
/// appends its rows to the checks.
type Case = fn(&Device, &mut Vec<KernelCheck>) -> Result<()>;

/// The cases by name, in the order of the report.
const CASES: &[(&str, Case)] = &[
    (
        "block attention, cross-entropy, interval softmax",
        training::check_block_attention_cross_entropy,
    ),
    ("interval attention", attention::check_interval_attention),
    ("tree attention", attention::check_tree_attention),
    ("prefill attention", attention::check_prefill_attention),
    ("training attention", training::check_train_attention),
    ("rms-norm backward", training::check_rms_norm_backward),
    ("training linear", training::check_training_linear),
    ("permuted copy", training::check_permuted_copy),
    (
        "silu·up of a stacked gate/up",
        layer_ops::check_stacked_silu,
    ),
    ("add + rms-norm", layer_ops::check_add_norm),
    ("partial RoPE", layer_ops::check_partial_rope),
    ("one-row product", layer_ops::check_gemv),
    ("masked attention", attention::check_masked_attention),
    (
        "cache rows written through an index",
        layer_ops::check_indexed_cache_write,
    ),
    ("a tree's path moved", layer_ops::check_tree_path_moves),
    (
        "QKV norms, RoPE and cache writes",
        layer_ops::check_qkv_rope,
    ),
    ("silu·up and its backward", training::check_silu_mul),
    ("argmax rows", sampling::check_argmax),
    ("top-k rows", sampling::check_top_k),
    ("sampling at T > 0", sampling::check_sampling),
    ("sampled tree", sampling::check_sampled_tree),
    ("top-k top-p probabilities", sampling::check_rule_probs),
    ("adamw", training::check_adamw),
    ("sum of squares", training::check_sum_of_squares),
    ("gated delta rule", gdn::check_gdn),
];

/// Compare `dev` (f32 and bf16) with the CPU (f32). Tolerances: 1e-4 relative in f32, 3e-2
/// in bf16 (inputs and outputs rounded to 8 bits of mantissa).
pub fn compare_with_cpu(dev: &Device) -> Result<Vec<KernelCheck>> {
    let mut checks = Vec::new();
    for (_, case) in CASES {
        case(dev, &mut checks)?;
    }
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU the check compares the CPU with itself in f32 (exact) and in bf16 (within
    /// its tolerance): the harness runs and the bf16 paths agree with f32; the cases' names
    /// are distinct.
    #[test]
    fn the_cpu_agrees_with_itself() {
        let names: std::collections::HashSet<&str> = CASES.iter().map(|c| c.0).collect();
        assert_eq!(names.len(), CASES.len());
        let checks = compare_with_cpu(&Device::Cpu).unwrap();
        assert_eq!(checks.len(), 216);
        for c in &checks {
            assert!(c.passed(), "{c:?}");
            if c.name.ends_with("(F32)") {
                assert_eq!(c.rel_err, 0.0, "{c:?}");
            }
        }
    }
}
