//! `dflash-rs data generate`: the target writes the responses of a prompt set (training shards
//! and their manifest), in one process or one per GPU.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use dflash_model::io::loader::load_target;
use dflash_train::data::Manifest;
use dflash_train::prompts;
use dflash_train::regen::{regenerate, RegenOptions};

use super::{rank_device, time_limit};
use crate::args::{DeviceArgs, SamplingArgs};

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
    /// at a time; a hybrid target's slots each keep their linear-attention state).
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

/// `data generate`: the target's responses to a prompt set, as training shards (on several
/// GPUs, one launched process per GPU, the shards merged).
pub(super) fn run_generate(a: GenerateDataArgs) -> Result<()> {
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
    if a.gpus > 0 && rank.is_none() {
        return launch_ranks(&a);
    }
    let (dtype, device) = rank_device(&a.run_on, rank.as_ref())?;
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
        time_limit: time_limit(a.time_limit)?,
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
    report(&m, &out);
    Ok(())
}

/// `--gpus`: the shards dealt round-robin to one launched process per GPU, then their streams
/// merged into one manifest.
fn launch_ranks(a: &GenerateDataArgs) -> Result<()> {
    let partition = dflash_train::regen_ranks::Partition {
        world: a.gpus,
        prompts_per_shard: a.shard_size,
    };
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
    Ok(())
}

/// What the run wrote to `out`: sequences, supervised tokens, shards, and the responses cut at
/// a repetition loop.
fn report(m: &Manifest, out: &Path) {
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
}
