//! Building a target from HF-named weights: its decoder layers (softmax attention or Gated
//! DeltaNet), the LM head and the embeddings (quantized ones as the CPU's panels).

use anyhow::Result;
use dflash_core::config::TargetConfig;

use super::layer::{Attention, DecoderLayer, Mixer};
use super::{Embeddings, Target};
use crate::io::weights::TensorStore;
use crate::layers::gdn::{GatedDeltaNet, GdnDims};
use crate::layers::linear::Linear;
use crate::layers::mlp::{load_linear, Mlp};
use crate::layers::norm::RmsNorm;
use crate::layers::rope::Rope;
use crate::models::families::{spec_for, FamilySpec};

/// The norms of a family: `RmsNorm` of `name`'s weight, zero-centred where the family's are.
struct Norms<'a> {
    store: &'a TensorStore,
    eps: f64,
    zero_centred: bool,
}

impl Norms<'_> {
    fn get(&self, name: &str, dim: usize) -> Result<RmsNorm> {
        let w = self.store.get(name, &[dim])?;
        Ok(match self.zero_centred {
            true => RmsNorm::zero_centred(w, self.eps)?,
            false => RmsNorm::new(w, self.eps),
        })
    }
}

impl Target {
    /// Build a target from HF-named weights (`model.layers.{i}.self_attn.q_proj.weight`, …).
    pub fn load(config: TargetConfig, store: &TensorStore) -> Result<Self> {
        config.validate()?;
        let spec = spec_for(&config)?;
        let h = config.hidden_size;
        let norms = Norms {
            store,
            eps: config.rms_norm_eps,
            zero_centred: spec.zero_centred_norm,
        };
        let layers = config
            .resolved_layer_types()
            .iter()
            .enumerate()
            .map(|(i, ty)| {
                let p = format!("model.layers.{i}");
                let mixer = match ty.as_str() {
                    "linear_attention" => linear_attention(store, &config, &p)?,
                    _ => Mixer::Attention(attention(store, &config, &spec, &norms, &p)?),
                };
                Ok(DecoderLayer {
                    input_layernorm: norms.get(&format!("{p}.input_layernorm.weight"), h)?,
                    mixer,
                    post_attention_layernorm: norms
                        .get(&format!("{p}.post_attention_layernorm.weight"), h)?,
                    mlp: Mlp::load(store, &format!("{p}.mlp"), h, config.intermediate_size)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (lm_head, embed_tokens) = head_and_embeddings(store, &config)?;
        // partial RoPE rotates the first head_dim · partial_rotary_factor features (qwen3_5)
        let rotary = ((config.head_dim() as f64 * config.rotary_fraction()) as usize) & !1;
        let rope = Rope::new(rotary, config.rope_theta());
        Ok(Self {
            spec,
            embed_tokens,
            layers,
            norm: norms.get("model.norm.weight", h)?,
            lm_head,
            rope,
            gdn_chunk_min_rows: 64,
            dtype: store.dtype,
            device: store.device.clone(),
            loaded_tensors: store.used(),
            ignored_tensors: store.unused(),
            config,
        })
    }
}

/// A Gated DeltaNet layer (`{p}.linear_attn`).
fn linear_attention(store: &TensorStore, config: &TargetConfig, p: &str) -> Result<Mixer> {
    let dims = GdnDims {
        hk: config.linear_num_key_heads.unwrap_or(0),
        hv: config.linear_num_value_heads.unwrap_or(0),
        dk: config.linear_key_head_dim.unwrap_or(0),
        dv: config.linear_value_head_dim.unwrap_or(0),
        kernel: config.linear_conv_kernel_dim.unwrap_or(0),
    };
    Ok(Mixer::GatedDeltaNet(GatedDeltaNet::load(
        store,
        &format!("{p}.linear_attn"),
        config.hidden_size,
        dims,
        config.rms_norm_eps,
    )?))
}

/// A softmax attention layer (`{p}.self_attn`): the family's q gate, q/k norms and biases.
fn attention(
    store: &TensorStore,
    config: &TargetConfig,
    spec: &FamilySpec,
    norms: &Norms,
    p: &str,
) -> Result<Attention> {
    let (h, nh, nkv, hd) = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_kv_heads(),
        config.head_dim(),
    );
    let q_out = if spec.gated_q { 2 * nh * hd } else { nh * hd };
    let a = format!("{p}.self_attn");
    let qk_norm = |n: &str| -> Result<Option<RmsNorm>> {
        spec.qk_norm
            .then(|| norms.get(&format!("{a}.{n}.weight"), hd))
            .transpose()
    };
    let bias = spec.qkv_bias;
    Ok(Attention {
        q_proj: load_linear(store, &format!("{a}.q_proj"), q_out, h, bias)?,
        k_proj: load_linear(store, &format!("{a}.k_proj"), nkv * hd, h, bias)?,
        v_proj: load_linear(store, &format!("{a}.v_proj"), nkv * hd, h, bias)?,
        o_proj: load_linear(store, &format!("{a}.o_proj"), h, nh * hd, false)?,
        q_norm: qk_norm("q_norm")?,
        k_norm: qk_norm("k_norm")?,
        heads: nh,
        kv_heads: nkv,
        head_dim: hd,
        gated: spec.gated_q,
        qkv: None,
    })
}

/// The LM head (its own weight, or tied to the embeddings) and the token embeddings.
fn head_and_embeddings(store: &TensorStore, config: &TargetConfig) -> Result<(Linear, Embeddings)> {
    let embed_name = "model.embed_tokens.weight";
    let head_name = if store.contains("lm_head.weight") {
        "lm_head.weight"
    } else {
        embed_name
    };
    let vocab_shape = [config.vocab_size, config.hidden_size];
    // under `--cpu-products q8` the exact products' arg-max: 8-bit rows alone move SmolLM2's
    // last logits by 6 % and flip it (tests/gguf_targets.rs), so a Q8_0 head recomputes
    // exactly the columns that could be a row's arg-max (`cpu::screen`)
    let lm_head = match store.quant(head_name, &vocab_shape) {
        Some(q) => Linear::from_blocks_head(&q, None, || store.get(head_name, &vocab_shape))?,
        None => Linear::new_exact(store.get(head_name, &vocab_shape)?, None),
    };
    // quantized embeddings are looked up from panels: the tied LM head's, or their own
    let embed_tokens = match (lm_head.panels(), store.quant(embed_name, &vocab_shape)) {
        (Some(p), _) if p.is_quantized() && head_name == embed_name => {
            Embeddings::Panels(p.clone())
        }
        (_, Some(q)) if crate::cpu::panels::Panels::supported() => Embeddings::Panels(
            std::sync::Arc::new(crate::cpu::panels::Panels::pack_quantized(&q)),
        ),
        // tied: the head's tensor (one copy)
        _ if head_name == embed_name => Embeddings::Table(lm_head.weight()?),
        _ => Embeddings::Table(store.get(embed_name, &vocab_shape)?),
    };
    Ok((lm_head, embed_tokens))
}
