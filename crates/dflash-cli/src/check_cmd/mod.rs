//! `dflash-rs check device`: does a device compute what the CPU computes?
//!
//! On one prompt: CPU f32 vs device logits and taps (f32 ≤ 1e-4 relative; bf16 reported with
//! its own tolerance), AR on the device equals AR on the CPU at T = 0, DFlash and DDTree on the
//! device equal the device's AR, and training-path vs inference-path drafter logits agree on
//! the device. In bf16, a verify of many rows and an AR step round differently, so greedy
//! equality can break where the top-2 logits are close: those rows are reported, not required. Prints a table and
//! exits non-zero on any failed required check.

mod decoding;

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use clap::Args;

use crate::args::DeviceArgs;
use decoding::device_rows;
use dflash_core::sampling::SamplingParams;
use dflash_engine::{generate, Mode, Request};
use dflash_model::io::loader::{load_target, LoadedTarget};
use dflash_model::models::drafter::Drafter;
use dflash_model::ops::compare::rel_err;
use dflash_model::{Rows, TargetOutput};

#[derive(Args, Debug)]
pub struct DeviceCheckArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// A drafter directory (default: a seeded random 2-layer drafter).
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Relative tolerance for bf16 logits and taps against CPU f32.
    #[arg(long, default_value_t = 5e-2)]
    pub bf16_tolerance: f64,
    /// The device under test; f32 is always compared, `--dtype bf16` adds the bf16 rows.
    #[command(flatten)]
    pub run_on: DeviceArgs,
}

/// Relative error of a device forward against the CPU one: (logits, worst tap).
fn rel_logits_taps(got: &TargetOutput, cpu: &TargetOutput) -> Result<(f64, f64)> {
    let logits = rel_err(got.logits.as_ref().unwrap(), cpu.logits.as_ref().unwrap())? as f64;
    let mut taps = 0.0f64;
    for (g, c) in got.taps.iter().zip(&cpu.taps) {
        taps = taps.max(rel_err(g, c)? as f64);
    }
    Ok((logits, taps))
}

fn drafter_for(lt: &LoadedTarget, dir: &Option<PathBuf>) -> Result<Drafter> {
    match dir {
        Some(d) => Drafter::load_dir(d, &lt.target),
        None => dflash_model::models::drafter_init::random_drafter(lt, 2, 16, None, 0),
    }
}

/// The fused training kernels on `dev` against the CPU ([`dflash_model::cuda::kernel_check`]), as
/// `check device` rows; `print` also prints them (with an error if one fails).
pub fn kernel_rows(dev: &Device, print: bool) -> Result<Vec<(String, bool, String)>> {
    let rows: Vec<(String, bool, String)> =
        dflash_model::cuda::kernel_check::compare_with_cpu(dev)?
            .into_iter()
            .map(|c| {
                (
                    format!("fused {} vs CPU", c.name),
                    c.passed(),
                    format!("rel. err {:.1e} (≤ {:.0e})", c.rel_err, c.tolerance),
                )
            })
            .collect();
    if print {
        for (c, ok, detail) in &rows {
            eprintln!("{c}: {} ({detail})", if *ok { "pass" } else { "FAIL" });
        }
        if rows.iter().any(|r| !r.1) {
            bail!("the fused training kernels differ from their CPU twins on this device");
        }
    }
    Ok(rows)
}

/// One check's row: its name, whether it passed, its numbers.
type Row = (String, bool, String);

pub fn run(a: DeviceCheckArgs) -> Result<()> {
    let (dtype, dev) = a.run_on.parse()?;
    let kernels = kernel_rows(&dev, false)?;
    let cpu = load_target(&a.target, DType::F32, &Device::Cpu)?;
    let gpu32 = load_target(&a.target, DType::F32, &dev)?;
    let gpu16 = match dtype {
        DType::F32 => None,
        DType::BF16 => Some(load_target(&a.target, DType::BF16, &dev)?),
        other => bail!("check device compares f32 and bf16, not {other:?}"),
    };
    eprintln!("{gpu32}");
    let d_cpu = drafter_for(&cpu, &a.drafter)?;
    let taps = d_cpu.target_layer_ids.clone();
    let prompt = cpu
        .tokenizer
        .prompt_ids("Explain in two sentences why the sky is blue.", true)?;
    let mut rows: Vec<Row> = kernels;
    rows.extend(forward_rows(
        &a,
        &prompt,
        &taps,
        &cpu,
        &gpu32,
        gpu16.as_ref(),
    )?);
    let req = Request {
        prompt_ids: prompt.clone(),
        max_new_tokens: a.max_new_tokens,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        loop_window: 0,
    };
    let ar_cpu = generate(&cpu.target, None, Mode::Ar, &req, Default::default(), None)?;
    let precisions = std::iter::once(("f32", &gpu32)).chain(gpu16.as_ref().map(|g| ("bf16", g)));
    for (name, lt) in precisions {
        rows.extend(device_rows(&a, name, lt, &cpu, &req, &ar_cpu)?);
    }
    println!("| check | result | numbers |\n|---|---|---|");
    for (c, ok, detail) in &rows {
        println!("| {c} | {} | {detail} |", if *ok { "pass" } else { "FAIL" });
    }
    let failed = rows.iter().filter(|r| !r.1).count();
    if failed > 0 {
        bail!("{failed} device check(s) failed");
    }
    Ok(())
}

/// One prefill of `prompt` on the device, f32 (and bf16), against the CPU's: logits and taps.
fn forward_rows(
    a: &DeviceCheckArgs,
    prompt: &[u32],
    taps: &[usize],
    cpu: &LoadedTarget,
    gpu32: &LoadedTarget,
    gpu16: Option<&LoadedTarget>,
) -> Result<Vec<Row>> {
    let fwd = |lt: &LoadedTarget| {
        let mut c = lt.target.new_cache();
        lt.target.forward_causal(prompt, &mut c, taps, &Rows::All)
    };
    let (oc, o32) = (fwd(cpu)?, fwd(gpu32)?);
    let mut rows = Vec::new();
    let (l32, t32) = rel_logits_taps(&o32, &oc)?;
    rows.push((
        "f32 logits and taps vs CPU".into(),
        l32 <= 1e-4 && t32 <= 1e-4,
        format!("logits {l32:.1e}, taps {t32:.1e} (≤ 1e-4)"),
    ));
    if let Some(g16) = gpu16 {
        let (l16, t16) = rel_logits_taps(&fwd(g16)?, &oc)?;
        rows.push((
            "bf16 logits and taps vs CPU f32".into(),
            l16 <= a.bf16_tolerance && t16 <= a.bf16_tolerance,
            format!(
                "logits {l16:.1e}, taps {t16:.1e} (≤ {:.0e})",
                a.bf16_tolerance
            ),
        ));
    }
    Ok(rows)
}
