//! Loading a drafter: its directory (config, weights, draft vocabulary), its weights checked
//! against the target it runs with.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use dflash_core::config::{Dflash2Params, DrafterConfig, TargetConfig};

use super::{DraftAttention, DraftLayer, Drafter};
use crate::io::weights::TensorStore;
use crate::layers::dynamic_conv::DynamicConv;
use crate::layers::linear::Linear;
use crate::layers::mlp::{load_linear, Mlp};
use crate::layers::norm::RmsNorm;
use crate::layers::rope::Rope;
use crate::models::draft_vocab::DraftVocab;
use crate::models::selector::CandidateSelector;
use crate::models::target::Target;

impl Drafter {
    /// Load a z-lab-format drafter directory (`config.json` + `model.safetensors`) for `target`.
    pub fn load_dir(dir: &Path, target: &Target) -> Result<Self> {
        Self::load_dir_as(dir, target, target.dtype)
    }

    /// [`Self::load_dir`] with the drafter's weights and compute in `dtype`, which may differ
    /// from the target's: the target's embeddings enter it cast to `dtype` and its LM head
    /// reads the drafter's rows in `dtype` ([`Self::logits`]; a draft vocabulary's head reads
    /// them in the target's dtype). Example: the doctor's f32 copy
    /// of a drafter beside a bf16 target, whose two forward paths must then agree to f32
    /// rounding. The head's weight is cast at every call (`vocab × h` values): a check's
    /// path, not a decoding one.
    pub fn load_dir_as(dir: &Path, target: &Target, dtype: DType) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("reading {}", cfg_path.display()))?;
        let config: DrafterConfig = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a DFlash drafter config", cfg_path.display()))?;
        let store =
            TensorStore::from_safetensors(&[dir.join("model.safetensors")], dtype, &target.device)?;
        let mut d = Self::load(config, &store, target)?;
        if let Some(v) = DraftVocab::read_dir(dir)? {
            v.validate(target.config.vocab_size).with_context(|| {
                format!("{}", dir.join(crate::models::draft_vocab::FILE).display())
            })?;
            d.notes.push(format!(
                "proposals from {} of the {} tokens ({})",
                v.token_ids.len(),
                target.config.vocab_size,
                crate::models::draft_vocab::FILE
            ));
            d.draft_vocab = Some(v);
        }
        Ok(d)
    }

    /// Build from a config and HF-named weights (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, …),
    /// checked against the target it will run with.
    pub fn load(config: DrafterConfig, store: &TensorStore, target: &Target) -> Result<Self> {
        config.validate().context("drafter config")?;
        fits_target(&config, &target.config)?;
        let (target_layer_ids, note) = config.resolve_target_layer_ids()?;
        let mut notes: Vec<String> = note.into_iter().collect();
        let (h, hd) = (config.hidden_size, config.head_dim());
        let eps = config.rms_norm_eps;
        let v2 = config.dflash2()?;
        let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm::new(store.get(name, &[dim])?, eps))
        };
        let layers = load_layers(&config, store, v2)?;
        let fc = Linear::new(
            store.get("fc.weight", &[h, target_layer_ids.len() * h])?,
            None,
        );
        let hidden_norm = norm("hidden_norm.weight", h)?;
        let final_norm = norm("norm.weight", h)?;
        let selector = v2
            .map(|p| {
                CandidateSelector::load(
                    store,
                    config.vocab_size,
                    h,
                    p.selector_rank,
                    p.selector_top_k,
                )
            })
            .transpose()?;
        let extra = store.unused();
        if !extra.is_empty() {
            bail!(
                "drafter checkpoint has tensors this drafter does not use: {}",
                extra.join(", ")
            );
        }
        if let Some(w) = config
            .sliding_window
            .filter(|_| layers.iter().any(|l| l.rule.sliding_window.is_some()))
        {
            notes.push(format!(
                "sliding-attention layers (window {w}){}, as z-lab 0.1.0",
                if config.is_causal() == Some(false) {
                    " are not causal in the block (is_causal: false)"
                } else {
                    " are causal in the block"
                }
            ));
        }
        Ok(Self {
            rope: Rope::new(hd, config.rope_theta()),
            mask_token_id: config.mask_token_id().expect("validated"),
            block_size: config.block_size,
            target_layer_ids,
            layers,
            norm: final_norm,
            fc,
            hidden_norm,
            notes,
            draft_vocab: None,
            selector,
            config,
        })
    }
}

/// Refuses a drafter whose hidden size, vocabulary or count of target layers differs from the
/// target's.
fn fits_target(config: &DrafterConfig, tc: &TargetConfig) -> Result<()> {
    if config.hidden_size != tc.hidden_size {
        bail!(
            "drafter hidden_size {} does not fit the target's hidden_size {}",
            config.hidden_size,
            tc.hidden_size
        );
    }
    if config.vocab_size != tc.vocab_size {
        bail!(
            "drafter vocab_size {} does not fit the target's vocab_size {}",
            config.vocab_size,
            tc.vocab_size
        );
    }
    if config.num_target_layers != tc.num_hidden_layers {
        bail!(
            "drafter num_target_layers {} does not fit the target's {} layers",
            config.num_target_layers,
            tc.num_hidden_layers
        );
    }
    Ok(())
}

/// The drafter's layers from HF-named weights (`layers.{i}.self_attn.q_proj.weight`, …), with
/// DFlash2's convs where `v2` gives their sizes.
fn load_layers(
    config: &DrafterConfig,
    store: &TensorStore,
    v2: Option<Dflash2Params>,
) -> Result<Vec<DraftLayer>> {
    let (h, nh, nkv, hd) = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_kv_heads(),
        config.head_dim(),
    );
    let eps = config.rms_norm_eps;
    let conv = |name: String| -> Result<Option<DynamicConv>> {
        v2.map(|p| DynamicConv::load(store, &name, h, p.conv_kernel_size, p.conv_group_size))
            .transpose()
    };
    let bias = config.attention_bias.unwrap_or(false);
    let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
        Ok(RmsNorm::new(store.get(name, &[dim])?, eps))
    };
    let mut layers = Vec::new();
    for i in 0..config.num_hidden_layers {
        let p = format!("layers.{i}");
        let a = format!("{p}.self_attn");
        layers.push(DraftLayer {
            input_layernorm: norm(&format!("{p}.input_layernorm.weight"), h)?,
            self_attn: DraftAttention {
                q_proj: load_linear(store, &format!("{a}.q_proj"), nh * hd, h, bias)?,
                k_proj: load_linear(store, &format!("{a}.k_proj"), nkv * hd, h, bias)?,
                v_proj: load_linear(store, &format!("{a}.v_proj"), nkv * hd, h, bias)?,
                o_proj: load_linear(store, &format!("{a}.o_proj"), h, nh * hd, bias)?,
                q_norm: norm(&format!("{a}.q_norm.weight"), hd)?,
                k_norm: norm(&format!("{a}.k_norm.weight"), hd)?,
                heads: nh,
                kv_heads: nkv,
                head_dim: hd,
            },
            post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            mlp: Mlp::load(store, &format!("{p}.mlp"), h, config.intermediate_size)?,
            rule: config.layer_rule(i),
            attention_conv: conv(format!("{p}.attention_conv"))?,
            mlp_conv: conv(format!("{p}.mlp_conv"))?,
        });
    }
    Ok(layers)
}
