//! One generation advanced a round at a time: [`super::generate`] runs a [`Session`] to its
//! end; the server runs one round between its other work, streams each round's tokens, and
//! moves a session into the AR batch ([`Session::into_live`]) when other requests arrive.

use std::time::Instant;

use anyhow::Result;
use dflash_core::stats::RoundOutcome;
use dflash_model::models::drafter::Drafter;
use dflash_model::{KvCache, Target};

use super::{DecodeOptions, Decoding, Generation, Mode, Request};
use crate::batched::Live;
use crate::graph_cache::GraphCache;

/// A generation between rounds. Example: `start` prefills a 20-token prompt and samples the
/// first token; each `round` then commits 1 … B tokens (`new_tokens` grows by them) until
/// `done`.
pub struct Session<'a> {
    run: Decoding<'a>,
    decode_secs: f64,
}

impl<'a> Session<'a> {
    /// Check the request, prefill its prompt and sample its first token.
    pub fn start(
        target: &'a Target,
        drafter: Option<&'a Drafter>,
        mode: Mode,
        req: &Request,
        opts: DecodeOptions,
    ) -> Result<Self> {
        Self::start_kept(target, drafter, mode, req, opts, None)
    }

    /// [`Session::start`] from the fixed-shape forwards kept in `graphs` (when there are).
    fn start_kept(
        target: &'a Target,
        drafter: Option<&'a Drafter>,
        mode: Mode,
        req: &Request,
        opts: DecodeOptions,
        graphs: Option<&mut GraphCache>,
    ) -> Result<Self> {
        let keep = graphs.is_some() && opts.cuda_graphs && !target.is_hybrid();
        let kept = graphs.and_then(|g| g.kept.take());
        let run = Decoding::prefill(target, drafter, mode, req, opts, kept, keep)?;
        Ok(Session {
            run,
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
        let mut tree = run.propose(depth)?;
        let draft_secs = t.elapsed().as_secs_f64();
        let tv = Instant::now();
        let (out, cache_len) = run.verify(&tree)?;
        let verify_secs = tv.elapsed().as_secs_f64();
        let to = Instant::now();
        let (path, bonus) = run.walk(&mut tree, &out)?;
        let produced = run.commit(&tree, &path, bonus, &out, cache_len)?;
        let round = RoundOutcome {
            drafted: tree.len() - 1,
            accepted: path.len(),
            tau_round: produced,
            bonus: (produced == path.len() + 1).then_some(bonus),
            draft_secs,
            verify_secs,
            other_secs: to.elapsed().as_secs_f64(),
            tree_size: matches!(run.mode, Mode::Tree { .. } | Mode::Auto { .. })
                .then_some(tree.len() - 1),
        };
        run.observe_auto(&round);
        run.rounds.push(round);
        self.decode_secs += t.elapsed().as_secs_f64();
        Ok(self.run.rounds.last())
    }

    /// The generation as [`super::generate`] reports it.
    pub fn finish(self) -> Generation {
        let run = self.run;
        Generation {
            new_tokens: run.new_tokens,
            rounds: run.rounds,
            prefill_secs: run.prefill_secs,
            decode_secs: self.decode_secs,
            stopped_by_token: run.stopped && !run.looped,
            stopped_by_loop: run.looped,
            auto: run.auto.as_ref().map(|a| a.policy.stats()),
        }
    }

    /// Continue this generation as AR in a [`crate::batched::Batch`] (`Batch::adopt`): its
    /// target cache (the committed rows, the last token not in it) and its sequence under the
    /// caller's `index`. The tokens go on as AR's would: at T = 0 the same, at T > 0 from the
    /// same seeded stream. Not for a session with fixed-shape forwards (`--cuda-graphs`) or of
    /// a hybrid target (a batch takes neither), nor one that has ended.
    pub fn into_live(self, index: usize) -> Result<(KvCache, Live)> {
        let run = self.run;
        anyhow::ensure!(
            run.graphed.is_none() && !run.target.is_hybrid(),
            "a session with CUDA graphs or of a hybrid target cannot move into a batch"
        );
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

pub(super) fn run_generation(
    target: &Target,
    drafter: Option<&Drafter>,
    mode: Mode,
    req: &Request,
    opts: DecodeOptions,
    mut graphs: Option<&mut GraphCache>,
) -> Result<Generation> {
    let mut session = Session::start_kept(target, drafter, mode, req, opts, graphs.as_deref_mut())?;
    if let Some(g) = graphs.as_mut() {
        g.reused += session.run.reused as usize;
    }
    while session.round()?.is_some() {}
    if let Some(g) = graphs {
        g.kept = session.run.take_kept();
    }
    Ok(session.finish())
}
