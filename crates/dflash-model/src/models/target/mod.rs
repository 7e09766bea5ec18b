//! The target model: one decoder over every family (llama, qwen2, qwen3, qwen3_5 hybrids),
//! with the forward speculative decoding needs.
//!
//! `forward(tokens, positions, mask over [cache | new rows], cache, taps, rows)` returns the
//! logits of the requested rows and the requested taps. Tap `i` is the output of decoder
//! layer `i` (see [`dflash_core::taps`]). Layers hold weights only; the cache, the mask and
//! the positions are arguments, so the same forward serves prefill, AR decode, chain verify
//! and tree verify. A forward is two halves: [`Target::prepare`] (`inputs.rs`: the host
//! side, ids, RoPE rows and the attention rule copied to the device) and
//! [`Target::forward_prepared`] (`layer.rs`: the layers on device tensors, what a CUDA graph
//! captures).

mod inputs;
mod layer;
mod load;
mod slots;

pub use inputs::{CacheLayout, ForwardInputs};

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use dflash_core::config::TargetConfig;
use dflash_core::visibility::Visibility;

use crate::cache::kv_cache::KvCache;
use crate::layers::gdn::{GdnCache, GdnSlots};
use crate::layers::linear::Linear;
use crate::layers::norm::RmsNorm;
use crate::layers::rope::Rope;
use crate::models::families::FamilySpec;
use layer::{DecoderLayer, Mixer};

/// Which rows get logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rows {
    None,
    Last,
    All,
    These(Vec<usize>),
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

/// The token embeddings `[vocab, hidden]`: a table, or the rows of quantized CPU panels
/// dequantized on lookup (a GGUF's blocks; tied to the LM head, the head's own panels), the
/// table's values bit for bit with the weight held once.
#[derive(Debug, Clone)]
pub enum Embeddings {
    Table(Tensor),
    Panels(std::sync::Arc<crate::cpu::panels::Panels>),
}

impl Embeddings {
    /// The table `[vocab, hidden]`: the tensor, or the panels' dequantization, made on each
    /// call (the loader's values, bit for bit).
    pub fn table(&self) -> candle_core::Result<Tensor> {
        match self {
            Embeddings::Table(t) => Ok(t.clone()),
            Embeddings::Panels(p) => {
                Tensor::from_vec(p.dense(), (p.out_features(), p.in_features()), &Device::Cpu)
            }
        }
    }

    /// The device the rows come to.
    pub fn device(&self) -> &Device {
        static CPU: Device = Device::Cpu;
        match self {
            Embeddings::Table(t) => t.device(),
            Embeddings::Panels(_) => &CPU,
        }
    }

    /// Rows `ids` (a 1-D u32 tensor) → `[ids, hidden]`.
    pub(crate) fn lookup(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Embeddings::Table(t) => t.index_select(ids, 0),
            Embeddings::Panels(p) => {
                let ids: Vec<u32> = ids.flatten_all()?.to_vec1()?;
                let h = p.in_features();
                let mut out = vec![0f32; ids.len() * h];
                for (row, &id) in out.chunks_mut(h.max(1)).zip(&ids) {
                    if id as usize >= p.out_features() {
                        candle_core::bail!(
                            "token id {id} is outside the vocabulary ({})",
                            p.out_features()
                        );
                    }
                    p.row_into(id as usize, row);
                }
                Tensor::from_vec(out, (ids.len(), h), &Device::Cpu)
            }
        }
    }
}

pub struct Target {
    pub config: TargetConfig,
    pub spec: FamilySpec,
    embed_tokens: Embeddings,
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
    /// On a GPU, each layer's q/k/v (or a Gated DeltaNet's four in-projections) and gate/up as
    /// stacked products ([`Linear::stack`]): one GEMM each instead of three (four) and two.
    /// Call it once the weights' [`TensorStore`] is dropped: the store holds the loaded
    /// tensors, so stacking while it lives holds each weight twice
    /// (a 54 GB target would need about 95 GB to load); afterwards a layer's parts are views of
    /// its stacked weight. Elsewhere (the CPU) nothing changes.
    pub fn stack_products(&mut self) -> Result<()> {
        for l in &mut self.layers {
            match &mut l.mixer {
                Mixer::Attention(a) => a.stack_projections()?,
                Mixer::GatedDeltaNet(g) => g.stack_in_projections()?,
            }
            l.mlp.stack_gate_up()?;
        }
        Ok(())
    }

