//! The draft block as a fixed-shape forward, so that one CUDA graph serves every round
//! ([`crate::cuda::graphed_draft`]): the same layers as [`Drafter::forward`], with every shape
//! fixed by the drafter's cache capacity `cap`, the context rows per round `ctx_rows` and the
//! block.
//!
//! **Layout.** A round's `m ≤ ctx_rows` new context rows (the rows committed since the last
//! draft, at positions `cache_len .. anchor`) are padded to `ctx_rows` rows; their K/V and the
//! block's are written through a device index at the `ctx_rows + block` cache rows from
//! `cache_len` on; the block's queries attend over all `cap` rows with the rule's own mask
//! moved to these columns ([`dflash_core::visibility::draft_inference_placed`]): the context
//! keys `0 .. anchor` and the block's keys, never the padding nor the stale rows past it.
//! Afterwards the caller truncates the cache to the anchor, as after an eager draft, and the
//! next round overwrites the padding.
//! Example: cache 40, 3 new context rows (anchor 43), ctx_rows 16, block 16, cap 128 → rows
//! 40..56 hold the context (43..56 padding), rows 56..72 the block; the block's queries see
//! columns 0..43 and 56..72; the cache is then cut to 43.
//!
//! Inputs live in device buffers ([`DraftInputs`]) that a later round overwrites in place
//! ([`DraftInputs::write_into`]), so a captured forward replays any round of the same shape.

use anyhow::{bail, Result};
use candle_core::Tensor;
use dflash_core::visibility::{draft_inference_placed, DraftRule};

use super::{BlockAt, Drafter, KvWrite, LayerMask};
use crate::cache::kv_cache::KvCache;
use crate::layers::attention::mask_tensor;
use crate::layers::rope::RopeTables;
use crate::models::draft_vocab::DraftHead;
use crate::models::target::Target;

/// A fixed-shape draft forward's inputs on the device ([`Drafter::prepare_fixed`]).
#[derive(Debug, Clone)]
pub struct DraftInputs {
    /// The block's tokens `[block]` u32: the anchor, then mask tokens.
    ids: Tensor,
    /// The round's context taps padded with zero rows, `[1, ctx_rows, L·h]`.
    taps: Tensor,
    /// RoPE rows of the context rows (padding at the anchor's position), then the block's.
    rope: RopeTables,
    /// One additive mask `[block, cap]` per distinct layer rule.
    masks: Vec<(DraftRule, Tensor)>,
    /// The fixed layout's write index `[1, hkv, ctx_rows + block, head_dim]` u32.
    index: Tensor,
    cap: usize,
    ctx_rows: usize,
    block: usize,
    /// The anchor's position: the cache's length once the round is done.
    pub anchor: usize,
}

impl DraftInputs {
    /// The forward's shape: `(cap, ctx_rows, block)`.
    pub fn shape(&self) -> (usize, usize, usize) {
        (self.cap, self.ctx_rows, self.block)
    }

    /// Copy this round's inputs into `dst`'s buffers, in place (the buffers a captured
    /// forward reads): the same shape, another round.
    pub fn write_into(&self, dst: &mut DraftInputs) -> Result<()> {
        if self.shape() != dst.shape() || self.masks.len() != dst.masks.len() {
            bail!(
                "draft inputs of shape {:?} into buffers of shape {:?}",
                self.shape(),
                dst.shape()
            );
        }
        let mut pairs = vec![
            (&self.ids, &dst.ids),
            (&self.taps, &dst.taps),
            (&self.rope.cos, &dst.rope.cos),
            (&self.rope.sin, &dst.rope.sin),
            (&self.index, &dst.index),
        ];
        pairs.extend(self.masks.iter().zip(&dst.masks).map(|(s, d)| (&s.1, &d.1)));
        for (src, d) in pairs {
            d.slice_set(src, 0, 0)?;
        }
        dst.anchor = self.anchor;
        Ok(())
    }
}

