//! `qwen2` (Qwen2.5): q/k/v projections have biases, o_proj has none; half-split RoPE in GGUF too.

use super::FamilySpec;
use dflash_core::config::TargetConfig;

pub fn spec(_config: &TargetConfig) -> FamilySpec {
    FamilySpec {
        name: "qwen2",
        qkv_bias: true,
        qk_norm: false,
        gated_q: false,
        zero_centred_norm: false,
    }
}
