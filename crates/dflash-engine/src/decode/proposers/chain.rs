//! The chains: DFlash's (the drafter's arg-max or draws, its round kept on the device where it
//! can be) and DFlash2's (its candidate selector's walk, on the host).

use anyhow::Result;
use candle_core::Tensor;
use dflash_core::selector;
use dflash_core::tree::DraftTree;
use dflash_model::ops::argmax::argmax_rows_kept;
use dflash_model::ops::sample_rows::{draw_rows, Uniforms};

use super::{by_target, Decoding, Proposer};
use crate::decode::proposal::{DeviceRound, Judge, OnDevice, Proposal, StagedVerify};
use dflash_model::models::drafter::Drafter;

/// DFlash: the chain of the drafter's `B - 1` drafts below the anchor, its arg-max (T = 0 and
/// the exact match) or its draws (the residual rule at T > 0).
///
/// Its round stays on the device unless `DFLASH_DISABLED_KERNELS=one-sync` (or
/// `DecodeOptions::drafts_to_host`) asks for the host's path: it reads the device once, after
/// the verify: at T = 0 the drafts and the target's arg-max of every row; at T > 0 under the
/// residual rule the drafts, each one's verdict and bonus
/// ([`dflash_model::ops::sample_rows`]) and the last row's draw; under the exact match the
/// drafts and the target's draw at every row — instead of the drafts after the draft and the
/// target's tokens (T = 0) or full rows of logits (T > 0) after the verify. Example: B = 16 at
/// T > 0 → 15 drafts, 30 verdicts and bonuses and 1 draw, 46 indices, leave the device once per
/// round (31 under the exact match).
pub(in crate::decode) struct Chain;

impl Proposer for Chain {
    fn propose(&mut self, run: &mut Decoding<'_>, depth: usize) -> Result<Proposal> {
        let (anchor, positions) = (run.anchor(), depth - 1);
        if run.one_sync && run.own_verify {
            // a round on the device stages its verify (the chain's shape, placeholder tokens)
            // before its draft is queued
            let staged = run.stage_verify(&DraftTree::chain(anchor, &vec![anchor; positions]))?;
            let (_, logits) = run.draft(depth, positions)?;
            return on_device(run, anchor, &logits, staged);
        }
        let (_, logits) = run.draft(depth, positions)?;
        if run.samples_drafts() {
            let qs = run.draft_distributions(&logits)?;
            let chain: Vec<u32> = qs.iter().map(|q| run.sampler.draw_draft(q)).collect();
            return Ok(Proposal::drafted(
                DraftTree::chain(anchor, &chain),
                Judge::Chain(qs),
            ));
        }
        greedy_chain(run, &logits)
    }
}

/// The chain of the drafter's arg-max below the anchor, from its `logits` `[positions, vocab]`
/// (a vocabulary head's columns mapped to its tokens), judged by the target's own tokens.
pub(in crate::decode) fn greedy_chain(run: &Decoding<'_>, logits: &Tensor) -> Result<Proposal> {
    let token = run.token_of();
    let chain: Vec<u32> = Drafter::argmax_rows(logits)?
        .into_iter()
        .map(token)
        .collect();
    Ok(by_target(DraftTree::chain(run.anchor(), &chain)))
}

/// A chain kept on the device: the drafts stay where the logits are; the tree holds
/// placeholders until the verify reads them back with the target's verdicts (one transfer per
/// round).
fn on_device(
    run: &mut Decoding<'_>,
    anchor: u32,
    logits: &Tensor,
    staged: StagedVerify,
) -> Result<Proposal> {
    let n = logits.dim(0)?;
    let (drafts, judged_by) = if !run.samples_drafts() {
        let best = argmax_rows_kept(logits)?;
        // at T > 0 (the exact match) every verify row draws the target's token
        let judged_by = match run.sampler.params.is_greedy() {
            true => OnDevice::Argmax,
            false => OnDevice::Draws(Uniforms::new(
                &run.sampler.uniforms(n + 1),
                &run.target.device,
            )?),
        };
        // a vocabulary head's columns are its tokens' indices
        match run.head() {
            Some(h) => (h.tokens_of(&best)?, judged_by),
            None => (best, judged_by),
        }
    } else {
        let u = Uniforms::new(&run.sampler.uniforms(3 * n + 1), &run.target.device)?;
        let q = run.probs(logits)?;
        let drawn = draw_rows(&q, &u, 0)?;
        // a vocabulary head's columns are ascending token ids: drawn there, then spread
        match run.head() {
            Some(h) => (h.tokens_of(&drawn)?, OnDevice::Judge(h.spread(&q)?, u)),
            None => (drawn, OnDevice::Judge(q, u)),
        }
    };
    let round = DeviceRound {
        drafts,
        judged_by,
        staged,
    };
    Ok(Proposal::drafted(
        DraftTree::chain(anchor, &vec![anchor; n]),
        Judge::Device(round),
    ))
}

/// DFlash2: the chain is its candidate selector's walk ([`dflash_core::selector`]): greedy at
/// T = 0 (and under the exact match), sampled at T > 0 under the residual rule, which then
/// judges each draft against the selector's `q` over its candidates, as z-lab's
/// `_rejection_sample` does. Its walk is the host's, so its rounds stay there.
pub(in crate::decode) struct Selector;

impl Proposer for Selector {
    fn propose(&mut self, run: &mut Decoding<'_>, depth: usize) -> Result<Proposal> {
        let anchor = run.anchor();
        let (hidden, logits) = run.draft(depth, depth - 1)?;
        let steps = run.selector_steps(&hidden, &logits)?;
        if run.samples_drafts() {
            let draw = run.sampler.walk_selector(&steps, run.target.vocab_size());
            return Ok(Proposal::drafted(
                DraftTree::chain(anchor, &draw.tokens),
                Judge::Chain(draw.qs),
            ));
        }
        Ok(by_target(DraftTree::chain(
            anchor,
            &selector::walk_greedy(&steps),
        )))
    }
}
