//! One Gated DeltaNet layer's rule alone at the shape's head sizes (hybrid shapes): chunked
//! against recurrent per length, and `--profile-gdn-rule`'s profiled runs.

use anyhow::{Context, Result};
use candle_core::DType;
use dflash_core::config::TargetConfig;
use dflash_model::ops::gdn_chunk::ChunkMath;

use crate::timing::time;

/// `(rows, chunked s, its prep kernel's s (GPU), recurrent s)`.
pub(super) type GdnRuleTimes = (usize, f64, Option<f64>, f64);

/// The shape's Gated DeltaNet head sizes (`None` without linear attention).
fn gdn_dims(cfg: &TargetConfig) -> Option<dflash_model::ops::gdn_recurrence::RecurrenceDims> {
    Some(dflash_model::ops::gdn_recurrence::RecurrenceDims {
        hk: cfg.linear_num_key_heads?,
        hv: cfg.linear_num_value_heads?,
        dk: cfg.linear_key_head_dim?,
        dv: cfg.linear_value_head_dim?,
    })
}

/// `--gdn-lengths` as row counts.
fn gdn_lengths(lengths: &str) -> Result<Vec<usize>> {
    lengths
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| t.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<_>>()
        .context("--gdn-lengths: comma-separated positive integers")
}

/// One layer's rule inputs over a chain of `n` rows (random unit-scale q, k, β in (0, 1),
/// g < 0) and the empty state: `(rows, init)`.
fn gdn_rule_inputs(
    d: dflash_model::ops::gdn_recurrence::RecurrenceDims,
    n: usize,
    dev: &candle_core::Device,
) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
    use candle_core::Tensor;
    let (kd, vd) = (d.hk * d.dk, d.hv * d.dv);
    let u = |cols: usize| Tensor::rand(0f32, 1f32, (n, cols), dev);
    let qk = u(2 * kd)?
        .affine(2.0, -1.0)?
        .affine((3.0 / d.dk as f64).sqrt(), 0.0)?;
    let v = u(vd)?.affine(2.0, -1.0)?;
    let beta = u(d.hv)?;
    let g = u(d.hv)?.affine(-0.5, 0.0)?;
    let rows = Tensor::cat(&[&qk, &v, &beta, &g], 1)?;
    let init = Tensor::zeros(d.state_len(), DType::F32, dev)?;
    Ok((rows, init))
}

/// One Gated DeltaNet layer's rule at the shape's head sizes over chains of each of `lengths`
/// rows: `(rows, chunked s, its prep kernel's s (GPU), recurrent s)`. Empty for a shape
/// without linear attention.
pub(super) fn gdn_rule_times(
    cfg: &TargetConfig,
    dev: &candle_core::Device,
    lengths: &str,
    repeats: usize,
    math: ChunkMath,
) -> Result<Vec<GdnRuleTimes>> {
    use dflash_model::ops::gdn_chunk::{gdn_chunk_prep_only, gdn_chunked};
    use dflash_model::ops::gdn_recurrence::gdn_recurrence;
    let Some(d) = gdn_dims(cfg) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for n in gdn_lengths(lengths)? {
        let (rows, init) = gdn_rule_inputs(d, n, dev)?;
        let chain: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        let tc = time(dev, repeats, || {
            gdn_chunked(&rows, &init, d, math)?;
            Ok(())
        })?;
        let tp = if dev.is_cpu() {
            None
        } else {
            Some(time(dev, repeats, || {
                gdn_chunk_prep_only(&rows, d, math)?;
                Ok(())
            })?)
        };
        let tr = time(dev, repeats, || {
            gdn_recurrence(&rows, &init, &chain, d, false)?;
            Ok(())
        })?;
        out.push((n, tc, tp, tr));
    }
    Ok(out)
}

/// `--profile-gdn-rule`: the chunked rule (in `math`: the `--dtype`'s) at each length, warmed up once, then run `reps`
/// times per length inside the profiler range, one length after another in the given order.
pub(super) fn profile_gdn_rule(
    cfg: &TargetConfig,
    dev: &candle_core::Device,
    lengths: &str,
    reps: usize,
    math: ChunkMath,
) -> Result<()> {
    use dflash_model::ops::gdn_chunk::gdn_chunked;
    if dev.is_cpu() {
        anyhow::bail!("--profile-gdn-rule needs a CUDA device: it runs the rule's kernels");
    }
    let d =
        gdn_dims(cfg).context("--profile-gdn-rule: the shape has no linear-attention layers")?;
    let lengths = gdn_lengths(lengths)?;
    if lengths.is_empty() {
        anyhow::bail!("--profile-gdn-rule needs --gdn-lengths");
    }
    let inputs = lengths
        .iter()
        .map(|&n| gdn_rule_inputs(d, n, dev))
        .collect::<Result<Vec<_>>>()?;
    for (rows, init) in &inputs {
        gdn_chunked(rows, init, d, math)?;
    }
    dev.synchronize()?;
    let names: Vec<String> = lengths.iter().map(|n| format!("T = {n}")).collect();
    println!(
        "gdn rule profile ({reps} runs each, {math:?} products, in this order): {}",
        names.join(", ")
    );
    dflash_model::cuda::launch_profile::profiled_range(dev, || {
        for (rows, init) in &inputs {
            for _ in 0..reps {
                gdn_chunked(rows, init, d, math)?;
            }
            dev.synchronize()?;
        }
        Ok(())
    })
}
