//! Stage 1 of a round, propose: one type per method. [`Ar`] proposes the anchor alone;
//! [`Chain`] the DFlash drafter's chain (kept on the device where it can be); [`Selector`]
//! DFlash2's chain, its candidate selector's walk; [`Tree`] DDTree's best-first tree;
//! [`Auto`] `--mode auto`'s tree of the budget its policy chooses, or no draft. Each returns a
//! [`Proposal`] carrying what its walk needs. Adding a method is adding a type here and its
//! arm in [`for_mode`].
//!
//! Example: `--mode ddtree:4` with a DFlash2 drafter at T = 0 → [`Tree`] drafts the block,
//! ranks each node's children with the selector after the node's own token, and proposes the 4
//! best prefixes, judged by the target's arg-max per row.

use anyhow::Result;
use candle_core::Tensor;
use dflash_core::auto::AutoStats;
use dflash_core::selector::{self, SelectorStep};
use dflash_core::stats::RoundOutcome;
use dflash_core::tree::DraftTree;
use dflash_model::models::draft_vocab::DraftHead;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_model::ops::top_k::top_k_rows;

use super::{Acceptance, Decoding, Judge, Mode, Proposal};

mod auto;
mod chain;
mod tree;

pub(super) use auto::Auto;
pub(super) use chain::{greedy_chain, Chain, Selector};
pub(super) use tree::Tree;

/// How one method proposes a round. The loop calls [`Proposer::propose`] for rounds of at
/// least 2 rows; a shorter round (the last token) is the anchor alone whatever the method.
pub(super) trait Proposer: Send {
    /// The round's proposal below the anchor: at most `depth` rows (`depth` ≥ 2).
    fn propose(&mut self, run: &mut Decoding<'_>, depth: usize) -> Result<Proposal>;

    /// The acceptance rule the method's proposals are judged by at T > 0, given the one asked
    /// for.
    fn acceptance(&self, asked: Acceptance) -> Acceptance {
        asked
    }

    /// Whether its rounds are trees (their size goes into each round's outcome).
    fn trees(&self) -> bool {
        false
    }

    /// What the round did and cost, once it is committed.
    fn observe(&mut self, _round: &RoundOutcome) {}

    /// Its choices over the generation, where it makes any (`--mode auto`).
    fn stats(&self) -> Option<AutoStats> {
        None
    }
}

/// The proposer of `mode` with this drafter: a chain with a candidate selector (DFlash2) is
/// its walk, without one the drafter's arg-max or draws.
pub(super) fn for_mode(mode: Mode, drafter: Option<&Drafter>) -> Box<dyn Proposer> {
    let selector = drafter.is_some_and(|d| d.selector.is_some());
    match mode {
        Mode::Ar => Box::new(Ar),
        Mode::Chain { .. } if selector => Box::new(Selector),
        Mode::Chain { .. } => Box::new(Chain),
        Mode::Tree { budget, top_k, .. } => Box::new(Tree { budget, top_k }),
        Mode::Auto { max_budget, .. } => Box::new(Auto::new(max_budget)),
    }
}

/// Plain autoregressive decoding, the degenerate proposer: every round is the anchor alone
/// (its block is 1, so the loop never asks it for more).
pub(super) struct Ar;

impl Proposer for Ar {
    fn propose(&mut self, run: &mut Decoding<'_>, _depth: usize) -> Result<Proposal> {
        Ok(Proposal::anchor_alone(run.anchor()))
    }
}

/// A tree's candidates below each node: the drafter's top-K per depth (every node of a depth
/// has the same list), or DFlash2's selector ranking them after the node's own token.
enum Candidates {
    PerDepth(Vec<Vec<(u32, f32)>>),
    Selector(Vec<SelectorStep>),
}

impl Candidates {
    /// How deep a tree can go.
    fn depths(&self) -> usize {
        match self {
            Candidates::PerDepth(top) => top.len(),
            Candidates::Selector(steps) => steps.len(),
        }
    }

