//! Speculative sampling at T > 0: drafts drawn from the drafter's own distribution `q`, kept
//! or rejected against the target's distribution `p` so that every committed token is
//! distributed exactly as the target's own sample (Leviathan et al. 2023; Chen et al. 2023;
//! z-lab's `_rejection_sample`).
//!
//! The rule at one position, for a draft `d` drawn from `q` (both distributions under the
//! request's temperature, top-k and top-p, [`dense_probs`]): keep `d` with probability
//! `min(1, p(d) / q(d))`; at the first rejection the round ends with a bonus drawn from the
//! residual `max(0, p − q)` renormalised (from `p` itself when the residual is empty, i.e.
//! `p = q`). After every draft of a chain is kept, the bonus is the target's own sample at the
//! last row. Why it is exact: a token `t` comes out as `q(t) · min(1, p(t)/q(t)) = min(q(t), p(t))`
//! by acceptance, plus `(1 − Σ min(p, q)) · (p(t) − min(p(t), q(t))) / (1 − Σ min(p, q))` by the
//! residual: `p(t)` in all.
//!
//! Example: p = [.5, .3, .2], q = [.2, .6, .2], draft 1 (drawn with q = .6): kept with
//! probability .3 / .6 = .5; if rejected, the residual is [.3, 0, 0], so the bonus is token 0.
//!
//! At T = 0 the drafts are the drafter's argmax and acceptance is an exact match with the
//! target's argmax (`crate::tree::DraftTree::walk`): the same rule with one-hot `q` and `p`.

use crate::sampling::{dense_probs, Sampler};

/// What the rule decides at one position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The draft is kept; the walk moves on.
    Accept,
    /// The draft is rejected; the round ends with this token (drawn from the residual).
    Reject { bonus: u32 },
}

/// The token a uniform `u` in [0, 1) picks from unnormalised weights `w` of total `sum`,
/// walking in token order (the last token of non-zero weight if rounding leaves `u` past the
/// end).
pub(crate) fn pick(w: impl Iterator<Item = f32>, sum: f64, u: f32) -> u32 {
    let target = u as f64 * sum;
    let (mut acc, mut last) = (0.0f64, 0u32);
    for (t, x) in w.enumerate() {
        if x > 0.0 {
            acc += x as f64;
            last = t as u32;
            if target < acc {
                return last;
            }
        }
    }
    last
}

/// [`pick`] over a slice (the bonus draws of [`crate::sampled_tree`], the device's draws'
/// CPU twin).
pub fn pick_weighted(w: &[f32], sum: f64, u: f32) -> u32 {
    pick(w.iter().copied(), sum, u)
}

/// The verdict on draft `d` drawn from `q`, against `p` (dense distributions over the same
/// vocabulary), given two uniform numbers: `u_accept` decides the draft, `u_bonus` draws the
/// bonus on a rejection.
pub fn judge(p: &[f32], q: &[f32], d: u32, u_accept: f32, u_bonus: f32) -> Verdict {
    let (pd, qd) = (p[d as usize], q[d as usize]);
    // qd > 0 for a draft drawn from q; a draft q gives no mass cannot be kept by the ratio
    if qd > 0.0 && (pd >= qd || u_accept < pd / qd) {
        return Verdict::Accept;
    }
    let residual = || p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0));
    let mass: f64 = residual().map(|x| x as f64).sum();
    let bonus = if mass > 0.0 {
        pick(residual(), mass, u_bonus)
    } else {
        let total = p.iter().map(|&x| x as f64).sum();
        pick(p.iter().copied(), total, u_bonus)
    };
    Verdict::Reject { bonus }
}

impl Sampler {
    /// A draft drawn from the drafter's dense distribution `q` (one uniform number).
    pub fn draw_draft(&mut self, q: &[f32]) -> u32 {
        let total = q.iter().map(|&x| x as f64).sum();
        pick(q.iter().copied(), total, self.uniform())
    }

    /// The drafter's distribution at one position under this sampler's rule, dense over the
    /// vocabulary.
    pub fn draft_distribution(&self, logits: &[f32]) -> Vec<f32> {
        dense_probs(logits, &self.params)
    }

