//! τ and acceptance statistics, defined once.
//!
//! A *round* is one target forward after the prefill (a verify of a chain block or a tree,
//! or one AR step). `tau_round` is the number of tokens that round committed: the accepted
//! drafts plus the target's own (bonus) token, at most B; at the very end of a generation it
//! is cut where a stop token or `max_new_tokens` ends it, as in z-lab's `acceptance_lengths`.
//! Example: B = 16, drafts d1..d15, the target agrees with d1..d4 → accepted 4, τ_round 5.
//!
//! Two conventions for τ over many rounds, both reported and named:
//! - `tau_mean_of_means`: z-lab's, the mean over requests of each request's mean τ_round;
//! - `tau_pooled`: committed tokens / rounds over all requests.

use serde::{Deserialize, Serialize};

/// What one round did: plain data.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundOutcome {
    /// Drafted tokens offered for verification (B - 1 in a full chain round, N in a tree).
    pub drafted: usize,
    /// Drafts the target accepted (length of the accepted path).
    pub accepted: usize,
    /// Tokens committed this round (accepted + bonus, cut at the end of generation).
    pub tau_round: usize,
    /// The target's own token at the first mismatch (`None` when cut before it).
    pub bonus: Option<u32>,
    /// Host clock of each stage. A round that reads the device once (a greedy chain whose
    /// drafts stay there) waits for its draft inside the verify: its `draft_secs` is the time
    /// to queue the draft, its `verify_secs` the wait for both forwards.
    pub draft_secs: f64,
    pub verify_secs: f64,
    pub other_secs: f64,
    /// Tree rounds only: nodes in the tree and the deepest node on the accepted path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree_size: Option<usize>,
}

/// Aggregate statistics over one or many requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TauSummary {
    pub requests: usize,
    pub rounds: usize,
    pub committed: usize,
    pub tau_mean_of_means: f64,
    pub tau_pooled: f64,
    /// Entry k-1 is P(draft k accepted | drafts 1..k-1 accepted), over rounds that drafted k.
    pub per_position_acceptance: Vec<f64>,
    /// Entry t counts the rounds with τ_round = t.
    pub tau_histogram: Vec<usize>,
    pub draft_secs: f64,
    pub verify_secs: f64,
    pub other_secs: f64,
}

/// Summarise requests, each given as its list of rounds.
pub fn summarize(requests: &[&[RoundOutcome]]) -> TauSummary {
    let mut s = TauSummary {
        requests: requests.len(),
        ..Default::default()
    };
    let mut means = Vec::new();
    let max_draft = requests
        .iter()
        .flat_map(|r| r.iter())
        .map(|r| r.drafted.max(r.accepted))
        .max()
        .unwrap_or(0);
    let mut reached = vec![0usize; max_draft + 1]; // rounds whose accepted >= k, and drafted >= k
    let mut offered = vec![0usize; max_draft + 1]; // rounds with accepted >= k-1 and drafted >= k
    for req in requests {
        if req.is_empty() {
            continue;
        }
        let committed: usize = req.iter().map(|r| r.tau_round).sum();
        means.push(committed as f64 / req.len() as f64);
        for r in req.iter() {
            s.rounds += 1;
            s.committed += r.tau_round;
            if s.tau_histogram.len() <= r.tau_round {
                s.tau_histogram.resize(r.tau_round + 1, 0);
            }
            s.tau_histogram[r.tau_round] += 1;
            for k in 1..=r.drafted {
                if r.accepted + 1 >= k {
                    offered[k] += 1;
                }
                if r.accepted >= k {
                    reached[k] += 1;
                }
            }
            s.draft_secs += r.draft_secs;
            s.verify_secs += r.verify_secs;
            s.other_secs += r.other_secs;
        }
    }
    s.tau_mean_of_means = if means.is_empty() {
        0.0
    } else {
        means.iter().sum::<f64>() / means.len() as f64
    };
    s.tau_pooled = if s.rounds == 0 {
        0.0
    } else {
        s.committed as f64 / s.rounds as f64
    };
    s.per_position_acceptance = (1..=max_draft)
        .take_while(|&k| offered[k] > 0)
        .map(|k| reached[k] as f64 / offered[k] as f64)
        .collect();
    s
}

