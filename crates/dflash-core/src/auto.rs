//! `--mode auto`: each round, the DDTree budget (0 = an AR step) with the most expected
//! committed tokens for what it costs on this machine, and no draft at all while drafting
//! does not pay.
//!
//! **Expected tokens.** DDTree's best-first tree adds nodes in order of their path probability
//! under the drafter's per-position distributions, so the first `b` nodes of the tree of budget
//! `N` are the tree of budget `b`, and the expected accepted drafts of that tree are the sum of
//! its nodes' path probabilities ([`expected_accepted`]). The drafter's probabilities are then
//! scaled by how much it has been accepted against what they predicted so far in the run
//! (`calibration`).
//!
//! **Cost.** A [`CostModel`] of this pair on this device: the draft forward's time and the
//! verify's time per row count, averaged over the rounds seen (a row count not seen yet is
//! read off a line through the ones seen, or off the CPU's prior shape through one).
//!
//! **The choice.** With `R` the run's tokens per second so far, a round's budget `b` maximises
//! `tokens(b) − R · seconds(b)`: the choice that raises the long-run rate (a round is worth
//! taking when it commits more than the time it takes would at the current rate). The draft is
//! paid before the choice, so it does not enter it; it enters the next round's question,
//! whether to draft at all: when an AR step has lately been worth more than the drafted
//! rounds' best budgets counting their drafts (a running average of the difference; after a
//! probe resumed drafting, the mean since it), the next rounds are AR steps without a draft,
//! and a draft probes again after 4, then 8, 16 and 32 such steps while it keeps losing.
//!
//! Example: AR step 6 ms, verify of 5 rows 8 ms, draft 2 ms, R = 250 tokens/s, calibrated
//! expectations E = [0, 0.9, 1.5, 1.9, 2.2]: scores 1 − 1.5 = −0.5 for b = 0, and for b = 4
//! 3.2 − 250 · 0.008 = 1.2 → budget 4; an AR step (1 − 1.5 = −0.5) is below b = 4 with its
//! draft (3.2 − 2.5 = 0.7), so the next round drafts too.

use crate::tree::DraftTree;

/// Expected accepted drafts of a best-first tree's first `b` non-root nodes, for `b = 0 ..=
/// scores.len() − 1`, from each node's cumulative log-probability ([`DraftTree::build_scored`]):
/// a node is accepted when its whole path is, and the sum of those probabilities is the
/// expected accepted length. Example: scores [0, −0.1, −0.3] → [0, 0.905, 0.905 + 0.741].
pub fn expected_accepted(scores: &[f64]) -> Vec<f64> {
    let mut out = vec![0f64; scores.len()];
    for i in 1..scores.len() {
        out[i] = out[i - 1] + scores[i].exp();
    }
    out
}

/// The tree's first `n` nodes (the root and `n − 1` drafts): the tree of budget `n − 1` when
/// the tree was built best-first. Example: a tree of 5 nodes cut to 3 keeps rows 0, 1, 2.
pub fn first_nodes(tree: &DraftTree, n: usize) -> DraftTree {
    let n = n.clamp(1, tree.len());
    DraftTree {
        tokens: tree.tokens[..n].to_vec(),
        parents: tree.parents[..n].to_vec(),
        depths: tree.depths[..n].to_vec(),
    }
}

/// Relative cost of a verify of `r` rows on the CPU before any has been measured (a row's
/// multiply-adds beside a step's fixed costs: a 5-row verify ≈ 1.6 steps).
fn prior_shape(r: usize) -> f64 {
    1.0 + 0.15 * (r as f64 - 1.0)
}

/// What a round costs here: the draft forward, and the verify per row count (seconds, each an
/// average over the rounds seen, recent ones weighing more).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CostModel {
    /// `verify[r]`: seconds of a verify of `r` rows, where seen.
    pub verify: Vec<Option<f64>>,
    pub draft: Option<f64>,
}

/// Weight of the newest observation in the running averages.
const EMA: f64 = 0.2;

fn ema(old: Option<f64>, x: f64) -> f64 {
    old.map_or(x, |o| o + EMA * (x - o))
}

impl CostModel {
    pub fn observe_verify(&mut self, rows: usize, secs: f64) {
        if self.verify.len() <= rows {
            self.verify.resize(rows + 1, None);
        }
        self.verify[rows] = Some(ema(self.verify[rows], secs));
    }