    pub fn new_cache(&self) -> KvCache {
        let mut c = KvCache::new(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            if let Mixer::GatedDeltaNet(g) = &l.mixer {
                c.set_gdn(i, GdnCache::new(g.dims, &self.device));
            }
        }
        c
    }
    /// An empty batched cache of `b` sequences with room for `cap` rows (see
    /// [`KvCache::batched`]); a hybrid target's linear-attention layers get one state per
    /// sequence ([`crate::layers::gdn::GdnSlots`]).
    pub fn new_batched_cache(&self, b: usize, cap: usize) -> Result<KvCache> {
        let shapes: Vec<Option<(usize, usize)>> = self
            .layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::Attention(_) => Some((self.config.num_kv_heads(), self.config.head_dim())),
                Mixer::GatedDeltaNet(_) => None,
            })
            .collect();
        let mut c = KvCache::batched(&shapes, b, cap, self.dtype, &self.device)?;
        for (i, l) in self.layers.iter().enumerate() {
            if let Mixer::GatedDeltaNet(g) = &l.mixer {
                c.set_gdn_slots(i, GdnSlots::new(g.dims, b, &self.device)?);
            }
        }
        Ok(c)
    }

    /// Bytes of one sequence's linear-attention states in a batched cache (every layer's conv
    /// window and recurrent state, f32; 0 for an attention-only target).
    pub fn slot_state_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::GatedDeltaNet(g) => g.dims.slot_state_len() * 4,
                Mixer::Attention(_) => 0,
            })
            .sum()
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

    /// Bytes of weights one forward reads: every projection's ([`Linear::weight_bytes_read`]:
    /// quantized panels at their block size) and the norms'. The read floor of a forward is
    /// this over the memory's read bandwidth.
    pub fn weight_bytes_read(&self) -> usize {
        let norm = |n: &crate::layers::norm::RmsNorm| {
            n.weight.elem_count() * n.weight.dtype().size_in_bytes()
        };
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let mixer: usize = match &l.mixer {
                    Mixer::Attention(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]
                        .iter()
                        .map(|p| p.weight_bytes_read())
                        .sum(),
                    Mixer::GatedDeltaNet(g) => g.weight_bytes_read(),
                };
                let m = &l.mlp;
                mixer
                    + [&m.gate_proj, &m.up_proj, &m.down_proj]
                        .iter()
                        .map(|p| p.weight_bytes_read())
                        .sum::<usize>()
                    + norm(&l.input_layernorm)
                    + norm(&l.post_attention_layernorm)
            })
            .sum();
        layers + self.lm_head.weight_bytes_read() + norm(&self.norm)
    }

    /// How many of the projections (the layers' and the LM head) the CPU panels stream from
    /// quantized blocks ([`crate::cpu::quant`]).
    pub fn quantized_projections(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let attn = match &l.mixer {
                    Mixer::Attention(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]
                        .iter()
                        .filter(|p| p.is_quantized())
                        .count(),
                    Mixer::GatedDeltaNet(_) => 0,
                };
                let m = &l.mlp;
                attn + [&m.gate_proj, &m.up_proj, &m.down_proj]
                    .iter()
                    .filter(|p| p.is_quantized())
                    .count()
            })
            .sum::<usize>()
            + usize::from(self.lm_head.is_quantized())
    }
    pub fn hidden_size(&self) -> usize {
        self.config.hidden_size
    }
    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// Every token id inside the vocabulary, or an error naming the first that is not.
    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
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
        self.embed_ids(&ids)
    }

    /// [`Target::embed`] of ids already on the device (`[n]` u32, checked against the
    /// vocabulary by whoever put them there) → `[1, n, hidden]`: what a captured forward
    /// reads from its input buffer.
    pub fn embed_ids(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(self.embed_tokens.lookup(ids)?.unsqueeze(0)?)
    }

    /// The LM head on already-normalised hidden states `[.., hidden]` → f32 logits (f64 for f64 models).
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        let _p = tracing::info_span!(target: "phase", "lm head").entered();
        self.logits_with(&self.lm_head, hidden)
    }

    /// `head`'s logits of normalised hidden states, cast to the compute dtype as
    /// [`Self::lm_head`]'s (a drafter's vocabulary head, [`crate::models::draft_vocab`]).
    pub fn logits_with(&self, head: &Linear, hidden: &Tensor) -> Result<Tensor> {
        Ok(head
            .forward(hidden)?
            .to_dtype(crate::layers::norm::compute_dtype(self.dtype))?)
    }

    /// The LM head over vocabulary rows `ids` only (a drafter's vocabulary subset,
    /// [`crate::models::draft_vocab`]): column `j` of its logits is bit-identical to column `ids[j]`
    /// of [`Self::lm_head`]'s (the same weight row, the same product).
    pub fn lm_head_rows(&self, ids: &[u32]) -> Result<Linear> {
        Ok(self.lm_head.select_rows(ids)?)
    }

    /// The LM head in the weights' dtype (training: the drafter's fused loss reads bf16
    /// logits; [`Self::lm_head`] is the same matmul cast to the compute dtype).
    pub fn lm_head_native(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?)
    }

    /// The LM head's weight `[vocab, hidden]` when [`Self::lm_head_native`] is exactly
    /// `hidden · Wᵀ` with a held tensor (no bias, not quantized panels only).
    pub fn lm_head_weight(&self) -> Option<&Tensor> {
        self.lm_head.plain_weight()
    }

    /// The token embeddings (frozen, shared with the drafter): [`Embeddings::table`] is the
    /// table as a tensor.
    pub fn embedding_table(&self) -> &Embeddings {
        &self.embed_tokens
    }

    /// Bytes the target holds for its weights: the projections' (tensors and panels), the
    /// embeddings' (counted once where tied to a quantized LM head) and the norms'.
    pub fn weight_bytes_held(&self) -> usize {
        let tied = matches!((&self.embed_tokens, self.lm_head.panels()), (Embeddings::Panels(e), Some(h)) if std::sync::Arc::ptr_eq(e, h));
        let embed = match &self.embed_tokens {
            Embeddings::Table(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Embeddings::Panels(_) if tied => 0,
            Embeddings::Panels(p) => p.resident_bytes(),
        };
        // the norms' and the Gated DeltaNets' weights: held as read
        let rest = self.weight_bytes_read()
            - self.lm_head.weight_bytes_read()
            - self
                .projections()
                .iter()
                .map(|p| p.weight_bytes_read())
                .sum::<usize>();
        embed
            + rest
            + self.lm_head.weight_bytes_held()
            + self
                .projections()
                .iter()
                .map(|p| p.weight_bytes_held())
                .sum::<usize>()
    }

    /// Bytes one forward reads per weight format (`Linear::format`; "embed rows" aside):
    /// the layers' projections and, as "lm head", the LM head, largest first.
    pub fn bytes_read_by_format(&self) -> Vec<(String, usize)> {
        let mut by: Vec<(String, usize)> = Vec::new();
        let mut add = |name: String, b: usize| match by.iter_mut().find(|(n, _)| *n == name) {
            Some(e) => e.1 += b,
            None => by.push((name, b)),
        };
        for p in self.projections() {
            add(format!("proj {}", p.format()), p.weight_bytes_read());
        }
        add(
            format!("lm head ({})", self.lm_head.format()),
            self.lm_head.weight_bytes_read(),
        );
        by.sort_by_key(|e| std::cmp::Reverse(e.1));
        by
    }

    /// The layers' projections (attention and MLP; not the Gated DeltaNet's).
    fn projections(&self) -> Vec<&Linear> {
        self.layers
            .iter()
            .flat_map(|l| {
                let mut v: Vec<&Linear> = match &l.mixer {
                    Mixer::Attention(a) => vec![&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj],
                    Mixer::GatedDeltaNet(_) => vec![],
                };
                v.extend([&l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj]);
                v
            })
            .collect()
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
        let inputs = self.prepare(tokens, positions, masks, cache.len(), None)?;
        self.forward_prepared(&inputs, cache, taps, rows)
    }

    /// [`Target::forward_batch`] with each row's key interval instead of the dense masks
    /// (`rows[s][r]`, [`Target::prepare_intervals`]; attention-only targets). Example: the
    /// same 2 sequences: `rows = [[2..10], [6..10]]`.
    pub fn forward_batch_intervals(
        &self,
        tokens: &[u32],
        positions: &[usize],
        rows: &[Vec<std::ops::Range<usize>>],
        cache: &mut KvCache,
        taps: &[usize],
        out_rows: &Rows,
    ) -> Result<TargetOutput> {
        let inputs = self.prepare_intervals(tokens, positions, rows, cache.len(), None)?;
        self.forward_prepared(&inputs, cache, taps, out_rows)
    }

    /// Concatenate taps along the hidden axis: the drafter's context feature input `[n, L*h]`.
    pub fn concat_taps(taps: &[Tensor]) -> Result<Tensor> {
        Ok(Tensor::cat(taps, D::Minus1)?)
    }
}
