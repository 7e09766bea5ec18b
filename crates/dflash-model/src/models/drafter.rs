//! The DFlash drafter (z-lab's `DFlashDraftModel`), one forward for training and inference.
//!
//! Semantics, exactly as z-lab's `dflash==0.1.0`:
//! 1. context feature `c = hidden_norm(fc(concat(taps)))` for each committed context row;
//! 2. block stream `x` = the target's embedding of `[anchor, mask × (B-1)]` (× `input_embedding_scale`);
//! 3. each layer: `h = input_layernorm(x)` (the context is NOT normed again);
//!    `q = q_norm(q_proj(h))`; `K = k_norm([k_proj(c) | k_proj(h)])`; `V = [v_proj(c) | v_proj(h)]`;
//!    RoPE at absolute positions (context rows at their own positions, block rows at
//!    `anchor .. anchor+B`); masked attention (the rule in `dflash_core::visibility`);
//!    `x = x + o_proj(attn)`; `x = x + mlp(post_attention_layernorm(x))`;
//! 4. `norm(x)`; logits = the target's LM head on block rows 1..B (row k predicts the token
//!    at `anchor + k`; row 0 is never used).
//!
//! **DFlash2** (`DFlash2DraftModel`): each layer also runs a grouped dynamic causal conv
//! before and after attention and before and after the MLP, inside the residual branch
//! ([`crate::layers::dynamic_conv`]), and the drafts come from the candidate selector
//! ([`crate::models::selector`], [`dflash_core::selector`]) instead of each row's argmax.
//!
//! [`DraftLayout::Inference`]: one block on top of a draft KV cache of committed context
//! (after `k_norm` and RoPE); the caller truncates the cache back to the anchor afterwards.
//! [`DraftLayout::Training`]: many blocks of one training row (one sequence, or several packed
//! side by side) at once, every context row given, blocks isolated by the mask. Both masks come from the same rule.

use std::path::Path;

use crate::layers::linear::Linear;
use anyhow::{bail, Context, Result};
use candle_core::Module;
use candle_core::{DType, Device, Tensor};
use dflash_core::config::DrafterConfig;
use dflash_core::segments::Segments;
use dflash_core::visibility::{draft_inference, draft_training_parts, DraftRule, Visibility};

use crate::cache::kv_cache::KvCache;
use crate::cpu::row_attention::{self, attend_rows, KeyRuns};
use crate::io::weights::TensorStore;
use crate::layers::attention::{attend, mask_tensor};
use crate::layers::dynamic_conv::DynamicConv;
use crate::layers::mlp::{load_linear, Mlp};
use crate::layers::norm::RmsNorm;
use crate::layers::rope::{Rope, RopeTables};
use crate::models::draft_vocab::{DraftHead, DraftVocab};
use crate::models::selector::CandidateSelector;
use crate::models::target::Target;
use crate::ops::add_norm::add_rms_norm;
use crate::ops::block_attention::{
    attend_blocks, attend_blocks_saving, context_windows, ContextWindow,
};
use crate::ops::qkv_rope;
use crate::ops::train_attention::{self, TrainIntervals};

mod fixed;
mod tape;
pub use fixed::DraftInputs;
pub use tape::Tape;

/// Where the rows of one drafter forward sit.
#[derive(Debug, Clone, Copy)]
pub enum DraftLayout<'a> {
    /// One block anchored at `anchor`. The new context rows are positions
    /// `cache.len() .. anchor`; the block rows `anchor .. anchor + block`.
    Inference { anchor: usize, block: usize },
    /// Blocks anchored at `anchors` (row indices) over a training row of `segs.len()` context
    /// rows: one sequence, or several packed side by side, each at its own positions
    /// ([`Segments`]). Block j's rows sit at the positions of rows `anchors[j] .. anchors[j] +
    /// block` of the anchor's sequence. Example: segments [0..5, 5..8], anchor 6 → block rows
    /// at positions 1, 2, …; context rows 5..8 at positions 0..3.
    Training {
        segs: &'a Segments,
        anchors: &'a [usize],
        block: usize,
    },
}

impl DraftLayout<'_> {
    /// Rows per block.
    fn block(&self) -> usize {
        match *self {
            DraftLayout::Inference { block, .. } | DraftLayout::Training { block, .. } => block,
        }
    }

    fn block_positions(&self) -> Vec<usize> {
        match *self {
            DraftLayout::Inference { anchor, block } => (anchor..anchor + block).collect(),
            DraftLayout::Training {
                segs,
                anchors,
                block,
            } => anchors
                .iter()
                .flat_map(|&a| {
                    let p = segs.position(a);
                    p..p + block
                })
                .collect(),
        }
    }
}

