//! `dflash-rs check device`: does a device compute what the CPU computes?
//!
//! On one prompt: CPU f32 vs device logits and taps (f32 ≤ 1e-4 relative; bf16 reported with
//! its own tolerance), AR on the device equals AR on the CPU at T = 0, DFlash and DDTree on the
//! device equal the device's AR, and training-path vs inference-path drafter logits agree on
//! the device. In bf16, a verify of many rows and an AR step round differently, so greedy
//! equality can break where the top-2 logits are close: those rows are reported, not required. Prints a table and
//! exits non-zero on any failed required check.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use clap::Args;

use crate::args::DeviceArgs;
use dflash_core::sampling::SamplingParams;
use dflash_engine::{
    generate, generate_with, DecodeOptions, Generation, GraphCache, Mode, Request,
};
use dflash_model::io::loader::{load_target, LoadedTarget};
use dflash_model::models::draft_vocab::DraftVocab;
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

/// The checks' draft vocabulary: every other token, and the prompt's (the anchors' tokens are
/// drafted from).
fn check_vocab(lt: &LoadedTarget, req: &Request) -> DraftVocab {
    let mut ids: Vec<u32> = (0..lt.target.vocab_size() as u32).step_by(2).collect();
    ids.extend(&req.prompt_ids);
    ids.sort_unstable();
    ids.dedup();
    DraftVocab {
        token_ids: ids,
        source: "check device: every other token".into(),
        coverage: None,
    }
}

/// Graphs kept from one generation to the next (`generate_with`, as `eval` and `bench decode`
/// run them) decode what fresh graphs decode: three prompts in turn, the drafter drafting from
/// a vocabulary subset (its head's weights made anew by each generation, while the kept draft
/// graph reads the ones it was captured with), DFlash and DDTree-8.
fn kept_graphs_row(
    lt: &LoadedTarget,
    drafter_dir: &Option<PathBuf>,
    req: &Request,
    name: &str,
) -> Result<(String, bool, String)> {
    let mut d = drafter_for(lt, drafter_dir)?;
    d.draft_vocab = Some(check_vocab(lt, req));
    let opts = DecodeOptions {
        cuda_graphs: true,
        ..Default::default()
    };
    let p = &req.prompt_ids;
    let prompts = [&p[..], &p[..p.len() / 2], &p[1..]];
    let (mut same, mut gens) = (true, 0);
    for mode in [
        Mode::Chain {
            block: d.block_size,
        },
        Mode::Tree {
            block: d.block_size,
            budget: 8,
            top_k: 0,
        },
    ] {
        let mut kept = GraphCache::default();
        for prompt in prompts {
            let r = Request {
                prompt_ids: prompt.to_vec(),
                ..req.clone()
            };
            let fresh = generate(&lt.target, Some(&d), mode, &r, opts)?;
            let k = generate_with(&lt.target, Some(&d), mode, &r, opts, &mut kept)?;
            same &= k.new_tokens == fresh.new_tokens;
            gens += 1;
        }
    }
    Ok((
        format!("CUDA graphs kept across generations = fresh ones ({name})"),
        same || name == "bf16",
        format!(
            "{gens} generations, a draft vocabulary{}",
            if same {
                ""
            } else {
                "; differs (bf16: kept caches are larger, a tree's mask spans them; reported)"
            }
        ),
    ))
}

/// A DFlash chain (`tree` false) or a DDTree-8 at T = 1 (seed 7) in f32 on the device and on
/// the CPU: the same tokens, with the drafter as given and with a draft vocabulary (every other
/// token and the prompt's). Both keep their rounds on their device — the chain's draws and
/// verdicts ([`dflash_model::ops::sample_rows`]), the tree's draws and walk
/// ([`dflash_model::ops::sampled_tree`]), and their CPU twins — and draw the same uniform
/// numbers; only a draw within rounding of a boundary between two tokens could differ.
fn sampled_row(
    gpu: &LoadedTarget,
    cpu: &LoadedTarget,
    drafter_dir: &Option<PathBuf>,
    req: &Request,
    tree: bool,
) -> Result<(String, bool, String)> {
    let req = Request {
        sampling: SamplingParams::new(1.0, 1.0, 0, 7)?,
        ..req.clone()
    };
    let (mut same, mut tokens, mut rounds, mut name) = (true, 0, 0, String::new());
    for head in [false, true] {
        let run = |lt: &LoadedTarget| -> Result<(Generation, Mode)> {
            let mut d = drafter_for(lt, drafter_dir)?;
            if head {
                d.draft_vocab = Some(check_vocab(lt, &req));
            }
            let mode = match tree {
                false => Mode::Chain {
                    block: d.block_size,
                },
                true => Mode::Tree {
                    block: d.block_size,
                    budget: 8,
                    top_k: 0,
                },
            };
            Ok((
                generate(&lt.target, Some(&d), mode, &req, Default::default())?,
                mode,
            ))
        };
        let ((g, mode), (c, _)) = (run(gpu)?, run(cpu)?);
        same &= g.new_tokens == c.new_tokens;
        tokens += g.new_tokens.len();
        rounds += g.rounds.len();
        name = mode.name();
    }
    Ok((
        format!("{name} at T = 1 on device = on CPU (f32, same seed)"),
        same,
        format!("{tokens} tokens in {rounds} rounds, with and without a draft vocabulary"),
    ))
}

