//! A round of the speculative batch: every live slot's proposal (its drafted chain, the blocks
//! of the slots that drafted here before in one drafter forward), ONE target forward of every
//! slot's rows, then each slot's walk and commit.

use std::time::Instant;

use anyhow::Result;
use candle_core::Tensor;
use dflash_core::batch_policy::RoundKind;
use dflash_core::stats::RoundOutcome;
use dflash_core::visibility::causal_rows;
use dflash_model::models::drafter::SlotDraft;
use dflash_model::{Rows, Target, TargetOutput};

use super::{room_for, SlotRound, SpecBatch};
use crate::decode::proposers::greedy_chain;
use crate::decode::{Judge, Proposal};
use dflash_model::ops::argmax::argmax_rows;

/// One slot's proposal in a round and what drafting it took.
struct Proposed {
    slot: usize,
    proposal: Proposal,
    draft_secs: f64,
}

impl SpecBatch<'_> {
    /// One round for every live slot: propose, one target forward, then each slot's walk and
    /// commit. What each slot committed; a slot whose generation ended is free after.
    pub fn round(&mut self) -> Result<Vec<SlotRound>> {
        let live: Vec<usize> = (0..self.slot.len())
            .filter(|&s| self.slot[s].is_some())
            .collect();
        if live.is_empty() {
            return Ok(Vec::new());
        }
        let kind = match self.fixed {
            Some(k) => k,
            None => self.policy.choose(live.len()),
        };
        let t0 = Instant::now();
        let phase = tracing::info_span!(target: "phase", "batch draft").entered();
        let mut proposed = self.propose(&live, kind)?;
        drop(phase);
        let tv = Instant::now();
        let out = self.verify(&proposed)?;
        self.pick_greedy(&mut proposed, &out)?;
        let verify_secs = tv.elapsed().as_secs_f64();
        let _p = tracing::info_span!(target: "phase", "batch walk and commit").entered();
        // every slot's tap rows side by side once, `[slots, n, taps · hidden]`
        let taps = match out.taps.is_empty() {
            true => None,
            false => Some(Target::concat_taps(&out.taps)?),
        };
        let mut rounds = Vec::with_capacity(proposed.len());
        for p in proposed {
            rounds.push(self.commit(p, &out, taps.as_ref(), verify_secs)?);
        }
        let committed: usize = rounds.iter().map(|r| r.round.tau_round).sum();
        let per_slot = committed as f64 / live.len() as f64;
        (self.policy).observe(kind, live.len(), t0.elapsed().as_secs_f64(), per_slot);
        Ok(rounds)
    }

    /// Each live slot's proposal: in a drafted round (where there is room for drafts) its
    /// drafter's chain, else its anchor alone.
    fn propose(&mut self, live: &[usize], kind: RoundKind) -> Result<Vec<Proposed>> {
        let drafts = |s: &usize| {
            let l = self.slot[*s].as_ref().expect("a live slot");
            kind == RoundKind::Draft && l.session.run.next_depth().is_some_and(|d| d > 1)
        };
        let drafting: Vec<usize> = live.iter().copied().filter(drafts).collect();
        let mut out = Vec::with_capacity(live.len());
        // the slots that have not drafted here yet draft alone, then join the drafter's cache
        for &s in &drafting {
            if self.slot[s]
                .as_ref()
                .is_some_and(|l| l.draft_held.is_none())
            {
                out.push(self.draft_alone(s)?);
            }
        }
        let together: Vec<usize> = (drafting.iter().copied())
            .filter(|&s| !out.iter().any(|p: &Proposed| p.slot == s))
            .collect();
        out.extend(self.draft_together(&together)?);
        for &s in live {
            if !out.iter().any(|p| p.slot == s) {
                let run = &self.slot[s].as_ref().expect("a live slot").session.run;
                out.push(Proposed {
                    slot: s,
                    proposal: Proposal::anchor_alone(run.anchor()),
                    draft_secs: 0.0,
                });
            }
        }
        out.sort_by_key(|p| p.slot);
        Ok(out)
    }

    /// Slot `s` drafts with its own drafter cache (its proposer's round); then, with a slotted
    /// drafter cache, its drafter rows move there.
    fn draft_alone(&mut self, s: usize) -> Result<Proposed> {
        let t = Instant::now();
        let l = self.slot[s].as_mut().expect("a live slot");
        let run = &mut l.session.run;
        let depth = run.next_depth().expect("a live slot's generation goes on");
        let proposal = l.session.proposer.propose(run, depth)?;
        if let (Some(dc), Some(dr)) = (self.draft_cache.as_mut(), run.drafting.as_mut()) {
            room_for(dc, dr.cache.len() + 1)?;
            dc.place_sequence(s, &dr.cache)?;
            l.draft_held = Some(dr.cache.len());
            dr.cache = dr.drafter.new_cache();
        }
        Ok(Proposed {
            slot: s,
            proposal,
            draft_secs: t.elapsed().as_secs_f64(),
        })
    }

    /// The chains of slots `together` (each holding its context rows in the slotted drafter
    /// cache) from ONE drafter forward of every slot (the others with an empty block that
    /// writes past their rows).
    fn draft_together(&mut self, together: &[usize]) -> Result<Vec<Proposed>> {
        let (Some(dc), Some(d), false) =
            (self.draft_cache.as_mut(), self.drafter, together.is_empty())
        else {
            return Ok(Vec::new());
        };
        let t = Instant::now();
        let block = self.mode.block();
        let empty = candle_core::Tensor::zeros(
            (1, 0, d.target_layer_ids.len() * self.target.hidden_size()),
            self.target.dtype,
            &self.target.device,
        )?;
        let slots: Vec<SlotDraft<'_>> = (self.slot.iter().enumerate())
            .map(|(s, l)| match (l, together.contains(&s)) {
                (Some(l), true) => {
                    let run = &l.session.run;
                    let dr = run.drafting.as_ref().expect("a drafting slot");
                    let held = l.draft_held.expect("a slot that drafted here");
                    SlotDraft {
                        ctx: &dr.ctx,
                        held,
                        token: run.anchor(),
                        anchor: run.start,
                    }
                }
                // a slot that does not draft now: an empty block past its rows
                (l, _) => {
                    let held = l.as_ref().and_then(|l| l.draft_held).unwrap_or(0);
                    SlotDraft {
                        ctx: &empty,
                        held,
                        token: d.mask_token_id,
                        anchor: held,
                    }
                }
            })
            .collect();
        room_for(
            dc,
            dflash_model::models::drafter::Drafter::slotted_columns(&slots, block)?,
        )?;
        let hidden = d.draft_slots(self.target, dc, &slots, block)?;
        let secs = t.elapsed().as_secs_f64() / together.len() as f64;
        let mut out = Vec::with_capacity(together.len());
        for &s in together {
            let l = self.slot[s].as_mut().expect("a live slot");
            let run = &mut l.session.run;
            let depth = run.next_depth().expect("a live slot's generation goes on");
            let rows = hidden.get(s)?.narrow(0, 0, depth - 1)?;
            let logits = d.rows_logits(self.target, run.head(), &rows)?;
            out.push(Proposed {
                slot: s,
                proposal: greedy_chain(run, &logits)?,
                draft_secs: secs,
            });
            l.draft_held = Some(run.start);
        }
        Ok(out)
    }

    /// ONE target forward of every slot's rows (the longest proposal's count; shorter ones
    /// and free slots padded with rows no real row sees): logits `[slots, n, vocab]`, taps
    /// `[slots, n, hidden]`.
    fn verify(&mut self, proposed: &[Proposed]) -> Result<TargetOutput> {
        let n = (proposed.iter())
            .map(|p| p.proposal.tree.len())
            .max()
            .unwrap_or(1);
        let mut starts = vec![0usize; self.slot.len()];
        let mut tokens = vec![0u32; self.slot.len() * n];
        let mut positions: Vec<usize> = (0..self.slot.len()).flat_map(|_| 0..n).collect();
        for p in proposed {
            let run = &self.slot[p.slot].as_ref().expect("a live slot").session.run;
            let (s, tree) = (p.slot, &p.proposal.tree);
            starts[s] = run.start;
            for r in 0..n {
                // padding rows continue the chain at the next positions, seen by no real row
                tokens[s * n + r] = tree.tokens.get(r).copied().unwrap_or(tree.tokens[0]);
                positions[s * n + r] = run.start + r;
            }
            let at = tree.positions(run.start);
            positions[s * n..s * n + tree.len()].copy_from_slice(&at);
        }
        room_for(&mut self.cache, starts.iter().max().unwrap_or(&0) + n)?;
        let rows: Vec<_> = starts.iter().map(|&h| causal_rows(h, n)).collect();
        let taps = match self.slot.iter().flatten().next() {
            Some(l) => l.session.run.taps.clone(),
            None => Vec::new(),
        };
        let _p = tracing::info_span!(target: "phase", "batch verify").entered();
        self.target.forward_slots(
            &tokens,
            &positions,
            &rows,
            &starts,
            &mut self.cache,
            &taps,
            &Rows::All,
        )
    }

    /// The target's arg-max at every row of the slots at T = 0, in one pick for all of them
    /// (one read of the device a round, where each slot's own walk would read it once each):
    /// their judges become [`Judge::Picked`]. Slots at T > 0 keep theirs (their draws).
    fn pick_greedy(&self, proposed: &mut [Proposed], out: &TargetOutput) -> Result<()> {
        let greedy = |p: &Proposed| {
            let run = &self.slot[p.slot].as_ref().expect("a live slot").session.run;
            run.sampler.params.is_greedy() && matches!(p.proposal.judge, Judge::Target)
        };
        let (Some(logits), true) = (out.logits.as_ref(), proposed.iter().any(greedy)) else {
            return Ok(());
        };
        let _p = tracing::info_span!(target: "phase", "batch pick").entered();
        let (slots, n, vocab) = logits.dims3()?;
        let best = argmax_rows(&logits.reshape((slots * n, vocab))?)?;
        for p in proposed.iter_mut() {
            if greedy(p) {
                let rows = p.proposal.tree.len();
                p.proposal.judge = Judge::Picked(best[p.slot * n..p.slot * n + rows].to_vec());
            }
        }
        Ok(())
    }

    /// Slot `p.slot`'s walk over its rows of `out` and its commit; its slot is freed when the
    /// generation ended.
    fn commit(
        &mut self,
        p: Proposed,
        out: &TargetOutput,
        taps: Option<&Tensor>,
        verify_secs: f64,
    ) -> Result<SlotRound> {
        let Proposed {
            slot,
            mut proposal,
            draft_secs,
        } = p;
        let t = Instant::now();
        let rows = proposal.tree.len();
        let own = |x: &candle_core::Tensor| -> Result<candle_core::Tensor> {
            Ok(x.get(slot)?.narrow(0, 0, rows)?)
        };
        let mine = TargetOutput {
            logits: out.logits.as_ref().map(own).transpose()?,
            taps: Vec::new(),
        };
        let l = self.slot[slot].as_mut().expect("a live slot");
        let run = &mut l.session.run;
        let before = run.new_tokens.len();
        let (path, bonus) = run.walk(&mut proposal, &mine)?;
        let kept = run.commit_tokens(&proposal, &path, bonus);
        // a chain's committed rows are its first ones, already in place
        anyhow::ensure!(
            kept.iter().enumerate().all(|(i, &r)| i == r),
            "a batch slot committed rows that are not its first ones"
        );
        // the committed rows are the first ones: their taps are a view of the round's
        if let Some(t) = taps {
            run.append_context(
                &proposal,
                t.get(slot)?.narrow(0, 0, kept.len())?.unsqueeze(0)?,
            )?;
        }
        let round = RoundOutcome {
            drafted: rows - 1,
            accepted: path.len(),
            tau_round: kept.len(),
            bonus: (kept.len() == path.len() + 1).then_some(bonus),
            draft_secs,
            verify_secs,
            other_secs: t.elapsed().as_secs_f64(),
            tree_size: None,
        };
        l.session.proposer.observe(&round);
        l.session.run.rounds.push(round.clone());
        l.session.decode_secs += draft_secs + verify_secs + round.other_secs;
        let tokens = l.session.run.new_tokens[before..].to_vec();
        let index = l.index;
        let done = match l.session.done() {
            true => self.slot[slot].take().map(|l| l.session.finish(None)),
            false => None,
        };
        Ok(SlotRound {
            index,
            tokens,
            round,
            done,
        })
    }
}