/// Row × key cells per training attention window (`window_bounds`) on a GPU. Each window costs
/// a fixed number of kernel launches; each cell past a row's own context is wasted work. On the
/// H200 (Qwen3-8B shape, a 2,048-token row, 512 anchors, docs/BENCHMARKS.md) the drafter step
/// takes 267, 260, 257 and 248 ms with windows of 0.5, 1, 2 and 4 M cells.
const WINDOW_CELLS_GPU: usize = 1 << 22;
/// The same on the CPU, where launches cost nothing and wasted cells cost FLOPs.
const WINDOW_CELLS_CPU: usize = 1 << 20;

/// [`WINDOW_CELLS_GPU`] or [`WINDOW_CELLS_CPU`] for `device`, or the runtime configuration's
/// `tuning.window_cells` (`DFLASH_WINDOW_CELLS`, for measuring the trade-off).
fn window_cells(device: &Device) -> usize {
    let set = dflash_core::runtime::current().tuning.window_cells;
    set.unwrap_or(if device.is_cpu() {
        WINDOW_CELLS_CPU
    } else {
        WINDOW_CELLS_GPU
    })
}

/// The target's LM head weight `[vocab, h]` cast to `hidden`'s dtype, for a drafter that runs
/// in another dtype than its target ([`Drafter::load_dir_as`]); `None` where they share one
/// (the head as the target runs it). A head held only as quantized panels cannot be cast: an
/// error names it.
fn head_weight_as(target: &Target, hidden: &Tensor) -> Result<Option<Tensor>> {
    if hidden.dtype() == target.dtype {
        return Ok(None);
    }
    match target.lm_head_weight() {
        Some(w) => Ok(Some(w.to_dtype(hidden.dtype())?)),
        None => bail!(
            "a drafter in {:?} beside a {:?} target needs the target's LM head as a tensor, \
             not quantized panels",
            hidden.dtype(),
            target.dtype
        ),
    }
}

/// A layer's attention mask: the whole `[keys]` mask and each row's visible key runs (for
/// [`crate::cpu::row_attention`] where it applies), or (training) the two visible parts.
pub(crate) enum LayerMask {
    Dense(Tensor, Option<KeyRuns>),
    Parts {
        context: Vec<ContextWindow>,
        block: usize,
    },
    /// training on the fused kernels ([`crate::ops::train_attention`]): each row's two
    /// intervals, no windows
    Fused(TrainIntervals),
}

/// The block rows whose output an inference forward returns, when fewer than the block's: the
/// last layer runs its queries, attention, residual and MLP on these rows only, with the draft
/// rule's rows for them (its keys and values still come from every row: the rows kept attend
/// to the whole block). Example: a DDTree of budget 4 reads rows 1..5 of a 16-block, so the last layer's
/// q, o and MLP products take 4 rows instead of 16; each returned row equals the whole block's
/// (up to the rounding of a product over fewer rows). `DFLASH_DISABLED_KERNELS=draft-last-rows` runs the whole
/// block instead (for measuring the difference).
pub(crate) struct LastRows {
    rows: std::ops::Range<usize>,
    mask: LayerMask,
}

/// Where a drafter forward's new K/V go: nowhere (training), appended to the cache
/// (inference), or written through the fixed layout's index into a cache of exactly `cap` rows
/// ([`KvCache::write_fixed`]: the draft block replayed from a CUDA graph).
pub(crate) enum KvWrite<'c> {
    None,
    Append(&'c mut KvCache),
    Fixed {
        cache: &'c mut KvCache,
        index: &'c Tensor,
        cap: usize,
    },
}

#[derive(Debug, Clone)]
struct DraftAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

#[derive(Debug, Clone)]
struct DraftLayer {
    input_layernorm: RmsNorm,
    self_attn: DraftAttention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    rule: DraftRule,
    /// DFlash2's convs around attention and around the MLP.
    attention_conv: Option<DynamicConv>,
    mlp_conv: Option<DynamicConv>,
}

pub struct Drafter {
    pub config: DrafterConfig,
    layers: Vec<DraftLayer>,
    norm: RmsNorm,
    fc: Linear,
    hidden_norm: RmsNorm,
    rope: Rope,
    pub target_layer_ids: Vec<usize>,
    pub mask_token_id: u32,
    pub block_size: usize,
    /// Notes from loading (tap-id conversions, defaults used).
    pub notes: Vec<String>,
    /// The tokens its proposals come from (`draft_vocab.json` beside the weights), or the
    /// whole vocabulary.
    pub draft_vocab: Option<DraftVocab>,
    /// DFlash2's candidate selector.
    pub selector: Option<CandidateSelector>,
}

