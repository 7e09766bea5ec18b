//! DDTree: the best-first tree under a node budget (greedy), or at T > 0 under the residual
//! rule its sampled tree, drawn where the logits are unless the host's path is asked for.

use anyhow::Result;
use candle_core::Tensor;
use dflash_core::sampled_tree::{place_draws, sampled_shape};
use dflash_model::ops::sample_rows::Uniforms;
use dflash_model::ops::sampled_tree::draw_distinct;
use dflash_model::ops::top_k::top_k_rows;

use super::{best_first, by_target, Decoding, Proposer};
use crate::decode::proposal::{Judge, Proposal};

/// DDTree: the best `budget` prefixes of the drafter's distributions from the top `top_k`
/// tokens per depth (0: the budget), or with a DFlash2 drafter at T = 0 from its selector's
/// candidates ranked after each node's own token. At T > 0 under the residual rule its tokens
/// are drawn without replacement from the draft logits (as for a DFlash drafter: the
/// selector's edge term needs a drawn predecessor, which a per-depth draw does not fix) and
/// walked by recursive rejection sampling ([`dflash_core::sampled_tree`]).
pub(in crate::decode) struct Tree {
    pub(in crate::decode) budget: usize,
    pub(in crate::decode) top_k: usize,
}

impl Tree {
    /// Candidates per depth: `top_k`, or the budget when it is 0 (the paper's rule).
    fn k(&self) -> usize {
        if self.top_k == 0 {
            self.budget
        } else {
            self.top_k
        }
    }
}

impl Proposer for Tree {
    fn propose(&mut self, run: &mut Decoding<'_>, depth: usize) -> Result<Proposal> {
        let anchor = run.anchor();
        // a tree of `budget` nodes is at most `budget` deep: the distributions below are
        // never read
        let (hidden, logits) = run.draft(depth, self.budget.min(depth - 1))?;
        if run.samples_drafts() {
            if run.one_sync {
                return self.sampled_on_device(run, anchor, &logits);
            }
            let qs = run.draft_distributions(&logits)?;
            let st = run.sampler.sampled_tree(anchor, qs, self.budget, self.k());
            return Ok(Proposal::drafted(st.tree.clone(), Judge::Tree(st)));
        }
        let candidates = run.candidates(&hidden, &logits, self.k())?;
        Ok(by_target(best_first(anchor, &candidates, self.budget).0))
    }

    fn trees(&self) -> bool {
        true
    }
}

impl Tree {
    /// A sampled tree where the logits are ([`dflash_model::ops::sampled_tree`]): the
    /// drafter's distributions under the rule (a vocabulary head's spread over the
    /// vocabulary), the shape from each depth's top-K (K values per depth read back), then the
    /// draws the shape needs (a few tokens per depth read back); the distributions stay there
    /// for the walk. Example: budget 4, a shape of two nodes at depth 1 and one each at depths
    /// 2 and 3 → 3 × 2 draws made, 4 used, 6 + 5 uniform numbers drawn up front.
    fn sampled_on_device(
        &self,
        run: &mut Decoding<'_>,
        anchor: u32,
        logits: &Tensor,
    ) -> Result<Proposal> {
        let q = run.probs(logits)?;
        let q = match run.head() {
            Some(h) => h.spread(&q)?,
            None => q,
        };
        let (mut tree, needed) = sampled_shape(anchor, &top_k_rows(&q, self.k())?, self.budget);
        let needed: Vec<usize> = needed.into_iter().take_while(|&n| n > 0).collect();
        let draws = needed.len() * needed.iter().copied().max().unwrap_or(0);
        let u = run.sampler.uniforms(draws + tree.len());
        let u = Uniforms::new(&u, &run.target.device)?;
        place_draws(&mut tree, &draw_distinct(&q, &u, 0, &needed)?);
        let judge = Judge::TreeOnDevice { q, u, from: draws };
        Ok(Proposal::drafted(tree, judge))
    }
}
