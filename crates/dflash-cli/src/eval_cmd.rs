//! `dflash-rs eval` and `dflash-rs doctor`.

use crate::args::{DeviceArgs, SamplingArgs};
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use dflash_core::sampling::SamplingParams;
use dflash_engine::{Acceptance, ModeName};
use dflash_eval::datasets;
use dflash_eval::doctor::{doctor, Status, Tolerances};
use dflash_eval::harness::{mode_specs, run_journaled, EvalDrafter, EvalOptions, ModeSpec, Run};
use dflash_eval::journal::Journal;
use dflash_eval::report::{lossless_check, mode_reports, write, Report};
use dflash_model::io::loader::{dflash_home, load_target, LoadedTarget};

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// Drafter directories; repeat to compare drafters side by side (label with NAME=DIR).
    #[arg(long)]
    pub drafter: Vec<String>,
    /// gsm8k, humaneval, mt-bench, math500, or a JSONL file with prompt/messages.
    #[arg(long)]
    pub dataset: String,
    #[arg(long)]
    pub limit: Option<usize>,
    /// Comma-separated: ar, dflash, ddtree:N, auto (auto:N).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ar,dflash,ddtree:8,ddtree:32,auto"
    )]
    pub modes: Vec<ModeName>,
    #[arg(long)]
    pub block_size: Option<usize>,
    #[arg(long, default_value_t = 2048)]
    pub max_new_tokens: usize,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what `--out` already holds (without it, an output that holds anything is
    /// refused by name).
    #[arg(long)]
    pub force: bool,
    /// Start no new item after this many seconds; the report covers the items finished, and
    /// the same command again continues from them (`--out`'s runs.jsonl).
    #[arg(long)]
    pub time_limit: Option<f64>,
    /// Replay the verify forwards and the draft block from CUDA graphs (see `generate
    /// --cuda-graphs`), each mode's graphs kept from one prompt to the next.
    #[arg(long)]
    pub cuda_graphs: bool,
    /// Untimed tokens per mode before the timed items (PTX compilation, allocations; 0: none).
    #[arg(long, default_value_t = 32)]
    pub warmup_tokens: usize,
    /// How drafts are accepted at T > 0: residual (a chain's drafts sampled from the
    /// drafter, kept with probability min(1, p/q), the bonus from the residual; a DDTree's
    /// tokens drawn without replacement, each node's children judged in turn against the
    /// residual) or exact-match (greedy drafts, a tree of the top-K, kept while they equal the
    /// target's sample). Both are lossless.
    #[arg(long, default_value = "residual")]
    pub acceptance: Acceptance,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub run_on: DeviceArgs,
    #[command(flatten)]
    pub draft: crate::args::DraftProducts,
}

/// `eval --out`: an evaluation's own files (its journal, report and plots) are continued
/// (the journal refuses other settings by name); anything else is refused unless `--force`
/// replaces it.
const EVAL_OUT: dflash_model::io::outputs::Output<'static> = dflash_model::io::outputs::Output {
    flag: "--out",
    own: &|n| {
        [
            JOURNAL,
            "report.json",
            "report.md",
            "tau_histogram.svg",
            "acceptance.svg",
            "tau.svg",
        ]
        .contains(&n)
            || (n.starts_with('.') && n.contains(".tmp-"))
    },
    forceable: true,
};

/// The journal of finished items in `--out` ([`dflash_eval::journal`]).
const JOURNAL: &str = "runs.jsonl";

