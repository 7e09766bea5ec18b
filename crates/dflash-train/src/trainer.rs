//! The training loop. The target (frozen) gives the context features of each sequence from
//! the same engine and kernels as decoding; the drafter is the same `Drafter` that decodes,
//! with its weights as variables; the target's embedding and LM head are plain tensors, so
//! they get no gradient, no update, and are not saved.
//!
//! Determinism: the data order of epoch e is a ChaCha8 permutation seeded by (seed, e); the
//! anchors of sequence i in epoch e are seeded by (seed, e, i); the trainer state stores the
//! step, the epoch and the position in the permutation, plus the AdamW moments. On CPU at f32
//! a resumed run therefore reproduces the uninterrupted loss curve bit for bit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use dflash_core::config::DrafterConfig;
use dflash_model::io::loader::{identity_hash, LoadedTarget};
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter::Drafter;
use dflash_model::models::drafter_init::{
    default_mask_token, drafter_config, random_weights, DrafterShape,
};
use dflash_model::profile::Phases;
use dflash_model::Target;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::anchors;
use crate::checkpoint::{
    read_trainer_state, replace_dir, write_drafter_files, write_trainer_state, CheckpointPaths,
    TrainerState, TrainingRecord,
};
use crate::config::{LossKind, TrainConfig};
use crate::data::{read_sequences, write_atomic, Sequence};
use crate::fingerprint::fingerprint;
use crate::loss::{block_loss_profiled, target_features};
use crate::optim::{clip_grad_norm, AdamW};
use crate::pack::{pack, TrainingRow};
use crate::progress::Progress;
use dflash_core::stats::AcceptCounts;

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

/// Limits of one invocation (not of the run: they are not part of the training config, so a
/// run split over several invocations is the same run).
#[derive(Debug, Clone, Copy)]
pub struct RunLimits {
    /// Stop after the first optimizer step that ends past this wall time, with a checkpoint
    /// of that step, so that `--resume` continues exactly (e.g. a 10-minute GPU lease).
    pub time_limit: Option<std::time::Duration>,
    /// Device memory for keeping the target's context features between epochs
    /// ([`FeatureCache`]); 0 keeps none (every visit runs the target forward again).
    pub feature_cache_bytes: usize,
}

impl Default for RunLimits {
    /// No time limit; 8 GiB of features kept.
    fn default() -> Self {
        Self {
            time_limit: None,
            feature_cache_bytes: 8 << 30,
        }
    }
}

/// The target's context features of training rows, kept on the device across epochs up to a
/// byte budget. The target is frozen and deterministic, so a kept row's features are exactly
/// what its forward would give on the next visit: the same function, run once per row instead
/// of once per visit. Rows past the budget are recomputed at every visit. Example: 480 packed
/// rows of ~780 tokens, 5 taps of width 576 in bf16: 480 × 780 × 2,880 × 2 B ≈ 2.2 GB.
pub struct FeatureCache {
    budget: usize,
    used: usize,
    hits: usize,
    rows: HashMap<usize, crate::loss::Features>,
}

impl FeatureCache {
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget: budget_bytes,
            used: 0,
            hits: 0,
            rows: HashMap::new(),
        }
    }

    /// Bytes held.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The features of row `key`: kept ones, or `compute()` (kept when they fit the budget).
    pub fn get(
        &mut self,
        key: usize,
        compute: impl FnOnce() -> Result<crate::loss::Features>,
    ) -> Result<crate::loss::Features> {
        if let Some(f) = self.rows.get(&key) {
            self.hits += 1;
            return Ok(f.clone());
        }
        let f = compute()?;
        let bytes = f.bytes();
        if self.used + bytes <= self.budget {
            self.used += bytes;
            self.rows.insert(key, f.clone());
        }
        Ok(f)
    }
}

/// The trainable drafter: named variables (sorted) and the drafter built on them.
pub struct TrainableDrafter {
    pub config: DrafterConfig,
    pub params: Vec<(String, Var)>,
    pub drafter: Drafter,
}

