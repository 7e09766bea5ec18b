//! `dflash-rs bench shape`: the costs of a target shape we have no weights for (random weights,
//! e.g. Qwen3-8B), and the speed-up they imply: one AR step, one chain verify of B rows, one
//! DDTree verify per budget, one draft block of a random drafter, against the memory floor.
//! Cost model: speed-up(τ) = τ · T_AR / (T_draft + T_verify).

mod gdn;
mod graph_costs;
mod measure;
mod model;
mod profile;
mod report;

use crate::args::DeviceArgs;

use anyhow::{Context, Result};
use candle_core::DType;
use clap::Args;
use dflash_core::config::TargetConfig;

use measure::{Bench, Floor};
pub use model::{bench_tokens, random_target, shape_config};
use report::Timings;

/// The random-weight model `bench shape` and `bench train` build.
#[derive(Args, Debug)]
pub struct ShapeArgs {
    /// `qwen3-8b`, or a config.json of any supported family.
    #[arg(long, default_value = "qwen3-8b")]
    pub shape: String,
    #[command(flatten)]
    pub run_on: DeviceArgs,
}

impl ShapeArgs {
    /// The device, the dtype and the shape's target config.
    pub fn parse(&self) -> Result<(candle_core::Device, DType, TargetConfig)> {
        let (dtype, device) = self.run_on.parse()?;
        Ok((device, dtype, shape_config(&self.shape)?))
    }
}

#[derive(Args, Debug)]
pub struct BenchShapeArgs {
    #[command(flatten)]
    pub model: ShapeArgs,
    /// Committed rows in the cache when timing.
    #[arg(long, default_value_t = 512)]
    pub cache: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long, default_value_t = 5)]
    pub draft_layers: usize,
    /// DDTree budgets (non-root nodes), comma-separated.
    #[arg(long, default_value = "8,16,32,64,128,256,512")]
    pub budgets: String,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Hybrid shapes: the rows of one Gated DeltaNet layer's rule timed alone, chunked and
    /// recurrent, per length (comma-separated; empty for none).
    #[arg(long, default_value = "2048,8192")]
    pub gdn_lengths: String,
    /// The τ of the cost-model figures in `--output-json` rows (the paper's Qwen3-8B GSM8K τ: 6.5).
    #[arg(long, default_value_t = 6.5)]
    pub tau: f64,
    /// Also write the figures as JSON lines to this file, for `docs/bench/`: one row of the
    /// eager forwards and, on a GPU, one of the forwards replayed from CUDA graphs (`shape`,
    /// `impl`, `mode`, `ar_ms`, `verify16_ms` (the chain verify of `--block-size` rows),
    /// `draft_ms`, `read_floor_ms`, `ddtree_verify_ms` (per budget), `costmodel`: `{"tau", "dflash", "ddtree_best"}`).
    #[arg(long)]
    pub output_json: Option<std::path::PathBuf>,
    /// Only capture the draft block, the AR step and the chain verify as CUDA graphs, replay
    /// each N times in that order inside a profiler range and exit (GPU): the run a kernel
    /// profiler reads (`ncu --profile-from-start off --graph-profiling node`,
    /// `bench/kernel_profile.py`). Prints each graph's kernel count.
    #[arg(long, default_value_t = 0)]
    pub profile_replays: usize,
    /// Only run the AR step and the chain verify eagerly (no CUDA graphs), each N times in that
    /// order inside a profiler range, and exit (GPU): what a kernel profiler reads where it
    /// cannot profile a graph's nodes (`ncu --profile-from-start off`, `bench/kernel_profile.py`).
    /// Prints each forward's kernel count.
    #[arg(long, default_value_t = 0)]
    pub profile_eager: usize,
    /// Only run one Gated DeltaNet layer's chunked rule N times at each `--gdn-lengths` inside
    /// a profiler range and exit (GPU, hybrid shapes): the run a kernel profiler reads beside
    /// fla's kernels (`bench/gdn_profile.py`). Prints the kernels of one run per length.
    #[arg(long, default_value_t = 0)]
    pub profile_gdn_rule: usize,
    /// The block products of the rule timed alone (`--gdn-lengths`, `--profile-gdn-rule`): `f32`
    /// FMAs or `tf32` tensor cores; default the `--dtype`'s (f32 for f32, tf32 otherwise).
    #[arg(long, value_parser = parse_chunk_math)]
    pub gdn_math: Option<dflash_model::ops::gdn_chunk::ChunkMath>,
}

