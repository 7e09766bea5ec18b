//! New drafters: a z-lab-format config for a target, seeded random weights, atomic saving.
//!
//! Weights follow transformers' init for Qwen3 (linear weights ~ N(0, 0.02), norm weights 1),
//! drawn from ChaCha8 with the given seed, so the same seed gives the same drafter anywhere.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use dflash_core::config::{
    DFlashSection, Dflash2Params, DrafterConfig, RopeParameters, DFLASH2_ARCH,
};
use dflash_core::taps::default_target_layer_ids;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Map;

use crate::io::tokenizer::TextTokenizer;
use crate::models::target::Target;

/// The shape of a new drafter; `None` fields copy the target's.
#[derive(Debug, Clone)]
pub struct DrafterShape {
    pub layers: usize,
    pub block_size: usize,
    pub mask_token_id: u32,
    pub intermediate_size: Option<usize>,
    pub target_layer_ids: Option<Vec<usize>>,
    /// A DFlash2 drafter's conv and selector sizes (`None`: a DFlash drafter).
    pub dflash2: Option<Dflash2Params>,
}

/// The published DFlash2 drafters' sizes (z-lab's Qwen3.8-27B and Muse-Glimmer-30B drafters):
/// convs of 2 taps, dynamic taps shared by 16 channels, a rank-256 selector over the top 16.
pub const PUBLISHED_DFLASH2: Dflash2Params = Dflash2Params {
    conv_kernel_size: 2,
    conv_group_size: 16,
    selector_rank: 256,
    selector_top_k: 16,
};

/// A z-lab `DFlashDraftModel` config for `target`: Qwen3 layers of the target's width and
/// heads, taps by z-lab's default rule unless given. With `shape.dflash2`, a
/// `DFlash2DraftModel` config: the sizes in `dflash_config` and `is_causal: false` at the top
/// level, as the published DFlash2 drafters have them.
pub fn drafter_config(target: &Target, shape: &DrafterShape) -> Result<DrafterConfig> {
    let tc = &target.config;
    if shape.layers == 0 {
        bail!("a drafter needs at least one layer");
    }
    let taps = shape
        .target_layer_ids
        .clone()
        .unwrap_or_else(|| default_target_layer_ids(tc.num_hidden_layers, shape.layers));
    let (mut section, mut top) = (Map::new(), Map::new());
    if let Some(p) = shape.dflash2 {
        for (k, v) in [
            ("conv_kernel_size", p.conv_kernel_size),
            ("conv_group_size", p.conv_group_size),
            ("selector_rank", p.selector_rank),
            ("selector_top_k", p.selector_top_k),
        ] {
            section.insert(k.into(), v.into());
        }
        top.insert("is_causal".into(), false.into());
    }
    let arch = if shape.dflash2.is_some() {
        DFLASH2_ARCH
    } else {
        "DFlashDraftModel"
    };
    let cfg = DrafterConfig {
        architectures: vec![arch.into()],
        model_type: "qwen3".into(),
        hidden_size: tc.hidden_size,
        intermediate_size: shape.intermediate_size.unwrap_or(tc.intermediate_size),
        num_hidden_layers: shape.layers,
        num_attention_heads: tc.num_attention_heads,
        num_key_value_heads: Some(tc.num_kv_heads()),
        head_dim: Some(tc.head_dim()),
        rms_norm_eps: tc.rms_norm_eps,
        rope_theta: None,
        rope_parameters: Some(RopeParameters {
            rope_theta: Some(tc.rope_theta()),
            rope_type: Some("default".into()),
            extra: Map::new(),
        }),
        rope_scaling: None,
        max_position_embeddings: tc.max_position_embeddings,
        layer_types: Some(vec!["full_attention".into(); shape.layers]),
        sliding_window: None,
        attention_bias: Some(false),
        block_size: shape.block_size,
        num_target_layers: tc.num_hidden_layers,
        dflash_config: DFlashSection {
            target_layer_ids: Some(taps),
            mask_token_id: Some(shape.mask_token_id),
            extra: section,
        },
        vocab_size: tc.vocab_size,
        extra: top,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The mask token for a target without a dedicated one: the highest-id special token that
/// neither the chat template nor the stop tokens use (SmolLM2: `<empty_output>`, id 16).
pub fn default_mask_token(tok: &TextTokenizer) -> Option<u32> {
    let tpl = tok.chat_template.as_deref().unwrap_or("");
    let mut specials: Vec<(u32, String)> = tok
        .inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, t)| (id, t.content))
        .collect();
    specials.sort();
    specials
        .into_iter()
        .rev()
        .find(|(id, s)| !tpl.contains(s.as_str()) && !tok.stop_ids.contains(id))
        .map(|(id, _)| id)
}