/// The chain τ that these per-position acceptance rates imply: `1 + Σ_k Π_{i<=k} acc_i`.
/// Example: rates [0.5, 0.5] → 1 + 0.5 + 0.25 = 1.75.
pub fn simulated_chain_tau(per_position_acceptance: &[f64]) -> f64 {
    let mut prod = 1.0;
    let mut tau = 1.0;
    for &a in per_position_acceptance {
        prod *= a;
        tau += prod;
    }
    tau
}

/// Decode time per output token: the decoding loop's time over the tokens it produced (the
/// first new token comes from the prefill's logits, so it is not one of them). The one
/// definition behind `generate --compare-ar`, `bench` and the eval reports' TPOT and speed-up.
/// Example: 64 new tokens decoded in 0.63 s → 10 ms per token.
pub fn decode_secs_per_token(decode_secs: f64, new_tokens: usize) -> f64 {
    decode_secs / new_tokens.saturating_sub(1).max(1) as f64
}

/// The pooled τ that decoding would measure, from per-anchor τ at uniformly sampled anchors
/// (τ_anchor = 1 + drafts accepted there): their **harmonic** mean, `n / Σ 1/τ_anchor`.
/// Decoding does not visit uniform positions: each round starts right after the previous one
/// ended, so a stretch of positions with τ = t costs one round per t tokens. Pooled τ = tokens /
/// rounds is then `1 / E_p[1/τ(p)]`, while [`simulated_chain_tau`] of the per-position rates
/// is the arithmetic mean `E_p[τ(p)]`, which overstates τ when acceptance is uneven.
/// Example: τ 16 at half the positions and 1 at the other half → arithmetic 8.5, decoding
/// 1 / (0.5/16 + 0.5/1) = 1.88 (the 16-token stretches take one round each, the rest one per token).
pub fn simulated_decoding_tau(inverse_tau_sum: f64, anchors: u64) -> f64 {
    if anchors == 0 || inverse_tau_sum <= 0.0 {
        return 1.0;
    }
    anchors as f64 / inverse_tau_sum
}

/// The decoding walk over a response whose drafts accepted at each anchor are known: the
/// first round anchors at `start` (the first response token, which the prefill produced), a
/// round at anchor `a` commits `1 + accepted_at(a)` tokens (at most up to position `end − 1`,
/// the response's last) and the next round anchors where it ended. Returns (tokens, rounds), τ
/// = tokens / rounds as decoding at T = 0 measures it on the same tokens, or `None` when a
/// visited anchor has no record. Unlike [`simulated_decoding_tau`] it needs every anchor the
/// walk visits, not a sample. Example: start 10, end 20, accepted 3 at 10, 0 at 14, 7 at 15 →
/// rounds at 10 (4 tokens), 14 (1) and 15 (4, cut at 19): `Some((9, 3))`, τ 3.
pub fn walk_decoding(
    start: usize,
    end: usize,
    accepted_at: impl Fn(usize) -> Option<usize>,
) -> Option<(u64, u64)> {
    let (tokens, rounds, whole) = walk(start, end, |a| accepted_at(a).map(|k| 1 + k));
    whole.then_some((tokens, rounds))
}

/// The walk both [`walk_decoding`] and [`walk_rounds`] take: a round at anchor `a` commits
/// `commits(a)` tokens, counted up to position `end − 1`, and the next round anchors where it
/// ended, while `a + 1 < end`. Returns (tokens, rounds, whether every visited anchor had a
/// round: `commits` gave `None` nowhere).
fn walk(
    start: usize,
    end: usize,
    mut commits: impl FnMut(usize) -> Option<usize>,
) -> (u64, u64, bool) {
    let (mut a, mut tokens, mut rounds) = (start, 0u64, 0u64);
    while a + 1 < end {
        let Some(t) = commits(a) else {
            return (tokens, rounds, false);
        };
        let t = t.min(end - 1 - a);
        tokens += t as u64;
        rounds += 1;
        a += t;
    }
    (tokens, rounds, true)
}

/// [`walk_decoding`]'s count over rounds that decoding took: the rounds committed `taus` tokens
/// in turn from the anchor at `start`; the rounds anchored before `end − 1` count, each for the
/// tokens it committed up to position `end − 1`. With a decoding budget past `end` (so that no
/// round before it drafted a cut block) this is τ on the same tokens as the walk's. Example:
/// start 10, end 20, rounds of 4, 1, 6, 3 → (4 + 1 + 4, 3) = (9, 3): the fourth round anchors at
/// 21, past the response.
pub fn walk_rounds(start: usize, end: usize, taus: &[usize]) -> (u64, u64) {
    let mut taus = taus.iter();
    let (tokens, rounds, _) = walk(start, end, |_| taus.next().copied());
    (tokens, rounds)
}

