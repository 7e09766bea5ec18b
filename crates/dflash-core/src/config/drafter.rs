//! [`DrafterConfig`]: z-lab's drafter config.json, its tap ids in our convention, its layer
//! rules and its checks.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::common::{
    check_rope_scaling, default_eps, default_max_pos, rope_theta_of, RopeParameters,
};
use crate::taps::default_target_layer_ids;
use crate::visibility::DraftRule;
use crate::CoreError;

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
    use crate::config::DFLASH2_ARCH;

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
