//! Speculation in the running batch: slots of [`Session`]s whose target K/V live in one
//! slotted cache ([`Target::forward_slots`]). Each round either every live slot's drafter
//! proposes its chain and ONE target forward verifies every slot's rows, or every slot takes
//! one AR step in that forward ([`dflash_core::batch_policy`]: `--mode auto` chooses per round
//! at this many live slots, `dflash` always drafts, `ar` never). Each slot then walks and
//! commits its own rows: its acceptance, its bonus, its tokens.
//!
//! **Layout.** Slot `s` holds its sequence's committed rows at columns `0 .. start_s` (its
//! anchor's position); a round writes its `n` rows at `start_s ..` and row `r` sees columns
//! `0 ..= start_s + r` ([`dflash_core::visibility::causal_rows`]: the target rule over the
//! slot's own columns). A chain's committed rows are a prefix of its rows, already in place;
//! the rejected ones are overwritten by the next round, so nothing moves. The drafter's blocks
//! are one forward too, over a slotted drafter cache laid out the same way
//! ([`Drafter::draft_slots`]); a slot's first draft (after its prefill, or after it moved in)
//! runs alone and its drafter rows then move into that cache.
//!
//! **Lossless.** Each slot is decoded by its session's rules, the exact match at T > 0 (each
//! verify row draws the target's token with its token's number of the request's seeded stream,
//! [`Sampler::seek`](dflash_core::sampling::Sampler::seek)): at T = 0 its tokens are AR's, and
//! at T > 0 a seeded request's tokens are AR's seeded tokens whatever else is in the batch (on
//! the CPU the row attention computes each slot's rows alone; the CPU products are per row).
//!
//! Example: slots A (prompt 20, `start` 21) and B (prompt 9, `start` 12), block 4, a drafted
//! round: A proposes [x, a, b, c] at positions 21..25, B [y, d, e, f] at 12..16; one forward of
//! 2 × 4 rows writes A's at columns 21..25 and B's at 12..16; A keeps a and its bonus (`start`
//! 23), B keeps d, e, f and its bonus (`start` 16).

use anyhow::Result;
use dflash_core::batch_policy::{BatchPolicy, RoundKind};
use dflash_core::stats::RoundOutcome;
use dflash_model::models::drafter::Drafter;
use dflash_model::{KvCache, Target};

use super::proposers;
use super::{Acceptance, DecodeOptions, Generation, Mode, Request, Session};

mod round;

/// Columns a slotted cache grows by at least (a multiple of this).
const COLUMNS: usize = 64;

/// What one slot did in a round.
#[derive(Debug, Clone)]
pub struct SlotRound {
    /// The caller's name for the request.
    pub index: usize,
    /// The tokens the round committed.
    pub tokens: Vec<u32>,
    pub round: RoundOutcome,
    /// The whole generation, when this round ended it (its slot is free after).
    pub done: Option<Generation>,
}

/// Slots of speculative sessions verified together (see the module doc).
pub struct SpecBatch<'a> {
    target: &'a Target,
    drafter: Option<&'a Drafter>,
    /// The slots' mode: the drafter's chain, or AR without a drafter.
    mode: Mode,
    /// `None`: the policy chooses each round's kind; else always this kind.
    fixed: Option<RoundKind>,
    policy: BatchPolicy,
    /// The target's slotted cache, and the drafter's (with a drafter without a candidate
    /// selector: a DFlash2 drafter's rounds draft slot by slot).
    cache: KvCache,
    draft_cache: Option<KvCache>,
    slot: Vec<Option<Slot<'a>>>,
}

/// A live slot: the caller's name for its request, its session, and how many context rows it
/// holds in the slotted drafter cache (`None`: its drafter rows are still in its session's own
/// cache, until its first draft here).
struct Slot<'a> {
    index: usize,
    session: Session<'a>,
    draft_held: Option<usize>,
}