pub fn run_eval(a: EvalArgs) -> Result<()> {
    EVAL_OUT.check_dir(&a.out, a.force)?;
    if a.force {
        let _ = std::fs::remove_file(a.out.join(JOURNAL));
    }
    let sampling = a.sampling.params()?;
    let time_limit = time_limit(a.time_limit)?;
    let (dtype, device) = a.run_on.parse()?;
    crate::args::note_cuda_graphs(a.cuda_graphs, &device);
    let items = datasets::load(&a.dataset, &dflash_home(), a.limit)?;
    let lt = load_target(&a.target, dtype, &device)?;
    eprintln!("{lt}");
    let drafters = load_drafters(&a, &lt)?;
    let specs = mode_specs(&a.modes, &drafters, a.block_size)?;
    if a.block_size.is_some_and(|b| b < 2) {
        bail!("--block-size must be >= 2");
    }
    eprintln!(
        "{} items × {} modes on {}",
        items.len(),
        specs.len(),
        a.dataset
    );
    std::fs::create_dir_all(&a.out)?;
    let mut journal = Journal::open(&a.out.join(JOURNAL), &journal_key(&a, &lt, &items))?;
    if !journal.done.is_empty() {
        eprintln!(
            "resuming: {} of {} items finished in {}",
            journal.done.len(),
            items.len(),
            a.out.join(JOURNAL).display()
        );
    }
    let runs = run_journaled(
        &lt,
        &drafters,
        &specs,
        &items,
        &EvalOptions {
            sampling,
            max_new_tokens: a.max_new_tokens,
            time_limit,
            decode: dflash_engine::DecodeOptions {
                cuda_graphs: a.cuda_graphs,
                acceptance: a.acceptance,
                ..Default::default()
            },
            warmup_tokens: a.warmup_tokens,
        },
        Some(&mut journal),
    )?;
    let report = report_of(&a, &lt, &specs, items.len(), runs, &sampling)?;
    write(&report, &a.out)?;
    print_modes(&report);
    eprintln!("wrote {}/report.json, report.md and plots", a.out.display());
    lossless_verdict(&report)
}

/// What an evaluation's runs depend on: a journal of other settings is not resumed. The
/// command line but for where it runs and writes (`--out`, `--force`, `--time-limit`,
/// `--cuda-graphs`, `--warmup-tokens`), the target's and drafters' identity, the items.
fn journal_key(
    a: &EvalArgs,
    lt: &LoadedTarget,
    items: &[dflash_eval::datasets::EvalItem],
) -> String {
    let ids: Vec<&str> = items.iter().map(|i| i.id.as_str()).collect();
    format!(
        "target {} ({}) on {} {} {:?}; drafters {:?}; modes {:?}; block {:?}; max_new_tokens {}; acceptance {}; sampling {:?}; draft products {:?}; items {:?}",
        a.target,
        lt.source.display(),
        a.run_on.device,
        a.run_on.dtype,
        a.run_on.cpu_products,
        a.drafter,
        a.modes.iter().map(|m| m.to_string()).collect::<Vec<_>>(),
        a.block_size,
        a.max_new_tokens,
        a.acceptance,
        a.sampling.params().ok(),
        a.draft.draft_products,
        ids
    )
}

/// `--time-limit` as a duration: a number of seconds >= 0.
fn time_limit(secs: Option<f64>) -> Result<Option<std::time::Duration>> {
    Ok(match secs {
        Some(t) if t.is_finite() && t >= 0.0 => Some(std::time::Duration::from_secs_f64(t)),
        Some(t) => bail!("--time-limit must be a number of seconds >= 0 (got {t})"),
        None => None,
    })
}

/// The `--drafter` directories loaded, each labelled by its `NAME=` or else its directory's
/// name (`d{i}` without one).
fn load_drafters(a: &EvalArgs, lt: &LoadedTarget) -> Result<Vec<EvalDrafter>> {
    let mut drafters = Vec::new();
    for (i, spec) in a.drafter.iter().enumerate() {
        let (label, dir) = match spec.split_once('=') {
            Some((l, d)) => (l.to_string(), PathBuf::from(d)),
            None => (
                PathBuf::from(spec)
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .unwrap_or_else(|| format!("d{i}")),
                PathBuf::from(spec),
            ),
        };
        drafters.push(EvalDrafter {
            label,
            drafter: a.draft.load(&dir, &lt.target)?,
        });
    }
    Ok(drafters)
}

/// The report of `runs`: the command line, the setting, each mode's figures and the lossless
/// check (every mode against AR, at T = 0).
fn report_of(
    a: &EvalArgs,
    lt: &LoadedTarget,
    specs: &[ModeSpec],
    items_asked: usize,
    runs: Vec<Run>,
    sampling: &SamplingParams,
) -> Result<Report> {
    let items_done = {
        let mut seen: Vec<&str> = runs.iter().map(|r| r.item.as_str()).collect();
        seen.dedup();
        seen.len()
    };
    let modes_r = mode_reports(specs, &runs);
    let lossless = lossless_check(lt, &runs, sampling.is_greedy())?;
    Ok(Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        dataset: a.dataset.clone(),
        target: lt.source.display().to_string(),
        drafters: a.drafter.clone(),
        device: a.run_on.device.clone(),
        dtype: a.run_on.dtype.clone(),
        versions: serde_json::json!({"dflash-rs": env!("CARGO_PKG_VERSION"), "candle": "0.11.1"}),
        temperature: sampling.temperature,
        max_new_tokens: a.max_new_tokens,
        warmup_tokens: a.warmup_tokens,
        acceptance: a.acceptance,
        items_done,
        items_asked,
        modes: modes_r,
        lossless,
        runs,
    })
}

