//! `dflash-rs data …` (one file per command) and `dflash-rs train`, `train curves`.

mod prompt_set;
mod regen;
mod vocab;

use crate::args::DeviceArgs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::{Args, Subcommand};
use dflash_model::io::loader::load_target;
use dflash_train::config::{machine_fields, TrainConfig};
use dflash_train::trainer::{train, TrainOptions, TrainSummary};

use crate::launch::RankEnv;

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Let the target write the responses of a prompt set: training shards + manifest.
    Generate(GenerateDataArgs),
    /// Freeze a prompt set: several sources, each cut to --limit, mixed by a seeded shuffle,
    /// written as one JSONL of chat messages (small enough to carry where the sources are not).
    Prompts(PromptsArgs),
    /// A drafter's vocabulary subset: the most frequent supervised tokens of a data
    /// directory, as `draft_vocab.json` (put it beside the drafter's weights).
    Vocab(VocabArgs),
}

pub use prompt_set::PromptsArgs;
pub use regen::GenerateDataArgs;
pub use vocab::VocabArgs;

pub fn run_data(cmd: DataCommand) -> Result<()> {
    match cmd {
        DataCommand::Generate(a) => regen::run_generate(a),
        DataCommand::Prompts(a) => prompt_set::run_prompts(a),
        DataCommand::Vocab(a) => vocab::run_vocab(a),
    }
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct TrainArgs {
    #[command(subcommand)]
    pub sub: Option<TrainSub>,
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// A directory written by `dflash-rs data generate`.
    #[arg(long, required = true)]
    pub data: Option<PathBuf>,
    #[arg(long, required = true)]
    pub out: Option<PathBuf>,
    /// A JSON training config (see dflash_train::config::TrainConfig); missing fields take the paper's defaults.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue the run in --out from its latest checkpoint, exactly.
    #[arg(long)]
    pub resume: bool,
    /// Stop after the step that ends past this many seconds, with a checkpoint (then --resume).
    #[arg(long)]
    pub time_limit: Option<f64>,
    /// Device memory (MB) for keeping the target's context features of training and
    /// validation rows between epochs (0: run the target forward at every visit). Results
    /// are the same either way; only the time changes.
    #[arg(long, default_value_t = 8192)]
    pub feature_cache_mb: usize,
    /// Append each step's rows (ids, loss mask, packed sequences, anchors, learning rate) to
    /// this JSON-lines file, for a reference trainer taking the same steps
    /// (bench/train_reference_run.py).
    #[arg(long)]
    pub plan_out: Option<PathBuf>,
    /// Shard the optimizer's moments over the ranks (with --gpus): each rank keeps 1/N of them
    /// and sends the parameters it updates to the others. The same run either way.
    #[arg(long)]
    pub shard_optimizer: bool,
    /// Train on this many GPUs of this node, one process (rank) each, the gradients summed
    /// through NCCL (a CUDA build); `grad_accum` rows per step are split evenly over the ranks
    /// of all nodes. 0: one process on --device.
    #[arg(long, default_value_t = 0)]
    pub gpus: usize,
    /// Nodes in the group (with --gpus on each).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's number, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// HOST:PORT where global rank 0 (node 0) hands the NCCL group id to the others.
    #[arg(long, default_value = "127.0.0.1:29511")]
    pub rendezvous: String,
    #[command(flatten)]
    pub run_on: DeviceArgs,
}

/// What `train` does besides training.
#[derive(Subcommand, Debug)]
pub enum TrainSub {
    /// Plot a training run's loss and simulated τ (metrics.jsonl → SVG).
    Curves(CurvesArgs),
}

impl TrainArgs {
    /// `--data` and `--out` (clap requires both unless a subcommand is given).
    fn paths(&self) -> Result<(&Path, &Path)> {
        let data = self.data.as_deref().context("train needs --data DIR")?;
        let out = self.out.as_deref().context("train needs --out DIR")?;
        Ok((data, out))
    }
}

pub fn run_train(a: TrainArgs) -> Result<()> {
    if let Some(TrainSub::Curves(c)) = a.sub {
        return run_curves(c);
    }
    let cfg = read_config(a.config.as_deref())?;
    cfg.validate()?;
    let rank = crate::launch::rank_env()?;
    if a.gpus > 0 && rank.is_none() {
        return launch_ranks(&a, &cfg);
    }
    // a launched rank trains on its own GPU
    let (dtype, device) = rank_device(&a.run_on, rank.as_ref())?;
    let lt = load_target(&a.target, dtype, &device)?;
    if rank.as_ref().is_none_or(|r| r.rank == 0) {
        eprintln!("{lt}");
    }
    let opts = TrainOptions {
        resume: a.resume,
        time_limit: time_limit(a.time_limit)?,
        feature_cache_bytes: a.feature_cache_mb.saturating_mul(1 << 20),
        plan_out: a.plan_out.clone(),
        shard_optimizer: a.shard_optimizer,
    };
    let s = match &rank {
        None => {
            let (data, out) = a.paths()?;
            train(&lt, data, out, cfg, &opts)?
        }
        Some(r) => train_as_rank(&lt, &a, cfg, &opts, r, &device)?,
    };
    print_summary(&s);
    Ok(())
}

/// The training config of `--config` (a recipe: machine fields are refused by name), or the
/// paper's defaults.
fn read_config(path: Option<&Path>) -> Result<TrainConfig> {
    Ok(match path {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", p.display()))?;
            if let [field, ..] = machine_fields(&json)[..] {
                anyhow::bail!(
                    "{}: '{field}' is not part of a training recipe: pass --{field} on the command line",
                    p.display()
                );
            }
            serde_json::from_value(json)
                .with_context(|| format!("{} is not a valid training config", p.display()))?
        }
        None => TrainConfig::default(),
    })
}