impl<'a> SpecBatch<'a> {
    /// `slots` empty slots decoding in `mode` (`ar`, `dflash`; `auto` and `ddtree:N` decode
    /// the drafter's chain in rounds the policy drafts). Attention-only targets.
    pub fn new(
        target: &'a Target,
        drafter: Option<&'a Drafter>,
        mode: Mode,
        slots: usize,
    ) -> Result<Self> {
        anyhow::ensure!(slots > 0, "a speculative batch needs at least one slot");
        anyhow::ensure!(
            !target.is_hybrid(),
            "a speculative batch takes attention-only targets: a hybrid target's linear-attention state cannot drop rejected rows"
        );
        let (mode, fixed) = match (mode, drafter) {
            (Mode::Ar, _) | (_, None) => (Mode::Ar, Some(RoundKind::Ar)),
            (Mode::Chain { block }, Some(_)) => (Mode::Chain { block }, Some(RoundKind::Draft)),
            (m, Some(_)) => (Mode::Chain { block: m.block() }, None),
        };
        let draft_cache = match drafter {
            Some(d) if d.selector.is_none() && mode != Mode::Ar => {
                Some(d.new_slotted_cache(slots, COLUMNS, target)?)
            }
            _ => None,
        };
        Ok(SpecBatch {
            target,
            drafter,
            mode,
            fixed,
            policy: BatchPolicy::new(),
            cache: target.new_batched_cache(slots, COLUMNS)?,
            draft_cache,
            slot: (0..slots).map(|_| None).collect(),
        })
    }

    /// How the slots' sessions run: eager forwards, the exact match at T > 0 (a slot's rows
    /// are drawn where the logits are, as AR draws them).
    fn opts() -> DecodeOptions {
        DecodeOptions {
            cuda_graphs: false,
            acceptance: Acceptance::ExactMatch,
            drafts_to_host: false,
        }
    }

    pub fn live(&self) -> usize {
        self.slot.iter().flatten().count()
    }

    pub fn slots(&self) -> usize {
        self.slot.len()
    }

    /// The empty slots.
    pub fn free(&self) -> usize {
        self.slots() - self.live()
    }

    /// The policy's figures (rounds of each kind, τ of drafted rounds).
    pub fn policy(&self) -> &BatchPolicy {
        &self.policy
    }

    /// Every round from the next on is `kind` (`None`: the policy chooses each one). Example:
    /// a chain batch forced to `RoundKind::Ar` for three rounds, then back to `Draft`, drafts
    /// its fourth round from every row committed so far.
    pub fn force_rounds(&mut self, kind: Option<RoundKind>) {
        self.fixed = kind;
    }

    /// Prefill `req` alone and take it into a free slot, under the caller's `index`: its first
    /// token, and its generation when that token ended it (no slot taken).
    pub fn admit(&mut self, index: usize, req: &Request) -> Result<(u32, Option<Generation>)> {
        let session = Session::start(
            self.target,
            self.drafter,
            self.mode,
            req,
            Self::opts(),
            None,
        )?;
        let first = session.new_tokens()[0];
        if session.done() {
            return Ok((first, Some(session.finish(None))));
        }
        self.take(index, session)?;
        Ok((first, None))
    }

    /// Take over a session decoded elsewhere so far (the server's request that was alone): its
    /// committed rows move into a free slot and it goes on by the batch's rules (the drafter's
    /// chain, the exact match at T > 0: lossless, though at T > 0 another use
    /// of the seeded stream than its own mode's).
    pub fn adopt(&mut self, index: usize, mut session: Session<'a>) -> Result<()> {
        anyhow::ensure!(!session.done(), "the session has ended");
        let run = &mut session.run;
        anyhow::ensure!(
            run.graphed.is_none(),
            "a session with CUDA graphs cannot move into a batch"
        );
        anyhow::ensure!(
            run.cache.len() == run.start,
            "the session's cache holds {} rows, its committed prefix {}",
            run.cache.len(),
            run.start
        );
        run.acceptance = Acceptance::ExactMatch;
        if run.drafting.is_none() && self.mode != Mode::Ar {
            anyhow::bail!("a session without a drafter cannot join a drafting batch");
        }
        session.proposer = proposers::for_mode(self.mode, self.drafter);
        self.take(index, session)
    }

