//! `qwen3_5` (Qwen3.5 / Qwen3.6 text models, hybrid): layers are `linear_attention` (Gated
//! DeltaNet, [`crate::layers::gdn`]) or `full_attention` (every `full_attention_interval`-th layer);
//! full attention has a gated query (`q_proj` yields query and gate per head, output ×
//! sigmoid(gate)), per-head q/k norms and partial RoPE (`partial_rotary_factor`, first part
//! of head_dim only; for text the multimodal RoPE reduces to plain positions); block norms,
//! q/k norms and the final norm are zero-centred (`norm(x) · (1 + w)`).

use super::FamilySpec;
use dflash_core::config::TargetConfig;

pub fn spec(config: &TargetConfig) -> FamilySpec {
    FamilySpec {
        name: "qwen3_5",
        qkv_bias: config.attention_bias.unwrap_or(false),
        qk_norm: true,
        gated_q: true,
        zero_centred_norm: true,
    }
}