/// `--gpus`: one process per GPU of each node, launched (a CUDA build), once the group and the
/// split of `grad_accum` over its ranks are checked.
fn launch_ranks(a: &TrainArgs, cfg: &TrainConfig) -> Result<()> {
    let l = crate::launch::Launch {
        gpus: a.gpus,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        rendezvous: a.rendezvous.clone(),
    };
    l.check()?;
    dflash_train::collective::rank_slice(cfg.grad_accum, 0, l.world())?;
    if !cfg!(feature = "cuda") {
        anyhow::bail!("--gpus needs a CUDA build (scripts/cuda-build.sh): this binary has no NCCL");
    }
    crate::launch::launch(&l)
}

/// The last step's loss and τ, and the latest checkpoint.
fn print_summary(s: &TrainSummary) {
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
}

/// The dtype and device to run on: a launched rank's own GPU (`cuda:LOCAL_RANK`, at
/// `--dtype`), else `--device` and `--dtype`.
fn rank_device(run_on: &DeviceArgs, rank: Option<&RankEnv>) -> Result<(DType, Device)> {
    Ok(match rank {
        Some(r) => (
            dflash_model::dtype(&run_on.dtype)?,
            dflash_model::device(&format!("cuda:{}", r.local_rank))?,
        ),
        None => run_on.parse()?,
    })
}

/// `--time-limit` as a duration: a number of seconds >= 0.
fn time_limit(secs: Option<f64>) -> Result<Option<std::time::Duration>> {
    Ok(match secs {
        Some(t) if t.is_finite() && t >= 0.0 => Some(std::time::Duration::from_secs_f64(t)),
        Some(t) => anyhow::bail!("--time-limit must be a number of seconds >= 0 (got {t})"),
        None => None,
    })
}

/// One launched rank's training (NCCL on its GPU).
#[cfg(feature = "cuda")]
fn train_as_rank(
    lt: &dflash_model::io::loader::LoadedTarget,
    a: &TrainArgs,
    cfg: TrainConfig,
    opts: &TrainOptions,
    r: &crate::launch::RankEnv,
    device: &candle_core::Device,
) -> Result<dflash_train::trainer::TrainSummary> {
    let comm = crate::launch::nccl_rank(r, device)?;
    let (data, out) = a.paths()?;
    dflash_train::trainer::train_rank(lt, data, out, cfg, opts, &comm)
}

#[cfg(not(feature = "cuda"))]
fn train_as_rank(
    _: &dflash_model::io::loader::LoadedTarget,
    _: &TrainArgs,
    _: TrainConfig,
    _: &TrainOptions,
    r: &crate::launch::RankEnv,
    _: &candle_core::Device,
) -> Result<dflash_train::trainer::TrainSummary> {
    anyhow::bail!(
        "rank {} of {}: this binary has no NCCL (build with scripts/cuda-build.sh)",
        r.rank,
        r.world
    )
}

#[derive(Args, Debug)]
pub struct CurvesArgs {
    /// A run directory (holding metrics.jsonl) or a metrics.jsonl file.
    #[arg(long)]
    pub run: PathBuf,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what `--out` already holds (without it, an output that holds anything is
    /// refused by name).
    #[arg(long)]
    pub force: bool,
}

fn run_curves(a: CurvesArgs) -> Result<()> {
    crate::args::OUT_REPLACEABLE.check_file(&a.out, a.force)?;
    let m = if a.run.is_dir() {
        a.run.join("metrics.jsonl")
    } else {
        a.run.clone()
    };
    let ms = dflash_train::trainer::read_metrics(&m)?;
    dflash_model::io::atomic::write_file(&a.out, dflash_train::curves::svg(&ms).as_bytes())?;
    eprintln!("wrote {}: {} steps", a.out.display(), ms.len());
    Ok(())
}
