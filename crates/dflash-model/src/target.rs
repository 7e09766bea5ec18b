//! The target model: a dense decoder (llama / qwen2 / qwen3) with the forward speculative
//! decoding needs.
//!
//! `forward(tokens, positions, mask over [cache | new rows], cache, taps, rows)` returns the
//! logits of the requested rows and the requested taps. Tap `i` is the output of decoder
//! layer `i` (see [`dflash_core::taps`]). Layers hold weights only; the cache, the mask and
//! the positions are arguments, so the same forward serves prefill, AR decode, chain verify
//! and tree verify.

use crate::linear::Linear;
use anyhow::{bail, Context, Result};
use candle_core::Module;
use candle_core::{DType, Device, Tensor, D};
use dflash_core::config::TargetConfig;
use dflash_core::visibility::Visibility;

use crate::attention::{attend, attend_intervals, mask_tensor_cols, mask_tensors};
use crate::families::{spec_for, FamilySpec};
use crate::gdn::{GatedDeltaNet, GdnCache, GdnDims};
use crate::interval_softmax::RowIntervals;
use crate::kv_cache::KvCache;
use crate::mlp::{load_linear, Mlp};
use crate::norm::RmsNorm;
use crate::rope::{Rope, RopeTables};
use crate::row_attention::{self, attend_rows, KeyRuns};
use crate::weights::TensorStore;

/// The parent of each new row for linear-attention layers: its nearest visible earlier new
/// row under the mask (causal: the previous row; tree: its parent node), `None` for a row
/// that sees no earlier new row.
fn parents_from_mask(mask: &Visibility, cache_len: usize) -> Vec<Option<usize>> {
    (0..mask.rows)
        .map(|i| (0..i).rev().find(|&j| mask.get(i, cache_len + j)))
        .collect()
}

/// Which rows get logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rows {
    None,
    Last,
    All,
    These(Vec<usize>),
}

/// A forward's inputs on the device ([`Target::prepare`]).
pub struct ForwardInputs {
    /// Token ids `[b · n]`.
    ids: Tensor,
    rope: RopeTables,
    /// The attention rule: one interval of keys per row where every row has one (the fused
    /// softmax), else the additive mask `[n, cache + n]` (one sequence) or
    /// `[b, 1, 1, n, cache + n]` in the compute dtype of the attention scores (f32; f64 for f64
    /// models). The fixed layout always has the additive mask (the captured buffer).
    mask: AttnMask,
    /// Each row's visible keys, for [`crate::row_attention`] (f32 CPU inference of one
    /// sequence with at most [`crate::row_attention::MAX_ROWS`] rows; else `None`).
    runs: Option<KeyRuns>,
    /// Linear-attention parents of the new rows (hybrid targets only).
    parents: Vec<Option<usize>>,
    b: usize,
    n: usize,
    /// The cache length the mask was built for.
    cache_len: usize,
    layout: CacheLayout,
}

impl ForwardInputs {
    /// Rows per sequence.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Copy these fixed-layout inputs into `dst`'s device buffers, in place (the buffers a
    /// captured forward reads): same row count and capacity, another cache length.
    /// Example: the AR step at cache 40 captured; `prepare_fixed(.., 41, cap).write_into(&mut
    /// captured)` makes a replay compute the step at cache 41.
    pub fn write_into(&self, dst: &mut ForwardInputs) -> Result<()> {
        let (CacheLayout::Fixed { index: si, cap: sc }, CacheLayout::Fixed { index: di, cap: dc }) =
            (&self.layout, &dst.layout)
        else {
            bail!("write_into: both inputs must have the fixed layout");
        };
        if sc != dc || self.n != dst.n || self.b != dst.b {
            bail!(
                "write_into: {} rows at capacity {sc} into buffers of {} rows at capacity {dc}",
                self.n,
                dst.n
            );
        }
        for (src, d) in [
            (&self.ids, &dst.ids),
            (&self.rope.cos, &dst.rope.cos),
            (&self.rope.sin, &dst.rope.sin),
            (self.mask.additive()?, dst.mask.additive()?),
            (si, di),
        ] {
            d.slice_set(src, 0, 0)?;
        }
        dst.cache_len = self.cache_len;
        Ok(())
    }
}