impl Drafter {
    /// The host side of a fixed-shape draft forward (see the module doc): the block's tokens,
    /// the context taps padded to `ctx_rows` rows, RoPE rows, masks and the write index, on
    /// the device. `new_ctx_taps` `[1, m, L*h]` are the rows at positions `cache_len ..
    /// at.anchor`.
    pub fn prepare_fixed(
        &self,
        target: &Target,
        new_ctx_taps: &Tensor,
        at: BlockAt,
        cache_len: usize,
        ctx_rows: usize,
        cap: usize,
    ) -> Result<DraftInputs> {
        let (m, block, anchor) = (new_ctx_taps.dim(1)?, at.block, at.anchor);
        if cache_len + m != anchor || m > ctx_rows {
            bail!(
                "fixed draft forward: cache {cache_len} + {m} context rows must end at the anchor {anchor}, at most {ctx_rows} rows"
            );
        }
        if cache_len + ctx_rows + block > cap || block < 2 {
            bail!(
                "fixed draft forward: {ctx_rows} context rows and a block of {block} after {cache_len} rows do not fit a capacity of {cap}"
            );
        }
        let (device, dtype) = (target.device.clone(), target.dtype);
        let tokens = self.block_tokens(at.token, block);
        target.check_tokens(&tokens)?;
        let ids = Tensor::from_vec(tokens, block, &device)?;
        let taps = if m == ctx_rows {
            new_ctx_taps.contiguous()?
        } else {
            let w = new_ctx_taps.dim(2)?;
            let pad = Tensor::zeros((1, ctx_rows - m, w), new_ctx_taps.dtype(), &device)?;
            Tensor::cat(&[new_ctx_taps, &pad], 1)?
        };
        let positions: Vec<usize> = (cache_len..anchor)
            .chain(std::iter::repeat_n(anchor, ctx_rows - m))
            .chain(anchor..anchor + block)
            .collect();
        let rope = self.rope.tables(&positions, dtype, &device)?;
        let mut masks: Vec<(DraftRule, Tensor)> = Vec::new();
        for l in &self.layers {
            if !masks.iter().any(|(r, _)| *r == l.rule) {
                let v = draft_inference_placed(l.rule, anchor, block, cache_len + ctx_rows, cap);
                masks.push((l.rule, mask_tensor(&v, dtype, &device)?));
            }
        }
        let a = &self.layers[0].self_attn;
        let index = KvCache::fixed_index(
            (1, a.kv_heads, ctx_rows + block, a.head_dim),
            cache_len,
            &device,
        )?;
        Ok(DraftInputs {
            ids,
            taps,
            rope,
            masks,
            index,
            cap,
            ctx_rows,
            block,
            anchor,
        })
    }

    /// The device side of a fixed-shape draft forward: the layers over `inputs` (K/V written
    /// into `cache`, whose buffers hold exactly `cap` rows), then the LM head (or the
    /// drafter's vocabulary head) on the block's rows after the anchor: `([block - 1, h],
    /// [block - 1, vocab])`, the logits as [`Drafter::logits`] gives them. Leaves the cache at `cache_len + ctx_rows + block`
    /// rows: cut it to `inputs.anchor` afterwards.
    pub fn forward_fixed(
        &self,
        target: &Target,
        head: Option<&DraftHead>,
        inputs: &DraftInputs,
        cache: &mut KvCache,
    ) -> Result<(Tensor, Tensor)> {
        let mut emb = target.embed_ids(&inputs.ids)?;
        let s = self.config.input_embedding_scale();
        if s != 1.0 {
            emb = (emb * s)?;
        }
        let masks: Vec<(DraftRule, LayerMask)> = inputs
            .masks
            .iter()
            .map(|(r, t)| (*r, LayerMask::Dense(t.clone(), None)))
            .collect();
        let h = self.layers_forward(
            &inputs.taps,
            &emb,
            inputs.block,
            &inputs.rope,
            &masks,
            KvWrite::Fixed {
                cache,
                index: &inputs.index,
                cap: inputs.cap,
            },
            None,
            None,
        )?;
        let rows = h.narrow(1, 1, inputs.block - 1)?;
        let logits = self.rows_logits(target, head, &rows)?;
        Ok((rows.squeeze(0)?, logits.squeeze(0)?))
    }
}
