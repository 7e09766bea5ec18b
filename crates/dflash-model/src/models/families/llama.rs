//! `llama` (SmolLM2): no biases unless `attention_bias`, no q/k norm. GGUFs of this
//! architecture have their Q/K rows permuted for interleaved RoPE: [`crate::io::gguf`] undoes it.

use super::FamilySpec;
use dflash_core::config::TargetConfig;

pub fn spec(config: &TargetConfig) -> FamilySpec {
    FamilySpec {
        name: "llama",
        qkv_bias: config.attention_bias.unwrap_or(false),
        qk_norm: false,
        gated_q: false,
        zero_centred_norm: false,
    }
}