/// Seeded random weights for `cfg` (f32, CPU), keyed as z-lab saves them. A DFlash2 drafter's
/// convs start as the identity (base tap 0 = 1, the other taps 0, the dynamic-tap projections
/// 0), so its layers start as a DFlash drafter's exactly; its selector's projection and
/// codebooks ~ N(0, 0.02).
pub fn random_weights(cfg: &DrafterConfig, seed: u64) -> Result<HashMap<String, Tensor>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (h, nh, nkv, hd, inter) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_kv_heads(),
        cfg.head_dim(),
        cfg.intermediate_size,
    );
    let n_taps = cfg.resolve_target_layer_ids()?.0.len();
    let mut normal = |rows: usize, cols: usize| -> Result<Tensor> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                // Box-Muller
                let u1: f64 = rng.random::<f64>().max(1e-300);
                let u2: f64 = rng.random();
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * 0.02) as f32
            })
            .collect();
        Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
    };
    let ones = |n: usize| Tensor::ones(n, candle_core::DType::F32, &Device::Cpu);
    let mut w = HashMap::new();
    for i in 0..cfg.num_hidden_layers {
        let p = format!("layers.{i}");
        w.insert(format!("{p}.self_attn.q_proj.weight"), normal(nh * hd, h)?);
        w.insert(format!("{p}.self_attn.k_proj.weight"), normal(nkv * hd, h)?);
        w.insert(format!("{p}.self_attn.v_proj.weight"), normal(nkv * hd, h)?);
        w.insert(format!("{p}.self_attn.o_proj.weight"), normal(h, nh * hd)?);
        w.insert(format!("{p}.self_attn.q_norm.weight"), ones(hd)?);
        w.insert(format!("{p}.self_attn.k_norm.weight"), ones(hd)?);
        w.insert(format!("{p}.input_layernorm.weight"), ones(h)?);
        w.insert(format!("{p}.post_attention_layernorm.weight"), ones(h)?);
        w.insert(format!("{p}.mlp.gate_proj.weight"), normal(inter, h)?);
        w.insert(format!("{p}.mlp.up_proj.weight"), normal(inter, h)?);
        w.insert(format!("{p}.mlp.down_proj.weight"), normal(h, inter)?);
    }
    if let Some(p) = cfg.dflash2()? {
        let g = h / p.conv_group_size;
        let k = p.conv_kernel_size;
        // base[s, o, :] = 1 for o = 0, else 0
        let base: Vec<f32> = (0..2 * k * h)
            .map(|i| if (i / h) % k == 0 { 1.0 } else { 0.0 })
            .collect();
        for i in 0..cfg.num_hidden_layers {
            for c in ["attention_conv", "mlp_conv"] {
                let pre = format!("layers.{i}.{c}");
                w.insert(
                    format!("{pre}.base_kernel"),
                    Tensor::from_vec(base.clone(), (2, k, h), &Device::Cpu)?,
                );
                w.insert(
                    format!("{pre}.kernel_projection.weight"),
                    Tensor::zeros((2 * k * g, h), candle_core::DType::F32, &Device::Cpu)?,
                );
            }
        }
        let s = crate::models::selector::CandidateSelector::PREFIX;
        let (v, r) = (cfg.vocab_size, p.selector_rank);
        w.insert(format!("{s}.hidden_projection.weight"), normal(r, h)?);
        w.insert(format!("{s}.predecessor_codebook"), normal(v, r)?);
        w.insert(format!("{s}.successor_codebook"), normal(v, r)?);
    }
    w.insert("fc.weight".into(), normal(h, n_taps * h)?);
    w.insert("hidden_norm.weight".into(), ones(h)?);
    w.insert("norm.weight".into(), ones(h)?);
    Ok(w)
}

/// Write a drafter (`config.json`, `model.safetensors`) into the directory `dir` (created;
/// not atomic: callers write into a directory that [`crate::io::atomic::replace_dir`] puts in
/// place).
pub fn write_drafter_into(
    dir: &Path,
    cfg: &DrafterConfig,
    weights: &HashMap<String, Tensor>,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(cfg)? + "\n",
    )?;
    candle_core::safetensors::save(weights, dir.join("model.safetensors"))
        .with_context(|| format!("writing {}/model.safetensors", dir.display()))?;
    Ok(())
}

/// Save a drafter in z-lab format into `dir`, replacing it atomically (its old content, if
/// any, stays whole until the new one is complete: [`crate::io::atomic`]).
pub fn save_drafter(
    dir: &Path,
    cfg: &DrafterConfig,
    weights: &HashMap<String, Tensor>,
) -> Result<()> {
    crate::io::atomic::replace_dir(dir, |tmp| write_drafter_into(tmp, cfg, weights))
        .with_context(|| format!("writing the drafter to {}", dir.display()))
}

/// A seeded random drafter for a loaded target (its default mask token), in the target's
/// dtype and device: for exercising the decoding loops and for tests.
pub fn random_drafter(
    lt: &crate::io::loader::LoadedTarget,
    layers: usize,
    block_size: usize,
    intermediate_size: Option<usize>,
    seed: u64,
) -> Result<crate::models::drafter::Drafter> {
    let mask_token_id = default_mask_token(&lt.tokenizer)
        .context("the target has no unused special token for a mask")?;
    let shape = DrafterShape {
        layers,
        block_size,
        mask_token_id,
        intermediate_size,
        target_layer_ids: None,
        dflash2: None,
    };
    let cfg = drafter_config(&lt.target, &shape)?;
    let store = crate::io::weights::TensorStore::new(
        random_weights(&cfg, seed)?,
        lt.target.dtype,
        lt.target.device.clone(),
    );
    crate::models::drafter::Drafter::load(cfg, &store, &lt.target)
}
