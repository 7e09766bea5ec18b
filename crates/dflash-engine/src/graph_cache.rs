//! Fixed-shape forwards kept from one generation to the next: with `--cuda-graphs` a
//! generation captures its verify forward and its draft block once and replays them every
//! round; an evaluation of many prompts in one process keeps the caches (at a fixed capacity)
//! and their graphs, so that only the first generation of a mode pays the captures
//! ([`crate::decode::generate`] with a [`GraphCache`]).
//!
//! A kept set serves a later generation of the same target, drafter, verify rows and block
//! whose prompt plus new tokens fit its capacity; otherwise it is dropped and a new one is
//! made, its capacity rounded up to [`CAP_STEP`] rows so that prompts of similar lengths share
//! it. Hybrid targets (their linear-attention state) are not kept.
//! Example: GSM8K, 256 new tokens, prompts of 90–180 tokens: the first item makes a cache of
//! 384 rows (180 + 256 + 16 → 512 after the first longer one), later items replay its graphs.

use anyhow::Result;
use dflash_model::cuda::graphed::GraphedForward;
use dflash_model::cuda::graphed_draft::GraphedDraft;
use dflash_model::models::draft_vocab::DraftHead;
use dflash_model::models::drafter::Drafter;
use dflash_model::{KvCache, Target};

/// Kept capacities are multiples of this many rows.
pub const CAP_STEP: usize = 128;

/// The fixed-shape state one generation leaves for the next (empty at first).
#[derive(Default)]
pub struct GraphCache {
    pub(crate) kept: Option<Kept>,
    /// Generations that found a kept set they could use.
    pub reused: usize,
}

/// The target's cache and verify graphs, the drafter's cache and draft graph, and its
/// vocabulary head.
pub(crate) struct Kept {
    /// Which target and drafter the graphs were captured with (their addresses).
    pub(crate) owner: (usize, Option<usize>),
    pub(crate) rows: usize,
    pub(crate) block: usize,
    pub(crate) cache: KvCache,
    pub(crate) graphed: GraphedForward,
    pub(crate) draft: Option<(KvCache, GraphedDraft)>,
    /// The drafter's vocabulary head (made once per drafter, not per generation).
    pub(crate) head: Option<DraftHead>,
}

/// Who captured: the target's and the drafter's addresses.
pub(crate) fn owner(target: &Target, drafter: Option<&Drafter>) -> (usize, Option<usize>) {
    (
        target as *const Target as usize,
        drafter.map(|d| d as *const Drafter as usize),
    )
}

/// `need` rounded up to [`CAP_STEP`]. Example: 437 → 512.
pub(crate) fn rounded(need: usize) -> usize {
    need.div_ceil(CAP_STEP) * CAP_STEP
}

impl Kept {
    /// Whether this set serves a generation of `owner` with `rows`-row verifies, blocks of
    /// `block` and caches of `cap` and `draft_cap` rows at least; if so, its caches emptied.
    pub(crate) fn take_for(
        mut self,
        owner: (usize, Option<usize>),
        rows: usize,
        block: usize,
        cap: usize,
        draft_cap: usize,
    ) -> Result<Option<Self>> {
        let draft_fits = match (&self.draft, owner.1) {
            (Some((c, _)), Some(_)) => c.capacity()? >= draft_cap,
            (None, None) => true,
            _ => false,
        };
        if self.owner != owner
            || self.rows != rows
            || self.block != block
            || self.cache.capacity()? < cap
            || !draft_fits
        {
            return Ok(None);
        }
        self.cache.truncate(0)?;
        if let Some((c, _)) = self.draft.as_mut() {
            c.truncate(0)?;
        }
        Ok(Some(self))
    }
}
