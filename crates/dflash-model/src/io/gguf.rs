//! GGUF files: metadata → a [`TargetConfig`], tensors → HF names, the embedded tokenizer.
//!
//! GGUF tensor names are translated to transformers' names once, here (`blk.3.attn_q.weight`
//! → `model.layers.3.self_attn.q_proj.weight`), so every model file sees HF names only.
//! llama.cpp's converter permutes the Q/K rows of `llama`-architecture models for its
//! interleaved RoPE; we undo that permutation at load, so all families use transformers'
//! half-split RoPE.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;

use crate::cpu::quant::{QuantBlocks, QuantKind};
use candle_core::{DType, Device, Tensor};
use dflash_core::config::{TargetConfig, TokenIds};
use serde_json::Map;

use crate::io::weights::TensorStore;

pub struct GgufModel {
    pub config: TargetConfig,
    pub store: TensorStore,
    pub tokenizer: GgufTokenizerData,
    pub architecture: String,
}

/// What a GGUF says about its tokenizer.
#[derive(Debug, Clone, Default)]
pub struct GgufTokenizerData {
    pub model: String,
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    pub token_types: Vec<i32>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub chat_template: Option<String>,
}

fn meta<'a>(c: &'a Content, key: &str) -> Result<&'a Value> {
    c.metadata
        .get(key)
        .with_context(|| format!("GGUF metadata has no '{key}'"))
}
fn meta_u32(c: &Content, key: &str) -> Result<u32> {
    let v = meta(c, key)?;
    v.to_u32()
        .or_else(|_| v.to_u64().map(|x| x as u32))
        .or_else(|_| v.to_i32().map(|x| x as u32))
        .map_err(|e| anyhow::anyhow!("GGUF '{key}': {e}"))
}
fn meta_f32(c: &Content, key: &str) -> Result<f32> {
    meta(c, key)?
        .to_f32()
        .map_err(|e| anyhow::anyhow!("GGUF '{key}': {e}"))
}
fn meta_opt_u32(c: &Content, key: &str) -> Option<u32> {
    c.metadata.get(key).and_then(|v| v.to_u32().ok())
}
fn meta_strings(c: &Content, key: &str) -> Result<Vec<String>> {
    meta(c, key)?
        .to_vec()
        .map_err(|e| anyhow::anyhow!("GGUF '{key}': {e}"))?
        .iter()
        .map(|v| {
            v.to_string()
                .cloned()
                .map_err(|e| anyhow::anyhow!("GGUF '{key}': {e}"))
        })
        .collect()
}