    pub fn observe_draft(&mut self, secs: f64) {
        self.draft = Some(ema(self.draft, secs));
    }

    /// Seconds of a verify of `rows` rows: as seen; else on the least-squares line through
    /// the row counts seen (two or more, its slope at least 0); else the prior shape through
    /// the one seen; `None` before any.
    pub fn verify(&self, rows: usize) -> Option<f64> {
        if let Some(Some(t)) = self.verify.get(rows) {
            return Some(*t);
        }
        let seen: Vec<(f64, f64)> = self
            .verify
            .iter()
            .enumerate()
            .filter_map(|(r, t)| t.map(|t| (r as f64, t)))
            .collect();
        match seen.len() {
            0 => None,
            1 => {
                let (r0, t0) = seen[0];
                Some(t0 * prior_shape(rows) / prior_shape(r0 as usize))
            }
            n => {
                let n = n as f64;
                let (mx, my) = (
                    seen.iter().map(|p| p.0).sum::<f64>() / n,
                    seen.iter().map(|p| p.1).sum::<f64>() / n,
                );
                let sxx: f64 = seen.iter().map(|p| (p.0 - mx).powi(2)).sum();
                let sxy: f64 = seen.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
                let slope = (sxy / sxx).max(0.0);
                Some((my + slope * (rows as f64 - mx)).max(1e-6))
            }
        }
    }
}

/// The run's choices, for `--json` and reports.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AutoStats {
    /// `budgets[b]`: rounds that verified a tree of budget `b` after a draft (0: the draft
    /// was not used).
    pub budgets: Vec<usize>,
    /// Rounds decoded as AR steps without a draft.
    pub undrafted: usize,
    /// Accepted drafts the calibrated drafter predicted, and those the target accepted, over
    /// the drafted rounds with a budget > 0.
    pub predicted_accepted: f64,
    pub observed_accepted: usize,
    pub cost: CostModel,
}

/// The per-round policy of `--mode auto` (see the module doc).
#[derive(Debug, Clone)]
pub struct AutoPolicy {
    pub max_budget: usize,
    cost: CostModel,
    /// Σ accepted / Σ predicted, both decayed: how far to trust the drafter's probabilities.
    obs: f64,
    pred: f64,
    /// Tokens per second of the run so far (decayed).
    rate: Option<f64>,
    /// A drafted round's best score, its draft counted, over an AR step's: whether drafting
    /// pays lately. After a probe resumed drafting, the mean over the drafted rounds since;
    /// a decayed average once [`ADVANTAGE_ROUNDS`] have been seen, and from the run's start.
    advantage: Option<f64>,
    /// Drafted rounds judged since the last probe (at least [`ADVANTAGE_ROUNDS`] from the
    /// run's start).
    judged: usize,
    /// Whether a round was seen: the first one's times are not costs (its draft reads the
    /// whole prompt's context, its forwards start cold), so they are left out.
    warm: bool,
    /// AR steps left before the next draft, and the next wait after a losing draft.
    wait: usize,
    /// Whether this round's draft is a probe after AR steps.
    probe: bool,
    /// The budgets of the last drafted rounds (the newest last), which bound how deep the
    /// next draft needs to look.
    recent: std::collections::VecDeque<usize>,
    backoff: usize,
    stats: AutoStats,
}

/// Steps without a draft after the first losing one; doubled up to [`MAX_WAIT`].
const FIRST_WAIT: usize = 4;
const MAX_WAIT: usize = 32;
/// The budget of the first rounds, before anything is measured, and the least of a probe.
const EXPLORE: usize = 4;
/// Drafted rounds after which the advantage of drafting is a decayed average of weight
/// 1 / this: about the last ten rounds decide (a round's outcome is noisy: a math answer's
/// trees fail two rounds in a row often enough and still pay). After a probe resumed drafting
/// it is the mean of the rounds since, so that one lucky probe on text the drafter does not
/// know resumes drafting for a few rounds, not for the ten its weight alone would take to
/// decay. E.g. a probe that gains +1.4 then rounds of −0.6: means 0.4, 0.07, −0.1 → three
/// rounds, where the decayed average would take twelve.
const ADVANTAGE_ROUNDS: usize = 10;

