//! `--mode auto` in a speculative batch: each round, either every live slot drafts its chain
//! and the target verifies them all in one forward, or every slot takes one AR step, whichever
//! has lately committed more tokens per second at this many live slots.
//!
//! **What it measures.** Per live-slot count `b`, a running average of each kind of round's
//! seconds (a verify's cost grows with its rows, `b · block` for drafted rounds, `b` for AR
//! steps, so each count has its own); over the run, the tokens a drafted round commits per
//! slot (τ; an AR step commits 1).
//!
//! **The choice.** Drafted rounds when `τ / t_draft(b) ≥ 1 / t_ar(b)`. A kind not measured at
//! `b` yet is tried first (drafting first). The kind that loses is tried again after 8 rounds
//! of the other, then 16, 32 and 64 while it keeps losing, so that a change of content (τ) or
//! of load is seen; such a probe's figures replace the ones it had (they are stale).
//!
//! Example: at 4 live slots an AR step takes 20 ms and a drafted round 50 ms committing τ = 3.1
//! tokens per slot: 3.1 / 50 = 0.062 ≥ 1 / 20 = 0.05 → draft. At 16 slots, 30 ms against
//! 160 ms: 3.1 / 160 < 1 / 30 → AR steps, a drafted round again after 8 of them.

use std::collections::BTreeMap;

/// A running average's weight of the newest value.
const WEIGHT: f64 = 0.25;
/// Rounds of the winning kind before the losing one is tried again, at first and at most.
const PROBE_FIRST: usize = 8;
const PROBE_MAX: usize = 64;

/// The kind of a batch round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RoundKind {
    /// Every slot one AR step.
    Ar,
    /// Every slot its drafter's chain, verified together.
    Draft,
}

/// The running average of `x` with its newest value `v` (the first value as it is).
fn average(x: Option<f64>, v: f64) -> f64 {
    match x {
        None => v,
        Some(x) => x + WEIGHT * (v - x),
    }
}

/// What decides the kind of the next round: the costs and τ measured so far.
#[derive(Debug, Clone, Default)]
pub struct BatchPolicy {
    /// Per live-slot count: the seconds of an AR round and of a drafted round.
    secs: BTreeMap<usize, (Option<f64>, Option<f64>)>,
    /// Tokens a drafted round commits per slot.
    tau: Option<f64>,
    /// Rounds since the losing kind was last tried, and how many to wait.
    since_probe: usize,
    probe_after: usize,
    /// Rounds since an AR round and since a drafted round ran: a kind back after a while (a
    /// probe) replaces its averages instead of moving them, what it measured before is stale.
    idle: (usize, usize),
    /// Rounds of each kind so far.
    pub ar_rounds: usize,
    pub draft_rounds: usize,
}

impl BatchPolicy {
    pub fn new() -> Self {
        Self {
            probe_after: PROBE_FIRST,
            ..Self::default()
        }
    }

    /// The kind of the next round at `b` live slots.
    pub fn choose(&mut self, b: usize) -> RoundKind {
        let Some(best) = self.best_at(b) else {
            // a kind not measured at this count yet: try it, drafting first
            let (_, draft) = self.secs.get(&b).copied().unwrap_or((None, None));
            return match draft.is_none() || self.tau.is_none() {
                true => RoundKind::Draft,
                false => RoundKind::Ar,
            };
        };
        self.since_probe += 1;
        if self.since_probe > self.probe_after {
            self.since_probe = 0;
            self.probe_after = (2 * self.probe_after).min(PROBE_MAX);
            return match best {
                RoundKind::Draft => RoundKind::Ar,
                RoundKind::Ar => RoundKind::Draft,
            };
        }
        best
    }