/// A forward's attention rule on the device ([`ForwardInputs`]).
#[derive(Debug, Clone)]
enum AttnMask {
    Additive(Tensor),
    Intervals(RowIntervals),
}

impl AttnMask {
    fn additive(&self) -> Result<&Tensor> {
        match self {
            AttnMask::Additive(t) => Ok(t),
            AttnMask::Intervals(_) => bail!("an interval mask has no additive buffer"),
        }
    }
}

/// Which keys each query row of a forward sees: the mask, and each row's key runs where
/// [`crate::row_attention`] runs the attention.
#[derive(Clone, Copy)]
struct Keys<'a> {
    mask: &'a AttnMask,
    runs: Option<&'a KeyRuns>,
}

/// Where a forward writes its new rows' K/V and which cache columns it attends over.
#[derive(Debug, Clone)]
pub enum CacheLayout {
    /// After the committed rows, into a cache that grows as needed; attention over
    /// `[cache | new]`, the mask's `cache + n` columns.
    Append,
    /// The same rows (`cache .. cache + n`), written through a device index into a cache of
    /// exactly `cap` rows ([`KvCache::reserve_exact`]); attention over all `cap` rows, the mask
    /// `[n, cap]` hiding the columns past the new rows. Every shape is fixed by `n` and `cap`,
    /// so a captured forward can be replayed at any cache length (CUDA graphs).
    /// Example: cache 37, n 16, cap 64 → rows 37..53 written, mask columns 53..64 hidden.
    Fixed {
        /// `[1, hkv, n, head_dim]` u32: the row of each new K/V element.
        index: Tensor,
        cap: usize,
    },
}

#[derive(Clone)]
pub struct TargetOutput {
    /// `[rows, vocab]`, f32 (`[b, rows, vocab]` from [`Target::forward_batch`]).
    pub logits: Option<Tensor>,
    /// One `[n, hidden]` tensor per requested tap, in request order (`[b, n, hidden]` from
    /// [`Target::forward_batch`]).
    pub taps: Vec<Tensor>,
}

impl TargetOutput {
    /// A batch of one sequence as [`Target::forward`] returns it: logits `[rows, vocab]`,
    /// taps `[n, hidden]` (views of the batch's tensors).
    pub fn one_sequence(self) -> Result<TargetOutput> {
        Ok(TargetOutput {
            logits: self.logits.map(|l| l.squeeze(0)).transpose()?,
            taps: self
                .taps
                .into_iter()
                .map(|t| t.squeeze(0))
                .collect::<candle_core::Result<_>>()?,
        })
    }
}

#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    gated: bool,
}

impl Attention {
    fn forward(
        &self,
        x: &Tensor,
        rope: &RopeTables,
        keys: Keys,
        layout: &CacheLayout,
        cache: &mut KvCache,
        layer: usize,
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let split = |t: Tensor, h: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let t = t.reshape((b, n, h, self.head_dim))?;
            let t = match norm {
                Some(nm) => nm.forward(&t)?,
                None => t,
            };
            Ok(t.transpose(1, 2)?)
        };
        // 1. projections → [b, heads, n, d]; qwen3 normalises each head before RoPE
        let (q, gate) = if self.gated {
            // q_proj yields [query | gate] per head
            let qg = self
                .q_proj
                .forward(x)?
                .reshape((b, n, self.heads, 2 * self.head_dim))?;
            let gate = qg.narrow(3, self.head_dim, self.head_dim)?.reshape((
                b,
                n,
                self.heads * self.head_dim,
            ))?;
            let q = qg.narrow(3, 0, self.head_dim)?.contiguous()?.reshape((
                b,
                n,
                self.heads * self.head_dim,
            ))?;
            (split(q, self.heads, &self.q_norm)?, Some(gate))
        } else {
            (
                split(self.q_proj.forward(x)?, self.heads, &self.q_norm)?,
                None,
            )
        };
        let k = split(self.k_proj.forward(x)?, self.kv_heads, &self.k_norm)?;
        let v = split(self.v_proj.forward(x)?, self.kv_heads, &None)?;
        // 2. RoPE at each row's own position
        let q = rope.apply(&q)?;
        let k = rope.apply(&k)?;
        // 3. cache: [cache rows | new rows] (fixed layout: all `cap` rows)
        let (k, v) = match layout {
            CacheLayout::Append => cache.append(layer, &k, &v)?,
            CacheLayout::Fixed { index, cap } => cache.write_fixed(layer, &k, &v, index, *cap)?,
        };
        // 4. masked attention, grouped K/V
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let o = match (keys.runs, keys.mask) {
            (Some(r), _) if row_attention::applies(&q) => attend_rows(&q, &k, &v, r, scale)?,
            (_, AttnMask::Intervals(iv)) => attend_intervals(&q, &k, &v, iv, scale)?,
            (_, AttnMask::Additive(m)) => attend(&q, &k, &v, m, scale)?,
        };
        let o = match gate {
            Some(g) => (o * candle_nn::ops::sigmoid(&g)?)?,
            None => o,
        };
        Ok(self.o_proj.forward(&o)?)
    }
}