/// Each mode's τ, tokens per second and speed-up, to stderr.
fn print_modes(report: &Report) {
    for m in &report.modes {
        eprintln!(
            "{:>14}: τ pooled {:.3}, mean-of-means {:.3}, {:.1} tok/s{}",
            m.mode,
            m.tau.tau_pooled,
            m.tau.tau_mean_of_means,
            m.tokens_per_second,
            m.speedup_vs_ar
                .map(|s| format!(", {s:.2}× vs AR"))
                .unwrap_or_default()
        );
    }
}

/// An error when a mode diverged from AR at T = 0 where nothing explains it (with the way to
/// tell rounding from a fault in bf16 and f16); the explained divergences noted.
fn lossless_verdict(report: &Report) -> Result<()> {
    let divs = &report.lossless.divergences;
    let faults = divs.iter().filter(|d| !d.explained()).count();
    let explained = dflash_eval::report::explained_counts(divs, &report.dtype);
    if report.lossless.checked && faults > 0 {
        let rounding = matches!(report.dtype.as_str(), "bf16" | "f16");
        bail!(
            "{faults} mode(s) diverged from AR at T = 0 (see report.md){}{}",
            if explained.is_empty() {
                String::new()
            } else {
                format!(", besides {}", explained.join(" and "))
            },
            if rounding {
                format!(
                    "; in {} a wider gap can still be rounding (a wide verify and a one-row \
                     step sum differently through every layer): rerun the diverging items with \
                     --dtype f32, where every mode must equal AR token for token",
                    report.dtype
                )
            } else {
                String::new()
            }
        );
    }
    if !explained.is_empty() {
        eprintln!(
            "generations that left AR's text, not as faults: {} (a wide verify and a one-row \
             step round differently; a later turn continues its mode's own answer; see report.md)",
            explained.join(" and ")
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct DoctorArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    #[arg(long)]
    pub drafter: PathBuf,
    /// The training data directory: measures τ on its validation shard.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Write the canary dump (taps, the drafter's round inputs, block logits and drafts for
    /// fixed prompts: docs/DOCTOR.md) into this directory instead of running the checklist.
    #[arg(long, conflicts_with = "against")]
    pub canary: Option<PathBuf>,
    /// Check another stack's canary dump (same layout) against this target and drafter,
    /// quantity by quantity, instead of running the checklist.
    #[arg(long)]
    pub against: Option<PathBuf>,
    #[command(flatten)]
    pub run_on: DeviceArgs,
    #[arg(long)]
    pub json: bool,
}

pub fn run_doctor(a: DoctorArgs) -> Result<()> {
    let (dtype, device) = a.run_on.parse()?;
    let lt = load_target(&a.target, dtype, &device)?;
    eprintln!("{lt}");
    if let Some(out) = &a.canary {
        dflash_eval::doctor::write_canary(&lt, &a.drafter, out)?;
        eprintln!("wrote the canary dump to {}", out.display());
        return Ok(());
    }
    let r = match &a.against {
        Some(dump) => {
            dflash_eval::doctor::doctor_against(&lt, &a.drafter, dump, &Tolerances::default())?
        }
        None => doctor(&lt, &a.drafter, a.data.as_deref(), &Tolerances::default())?,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        for c in &r.checks {
            println!(
                "[{}] {}: {}",
                match c.status {
                    Status::Pass => "PASS",
                    Status::Fail => "FAIL",
                    Status::Skipped => "SKIP",
                },
                c.name,
                c.detail
            );
        }
        if let Some(c) = &r.likely_cause {
            println!("likely cause: {c}");
        }
    }
    if !r.ok() {
        bail!(
            "doctor found {} problem(s)",
            r.checks.iter().filter(|c| c.failed()).count()
        );
    }
    Ok(())
}