impl TrainableDrafter {
    /// f32 variables (f64 for an f64 target: gradient checks); the drafter computes in the
    /// target's dtype (bf16 on GPU), so the variables are the master weights.
    pub fn new(
        config: DrafterConfig,
        weights: &HashMap<String, Tensor>,
        t: &Target,
    ) -> Result<Self> {
        let master = dflash_model::layers::norm::compute_dtype(t.dtype);
        let mut names: Vec<&String> = weights.keys().collect();
        names.sort();
        let mut params = Vec::new();
        let mut map = HashMap::new();
        for n in names {
            let var = Var::from_tensor(&weights[n].to_dtype(master)?.to_device(&t.device)?)?;
            map.insert(n.clone(), var.as_tensor().clone());
            params.push((n.clone(), var));
        }
        let drafter = Drafter::load(
            config.clone(),
            &TensorStore::new(map, t.dtype, t.device.clone()),
            t,
        )?;
        Ok(Self {
            config,
            params,
            drafter,
        })
    }

    pub fn weights(&self) -> HashMap<String, Tensor> {
        self.params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// Add the gradients of `g` to `acc` (one slot per parameter, in `params` order; a slot
    /// stays `None` until some row gives that parameter a gradient).
    pub fn accumulate_grads(
        &self,
        acc: &mut [Option<Tensor>],
        g: &candle_core::backprop::GradStore,
    ) -> Result<()> {
        for (slot, (_, p)) in acc.iter_mut().zip(&self.params) {
            if let Some(gi) = g.get(p.as_tensor()) {
                *slot = Some(match slot.take() {
                    Some(a) => (a + gi)?,
                    None => gi.clone(),
                });
            }
        }
        Ok(())
    }

    /// After an optimizer step: when the drafter computes in another dtype than its master
    /// weights (bf16 on GPU), its weights are casts taken at build time, so cast them anew.
    /// (At the master dtype the drafter's tensors share storage with the variables.)
    pub fn refresh(&mut self, t: &Target) -> Result<()> {
        if self
            .params
            .first()
            .is_some_and(|(_, p)| p.dtype() != t.dtype)
        {
            let store = TensorStore::new(self.weights(), t.dtype, t.device.clone());
            self.drafter = Drafter::load(self.config.clone(), &store, t)?;
        }
        Ok(())
    }
}

/// One optimizer update from the summed gradients of a step's rows (a parameter without one
/// counts as 0): global-norm clipping, AdamW at `lr`, the compute-dtype copies refreshed.
/// Returns the gradient norm before clipping; a non-finite norm leaves the weights as they
/// were. The trainer and `bench-train` both update through here.
#[allow(clippy::too_many_arguments)]
pub fn apply_update(
    td: &mut TrainableDrafter,
    target: &Target,
    opt: &mut AdamW,
    grads: Vec<Option<Tensor>>,
    grad_clip: f64,
    lr: f64,
    ph: &mut Phases,
) -> Result<f64> {
    let mut grads: Vec<Tensor> = grads
        .into_iter()
        .zip(&td.params)
        .map(|(g, (_, p))| {
            g.map(Ok)
                .unwrap_or_else(|| Tensor::zeros(p.shape(), p.dtype(), p.device()))
        })
        .collect::<candle_core::Result<_>>()?;
    let grad_norm = clip_grad_norm(&mut grads, grad_clip)?;
    ph.mark("clip");
    if !grad_norm.is_finite() {
        return Ok(grad_norm);
    }
    opt.update(&td.params, &grads, lr)?;
    ph.mark("optimizer");
    td.refresh(target)?;
    ph.mark("refresh bf16 copies");
    Ok(grad_norm)
}

/// Sequences cut after their first loop (`loop_window`, [`crate::loops`]) and to
/// `max_length`, and the ones without two consecutive supervised tokens dropped (counted).
/// Returns (sequences, dropped, supervised tokens cut as loops).
pub fn usable_sequences(seqs: Vec<Sequence>, cfg: &TrainConfig) -> (Vec<Sequence>, usize, usize) {
    let (mut dropped, mut looped) = (0, 0);
    let kept = seqs
        .into_iter()
        .filter_map(|mut s| {
            if let Some(w) = cfg.loop_window {
                looped += crate::loops::cut_loop(&mut s, w);
            }
            s.ids.truncate(cfg.max_length);
            s.loss_mask.truncate(cfg.max_length);
            if anchors::candidates(&s.loss_mask).is_empty() {
                dropped += 1;
                None
            } else {
                Some(s)
            }
        })
        .collect();
    (kept, dropped, looped)
}

fn permutation(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    p.shuffle(&mut ChaCha8Rng::seed_from_u64(anchors::seed_for(
        seed,
        epoch,
        usize::MAX,
    )));
    p
}

/// One training row's objective: the clean target forward for its features (or the ones
/// `cache` kept for `key`), anchors drawn with `anchor_seed`, the block loss. Training and
/// validation both go through here.
#[allow(clippy::too_many_arguments)]
pub fn row_loss(
    td: &TrainableDrafter,
    lt: &LoadedTarget,
    cfg: &TrainConfig,
    row: &TrainingRow,
    anchor_seed: u64,
    cache: &mut FeatureCache,
    key: usize,
    ph: &mut Phases,
) -> Result<crate::loss::LossOutput> {
    let feats = cache.get(key, || {
        target_features(
            &lt.target,
            &td.drafter.target_layer_ids,
            row,
            cfg.loss == LossKind::Kl,
        )
    })?;
    ph.mark("target features");
    let a = anchors::sample(row.anchor_candidates(), cfg.num_anchors, anchor_seed);
    block_loss_profiled(
        &td.drafter,
        &lt.target,
        row,
        &feats,
        &a,
        cfg.block_size,
        cfg.gamma,
        cfg.loss,
        ph,
    )
}

/// Loss and acceptance on held-out sequences (fixed anchors).
pub fn evaluate(
    td: &TrainableDrafter,
    lt: &LoadedTarget,
    cfg: &TrainConfig,
    seqs: &[Sequence],
) -> Result<(f64, AcceptCounts)> {
    evaluate_cached(td, lt, cfg, seqs, &mut FeatureCache::new(0), 0)
}

/// [`evaluate`], with the features of `seqs[i]` in `cache` under key `key0 + i`.
pub fn evaluate_cached(
    td: &TrainableDrafter,
    lt: &LoadedTarget,
    cfg: &TrainConfig,
    seqs: &[Sequence],
    cache: &mut FeatureCache,
    key0: usize,
) -> Result<(f64, AcceptCounts)> {
    let mut counts = AcceptCounts::new(cfg.block_size - 1);
    let (mut num, mut den) = (0.0, 0.0);
    for (i, s) in seqs.iter().enumerate() {
        let out = row_loss(
            td,
            lt,
            cfg,
            &TrainingRow::single(s.clone()),
            anchors::seed_for(cfg.seed, usize::MAX - 1, i),
            cache,
            key0 + i,
            &mut Phases::with(false, &lt.target.device),
        )?;
        num += out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * out.weight_sum;
        den += out.weight_sum;
        counts.merge(&out.counts);
    }
    Ok((num / den.max(1e-12), counts))
}

/// The weights of an existing drafter directory, checked against the run's drafter config
/// (same shape, taps, block size and mask token), as f32.
fn init_weights_from(dir: &Path, dcfg: &DrafterConfig) -> Result<HashMap<String, Tensor>> {
    let text = std::fs::read_to_string(dir.join("config.json"))
        .with_context(|| format!("init_from: reading {}/config.json", dir.display()))?;
    let theirs: DrafterConfig = serde_json::from_str(&text).with_context(|| {
        format!(
            "init_from: {}/config.json is not a drafter config",
            dir.display()
        )
    })?;
    let same = theirs.hidden_size == dcfg.hidden_size
        && theirs.intermediate_size == dcfg.intermediate_size
        && theirs.num_hidden_layers == dcfg.num_hidden_layers
        && theirs.num_attention_heads == dcfg.num_attention_heads
        && theirs.num_kv_heads() == dcfg.num_kv_heads()
        && theirs.head_dim() == dcfg.head_dim()
        && theirs.block_size == dcfg.block_size
        && theirs.mask_token_id() == dcfg.mask_token_id()
        && theirs.resolve_target_layer_ids()?.0 == dcfg.resolve_target_layer_ids()?.0;
    if !same {
        bail!(
            "init_from: the drafter in {} has another shape, block size, mask token or taps than this run's config",
            dir.display()
        );
    }
    let w =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .with_context(|| format!("init_from: reading {}/model.safetensors", dir.display()))?;
    w.into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?)))
        .collect()
}