/// Per-position acceptance of drafted blocks scored against their labels, as a chain walk
/// would accept them (training metrics, validation, the doctor): `offered[k-1]` blocks
/// reached draft k with drafts 1..k-1 all right and a label at k; `reached[k-1]` of them got
/// draft k right too. Each block is also one anchor with τ_anchor = 1 + drafts accepted.
/// Example: one block whose drafts are [right, wrong, right] → offered [1, 1, 0], reached
/// [1, 0, 0], τ_anchor 2.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AcceptCounts {
    pub offered: Vec<u64>,
    pub reached: Vec<u64>,
    /// Anchors walked, and Σ 1/τ_anchor over them.
    #[serde(default)]
    pub anchors: u64,
    #[serde(default)]
    pub inverse_tau_sum: f64,
}

impl AcceptCounts {
    /// Counts for blocks of `positions` drafts (B − 1).
    pub fn new(positions: usize) -> Self {
        Self {
            offered: vec![0; positions],
            reached: vec![0; positions],
            anchors: 0,
            inverse_tau_sum: 0.0,
        }
    }

    /// Walk one block: entry k-1 is `Some(draft k is right)`, or `None` where position k has
    /// no label (the walk ends there, as it ends at the first wrong draft). Returns the drafts
    /// accepted (τ_anchor − 1).
    pub fn add_block(&mut self, drafts: impl IntoIterator<Item = Option<bool>>) -> usize {
        let mut accepted = 0;
        for (k, d) in drafts.into_iter().enumerate() {
            let Some(right) = d else { break };
            if self.offered.len() <= k {
                self.offered.resize(k + 1, 0);
                self.reached.resize(k + 1, 0);
            }
            self.offered[k] += 1;
            if !right {
                break;
            }
            self.reached[k] += 1;
            accepted += 1;
        }
        self.anchors += 1;
        self.inverse_tau_sum += 1.0 / (1 + accepted) as f64;
        accepted
    }

    pub fn merge(&mut self, o: &AcceptCounts) {
        if self.offered.len() < o.offered.len() {
            self.offered.resize(o.offered.len(), 0);
            self.reached.resize(o.reached.len(), 0);
        }
        for (i, (a, b)) in o.offered.iter().zip(&o.reached).enumerate() {
            self.offered[i] += a;
            self.reached[i] += b;
        }
        self.anchors += o.anchors;
        self.inverse_tau_sum += o.inverse_tau_sum;
    }

    /// Per-position acceptance rates, up to the first position never offered.
    pub fn rates(&self) -> Vec<f64> {
        self.offered
            .iter()
            .zip(&self.reached)
            .take_while(|(o, _)| **o > 0)
            .map(|(o, r)| *r as f64 / *o as f64)
            .collect()
    }

    /// The chain τ these rates imply at uniform anchors ([`simulated_chain_tau`]).
    pub fn simulated_tau(&self) -> f64 {
        simulated_chain_tau(&self.rates())
    }