fn parse_chunk_math(s: &str) -> Result<dflash_model::ops::gdn_chunk::ChunkMath, String> {
    use dflash_model::ops::gdn_chunk::ChunkMath;
    match s {
        "f32" => Ok(ChunkMath::F32),
        "tf32" => Ok(ChunkMath::Tf32),
        _ => Err(format!("unknown products {s:?}: f32 or tf32")),
    }
}

/// `bench shape`: the checks of the flags, the random pair built, then either one profiling
/// run or every timing, printed (and written as JSON lines with `--output-json`).
pub fn run(a: BenchShapeArgs) -> Result<()> {
    let (dev, dtype, cfg) = a.model.parse()?;
    if (a.profile_replays > 0 || a.profile_eager > 0) && dev.is_cpu() {
        anyhow::bail!(
            "--profile-replays and --profile-eager need a CUDA device: they count kernels in CUDA graph captures"
        );
    }
    if a.profile_gdn_rule > 0 {
        let math = a
            .gdn_math
            .unwrap_or(dflash_model::ops::gdn_chunk::ChunkMath::for_dtype(dtype));
        return gdn::profile_gdn_rule(&cfg, &dev, &a.gdn_lengths, a.profile_gdn_rule, math);
    }
    if a.block_size < 2 || a.cache == 0 || a.repeats == 0 {
        anyhow::bail!("--block-size must be >= 2, --cache and --repeats >= 1");
    }
    let budgets = parse_budgets(&a.budgets)?;
    let (bench, mut caches) = Bench::build(&a, &cfg, dtype, &dev)?;
    if a.profile_eager > 0 {
        return profile::profile_eager(
            &bench.target,
            &mut caches.target,
            &bench.taps,
            a.block_size,
            a.profile_eager,
        );
    }
    if a.profile_replays > 0 {
        return profile::profile_replays(
            &bench.target,
            &bench.drafter,
            (&mut caches.target, &mut caches.draft),
            &bench.last_row,
            &bench.taps,
            a.block_size,
            a.profile_replays,
        );
    }
    let eager = bench.time_eager(&mut caches, &dev, a.repeats)?;
    let graphed = graphs_wanted(&dev);
    let draft_graph = if graphed {
        Some(bench.time_draft_graph(&mut caches, &dev, a.repeats)?)
    } else {
        None
    };
    let trees = bench.time_trees(&mut caches.target, &budgets, &dev, a.repeats)?;
    let graphs = if graphed {
        bench.graph_costs(&mut caches.target, &budgets, &dev, a.repeats)?
    } else {
        Vec::new()
    };
    let timings = Timings {
        eager,
        draft_graph,
        trees,
        graphs,
        gdn_rule: gdn::gdn_rule_times(
            &cfg,
            &dev,
            &a.gdn_lengths,
            a.repeats,
            a.gdn_math
                .unwrap_or(dflash_model::ops::gdn_chunk::ChunkMath::for_dtype(dtype)),
        )?,
        floor: Floor::measure(&cfg, dtype, &dev)?,
    };
    report::print(&a, &timings);
    if let Some(path) = &a.output_json {
        report::write_json(path, &a, &timings)?;
    }
    Ok(())
}

/// `--budgets` as positive integers.
fn parse_budgets(budgets: &str) -> Result<Vec<usize>> {
    budgets
        .split(',')
        .map(|b| b.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<_>>()
        .context("--budgets: comma-separated positive integers")
}

/// Whether the CUDA-graph replays run: on a GPU, unless phase profiling is requested (it
/// synchronises the device inside each forward, which a CUDA graph capture cannot hold; said).
fn graphs_wanted(dev: &candle_core::Device) -> bool {
    let graphed = !dev.is_cpu() && !dflash_model::profile::requested();
    if !dev.is_cpu() && !graphed {
        eprintln!(
            "{} is set: no CUDA-graph replays (a capture cannot synchronise)",
            dflash_core::env::PROFILE.name
        );
    }
    graphed
}