impl AutoPolicy {
    pub fn new(max_budget: usize) -> AutoPolicy {
        AutoPolicy {
            max_budget: max_budget.max(1),
            cost: CostModel::default(),
            obs: 0.0,
            pred: 0.0,
            rate: None,
            advantage: None,
            judged: 0,
            warm: false,
            wait: 0,
            probe: false,
            recent: std::collections::VecDeque::new(),
            backoff: FIRST_WAIT,
            stats: AutoStats::default(),
        }
    }

    /// The factor on the drafter's expectations: accepted over predicted so far, with one
    /// token of each as a prior, within [0.2, 3].
    pub fn calibration(&self) -> f64 {
        ((self.obs + 1.0) / (self.pred + 1.0)).clamp(0.2, 3.0)
    }

    /// How many positions the next draft computes: one more than the largest budget of the
    /// last 8 drafted rounds (the first rounds': the exploring budget's), at most the largest
    /// budget. A tree deeper than its budget cannot be, and the drafter's last layer and head
    /// then run on fewer rows (the cost model's draft is one cost, so the depth stays near the
    /// budgets that paid lately). Example: budgets 3, 5, 4 lately, at most 15 → 6 positions.
    pub fn positions(&self) -> usize {
        let recent = self.recent.iter().copied().max().unwrap_or(EXPLORE);
        (recent + 1).min(self.max_budget)
    }

    /// Whether this round drafts (else it is an AR step without a draft).
    pub fn drafts(&mut self) -> bool {
        if self.wait > 0 {
            self.wait -= 1;
            self.probe = self.wait == 0;
            return false;
        }
        true
    }

    /// This round's budget from the drafter's raw expectations `expected[b]` (b = 0 ..=
    /// the largest tree built). A probe after AR steps verifies a tree of at least the first
    /// round's budget, so that what it learns is about drafts.
    pub fn choose(&self, expected: &[f64]) -> usize {
        let most = self.max_budget.min(expected.len().saturating_sub(1));
        let (Some(rate), Some(_)) = (self.rate, self.cost.verify(1)) else {
            return EXPLORE.min(most);
        };
        let k = self.calibration();
        let score = |b: usize| {
            let v = self.cost.verify(b + 1).unwrap_or(f64::INFINITY);
            k * expected[b] + 1.0 - rate * v
        };
        let best = (0..=most)
            .max_by(|&a, &b| score(a).total_cmp(&score(b)).then(b.cmp(&a)))
            .unwrap_or(0);
        match self.probe {
            true => best.max(EXPLORE.min(most)),
            false => best,
        }
    }

    /// A round's outcome: whether it drafted, the budget verified (its rows are `budget + 1`),
    /// the drafts accepted against the raw expectation of that budget, the tokens it committed
    /// and its times. A drafted round also decides whether the next rounds draft: by what
    /// drafted rounds lately committed beyond their time at the run's rate (their drafts
    /// counted), against an AR step; a probe after AR steps judges the text as it is now.
    #[allow(clippy::too_many_arguments)]
    pub fn observe(
        &mut self,
        drafted: bool,
        budget: usize,
        expected: f64,
        accepted: usize,
        produced: usize,
        draft_secs: f64,
        verify_secs: f64,
        other_secs: f64,
    ) {
        let timed = std::mem::replace(&mut self.warm, true);
        let rate = self.rate;
        if timed {
            self.cost
                .observe_verify(budget + 1, verify_secs + other_secs);
        }
        if drafted {
            if timed {
                self.cost.observe_draft(draft_secs);
            }
            if self.stats.budgets.len() <= budget {
                self.stats.budgets.resize(budget + 1, 0);
            }
            self.stats.budgets[budget] += 1;
            if self.recent.len() == 8 {
                self.recent.pop_front();
            }
            self.recent.push_back(budget);
            if budget > 0 {
                self.obs = 0.9 * self.obs + accepted as f64;
                self.pred = 0.9 * self.pred + expected;
                self.stats.predicted_accepted += self.calibration() * expected;
                self.stats.observed_accepted += accepted;
            }
            let c = &self.cost;
            if let (Some(r), Some(v1), Some(vb), Some(d)) =
                (rate, c.verify(1), c.verify(budget + 1), c.draft)
            {
                let gain = (produced as f64 - r * (d + vb)) - (1.0 - r * v1);
                let probe = std::mem::take(&mut self.probe);
                let before = match probe {
                    true => None,
                    false => self.advantage,
                };
                // after a probe the mean since it; from the run's start the decayed average
                self.judged = match (probe, before) {
                    (true, _) => 1,
                    (false, None) => ADVANTAGE_ROUNDS,
                    (false, Some(_)) => self.judged + 1,
                };
                let w = 1.0 / self.judged.min(ADVANTAGE_ROUNDS) as f64;
                let advantage = before.map_or(gain, |a| a + w * (gain - a));
                self.advantage = Some(advantage);
                if advantage < 0.0 {
                    self.wait = self.backoff;
                    self.backoff = (2 * self.backoff).min(MAX_WAIT);
                } else {
                    self.backoff = FIRST_WAIT;
                }
            }
        } else {
            self.stats.undrafted += 1;
        }
        let secs = draft_secs + verify_secs + other_secs;
        if timed && secs > 0.0 {
            self.rate = Some(ema(self.rate, produced as f64 / secs));
        }
    }