    /// The pooled τ decoding would measure ([`simulated_decoding_tau`]).
    pub fn simulated_decoding_tau(&self) -> f64 {
        simulated_decoding_tau(self.inverse_tau_sum, self.anchors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_rounds_counts_the_rounds_before_the_end_as_the_walk_does() {
        assert_eq!(walk_rounds(10, 20, &[4, 1, 6, 3]), (9, 3));
        // the same response as walk_decoding's example, walked from the decoded rounds
        let acc = |a: usize| {
            Some(match a {
                10 => 3,
                14 => 0,
                _ => 7,
            })
        };
        assert_eq!(walk_decoding(10, 20, acc), Some((9, 3)));
        assert_eq!(walk_rounds(10, 20, &[4, 1, 8]), (9, 3));
        assert_eq!(walk_rounds(10, 11, &[3]), (0, 0));
        assert_eq!(walk_rounds(10, 20, &[]), (0, 0));
    }

    fn round(drafted: usize, accepted: usize) -> RoundOutcome {
        RoundOutcome {
            drafted,
            accepted,
            tau_round: accepted + 1,
            ..Default::default()
        }
    }

    #[test]
    fn both_conventions() {
        let a = [round(3, 3), round(3, 0)]; // τ 4, 1 → mean 2.5
        let b = [round(3, 1)]; // τ 2
        let s = summarize(&[&a, &b]);
        assert_eq!(s.rounds, 3);
        assert_eq!(s.committed, 7);
        assert!((s.tau_pooled - 7.0 / 3.0).abs() < 1e-12);
        assert!((s.tau_mean_of_means - 2.25).abs() < 1e-12);
        assert_eq!(s.tau_histogram, vec![0, 1, 1, 0, 1]);
        // position 1: offered 3, accepted 2; position 2: offered 2 (acc>=1), accepted 1; 3: 1/1
        assert_eq!(s.per_position_acceptance, vec![2.0 / 3.0, 0.5, 1.0]);
        assert!((simulated_chain_tau(&[0.5, 0.5]) - 1.75).abs() < 1e-12);
    }

    #[test]
    fn a_block_is_walked_as_a_chain() {
        let mut c = AcceptCounts::new(3);
        c.add_block([Some(true), Some(false), Some(true)]);
        assert_eq!(
            (c.offered.clone(), c.reached.clone()),
            (vec![1, 1, 0], vec![1, 0, 0])
        );
        // a block whose second position has no label ends there, with one draft accepted
        c.add_block([Some(true), None, Some(true)]);
        assert_eq!(
            (c.offered.clone(), c.reached.clone()),
            (vec![2, 1, 0], vec![2, 0, 0])
        );
        c.add_block([Some(false), Some(true), Some(true)]);
        assert_eq!(c.anchors, 3);
        // τ_anchor 2, 2, 1 → harmonic 3 / (1/2 + 1/2 + 1) = 1.5
        assert!((c.simulated_decoding_tau() - 1.5).abs() < 1e-12);
        assert_eq!(c.rates(), vec![2.0 / 3.0, 0.0]);
        let mut m = AcceptCounts::new(1);
        m.merge(&c);
        assert_eq!(m, c);
    }

    #[test]
    fn time_per_token_counts_the_decoded_tokens_only() {
        assert!((decode_secs_per_token(0.63, 64) - 0.01).abs() < 1e-12);
        // one new token: it came from the prefill; no division by zero
        assert_eq!(decode_secs_per_token(0.5, 1), 0.5);
        assert_eq!(decode_secs_per_token(0.5, 0), 0.5);
    }

    #[test]
    fn the_walk_of_the_doc_example_and_a_missing_anchor() {
        let acc = |a: usize| match a {
            10 => Some(3),
            14 => Some(0),
            15 => Some(7),
            _ => None,
        };
        assert_eq!(walk_decoding(10, 20, acc), Some((9, 3)));
        // an anchor the walk visits without a record
        assert_eq!(walk_decoding(10, 20, |a| (a != 14).then_some(3)), None);
        // a response of one token: nothing to decode
        assert_eq!(walk_decoding(10, 11, acc), Some((0, 0)));
    }

    #[test]
    fn decoding_tau_is_the_harmonic_mean_and_matches_a_replayed_walk() {
        // half the positions accept everything (τ 16), half nothing (τ 1)
        assert!(
            (simulated_decoding_tau(0.5 * 100.0 / 16.0 + 0.5 * 100.0, 100)
                - 1.0 / (0.5 / 16.0 + 0.5))
                .abs()
                < 1e-12
        );
        assert_eq!(simulated_decoding_tau(0.0, 0), 1.0);
        // replay decoding over a sequence made of regions of constant τ: rounds jump by τ(p)
        let regions = [(160usize, 16usize), (40, 1), (96, 4), (30, 1), (64, 16)];
        let tau_at: Vec<usize> = regions
            .iter()
            .flat_map(|&(len, t)| std::iter::repeat_n(t, len))
            .collect();
        // (the walk from position 0; `end` one past the last: every position is a token)
        let (tokens, rounds) = walk_decoding(0, tau_at.len() + 1, |a| Some(tau_at[a] - 1)).unwrap();
        assert_eq!(tokens as usize, tau_at.len());
        let measured = tokens as f64 / rounds as f64;
        let inv: f64 = tau_at.iter().map(|&t| 1.0 / t as f64).sum();
        let harmonic = simulated_decoding_tau(inv, tau_at.len() as u64);
        let arithmetic = tau_at.iter().sum::<usize>() as f64 / tau_at.len() as f64;
        assert!(
            (harmonic - measured).abs() < 1e-9,
            "harmonic {harmonic} vs replay {measured}"
        );
        assert!(
            arithmetic > 2.0 * measured,
            "arithmetic {arithmetic} overstates {measured}"
        );
    }
}
