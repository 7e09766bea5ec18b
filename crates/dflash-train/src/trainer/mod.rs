//! The training loop, in stages: [`run::Run::open`] → per step [`run::Run::step`] →
//! validation → the metrics line → [`run::Run::checkpoint`]. The target (frozen) gives the context features of each sequence from
//! the same engine and kernels as decoding; the drafter is the same `Drafter` that decodes,
//! with its weights as variables; the target's embedding and LM head are plain tensors, so
//! they get no gradient, no update, and are not saved.
//!
//! Determinism: the data order of epoch e is a ChaCha8 permutation seeded by (seed, e); the
//! anchors of sequence i in epoch e are seeded by (seed, e, i); the trainer state stores the
//! step, the epoch and the position in the permutation, plus the AdamW moments. On CPU at f32
//! a resumed run therefore reproduces the uninterrupted loss curve bit for bit.

mod drafter;
mod features;
mod grads;
mod rows;
mod run;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dflash_model::io::loader::LoadedTarget;
use serde::{Deserialize, Serialize};

pub use drafter::TrainableDrafter;
pub use features::FeatureCache;
pub use rows::{row_loss, usable_sequences, validate, Validation};

use crate::collective::{Collective, Single};
use crate::config::TrainConfig;
use crate::progress::Progress;

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    pub epoch: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub supervised_tokens: usize,
    pub acceptance: Vec<f64>,
    pub simulated_tau: f64,
    /// The pooled τ decoding would measure (harmonic mean over anchors).
    #[serde(default)]
    pub simulated_decoding_tau: f64,
    pub tokens_per_sec: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_simulated_tau: Option<f64>,
    /// On the validation sequences (every anchor scored): τ of the decoding walk over their
    /// responses (`Validation::decoding_tau`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_simulated_decoding_tau: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps: usize,
    pub last: Option<StepMetrics>,
    pub latest_checkpoint: Option<PathBuf>,
    /// The run stopped at its time limit before the last step (continue with `--resume`).
    pub stopped_at_time_limit: bool,
    /// Row visits served from the [`FeatureCache`] (no target forward).
    pub feature_cache_hits: usize,
}

/// How one invocation runs (not part of the run: they are not in the training config, so a
/// run split over several invocations is the same run).
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Continue the run in `out` from its latest checkpoint, exactly.
    pub resume: bool,
    /// Stop after the first optimizer step that ends past this wall time, with a checkpoint
    /// of that step, so that `--resume` continues exactly (e.g. a 10-minute GPU lease).
    pub time_limit: Option<Duration>,
    /// Device memory for keeping the target's context features between epochs
    /// ([`FeatureCache`]); 0 keeps none (every visit runs the target forward again).
    pub feature_cache_bytes: usize,
    /// Append each step's training rows to this JSON-lines file (rank 0): per row the step
    /// (from 1), its index in the step, its learning rate, ids, loss mask, the packed
    /// sequences' first rows and the anchors drawn — what a reference trainer needs to take
    /// the same steps (`bench/train_reference_run.py`).
    pub plan_out: Option<PathBuf>,
    /// Shard the optimizer's moments over the ranks ([`crate::shard`]): each keeps those of
    /// the parameters it owns (1/N of them) and sends their updates to the others. The same
    /// run either way (checkpoints included); only the memory and the traffic change.
    pub shard_optimizer: bool,
}

impl Default for TrainOptions {
    /// A new run, no time limit, 8 GiB of features kept.
    fn default() -> Self {
        Self {
            resume: false,
            time_limit: None,
            feature_cache_bytes: 8 << 30,
            plan_out: None,
            shard_optimizer: false,
        }
    }
}

/// Train a drafter for `lt` on the shards in `data_dir`, writing into `out`.
pub fn train(
    lt: &LoadedTarget,
    data_dir: &Path,
    out: &Path,
    cfg: TrainConfig,
    opts: &TrainOptions,
) -> Result<TrainSummary> {
    train_rank(lt, data_dir, out, cfg, opts, &Single)
}

/// [`train`] as one rank of a data-parallel group: every rank of `comm` calls this with the
/// same arguments; each computes its slice of every step's rows and the gradients are summed
/// over the ranks (the order that makes N ranks equal one rank: [`crate::collective`]). Rank 0
/// alone validates and writes metrics, checkpoints and curves; its clock decides a time-limited
/// stop. A resumed run may use another number of ranks (the step's rows are re-sliced).
pub fn train_rank(
    lt: &LoadedTarget,
    data_dir: &Path,
    out: &Path,
    cfg: TrainConfig,
    opts: &TrainOptions,
    comm: &dyn Collective,
) -> Result<TrainSummary> {
    let started = Instant::now();
    let mut run = run::Run::open(lt, data_dir, out, cfg, opts, comm)?;
    let total = run.total;
    let lead = run.lead();
    let mut pb = lead.then(|| Progress::new(total, "train", "steps"));
    if let Some(pb) = &mut pb {
        pb.set_position(run.state.steps_done);
    }
    let mut last = None;
    let mut stopped_at_time_limit = false;
    while run.state.steps_done < total {
        let step = run.step()?;
        let done = run.state.steps_done;
        if let Some(limit) = opts.time_limit {
            let past = (started.elapsed() >= limit) as u8 as f64;
            stopped_at_time_limit = done < total && comm.all_gather(&[past])?[0] == 1.0;
        }
        let save =
            done.is_multiple_of(run.cfg.save_every) || done == total || stopped_at_time_limit;
        // every checkpoint records its own validation (a time-limited stop or a save between
        // validation steps too), so that its training.json always has the numbers the doctor
        // compares with
        let val =
            if lead && !run.val_seqs.is_empty() && (done.is_multiple_of(run.cfg.val_every) || save)
            {
                Some(run.validate()?)
            } else {
                None
            };
        let m = run.record(&step, val.as_ref())?;
        if let Some(pb) = &mut pb {
            pb.inc(
                1,
                // τ as decoding would measure it: the uniform-anchor mean (`simulated_tau`)
                // overstates it where acceptance is uneven (the shipped SmolLM2 drafter on its
                // card's 32 responses: 5.43, where decoding measures 2.25 and the walk 2.25);
                // both stay in metrics.jsonl
                format!(
                    "loss {:.4} decoding τ ≈ {:.2} {:.0} tok/s{}",
                    m.loss,
                    m.simulated_decoding_tau,
                    m.tokens_per_sec,
                    match (m.val_loss, m.val_simulated_decoding_tau) {
                        (Some(l), Some(t)) => format!(", val loss {l:.4}, val decoding τ {t:.2}"),
                        (Some(l), None) => format!(", val loss {l:.4}"),
                        _ => String::new(),
                    }
                ),
            );
        }
        if save {
            run.checkpoint(&m, val.as_ref())?;
        }
        last = Some(m);
        if stopped_at_time_limit {
            break;
        }
    }
    if let Some(pb) = pb {
        pb.finish();
        dflash_model::profile::print_report("training");
    }
    if lead && stopped_at_time_limit {
        eprintln!(
            "time limit reached after step {}/{total}: checkpoint saved, continue with --resume",
            run.state.steps_done
        );
    }
    Ok(TrainSummary {
        steps: run.state.steps_done,
        last,
        latest_checkpoint: run.latest_checkpoint,
        stopped_at_time_limit,
        feature_cache_hits: run.cache.hits,
    })
}

/// The lines of a run's `metrics.jsonl`.
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    crate::data::parse_jsonl(&text, path)
}
