//! Serde mirrors of HF `config.json` files, field for field.
//!
//! [`TargetConfig`] mirrors the config of a transformers causal LM (`LlamaForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`); [`DrafterConfig`] mirrors z-lab's
//! `DFlashDraftModel` config (a Qwen3 config plus `block_size`, `num_target_layers` and
//! `dflash_config`; z-lab's `DFlash2DraftModel` adds conv and selector sizes there, see
//! [`Dflash2Params`]). Unknown fields are kept in `extra` so a config round-trips.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::taps::default_target_layer_ids;
use crate::visibility::DraftRule;
use crate::CoreError;

/// `rope_parameters` as transformers 5 writes it (`rope_theta` moved in here).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RopeParameters {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_type: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A token id field that may be a single id or a list (`eos_token_id: [1, 2]`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(t) => vec![*t],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// The config of a dense decoder-only target (llama / qwen2 / qwen3).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TargetConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Value>,
    pub vocab_size: usize,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<TokenIds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    /// Hybrid models (qwen3_5): `linear_attention` or `full_attention` per layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_attention_interval: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_conv_kernel_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_key_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_value_head_dim: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_num_key_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_num_value_heads: Option<usize>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    32768
}

/// RoPE theta from `rope_theta` or `rope_parameters.rope_theta`; 10000 when neither is set.
fn rope_theta_of(rope_theta: Option<f64>, params: &Option<RopeParameters>) -> f64 {
    rope_theta
        .or_else(|| params.as_ref().and_then(|p| p.rope_theta))
        .unwrap_or(10_000.0)
}

/// Rejects RoPE scaling we do not implement instead of silently computing something else.
fn check_rope_scaling(
    scaling: &Option<Value>,
    params: &Option<RopeParameters>,
) -> Result<(), CoreError> {
    let kind = scaling
        .as_ref()
        .and_then(|v| v.get("rope_type").or_else(|| v.get("type")))
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .or_else(|| params.as_ref().and_then(|p| p.rope_type.clone()));
    match kind.as_deref() {
        None | Some("default") => Ok(()),
        Some(other) => Err(CoreError::Config(format!(
            "rope scaling type '{other}' is not supported (only plain RoPE)"
        ))),
    }
}

/// The most layers a target config may declare ([`TargetConfig::validate`]).
pub const MAX_LAYERS: usize = 1 << 12;
/// The widest hidden, intermediate or head count a target config may declare.
pub const MAX_WIDTH: usize = 1 << 20;
/// The largest vocabulary a target config may declare.
pub const MAX_VOCAB: usize = 1 << 24;

impl TargetConfig {
    /// Parameters one forward reads: every layer's attention and MLP matrices and norms, the
    /// final norm and the LM head (the embedding only row by row: not counted). The memory
    /// floor of a forward is this × bytes per parameter / bandwidth. Softmax-attention layers
    /// are assumed (a hybrid's linear-attention layers are counted as attention layers).
    pub fn forward_weight_params(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (nh, nkv, hd) = (
            self.num_attention_heads,
            self.num_kv_heads(),
            self.head_dim(),
        );
        let per_layer = 2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * i + 2 * h;
        self.num_hidden_layers * per_layer + v * h + h
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }
    pub fn rope_theta(&self) -> f64 {
        rope_theta_of(self.rope_theta, &self.rope_parameters)
    }
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// Qwen3.5-style hybrid (Gated DeltaNet + gated attention).
    pub fn is_qwen3_5(&self) -> bool {
        self.model_type == "qwen3_5" || self.model_type == "qwen3_5_text"
    }