/// Where one inference round's draft block sits: the anchor `token` (committed, not yet in
/// the target cache) at position `anchor`, a block of `block` rows (the anchor and `block - 1`
/// mask tokens), and how many of the rows after the anchor go through the LM head
/// (`positions ≤ block - 1`). Example: anchor token 42 at position 20, block 16, a DDTree of
/// budget 8 → `BlockAt { token: 42, anchor: 20, block: 16, positions: 8 }`: logits for
/// positions 21 ..= 28.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockAt {
    pub token: u32,
    pub anchor: usize,
    pub block: usize,
    pub positions: usize,
}

impl Drafter {
    /// Load a z-lab-format drafter directory (`config.json` + `model.safetensors`) for `target`.
    pub fn load_dir(dir: &Path, target: &Target) -> Result<Self> {
        Self::load_dir_as(dir, target, target.dtype)
    }

    /// [`Self::load_dir`] with the drafter's weights and compute in `dtype`, which may differ
    /// from the target's: the target's embeddings enter it cast to `dtype` and its LM head
    /// reads the drafter's rows in `dtype` ([`Self::logits`]; a draft vocabulary's head reads
    /// them in the target's dtype). Example: the doctor's f32 copy
    /// of a drafter beside a bf16 target, whose two forward paths must then agree to f32
    /// rounding. The head's weight is cast at every call (`vocab × h` values): a check's
    /// path, not a decoding one.
    pub fn load_dir_as(dir: &Path, target: &Target, dtype: DType) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("reading {}", cfg_path.display()))?;
        let config: DrafterConfig = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a DFlash drafter config", cfg_path.display()))?;
        let store =
            TensorStore::from_safetensors(&[dir.join("model.safetensors")], dtype, &target.device)?;
        let mut d = Self::load(config, &store, target)?;
        if let Some(v) = DraftVocab::read_dir(dir)? {
            v.validate(target.config.vocab_size).with_context(|| {
                format!("{}", dir.join(crate::models::draft_vocab::FILE).display())
            })?;
            d.notes.push(format!(
                "proposals from {} of the {} tokens ({})",
                v.token_ids.len(),
                target.config.vocab_size,
                crate::models::draft_vocab::FILE
            ));
            d.draft_vocab = Some(v);
        }
        Ok(d)
    }

    /// Build from a config and HF-named weights (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, …),
    /// checked against the target it will run with.
    pub fn load(config: DrafterConfig, store: &TensorStore, target: &Target) -> Result<Self> {
        config.validate().context("drafter config")?;
        let tc = &target.config;
        if config.hidden_size != tc.hidden_size {
            bail!(
                "drafter hidden_size {} does not fit the target's hidden_size {}",
                config.hidden_size,
                tc.hidden_size
            );
        }
        if config.vocab_size != tc.vocab_size {
            bail!(
                "drafter vocab_size {} does not fit the target's vocab_size {}",
                config.vocab_size,
                tc.vocab_size
            );
        }
        if config.num_target_layers != tc.num_hidden_layers {
            bail!(
                "drafter num_target_layers {} does not fit the target's {} layers",
                config.num_target_layers,
                tc.num_hidden_layers
            );
        }
        let (target_layer_ids, note) = config.resolve_target_layer_ids()?;
        let mut notes: Vec<String> = note.into_iter().collect();
        let (h, nh, nkv, hd) = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_kv_heads(),
            config.head_dim(),
        );
        let eps = config.rms_norm_eps;
        let v2 = config.dflash2()?;
        let conv = |name: String| -> Result<Option<DynamicConv>> {
            v2.map(|p| DynamicConv::load(store, &name, h, p.conv_kernel_size, p.conv_group_size))
                .transpose()
        };
        let bias = config.attention_bias.unwrap_or(false);
        let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm::new(store.get(name, &[dim])?, eps))
        };
        let mut layers = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("layers.{i}");
            let a = format!("{p}.self_attn");
            layers.push(DraftLayer {
                input_layernorm: norm(&format!("{p}.input_layernorm.weight"), h)?,
                self_attn: DraftAttention {
                    q_proj: load_linear(store, &format!("{a}.q_proj"), nh * hd, h, bias)?,
                    k_proj: load_linear(store, &format!("{a}.k_proj"), nkv * hd, h, bias)?,
                    v_proj: load_linear(store, &format!("{a}.v_proj"), nkv * hd, h, bias)?,
                    o_proj: load_linear(store, &format!("{a}.o_proj"), h, nh * hd, bias)?,
                    q_norm: norm(&format!("{a}.q_norm.weight"), hd)?,
                    k_norm: norm(&format!("{a}.k_norm.weight"), hd)?,
                    heads: nh,
                    kv_heads: nkv,
                    head_dim: hd,
                },
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
                mlp: Mlp::load(store, &format!("{p}.mlp"), h, config.intermediate_size)?,
                rule: config.layer_rule(i),
                attention_conv: conv(format!("{p}.attention_conv"))?,
                mlp_conv: conv(format!("{p}.mlp_conv"))?,
            });
        }
        let fc = Linear::new(
            store.get("fc.weight", &[h, target_layer_ids.len() * h])?,
            None,
        );
        let hidden_norm = norm("hidden_norm.weight", h)?;
        let final_norm = norm("norm.weight", h)?;
        let selector = v2
            .map(|p| {
                CandidateSelector::load(
                    store,
                    config.vocab_size,
                    h,
                    p.selector_rank,
                    p.selector_top_k,
                )
            })
            .transpose()?;
        let extra = store.unused();
        if !extra.is_empty() {
            bail!(
                "drafter checkpoint has tensors this drafter does not use: {}",
                extra.join(", ")
            );
        }
        if let Some(w) = config
            .sliding_window
            .filter(|_| layers.iter().any(|l| l.rule.sliding_window.is_some()))
        {
            notes.push(format!(
                "sliding-attention layers (window {w}){}, as z-lab 0.1.0",
                if config.is_causal() == Some(false) {
                    " are not causal in the block (is_causal: false)"
                } else {
                    " are causal in the block"
                }
            ));
        }
        Ok(Self {
            rope: Rope::new(hd, config.rope_theta()),
            mask_token_id: config.mask_token_id().expect("validated"),
            block_size: config.block_size,
            target_layer_ids,
            layers,
            norm: final_norm,
            fc,
            hidden_norm,
            notes,
            draft_vocab: None,
            selector,
            config,
        })
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// The block stream input: the target's embedding of `tokens`, scaled as z-lab does.
    pub fn embed_block(&self, target: &Target, tokens: &[u32]) -> Result<Tensor> {
        let e = target.embed(tokens)?.to_dtype(self.norm.weight.dtype())?;
        let s = self.config.input_embedding_scale();
        Ok(if s != 1.0 { (e * s)? } else { e })
    }

    /// The block tokens `[anchor, mask × (block - 1)]`.
    pub fn block_tokens(&self, anchor_token: u32, block: usize) -> Vec<u32> {
        let mut t = vec![self.mask_token_id; block];
        t[0] = anchor_token;
        t
    }

    /// The one drafter forward. `ctx_taps`: `[1, m, L*h]` concatenated taps of the new
    /// context rows; `block_emb`: `[1, nb, h]`. Returns the normed block hidden states
    /// `[1, nb, h]`.
    pub fn forward(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        layout: DraftLayout<'_>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        Ok(self
            .forward_inner(ctx_taps, block_emb, layout, cache, None, None)?
            .0)
    }

    /// [`Self::forward`] (no cache) keeping what the taped backward reads in `rec`; also
    /// returns the RoPE rows of the context then the block rows.
    fn forward_recorded(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        layout: DraftLayout<'_>,
        rec: &mut tape::Recorder,
    ) -> Result<(Tensor, RopeTables)> {
        self.forward_inner(ctx_taps, block_emb, layout, None, Some(rec), None)
    }

    /// `out_rows`: the block rows to return (all of them when `None`); at inference the last
    /// layer runs on them alone where it can ([`LastRows`]).
    fn forward_inner(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        layout: DraftLayout<'_>,
        cache: Option<&mut KvCache>,
        rec: Option<&mut tape::Recorder>,
        out_rows: Option<std::ops::Range<usize>>,
    ) -> Result<(Tensor, RopeTables)> {
        let m = ctx_taps.dim(1)?;
        let nb = block_emb.dim(1)?;
        let cache_len = cache.as_ref().map(|c| c.len()).unwrap_or(0);
        let ctx_positions: Vec<usize> = match layout {
            DraftLayout::Inference { anchor, block } => {
                if cache_len + m != anchor || nb != block {
                    bail!(
                        "draft inference: cache {cache_len} + context {m} rows must end at the anchor {anchor}, block {nb} must be {block}"
                    );
                }
                (cache_len..anchor).collect()
            }
            DraftLayout::Training {
                segs,
                anchors,
                block,
            } => {
                if cache.is_some() || m != segs.len() || nb != anchors.len() * block {
                    bail!(
                        "draft training: no cache, {} context rows and {} block rows expected",
                        segs.len(),
                        anchors.len() * block
                    );
                }
                segs.positions()
            }
        };
        let block_positions = layout.block_positions();
        let dtype = block_emb.dtype();
        let device = block_emb.device();
        let mut all_pos = ctx_positions.clone();
        all_pos.extend_from_slice(&block_positions);
        let rope_kv = self.rope.tables(&all_pos, dtype, device)?;
        // masks per distinct rule, from the shared visibility rule: training uses the two
        // visible parts (context, own block), inference the whole [cache | block] mask
        let mut masks: Vec<(DraftRule, LayerMask)> = Vec::new();
        // inference: each rule's visibility, for the last layer's rows ([`LastRows`])
        let mut visible: Vec<(DraftRule, Visibility)> = Vec::new();
        for l in &self.layers {
            if !masks.iter().any(|(r, _)| *r == l.rule) {
                let lm = match layout {
                    DraftLayout::Training {
                        segs,
                        anchors,
                        block,
                    } => {
                        let (c, o) = draft_training_parts(l.rule, segs, anchors, block);
                        if train_attention::takes(device, dtype, l.self_attn.head_dim) {
                            // the fused kernels: each row's two intervals, no windows
                            LayerMask::Fused(TrainIntervals::new(&c, &o, block, m, device)?)
                        } else {
                            // windows: the blocks of one sequence, window_cells(device) at a
                            // time, score only the context keys their rows may see
                            let group: Vec<usize> =
                                anchors.iter().map(|&a| segs.segment_of(a)).collect();
                            let context = context_windows(
                                &c,
                                &o,
                                block,
                                &group,
                                window_cells(device),
                                m,
                                device,
                            )?;
                            LayerMask::Parts { context, block }
                        }
                    }
                    DraftLayout::Inference { anchor, block } => {
                        let v = draft_inference(l.rule, anchor, block);
                        let runs = row_attention::serves(device, dtype, 1, block)
                            .then(|| KeyRuns::new(&v));
                        let lm = LayerMask::Dense(mask_tensor(&v, dtype, device)?, runs);
                        visible.push((l.rule, v));
                        lm
                    }
                };
                masks.push((l.rule, lm));
            }
        }
        // fewer output rows: the last layer's own mask for them (a conv mixes the block's rows,
        // so a DFlash2 layer keeps them all)
        let last = match (layout, out_rows.clone(), self.layers.last()) {
            (DraftLayout::Inference { block, .. }, Some(r), Some(l))
                if r.end <= block
                    && r != (0..block)
                    && !dflash_core::runtime::off(dflash_core::runtime::Kernel::DraftLastRows)
                    && l.attention_conv.is_none()
                    && l.mlp_conv.is_none() =>
            {
                let whole = &visible.iter().find(|(rule, _)| *rule == l.rule).unwrap().1;
                let v = whole.select_rows(r.clone());
                let runs =
                    row_attention::serves(device, dtype, 1, r.len()).then(|| KeyRuns::new(&v));
                Some(LastRows {
                    mask: LayerMask::Dense(mask_tensor(&v, dtype, device)?, runs),
                    rows: r,
                })
            }
            _ => None,
        };
        let write = match cache {
            Some(c) => KvWrite::Append(c),
            None => KvWrite::None,
        };
        let out = self.layers_forward(
            ctx_taps,
            block_emb,
            layout.block(),
            &rope_kv,
            &masks,
            write,
            rec,
            last.as_ref(),
        )?;
        // the rows asked for, whether the last layer ran on them alone or on the whole block
        let out = match (out_rows, &last) {
            (Some(r), None) => out.narrow(1, r.start, r.len())?,
            _ => out,
        };
        Ok((out, rope_kv))
    }

    /// The layers of the one drafter forward, after the host side ([`Self::forward`], or the
    /// fixed-shape inputs of [`crate::models::draft_inputs`]): `ctx_taps` `[1, m, L*h]`,
    /// `block_emb` `[1, nb, h]`, `rope_kv` the RoPE rows of the m context rows then the nb
    /// block rows, a mask per distinct layer rule, and where the new K/V go. Returns the normed
    /// block hidden states `[1, nb, h]`; a cache commits its m + nb new rows. With a recorder
    /// (a training layout on weights without a graph: [`Drafter::forward_taped`]) the
    /// activations the written backward reads are kept in it. With `last` (inference) the last
    /// layer runs its queries on those rows only and the result has only them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layers_forward(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        block: usize,
        rope_kv: &RopeTables,
        masks: &[(DraftRule, LayerMask)],
        mut write: KvWrite<'_>,
        mut rec: Option<&mut tape::Recorder>,
        last: Option<&LastRows>,
    ) -> Result<Tensor> {
        if last.is_some() && rec.is_some() {
            bail!("a taped forward returns every block row");
        }
        let m = ctx_taps.dim(1)?;
        let nb = block_emb.dim(1)?;
        let dtype = block_emb.dtype();
        let rope_q = rope_kv.narrow(m, nb)?;
        // 1. context feature (none at anchor 0 with an empty cache)
        let ctx = if m > 0 {
            let taps = ctx_taps.to_dtype(dtype)?;
            let fc_out = self.fc.forward(&taps)?;
            let c = self.hidden_norm.forward(&fc_out)?;
            if let Some(r) = rec.as_deref_mut() {
                r.ctx = Some((taps, fc_out));
            }
            Some(c)
        } else {
            None
        };
        // each residual add and the norm after it are one step (one kernel on a GPU without
        // gradients: `add_rms_norm`), the next layer's input norm (or the final norm) with this
        // layer's MLP residual
        let mut x = block_emb.clone();
        let mut hn = match self.layers.first() {
            Some(l) => l.input_layernorm.forward(&x)?,
            None => x.clone(),
        };
        let mut out = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            // the last layer on fewer rows: its queries, their RoPE rows and mask
            let trim = last.filter(|_| i + 1 == self.layers.len());
            let rope_last;
            let (q_rows, rope_q_layer) = match trim {
                Some(t) => {
                    rope_last = rope_kv.narrow(m + t.rows.start, t.rows.len())?;
                    (t.rows.clone(), &rope_last)
                }
                None => (0..nb, &rope_q),
            };
            let (hn_in, attn_post) = match &layer.attention_conv {
                Some(c) => {
                    let (y, post) = c.prepare(&hn, block)?;
                    (y, Some(post))
                }
                None => (hn.clone(), None),
            };
            // 2. q from the block stream only; 3. K/V over [context | block] (one product of
            // the rows stacked: proj([c; h]) = [proj(c); proj(h)])
            let kv_in = match &ctx {
                Some(c) => Tensor::cat(&[c, &hn_in], 1)?,
                None => hn_in.clone(),
            };
            let q_in = match trim {
                Some(_) => hn_in.narrow(1, q_rows.start, q_rows.len())?,
                None => hn_in.clone(),
            };
            let (q, k, v) = (
                a.q_proj.forward(&q_in)?,
                a.k_proj.forward(&kv_in)?,
                a.v_proj.forward(&kv_in)?,
            );
            let p = qkv_rope::Projections {
                q: &q,
                k: &k,
                v: &v,
            };
            let heads = qkv_rope::Heads {
                q: a.heads,
                kv: a.kv_heads,
                dim: a.head_dim,
            };
            let norms = (Some(&a.q_norm), Some(&a.k_norm));
            let tables = qkv_rope::Tables {
                q: rope_q_layer,
                kv: rope_kv,
            };
            // the projections before their norms, for a taped backward
            let projections = rec.is_some().then(|| (q.clone(), k.clone()));
            // per-head norms, RoPE and the cache write (one kernel on a GPU)
            let (q, k, v) = match &mut write {
                KvWrite::None => qkv_rope::heads_rotated(p, heads, norms, tables)?,
                KvWrite::Append(c) => {
                    qkv_rope::apply(p, heads, norms, tables, qkv_rope::Rows::APPEND, c, i)?
                }
                KvWrite::Fixed { cache, index, cap } => {
                    let rows = qkv_rope::Rows::fixed(index, *cap);
                    qkv_rope::apply(p, heads, norms, tables, rows, cache, i)?
                }
            };
            let scale = 1.0 / (a.head_dim as f64).sqrt();
            let mask = match trim {
                Some(t) => &t.mask,
                None => &masks.iter().find(|(r, _)| *r == layer.rule).unwrap().1,
            };
            let (o, attn_bwd) = match (mask, rec.is_some()) {
                // taped: the attention's value and its written backward, no graph
                (LayerMask::Parts { context, block }, true) => {
                    let (o, b) = attend_blocks_saving(&q, &k, &v, m, context, *block, scale)?;
                    (o, Some(b))
                }
                (LayerMask::Fused(iv), true) => {
                    let (o, b) = train_attention::attend_saving(&q, &k, &v, iv, scale)?;
                    (o, Some(b))
                }
                (LayerMask::Dense(..), true) => bail!("a taped forward takes a training layout"),
                (LayerMask::Dense(_, Some(runs)), false) if row_attention::applies(&q) => {
                    (attend_rows(&q, &k, &v, runs, scale)?, None)
                }
                (LayerMask::Dense(mask, _), false) => (attend(&q, &k, &v, mask, scale)?, None),
                (LayerMask::Parts { context, block }, false) => {
                    (attend_blocks(&q, &k, &v, m, context, *block, scale)?, None)
                }
                (LayerMask::Fused(iv), false) => {
                    (train_attention::attend(&q, &k, &v, iv, scale)?, None)
                }
            };
            let attn_raw = a.o_proj.forward(&o)?;
            let attn_out = match (&layer.attention_conv, &attn_post) {
                (Some(c), Some(taps)) => c.finish(&attn_raw, taps)?,
                _ => attn_raw.clone(),
            };
            if trim.is_some() {
                x = x.narrow(1, q_rows.start, q_rows.len())?;
            }
            let (x1, mn) = add_rms_norm(&x, &attn_out, &layer.post_attention_layernorm)?;
            let mlp_out = match rec.as_deref_mut() {
                None => match &layer.mlp_conv {
                    Some(c) => {
                        let (y, taps) = c.prepare(&mn, block)?;
                        c.finish(&layer.mlp.forward(&y)?, &taps)?
                    }
                    None => layer.mlp.forward(&mn)?,
                },
                Some(r) => {
                    // taped: the MLP's products, and each conv's input, taps and output kept
                    let (mlp_in, mlp_taps) = match &layer.mlp_conv {
                        Some(c) => {
                            let (y, taps) = c.prepare(&mn, block)?;
                            (y, Some(taps))
                        }
                        None => (mn.clone(), None),
                    };
                    let p = layer.mlp.forward_parts(&mlp_in)?;
                    let out = match (&layer.mlp_conv, &mlp_taps) {
                        (Some(c), Some(taps)) => c.finish(&p.out, taps)?,
                        _ => p.out.clone(),
                    };
                    let ((q, k), attn) = match (projections, attn_bwd) {
                        (Some(qk), Some(b)) => (qk, b),
                        _ => bail!("a taped layer without its projections or attention backward"),
                    };
                    r.layers.push(tape::LayerTape {
                        x: x.clone(),
                        hn: hn.clone(),
                        attn_in: hn_in.clone(),
                        attn_conv: attn_post.map(|t| (t, attn_raw.clone())),
                        kv_in: kv_in.clone(),
                        q,
                        k,
                        attn,
                        o: o.clone(),
                        x1: x1.clone(),
                        mn: mn.clone(),
                        mlp_in,
                        mlp_conv: mlp_taps.map(|t| (t, p.out.clone())),
                        gate: p.gate,
                        up: p.up,
                        act: p.act,
                    });
                    out
                }
            };
            match self.layers.get(i + 1) {
                Some(next) => (x, hn) = add_rms_norm(&x1, &mlp_out, &next.input_layernorm)?,
                None => {
                    let (s, n) = add_rms_norm(&x1, &mlp_out, &self.norm)?;
                    (x, out) = (s, Some(n));
                }
            }
        }
        match write {
            KvWrite::Append(c) | KvWrite::Fixed { cache: c, .. } => c.commit(m + nb),
            KvWrite::None => {}
        }
        if let Some(r) = rec {
            r.x_last = Some(x.clone());
        }
        match out {
            Some(o) => Ok(o),
            None => Ok(self.norm.forward(&x)?),
        }
    }

    /// Draft logits (f32) from normed hidden rows: the target's LM head, then z-lab's
    /// `output_multiplier` and `final_logit_softcapping`.
    pub fn logits(&self, target: &Target, hidden: &Tensor) -> Result<Tensor> {
        self.finish_logits(match head_weight_as(target, hidden)? {
            Some(w) => hidden.broadcast_matmul(&w.t()?)?,
            None => target.lm_head(hidden)?,
        })
    }

    /// z-lab's `output_multiplier` and `final_logit_softcapping` on LM-head logits.
    fn finish_logits(&self, mut l: Tensor) -> Result<Tensor> {
        let mult = self.config.output_multiplier();
        if mult != 1.0 {
            l = (l * mult)?;
        }
        if let Some(cap) = self.config.final_logit_softcapping() {
            l = ((l / cap)?.tanh()? * cap)?;
        }
        Ok(l)
    }

    /// Whether the drafter's logits are the LM head's as they are (no `output_multiplier`, no
    /// `final_logit_softcapping`): the loss may then take the head and the cross-entropy as one
    /// node ([`crate::ops::cross_entropy::linear_cross_entropy_rows`]).
    pub fn logits_are_the_heads(&self) -> bool {
        self.config.output_multiplier() == 1.0 && self.config.final_logit_softcapping().is_none()
    }

    /// Draft logits for training, in the model's dtype (the LM head's matmul output, no f32
    /// copy of `rows × vocab`), then z-lab's multiplier and soft-capping as [`Self::logits`].
    /// The fused cross-entropy ([`crate::ops::cross_entropy`]) reads them in f32.
    pub fn training_logits(&self, target: &Target, hidden: &Tensor) -> Result<Tensor> {
        self.finish_logits(match head_weight_as(target, hidden)? {
            Some(w) => hidden.broadcast_matmul(&w.t()?)?,
            None => target.lm_head_native(hidden)?,
        })
    }

    /// One inference round's draft ([`BlockAt`]): logits `[positions, vocab]` for positions
    /// `anchor + 1 ..= anchor + positions` (`positions ≤ block - 1`; `block - 1`: the whole
    /// block). Every layer's keys come from the whole block, so a row's logits do not depend on
    /// `positions` (up to rounding): a DDTree of budget 8 is at most 8 deep and takes 8 of a
    /// 16-block's 15 rows through the last layer's queries and MLP ([`LastRows`]) and the LM head.
    /// `new_ctx_taps` `[1, m, L*h]` are the committed rows since the last call (positions
    /// `cache.len() .. anchor`); afterwards the cache holds exactly the context rows `0 .. anchor`.
    /// With a `head` the logits are over its vocabulary subset, `[positions, subset]`, column
    /// `j` being token `head.token(j)` ([`crate::models::draft_vocab`]).
    pub fn draft(
        &self,
        target: &Target,
        head: Option<&DraftHead>,
        cache: &mut KvCache,
        new_ctx_taps: &Tensor,
        at: BlockAt,
    ) -> Result<Tensor> {
        Ok(self.draft_rows(target, head, cache, new_ctx_taps, at)?.1)
    }

    /// [`Self::draft`] with the normed hidden rows the logits come from, `([positions, h],
    /// [positions, vocab])`: DFlash2's selector reads both.
    pub fn draft_rows(
        &self,
        target: &Target,
        head: Option<&DraftHead>,
        cache: &mut KvCache,
        new_ctx_taps: &Tensor,
        at: BlockAt,
    ) -> Result<(Tensor, Tensor)> {
        let BlockAt {
            token: anchor_token,
            anchor,
            block,
            positions,
        } = at;
        if positions == 0 {
            anyhow::bail!("draft: no position to draft");
        }
        let emb = self.embed_block(target, &self.block_tokens(anchor_token, block))?;
        let out = 1..1 + positions.min(block - 1);
        let (rows, _) = self.forward_inner(
            new_ctx_taps,
            &emb,
            DraftLayout::Inference { anchor, block },
            Some(cache),
            None,
            Some(out),
        )?;
        cache.truncate(anchor)?;
        let logits = match head {
            Some(hd) => self.finish_logits(hd.logits(target, &rows)?)?,
            None => self.logits(target, &rows)?,
        };
        Ok((rows.squeeze(0)?, logits.squeeze(0)?))
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Row-wise log-softmax of `[n, vocab]` logits on their device (in f32): DDTree's
    /// per-position distributions, so that only the log-probabilities leave the device and the
    /// host picks the top K without an exp over the vocabulary.
    pub fn log_probs(logits: &Tensor) -> Result<Tensor> {
        Ok(crate::ops::log_softmax::log_softmax_rows(logits)?)
    }

    /// `[n, vocab]` logits as host rows in f32 (the drafter's distributions at T > 0).
    pub fn rows_f32(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
        Ok(logits.to_dtype(DType::F32)?.to_vec2::<f32>()?)
    }

    /// Row-wise argmax of `[n, vocab]` logits, by the target's rule
    /// ([`crate::ops::argmax`]: the first index of the largest value).
    pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
        Ok(crate::ops::argmax::argmax_rows(logits)?)
    }
}
