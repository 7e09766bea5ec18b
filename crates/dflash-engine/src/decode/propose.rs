//! Stage 1 of a round, propose: the drafter's chain or tree below the anchor (or `--mode auto`'s
//! choice among them), and how a round stays on the device.

use super::*;

impl Decoding<'_> {
    /// Stage 1, propose: the drafter's chain or tree below the anchor (AR: the anchor alone).
    pub(super) fn propose(&mut self, depth: usize) -> Result<DraftTree> {
        let anchor = *self.new_tokens.last().unwrap();
        self.drafted = false;
        let d = match (self.drafter, depth > 1) {
            (Some(d), true) => d,
            _ => return Ok(DraftTree::chain(anchor, &[])),
        };
        if !self.auto_drafts() {
            return Ok(DraftTree::chain(anchor, &[]));
        }
        self.drafted = true;
        let positions = self.positions(depth);
        let at = BlockAt {
            token: anchor,
            anchor: self.start,
            block: depth,
            positions,
        };
        // a round on the device stages its verify (the chain's shape, placeholder tokens)
        // before its draft is queued
        let staged = match self.round_on_device() {
            true => Some(self.stage_verify(&DraftTree::chain(anchor, &vec![anchor; positions]))?),
            false => None,
        };
        let (cache, ctx) = (
            self.draft_cache.as_mut().unwrap(),
            self.ctx.as_ref().unwrap(),
        );
        let (hidden, logits) = match self.draft_graph.as_mut() {
            Some(g) => g.draft_rows(d, self.target, self.head.as_ref(), cache, ctx, at)?,
            None => d.draft_rows(self.target, self.head.as_ref(), cache, ctx, at)?,
        };
        // logit column → token (the vocabulary head's columns are its subset)
        let head = self.head.as_ref();
        let token = |j: u32| head.map_or(j, |h| h.token(j));
        if let Some(sel) = d.selector.as_ref() {
            let steps = sel.steps(&hidden, &logits, anchor, token)?;
            match self.mode {
                // DDTree at T > 0 draws each depth from the draft logits as a DFlash drafter
                // does (below): the selector's edge term needs a drawn predecessor, which a
                // per-depth draw does not fix
                Mode::Tree { .. } if self.samples_drafts() => {}
                Mode::Tree { budget, .. } => {
                    return Ok(DraftTree::build_conditional(
                        anchor,
                        steps.len(),
                        budget,
                        |depth, parent| selector::children(&steps, depth, parent),
                    ));
                }
                Mode::Auto { max_budget, .. } => {
                    let scored =
                        DraftTree::build_scored(anchor, steps.len(), max_budget, |d, p| {
                            selector::children(&steps, d, p)
                        });
                    return Ok(self.choose_auto(scored));
                }
                _ if self.samples_drafts() => {
                    let draw = self.sampler.walk_selector(&steps, self.target.vocab_size());
                    self.sampled = Some(Sampled::Chain(draw.qs));
                    return Ok(DraftTree::chain(anchor, &draw.tokens));
                }
                _ => return Ok(DraftTree::chain(anchor, &selector::walk_greedy(&steps))),
            }
        }
        if let Some(staged) = staged {
            return self.device_proposal(anchor, &logits, staged);
        }
        match self.samples_drafts() {
            true => self.sampled_proposal(anchor, &logits),
            false => self.greedy_proposal(anchor, &logits),
        }
    }

    /// A chain kept on the device (see [`Self::round_on_device`]): the drafts stay where the
    /// logits are; the tree holds placeholders until the verify reads them back with the
    /// target's verdicts (one transfer per round).
    fn device_proposal(
        &mut self,
        anchor: u32,
        logits: &Tensor,
        staged: StagedVerify,
    ) -> Result<DraftTree> {
        let n = logits.dim(0)?;
        let (drafts, judged_by) = if !self.samples_drafts() {
            let best = dflash_model::ops::argmax::argmax_rows_kept(logits)?;
            // at T > 0 (the exact match) every verify row draws the target's token
            let judged_by = match self.sampler.params.is_greedy() {
                true => OnDevice::Argmax,
                false => OnDevice::Draws(Uniforms::new(
                    &self.sampler.uniforms(n + 1),
                    &self.target.device,
                )?),
            };
            // a vocabulary head's columns are its tokens' indices
            match self.head.as_ref() {
                Some(h) => (h.tokens_of(&best)?, judged_by),
                None => (best, judged_by),
            }
        } else {
            let u = Uniforms::new(&self.sampler.uniforms(3 * n + 1), &self.target.device)?;
            let q = self.probs(logits)?;
            let drawn = draw_rows(&q, &u, 0)?;
            // a vocabulary head's columns are ascending token ids: drawn there, then spread
            match self.head.as_ref() {
                Some(h) => (h.tokens_of(&drawn)?, OnDevice::Judge(h.spread(&q)?, u)),
                None => (drawn, OnDevice::Judge(q, u)),
            }
        };
        self.device_round = Some(DeviceRound {
            drafts,
            judged_by,
            staged,
        });
        Ok(DraftTree::chain(anchor, &vec![anchor; n]))
    }

    /// A round's drafts drawn from the drafter's distributions (speculative sampling at T > 0):
    /// a DDTree's sampled tree (on the device where rounds stay there), or a chain of draws.
    fn sampled_proposal(&mut self, anchor: u32, logits: &Tensor) -> Result<DraftTree> {
        if let (Mode::Tree { budget, top_k, .. }, true) = (self.mode, self.one_sync) {
            return self.sampled_tree_on_device(anchor, logits, budget, top_k);
        }
        let qs = self.draft_distributions(logits)?;
        Ok(match self.mode {
            Mode::Tree { budget, top_k, .. } => {
                let k = if top_k == 0 { budget } else { top_k };
                let st = self.sampler.sampled_tree(anchor, qs, budget, k);
                let tree = st.tree.clone();
                self.sampled = Some(Sampled::Tree(st));
                tree
            }
            _ => {
                let chain: Vec<u32> = qs.iter().map(|q| self.sampler.draw_draft(q)).collect();
                self.sampled = Some(Sampled::Chain(qs));
                DraftTree::chain(anchor, &chain)
            }
        })
    }

    /// A round's greedy drafts: DDTree's best-first tree of the top-K per depth (auto's cut to
    /// its chosen budget), or the chain of arg-maxes.
    fn greedy_proposal(&mut self, anchor: u32, logits: &Tensor) -> Result<DraftTree> {
        // logit column → token (the vocabulary head's columns are its subset); the candidates
        // picked where the log-probabilities are: k per row leave it
        let head = self.head.as_ref();
        let token = |j: u32| head.map_or(j, |h| h.token(j));
        let top = |k: usize| -> Result<Vec<Vec<(u32, f32)>>> {
            let mut top = top_k_rows(&Drafter::log_probs(logits)?, k)?;
            top.iter_mut().flatten().for_each(|(j, _)| *j = token(*j));
            Ok(top)
        };
        Ok(match self.mode {
            Mode::Tree { budget, top_k, .. } => {
                let k = if top_k == 0 { budget } else { top_k };
                DraftTree::build(anchor, &top(k)?, budget)
            }
            Mode::Auto { max_budget, .. } => {
                let top = top(max_budget)?;
                let scored = DraftTree::build_scored(anchor, top.len(), max_budget, |d, _| {
                    top[d - 1].clone()
                });
                self.choose_auto(scored)
            }
            _ => {
                let chain: Vec<u32> = Drafter::argmax_rows(logits)?
                    .into_iter()
                    .map(token)
                    .collect();
                DraftTree::chain(anchor, &chain)
            }
        })
    }

    /// Whether this round drafts: always, but under `--mode auto` while drafting does not pay
    /// (an AR step without a draft; the draft graph's context block holds one round's rows, so
    /// with graphs every round drafts).
    fn auto_drafts(&mut self) -> bool {
        let graph = self.draft_graph.is_some();
        let Some(a) = self.auto.as_mut() else {
            return true;
        };
        a.drafted = a.policy.drafts() || graph;
        (a.budget, a.expected) = (0, 0.0);
        a.drafted
    }

    /// Positions a round of `depth` rows drafts: a tree of `budget` nodes is at most `budget`
    /// deep (the distributions below are never read); auto's trees as deep as its recent
    /// budgets need, except under the fixed-shape draft graph (the same rows every round).
    fn positions(&self, depth: usize) -> usize {
        match (self.mode, &self.auto, self.draft_graph.is_some()) {
            (Mode::Tree { budget, .. }, _, _) => budget.min(depth - 1),
            (Mode::Auto { .. }, Some(a), false) => a.policy.positions().min(depth - 1),
            (Mode::Auto { max_budget, .. }, _, _) => max_budget.min(depth - 1),
            _ => depth - 1,
        }
    }

    /// `--mode auto`'s tree: the first nodes of the best-first tree of the largest budget, as
    /// many as the policy chooses from their expected acceptance ([`dflash_core::auto`]).
    pub(super) fn choose_auto(&mut self, (tree, scores): (DraftTree, Vec<f64>)) -> DraftTree {
        let a = self.auto.as_mut().expect("auto mode has its policy");
        let expected = dflash_core::auto::expected_accepted(&scores);
        a.budget = a.policy.choose(&expected);
        a.expected = expected[a.budget];
        dflash_core::auto::first_nodes(&tree, a.budget + 1)
    }

    /// Tell `--mode auto`'s policy what the round did and cost.
    pub(super) fn observe_auto(&mut self, r: &RoundOutcome) {
        if let Some(a) = self.auto.as_mut() {
            a.policy.observe(
                a.drafted,
                a.budget,
                a.expected,
                r.accepted,
                r.tau_round,
                r.draft_secs,
                r.verify_secs,
                r.other_secs,
            );
        }
    }

    /// A DDTree's sampled round where the logits are ([`dflash_model::ops::sampled_tree`]):
    /// the drafter's distributions under the rule (a vocabulary head's spread over the
    /// vocabulary), the shape from each depth's top-K (K values per depth read back), then the
    /// draws the shape needs (a few tokens per depth read back); the distributions stay there
    /// for the walk. Example: budget 4, a shape of two nodes at depth 1 and one each at depths
    /// 2 and 3 → 3 × 2 draws made, 4 used, 6 + 5 uniform numbers drawn up front.
    pub(super) fn sampled_tree_on_device(
        &mut self,
        anchor: u32,
        logits: &Tensor,
        budget: usize,
        top_k: usize,
    ) -> Result<DraftTree> {
        let q = self.probs(logits)?;
        let q = match self.head.as_ref() {
            Some(h) => h.spread(&q)?,
            None => q,
        };
        let k = if top_k == 0 { budget } else { top_k };
        let (mut tree, needed) = sampled_shape(anchor, &top_k_rows(&q, k)?, budget);
        let needed: Vec<usize> = needed.into_iter().take_while(|&n| n > 0).collect();
        let draws = needed.len() * needed.iter().copied().max().unwrap_or(0);
        let u = self.sampler.uniforms(draws + tree.len());
        let u = Uniforms::new(&u, &self.target.device)?;
        place_draws(&mut tree, &draw_distinct(&q, &u, 0, &needed)?);
        self.sampled = Some(Sampled::TreeOnDevice { q, u, from: draws });
        Ok(tree)
    }

    /// The drafter's distribution at each drafted position under the request's rule, dense
    /// over the target's vocabulary (a vocabulary head's columns scattered to their tokens).
    pub(super) fn draft_distributions(&self, logits: &Tensor) -> Result<Vec<Vec<f32>>> {
        let vocab = self.target.vocab_size();
        Drafter::rows_f32(logits)?
            .iter()
            .map(|r| {
                let q_cols = self.sampler.draft_distribution(r);
                Ok(match self.head.as_ref() {
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

    /// Whether this round's chain stays on the device: a DFlash chain of a drafter without a
    /// candidate selector (its walk is the host's), greedy or sampled, unless
    /// `DFLASH_DISABLED_KERNELS=one-sync` asks for the host's path.
    /// Its round reads the device once, after the verify: at T = 0 the drafts and the
    /// target's arg-max of every row; at T > 0 under the residual rule the drafts, each one's
    /// verdict and bonus ([`dflash_model::ops::sample_rows`]) and the last row's draw; under
    /// the exact match the drafts and the target's draw at every row — instead of the drafts
    /// after the draft and the target's tokens (T = 0) or full rows of logits (T > 0) after
    /// the verify. Example: B = 16 at T > 0 → 15 drafts, 30 verdicts and bonuses and 1 draw,
    /// 46 indices, leave the device once per round (31 under the exact match).
    pub(super) fn round_on_device(&self) -> bool {
        self.one_sync
            && !matches!(self.mode, Mode::Tree { .. } | Mode::Auto { .. })
            && self.drafter.is_some_and(|d| d.selector.is_none())
    }

    /// Whether draws at T > 0 happen on the device (every rule does, unless
    /// `DFLASH_DISABLED_KERNELS=one-sync` asks for the host's path).
    pub(super) fn samples_on_device(&self) -> bool {
        self.one_sync && !self.sampler.params.is_greedy()
    }

    /// Each row's distribution under the request's rule, where the logits are
    /// ([`dflash_model::ops::sample_rows::rule_probs`]).
    pub(super) fn probs(&self, logits: &Tensor) -> Result<Tensor> {
        let p = self.sampler.params;
        Ok(rule_probs(logits, p.temperature, p.top_k, p.top_p)?)
    }

    /// Whether this round's drafts are drawn from the drafter's distribution (speculative
    /// sampling at T > 0: a chain, or a tree by [`dflash_core::sampled_tree`]) rather than its
    /// argmax or top-K.
    pub(super) fn samples_drafts(&self) -> bool {
        !self.sampler.params.is_greedy() && self.acceptance == Acceptance::Residual
    }

    /// A verify's inputs for `tree`, built and uploaded now ([`StagedVerify`]).
    pub(super) fn stage_verify(&self, tree: &DraftTree) -> Result<StagedVerify> {
        let cache_len = self.cache.len();
        let (positions, visibility) = (tree.positions(self.start), tree.visibility(cache_len));
        Ok(match self.graphed.as_ref() {
            Some(g) => StagedVerify::Graphed(g.stage(
                self.target,
                &tree.tokens,
                &positions,
                &visibility,
                cache_len,
            )?),
            None => StagedVerify::Eager(self.target.prepare(
                &tree.tokens,
                &positions,
                std::slice::from_ref(&visibility),
                cache_len,
                None,
            )?),
        })
    }
}