    /// The fraction of head_dim that RoPE rotates. transformers reads
    /// `rope_parameters.partial_rotary_factor` and only then the top-level field (transformers
    /// 5.17 writes a top-level 0.25 beside a different `rope_parameters` value: the latter
    /// wins); the default is 0.25 for qwen3_5 and 1 elsewhere.
    pub fn rotary_fraction(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.extra.get("partial_rotary_factor"))
            .and_then(|v| v.as_f64())
            .or(self.partial_rotary_factor)
            .unwrap_or(if self.is_qwen3_5() { 0.25 } else { 1.0 })
    }

    /// Layer kinds: `layer_types`, or for qwen3_5 every `full_attention_interval`-th layer
    /// (default 4) full attention and the rest linear attention; otherwise all full attention.
    /// Example: 8 layers, interval 4 → linear ×3, full, linear ×3, full.
    pub fn resolved_layer_types(&self) -> Vec<String> {
        if let Some(t) = &self.layer_types {
            return t.clone();
        }
        let every = if self.is_qwen3_5() {
            self.full_attention_interval.unwrap_or(4)
        } else {
            1
        };
        (0..self.num_hidden_layers)
            .map(|i| {
                if (i + 1) % every == 0 {
                    "full_attention"
                } else {
                    "linear_attention"
                }
                .to_string()
            })
            .collect()
    }

    /// Shape checks that every family shares.
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |m: String| Err(CoreError::Config(m));
        if self.hidden_size == 0 || self.num_hidden_layers == 0 || self.vocab_size == 0 {
            return bad("hidden_size, num_hidden_layers and vocab_size must be > 0".into());
        }
        // a damaged or hostile config.json must not size the buffers built from it: these are
        // far beyond every model of this family, and the weights are checked against them later
        for (name, v, most) in [
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("num_attention_heads", self.num_attention_heads, MAX_WIDTH),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
        ] {
            if v > most {
                return bad(format!(
                    "{name} {v} is larger than any model's (at most {most})"
                ));
            }
        }
        if self.num_attention_heads == 0 || self.num_kv_heads() == 0 {
            return bad("num_attention_heads and num_key_value_heads must be > 0".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return bad(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim()
            ));
        }
        let types = self.resolved_layer_types();
        if types.len() != self.num_hidden_layers {
            return bad(format!(
                "layer_types has {} entries for {} layers",
                types.len(),
                self.num_hidden_layers
            ));
        }
        if let Some(t) = types
            .iter()
            .find(|t| *t != "full_attention" && *t != "linear_attention")
        {
            return bad(format!("unknown layer type '{t}'"));
        }
        if types.iter().any(|t| t == "linear_attention") {
            let need = [
                ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
                ("linear_key_head_dim", self.linear_key_head_dim),
                ("linear_value_head_dim", self.linear_value_head_dim),
                ("linear_num_key_heads", self.linear_num_key_heads),
                ("linear_num_value_heads", self.linear_num_value_heads),
            ];
            if let Some((n, _)) = need.iter().find(|(_, v)| v.is_none_or(|x| x == 0)) {
                return bad(format!("linear_attention layers need {n} > 0"));
            }
            let (hk, hv) = (
                self.linear_num_key_heads.unwrap(),
                self.linear_num_value_heads.unwrap(),
            );
            if hv % hk != 0 {
                return bad(format!("linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})"));
            }
        }
        check_rope_scaling(&self.rope_scaling, &self.rope_parameters)
    }
}

/// `dflash_config` inside a drafter's config.json.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DFlashSection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_layer_ids: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_token_id: Option<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// z-lab's `DFlashDraftModel` config.json.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DrafterConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default = "qwen3")]
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Value>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    #[serde(default = "default_block")]
    pub block_size: usize,
    pub num_target_layers: usize,
    #[serde(default)]
    pub dflash_config: DFlashSection,
    pub vocab_size: usize,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn qwen3() -> String {
    "qwen3".into()
}
fn default_block() -> usize {
    16
}

/// `architectures` entry of z-lab's DFlash2 drafters.
pub const DFLASH2_ARCH: &str = "DFlash2DraftModel";

/// DFlash2's extra sizes (`dflash_config`): per layer two grouped dynamic causal convs of
/// `conv_kernel_size` taps whose dynamic taps are shared by `conv_group_size` channels, and a
/// candidate selector rescoring the top `selector_top_k` logits with rank-`selector_rank`
/// codebooks. The published drafters: K = 2, groups of 16, rank 256, top 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dflash2Params {
    pub conv_kernel_size: usize,
    pub conv_group_size: usize,
    pub selector_rank: usize,
    pub selector_top_k: usize,
}

/// Names of vLLM/EAGLE's "+1 auxiliary layer" tap field (tap i there = our tap i-1).
pub const AUX_TAP_FIELD: &str = "eagle_aux_hidden_state_layer_ids";

