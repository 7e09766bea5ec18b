//! Target families. Each file says how its config.json and GGUF differ from the shared
//! dense decoder in [`crate::target`]; the decoder reads only the resulting [`FamilySpec`].

pub mod llama;
pub mod qwen2;
pub mod qwen3;

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
}

/// The family of a target config, by `model_type`.
pub fn spec_for(config: &TargetConfig) -> Result<FamilySpec> {
    let spec = match config.model_type.as_str() {
        "llama" => llama::spec(config),
        "qwen2" => qwen2::spec(config),
        "qwen3" => qwen3::spec(config),
        other => bail!("unknown architecture '{other}' (supported: llama, qwen2, qwen3)"),
    };
    Ok(spec)
}