    /// What the run chose so far.
    pub fn stats(&self) -> AutoStats {
        AutoStats {
            cost: self.cost.clone(),
            ..self.stats.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expectations_are_the_path_probabilities_in_tree_order() {
        // the tree module's example: nodes a (−0.1), a→c (−0.3), a→d (−1.1)
        let top = vec![vec![(1, -0.1f32), (2, -2.0)], vec![(3, -0.2f32), (4, -1.0)]];
        let (tree, scores) = DraftTree::build_scored(0, 2, 3, |d, _| top[d - 1].clone());
        assert_eq!(tree, DraftTree::build(0, &top, 3));
        let e = expected_accepted(&scores);
        let want = [0.0, (-0.1f64).exp(), (-0.3f64).exp(), (-1.1f64).exp()];
        let mut acc = 0.0;
        for (b, w) in want.iter().enumerate() {
            acc += w;
            assert!((e[b] - acc).abs() < 1e-6, "b = {b}: {} vs {acc}", e[b]);
        }
        // the first nodes of the budget-3 tree are the budget-2 tree
        assert_eq!(first_nodes(&tree, 3), DraftTree::build(0, &top, 2));
    }

    #[test]
    fn the_cost_model_reads_seen_rows_then_a_line_then_the_prior() {
        let mut c = CostModel::default();
        assert_eq!(c.verify(3), None);
        c.observe_verify(5, 0.008);
        assert_eq!(c.verify(5), Some(0.008));
        let one = c.verify(1).unwrap();
        assert!((one - 0.008 / prior_shape(5)).abs() < 1e-12);
        c.observe_verify(1, 0.006);
        // the line through (1, 6 ms) and (5, 8 ms)
        assert!((c.verify(3).unwrap() - 0.007).abs() < 1e-9);
        assert!((c.verify(9).unwrap() - 0.010).abs() < 1e-9);
        // averages move 20 % of the way to a new observation
        c.observe_verify(1, 0.011);
        assert!((c.verify(1).unwrap() - 0.007).abs() < 1e-9);
    }

    /// The module doc's example, with the cost model and the rate set as there.
    fn policy_at(ar: f64, v5: f64, draft: f64, rate: f64) -> AutoPolicy {
        let mut p = AutoPolicy::new(4);
        p.cost.observe_verify(1, ar);
        p.cost.observe_verify(5, v5);
        p.cost.observe_draft(draft);
        p.rate = Some(rate);
        p.warm = true;
        p
    }

    #[test]
    fn the_budget_maximises_tokens_minus_their_time_at_the_runs_rate() {
        let e = [0.0, 0.9, 1.5, 1.9, 2.2];
        let p = policy_at(0.006, 0.008, 0.002, 250.0);
        assert_eq!(p.choose(&e), 4);
        // a drafter that is rarely right: the AR step
        let weak = [0.0, 0.05, 0.08, 0.1, 0.11];
        assert_eq!(policy_at(0.006, 0.008, 0.002, 150.0).choose(&weak), 0);
        // a cheap verify (a GPU: 9 rows cost an AR step) takes the whole budget
        assert_eq!(policy_at(0.001, 0.001, 0.0005, 600.0).choose(&weak), 4);
    }

    /// Drafted rounds that commit less than their time is worth stop the drafts for 4, then 8
    /// steps; a probe that pays resumes them at once.
    #[test]
    fn drafting_stops_while_it_loses_and_a_paying_probe_resumes_it() {
        // 5 rows cost 8 ms with the draft's 2 ms; at 150 tokens/s a round must commit 1.6
        // tokens to beat an AR step's 1 (its 6 ms worth 0.9)
        let mut p = policy_at(0.006, 0.008, 0.002, 150.0);
        let round = |p: &mut AutoPolicy, produced: usize| {
            p.observe(true, 4, 1.0, produced - 1, produced, 0.002, 0.008, 0.0)
        };
        round(&mut p, 3);
        assert!(p.drafts(), "3 tokens pay");
        let mut poor = 0;
        loop {
            round(&mut p, 1);
            poor += 1;
            if !p.drafts() {
                break;
            }
            assert!(poor < 30, "losing rounds must stop the drafts");
        }
        assert!(
            poor >= 3,
            "a few poor rounds after a paying one do not stop the drafts"
        );
        let drafted: Vec<bool> = (0..4).map(|_| p.drafts()).collect();
        assert_eq!(
            drafted,
            [false, false, false, true],
            "4 AR steps, then a probe"
        );
        // the probe verifies a tree even when the expectations say an AR step
        assert_eq!(p.choose(&[0.0, 0.01, 0.02, 0.03, 0.04]), 4);
        round(&mut p, 1);
        assert_eq!(
            (0..9).filter(|_| !p.drafts()).count(),
            8,
            "losing again waits longer"
        );
        round(&mut p, 4);
        assert!(p.drafts(), "a paying probe resumes drafting");
        // after a probe the mean since it judges: the probe gained 4 − 1.6 = 2.4, a poor round
        // −0.6, so (2.4 − 0.6 n) / (n + 1) < 0 from n = 5 (a decayed average of weight 0.1
        // would go on for 16)
        let mut after = 0;
        while p.drafts() {
            round(&mut p, 1);
            after += 1;
            assert!(after <= 6, "poor rounds after a lucky probe keep drafting");
        }
        assert!(
            after >= 2,
            "one poor round after a paying probe does not stop the drafts"
        );
    }

    #[test]
    fn calibration_follows_what_the_target_accepted() {
        let e = [0.0, 0.2, 0.35, 0.45, 0.5];
        let mut p = policy_at(0.006, 0.008, 0.002, 250.0);
        assert_eq!(p.calibration(), 1.0);
        // a row costs 0.5 ms, 0.125 tokens at 250 tokens/s: the first two nodes pay
        assert_eq!(p.clone().choose(&e), 2);
        for _ in 0..20 {
            // predicted 2 drafts, 0 accepted; the rate falls to about 100 tokens/s
            p.observe(true, 4, 2.0, 0, 1, 0.002, 0.008, 0.0);
        }
        assert!(p.calibration() < 0.2 + 1e-9);
        // the same expectations, scaled by 0.2, no longer pay for a node
        assert_eq!(p.choose(&e), 0);
        let s = p.stats();
        assert_eq!(s.budgets[4], 20);
        assert_eq!(s.observed_accepted, 0);
    }

    #[test]
    fn the_first_round_explores_and_its_times_are_left_out() {
        let mut p = AutoPolicy::new(16);
        assert!(p.drafts());
        assert_eq!(p.choose(&[0.0; 17]), EXPLORE);
        // the first round's draft read the whole prompt: not a cost; the second explores again
        p.observe(true, EXPLORE, 1.0, 1, 2, 0.050, 0.020, 0.0);
        assert!(p.stats().cost.draft.is_none() && p.stats().cost.verify.is_empty());
        assert_eq!(p.choose(&[0.0; 17]), EXPLORE);
        p.observe(true, EXPLORE, 1.0, 1, 2, 0.002, 0.008, 0.0);
        assert_eq!(p.stats().cost.draft, Some(0.002));
        assert_eq!(p.stats().budgets[EXPLORE], 2);
        // the drafts look one deeper than the recent budgets
        assert_eq!(p.positions(), EXPLORE + 1);
        p.observe(true, 9, 1.0, 1, 2, 0.002, 0.012, 0.0);
        assert_eq!(p.positions(), 10);
        assert_eq!(AutoPolicy::new(3).positions(), 3);
        let p = AutoPolicy::new(2);
        assert_eq!(p.choose(&[0.0; 17]), 2);
    }
}
