//! `dflash-rs data generate` and `dflash-rs train`.

use crate::args::{DeviceArgs, SamplingArgs};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use dflash_model::io::loader::{dflash_home, load_target};
use dflash_train::config::{machine_fields, TrainConfig};
use dflash_train::prompts;
use dflash_train::regen::{regenerate, RegenOptions};
use dflash_train::trainer::{train, TrainOptions};

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

#[derive(Args, Debug)]
pub struct VocabArgs {
    /// A data directory (`data generate`'s shards + manifest).
    #[arg(long)]
    pub data: PathBuf,
    /// Tokens to keep.
    #[arg(long, default_value_t = 8192)]
    pub size: usize,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what `--out` already holds (without it, an output that holds anything is
    /// refused by name).
    #[arg(long)]
    pub force: bool,
}

fn run_vocab(a: VocabArgs) -> Result<()> {
    if a.size == 0 {
        anyhow::bail!("--size must be at least 1");
    }
    crate::args::OUT_REPLACEABLE.check_file(&a.out, a.force)?;
    let (_, seqs) = dflash_train::data::read_sequences(&a.data)?;
    let (ids, coverage) = dflash_train::vocab::frequent_tokens(&seqs, a.size);
    let v = dflash_model::models::draft_vocab::DraftVocab {
        source: format!(
            "the {} most frequent supervised tokens of {} ({} sequences)",
            ids.len(),
            a.data.display(),
            seqs.len()
        ),
        coverage: Some(coverage),
        token_ids: ids,
    };
    dflash_model::io::atomic::write_file(&a.out, serde_json::to_string(&v)?.as_bytes())?;
    eprintln!(
        "wrote {}: {} tokens, {:.2} % of the supervised tokens",
        a.out.display(),
        v.token_ids.len(),
        100.0 * coverage
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct PromptsArgs {
    /// A source as for `data generate --prompts`; repeat to mix several.
    #[arg(long, required = true)]
    pub prompts: Vec<String>,
    /// At most this many prompts from a source (after --max-chars): once for all sources, or
    /// once per --prompts, in the same order.
    #[arg(long)]
    pub limit: Vec<usize>,
    /// Skip prompts whose text is longer than this many characters.
    #[arg(long)]
    pub max_chars: Option<usize>,
    /// At most this many prompts from each file of a directory source (evals registry).
    #[arg(long, default_value_t = 50)]
    pub cap_per_file: usize,
    /// Seed of the shuffle that mixes the sources.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Continue this frozen prompt file: its prompts first, in its order (a regeneration of it
    /// resumes on the output), then the new mix without the prompts it already has.
    #[arg(long)]
    pub extend: Option<PathBuf>,
    /// Wrap each prompt's last user turn in this text, where `{prompt}` stands for the turn (e.g.
    /// "{prompt}\nWrite the solution in Python."): once for all sources, or once per --prompts,
    /// in the same order (`{prompt}` alone leaves a source as it is; `\n`, `\t` and `\\` are
    /// a newline, a tab and a backslash). Applied after --max-chars and --limit.
    #[arg(long)]
    pub template: Vec<String>,
    /// Drop every prompt that shares a run of 13 words with an item of GSM8K, HumanEval,
    /// MT-Bench or MATH-500, or whose words are exactly a shorter item's (all four sets must be
    /// in the asset cache). Without it such prompts are counted and kept.
    #[arg(long)]
    pub drop_eval_overlap: bool,
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what `--out` already holds (without it, an output that holds anything is
    /// refused by name).
    #[arg(long)]
    pub force: bool,
}

fn run_prompts(a: PromptsArgs) -> Result<()> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    if a.limit.len() > 1 && a.limit.len() != a.prompts.len() {
        anyhow::bail!(
            "{} --limit values for {} --prompts sources: give one for all, or one per source",
            a.limit.len(),
            a.prompts.len()
        );
    }
    if a.template.len() > 1 && a.template.len() != a.prompts.len() {
        anyhow::bail!(
            "{} --template values for {} --prompts sources: give one for all, or one per source",
            a.template.len(),
            a.prompts.len()
        );
    }
    if let Some(t) = a
        .template
        .iter()
        .find(|t| !t.contains(prompts::TEMPLATE_SLOT))
    {
        anyhow::bail!(
            "--template {t:?} has no {} for the prompt's text",
            prompts::TEMPLATE_SLOT
        );
    }
    crate::args::OUT_REPLACEABLE.check_file(&a.out, a.force)?;
    let (items, missing) = dflash_eval::datasets::item_texts(&dflash_home())?;
    if a.drop_eval_overlap && !missing.is_empty() {
        anyhow::bail!(
            "--drop-eval-overlap needs every evaluation set in the asset cache ({}); missing: {} \
             (scripts/fetch-assets.sh datasets)",
            dflash_home().display(),
            missing.join(", ")
        );
    }
    let overlap = missing
        .is_empty()
        .then(|| dflash_train::overlap::Overlap::new(items.iter().map(String::as_str)));
    let mut all = Vec::new();
    for (k, src) in a.prompts.iter().enumerate() {
        let mut ps = prompts::load(src, a.cap_per_file)?;
        let n0 = ps.len();
        match &overlap {
            Some(o) => {
                let quotes = |p: &prompts::Prompt| p.messages.iter().any(|m| o.hits(&m.content));
                let hits = ps.iter().filter(|p| quotes(p)).count();
                if a.drop_eval_overlap {
                    ps.retain(|p| !quotes(p));
                    eprintln!("{src}: {hits} of {n0} prompts quote an evaluation item: dropped");
                } else {
                    eprintln!("{src}: {hits} of {n0} prompts quote an evaluation item: kept (--drop-eval-overlap drops them)");
                }
            }
            None => eprintln!(
                "{src}: overlap with the evaluation sets not checked ({} not in the asset cache)",
                missing.join(", ")
            ),
        }
        if let Some(m) = a.max_chars {
            ps.retain(|p| {
                p.messages
                    .iter()
                    .map(|m| m.content.chars().count())
                    .sum::<usize>()
                    <= m
            });
        }
        if let Some(&l) = a.limit.get(k).or(a.limit.first()) {
            ps.truncate(l);
        }
        if let Some(t) = a.template.get(k).or(a.template.first()) {
            let t = prompts::unescape_template(t);
            ps.iter_mut().for_each(|p| prompts::apply_template(p, &t));
        }
        eprintln!("{src}: {} of {n0} prompts", ps.len());
        all.extend(ps);
    }
    all.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(a.seed));
    if let Some(old) = &a.extend {
        let old = prompts::load(&format!("jsonl:{}", old.display()), usize::MAX)?;
        let n_old = old.len();
        let (ext, already) = prompts::extend(old, all);
        eprintln!(
            "extending {n_old} prompts: {} new, {already} already there",
            ext.len() - n_old
        );
        all = ext;
    }
    let mut text = String::new();
    for p in &all {
        text.push_str(&serde_json::to_string(
            &serde_json::json!({ "messages": p.messages }),
        )?);
        text.push('\n');
    }
    dflash_model::io::atomic::write_file(&a.out, text.as_bytes())?;
    eprintln!("wrote {}: {} prompts", a.out.display(), all.len());
    Ok(())
}

#[derive(Args, Debug)]
pub struct GenerateDataArgs {
    #[arg(long, default_value = "smollm2-135m")]
    pub target: String,
    /// sharegpt:PATH (first human turns), sharegpt-turns:PATH (every human turn with the conversation before it), evals:DIR, writingbench:PATH (WritingBench's queries), fields:SPEC:PATH (named fields of JSON records, e.g. fields:passage+question:asdiv.jsonl), a ShareGPT .json, a .jsonl with prompt/messages, or a directory of .jsonl.
    #[arg(long)]
    pub prompts: String,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 1024)]
    pub max_new_tokens: usize,
    /// End each response at its first repeated window of this many tokens, keeping that window
    /// (a small target's greedy loops; the rule of training's `loop_window`). 0: never.
    #[arg(long, default_value_t = 0)]
    pub loop_window: usize,
    /// Use only the first N prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Prompts per shard (a shard is the unit of resumption).
    #[arg(long, default_value_t = 64)]
    pub shard_size: usize,
    /// At most this many prompts from each file of a directory source (evals registry).
    #[arg(long, default_value_t = 50)]
    pub cap_per_file: usize,
    /// Prompts decoded together, in one batched target forward per step (same tokens as one
    /// at a time; attention-only targets, a hybrid target decodes one at a time).
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Replay each batched step from a CUDA graph (the batched cache then has a fixed
    /// capacity of twice the longest prompt + --max-new-tokens).
    #[arg(long)]
    pub cuda_graphs: bool,
    /// Stop after this many seconds, keeping the finished shards (run again to continue).
    #[arg(long)]
    pub time_limit: Option<f64>,
    /// Regenerate on this many GPUs of this machine, one process each: shards dealt
    /// round-robin, each rank its own stream under OUT/ranks/, one merged manifest (the data
    /// one process writes). Continue a directory with the same --gpus. 0: one process.
    #[arg(long, default_value_t = 0)]
    pub gpus: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub run_on: DeviceArgs,
}

pub fn run_data(cmd: DataCommand) -> Result<()> {
    let a = match cmd {
        DataCommand::Generate(a) => a,
        DataCommand::Prompts(a) => return run_prompts(a),
        DataCommand::Vocab(a) => return run_vocab(a),
    };
    let sampling = a.sampling.params()?;
    if a.shard_size == 0 {
        anyhow::bail!("--shard-size must be >= 1");
    }
    if a.batch_size == 0 {
        anyhow::bail!("--batch-size must be >= 1");
    }
    let rank = crate::launch::rank_env()?;
    if rank.is_none() {
        dflash_train::data::check_out(&a.out)?;
    }
    let partition = dflash_train::regen_ranks::Partition {
        world: a.gpus,
        prompts_per_shard: a.shard_size,
    };
    if a.gpus > 0 && rank.is_none() {
        if !cfg!(feature = "cuda") {
            anyhow::bail!("--gpus needs a CUDA build (scripts/cuda-build.sh)");
        }
        dflash_train::regen_ranks::start(&a.out, partition)?;
        crate::launch::launch(&crate::launch::Launch {
            gpus: a.gpus,
            nnodes: 1,
            node_rank: 0,
            rendezvous: "127.0.0.1:29511".into(),
        })?;
        let m = dflash_train::regen_ranks::merge(&a.out)?;
        eprintln!(
            "merged {}: {} sequences, {} supervised tokens in {} shard(s) from {} ranks",
            a.out.display(),
            m.sequences(),
            m.supervised_tokens(),
            m.shards.len(),
            a.gpus
        );
        return Ok(());
    }
    let (dtype, device) = match &rank {
        Some(r) => (
            dflash_model::dtype(&a.run_on.dtype)?,
            dflash_model::device(&format!("cuda:{}", r.local_rank))?,
        ),
        None => a.run_on.parse()?,
    };
    let mut ps = prompts::load(&a.prompts, a.cap_per_file)?;
    if let Some(l) = a.limit {
        ps.truncate(l);
    }
    let lt = load_target(&a.target, dtype, &device)?;
    eprintln!("{lt}");
    eprintln!("{} prompts from {}", ps.len(), a.prompts);
    let opts = RegenOptions {
        max_new_tokens: a.max_new_tokens,
        loop_window: a.loop_window,
        sampling,
        prompts_per_shard: a.shard_size,
        batch_size: a.batch_size,
        cuda_graphs: a.cuda_graphs,
        time_limit: match a.time_limit {
            Some(t) if t.is_finite() && t >= 0.0 => Some(std::time::Duration::from_secs_f64(t)),
            Some(t) => anyhow::bail!("--time-limit must be a number of seconds >= 0 (got {t})"),
            None => None,
        },
        source: a.prompts.clone(),
        target_name: a.target.clone(),
    };
    let (m, out) = match &rank {
        Some(r) => (
            dflash_train::regen_ranks::regenerate_rank(&lt, &ps, &a.out, &opts, r.rank)?,
            dflash_train::regen_ranks::rank_dir(&a.out, r.rank),
        ),
        None => (regenerate(&lt, &ps, &a.out, &opts)?, a.out.clone()),
    };
    eprintln!(
        "wrote {}: {} sequences, {} supervised tokens in {} shard(s)",
        out.display(),
        m.sequences(),
        m.supervised_tokens(),
        m.shards.len()
    );
    if m.loop_window > 0 {
        let looped: usize = m.shards.iter().map(|s| s.ended_by_loop).sum();
        eprintln!(
            "{looped} of the {} responses ended at their first repeated {}-token window",
            m.sequences(),
            m.loop_window
        );
    }
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

pub fn run_train(a: TrainArgs) -> Result<()> {
    let cfg: TrainConfig = match &a.config {
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
    };
    cfg.validate()?;
    let rank = crate::launch::rank_env()?;
    if a.gpus > 0 && rank.is_none() {
        let l = crate::launch::Launch {
            gpus: a.gpus,
            nnodes: a.nnodes,
            node_rank: a.node_rank,
            rendezvous: a.rendezvous.clone(),
        };
        l.check()?;
        dflash_train::collective::rank_slice(cfg.grad_accum, 0, l.world())?;
        if !cfg!(feature = "cuda") {
            anyhow::bail!(
                "--gpus needs a CUDA build (scripts/cuda-build.sh): this binary has no NCCL"
            );
        }
        return crate::launch::launch(&l);
    }
    let (dtype, device) = match &rank {
        // a launched rank trains on its own GPU
        Some(r) => (
            dflash_model::dtype(&a.run_on.dtype)?,
            dflash_model::device(&format!("cuda:{}", r.local_rank))?,
        ),
        None => a.run_on.parse()?,
    };
    let lt = load_target(&a.target, dtype, &device)?;
    if rank.as_ref().is_none_or(|r| r.rank == 0) {
        eprintln!("{lt}");
    }
    let opts = TrainOptions {
        resume: a.resume,
        time_limit: match a.time_limit {
            Some(t) if t.is_finite() && t >= 0.0 => Some(std::time::Duration::from_secs_f64(t)),
            Some(t) => anyhow::bail!("--time-limit must be a number of seconds >= 0 (got {t})"),
            None => None,
        },
        feature_cache_bytes: a.feature_cache_mb.saturating_mul(1 << 20),
        plan_out: a.plan_out.clone(),
    };
    let s = match &rank {
        None => train(&lt, &a.data, &a.out, cfg, &opts)?,
        Some(r) => train_as_rank(&lt, &a, cfg, &opts, r, &device)?,
    };
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
    dflash_train::trainer::train_rank(lt, &a.data, &a.out, cfg, opts, &comm)
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

pub fn run_curves(a: CurvesArgs) -> Result<()> {
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
