//! The draft blocks of several sequences in ONE drafter forward, over a slotted drafter cache
//! (the speculative batch's): batched K/V buffers of a fixed capacity, each slot's context rows
//! from column 0, their count kept by the caller.
//!
//! **Layout.** Slot `s` brings its `m_s` new context rows (positions `held_s .. anchor_s`),
//! padded with zero rows to the round's most, `M`; then its block of `B` rows. Its context
//! rows are written at columns `held_s ..`, its block at `anchor_s ..`, its padding after the
//! block (`anchor_s + B ..`, where no query looks); its block's queries see what
//! [`draft_inference_placed`] gives them (the context keys `0 .. anchor_s` and the block). The
//! slot then holds `anchor_s` context rows; its next round overwrites the block and padding.
//!
//! Example: slots holding 40 and 12 context rows, new rows 3 and 1 (anchors 43 and 13), B 4:
//! M = 3; slot 0 writes columns 40..43 and its block 43..47; slot 1 writes column 12, its block
//! 13..17 and its two padding rows 17..19. Each block's rows are the ones its sequence drafts
//! alone, up to the order of the sums.

use anyhow::{bail, Result};
use candle_core::Tensor;
use dflash_core::visibility::{draft_inference_placed, DraftRule, Visibility};

use super::{Drafter, KvWrite, LayerMask};
use crate::cache::kv_cache::KvCache;
use crate::layers::attention::mask_tensors;
use crate::models::target::Target;

/// One slot's round in [`Drafter::draft_slots`].
#[derive(Debug, Clone)]
pub struct SlotDraft<'t> {
    /// The new context rows `[1, m, L·h]` (positions `held .. anchor`).
    pub ctx: &'t Tensor,
    /// Context rows the slot holds in the cache.
    pub held: usize,
    /// The anchor token and its position.
    pub token: u32,
    pub anchor: usize,
}

impl Drafter {
    /// An empty slotted cache of `b` slots and `cap` columns for [`Drafter::draft_slots`].
    pub fn new_slotted_cache(&self, b: usize, cap: usize, target: &Target) -> Result<KvCache> {
        let a = &self.layers[0].self_attn;
        let shapes = vec![Some((a.kv_heads, a.head_dim)); self.layers.len()];
        Ok(KvCache::batched(
            &shapes,
            b,
            cap,
            target.dtype,
            &target.device,
        )?)
    }

    /// Columns a slotted cache needs for `slots` with blocks of `block` rows (see the module
    /// doc: the furthest padding row).
    pub fn slotted_columns(slots: &[SlotDraft<'_>], block: usize) -> Result<usize> {
        let most = new_rows(slots)?.into_iter().max().unwrap_or(0);
        Ok(slots
            .iter()
            .map(|s| s.anchor + block + most - (s.anchor - s.held))
            .max()
            .unwrap_or(0))
    }

    /// Each slot's block in one forward over a slotted `cache` (one sequence per slot, in
    /// order; see the module doc): the normed hidden rows after the anchor, `[b, block - 1, h]`
    /// (their logits: [`Drafter::rows_logits`]).
    pub fn draft_slots(
        &self,
        target: &Target,
        cache: &mut KvCache,
        slots: &[SlotDraft<'_>],
        block: usize,
    ) -> Result<Tensor> {
        let (b, cap) = (slots.len(), cache.capacity()?);
        if b == 0 || block < 2 || !cache.is_empty() {
            bail!("draft_slots: {b} slots, a block of {block}, a cache of {} rows (a slotted cache keeps length 0)", cache.len());
        }
        if Self::slotted_columns(slots, block)? > cap {
            bail!("draft_slots: the slots' rows do not fit the cache's {cap} columns");
        }
        let (device, dtype) = (target.device.clone(), target.dtype);
        let m = new_rows(slots)?;
        let most = m.iter().copied().max().unwrap_or(0);
        let (mut taps, mut positions, mut columns, mut tokens) = (vec![], vec![], vec![], vec![]);
        for (s, &ms) in slots.iter().zip(&m) {
            if s.held + ms != s.anchor {
                bail!(
                    "draft_slots: {} held + {ms} new context rows must end at the anchor {}",
                    s.held,
                    s.anchor
                );
            }
            let w = s.ctx.dim(2)?;
            taps.push(match ms == most {
                true => s.ctx.contiguous()?,
                false => Tensor::cat(
                    &[
                        s.ctx,
                        &Tensor::zeros((1, most - ms, w), s.ctx.dtype(), &device)?,
                    ],
                    1,
                )?,
            });
            let after = s.anchor + block;
            positions.extend((s.held..s.anchor).chain(std::iter::repeat_n(s.anchor, most - ms)));
            positions.extend(s.anchor..after);
            columns.extend((s.held..s.anchor).chain(after..after + most - ms));
            columns.extend(s.anchor..after);
            tokens.extend(self.block_tokens(s.token, block));
        }
        target.check_tokens(&tokens)?;
        let rows = most + block;
        let rope = self.rope.tables(&positions, dtype, &device)?;
        let rope = rope.reshape_rows(b, rows)?;
        let a = &self.layers[0].self_attn;
        let index = KvCache::column_index((a.kv_heads, a.head_dim), b, &columns, &device)?;
        let mut masks: Vec<(DraftRule, LayerMask)> = Vec::new();
        for l in &self.layers {
            if !masks.iter().any(|(r, _)| *r == l.rule) {
                let v: Vec<Visibility> = slots
                    .iter()
                    .map(|s| draft_inference_placed(l.rule, s.anchor, block, s.anchor, cap))
                    .collect();
                masks.push((
                    l.rule,
                    LayerMask::Dense(mask_tensors(&v, dtype, &device)?, None),
                ));
            }
        }
        let emb = self.embed_block(target, &tokens)?.reshape((b, block, ()))?;
        let ctx = Tensor::cat(&taps, 0)?;
        let h = self.layers_forward(
            &ctx,
            &emb,
            block,
            &rope,
            &masks,
            KvWrite::Fixed {
                cache,
                index: &index,
                cap,
            },
            None,
            None,
        )?;
        // what each slot holds is its owner's count
        cache.truncate(0)?;
        Ok(h.narrow(1, 1, block - 1)?)
    }
}

/// Each slot's new context rows (`m_s` of the module doc).
fn new_rows(slots: &[SlotDraft<'_>]) -> Result<Vec<usize>> {
    Ok(slots
        .iter()
        .map(|s| s.ctx.dim(1))
        .collect::<candle_core::Result<Vec<_>>>()?)
}
