//! The trainable drafter: its weights as variables (f32 masters), the drafter built on them,
//! gradient accumulation and the optimizer update.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use dflash_core::config::DrafterConfig;
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter::Drafter;
use dflash_model::Target;

use crate::collective::Collective;
use crate::optim::{clip_scale, AdamW};

/// The trainable drafter: named variables (sorted), the frozen weights, and the drafter built
/// on both.
pub struct TrainableDrafter {
    pub config: DrafterConfig,
    /// The master weights the optimizer updates and checkpoints save.
    pub params: Vec<(String, Var)>,
    /// When the drafter computes in another dtype than its masters (bf16 on a GPU): per
    /// parameter, the compute copy as a variable of its own, so that the backward ends there
    /// (a bf16 gradient, read as it is by the clip and AdamW: no cast of each weight's gradient
    /// and no f32 accumulation of it). Empty at the master dtype, where the drafter computes on
    /// the masters themselves. Refreshed from the masters after each update.
    compute: Vec<Var>,
    /// Weights that are not trained (`train_only`): constants, so no gradient is computed
    /// through them.
    pub frozen: HashMap<String, Tensor>,
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
        Self::training_only(config, weights, t, None)
    }

    /// [`Self::new`] with only the weights whose names start with one of `prefixes` trained
    /// (`None`: all of them). A prefix that names no weight is refused.
    pub fn training_only(
        config: DrafterConfig,
        weights: &HashMap<String, Tensor>,
        t: &Target,
        prefixes: Option<&[String]>,
    ) -> Result<Self> {
        let master = dflash_model::layers::norm::compute_dtype(t.dtype);
        let trained = |n: &str| prefixes.is_none_or(|ps| ps.iter().any(|p| n.starts_with(p)));
        if let Some(ps) = prefixes {
            if let Some(p) = ps
                .iter()
                .find(|p| !weights.keys().any(|n| n.starts_with(*p)))
            {
                bail!("train_only: no drafter weight starts with '{p}'");
            }
        }
        let mut names: Vec<&String> = weights.keys().collect();
        names.sort();
        let mut params = Vec::new();
        let mut compute = Vec::new();
        let mut frozen = HashMap::new();
        let mut map = HashMap::new();
        for n in names {
            let w = weights[n].to_dtype(master)?.to_device(&t.device)?;
            if trained(n) {
                let var = Var::from_tensor(&w)?;
                if master == t.dtype {
                    map.insert(n.clone(), var.as_tensor().clone());
                } else {
                    let c = Var::from_tensor(&w.to_dtype(t.dtype)?)?;
                    map.insert(n.clone(), c.as_tensor().clone());
                    compute.push(c);
                }
                params.push((n.clone(), var));
            } else {
                map.insert(n.clone(), w.clone());
                frozen.insert(n.clone(), w);
            }
        }
        let drafter = Drafter::load(
            config.clone(),
            &TensorStore::new(map, t.dtype, t.device.clone()),
            t,
        )?;
        Ok(Self {
            config,
            params,
            compute,
            frozen,
            drafter,
        })
    }

    /// Each parameter's gradient in `g` (in `params` order): the compute copy's when there is
    /// one (bf16 on a GPU), else the master's.
    pub fn grads_of(&self, g: &candle_core::backprop::GradStore) -> Vec<Option<Tensor>> {
        (0..self.params.len()).map(|i| self.grad_of(g, i)).collect()
    }

    /// Parameter `i`'s gradient in `g` (as [`TrainableDrafter::grads_of`]).
    pub fn grad_of(&self, g: &candle_core::backprop::GradStore, i: usize) -> Option<Tensor> {
        let v = self.compute.get(i).unwrap_or(&self.params[i].1);
        g.get(v.as_tensor()).cloned()
    }

    /// Every weight, trained and frozen.
    pub fn weights(&self) -> HashMap<String, Tensor> {
        let mut w = self.frozen.clone();
        w.extend(
            self.params
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().clone())),
        );
        w
    }

    /// After an optimizer step: when the drafter computes in another dtype than its master
    /// weights (bf16 on GPU), the compute copies are written from the masters in place (unless
    /// `written`: the optimizer's kernel already wrote them, on a GPU) and the drafter is built
    /// on them again. (At the master dtype the drafter's tensors share storage with the
    /// variables.)
    fn refresh(&mut self, t: &Target, written: bool) -> Result<()> {
        if self.compute.is_empty() {
            return Ok(());
        }
        let mut map = self.frozen.clone();
        for ((n, p), c) in self.params.iter().zip(&self.compute) {
            if !written {
                c.set(&p.as_tensor().to_dtype(c.dtype())?)?;
            }
            map.insert(n.clone(), c.as_tensor().clone());
        }
        let store = TensorStore::new(map, t.dtype, t.device.clone());
        self.drafter = Drafter::load(self.config.clone(), &store, t)?;
        Ok(())
    }

    /// One optimizer update from the summed gradients of a step's rows (a parameter without
    /// one counts as 0): global-norm clipping at `grad_clip`, AdamW at `lr`, the compute-dtype
    /// copies refreshed; with a sharded optimizer each rank updates its own parameters and
    /// takes the others' from their owners through `comm`. Returns the gradient norm before
    /// clipping; a non-finite norm leaves the weights as they were. The trainer and `bench
    /// train` both update through here.
    pub fn update(
        &mut self,
        target: &Target,
        opt: &mut AdamW,
        grads: Vec<Option<Tensor>>,
        grad_clip: f64,
        lr: f64,
        comm: &dyn Collective,
    ) -> Result<f64> {
        let grads: Vec<Tensor> = grads
            .into_iter()
            .zip(&self.params)
            .map(|(g, (_, p))| {
                g.map(Ok)
                    .unwrap_or_else(|| Tensor::zeros(p.shape(), p.dtype(), p.device()))
            })
            .collect::<candle_core::Result<_>>()?;
        let (grad_norm, scale) = {
            let _p = tracing::info_span!(target: "phase", "clip").entered();
            clip_scale(&grads, grad_clip)?
        };
        if !grad_norm.is_finite() {
            return Ok(grad_norm);
        }
        let written = {
            // the clip's factor is applied inside the update (no pass of its own), and the
            // compute copies written there too where the device does that
            let _p = tracing::info_span!(target: "phase", "optimizer").entered();
            opt.update_with_copies(&self.params, &grads, lr, scale, &self.compute)?
        };
        if let Some(shards) = opt.shards() {
            // the other ranks' parameters, as their owners updated them
            let _p = tracing::info_span!(target: "phase", "optimizer shards").entered();
            crate::shard::sync_weights(&self.params, shards, comm)?;
        }
        let _p = tracing::info_span!(target: "phase", "refresh bf16 copies").entered();
        self.refresh(target, written)?;
        Ok(grad_norm)
    }
}

/// The weights of an existing drafter directory, checked against the run's drafter config
/// (same shape, taps, block size and mask token), as f32. For a DFlash2 run from a DFlash
/// drafter, the weights DFlash2 adds come from `fresh` (the run's seeded init: identity convs,
/// a new selector).
pub(super) fn init_weights_from(
    dir: &Path,
    dcfg: &DrafterConfig,
    fresh: HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
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
    if theirs.is_dflash2() && !dcfg.is_dflash2() {
        bail!(
            "init_from: the drafter in {} is a DFlash2 drafter; set dflash2 in the training config",
            dir.display()
        );
    }
    if theirs.is_dflash2() && theirs.dflash2()? != dcfg.dflash2()? {
        bail!(
            "init_from: the DFlash2 drafter in {} has other conv or selector sizes than this run's config",
            dir.display()
        );
    }
    let w =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .with_context(|| format!("init_from: reading {}/model.safetensors", dir.display()))?;
    let mut w: HashMap<String, Tensor> = w
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?)))
        .collect::<Result<_>>()?;
    if dcfg.is_dflash2() && !theirs.is_dflash2() {
        for (n, t) in fresh {
            w.entry(n).or_insert(t);
        }
    }
    Ok(w)
}