    /// Walk a chain of `drafts` (drawn from `qs`, one distribution per draft) with the target's
    /// logits of each verify row (`logits_at(r)`: row r = the position after the anchor and r
    /// drafts). Returns how many drafts were kept and the bonus token.
    /// Example: drafts (a, b, c), a kept, b rejected → (1, a token from row 1's residual).
    pub fn walk_chain<E>(
        &mut self,
        drafts: &[u32],
        qs: &[Vec<f32>],
        mut logits_at: impl FnMut(usize) -> Result<Vec<f32>, E>,
    ) -> Result<(usize, u32), E> {
        for (k, (&d, q)) in drafts.iter().zip(qs).enumerate() {
            let p = dense_probs(&logits_at(k)?, &self.params);
            let (u_accept, u_bonus) = (self.uniform(), self.uniform());
            if let Verdict::Reject { bonus } = judge(&p, q, d, u_accept, u_bonus) {
                return Ok((k, bonus));
            }
        }
        let last = logits_at(drafts.len())?;
        Ok((drafts.len(), self.sample(&last)))
    }
}

/// Test support: `counts` of `Σ counts` draws agree with `p` within 5 standard deviations per
/// token (the frequency tests of the acceptance rules).
#[cfg(test)]
pub(crate) fn assert_distributed_as(counts: &[usize], p: &[f32], what: &str) {
    let n = counts.iter().sum::<usize>() as f64;
    for (t, &c) in counts.iter().enumerate() {
        let (f, pt) = (c as f64 / n, p[t] as f64);
        let sd = (pt * (1.0 - pt) / n).sqrt().max(1e-9);
        assert!((f - pt).abs() <= 5.0 * sd, "{what}, token {t}: {f} vs {pt}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    /// Drafts drawn from q and judged against p come out distributed as p: the frequencies of
    /// 400,000 rounds of one position agree with p within 5 standard deviations, for a q that
    /// over- and under-weights tokens and for q = p.
    #[test]
    fn one_position_gives_the_target_distribution() {
        let p = [0.5f32, 0.3, 0.15, 0.05, 0.0];
        for q in [[0.1f32, 0.6, 0.05, 0.05, 0.2], p] {
            let mut s = Sampler::new(SamplingParams::new(1.0, 1.0, 0, 7).unwrap());
            let n = 400_000;
            let mut counts = [0usize; 5];
            let mut accepted = 0;
            for _ in 0..n {
                let d = s.draw_draft(&q);
                let (ua, ub) = (s.uniform(), s.uniform());
                let t = match judge(&p, &q, d, ua, ub) {
                    Verdict::Accept => {
                        accepted += 1;
                        d
                    }
                    Verdict::Reject { bonus } => bonus,
                };
                counts[t as usize] += 1;
            }
            assert_distributed_as(&counts, &p, &format!("q {q:?}"));
            // the acceptance rate is Σ min(p, q)
            let rate: f64 = p.iter().zip(&q).map(|(a, b)| a.min(*b) as f64).sum();
            let got = accepted as f64 / n as f64;
            assert!((got - rate).abs() < 5e-3, "acceptance {got} vs {rate}");
        }
    }

    #[test]
    fn the_module_example() {
        let (p, q) = ([0.5f32, 0.3, 0.2], [0.2f32, 0.6, 0.2]);
        assert_eq!(judge(&p, &q, 1, 0.49, 0.9), Verdict::Accept);
        assert_eq!(judge(&p, &q, 1, 0.51, 0.9), Verdict::Reject { bonus: 0 });
        // a draft p favours over q is always kept
        assert_eq!(judge(&p, &q, 0, 0.999, 0.0), Verdict::Accept);
        // p = q: nothing is rejected; a zero-mass draft falls back to p
        assert_eq!(judge(&p, &p, 2, 0.999, 0.0), Verdict::Accept);
        assert_eq!(
            judge(&p, &[0.0, 0.0, 1.0], 1, 0.0, 0.0),
            Verdict::Reject { bonus: 0 }
        );
    }

    /// dense_probs equals sampling_probs scattered, bit for bit, with and without top-k/top-p.
    #[test]
    fn dense_probs_are_sampling_probs() {
        let logits = [0.0f32, 2.0, 1.0, -1.0, 2.0, 0.5];
        for (t, top_p, top_k) in [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.7, 0), (1.3, 1.0, 3)] {
            let p = SamplingParams::new(t, top_p, top_k, 0).unwrap();
            let mut want = vec![0.0f32; logits.len()];
            for (tok, x) in crate::sampling::sampling_probs(&logits, &p) {
                want[tok as usize] = x;
            }
            assert_eq!(dense_probs(&logits, &p), want, "{p:?}");
        }
    }
}
