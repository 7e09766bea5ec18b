//! `dflash-rs data generate` and `dflash-rs train`.

use crate::args::{DeviceArgs, SamplingArgs};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use dflash_model::loader::load_target;
use dflash_train::config::TrainConfig;
use dflash_train::prompts;
use dflash_train::regen::{regenerate, RegenOptions};
use dflash_train::trainer::train;

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Let the target write the responses of a prompt set: training shards + manifest.
    Generate(GenerateDataArgs),
}

#[derive(Args, Debug)]
pub struct GenerateDataArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// sharegpt:PATH, evals:DIR, a ShareGPT .json, a .jsonl with prompt/messages, or a directory of .jsonl.
    #[arg(long)]
    pub prompts: String,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 1024)]
    pub max_new_tokens: usize,
    /// Use only the first N prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Prompts per shard (a shard is the unit of resumption).
    #[arg(long, default_value_t = 64)]
    pub shard_size: usize,
    /// At most this many prompts from each file of a directory source (evals registry).
    #[arg(long, default_value_t = 50)]
    pub cap_per_file: usize,
    /// Prompts generated together (the engine decodes one sequence at a time for now).
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub run_on: DeviceArgs,
}

pub fn run_data(cmd: DataCommand) -> Result<()> {
    let DataCommand::Generate(a) = cmd;
    let sampling = a.sampling.params()?;
    if a.shard_size == 0 {
        anyhow::bail!("--shard-size must be >= 1");
    }
    if a.batch_size != 1 {
        eprintln!(
            "note: --batch-size {} ignored: sequences are generated one at a time",
            a.batch_size
        );
    }
    let (dtype, device) = a.run_on.parse()?;
    let mut ps = prompts::load(&a.prompts, a.cap_per_file)?;
    if let Some(l) = a.limit {
        ps.truncate(l);
    }
    let lt = load_target(&a.target, dtype, &device)?;
    eprintln!("{lt}");
    eprintln!("{} prompts from {}", ps.len(), a.prompts);
    let opts = RegenOptions {
        max_new_tokens: a.max_new_tokens,
        sampling,
        prompts_per_shard: a.shard_size,
        source: a.prompts.clone(),
        target_name: a.target.clone(),
    };
    let m = regenerate(&lt, &ps, &a.out, &opts)?;
    eprintln!(
        "wrote {}: {} sequences, {} supervised tokens in {} shard(s)",
        a.out.display(),
        m.sequences(),
        m.supervised_tokens(),
        m.shards.len()
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// A directory written by `dflash-rs data generate`.
    #[arg(long)]
    pub data: PathBuf,
    #[arg(long)]
    pub out: PathBuf,
    /// A JSON training config (see dflash_train::config::TrainConfig); missing fields take the paper's defaults.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue the run in --out from its latest checkpoint, exactly.
    #[arg(long)]
    pub resume: bool,
}

pub fn run_train(a: TrainArgs) -> Result<()> {
    let cfg: TrainConfig = match &a.config {
        Some(p) => serde_json::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("{} is not a valid training config", p.display()))?,
        None => TrainConfig::default(),
    };
    cfg.validate()?;
    let lt = load_target(
        &a.target,
        dflash_model::dtype(&cfg.dtype)?,
        &dflash_model::device(&cfg.device)?,
    )?;
    eprintln!("{lt}");
    let s = train(&lt, &a.data, &a.out, cfg, a.resume)?;
    if let Some(m) = &s.last {
        eprintln!(
            "trained {} steps: loss {:.4}, simulated τ {:.2}{}",
            s.steps,
            m.loss,
            m.simulated_tau,
            m.val_simulated_tau
                .map(|t| format!(", validation simulated τ {t:.2}"))
                .unwrap_or_default()
        );
    }
    if let Some(p) = &s.latest_checkpoint {
        eprintln!("latest checkpoint: {}", p.join("drafter").display());
    }
    Ok(())
}
