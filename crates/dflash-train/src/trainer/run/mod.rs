//! One training run's state and its stages: [`Run::open`] (data, rows, the drafter, a resumed
//! checkpoint), [`Run::step`] (one optimizer step), [`Run::validate`] and [`Run::checkpoint`].

mod checkpoint;
mod open;
mod ranks;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use dflash_core::config::DrafterConfig;
use dflash_core::stats::AcceptCounts;
use dflash_model::io::loader::LoadedTarget;

use super::drafter::TrainableDrafter;
use super::features::FeatureCache;
use super::grads::{add_grads, fold_path, path_to_last, GradBuckets};
use super::rows::{permutation, row_anchors, row_loss, validate, Validation};
use crate::checkpoint::{CheckpointPaths, TrainerState};
use crate::collective::{halving_sum, rank_slice, Collective};
use crate::config::TrainConfig;
use crate::data::{Manifest, Sequence};
use crate::fingerprint::Fingerprint;
use crate::loss::LossOutput;
use crate::optim::AdamW;
use crate::pack::TrainingRow;
use ranks::{agreed, parse_row_stats, row_stats, row_stats_len};

/// What one optimizer step did, before validation.
pub(super) struct StepOutcome {
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub counts: AcceptCounts,
    pub supervised: usize,
}

/// A training run: its inputs, the drafter and optimizer, and where it is.
pub(super) struct Run<'a> {
    pub lt: &'a LoadedTarget,
    comm: &'a dyn Collective,
    pub cfg: TrainConfig,
    pub out: PathBuf,
    pub paths: CheckpointPaths,
    manifest: Manifest,
    manifest_sha: String,
    pub train_rows: Vec<TrainingRow>,
    pub val_seqs: Vec<Sequence>,
    dcfg: DrafterConfig,
    mask_token_id: u32,
    pub td: TrainableDrafter,
    names: Vec<String>,
    opt: AdamW,
    pub state: TrainerState,
    order: Vec<usize>,
    /// Steps of the whole run (the schedule's length).
    pub total: usize,
    pub metrics_path: PathBuf,
    /// Rank 0's (the other ranks write nothing).
    metrics_file: Option<std::fs::File>,
    /// Rank 0's.
    fingerprint: Option<Fingerprint>,
    /// Rank 0's: each step's rows ([`TrainOptions::plan_out`](super::TrainOptions::plan_out)).
    plan_file: Option<std::io::BufWriter<std::fs::File>>,
    pub cache: FeatureCache,
    cache_reported: bool,
    pub latest_checkpoint: Option<PathBuf>,
    started: Instant,
    tokens_total: usize,
}

impl<'a> Run<'a> {
    /// The step's rows to the plan file
    /// ([`TrainOptions::plan_out`](super::TrainOptions::plan_out)), one JSON line each.
    /// Example: `{"step":1,"row":0,"lr":0.0006,"ids":[…],"loss_mask":[…],"starts":[0,700],
    /// "anchors":[3,17,…]}` (two sequences packed in the row, the second from row 700).
    fn write_plan(&mut self, plan: &[(usize, usize)]) -> Result<()> {
        use std::io::Write;
        let lr = self.cfg.lr_at(self.state.steps_done, self.total);
        let step = self.state.steps_done + 1;
        let Some(f) = self.plan_file.as_mut() else {
            return Ok(());
        };
        for (j, &(si, epoch)) in plan.iter().enumerate() {
            let row = &self.train_rows[si];
            let anchors = row_anchors(row, &self.cfg, epoch, si);
            let line = serde_json::json!({
                "step": step,
                "row": j,
                "lr": lr,
                "ids": row.seq.ids,
                "loss_mask": row.seq.loss_mask,
                "starts": row.segs.starts(),
                "anchors": anchors,
            });
            writeln!(f, "{line}")?;
        }
        f.flush()?;
        Ok(())
    }

