//! The random-weight model the shape benchmarks build (`bench shape`, `bench train`, `bench
//! regen`): the shape's config, its input tokens, the target and a drafter of its width.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::DType;
use dflash_core::config::{DrafterConfig, TargetConfig};
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter_init::{drafter_config, DrafterShape};
use dflash_model::Target;

/// Qwen/Qwen3-8B's config.json (the fields the model reads).
const QWEN3_8B: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
 "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
 "rms_norm_eps": 1e-06, "rope_theta": 1000000, "max_position_embeddings": 40960,
 "vocab_size": 151936, "tie_word_embeddings": false, "attention_bias": false,
 "torch_dtype": "bfloat16"}"#;

/// The target config of `--shape`: `qwen3-8b`, or a config.json of any supported family.
pub fn shape_config(shape: &str) -> Result<TargetConfig> {
    let text = if shape == "qwen3-8b" {
        QWEN3_8B.to_string()
    } else {
        std::fs::read_to_string(shape).with_context(|| {
            format!("--shape: '{shape}' is neither qwen3-8b nor a readable config.json")
        })?
    };
    serde_json::from_str(&text).with_context(|| format!("--shape {shape}: not a model config"))
}

/// `n` fixed pseudo-random token ids below `vocab`: the benchmarks' input on random weights.
pub fn bench_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((17 + i * 7919) % vocab as u64) as u32)
        .collect()
}

/// A target of config `cfg` with random weights (seed 0) on `dev`, and the config of a
/// `layers`-layer drafter of its width; says how long building it took.
pub fn random_target(
    shape: &str,
    cfg: &TargetConfig,
    dtype: DType,
    dev: &candle_core::Device,
    layers: usize,
    block_size: usize,
) -> Result<(Target, DrafterConfig)> {
    let t0 = Instant::now();
    let mut target = Target::load(cfg.clone(), &TensorStore::random(dtype, dev, 0)?)?;
    target.stack_products()?;
    let dcfg = drafter_config(
        &target,
        &DrafterShape {
            layers,
            block_size,
            mask_token_id: 0,
            intermediate_size: None,
            target_layer_ids: None,
            dflash2: None,
        },
    )?;
    dev.synchronize()?;
    eprintln!(
        "random {shape} target ({} layers, hidden {}) built in {:.1} s",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        t0.elapsed().as_secs_f64()
    );
    Ok((target, dcfg))
}
