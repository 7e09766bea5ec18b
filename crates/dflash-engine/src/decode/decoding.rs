//! The loop's state from the prompt on: the prefill (caches, fixed-shape forwards, the first
//! token), the rules every stage shares, and the forwards a generation leaves for the next.

use std::time::Instant;

use dflash_model::ops::sample_rows::rule_probs;
use dflash_model::Rows;

use super::proposal::StagedVerify;
use super::*;
use crate::graph_cache::{self, Kept};

impl<'a> Decoding<'a> {
    /// Check the request, prefill the whole prompt (causal, taps of every prompt row) and
    /// sample the first token: the first round's anchor. `kept`: the fixed-shape forwards an
    /// earlier generation left ([`GraphCache`]); they serve this one when `keep` and they fit.
    pub(super) fn prefill(
        target: &'a Target,
        drafter: Option<&'a Drafter>,
        mode: Mode,
        req: &Request,
        opts: DecodeOptions,
        kept: Option<Kept>,
        keep: bool,
    ) -> Result<Self> {
        check_request(target, req)?;
        let drafter = drafter_for(mode, drafter)?;
        let taps: Vec<usize> = drafter
            .map(|d| d.target_layer_ids.clone())
            .unwrap_or_default();
        let mut sampler = Sampler::new(req.sampling);
        let (rows, block) = (verify_rows(mode), mode.block());
        let (cap, draft_cap) = capacities(req, rows, block, keep);
        let owner = graph_cache::owner(target, drafter);
        let kept = match kept {
            Some(k) if keep => k.take_for(owner, rows, block, cap, draft_cap)?,
            _ => None,
        };
        let reused = kept.is_some();
        let (mut cache, kept_graphed, kept_draft, kept_head) = match kept {
            Some(k) => (k.cache, Some(k.graphed), k.draft, k.head),
            None => (target.new_cache(), None, None, None),
        };

        let t0 = Instant::now();
        let out = target.forward_causal(&req.prompt_ids, &mut cache, &taps, &Rows::Last)?;
        let first = sampler.sample(&row(out.logits.as_ref().unwrap(), 0)?);
        let ctx = match drafter {
            Some(_) => Some(Target::concat_taps(&out.taps)?.unsqueeze(0)?),
            None => None,
        };
        let graphed = match (opts.cuda_graphs, kept_graphed) {
            (true, Some(g)) => Some(g),
            // chains (AR, DFlash) attend over each row's interval of keys; trees need the mask
            (true, None) => {
                let g = GraphedForward::new(&mut cache, cap, rows)?;
                Some(match mode {
                    Mode::Tree { .. } | Mode::Auto { .. } => g,
                    _ => g.chains(),
                })
            }
            _ => None,
        };
        let draft = draft_forwards(drafter, kept_draft, opts.cuda_graphs, draft_cap, block)?;
        let prefill_secs = t0.elapsed().as_secs_f64();
        let mut loops = LoopDetector::new(req.loop_window);
        let looped = loops.push(first);
        let head = draft_head(target, drafter, kept_head, keep, &req.prompt_ids)?;
        let drafting = match (drafter, draft, ctx) {
            (Some(drafter), Some((cache, graph)), Some(ctx)) => Some(Drafting {
                drafter,
                cache,
                graph,
                head,
                ctx,
            }),
            _ => None,
        };
        Ok(Self {
            target,
            drafting,
            req: req.clone(),
            taps,
            sampler,
            cache,
            graphed,
            keep,
            reused,
            block,
            rows,
            acceptance: opts.acceptance,
            one_sync: !opts.drafts_to_host && one_sync_on(),
            own_verify: true,
            start: req.prompt_ids.len(),
            stopped: req.stop_ids.contains(&first) || looped,
            looped,
            loops,
            new_tokens: vec![first],
            rounds: Vec::new(),
            prefill_secs,
        })
    }

    /// The fixed-shape forwards for the next generation ([`GraphCache`]), when they are kept:
    /// the target's cache and verify graphs, and the drafter's cache and draft graph.
    pub(super) fn take_kept(&mut self) -> Option<Kept> {
        if !self.keep {
            return None;
        }
        let owner = graph_cache::owner(self.target, self.drafting.as_ref().map(|d| d.drafter));
        let graphed = self.graphed.take()?;
        let (draft, head) = match self.drafting.take() {
            Some(d) => (d.graph.map(|g| (d.cache, g)), d.head),
            None => (None, None),
        };
        Some(Kept {
            owner,
            rows: self.rows,
            block: self.block,
            cache: std::mem::replace(&mut self.cache, KvCache::new(0)),
            graphed,
            draft,
            head,
        })
    }

