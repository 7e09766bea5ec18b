//! `qwen3`: per-head RMSNorm on q and k (`q_norm`, `k_norm`, weight `[head_dim]`) before
//! RoPE; no biases unless `attention_bias`; explicit `head_dim`.

use super::FamilySpec;
use dflash_core::config::TargetConfig;

pub fn spec(config: &TargetConfig) -> FamilySpec {
    FamilySpec {
        name: "qwen3",
        qkv_bias: config.attention_bias.unwrap_or(false),
        qk_norm: true,
        gated_q: false,
        zero_centred_norm: false,
    }
}