/// A row that two runs gave the same tokens: a failure in f32, reported in bf16 (where a
/// near-tie of the logits may round either way).
fn equal_row(what: String, same: bool, dtype: &str) -> (String, bool, String) {
    let detail = if same {
        "equal"
    } else {
        "differs (bf16; reported)"
    };
    (what, same || dtype == "bf16", detail.into())
}

/// Each request's new tokens from one batched run on 2 slots (its steps replayed from one CUDA
/// graph with `cuda_graphs`).
fn batched_tokens(lt: &LoadedTarget, reqs: &[Request], cuda_graphs: bool) -> Result<Vec<Vec<u32>>> {
    let mut out = vec![Vec::new(); reqs.len()];
    let opts = dflash_engine::batched::BatchedOptions { cuda_graphs };
    dflash_engine::batched::generate_batched(&lt.target, reqs, 2, opts, |i, r| {
        out[i] = r?.new_tokens;
        Ok(dflash_engine::batched::Flow::Continue)
    })?;
    Ok(out)
}

/// Whether each request's `tokens` are the ones AR gives it alone.
fn equals_ar(lt: &LoadedTarget, reqs: &[Request], tokens: &[Vec<u32>]) -> Result<bool> {
    for (r, t) in reqs.iter().zip(tokens) {
        if generate(&lt.target, None, Mode::Ar, r, Default::default())?.new_tokens != *t {
            return Ok(false);
        }
    }
    Ok(true)
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
    let ar_cpu = generate(&cpu.target, None, Mode::Ar, &req, Default::default())?;
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

/// The decoding checks of one precision (`name`) on the device: AR against the CPU's and the
/// sampled rows (f32), each mode against AR and with CUDA graphs, kept graphs and batched
/// decoding (attention-only targets), train/infer parity.
fn device_rows(
    a: &DeviceCheckArgs,
    name: &str,
    lt: &LoadedTarget,
    cpu: &LoadedTarget,
    req: &Request,
    ar_cpu: &Generation,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let t = Instant::now();
    let ar = generate(&lt.target, None, Mode::Ar, req, Default::default())?;
    let ar_secs = t.elapsed().as_secs_f64();
    if name == "f32" {
        rows.push((
            "AR on device = AR on CPU (T=0)".into(),
            ar.new_tokens == ar_cpu.new_tokens,
            format!("{} tokens", ar.new_tokens.len()),
        ));
        rows.push(sampled_row(lt, cpu, &a.drafter, req, false)?);
        rows.push(sampled_row(lt, cpu, &a.drafter, req, true)?);
    }
    let d = drafter_for(lt, &a.drafter)?;
    rows.extend(mode_rows(name, lt, &d, req, &ar, ar_secs)?);
    if !lt.target.is_hybrid() {
        rows.push(kept_graphs_row(lt, &a.drafter, req, name)?);
        rows.extend(batched_rows(name, lt, req)?);
    }
    rows.push(parity_row(name, lt, &d, &req.prompt_ids)?);
    Ok(rows)
}

/// Each mode plain (speculative ones = AR, `ar` taking `ar_secs`), then with its verify
/// forwards replayed from CUDA graphs (= the plain run).
fn mode_rows(
    name: &str,
    lt: &LoadedTarget,
    d: &Drafter,
    req: &Request,
    ar: &Generation,
    ar_secs: f64,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let graphs = DecodeOptions {
        cuda_graphs: true,
        ..Default::default()
    };
    for (mode, drafter) in [
        (Mode::Ar, None),
        (
            Mode::Chain {
                block: d.block_size,
            },
            Some(d),
        ),
        (
            Mode::Tree {
                block: d.block_size,
                budget: 8,
                top_k: 0,
            },
            Some(d),
        ),
    ] {
        let plain = match drafter {
            None => ar.clone(),
            Some(d) => {
                let g = generate(&lt.target, Some(d), mode, req, Default::default())?;
                rows.push(equals_ar_row(name, mode, &g, ar, ar_secs));
                g
            }
        };
        let g = generate(&lt.target, drafter, mode, req, graphs)?;
        rows.push(graphs_row(name, mode, &g, &plain));
    }
    Ok(rows)
}

/// A speculative mode's plain run `g` against AR's `ar` (which took `ar_secs`): equal in f32,
/// reported in bf16.
fn equals_ar_row(name: &str, mode: Mode, g: &Generation, ar: &Generation, ar_secs: f64) -> Row {
    let same = g.new_tokens == ar.new_tokens;
    (
        format!("{} = AR on device ({name})", mode.name()),
        same || name == "bf16",
        format!(
            "{}{} rounds; AR {:.2} ms/token",
            if same {
                ""
            } else {
                "differs from AR (bf16 rounds wide and narrow forwards differently; reported); "
            },
            g.rounds.len(),
            ar_secs * 1e3 / ar.new_tokens.len() as f64
        ),
    )
}

/// A mode's run `g` with its verify forwards replayed from CUDA graphs against its `plain` run:
/// equal in f32, reported in bf16.
fn graphs_row(name: &str, mode: Mode, g: &Generation, plain: &Generation) -> Row {
    let ms_per_token = |g: &Generation| g.decode_secs * 1e3 / g.new_tokens.len() as f64;
    let same = g.new_tokens == plain.new_tokens;
    (
        format!("{} with CUDA graphs = without ({name})", mode.name()),
        same || name == "bf16",
        format!(
            "{}{} rounds; {:.2} vs {:.2} ms/token decoding",
            if same {
                ""
            } else {
                "differs (bf16: attention over the fixed capacity rounds differently; reported); "
            },
            g.rounds.len(),
            ms_per_token(g),
            ms_per_token(plain)
        ),
    )
}

/// Batched decoding (data regeneration): three prompts on two slots = AR for each, and its
/// steps replayed from one CUDA graph = eager; at T > 0 (a plain temperature; top-k 20 with
/// top-p): the same draws where the logits are as AR's, seeded per request.
fn batched_rows(name: &str, lt: &LoadedTarget, req: &Request) -> Result<Vec<Row>> {
    let prompt = &req.prompt_ids;
    let mut rows = Vec::new();
    let reqs: Vec<Request> = [&prompt[..], &prompt[..prompt.len() - 3], &prompt[2..]]
        .iter()
        .map(|p| Request {
            prompt_ids: p.to_vec(),
            ..req.clone()
        })
        .collect();
    let eager = batched_tokens(lt, &reqs, false)?;
    let graphed = batched_tokens(lt, &reqs, true)?;
    let same_ar = equals_ar(lt, &reqs, &eager)?;
    rows.push(equal_row(
        format!("batched decoding (3 prompts, 2 slots) = AR on device ({name})"),
        same_ar,
        name,
    ));
    rows.push(equal_row(
        format!("batched decoding with CUDA graphs = without ({name})"),
        graphed == eager,
        name,
    ));
    let sampled: Vec<Request> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| Request {
            sampling: match i % 2 {
                0 => SamplingParams::new(0.8, 1.0, 0, 7 + i as u64),
                _ => SamplingParams::new(1.0, 0.9, 20, 7 + i as u64),
            }
            .expect("valid sampling parameters"),
            ..r.clone()
        })
        .collect();
    let same_t = equals_ar(lt, &sampled, &batched_tokens(lt, &sampled, false)?)?;
    rows.push(equal_row(
        format!("batched decoding at T > 0 (3 prompts, 2 slots) = AR on device ({name})"),
        same_t,
        name,
    ));
    Ok(rows)
}

/// Training-path vs inference-path drafter logits on `prompt`: ≤ 1e-4 in f32, reported in
/// bf16.
fn parity_row(name: &str, lt: &LoadedTarget, d: &Drafter, prompt: &[u32]) -> Result<Row> {
    let p = dflash_eval::doctor::parity_diff(lt, d, prompt)?;
    let agree = p.agreement_text();
    Ok(if name == "f32" {
        (
            format!("train/infer parity ({name})"),
            p.max_abs <= 1e-4,
            format!("max |Δ logits| {:.1e} (≤ 1e-4); {agree}", p.max_abs),
        )
    } else {
        (
            format!("train/infer parity ({name})"),
            true,
            format!("max |Δ logits| {:.1e}, {agree} (reported)", p.max_abs),
        )
    })
}
