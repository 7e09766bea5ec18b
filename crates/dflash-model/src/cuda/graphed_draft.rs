//! The draft block replayed from a CUDA graph: a decoding loop's rounds draft the same shape
//! (a block of B rows after at most B new context rows), so with the drafter's cache at a
//! fixed capacity the block is captured once and replayed every round after, its inputs
//! (block tokens, context taps, RoPE rows, masks, write index) copied into the captured
//! buffers first ([`crate::models::drafter::DraftInputs`]; the layout is
//! [`crate::models::drafter`]'s `fixed` module's). The block's LM head is in the graph: a
//! replay returns the hidden rows and logits of the block's rows after the anchor.
//!
//! DFlash2 drafters' dynamic convs are in the graph too (their selector reads the returned
//! rows). The first draft after the prefill (the whole prompt's context rows) and a round with
//! another block (the generation's last, cut at its length) run the eager forward on the same
//! buffers, as every draft does after a capture that failed (its error printed once). On the CPU there are no graphs: the fixed-shape
//! forward runs eagerly on the same buffers, so the bookkeeping is tested without a GPU.
//!
//! Example: B = 16, prompt 40 → round 1 (40 context rows) eager; round 2 (5 rows committed)
//! captures the 16 + 16-row forward; every later round with ≤ 16 new rows replays it.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

use crate::cache::kv_cache::KvCache;
use crate::cuda::launch_profile::{warm_capture, Captured};
use crate::models::draft_vocab::DraftHead;
use crate::models::drafter::{BlockAt, DraftInputs, Drafter};
use crate::models::target::Target;

/// A captured draft: its inputs' buffers, the vocabulary head it was captured with (a graph
/// reads the head's weights where they were at the capture: the slot holds them, so that they
/// outlive the generation that made them) and, on a GPU, the graph with its output buffers
/// (the block's hidden rows and logits).
struct Slot {
    inputs: DraftInputs,
    head: Option<DraftHead>,
    graph: Option<(Captured, (Tensor, Tensor))>,
}

/// Fixed-shape draft forwards of one sequence over a drafter cache of `cap` rows.
pub struct GraphedDraft {
    cap: usize,
    /// Context rows per fixed-shape round (the most a round commits: the block).
    ctx_rows: usize,
    /// The captured inputs and, on a GPU, the graph with its output buffers.
    slot: Option<Slot>,
    /// Drafts run eagerly (more context rows than `ctx_rows`, another block, no graph).
    pub eager_calls: usize,
    /// The capture failed once (its error printed): every later draft runs eagerly.
    eager_only: bool,
}

impl GraphedDraft {
    /// Give the drafter's `cache` exactly `cap` rows: every later draft's context rows,
    /// padding and block must fit (`prompt + max_new_tokens + 2 · block` for a decoding loop).
    pub fn new(cache: &mut KvCache, cap: usize, ctx_rows: usize) -> Result<Self> {
        cache.reserve_exact(cap)?;
        Ok(Self {
            cap,
            ctx_rows,
            slot: None,
            eager_calls: 0,
            eager_only: false,
        })
    }

    /// [`Drafter::draft_rows`] through the fixed shape and, on a GPU, its graph. The returned
    /// tensors may be the graph's output buffers: read them before the next call.
    pub fn draft_rows(
        &mut self,
        drafter: &Drafter,
        target: &Target,
        head: Option<&DraftHead>,
        cache: &mut KvCache,
        new_ctx_taps: &Tensor,
        at: BlockAt,
    ) -> Result<(Tensor, Tensor)> {
        // the captured forward reads and writes the buffers it was captured with
        if self.slot.is_some() && cache.capacity()? != self.cap {
            bail!(
                "the drafter's cache holds {} rows, not the {} of its captured draft: it was reallocated",
                cache.capacity()?,
                self.cap
            );
        }
        let cache_len = cache.len();
        let m = new_ctx_taps.dim(1)?;
        let fits = cache_len + self.ctx_rows + at.block <= self.cap;
        let same_block = self
            .slot
            .as_ref()
            .is_none_or(|s| s.inputs.shape().2 == at.block && s.head.is_some() == head.is_some());
        if m > self.ctx_rows || !fits || !same_block || self.eager_only {
            self.eager_calls += 1;
            let out = drafter.draft_rows(target, head, cache, new_ctx_taps, at)?;
            // an eager draft into a cache without buffers yet sized them itself
            if cache.capacity()? != self.cap {
                if self.slot.is_some() {
                    bail!("an eager draft reallocated the drafter's cache of a captured draft");
                }
                cache.reserve_exact(self.cap)?;
            }
            return Ok(out);
        }
        let fresh =
            drafter.prepare_fixed(target, new_ctx_taps, at, cache_len, self.ctx_rows, self.cap)?;
        let positions = at.positions.min(at.block - 1);
        let take = |(h, l): (Tensor, Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((h.narrow(0, 0, positions)?, l.narrow(0, 0, positions)?))
        };
        if let Some(Slot {
            inputs,
            head,
            graph,
        }) = self.slot.as_mut()
        {
            // the head of the capture (the same weights: one drafter per GraphedDraft)
            let head = head.as_ref();
            fresh.write_into(inputs)?;
            let out = match graph {
                Some((g, out)) => {
                    g.replay()?;
                    let (c, r, b) = inputs.shape();
                    debug_assert_eq!(c, self.cap);
                    cache.commit(r + b);
                    out.clone()
                }
                None => drafter.forward_fixed(target, head, inputs, cache)?,
            };
            cache.truncate(at.anchor)?;
            return take(out);
        }
        let dev = target.device.clone();
        let (out, graph) = match dev {
            Device::Cuda(_) => {
                let captured = warm_capture(&dev, cache, cache_len, |c| {
                    drafter.forward_fixed(target, head, &fresh, c)
                });
                match captured {
                    Ok((graph, out)) => (out.clone(), Some((graph, out))),
                    Err(e) => {
                        // the capture ended whatever it recorded: draft eagerly from here on
                        eprintln!("the draft block has no CUDA graph ({e:#}): drafting eagerly");
                        self.eager_only = true;
                        cache.truncate(cache_len)?;
                        return self.draft_rows(drafter, target, head, cache, new_ctx_taps, at);
                    }
                }
            }
            _ => (drafter.forward_fixed(target, head, &fresh, cache)?, None),
        };
        self.slot = Some(Slot {
            inputs: fresh,
            head: head.cloned(),
            graph,
        });
        cache.truncate(at.anchor)?;
        take(out)
    }

    /// Whether a fixed-shape draft has been prepared (captured, on a GPU).
    pub fn captured(&self) -> bool {
        self.slot.is_some()
    }
}
