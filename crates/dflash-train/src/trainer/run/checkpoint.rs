//! What a run writes per step: its line of `metrics.jsonl` ([`Run::record`]) and its
//! checkpoint ([`Run::checkpoint`]).

use anyhow::Result;
use dflash_model::io::atomic::{replace_dir, write_file};

use super::{Run, StepOutcome};
use crate::checkpoint::{
    write_checksums, write_drafter_files, write_trainer_state, TrainingRecord,
};
use crate::trainer::rows::Validation;
use crate::trainer::{read_metrics, StepMetrics};

impl Run<'_> {
    /// The step's line of `metrics.jsonl`, written by rank 0.
    pub fn record(&mut self, s: &StepOutcome, val: Option<&Validation>) -> Result<StepMetrics> {
        use std::io::Write;
        let m = StepMetrics {
            step: self.state.steps_done,
            epoch: self.state.epoch,
            loss: s.loss,
            lr: s.lr,
            grad_norm: s.grad_norm,
            supervised_tokens: s.supervised,
            acceptance: s.counts.rates(),
            simulated_tau: s.counts.simulated_tau(),
            simulated_decoding_tau: s.counts.simulated_decoding_tau(),
            tokens_per_sec: self.tokens_total as f64 / self.started.elapsed().as_secs_f64(),
            val_loss: val.map(|v| v.loss),
            val_simulated_tau: val.map(|v| v.counts.simulated_tau()),
            val_simulated_decoding_tau: val.map(Validation::decoding_tau),
        };
        if let Some(f) = &mut self.metrics_file {
            f.write_all((serde_json::to_string(&m)? + "\n").as_bytes())?;
            f.flush()?;
        }
        Ok(m)
    }

    /// A checkpoint of this step (drafter + trainer state), `latest`, `best/` when the
    /// validation loss is the lowest so far, the oldest checkpoints pruned, `curves.svg`.
    /// Rank 0 alone writes (the other ranks return at once).
    pub fn checkpoint(&mut self, m: &StepMetrics, val: Option<&Validation>) -> Result<()> {
        // a sharded optimizer's owners send rank 0 their moments: every rank takes part
        let moments = crate::shard::gather_moments(&self.td.params, &self.opt, self.comm)?;
        let (Some(fingerprint), Some((m1, m2))) = (self.fingerprint.clone(), moments) else {
            return Ok(());
        };
        let _p = tracing::info_span!(target: "phase", "checkpoint").entered();
        let is_best = match (val, self.state.best_val_loss) {
            (Some(v), Some(b)) => v.loss < b,
            (Some(_), None) => true,
            _ => false,
        };
        if is_best {
            self.state.best_val_loss = val.map(|v| v.loss);
        }
        let rec = TrainingRecord {
            train_config: self.cfg.clone(),
            loss: self.cfg.loss,
            mask_token_id: self.mask_token_id,
            data_target_hash: self.manifest.target_hash.clone(),
            data_source: self.manifest.source.clone(),
            data_manifest_sha256: self.manifest_sha.clone(),
            steps: self.state.steps_done,
            train_loss: Some(m.loss),
            val_loss: val.map(|v| v.loss),
            val_acceptance: val.map(|v| v.counts.rates()).unwrap_or_default(),
            val_simulated_tau: val.map(|v| v.counts.simulated_tau()),
            fingerprint,
        };
        let w = self.td.weights();
        let dir = self.paths.step_dir(self.state.steps_done);
        replace_dir(&dir, |tmp| {
            write_drafter_files(&tmp.join("drafter"), &self.dcfg, &w, &rec)?;
            write_trainer_state(&tmp.join("trainer"), &self.names, &m1, &m2, &self.state)?;
            write_checksums(tmp)
        })?;
        self.paths.set_latest(self.state.steps_done)?;
        if is_best {
            replace_dir(&self.out.join("best"), |tmp| {
                write_drafter_files(tmp, &self.dcfg, &w, &rec)
            })?;
        }
        self.paths.prune(self.cfg.keep_last)?;
        self.latest_checkpoint = Some(dir);
        write_file(
            &self.out.join("curves.svg"),
            crate::curves::svg(&read_metrics(&self.metrics_path)?).as_bytes(),
        )
    }
}
