//! The drafter's logits (the target's LM head, z-lab's multiplier and soft-capping) and one
//! inference round's draft.

use anyhow::{bail, Result};
use candle_core::Tensor;

use super::{BlockAt, DraftLayout, Drafter};
use crate::cache::kv_cache::KvCache;
use crate::models::draft_vocab::DraftHead;
use crate::models::target::Target;

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

impl Drafter {
    /// Draft logits (f32) from normed hidden rows: the target's LM head, then z-lab's
    /// `output_multiplier` and `final_logit_softcapping`.
    pub fn logits(&self, target: &Target, hidden: &Tensor) -> Result<Tensor> {
        self.finish_logits(match head_weight_as(target, hidden)? {
            Some(w) => hidden.broadcast_matmul(&w.t()?)?,
            None => target.lm_head(hidden)?,
        })
    }

    /// z-lab's `output_multiplier` and `final_logit_softcapping` on LM-head logits.
    pub(super) fn finish_logits(&self, mut l: Tensor) -> Result<Tensor> {
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
    /// 16-block's 15 rows through the last layer's queries and MLP ([`LastRows`](super::LastRows)) and the LM head.
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
        let logits = self.rows_logits(target, head, &rows)?;
        Ok((rows.squeeze(0)?, logits.squeeze(0)?))
    }

    /// The logits of normed hidden `rows` (`[.., h]`): over the target's vocabulary, or with a
    /// `head` over its subset ([`crate::models::draft_vocab`]).
    pub fn rows_logits(
        &self,
        target: &Target,
        head: Option<&DraftHead>,
        rows: &Tensor,
    ) -> Result<Tensor> {
        match head {
            Some(hd) => self.finish_logits(hd.logits(target, rows)?),
            None => self.logits(target, rows),
        }
    }
}