    /// One optimizer step over `grad_accum` rows in the epoch's order: each row's loss and
    /// backward (this rank's slice of the rows, [`rank_slice`]), the gradients summed as the
    /// halving tree of [`crate::collective`] and over the ranks, one update at the schedule's
    /// learning rate (the same on every rank, so the ranks' weights stay equal).
    pub fn step(&mut self) -> Result<StepOutcome> {
        let a = self.cfg.grad_accum;
        // the step's rows: every rank walks them all, so the state (epoch, position) is global
        let mut plan = Vec::with_capacity(a);
        for _ in 0..a {
            if self.state.position >= self.order.len() {
                self.state.epoch += 1;
                self.state.position = 0;
                self.order = permutation(self.train_rows.len(), self.cfg.seed, self.state.epoch);
            }
            plan.push((self.order[self.state.position], self.state.epoch));
            self.state.position += 1;
        }
        if self.plan_file.is_some() {
            self.write_plan(&plan)?;
        }
        let mine = rank_slice(a, self.comm.rank(), self.comm.world())?;
        let mut stats: Vec<f64> = Vec::new();
        let positions = self.cfg.block_size - 1;
        let grads = if self.comm.is_single() {
            halving_sum(
                mine.start,
                mine.end,
                &mut |j| self.row_grads(&plan, j, &mut stats),
                &add_grads,
            )?
        } else {
            self.ranks_grads(&plan, mine, &mut stats)?
        };
        // the rows' numbers from every rank, merged in the step's row order
        let all = self.comm.all_gather(&stats)?;
        let (mut loss_num, mut loss_den) = (0.0, 0.0);
        let mut counts = AcceptCounts::new(positions);
        for row in all.chunks(row_stats_len(positions)) {
            let (l, w, c) = parse_row_stats(row, positions);
            loss_num += l * w;
            loss_den += w;
            counts.merge(&c);
        }
        let supervised = plan
            .iter()
            .map(|&(si, _)| self.train_rows[si].seq.supervised())
            .sum();
        let lr = self.cfg.lr_at(self.state.steps_done, self.total);
        let grad_norm = self.td.update(
            &self.lt.target,
            &mut self.opt,
            grads,
            self.cfg.grad_clip,
            lr,
            self.comm,
        )?;
        if !grad_norm.is_finite() {
            bail!(
                "gradient norm is {grad_norm} at step {}: stopping",
                self.state.steps_done + 1
            );
        }
        self.state.steps_done += 1;
        self.state.adam_step = self.opt.step;
        self.tokens_total += supervised;
        if self.lead() && !self.cache_reported && self.state.position >= self.order.len() {
            self.cache_reported = true;
            eprintln!(
                "feature cache: {:.0} MB kept for {} rows of {} (budget {:.0} MB)",
                self.cache.used() as f64 / 1e6,
                self.cache.len(),
                self.train_rows.len() + self.val_seqs.len(),
                self.cache.budget as f64 / 1e6
            );
        }
        Ok(StepOutcome {
            loss: loss_num / loss_den,
            lr,
            grad_norm,
            counts,
            supervised,
        })
    }

    /// Row `j` of the step's `plan`: its loss on the drafter (a non-finite loss stops the run,
    /// naming the last good checkpoint), its numbers appended to `stats`.
    fn row_forward(
        &mut self,
        plan: &[(usize, usize)],
        j: usize,
        stats: &mut Vec<f64>,
    ) -> Result<LossOutput> {
        let (si, epoch) = plan[j];
        let row = &self.train_rows[si];
        let out = row_loss(
            &self.td,
            self.lt,
            &self.cfg,
            row,
            &row_anchors(row, &self.cfg, epoch, si),
            (&mut self.cache, si),
        )?;
        let l = {
            let _p = tracing::info_span!(target: "phase", "loss to host").entered();
            out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?
        };
        if !l.is_finite() {
            bail!(
                "loss is {l} at step {}: stopping; the last good checkpoint is {}",
                self.state.steps_done + 1,
                self.latest_checkpoint
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "none (no checkpoint yet)".into())
            );
        }
        let positions = self.cfg.block_size - 1;
        stats.extend(row_stats(l, out.weight_sum, &out.counts, positions));
        Ok(out)
    }

    /// Row `j`'s gradients of `loss / grad_accum`, its numbers appended to `stats`.
    fn row_grads(
        &mut self,
        plan: &[(usize, usize)],
        j: usize,
        stats: &mut Vec<f64>,
    ) -> Result<Vec<Option<Tensor>>> {
        let out = self.row_forward(plan, j, stats)?;
        let g = {
            let _p = tracing::info_span!(target: "phase", "backward").entered();
            out.backward_over(self.cfg.grad_accum as f64)?
        };
        Ok(self.td.grads_of(&g))
    }

    /// This rank's rows `mine` summed (the halving tree) and over the ranks, bucket by bucket
    /// ([`GradBuckets`]): the rows before the last as the tree's left subtrees, then the last
    /// row's backward, which starts each layer's sum over the ranks as soon as that layer's
    /// gradients are done. Every rank first agrees that its rows so far went well, so that no
    /// rank waits in a sum a failed rank never starts.
    fn ranks_grads(
        &mut self,
        plan: &[(usize, usize)],
        mine: std::ops::Range<usize>,
        stats: &mut Vec<f64>,
    ) -> Result<Vec<Option<Tensor>>> {
        let before = (|| {
            let (left, last) = path_to_last(mine.start, mine.end, &mut |lo, hi| {
                halving_sum(lo, hi, &mut |j| self.row_grads(plan, j, stats), &add_grads)
            })?;
            let out = self.row_forward(plan, last, stats)?;
            Ok((left, out))
        })();
        let (left, out) = agreed(self.comm, before)?;
        let td = &self.td;
        let comm = self.comm;
        let mut buckets = GradBuckets::new(&td.params, td.config.num_hidden_layers);
        let g = {
            let _p = tracing::info_span!(target: "phase", "backward").entered();
            out.backward_each_over(self.cfg.grad_accum as f64, &mut |layer, g| {
                buckets.layer_done(layer, comm, &mut |i| fold_path(&left, i, td.grad_of(g, i)))
            })?
        };
        let _p = tracing::info_span!(target: "phase", "all-reduce grads").entered();
        buckets.finish(comm, &mut |i| fold_path(&left, i, td.grad_of(&g, i)))
    }

    /// Rank 0: the rank that validates and writes metrics, checkpoints and curves.
    pub fn lead(&self) -> bool {
        self.comm.rank() == 0
    }

    /// Loss and acceptance on the validation sequences (their features in the run's cache).
    pub fn validate(&mut self) -> Result<Validation> {
        let key0 = self.train_rows.len();
        validate(
            &self.td,
            self.lt,
            &self.cfg,
            &self.val_seqs,
            (&mut self.cache, key0),
        )
    }
}