/// The lines of a run's `metrics.jsonl`.
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    crate::data::parse_jsonl(&text, path)
}

fn sha256_file(p: &Path) -> Result<String> {
    Ok(Sha256::digest(std::fs::read(p)?)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Train a drafter for `lt` on the shards in `data_dir`, writing into `out`.
pub fn train(
    lt: &LoadedTarget,
    data_dir: &Path,
    out: &Path,
    cfg: TrainConfig,
    resume: bool,
) -> Result<TrainSummary> {
    train_with_limits(lt, data_dir, out, cfg, resume, RunLimits::default())
}

/// [`train`], stopping early (with a checkpoint) at the limits of this invocation.
pub fn train_with_limits(
    lt: &LoadedTarget,
    data_dir: &Path,
    out: &Path,
    cfg: TrainConfig,
    resume: bool,
    limits: RunLimits,
) -> Result<TrainSummary> {
    let started = Instant::now();
    cfg.validate()?;
    let (manifest, seqs) = read_sequences(data_dir)?;
    let target_hash = identity_hash(&lt.source)?;
    if manifest.target_hash != target_hash {
        bail!(
            "the data in {} was generated by another target (hash {}…), not {} ({}…): regenerate it with this target",
            data_dir.display(),
            &manifest.target_hash[..12.min(manifest.target_hash.len())],
            lt.source.display(),
            &target_hash[..12]
        );
    }
    let supervised: usize = seqs.iter().map(Sequence::supervised).sum();
    let (seqs, dropped, looped) = usable_sequences(seqs, &cfg);
    if let Some(w) = cfg.loop_window {
        eprintln!(
            "loop_window {w}: {looped} of {supervised} supervised tokens cut as repetition loops ({:.0} %)",
            100.0 * looped as f64 / supervised.max(1) as f64
        );
    }
    if dropped > 0 {
        eprintln!(
            "note: {dropped} sequence(s) without two consecutive supervised tokens were skipped"
        );
    }
    if seqs.is_empty() {
        bail!("no usable sequence in {}: every sequence has fewer than 2 consecutive supervised tokens", data_dir.display());
    }
    let n_val = cfg.val_sequences.min(seqs.len() - 1);
    let (train_seqs, val_seqs) = seqs.split_at(seqs.len() - n_val);
    // training rows: packed once in a seeded order (their order is then shuffled per epoch)
    let train_rows: Vec<TrainingRow> = match cfg.pack_length {
        Some(len) => pack(
            train_seqs,
            &permutation(train_seqs.len(), cfg.seed, usize::MAX),
            len,
        ),
        None => train_seqs
            .iter()
            .cloned()
            .map(TrainingRow::single)
            .collect(),
    };
    if cfg.pack_length.is_some() {
        eprintln!(
            "packed {} training sequences into {} rows",
            train_seqs.len(),
            train_rows.len()
        );
    }
    let steps_per_epoch = train_rows.len().div_ceil(cfg.grad_accum);
    let total = cfg.max_steps.unwrap_or(cfg.epochs * steps_per_epoch);

    // the drafter
    let mask = match cfg.mask_token_id {
        Some(m) => m,
        None => default_mask_token(&lt.tokenizer)
            .context("the target has no unused special token: set mask_token_id")?,
    };
    let shape = DrafterShape {
        layers: cfg.num_draft_layers,
        block_size: cfg.block_size,
        mask_token_id: mask,
        intermediate_size: cfg.intermediate_size,
        target_layer_ids: cfg.target_layer_ids.clone(),
    };
    let dcfg = drafter_config(&lt.target, &shape)?;
    let paths = CheckpointPaths {
        out: out.to_path_buf(),
    };
    std::fs::create_dir_all(out)?;
    let cfg_path = out.join("train_config.json");
    let latest = if resume { paths.latest()? } else { None };
    if resume {
        let saved: TrainConfig = serde_json::from_str(
            &std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("--resume: {} not found", cfg_path.display()))?,
        )?;
        if saved != cfg {
            bail!(
                "--resume: the training config differs from {}",
                cfg_path.display()
            );
        }
        if latest.is_none() {
            bail!("--resume: {} has no checkpoint yet", out.display());
        }
    } else {
        if paths.latest()?.is_some() {
            bail!(
                "{} already holds a training run: pass --resume or choose a new --out",
                out.display()
            );
        }
        write_atomic(
            &cfg_path,
            (serde_json::to_string_pretty(&cfg)? + "\n").as_bytes(),
        )?;
    }
    let weights = match &latest {
        Some(dir) => candle_core::safetensors::load(
            dir.join("drafter/model.safetensors"),
            &lt.target.device,
        )?,
        None => match &cfg.init_from {
            Some(dir) => init_weights_from(Path::new(dir), &dcfg)?,
            None => random_weights(&dcfg, cfg.init_seed)?,
        },
    };
    let mut td = TrainableDrafter::new(dcfg.clone(), &weights, &lt.target)?;
    let names: Vec<String> = td.params.iter().map(|(n, _)| n.clone()).collect();
    let mut opt = AdamW::new(&td.params, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay)?;
    let mut state = TrainerState {
        steps_done: 0,
        epoch: 0,
        position: 0,
        adam_step: 0,
        best_val_loss: None,
    };
    if let Some(dir) = &latest {
        let (m, v, s) = read_trainer_state(&dir.join("trainer"), &names, &lt.target.device)?;
        opt.m = m;
        opt.v = v;
        opt.step = s.adam_step;
        state = s;
        eprintln!(
            "resuming from {} (step {})",
            dir.display(),
            state.steps_done
        );
    }
    // the metrics of steps after the checkpoint are recomputed: drop them
    let metrics_path = out.join("metrics.jsonl");
    let mut kept_lines = String::new();
    if let Ok(text) = std::fs::read_to_string(&metrics_path) {
        for l in text.lines() {
            if let Ok(m) = serde_json::from_str::<StepMetrics>(l) {
                if m.step <= state.steps_done && resume {
                    kept_lines.push_str(l);
                    kept_lines.push('\n');
                }
            }
        }
    }
    write_atomic(&metrics_path, kept_lines.as_bytes())?;
    let mut metrics_file = std::fs::OpenOptions::new()
        .append(true)
        .open(&metrics_path)?;

    let fp = fingerprint(lt, &td.drafter.target_layer_ids)?;
    let manifest_sha = sha256_file(&data_dir.join("manifest.json"))?;
    let mut pb = Progress::new(total, "train", "steps");
    pb.set_position(state.steps_done);
    let mut order = permutation(train_rows.len(), cfg.seed, state.epoch);
    let mut last: Option<StepMetrics> = None;
    let mut latest_ckpt = latest.clone();
    let t0 = Instant::now();
    let mut tokens_total = 0usize;
    let mut ph = Phases::new(&lt.target.device);
    // one budget: training rows under their index, validation sequences after them
    let mut cache = FeatureCache::new(limits.feature_cache_bytes);
    let mut cache_reported = false;
    while state.steps_done < total {
        // one optimizer step over grad_accum sequences
        let mut grads: Vec<Option<Tensor>> = vec![None; td.params.len()];
        let (mut loss_num, mut loss_den) = (0.0, 0.0);
        let mut counts = AcceptCounts::new(cfg.block_size - 1);
        let mut sup = 0;
        for _ in 0..cfg.grad_accum {
            if state.position >= order.len() {
                state.epoch += 1;
                state.position = 0;
                order = permutation(train_rows.len(), cfg.seed, state.epoch);
            }
            let si = order[state.position];
            state.position += 1;
            let row = &train_rows[si];
            let out = row_loss(
                &td,
                lt,
                &cfg,
                row,
                anchors::seed_for(cfg.seed, state.epoch, si),
                &mut cache,
                si,
                &mut ph,
            )?;
            let l = out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            ph.mark("loss to host");
            if !l.is_finite() {
                bail!(
                    "loss is {l} at step {}: stopping; the last good checkpoint is {}",
                    state.steps_done + 1,
                    latest_ckpt
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| "none (no checkpoint yet)".into())
                );
            }
            let g = (out.loss / cfg.grad_accum as f64)?.backward()?;
            ph.mark("backward");
            td.accumulate_grads(&mut grads, &g)?;
            ph.mark("accumulate grads");
            loss_num += l * out.weight_sum;
            loss_den += out.weight_sum;
            counts.merge(&out.counts);
            sup += row.seq.supervised();
        }
        let lr = cfg.lr_at(state.steps_done, total);
        let grad_norm = apply_update(
            &mut td,
            &lt.target,
            &mut opt,
            grads,
            cfg.grad_clip,
            lr,
            &mut ph,
        )?;
        if !grad_norm.is_finite() {
            bail!(
                "gradient norm is {grad_norm} at step {}: stopping",
                state.steps_done + 1
            );
        }
        state.steps_done += 1;
        state.adam_step = opt.step;
        if !cache_reported && state.position >= order.len() {
            cache_reported = true;
            eprintln!(
                "feature cache: {:.0} MB kept for {} rows of {} (budget {:.0} MB)",
                cache.used() as f64 / 1e6,
                cache.len(),
                train_rows.len() + val_seqs.len(),
                cache.budget as f64 / 1e6
            );
        }
        tokens_total += sup;
        let mut m = StepMetrics {
            step: state.steps_done,
            epoch: state.epoch,
            loss: loss_num / loss_den,
            lr,
            grad_norm,
            supervised_tokens: sup,
            acceptance: counts.rates(),
            simulated_tau: counts.simulated_tau(),
            simulated_decoding_tau: counts.simulated_decoding_tau(),
            tokens_per_sec: tokens_total as f64 / t0.elapsed().as_secs_f64(),
            val_loss: None,
            val_simulated_tau: None,
            val_simulated_decoding_tau: None,
        };
        let out_of_time =
            state.steps_done < total && limits.time_limit.is_some_and(|l| started.elapsed() >= l);
        let save = state.steps_done.is_multiple_of(cfg.save_every)
            || state.steps_done == total
            || out_of_time;
        // every checkpoint records its own validation (a time-limited stop or a save between
        // validation steps too), so that its training.json always has the numbers the doctor
        // compares with
        let mut val = None;
        if !val_seqs.is_empty() && (state.steps_done.is_multiple_of(cfg.val_every) || save) {
            ph.skip();
            let (vl, vc) = evaluate_cached(&td, lt, &cfg, val_seqs, &mut cache, train_rows.len())?;
            ph.mark("validation");
            m.val_loss = Some(vl);
            m.val_simulated_tau = Some(vc.simulated_tau());
            m.val_simulated_decoding_tau = Some(vc.simulated_decoding_tau());
            val = Some((vl, vc));
        }
        let line = serde_json::to_string(&m)? + "\n";
        use std::io::Write;
        metrics_file.write_all(line.as_bytes())?;
        metrics_file.flush()?;
        pb.inc(
            1,
            format!(
                "loss {:.4} sim-τ {:.2} {:.0} tok/s{}",
                m.loss,
                m.simulated_tau,
                m.tokens_per_sec,
                m.val_loss
                    .map(|v| format!(", val loss {v:.4}"))
                    .unwrap_or_default()
            ),
        );
        ph.skip();
        if save {
            let is_best = match (&val, state.best_val_loss) {
                (Some((vl, _)), Some(b)) => *vl < b,
                (Some(_), None) => true,
                _ => false,
            };
            if let Some((vl, _)) = &val {
                if is_best {
                    state.best_val_loss = Some(*vl);
                }
            }
            let rec = TrainingRecord {
                train_config: cfg.clone(),
                loss: cfg.loss,
                mask_token_id: mask,
                data_target_hash: manifest.target_hash.clone(),
                data_source: manifest.source.clone(),
                data_manifest_sha256: manifest_sha.clone(),
                steps: state.steps_done,
                train_loss: Some(m.loss),
                val_loss: val.as_ref().map(|v| v.0),
                val_acceptance: val.as_ref().map(|v| v.1.rates()).unwrap_or_default(),
                val_simulated_tau: val.as_ref().map(|v| v.1.simulated_tau()),
                fingerprint: fp.clone(),
            };
            let w = td.weights();
            let dir = paths.step_dir(state.steps_done);
            replace_dir(&dir, |tmp| {
                write_drafter_files(&tmp.join("drafter"), &dcfg, &w, &rec)?;
                write_trainer_state(&tmp.join("trainer"), &names, &opt.m, &opt.v, &state)
            })?;
            paths.set_latest(state.steps_done)?;
            if is_best {
                replace_dir(&out.join("best"), |tmp| {
                    write_drafter_files(tmp, &dcfg, &w, &rec)
                })?;
            }
            paths.prune(cfg.keep_last)?;
            latest_ckpt = Some(dir);
            write_atomic(
                &out.join("curves.svg"),
                crate::curves::svg(&read_metrics(&metrics_path)?).as_bytes(),
            )?;
            ph.mark("checkpoint");
        }
        last = Some(m);
        if out_of_time {
            pb.finish();
            if ph.enabled() {
                eprintln!("training, time per phase:\n{}", ph.report());
            }
            eprintln!(
                "time limit reached after step {}/{total}: checkpoint saved, continue with --resume",
                state.steps_done
            );
            return Ok(TrainSummary {
                steps: state.steps_done,
                last,
                latest_checkpoint: latest_ckpt,
                stopped_at_time_limit: true,
                feature_cache_hits: cache.hits,
            });
        }
    }
    pb.finish();
    if ph.enabled() {
        eprintln!("training, time per phase:\n{}", ph.report());
    }
    Ok(TrainSummary {
        steps: state.steps_done,
        last,
        latest_checkpoint: latest_ckpt,
        stopped_at_time_limit: false,
        feature_cache_hits: cache.hits,
    })
}
