//! One generation advanced a round at a time: [`super::generate`] runs a [`Session`] to its
//! end; the server runs one round between its other work, streams each round's tokens, and
//! moves a session into the AR batch ([`Session::into_live`]) when other requests arrive.

use std::time::Instant;

use anyhow::Result;
use dflash_core::stats::RoundOutcome;
use dflash_model::models::drafter::Drafter;
use dflash_model::{KvCache, Target};

use super::proposers::{self, Proposer};
use super::{DecodeOptions, Decoding, Generation, Mode, Proposal, Request};
use crate::batched::Live;
use crate::graph_cache::GraphCache;

/// A generation between rounds: the loop's state and the proposer of its mode. Example:
/// `start` prefills a 20-token prompt and samples the first token; each `round` then commits
/// 1 … B tokens (`new_tokens` grows by them) until `done`.
pub struct Session<'a> {
    pub(super) run: Decoding<'a>,
    pub(super) proposer: Box<dyn Proposer>,
    pub(super) decode_secs: f64,
}

impl<'a> Session<'a> {
    /// Check the request, prefill its prompt and sample its first token. With `graphs`, from
    /// the fixed-shape forwards kept there when they fit ([`Session::finish`] gives the
    /// session's back).
    pub fn start(
        target: &'a Target,
        drafter: Option<&'a Drafter>,
        mode: Mode,
        req: &Request,
        opts: DecodeOptions,
        graphs: Option<&mut GraphCache>,
    ) -> Result<Self> {
        let proposer = proposers::for_mode(mode, drafter);
        let opts = DecodeOptions {
            acceptance: proposer.acceptance(opts.acceptance),
            ..opts
        };
        let keep = graphs.is_some() && opts.cuda_graphs && !target.is_hybrid();
        let (kept, reused) = match graphs {
            Some(g) => (g.kept.take(), Some(&mut g.reused)),
            None => (None, None),
        };
        let run = Decoding::prefill(target, drafter, mode, req, opts, kept, keep)?;
        if let Some(r) = reused {
            *r += run.reused as usize;
        }
        Ok(Session {
            run,
            proposer,
            decode_secs: 0.0,
        })
    }

    /// The tokens committed so far (the first one from the prefill).
    pub fn new_tokens(&self) -> &[u32] {
        &self.run.new_tokens
    }

    /// Whether the generation ended (a stop token, its loop window, or its length).
    pub fn done(&self) -> bool {
        self.run.next_depth().is_none()
    }

    /// The rounds so far.
    pub fn rounds(&self) -> &[RoundOutcome] {
        &self.run.rounds
    }

    /// One round: propose, verify, walk, commit. `None` when the generation had ended.
    pub fn round(&mut self) -> Result<Option<&RoundOutcome>> {
        let Some(depth) = self.run.next_depth() else {
            return Ok(None);
        };
        let t = Instant::now();
        let run = &mut self.run;
        let mut proposal = match depth > 1 {
            true => self.proposer.propose(run, depth)?,
            // no room for drafts: the anchor alone, whatever the method
            false => Proposal::anchor_alone(run.anchor()),
        };
        let draft_secs = t.elapsed().as_secs_f64();
        let tv = Instant::now();
        let (out, cache_len) = run.verify(&mut proposal)?;
        let verify_secs = tv.elapsed().as_secs_f64();
        let to = Instant::now();
        let (path, bonus) = run.walk(&mut proposal, &out)?;
        let produced = run.commit(&proposal, &path, bonus, &out, cache_len)?;
        let size = proposal.tree.len() - 1;
        let round = RoundOutcome {
            drafted: size,
            accepted: path.len(),
            tau_round: produced,
            bonus: (produced == path.len() + 1).then_some(bonus),
            draft_secs,
            verify_secs,
            other_secs: to.elapsed().as_secs_f64(),
            tree_size: self.proposer.trees().then_some(size),
        };
        self.proposer.observe(&round);
        run.rounds.push(round);
        self.decode_secs += t.elapsed().as_secs_f64();
        Ok(self.run.rounds.last())
    }

    /// The generation as [`super::generate`] reports it. With `graphs`, the session's
    /// fixed-shape forwards go back there for the next generation when they are kept (it
    /// started from the same `graphs`, with [`DecodeOptions::cuda_graphs`]).
    pub fn finish(mut self, graphs: Option<&mut GraphCache>) -> Generation {
        if let Some(g) = graphs {
            g.kept = self.run.take_kept();
        }
        let run = self.run;
        Generation {
            new_tokens: run.new_tokens,
            rounds: run.rounds,
            prefill_secs: run.prefill_secs,
            decode_secs: self.decode_secs,
            stopped_by_token: run.stopped && !run.looped,
            stopped_by_loop: run.looped,
            auto: self.proposer.stats(),
        }
    }

    /// Continue this generation as AR in a [`crate::batched::Batch`] (`Batch::adopt`): its
    /// target cache (the committed rows, the last token not in it) and its sequence under the
    /// caller's `index`. The tokens go on as AR's would: at T = 0 the same, at T > 0 from the
    /// same seeded stream (a hybrid target's linear-attention state goes with it, settled at
    /// the committed prefix). Not for a session with fixed-shape forwards (`--cuda-graphs`: a
    /// batch does not take them), nor one that has ended.
    pub fn into_live(self, index: usize) -> Result<(KvCache, Live)> {
        let mut run = self.run;
        anyhow::ensure!(
            run.graphed.is_none(),
            "a session with CUDA graphs cannot move into a batch"
        );
        run.cache.settle_linear()?;
        anyhow::ensure!(run.next_depth().is_some(), "the session has ended");
        anyhow::ensure!(
            run.cache.len() == run.start,
            "the session's cache holds {} rows, its committed prefix {}",
            run.cache.len(),
            run.start
        );
        let live = Live::resume(
            index,
            &run.req,
            run.sampler,
            run.new_tokens,
            run.loops,
            run.looped,
        );
        Ok((run.cache, live))
    }
}