    /// The next round's depth (rows of its block, cut at the length cap), or `None` when the
    /// generation is done.
    pub(super) fn next_depth(&self) -> Option<usize> {
        let max_len = self.req.prompt_ids.len() + self.req.max_new_tokens;
        (self.start + 1 < max_len && !self.stopped).then(|| self.block.min(max_len - self.start))
    }

    /// The anchor: the last committed token, the root of the next proposal.
    pub(super) fn anchor(&self) -> u32 {
        *self.new_tokens.last().unwrap()
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

    /// Whether a round's drafts are drawn from the drafter's distribution (speculative
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

/// The drafter a generation of `mode` uses (none for AR), or why the mode cannot run.
fn drafter_for(mode: Mode, drafter: Option<&Drafter>) -> Result<Option<&Drafter>> {
    let block_size = mode.block();
    if block_size == 0 {
        bail!("block size must be >= 1");
    }
    if let Mode::Tree { budget: 0, .. } = mode {
        bail!("the tree budget must be >= 1");
    }
    let drafter = match (drafter, block_size > 1) {
        (Some(d), true) => Some(d),
        (None, true) => bail!("{} needs a drafter", mode.name()),
        _ => None,
    };
    if let Some(d) = drafter {
        if block_size > d.block_size {
            tracing::warn!(
                "block size {block_size} is larger than the drafter's trained block {}",
                d.block_size
            );
        }
    }
    Ok(drafter)
}

/// The target's and the drafter's cache capacities under fixed-shape forwards: the draft
/// block as one graph is a round's context rows (at most a block) padded to a block, then the
/// block, after at most `prompt + max_new_tokens` rows; kept ones rounded up
/// ([`graph_cache::rounded`]). Example: 20 + 64 tokens, rows 16, block 16 → 100 and 116.
fn capacities(req: &Request, rows: usize, block: usize, keep: bool) -> (usize, usize) {
    let max_len = req.prompt_ids.len() + req.max_new_tokens;
    let (cap, draft_cap) = (max_len + rows, max_len + 2 * block);
    match keep {
        true => (graph_cache::rounded(cap), graph_cache::rounded(draft_cap)),
        false => (cap, draft_cap),
    }
}

/// The drafter's cache and its fixed-shape block (`--cuda-graphs`): the kept ones, or new.
fn draft_forwards(
    drafter: Option<&Drafter>,
    kept: Option<(KvCache, GraphedDraft)>,
    cuda_graphs: bool,
    draft_cap: usize,
    block: usize,
) -> Result<Option<(KvCache, Option<GraphedDraft>)>> {
    let Some(d) = drafter else {
        return Ok(None);
    };
    let (mut cache, graph) = match kept {
        Some((c, g)) => (c, Some(g)),
        None => (d.new_cache(), None),
    };
    let graph = match (cuda_graphs, graph) {
        (true, Some(g)) => Some(g),
        (true, None) => Some(GraphedDraft::new(&mut cache, draft_cap, block)?),
        _ => None,
    };
    Ok(Some((cache, graph)))
}

/// The drafter's vocabulary head, when it drafts a subset: the kept head is the one the kept
/// draft graph reads; a head built for this generation alone also drafts the prompt's tokens
/// (`DraftVocab::with_tokens`), one kept for later generations (their graphs read its rows)
/// the subset alone.
fn draft_head(
    target: &Target,
    drafter: Option<&Drafter>,
    kept: Option<DraftHead>,
    keep: bool,
    prompt: &[u32],
) -> Result<Option<DraftHead>> {
    Ok(match (kept, drafter.and_then(|d| d.draft_vocab.as_ref())) {
        (Some(h), _) => Some(h),
        (None, Some(v)) if keep || prompt_tokens_off() => Some(DraftHead::new(target, v)?),
        (None, Some(v)) => Some(DraftHead::new(target, &v.with_tokens(prompt))?),
        (None, None) => None,
    })
}