    /// Move `session`'s cache rows into a free slot (columns from 0) and keep it there; its
    /// verifies are the batch's from now on.
    fn take(&mut self, index: usize, mut session: Session<'a>) -> Result<()> {
        let s = (self.slot.iter())
            .position(|s| s.is_none())
            .ok_or_else(|| anyhow::anyhow!("no free slot for a new sequence"))?;
        room_for(&mut self.cache, session.run.start + self.mode.block())?;
        self.cache.place_sequence(s, &session.run.cache)?;
        session.run.cache = KvCache::new(0);
        session.run.own_verify = false;
        self.slot[s] = Some(Slot {
            index,
            session,
            draft_held: None,
        });
        Ok(())
    }

    /// Free the slot of the caller's `index`; whether it was live.
    pub fn cancel(&mut self, index: usize) -> bool {
        match (self.slot.iter_mut()).find(|s| s.as_ref().is_some_and(|l| l.index == index)) {
            Some(s) => {
                *s = None;
                true
            }
            None => false,
        }
    }

    /// Lay the batch out over `slots` slots (at least the live ones, which keep their order):
    /// a round computes rows for every slot, live or not.
    pub fn resize(&mut self, slots: usize) -> Result<()> {
        let live = self.live();
        anyhow::ensure!(
            slots >= live.max(1),
            "{slots} slots cannot hold {live} live sequences"
        );
        if slots == self.slot.len() {
            return Ok(());
        }
        let mut cache = self
            .target
            .new_batched_cache(slots, self.cache.capacity()?)?;
        let mut draft_cache = match (&self.draft_cache, self.drafter) {
            (Some(c), Some(d)) => Some(d.new_slotted_cache(slots, c.capacity()?, self.target)?),
            _ => None,
        };
        let mut slot: Vec<Option<Slot<'a>>> = Vec::with_capacity(slots);
        for (old, entry) in self.slot.iter_mut().enumerate() {
            if let Some(l) = entry.take() {
                let new = slot.len();
                cache.copy_slot(new, &self.cache, old, l.session.run.start)?;
                if let (Some(dc), Some(old_dc), Some(n)) = (
                    draft_cache.as_mut(),
                    self.draft_cache.as_ref(),
                    l.draft_held,
                ) {
                    dc.copy_slot(new, old_dc, old, n)?;
                }
                slot.push(Some(l));
            }
        }
        slot.resize_with(slots, || None);
        self.cache = cache;
        self.draft_cache = draft_cache;
        self.slot = slot;
        Ok(())
    }
}

/// At least `cols` columns in every slot of a slotted `cache` (grown by doubling, in whole
/// [`COLUMNS`]).
fn room_for(cache: &mut KvCache, cols: usize) -> Result<()> {
    let cap = cache.capacity()?;
    if cols > cap {
        let want = cols.max(2 * cap).div_ceil(COLUMNS) * COLUMNS;
        cache.widen(want)?;
    }
    Ok(())
}

/// Every request decoded to its end in one speculative batch of `slots` slots, each joining
/// as a slot frees up, in order; their generations in the requests' order. E.g. three requests
/// on two slots: 0 and 1 start together, 2 takes the slot of whichever ends first.
pub fn generate_spec_batched(
    target: &Target,
    drafter: Option<&Drafter>,
    mode: Mode,
    reqs: &[Request],
    slots: usize,
) -> Result<Vec<Generation>> {
    let mut b = SpecBatch::new(target, drafter, mode, slots)?;
    let mut out: Vec<Option<Generation>> = vec![None; reqs.len()];
    let mut next = 0;
    loop {
        while b.free() > 0 && next < reqs.len() {
            out[next] = b.admit(next, &reqs[next])?.1;
            next += 1;
        }
        if b.live() == 0 {
            break;
        }
        for r in b.round()? {
            if let Some(g) = r.done {
                out[r.index] = Some(g);
            }
        }
    }
    out.into_iter()
        .map(|g| g.ok_or_else(|| anyhow::anyhow!("a request of the batch did not end")))
        .collect()
}