/// The token mixer of a layer: softmax attention or Gated DeltaNet (hybrid targets).
#[derive(Debug, Clone)]
enum Mixer {
    Attention(Attention),
    GatedDeltaNet(GatedDeltaNet),
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    mixer: Mixer,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

pub struct Target {
    pub config: TargetConfig,
    pub spec: FamilySpec,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    /// Chain forwards of at least this many rows run the chunked Gated DeltaNet algorithm
    /// (no per-row states kept: prefill); shorter ones and trees the recurrent one.
    pub gdn_chunk_min_rows: usize,
    pub dtype: DType,
    pub device: Device,
    /// Tensor names the model took from its file(s).
    pub loaded_tensors: Vec<String>,
    /// Tensor names present in the file(s) that the model ignored.
    pub ignored_tensors: Vec<String>,
}

impl Target {
    /// Build a target from HF-named weights (`model.layers.{i}.self_attn.q_proj.weight`, …).
    pub fn load(config: TargetConfig, store: &TensorStore) -> Result<Self> {
        config.validate()?;
        let spec = spec_for(&config)?;
        let (h, nh, nkv, hd) = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_kv_heads(),
            config.head_dim(),
        );
        let eps = config.rms_norm_eps;
        let zc = spec.zero_centred_norm;
        let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
            let w = store.get(name, &[dim])?;
            Ok(if zc {
                RmsNorm::zero_centred(w, eps)
            } else {
                RmsNorm::new(w, eps)
            })
        };
        let q_out = if spec.gated_q { 2 * nh * hd } else { nh * hd };
        let types = config.resolved_layer_types();
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for (i, ty) in types.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = if ty == "linear_attention" {
                let dims = GdnDims {
                    hk: config.linear_num_key_heads.unwrap_or(0),
                    hv: config.linear_num_value_heads.unwrap_or(0),
                    dk: config.linear_key_head_dim.unwrap_or(0),
                    dv: config.linear_value_head_dim.unwrap_or(0),
                    kernel: config.linear_conv_kernel_dim.unwrap_or(0),
                };
                Mixer::GatedDeltaNet(GatedDeltaNet::load(
                    store,
                    &format!("{p}.linear_attn"),
                    h,
                    dims,
                    eps,
                )?)
            } else {
                let a = format!("{p}.self_attn");
                let qk_norm = |n: &str| -> Result<Option<RmsNorm>> {
                    Ok(if spec.qk_norm {
                        Some(norm(&format!("{a}.{n}.weight"), hd)?)
                    } else {
                        None
                    })
                };
                Mixer::Attention(Attention {
                    q_proj: load_linear(store, &format!("{a}.q_proj"), q_out, h, spec.qkv_bias)?,
                    k_proj: load_linear(store, &format!("{a}.k_proj"), nkv * hd, h, spec.qkv_bias)?,
                    v_proj: load_linear(store, &format!("{a}.v_proj"), nkv * hd, h, spec.qkv_bias)?,
                    o_proj: load_linear(store, &format!("{a}.o_proj"), h, nh * hd, false)?,
                    q_norm: qk_norm("q_norm")?,
                    k_norm: qk_norm("k_norm")?,
                    heads: nh,
                    kv_heads: nkv,
                    head_dim: hd,
                    gated: spec.gated_q,
                })
            };
            layers.push(DecoderLayer {
                input_layernorm: norm(&format!("{p}.input_layernorm.weight"), h)?,
                mixer,
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
                mlp: Mlp::load(store, &format!("{p}.mlp"), h, config.intermediate_size)?,
            });
        }
        let embed_tokens = store.get("model.embed_tokens.weight", &[config.vocab_size, h])?;
        let lm_head = match store.get_opt("lm_head.weight", &[config.vocab_size, h])? {
            Some(w) => w,
            None if config.tie_word_embeddings || !store.contains("lm_head.weight") => {
                embed_tokens.clone()
            }
            None => bail!("missing tensor 'lm_head.weight'"),
        };
        // partial RoPE rotates the first head_dim · partial_rotary_factor features (qwen3_5)
        let rotary = ((hd as f64 * config.rotary_fraction()) as usize) & !1;
        let rope = Rope::new(rotary, config.rope_theta());
        Ok(Self {
            spec,
            embed_tokens,
            layers,
            norm: norm("model.norm.weight", h)?,
            lm_head: Linear::new(lm_head, None),
            rope,
            gdn_chunk_min_rows: 64,
            dtype: store.dtype,
            device: store.device.clone(),
            loaded_tensors: store.used(),
            ignored_tensors: store.unused(),
            config,
        })
    }

    pub fn new_cache(&self) -> KvCache {
        let mut c = KvCache::new(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            if let Mixer::GatedDeltaNet(g) = &l.mixer {
                c.set_gdn(i, GdnCache::new(g.dims));
            }
        }
        c
    }
    /// An empty batched cache of `b` sequences with room for `cap` rows (attention-only
    /// targets; see [`KvCache::batched`]).
    pub fn new_batched_cache(&self, b: usize, cap: usize) -> Result<KvCache> {
        if self.is_hybrid() {
            bail!("a batched cache needs an attention-only target: the linear-attention layers of this hybrid target keep one sequence's state");
        }
        let shapes: Vec<Option<(usize, usize)>> = self
            .layers
            .iter()
            .map(|_| Some((self.config.num_kv_heads(), self.config.head_dim())))
            .collect();
        Ok(KvCache::batched(&shapes, b, cap, self.dtype, &self.device)?)
    }
    /// True when some layers are linear attention (their state is not a K/V row per token).
    pub fn is_hybrid(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.mixer, Mixer::GatedDeltaNet(_)))
    }
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    pub fn hidden_size(&self) -> usize {
        self.config.hidden_size
    }
    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// Every token id inside the vocabulary, or an error naming the first that is not.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&bad) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            bail!(
                "token id {bad} is outside the vocabulary ({})",
                self.config.vocab_size
            );
        }
        Ok(())
    }

    /// Token embeddings `[1, n, hidden]` (the drafter embeds its block with these).
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        self.check_tokens(tokens)?;
        let ids = Tensor::from_vec(tokens.to_vec(), tokens.len(), &self.device)?;
        Ok(self.embed_tokens.index_select(&ids, 0)?.unsqueeze(0)?)
    }

    /// The LM head on already-normalised hidden states `[.., hidden]` → f32 logits (f64 for f64 models).
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.logits_with(&self.lm_head, hidden)
    }

    /// `head`'s logits of normalised hidden states, cast to the compute dtype as
    /// [`Self::lm_head`]'s (a drafter's vocabulary head, [`crate::draft_vocab`]).
    pub fn logits_with(&self, head: &Linear, hidden: &Tensor) -> Result<Tensor> {
        Ok(head
            .forward(hidden)?
            .to_dtype(crate::norm::compute_dtype(self.dtype))?)
    }

    /// The LM head over vocabulary rows `ids` only (a drafter's vocabulary subset,
    /// [`crate::draft_vocab`]): column `j` of its logits is bit-identical to column `ids[j]`
    /// of [`Self::lm_head`]'s (the same weight row, the same product).
    pub fn lm_head_rows(&self, ids: &[u32]) -> Result<Linear> {
        let idx = Tensor::new(ids, &self.device)?;
        Ok(Linear::new(
            self.lm_head.weight().index_select(&idx, 0)?.contiguous()?,
            None,
        ))
    }

    /// The LM head in the weights' dtype (training: the drafter's fused loss reads bf16
    /// logits; [`Self::lm_head`] is the same matmul cast to the compute dtype).
    pub fn lm_head_native(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?)
    }

    /// The embedding table (frozen, shared with the drafter).
    pub fn embedding_table(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// One forward of one sequence: `tokens` at `positions`, `mask` over `[cache | new rows]`.
    /// Logits are `[rows, vocab]`, taps `[n, hidden]`.
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[usize],
        mask: &Visibility,
        cache: &mut KvCache,
        taps: &[usize],
        rows: &Rows,
    ) -> Result<TargetOutput> {
        let out = self.forward_batch(
            tokens,
            positions,
            std::slice::from_ref(mask),
            cache,
            taps,
            rows,
        )?;
        out.one_sequence()
    }

    /// The target rule in its plain form: `tokens` follow the cache's rows, at positions
    /// `cache.len() ..`, causal ([`dflash_core::visibility::causal`]). A prompt's prefill on an
    /// empty cache, or one AR step. Example: cache 3, tokens [a, b] → positions 3, 4; b sees
    /// rows 0..=4.
    pub fn forward_causal(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        taps: &[usize],
        rows: &Rows,
    ) -> Result<TargetOutput> {
        let (c, n) = (cache.len(), tokens.len());
        let positions: Vec<usize> = (c..c + n).collect();
        self.forward(
            tokens,
            &positions,
            &dflash_core::visibility::causal(c, n),
            cache,
            taps,
            rows,
        )
    }

    /// One forward of `b = masks.len()` sequences that each feed `n` new rows on top of their
    /// own row of a batched cache (`[b, hkv, len, d]`): `tokens` and `positions` are `b · n`,
    /// sequence-major; `masks[s]` is sequence `s`'s `[n, cache | n]` visibility. Logits are
    /// `[b, rows, vocab]`, taps `[b, n, hidden]`. Batches of more than one sequence need an
    /// attention-only target (a linear-attention state is one sequence's).
    /// Example: 2 sequences, one new token each at positions [7, 3] over a 9-column cache:
    /// `tokens = [t0, t1]`, `masks[0]` shows columns 2..=9, `masks[1]` columns 6..=9.
    pub fn forward_batch(
        &self,
        tokens: &[u32],
        positions: &[usize],
        masks: &[Visibility],
        cache: &mut KvCache,
        taps: &[usize],
        rows: &Rows,
    ) -> Result<TargetOutput> {
        let inputs = self.prepare(tokens, positions, masks, cache.len())?;
        self.forward_prepared(&inputs, cache, taps, rows)
    }

    /// The host side of a forward: token ids, RoPE rows and the additive mask copied to the
    /// device (and, for hybrid targets, each new row's parent). Everything after it
    /// ([`Target::forward_prepared`]) runs on device tensors, which is what a CUDA graph can
    /// capture. Arguments as [`Target::forward_batch`], `cache_len` its cache's length.
    /// Example: one AR step on a 512-row cache: ids `[t]`, RoPE rows of position 512, mask
    /// `[1, 513]` all visible.
    pub fn prepare(
        &self,
        tokens: &[u32],
        positions: &[usize],
        masks: &[Visibility],
        cache_len: usize,
    ) -> Result<ForwardInputs> {
        self.prepare_cols(tokens, positions, masks, cache_len, None)
    }

    /// [`Target::prepare`], the mask widened to `mask_cols` columns (hidden past the
    /// visibility's own) when given: the fixed layout's `[n, cap]` mask, built and copied once.
    fn prepare_cols(
        &self,
        tokens: &[u32],
        positions: &[usize],
        masks: &[Visibility],
        cache_len: usize,
        mask_cols: Option<usize>,
    ) -> Result<ForwardInputs> {
        let b = masks.len();
        if b == 0
            || tokens.is_empty()
            || !tokens.len().is_multiple_of(b)
            || positions.len() != tokens.len()
        {
            bail!(
                "forward needs one position per token and the same number of tokens per sequence (got {} tokens, {} positions, {b} sequences)",
                tokens.len(),
                positions.len()
            );
        }
        let n = tokens.len() / b;
        if let Some(mask) = masks
            .iter()
            .find(|m| m.rows != n || m.cols != cache_len + n)
        {
            bail!(
                "mask is {}x{}, expected {}x{} (new rows x [cache {} | new {}])",
                mask.rows,
                mask.cols,
                n,
                cache_len + n,
                cache_len,
                n
            );
        }
        if b > 1 && self.is_hybrid() {
            bail!("a batch of {b} sequences needs an attention-only target: the linear-attention layers of this hybrid target keep one sequence's state");
        }
        let max_pos = positions.iter().copied().max().unwrap_or(0);
        if max_pos >= self.config.max_position_embeddings {
            bail!(
                "position {max_pos} exceeds the context length ({})",
                self.config.max_position_embeddings
            );
        }
        self.check_tokens(tokens)?;
        let ids = Tensor::from_vec(tokens.to_vec(), tokens.len(), &self.device)?;
        let mut rope = self.rope.tables(positions, self.dtype, &self.device)?;
        if b > 1 {
            // [b·n, half] → [b, n, half]: each sequence's rows at their own positions
            let half = rope.cos.dim(1)?;
            rope.cos = rope.cos.reshape((b, n, half))?;
            rope.sin = rope.sin.reshape((b, n, half))?;
        }
        let parents = if self.is_hybrid() {
            parents_from_mask(&masks[0], cache_len)
        } else {
            Vec::new()
        };
        // in the attention scores' dtype: no cast per layer (−1 kernel per layer)
        let cd = crate::norm::compute_dtype(self.dtype);
        let mask = match (mask_cols, masks) {
            (Some(cols), [one]) => {
                AttnMask::Additive(mask_tensor_cols(one, cols, cd, &self.device)?)
            }
            (Some(_), _) => bail!("a widened mask is for one sequence"),
            (None, _) => match RowIntervals::from_visibilities(masks, &self.device)? {
                Some(iv) => AttnMask::Intervals(iv),
                None => AttnMask::Additive(mask_tensors(masks, cd, &self.device)?),
            },
        };
        // f32 CPU inference of a few rows: each row over its own keys (bit-identical rows
        // whatever the other rows, e.g. a tree's verify row and the AR step of the same tokens)
        let runs = match masks {
            [one]
                if mask_cols.is_none() && row_attention::serves(&self.device, self.dtype, b, n) =>
            {
                Some(KeyRuns::new(one))
            }
            _ => None,
        };
        Ok(ForwardInputs {
            ids,
            rope,
            mask,
            runs,
            parents,
            b,
            n,
            cache_len,
            layout: CacheLayout::Append,
        })
    }

    /// [`Target::prepare`] for the fixed layout ([`CacheLayout::Fixed`]): one sequence, its
    /// `n` new rows at cache rows `cache_len ..`, attention over a cache of exactly `cap` rows
    /// (the visibility `mask` is `[n, cache_len + n]` as for [`Target::forward`]; the columns
    /// past it are hidden). Attention-only targets.
    /// Example: cache 512, one AR step, cap 1024 → ids `[t]`, mask `[1, 1024]` with columns
    /// 0..=512 visible, index rows all 512.
    pub fn prepare_fixed(
        &self,
        tokens: &[u32],
        positions: &[usize],
        mask: &Visibility,
        cache_len: usize,
        cap: usize,
    ) -> Result<ForwardInputs> {
        if self.is_hybrid() {
            bail!("fixed-shape forwards need an attention-only target: the linear-attention layers of this hybrid target keep a state, not rows");
        }
        let n = tokens.len();
        if cache_len + n > cap {
            bail!(
                "a fixed-shape forward of {n} rows on a {cache_len}-row cache needs more than its capacity of {cap} rows"
            );
        }
        let mut inputs = self.prepare_cols(
            tokens,
            positions,
            std::slice::from_ref(mask),
            cache_len,
            Some(cap),
        )?;
        let (hkv, d) = self
            .layers
            .iter()
            .find_map(|l| match &l.mixer {
                Mixer::Attention(a) => Some((a.kv_heads, a.head_dim)),
                Mixer::GatedDeltaNet(_) => None,
            })
            .context("the target has no attention layer")?;
        let index: Vec<u32> = (0..hkv)
            .flat_map(|_| (0..n).flat_map(move |j| std::iter::repeat_n((cache_len + j) as u32, d)))
            .collect();
        inputs.layout = CacheLayout::Fixed {
            index: Tensor::from_vec(index, (1, hkv, n, d), &self.device)?,
            cap,
        };
        Ok(inputs)
    }

    /// The device side of [`Target::forward_batch`]: the layers, the cache writes, the taps
    /// and the logits of `rows` from prepared inputs. Copies nothing from the host except
    /// the row index of [`Rows::These`].
    pub fn forward_prepared(
        &self,
        inputs: &ForwardInputs,
        cache: &mut KvCache,
        taps: &[usize],
        rows: &Rows,
    ) -> Result<TargetOutput> {
        let ForwardInputs {
            ids,
            rope,
            mask,
            runs,
            parents,
            b,
            n,
            cache_len,
            layout,
        } = inputs;
        let (b, n) = (*b, *n);
        if cache.len() != *cache_len {
            bail!(
                "inputs prepared for a {cache_len}-row cache, the cache has {} rows",
                cache.len()
            );
        }
        if let Some(&bad) = taps.iter().find(|&&t| t >= self.layers.len()) {
            bail!(
                "tap {bad} is out of range: the target has {} layers",
                self.layers.len()
            );
        }
        let mut x =
            self.embed_tokens
                .index_select(ids, 0)?
                .reshape((b, n, self.config.hidden_size))?;
        let mut tap_out = vec![None; taps.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let hn = layer.input_layernorm.forward(&x)?;
            let h = match &layer.mixer {
                Mixer::Attention(a) => a.forward(
                    &hn,
                    rope,
                    Keys {
                        mask,
                        runs: runs.as_ref(),
                    },
                    layout,
                    cache,
                    i,
                )?,
                Mixer::GatedDeltaNet(g) => {
                    g.forward(&hn, parents, cache.gdn_mut(i)?, self.gdn_chunk_min_rows)?
                }
            };
            let x1 = (x + h)?;
            let m = layer
                .mlp
                .forward(&layer.post_attention_layernorm.forward(&x1)?)?;
            x = (x1 + m)?;
            for (slot, _) in taps.iter().enumerate().filter(|(_, &t)| t == i) {
                tap_out[slot] = Some(x.clone());
            }
        }
        cache.commit(n);
        let sel = match rows {
            Rows::None => None,
            Rows::All => Some(x.clone()),
            Rows::Last => Some(x.narrow(1, n - 1, 1)?),
            Rows::These(r) => {
                if let Some(&bad) = r.iter().find(|&&i| i >= n) {
                    bail!("logit row {bad} is out of range for {n} rows");
                }
                let idx = Tensor::from_vec(
                    r.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                    r.len(),
                    &self.device,
                )?;
                Some(x.index_select(&idx, 1)?)
            }
        };
        let logits = match sel {
            Some(s) => Some(self.lm_head(&self.norm.forward(&s)?)?),
            None => None,
        };
        Ok(TargetOutput {
            logits,
            taps: tap_out.into_iter().map(|t| t.unwrap()).collect(),
        })
    }

    /// Concatenate taps along the hidden axis: the drafter's context feature input `[n, L*h]`.
    pub fn concat_taps(taps: &[Tensor]) -> Result<Tensor> {
        Ok(Tensor::cat(taps, D::Minus1)?)
    }
}
