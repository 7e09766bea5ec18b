//! Target families. Each file says how its config.json and GGUF differ from the shared
//! dense decoder in [`crate::models::target`]; the decoder reads only the resulting [`FamilySpec`].

pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_5;

use anyhow::{bail, Result};
use dflash_core::config::TargetConfig;

/// The architectural switches of a dense decoder family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FamilySpec {
    pub name: &'static str,
    /// q/k/v projections carry biases (qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (qwen3).
    pub qk_norm: bool,
    /// `q_proj` yields query and gate per head; attention output × sigmoid(gate) (qwen3_5).
    pub gated_q: bool,
    /// Norm weights are zero-centred: `norm(x) · (1 + w)` (qwen3_5; not the GDN gated norm).
    pub zero_centred_norm: bool,
}

/// The family of a target config, by `model_type`.
pub fn spec_for(config: &TargetConfig) -> Result<FamilySpec> {
    let spec = match config.model_type.as_str() {
        "llama" => llama::spec(config),
        "qwen2" => qwen2::spec(config),
        "qwen3" => qwen3::spec(config),
        "qwen3_5" | "qwen3_5_text" => qwen3_5::spec(config),
        other => bail!("unknown architecture '{other}' (supported: llama, qwen2, qwen3, qwen3_5)"),
    };
    Ok(spec)
}
