//! The training configuration: every knob, saved beside every checkpoint (`train_config.json`).

use serde::{Deserialize, Serialize};

/// Which loss trains the drafter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossKind {
    /// Cross-entropy against the token in the sequence (hard labels).
    Ce,
    /// KL(target ‖ drafter) against the target's distribution at the label position, from the
    /// same clean target forward that gives the context features (soft labels).
    Kl,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    // the drafter
    pub num_draft_layers: usize,
    pub block_size: usize,
    pub intermediate_size: Option<usize>,
    /// The mask token; default: an unused special token of the target (recorded in the checkpoint).
    pub mask_token_id: Option<u32>,
    pub target_layer_ids: Option<Vec<usize>>,
    /// Seed of the drafter's initial weights.
    pub init_seed: u64,
    /// Start from this drafter's weights (a drafter directory, e.g. an earlier run's export)
    /// instead of random ones; the optimizer state starts fresh. Its shape must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<String>,
    /// A DFlash2 drafter (z-lab's `DFlash2DraftModel`) of these conv and selector sizes;
    /// unset: a DFlash drafter. `init_from` may name a DFlash drafter: its weights start the
    /// layers, the convs start as the identity and the selector from `init_seed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dflash2: Option<dflash_core::config::Dflash2Params>,
    /// Train only the weights whose names start with one of these prefixes (e.g.
    /// `["candidate_selector."]`); the others stay as initialised. Unset: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_only: Option<Vec<String>>,
    // the objective
    pub num_anchors: usize,
    /// Position decay: row k (k ≥ 1) of a block weighs exp(-(k-1)/gamma).
    pub gamma: f64,
    pub loss: LossKind,
    /// DFlash2: the weight of the selector's term ([`crate::selector_loss`]).
    pub selector_loss_weight: f64,
    pub max_length: usize,
    /// Pack training sequences side by side into rows of at most this many tokens (one
    /// target and one drafter forward per row; `num_anchors` then counts per row). Unset:
    /// one sequence per row. Validation rows are never packed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack_length: Option<usize>,
    /// Cut each response after its first window of this many supervised tokens that already
    /// occurred earlier in it (a repetition loop, [`crate::loops`]), validation included.
    /// Unset: responses whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loop_window: Option<usize>,
    // the optimizer
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub warmup_ratio: f64,
    pub min_lr_ratio: f64,
    pub grad_clip: f64,
    /// Training rows (sequences, or packs of them) per optimizer step.
    pub grad_accum: usize,
    pub epochs: usize,
    /// Stop after this many optimizer steps (the schedule spans `max_steps` when set).
    pub max_steps: Option<usize>,
    // bookkeeping
    pub seed: u64,
    pub save_every: usize,
    pub keep_last: usize,
    pub val_every: usize,
    /// Sequences held out from the end of the data for validation.
    pub val_sequences: usize,
    /// Where a run computes is the command line's (`train --device --dtype`), not the
    /// recipe's; configs and training records that still name them are read with them
    /// ignored (`train --config` refuses a file that names them, [`machine_fields`]).
    #[serde(default, skip_serializing)]
    pub dtype: Ignored,
    #[serde(default, skip_serializing)]
    pub device: Ignored,
}

/// A field read and ignored; every two compare equal.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ignored;

impl PartialEq for Ignored {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<'de> Deserialize<'de> for Ignored {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d)?;
        Ok(Ignored)
    }
}

/// The machine fields (`device`, `dtype`) a config file's JSON names: they belong on the
/// command line. Example: `{"lr": 1e-3, "device": "cuda"}` → `["device"]`.
pub fn machine_fields(json: &serde_json::Value) -> Vec<&'static str> {
    ["device", "dtype"]
        .into_iter()
        .filter(|k| json.get(k).is_some())
        .collect()
}

impl Default for TrainConfig {
    /// The DFlash paper / SpecForge recipe.
    fn default() -> Self {
        Self {
            num_draft_layers: 5,
            block_size: 16,
            intermediate_size: None,
            mask_token_id: None,
            target_layer_ids: None,
            init_seed: 0,
            init_from: None,
            dflash2: None,
            train_only: None,
            num_anchors: 512,
            gamma: 7.0,
            loss: LossKind::Ce,
            selector_loss_weight: 1.0,
            max_length: 3072,
            pack_length: None,
            loop_window: None,
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            warmup_ratio: 0.04,
            min_lr_ratio: 0.0,
            grad_clip: 1.0,
            grad_accum: 1,
            epochs: 6,
            max_steps: None,
            seed: 0,
            save_every: 200,
            keep_last: 3,
            val_every: 200,
            val_sequences: 8,
            dtype: Ignored,
            device: Ignored,
        }
    }
}

