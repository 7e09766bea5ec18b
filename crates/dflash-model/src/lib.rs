//! dflash-model: candle models for DFlash speculative decoding.
//!
//! Attention with an explicit additive mask, RoPE, RMSNorm, KV cache, the target families
//! (llama, qwen2, qwen3), the DFlash drafter, loaders (GGUF, safetensors) and the tokenizer.

pub mod attention;
pub mod compare;
pub mod drafter;
pub mod drafter_init;
pub mod families;
pub mod gdn;
pub mod gguf;
pub mod kv_cache;
pub mod loader;
pub mod mlp;
pub mod norm;
pub mod profile;
pub mod rope;
pub mod target;
pub mod tokenizer;
pub mod weights;

pub use candle_core;
pub use kv_cache::KvCache;
pub use target::{Rows, Target, TargetOutput};

/// Parse a device name (`cpu`, `cuda`, `cuda:N`).
pub fn device(name: &str) -> anyhow::Result<candle_core::Device> {
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ord = s
                .strip_prefix("cuda:")
                .map(|n| n.parse::<usize>())
                .transpose()?
                .unwrap_or(0);
            if !candle_core::utils::cuda_is_available() {
                anyhow::bail!(
                    "device '{s}': this build has no CUDA support (build with --features cuda)"
                );
            }
            Ok(candle_core::Device::new_cuda(ord)?)
        }
        other => anyhow::bail!("unknown device '{other}' (cpu, cuda, cuda:N)"),
    }
}

/// Parse a dtype name (`f32`, `bf16`, `f16`).
pub fn dtype(name: &str) -> anyhow::Result<candle_core::DType> {
    match name {
        "f32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "f16" => Ok(candle_core::DType::F16),
        other => anyhow::bail!("unknown dtype '{other}' (f32, bf16, f16)"),
    }
}
