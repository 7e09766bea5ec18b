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

use crate::layers::linear::Linear;
use anyhow::Result;
use candle_core::{DType, Tensor};
use dflash_core::config::DrafterConfig;
use dflash_core::segments::Segments;
use dflash_core::visibility::DraftRule;

use crate::cache::kv_cache::KvCache;
use crate::cpu::row_attention::KeyRuns;
use crate::layers::dynamic_conv::DynamicConv;
use crate::layers::mlp::Mlp;
use crate::layers::norm::RmsNorm;
use crate::layers::rope::Rope;
use crate::models::draft_vocab::DraftVocab;
use crate::models::selector::CandidateSelector;
use crate::models::target::Target;
use crate::ops::block_attention::ContextWindow;
use crate::ops::train_attention::TrainIntervals;

mod fixed;
mod forward;
mod layers;
mod load;
mod logits;
mod slots;
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

pub use slots::SlotDraft;

impl Drafter {
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