/// GGUF tensor name → transformers name.
pub fn hf_name(gguf: &str) -> Option<String> {
    let simple = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(s) = simple {
        return Some(s.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undo llama.cpp's Q/K row permutation: GGUF rows are `[head, pair, 2]`-interleaved,
/// transformers' rows are `[head, 2, pair]` (half split).
fn unpermute_rows(t: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    let rest: usize = dims[1..].iter().product();
    let half = rows / n_head / 2;
    let t = t
        .reshape((n_head, half, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?;
    Ok(t)
}

/// Read a GGUF target: config from metadata, every tensor dequantized to `dtype`, except the
/// quantized weights the CPU streams (f32 on the CPU, [`crate::cpu::quant::streaming`]): those
/// are held as their blocks, and the store dequantizes one when asked for its tensor.
pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<GgufModel> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    load_from(&mut file, path, dtype, device)
}

/// [`load`] from any reader of a GGUF's bytes (`path` names it in messages): a damaged file
/// ends in an error naming what is wrong, never a panic (candle's parser, which divides by a
/// declared alignment, runs under `catch_unwind`), and every declared size is checked against
/// the bytes present before anything is read.
pub fn load_from<R: Read + Seek>(
    file: &mut R,
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<GgufModel> {
    let file_len = file.seek(std::io::SeekFrom::End(0))?;
    let content = parse(file, path)?;
    let meta = Meta::read(&content, path)?;
    check_extents(&content, file_len, path)?;
    let tensors = read_tensors(&content, file, path, &meta, dtype, device)?;
    let vocab_of = |name: &str| -> Option<usize> {
        match (tensors.dense.get(name), tensors.deferred.get(name)) {
            (Some(t), _) => t.dim(0).ok(),
            (None, Some(q)) => Some(q.n),
            (None, None) => None,
        }
    };
    let vocab = vocab_of("model.embed_tokens.weight").context("GGUF has no token_embd.weight")?;
    let tie = vocab_of("lm_head.weight").is_none();
    let tokenizer = tokenizer_data(&content);
    let config = meta.config(vocab, tie, &tokenizer);
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let store = TensorStore::new(tensors.dense, dtype, device.clone())
        .with_quant(tensors.quant)
        .with_deferred(tensors.deferred);
    Ok(GgufModel {
        config,
        store,
        tokenizer,
        architecture: meta.arch,
    })
}

/// The GGUF header and metadata of `file` (its magic checked first; candle's parser under
/// `catch_unwind`).
fn parse<R: Read + Seek>(file: &mut R, path: &Path) -> Result<Content> {
    file.rewind()?;
    let mut magic = [0u8; 4];
    file.read_exact(&mut magic).ok();
    if &magic != b"GGUF" {
        bail!("{} is not a GGUF file (bad magic)", path.display());
    }
    file.rewind()?;
    let parsed =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(&mut *file)));
    match parsed {
        Ok(c) => {
            c.map_err(|e| anyhow::anyhow!("{} is not a readable GGUF file: {e}", path.display()))
        }
        Err(_) => bail!(
            "{} is not a readable GGUF file: its header is inconsistent (e.g. an alignment of 0)",
            path.display()
        ),
    }
}

/// The model's shape as the metadata gives it (`{arch}.embedding_length`, …).
struct Meta {
    arch: String,
    model_type: String,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: Option<usize>,
    inter: usize,
    eps: f64,
    theta: f64,
    ctx: usize,
}

impl Meta {
    fn read(content: &Content, path: &Path) -> Result<Self> {
        let arch = meta(content, "general.architecture")?
            .to_string()
            .map_err(|e| anyhow::anyhow!("general.architecture: {e}"))?
            .clone();
        let model_type = match arch.as_str() {
            "llama" | "qwen2" | "qwen3" => arch.clone(),
            other => bail!(
                "unknown architecture '{other}' in {} (supported: llama, qwen2, qwen3)",
                path.display()
            ),
        };
        let k = |s: &str| format!("{arch}.{s}");
        let heads = meta_u32(content, &k("attention.head_count"))? as usize;
        Ok(Self {
            hidden: meta_u32(content, &k("embedding_length"))? as usize,
            layers: meta_u32(content, &k("block_count"))? as usize,
            heads,
            kv_heads: meta_opt_u32(content, &k("attention.head_count_kv"))
                .map(|x| x as usize)
                .unwrap_or(heads),
            head_dim: meta_opt_u32(content, &k("attention.key_length")).map(|x| x as usize),
            inter: meta_u32(content, &k("feed_forward_length"))? as usize,
            eps: meta_f32(content, &k("attention.layer_norm_rms_epsilon"))? as f64,
            theta: content
                .metadata
                .get(&k("rope.freq_base"))
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(10_000.0) as f64,
            ctx: meta_opt_u32(content, &k("context_length")).unwrap_or(2048) as usize,
            arch,
            model_type,
        })
    }

    /// The target config of this metadata, with the vocabulary and tying the tensors show.
    fn config(&self, vocab: usize, tie: bool, tokenizer: &GgufTokenizerData) -> TargetConfig {
        TargetConfig {
            architectures: vec![],
            model_type: self.model_type.clone(),
            hidden_size: self.hidden,
            intermediate_size: self.inter,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: Some(self.kv_heads),
            head_dim: self.head_dim,
            rms_norm_eps: self.eps,
            rope_theta: Some(self.theta),
            rope_parameters: None,
            rope_scaling: None,
            vocab_size: vocab,
            max_position_embeddings: self.ctx,
            tie_word_embeddings: tie,
            attention_bias: Some(self.arch == "qwen2"),
            bos_token_id: tokenizer.bos_id.map(TokenIds::One),
            eos_token_id: tokenizer.eos_id.map(TokenIds::One),
            torch_dtype: None,
            layer_types: None,
            full_attention_interval: None,
            partial_rotary_factor: None,
            linear_conv_kernel_dim: None,
            linear_key_head_dim: None,
            linear_value_head_dim: None,
            linear_num_key_heads: None,
            linear_num_value_heads: None,
            extra: Map::new(),
        }
    }
}

/// Every tensor must lie inside the file: a truncated download is caught here, not as a panic.
fn check_extents(content: &Content, file_len: u64, path: &Path) -> Result<()> {
    for (name, info) in content.tensor_infos.iter() {
        let dims = info.shape.dims();
        let n = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let block = info.ggml_dtype.block_size();
        let bytes = n
            .filter(|n| n % block == 0)
            .and_then(|n| (n / block).checked_mul(info.ggml_dtype.type_size()));
        let Some(bytes) = bytes else {
            bail!(
                "{}: tensor '{name}' has shape {dims:?}, not a whole number of {:?} blocks of {block}",
                path.display(),
                info.ggml_dtype
            );
        };
        let end = content
            .tensor_data_offset
            .checked_add(info.offset)
            .and_then(|o| o.checked_add(bytes as u64));
        match end {
            Some(end) if end <= file_len => {}
            _ => bail!(
                "{} is truncated: tensor '{name}' ends at byte {} but the file has {file_len} bytes",
                path.display(),
                end.map_or("past 2^64".to_string(), |e| e.to_string())
            ),
        }
    }
    Ok(())
}

/// A GGUF's tensors under HF names: dequantized ones, quantized weights that also keep their
/// blocks for the CPU's panels, and (while streaming is on) weights held as blocks only.
struct Tensors {
    dense: HashMap<String, Tensor>,
    quant: HashMap<String, std::sync::Arc<QuantBlocks>>,
    deferred: HashMap<String, std::sync::Arc<QuantBlocks>>,
}

/// The heads whose rows a llama GGUF stores permuted for `hf` (its q or k projection).
fn permuted_heads(meta: &Meta, hf: &str) -> Option<usize> {
    if meta.model_type != "llama" {
        return None;
    }
    let is = |p: &str| hf.ends_with(&format!("{p}.weight")) || hf.ends_with(&format!("{p}.bias"));
    if is("self_attn.q_proj") {
        Some(meta.heads)
    } else if is("self_attn.k_proj") {
        Some(meta.kv_heads)
    } else {
        None
    }
}

/// The quantized kinds whose blocks the CPU panels stream (exact).
fn streamed_kind(d: GgmlDType) -> Option<QuantKind> {
    match d {
        GgmlDType::Q4_1 => Some(QuantKind::Q4_1),
        GgmlDType::Q8_0 => Some(QuantKind::Q8_0),
        GgmlDType::Q4_0 => Some(QuantKind::Q4_0),
        GgmlDType::Q5_0 => Some(QuantKind::Q5_0),
        GgmlDType::Q4K => Some(QuantKind::Q4K),
        GgmlDType::Q6K => Some(QuantKind::Q6K),
        _ => None,
    }
}

/// Every tensor of `content` read (in name order), renamed and its rows in the model's order.
fn read_tensors<R: Read + Seek>(
    content: &Content,
    file: &mut R,
    path: &Path,
    meta: &Meta,
    dtype: DType,
    device: &Device,
) -> Result<Tensors> {
    let mut out = Tensors {
        dense: HashMap::new(),
        quant: HashMap::new(),
        deferred: HashMap::new(),
    };
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let q = content
            .tensor(&mut *file, name, &Device::Cpu)
            .map_err(|e| anyhow::anyhow!("reading tensor '{name}' from {}: {e}", path.display()))?;
        let hf = hf_name(name).unwrap_or_else(|| format!("gguf.{name}"));
        let row_heads = permuted_heads(meta, &hf);
        let dims = q.shape().dims().to_vec();
        // a quantized weight also keeps its blocks, for the CPU panels to stream; while
        // streaming is on, only its blocks (the store dequantizes them on demand)
        if let (Some(kind), &[n, kdim], DType::F32, true) = (
            streamed_kind(q.dtype()),
            dims.as_slice(),
            dtype,
            device.is_cpu(),
        ) {
            let blocks = QuantBlocks::new(kind, n, kdim, q.data()?.into_owned())?;
            let blocks = match row_heads {
                Some(h) => blocks.with_rows(&unpermuted_order(n, h)?),
                None => blocks,
            };
            if crate::cpu::quant::streaming() {
                out.deferred.insert(hf, std::sync::Arc::new(blocks));
                continue;
            }
            out.quant.insert(hf.clone(), std::sync::Arc::new(blocks));
        }
        let mut t = q.dequantize(&Device::Cpu)?;
        if let Some(h) = row_heads {
            t = unpermute_rows(&t, h)?;
        }
        out.dense.insert(hf, t.to_dtype(dtype)?.to_device(device)?);
    }
    Ok(out)
}

/// The source row of each of `n` rows after [`unpermute_rows`] over `heads` heads.
fn unpermuted_order(n: usize, heads: usize) -> Result<Vec<usize>> {
    let order = Tensor::arange(0f32, n as f32, &Device::Cpu)?.reshape((n, 1))?;
    Ok(unpermute_rows(&order, heads)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|r| r as usize)
        .collect())
}

/// The embedded tokenizer's metadata (`tokenizer.ggml.*`, the chat template).
fn tokenizer_data(content: &Content) -> GgufTokenizerData {
    let string = |k: &str| {
        content
            .metadata
            .get(k)
            .and_then(|v| v.to_string().ok().cloned())
    };
    GgufTokenizerData {
        model: string("tokenizer.ggml.model").unwrap_or_default(),
        pre: string("tokenizer.ggml.pre"),
        tokens: meta_strings(content, "tokenizer.ggml.tokens").unwrap_or_default(),
        merges: meta_strings(content, "tokenizer.ggml.merges").unwrap_or_default(),
        token_types: content
            .metadata
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok())
            .map(|v| v.iter().map(|x| x.to_i32().unwrap_or(1)).collect())
            .unwrap_or_default(),
        bos_id: meta_opt_u32(content, "tokenizer.ggml.bos_token_id"),
        eos_id: meta_opt_u32(content, "tokenizer.ggml.eos_token_id"),
        chat_template: string("tokenizer.chat_template"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_transformers() {
        assert_eq!(
            hf_name("blk.3.attn_q.weight").unwrap(),
            "model.layers.3.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.attn_k.bias").unwrap(),
            "model.layers.0.self_attn.k_proj.bias"
        );
        assert_eq!(hf_name("output.weight").unwrap(), "lm_head.weight");
        assert!(hf_name("blk.0.unknown.weight").is_none());
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(n_head, 2, half, in).swapaxes(1, 2) — rows [h, pair, 2]
        let (n_head, hd, inp) = (2usize, 4usize, 3usize);
        let hf: Vec<f32> = (0..n_head * hd * inp).map(|x| x as f32).collect();
        let hf = Tensor::from_vec(hf, (n_head * hd, inp), &Device::Cpu).unwrap();
        let gguf = hf
            .reshape((n_head, 2, hd / 2, inp))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((n_head * hd, inp))
            .unwrap();
        let back = unpermute_rows(&gguf, n_head).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    }
}
