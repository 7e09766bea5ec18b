//! [`TargetConfig`]: the config of a dense or hybrid decoder-only target, its derived sizes
//! and its shape checks.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::common::{
    check_rope_scaling, default_eps, default_max_pos, rope_theta_of, RopeParameters, TokenIds,
};
use crate::CoreError;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