    /// A round of `kind` at `b` live slots took `secs` and committed `per_slot` tokens per
    /// slot on average.
    pub fn observe(&mut self, kind: RoundKind, b: usize, secs: f64, per_slot: f64) {
        let before = self.best_at(b);
        let (ar, draft) = self.secs.entry(b).or_insert((None, None));
        let idle = match kind {
            RoundKind::Ar => std::mem::take(&mut self.idle.0),
            RoundKind::Draft => std::mem::take(&mut self.idle.1),
        };
        let stale = idle >= PROBE_FIRST;
        let update = |x: Option<f64>, v: f64| if stale { v } else { average(x, v) };
        match kind {
            RoundKind::Ar => {
                *ar = Some(update(*ar, secs));
                self.idle.1 += 1;
                self.ar_rounds += 1;
            }
            RoundKind::Draft => {
                *draft = Some(update(*draft, secs));
                self.tau = Some(update(self.tau, per_slot));
                self.idle.0 += 1;
                self.draft_rounds += 1;
            }
        }
        // the winner changed: the other kind is tried again soon
        if before.is_some() && before != self.best_at(b) {
            self.since_probe = 0;
            self.probe_after = PROBE_FIRST;
        }
    }

    /// The kind that commits more per second at `b` slots, once both are measured there.
    fn best_at(&self, b: usize) -> Option<RoundKind> {
        let (Some(ar), Some(draft)) = self.secs.get(&b).copied()? else {
            return None;
        };
        let tau = self.tau?;
        Some(match tau / draft >= 1.0 / ar {
            true => RoundKind::Draft,
            false => RoundKind::Ar,
        })
    }

    /// The measured τ of drafted rounds, if any ran.
    pub fn tau(&self) -> Option<f64> {
        self.tau
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `rounds` rounds at `b` slots with these costs and τ; the kinds chosen.
    fn run(
        p: &mut BatchPolicy,
        b: usize,
        rounds: usize,
        ar: f64,
        draft: f64,
        tau: f64,
    ) -> Vec<RoundKind> {
        (0..rounds)
            .map(|_| {
                let k = p.choose(b);
                let (secs, per) = match k {
                    RoundKind::Ar => (ar, 1.0),
                    RoundKind::Draft => (draft, tau),
                };
                p.observe(k, b, secs, per);
                k
            })
            .collect()
    }

    /// How many of `kinds` drafted.
    fn drafts(kinds: &[RoundKind]) -> usize {
        kinds.iter().filter(|&&k| k == RoundKind::Draft).count()
    }

    #[test]
    fn the_module_doc_example() {
        let mut p = BatchPolicy::new();
        let kinds = run(&mut p, 4, 20, 0.020, 0.050, 3.1);
        // measured both (draft first), then drafts, with AR probes
        assert_eq!(&kinds[..2], &[RoundKind::Draft, RoundKind::Ar]);
        assert!(drafts(&kinds[2..]) >= 16);
        let kinds = run(&mut p, 16, 40, 0.030, 0.160, 3.1);
        assert_eq!(&kinds[..2], &[RoundKind::Draft, RoundKind::Ar]);
        let drafts = drafts(&kinds[2..]);
        // AR wins at 16 slots; drafts only as probes (after 8, then 16 rounds)
        assert!((1..=3).contains(&drafts), "{drafts} drafted rounds");
    }

    #[test]
    fn probes_back_off_while_the_loser_keeps_losing_and_reset_when_it_wins() {
        let mut p = BatchPolicy::new();
        let kinds = run(&mut p, 2, 200, 0.010, 0.100, 2.0);
        let probes: Vec<usize> = (2..200).filter(|&i| kinds[i] == RoundKind::Draft).collect();
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(&gaps[..3], &[17, 33, 65], "probes at {probes:?}");
        // the drafter gets good: the next probe finds it and drafting takes over
        let kinds = run(&mut p, 2, 100, 0.010, 0.012, 4.0);
        assert!(drafts(&kinds[80..]) >= 17);
    }

    #[test]
    fn every_slot_count_is_measured_on_its_own() {
        let mut p = BatchPolicy::new();
        run(&mut p, 1, 6, 0.010, 0.012, 3.0);
        assert_eq!(p.choose(1), RoundKind::Draft);
        // a new count: its draft cost is not known yet, then its AR cost
        assert_eq!(p.choose(8), RoundKind::Draft);
        p.observe(RoundKind::Draft, 8, 0.2, 3.0);
        assert_eq!(p.choose(8), RoundKind::Ar);
    }
}