impl DrafterConfig {
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }
    pub fn rope_theta(&self) -> f64 {
        rope_theta_of(self.rope_theta, &self.rope_parameters)
    }
    pub fn mask_token_id(&self) -> Option<u32> {
        self.dflash_config.mask_token_id.or_else(|| {
            self.extra
                .get("mask_token_id")
                .and_then(|v| v.as_u64())
                .map(|v| v as u32)
        })
    }

    /// The tap ids in our convention (tap i = output of target layer i), with a note when
    /// they had to be derived or converted. Resolution order:
    /// 1. `dflash_config.target_layer_ids` (or a top-level `target_layer_ids`), as is;
    /// 2. vLLM's `eagle_aux_hidden_state_layer_ids` (output of layer i is aux id i+1): minus one;
    /// 3. z-lab's default (see [`default_target_layer_ids`]).
    ///
    /// When both 1 and 2 are present they must agree after conversion.
    pub fn resolve_target_layer_ids(&self) -> Result<(Vec<usize>, Option<String>), CoreError> {
        let top = self
            .extra
            .get("target_layer_ids")
            .and_then(|v| serde_json::from_value::<Vec<usize>>(v.clone()).ok());
        let ours = self.dflash_config.target_layer_ids.clone().or(top);
        let aux = self
            .dflash_config
            .extra
            .get(AUX_TAP_FIELD)
            .or_else(|| self.extra.get(AUX_TAP_FIELD))
            .map(|v| serde_json::from_value::<Vec<usize>>(v.clone()))
            .transpose()
            .map_err(|e| CoreError::Config(format!("{AUX_TAP_FIELD}: {e}")))?;
        let aux_converted = match &aux {
            Some(ids) => Some(
                ids.iter()
                    .map(|&i| {
                        i.checked_sub(1).ok_or_else(|| {
                            CoreError::Config(format!(
                                "{AUX_TAP_FIELD} contains 0, which names the embedding output"
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };
        match (ours, aux_converted) {
            (Some(o), Some(a)) if o != a => Err(CoreError::Config(format!(
                "target_layer_ids {o:?} disagree with {AUX_TAP_FIELD} {:?} (= layer outputs {a:?})",
                aux.unwrap()
            ))),
            (Some(o), Some(_)) => Ok((o, Some(format!("{AUX_TAP_FIELD} present and consistent with target_layer_ids")))),
            (Some(o), None) => Ok((o, None)),
            (None, Some(a)) => Ok((
                a.clone(),
                Some(format!(
                    "converted {AUX_TAP_FIELD} {:?} (+1 auxiliary convention) to layer outputs {a:?}",
                    aux.unwrap()
                )),
            )),
            (None, None) => Ok((
                default_target_layer_ids(self.num_target_layers, self.num_hidden_layers),
                Some("target_layer_ids absent: using z-lab's default".into()),
            )),
        }
    }

    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |m: String| Err(CoreError::Config(m));
        if self.block_size < 2 {
            return bad(format!("block_size must be >= 2, got {}", self.block_size));
        }
        if self.num_attention_heads == 0
            || !self.num_attention_heads.is_multiple_of(self.num_kv_heads())
        {
            return bad(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        match self.mask_token_id() {
            None => return bad("dflash_config.mask_token_id is missing".into()),
            Some(m) if m as usize >= self.vocab_size => {
                return bad(format!(
                    "mask_token_id {m} is outside the vocabulary ({})",
                    self.vocab_size
                ))
            }
            _ => {}
        }
        if let Some(lt) = &self.layer_types {
            if lt.len() != self.num_hidden_layers {
                return bad(format!(
                    "layer_types has {} entries for {} layers",
                    lt.len(),
                    self.num_hidden_layers
                ));
            }
            for t in lt {
                if t != "full_attention" && t != "sliding_attention" {
                    return bad(format!("unknown layer type '{t}'"));
                }
                if t == "sliding_attention" && self.sliding_window.is_none() {
                    return bad("a sliding_attention layer needs sliding_window".into());
                }
            }
        }
        check_rope_scaling(&self.rope_scaling, &self.rope_parameters)?;
        self.dflash2()?;
        let (ids, _) = self.resolve_target_layer_ids()?;
        if ids.is_empty() {
            return bad("target_layer_ids is empty".into());
        }
        if let Some(&bad_id) = ids.iter().find(|&&i| i >= self.num_target_layers) {
            return bad(format!(
                "tap id {bad_id} is out of range for num_target_layers = {}",
                self.num_target_layers
            ));
        }
        Ok(())
    }

    /// Sliding window of draft layer `i`, if that layer is a sliding-attention layer.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        match &self.layer_types {
            Some(t) if t[i] == "sliding_attention" => self.sliding_window,
            _ => None,
        }
    }

    /// The top-level `is_causal` (z-lab reads it there only; absent: a sliding layer is
    /// causal in the block and a full layer is not).
    pub fn is_causal(&self) -> Option<bool> {
        self.extra.get("is_causal").and_then(|v| v.as_bool())
    }

    /// Which keys draft layer `i` sees: its window and causality as z-lab 0.1.0 sets them.
    /// Example: the published DFlash2 drafters (`is_causal: false`, every layer sliding with
    /// W = 2048) → `DraftRule { sliding_window: Some(2048), causal: false }`.
    pub fn layer_rule(&self, i: usize) -> DraftRule {
        let window = self.layer_window(i);
        DraftRule {
            sliding_window: window,
            causal: self.is_causal().unwrap_or(window.is_some()),
        }
    }

    /// True for z-lab's `DFlash2DraftModel` (`architectures`).
    pub fn is_dflash2(&self) -> bool {
        self.architectures.iter().any(|a| a == DFLASH2_ARCH)
    }

    /// A DFlash2 drafter's conv and selector sizes (`dflash_config` first, then the top level,
    /// as z-lab reads them); `None` for a DFlash drafter.
    pub fn dflash2(&self) -> Result<Option<Dflash2Params>, CoreError> {
        if !self.is_dflash2() {
            return Ok(None);
        }
        let get = |name: &str| -> Result<usize, CoreError> {
            let v = self
                .dflash_config
                .extra
                .get(name)
                .or_else(|| self.extra.get(name));
            match v.and_then(|v| v.as_u64()) {
                Some(x) if x > 0 => Ok(x as usize),
                Some(_) => Err(CoreError::Config(format!("{name} must be >= 1"))),
                None => Err(CoreError::Config(format!(
                    "{DFLASH2_ARCH} needs dflash_config.{name} (a positive integer)"
                ))),
            }
        };
        let p = Dflash2Params {
            conv_kernel_size: get("conv_kernel_size")?,
            conv_group_size: get("conv_group_size")?,
            selector_rank: get("selector_rank")?,
            selector_top_k: get("selector_top_k")?,
        };
        if !self.hidden_size.is_multiple_of(p.conv_group_size) {
            return Err(CoreError::Config(format!(
                "conv_group_size {} does not divide hidden_size {}",
                p.conv_group_size, self.hidden_size
            )));
        }
        if p.selector_top_k > self.vocab_size {
            return Err(CoreError::Config(format!(
                "selector_top_k {} exceeds the vocabulary ({})",
                p.selector_top_k, self.vocab_size
            )));
        }
        Ok(Some(p))
    }

    /// z-lab scales the noise embedding by `dflash_config.input_embedding_scale` (default 1).
    pub fn input_embedding_scale(&self) -> f64 {
        self.dflash_value("input_embedding_scale").unwrap_or(1.0)
    }
    /// z-lab multiplies draft logits by `output_multiplier` (default 1).
    pub fn output_multiplier(&self) -> f64 {
        self.dflash_value("output_multiplier").unwrap_or(1.0)
    }
    /// z-lab soft-caps draft logits when `final_logit_softcapping` > 0.
    pub fn final_logit_softcapping(&self) -> Option<f64> {
        self.dflash_value("final_logit_softcapping")
            .filter(|v| *v > 0.0)
    }
    fn dflash_value(&self, name: &str) -> Option<f64> {
        self.dflash_config
            .extra
            .get(name)
            .or_else(|| self.extra.get(name))
            .and_then(|v| v.as_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafter_json(extra: &str) -> String {
        format!(
            r#"{{"architectures":["DFlashDraftModel"],"model_type":"qwen3","hidden_size":64,
            "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "head_dim":16,"rms_norm_eps":1e-6,"rope_parameters":{{"rope_theta":1000000.0,"rope_type":"default"}},
            "max_position_embeddings":4096,"block_size":16,"num_target_layers":30,"vocab_size":100{extra}}}"#
        )
    }

    #[test]
    fn rope_theta_from_rope_parameters() {
        let c: DrafterConfig =
            serde_json::from_str(&drafter_json(r#","dflash_config":{"mask_token_id":5}"#)).unwrap();
        assert_eq!(c.rope_theta(), 1_000_000.0);
        c.validate().unwrap();
    }

    #[test]
    fn rope_parameters_partial_factor_wins_over_the_top_level_one() {
        let c: TargetConfig = serde_json::from_str(
            r#"{"model_type":"qwen3_5_text","hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":1,"vocab_size":4,"partial_rotary_factor":0.25,
            "rope_parameters":{"partial_rotary_factor":0.5,"rope_theta":10000.0,"rope_type":"default"}}"#,
        )
        .unwrap();
        assert_eq!(c.rotary_fraction(), 0.5);
        let mut d = c.clone();
        d.rope_parameters = None;
        assert_eq!(d.rotary_fraction(), 0.25);
    }

    /// A declared size beyond any model is refused by name before anything is sized by it.
    #[test]
    fn sizes_beyond_any_model_are_refused() {
        let c: TargetConfig = serde_json::from_str(
            r#"{"model_type":"llama","hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":1,"vocab_size":4}"#,
        )
        .unwrap();
        c.validate().unwrap();
        let mut d = c.clone();
        d.num_hidden_layers = 16_777_217;
        let e = d.validate().unwrap_err().to_string();
        assert!(e.contains("num_hidden_layers 16777217"), "{e}");
        let mut d = c.clone();
        d.vocab_size = MAX_VOCAB + 1;
        assert!(d.validate().unwrap_err().to_string().contains("vocab_size"));
    }

    #[test]
    fn aux_tap_ids_are_converted_and_said() {
        let c: DrafterConfig = serde_json::from_str(&drafter_json(
            r#","dflash_config":{"mask_token_id":5,"eagle_aux_hidden_state_layer_ids":[2,9]}"#,
        ))
        .unwrap();
        let (ids, note) = c.resolve_target_layer_ids().unwrap();
        assert_eq!(ids, vec![1, 8]);
        assert!(note.unwrap().contains("converted"));
    }

    #[test]
    fn inconsistent_tap_fields_are_rejected() {
        let c: DrafterConfig = serde_json::from_str(&drafter_json(
            r#","dflash_config":{"mask_token_id":5,"target_layer_ids":[2,9],"eagle_aux_hidden_state_layer_ids":[2,9]}"#,
        ))
        .unwrap();
        assert!(c
            .resolve_target_layer_ids()
            .unwrap_err()
            .to_string()
            .contains("disagree"));
    }

    #[test]
    fn bad_drafter_fields_are_named() {
        let mask_big: DrafterConfig =
            serde_json::from_str(&drafter_json(r#","dflash_config":{"mask_token_id":100}"#))
                .unwrap();
        assert!(mask_big
            .validate()
            .unwrap_err()
            .to_string()
            .contains("mask_token_id"));
        let tap_big: DrafterConfig = serde_json::from_str(&drafter_json(
            r#","dflash_config":{"mask_token_id":1,"target_layer_ids":[1,30]}"#,
        ))
        .unwrap();
        assert!(tap_big
            .validate()
            .unwrap_err()
            .to_string()
            .contains("tap id 30"));
        let mut small_block = mask_big.clone();
        small_block.dflash_config.mask_token_id = Some(1);
        small_block.block_size = 1;
        assert!(small_block
            .validate()
            .unwrap_err()
            .to_string()
            .contains("block_size"));
    }

    #[test]
    fn dflash2_sizes_and_layer_rules() {
        let mut c: DrafterConfig = serde_json::from_str(&drafter_json(
            r#","is_causal":false,"layer_types":["sliding_attention","full_attention"],
            "sliding_window":4,"dflash_config":{"mask_token_id":5,"conv_kernel_size":2,"conv_group_size":16,
            "selector_rank":8,"selector_top_k":4}"#,
        ))
        .unwrap();
        assert!(
            c.dflash2().unwrap().is_none(),
            "a DFlash drafter has no DFlash2 sizes"
        );
        c.architectures = vec![DFLASH2_ARCH.into()];
        c.validate().unwrap();
        let p = c.dflash2().unwrap().unwrap();
        assert_eq!(
            (
                p.conv_kernel_size,
                p.conv_group_size,
                p.selector_rank,
                p.selector_top_k
            ),
            (2, 16, 8, 4)
        );
        assert_eq!(
            c.layer_rule(0),
            DraftRule {
                sliding_window: Some(4),
                causal: false
            }
        );
        assert_eq!(
            c.layer_rule(1),
            DraftRule {
                sliding_window: None,
                causal: false
            }
        );
        let mut d = c.clone();
        d.extra.remove("is_causal");
        assert_eq!(d.layer_rule(0), DraftRule::for_layer(Some(4)));
        d.extra.insert("is_causal".into(), Value::Bool(true));
        assert_eq!(
            d.layer_rule(1),
            DraftRule {
                sliding_window: None,
                causal: true
            }
        );
        let mut bad = c.clone();
        bad.dflash_config.extra.remove("selector_rank");
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("selector_rank"));
        bad = c.clone();
        bad.dflash_config
            .extra
            .insert("conv_group_size".into(), 7.into());
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("does not divide"));
    }
}