impl TrainConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        let bad = |m: &str| Err(anyhow::anyhow!("invalid training config: {m}"));
        if self.block_size < 2 {
            return bad("block_size must be >= 2");
        }
        if self.num_anchors == 0 || self.grad_accum == 0 || self.num_draft_layers == 0 {
            return bad("num_anchors, grad_accum and num_draft_layers must be >= 1");
        }
        // written as !(x > 0) so that NaN is refused too
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(self.lr > 0.0)
            || !(self.gamma > 0.0)
            || self.grad_clip.is_nan()
            || self.grad_clip < 0.0
        {
            return bad("lr and gamma must be > 0, grad_clip >= 0");
        }
        if !(0.0..1.0).contains(&self.warmup_ratio) {
            return bad("warmup_ratio must be in [0, 1)");
        }
        if self.loop_window == Some(0) {
            return bad("loop_window must be >= 1 (unset it to keep responses whole)");
        }
        if self.pack_length.is_some_and(|p| p < self.max_length) {
            return bad("pack_length must be >= max_length (a sequence must fit one row)");
        }
        if !(self.selector_loss_weight >= 0.0 && self.selector_loss_weight.is_finite()) {
            return bad("selector_loss_weight must be a finite number >= 0");
        }
        if self
            .train_only
            .as_ref()
            .is_some_and(|t| t.is_empty() || t.iter().any(|p| p.is_empty()))
        {
            return bad("train_only needs at least one non-empty name prefix");
        }
        if self.save_every == 0 || self.val_every == 0 {
            return bad("save_every and val_every must be >= 1");
        }
        Ok(())
    }

    /// Learning rate at optimizer step `step` (0-based) of `total`: linear warmup over
    /// `warmup_ratio · total` steps, then cosine from `lr` down to `min_lr_ratio · lr`.
    pub fn lr_at(&self, step: usize, total: usize) -> f64 {
        let warm = (self.warmup_ratio * total as f64).ceil() as usize;
        if step < warm {
            return self.lr * (step + 1) as f64 / warm as f64;
        }
        let span = (total - warm).max(1) as f64;
        let p = ((step - warm) as f64 / span).min(1.0);
        let min = self.min_lr_ratio * self.lr;
        min + (self.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record written with the machine in the recipe still reads (the fields ignored, the
    /// rest kept); a config file that names them is flagged; unknown fields stay refused.
    #[test]
    fn machine_fields_are_read_ignored_and_flagged() {
        let j = serde_json::json!({"lr": 1e-3, "device": "cuda", "dtype": "bf16"});
        let c: TrainConfig = serde_json::from_value(j.clone()).unwrap();
        assert_eq!(
            c,
            TrainConfig {
                lr: 1e-3,
                ..Default::default()
            }
        );
        let written = serde_json::to_value(&c).unwrap();
        assert!(written.get("device").is_none() && written.get("lr").is_some());
        assert_eq!(machine_fields(&j), ["device", "dtype"]);
        assert!(machine_fields(&written).is_empty());
        assert!(serde_json::from_value::<TrainConfig>(serde_json::json!({"lrr": 1})).is_err());
    }

    #[test]
    fn schedule_warms_up_then_decays() {
        let c = TrainConfig {
            lr: 1.0,
            warmup_ratio: 0.1,
            ..Default::default()
        };
        assert!((c.lr_at(0, 100) - 0.1).abs() < 1e-12);
        assert!((c.lr_at(9, 100) - 1.0).abs() < 1e-12);
        assert!((c.lr_at(10, 100) - 1.0).abs() < 1e-12);
        assert!(c.lr_at(99, 100) < 0.01);
        let unknown: Result<TrainConfig, _> = serde_json::from_str(r#"{"lrr": 1}"#);
        assert!(unknown.is_err(), "unknown fields are refused");
    }
}
