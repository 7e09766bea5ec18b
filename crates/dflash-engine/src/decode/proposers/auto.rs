//! `--mode auto`: each round the tree budget with the most expected tokens for its cost, or no
//! draft while drafting does not pay ([`dflash_core::auto`]).

use anyhow::Result;
use dflash_core::auto::{self, AutoPolicy, AutoStats};
use dflash_core::stats::RoundOutcome;
use dflash_core::tree::DraftTree;

use super::{best_first, by_target, Acceptance, Decoding, Proposer};
use crate::decode::proposal::Proposal;

/// `--mode auto`'s proposer: the first nodes of the best-first tree of the largest budget
/// (DDTree's candidates, or a DFlash2 drafter's selector's), as many as its policy chooses;
/// greedy trees, walked by the exact match at every temperature. Example: the best-first tree
/// `x → a → b` plus `x → c`, node order [x, a, b, c], and the policy's budget 2 → the round
/// verifies [x, a, b]; while drafting does not pay, the round is [x] alone and the drafter
/// does not run.
pub(in crate::decode) struct Auto {
    policy: AutoPolicy,
    max_budget: usize,
    /// This round's choice: whether it drafted, its budget and the drafter's raw expectation
    /// for it (what the policy learns from, once the round is committed).
    drafted: bool,
    budget: usize,
    expected: f64,
}

impl Auto {
    pub(in crate::decode) fn new(max_budget: usize) -> Self {
        Self {
            policy: AutoPolicy::new(max_budget),
            max_budget,
            drafted: false,
            budget: 0,
            expected: 0.0,
        }
    }

    /// Whether this round drafts: while drafting pays (an AR step without a draft otherwise;
    /// the draft graph's context block holds one round's rows, so with graphs every round
    /// drafts).
    fn drafts(&mut self, graph: bool) -> bool {
        self.drafted = self.policy.drafts() || graph;
        (self.budget, self.expected) = (0, 0.0);
        self.drafted
    }

    /// The tree: the first nodes of the best-first tree of the largest budget, as many as the
    /// policy chooses from their expected acceptance.
    fn choose(&mut self, (tree, scores): (DraftTree, Vec<f64>)) -> DraftTree {
        let expected = auto::expected_accepted(&scores);
        self.budget = self.policy.choose(&expected);
        self.expected = expected[self.budget];
        auto::first_nodes(&tree, self.budget + 1)
    }
}

impl Proposer for Auto {
    fn propose(&mut self, run: &mut Decoding<'_>, depth: usize) -> Result<Proposal> {
        let anchor = run.anchor();
        let graph = run.drafting.as_ref().is_some_and(|d| d.graph.is_some());
        if !self.drafts(graph) {
            return Ok(Proposal::anchor_alone(anchor));
        }
        // trees as deep as the recent budgets need, except under the fixed-shape draft graph
        // (the same rows every round)
        let positions = match graph {
            true => self.max_budget.min(depth - 1),
            false => self.policy.positions().min(depth - 1),
        };
        let (hidden, logits) = run.draft(depth, positions)?;
        let candidates = run.candidates(&hidden, &logits, self.max_budget)?;
        let tree = self.choose(best_first(anchor, &candidates, self.max_budget));
        Ok(by_target(tree))
    }

    fn acceptance(&self, _asked: Acceptance) -> Acceptance {
        // its trees are greedy, which the exact match walks at T > 0
        Acceptance::ExactMatch
    }

    fn trees(&self) -> bool {
        true
    }

    fn observe(&mut self, r: &RoundOutcome) {
        self.policy.observe(
            self.drafted,
            self.budget,
            self.expected,
            r.accepted,
            r.tau_round,
            r.draft_secs,
            r.verify_secs,
            r.other_secs,
        );
    }

    fn stats(&self) -> Option<AutoStats> {
        Some(self.policy.stats())
    }
}