    /// The sorted (token, log-prob) children at `depth` (1-based) below a node whose token is
    /// `parent` ([`DraftTree::build_conditional`]'s `children`).
    fn children(&self, depth: usize, parent: u32) -> Vec<(u32, f32)> {
        match self {
            Candidates::PerDepth(top) => top[depth - 1].clone(),
            Candidates::Selector(steps) => selector::children(steps, depth, parent),
        }
    }
}

impl Decoding<'_> {
    /// The drafter's block below the anchor: a round of `depth` rows of which `positions` are
    /// drafted; the drafted rows' hidden states and logits ([`Drafter::draft_rows`], through
    /// the fixed-shape block where there is one).
    fn draft(&mut self, depth: usize, positions: usize) -> Result<(Tensor, Tensor)> {
        let at = BlockAt {
            token: self.anchor(),
            anchor: self.start,
            block: depth,
            positions,
        };
        let dr = self
            .drafting
            .as_mut()
            .expect("a drafting mode has its drafter");
        let (d, head) = (dr.drafter, dr.head.as_ref());
        Ok(match dr.graph.as_mut() {
            Some(g) => g.draft_rows(d, self.target, head, &mut dr.cache, &dr.ctx, at)?,
            None => d.draft_rows(self.target, head, &mut dr.cache, &dr.ctx, at)?,
        })
    }

    /// The drafter's vocabulary head, when it drafts a subset.
    pub(in crate::decode) fn head(&self) -> Option<&DraftHead> {
        self.drafting.as_ref().and_then(|d| d.head.as_ref())
    }

    /// Logit column → token (a vocabulary head's columns are its subset). Example: a head of
    /// tokens [7, 19, 40] maps column 1 to 19; without a head, column 1 is token 1.
    pub(in crate::decode) fn token_of(&self) -> impl Fn(u32) -> u32 + '_ {
        let head = self.head();
        move |j| head.map_or(j, |h| h.token(j))
    }

    /// A DFlash2 drafter's selector steps for this block ([`selector`]).
    fn selector_steps(&self, hidden: &Tensor, logits: &Tensor) -> Result<Vec<SelectorStep>> {
        let sel = self
            .drafting
            .as_ref()
            .and_then(|d| d.drafter.selector.as_ref());
        let sel = sel.expect("a selector proposal has its drafter's selector");
        sel.steps(hidden, logits, self.anchor(), self.token_of())
    }

    /// A tree's candidates: the selector's where the drafter has one, else the top `k` of
    /// each drafted row, picked where the log-probabilities are (k per row leave it).
    fn candidates(&self, hidden: &Tensor, logits: &Tensor, k: usize) -> Result<Candidates> {
        let has_selector = self
            .drafting
            .as_ref()
            .is_some_and(|d| d.drafter.selector.is_some());
        if has_selector {
            return Ok(Candidates::Selector(self.selector_steps(hidden, logits)?));
        }
        let token = self.token_of();
        let mut top = top_k_rows(&Drafter::log_probs(logits)?, k)?;
        top.iter_mut().flatten().for_each(|(j, _)| *j = token(*j));
        Ok(Candidates::PerDepth(top))
    }

    /// The drafter's distribution at each drafted position under the request's rule, dense
    /// over the target's vocabulary (a vocabulary head's columns scattered to their tokens).
    fn draft_distributions(&self, logits: &Tensor) -> Result<Vec<Vec<f32>>> {
        let vocab = self.target.vocab_size();
        Drafter::rows_f32(logits)?
            .iter()
            .map(|r| {
                let q_cols = self.sampler.draft_distribution(r);
                Ok(match self.head() {
                    Some(h) => {
                        let mut q = vec![0.0; vocab];
                        for (j, &x) in q_cols.iter().enumerate() {
                            q[h.token(j as u32) as usize] = x;
                        }
                        q
                    }
                    None => q_cols,
                })
            })
            .collect()
    }
}

/// A best-first tree of at most `budget` nodes from `candidates` below `anchor`, with each
/// node's cumulative log-probability ([`DraftTree::build_scored`]).
fn best_first(anchor: u32, candidates: &Candidates, budget: usize) -> (DraftTree, Vec<f64>) {
    DraftTree::build_scored(anchor, candidates.depths(), budget, |d, p| {
        candidates.children(d, p)
    })
}

/// How a proposal drafted greedily is judged: by the target's own token per row.
fn by_target(tree: DraftTree) -> Proposal {
    Proposal::drafted(tree, Judge::Target)
}
