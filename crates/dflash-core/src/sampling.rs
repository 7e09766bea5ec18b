//! Sampling parameters and the seeded sampler.
//!
//! The rule follows z-lab's `_sampling_probs`: temperature 0 is greedy (first maximal index);
//! otherwise scores = logits / T, keep the top-k scores (k = 0: all), softmax (normalised by an
//! f64 sum of the kept weights), then keep the smallest prefix of the descending probabilities
//! whose mass reaches top-p (a token is kept while the mass before it is < top-p), renormalise
//! and draw. The RNG is ChaCha8 seeded by
//! `seed`, so a run is reproducible on every platform.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::tree::top_k_sorted;
use crate::CoreError;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

/// A sampling parameter, as [`SamplingParams::check`] names the one at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplingField {
    Temperature,
    TopP,
    TopK,
}

impl SamplingParams {
    /// Checks the parameters as a user gives them: temperature >= 0, top-p in (0, 1], top-k >= 0.
    pub fn new(temperature: f64, top_p: f64, top_k: i64, seed: u64) -> Result<Self, CoreError> {
        if let Err((_, msg)) = Self::check(temperature, top_p, top_k) {
            return Err(CoreError::Sampling(msg));
        }
        Ok(Self {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k: top_k as usize,
            seed,
        })
    }
    /// The rule [`SamplingParams::new`] checks, with the parameter at fault (an HTTP error
    /// names it). Example: top-p 1.5 → `Err((SamplingField::TopP, "top-p must be in (0, 1], got 1.5"))`.
    pub fn check(temperature: f64, top_p: f64, top_k: i64) -> Result<(), (SamplingField, String)> {
        if !temperature.is_finite() || temperature < 0.0 {
            let m = format!("temperature must be >= 0, got {temperature}");
            return Err((SamplingField::Temperature, m));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err((
                SamplingField::TopP,
                format!("top-p must be in (0, 1], got {top_p}"),
            ));
        }
        if top_k < 0 {
            return Err((
                SamplingField::TopK,
                format!("top-k must be >= 0, got {top_k}"),
            ));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Index of the first maximal value.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The mass the softmax normalises by: the unnormalised weights `w` of the kept tokens (`None`:
/// every token) summed in f64 in token-id order, whatever order they were ranked in — one
/// definition for [`sampling_probs`] and [`Sampler::sample`], so both give the same
/// probabilities bit for bit.
fn kept_mass(w: &[f32], kept: Option<&[u32]>) -> f32 {
    let Some(kept) = kept else {
        return w.iter().map(|&x| x as f64).sum::<f64>() as f32;
    };
    let mut ids = kept.to_vec();
    ids.sort_unstable();
    ids.iter().map(|&i| w[i as usize] as f64).sum::<f64>() as f32
}

/// The `k` most likely tokens in sampling order: the higher logit first, ties by the lower
/// token id (`tree::top_k_sorted`'s order, the one DDTree ranks candidates by).
fn ranked_ids(logits: &[f32], k: usize) -> Vec<u32> {
    top_k_sorted(logits, k)
        .into_iter()
        .map(|(t, _)| t)
        .collect()
}

/// The number of tokens top-k keeps (0: all).
fn kept_len(logits: &[f32], p: &SamplingParams) -> usize {
    if p.top_k > 0 && p.top_k < logits.len() {
        p.top_k
    } else {
        logits.len()
    }
}

/// The unnormalised softmax weights `exp(l_i / T − max / T)` of every token, in token order.
fn weights(logits: &[f32], t: f32) -> Vec<f32> {
    let max = logits
        .iter()
        .copied()
        .max_by(|a, b| a.total_cmp(b))
        .unwrap_or(0.0)
        / t;
    logits.iter().map(|&l| (l / t - max).exp()).collect()
}

/// The sampling distribution as (token, probability) pairs with non-zero mass, in
/// descending probability order. The definition [`Sampler::sample`] draws from (it ranks only
/// as far as its draw needs); e.g. logits [0, 2, 1, −1], T = 1, top-p 0.7: softmax .644, .237,
/// .087, .032 → tokens 1 and 2 kept (mass before token 2 is .644 < .7), renormalised .731, .269.
pub fn sampling_probs(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
    let w = weights(logits, p.temperature);
    let n = kept_len(logits, p);
    let mut idx = ranked_ids(logits, n);
    let sum = kept_mass(&w, (n < logits.len()).then_some(&idx[..]));
    let mut probs: Vec<f32> = idx.iter().map(|&i| w[i as usize] / sum).collect();
    if p.top_p < 1.0 {
        let mut before = 0.0f32;
        let mut keep = 0;
        for &x in &probs {
            if before < p.top_p {
                keep += 1;
                before += x;
            } else {
                break;
            }
        }
        probs.truncate(keep.max(1));
        idx.truncate(keep.max(1));
        let s: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= s);
    }
    idx.into_iter()
        .zip(probs)
        .filter(|(_, q)| *q > 0.0)
        .collect()
}

/// [`sampling_probs`] as a dense vector over the vocabulary (0 for the tokens the rule drops):
/// the same probabilities bit for bit, without a ranking when neither top-k nor top-p drops
/// anything. What speculative sampling compares draft and target with
/// ([`crate::acceptance`]). E.g. logits [0, 2, 1, −1], T = 1, top-p 0.7 → [0, .731, .269, 0].
pub fn dense_probs(logits: &[f32], p: &SamplingParams) -> Vec<f32> {
    if p.top_p >= 1.0 && kept_len(logits, p) == logits.len() {
        let w = weights(logits, p.temperature);
        let sum = kept_mass(&w, None);
        return w.iter().map(|&x| x / sum).collect();
    }
    let mut dense = vec![0.0; logits.len()];
    for (t, q) in sampling_probs(logits, p) {
        dense[t as usize] = q;
    }
    dense
}

/// The token a uniform draw `u` in [0, 1) picks from a distribution in [`sampling_probs`]
/// order: the first whose cumulative probability exceeds `u` (the last one if rounding leaves
/// the total below `u`). E.g. [(1, .731), (2, .269)], u = .8 → token 2. The reference that
/// [`Sampler::sample`]'s lazy walk is tested and measured against.
pub fn draw(dist: &[(u32, f32)], u: f32) -> u32 {
    let mut acc = 0.0;
    for &(tok, q) in dist {
        acc += q;
        if u < acc {
            return tok;
        }
    }
    dist.last().map_or(0, |d| d.0)
}

/// The first `n` tokens in sampling order, ranked only as far as asked: the first 64, then 8×
/// more each time a walk goes past them, so a draw that ends early pays for one pass over the
/// row instead of a sort of the whole vocabulary (≈ 2.4 ms per sampled token of SmolLM2 on the
/// H200's host).
struct Ranked<'a> {
    logits: &'a [f32],
    n: usize,
    ids: Vec<u32>,
}

impl<'a> Ranked<'a> {
    fn new(logits: &'a [f32], n: usize) -> Self {
        Self {
            logits,
            n,
            ids: ranked_ids(logits, n.min(64)),
        }
    }

    /// The token of rank `i` < `n` (0: the most likely).
    fn get(&mut self, i: usize) -> u32 {
        if i >= self.ids.len() {
            let k = (self.ids.len() * 8).max(i + 1).min(self.n);
            self.ids = ranked_ids(self.logits, k);
        }
        self.ids[i]
    }
}

/// A seeded sampler; one per generation.
#[derive(Debug, Clone)]
pub struct Sampler {
    pub params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        }
    }

    /// One uniform number in [0, 1) from this generation's stream.
    pub(crate) fn uniform(&mut self) -> f32 {
        self.rng.random()
    }

    /// Put the stream at the number of new token `token` (0: the first after the prompt). AR
    /// draws one number per token, so new token i is drawn with number i; a round judged by
    /// the exact match draws the target's token at each verify row with the number of the
    /// token that row decides (its depth after the committed ones), and seeks to the first
    /// uncommitted token after: its committed tokens are then AR's draws from the same seed.
    /// Example: 5 tokens committed, a chain round draws rows 0…3 with numbers 5…8, keeps 2
    /// drafts and the bonus (tokens 5, 6, 7) → seek(8): number 8 decides token 8 next round.
    /// The numbers a round drew for rows it did not commit decided nothing that was kept, so
    /// drawing with them again keeps every committed token a fresh draw.
    pub fn seek(&mut self, token: usize) {
        // one f32 takes one 32-bit word of the stream
        self.rng.set_word_pos(token as u128);
    }

    /// The next `k` uniform numbers of this generation's stream, drawn up front (a round
    /// sampled on the device: its draws, verdicts and bonuses).
    pub fn uniforms(&mut self, k: usize) -> Vec<f32> {
        (0..k).map(|_| self.uniform()).collect()
    }

    /// The target's own next token given these logits: a draw from [`sampling_probs`] (the same
    /// probabilities, the same walk, one random number per token), ranking lazily.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let p = self.params;
        let w = weights(logits, p.temperature);
        let n = kept_len(logits, &p);
        let mut ranked = Ranked::new(logits, n);
        let sum = if n < logits.len() {
            ranked.get(n - 1); // the whole kept set ranked
            kept_mass(&w, Some(&ranked.ids[..n]))
        } else {
            kept_mass(&w, None)
        };
        let prob = |tok: u32| w[tok as usize] / sum;
        // the nucleus: a prefix of the ranking, renormalised by its own mass
        let (end, norm) = if p.top_p < 1.0 {
            let (mut before, mut keep) = (0.0f32, 0);
            while keep < n && before < p.top_p {
                before += prob(ranked.get(keep));
                keep += 1;
            }
            let keep = keep.max(1);
            let s: f32 = (0..keep).map(|i| prob(ranked.get(i))).sum();
            (keep, Some(s))
        } else {
            (n, None)
        };
        let u: f32 = self.rng.random();
        let (mut acc, mut last) = (0.0f32, None);
        for i in 0..end {
            let tok = ranked.get(i);
            let q = norm.map_or(prob(tok), |s| prob(tok) / s);
            if q > 0.0 {
                acc += q;
                last = Some(tok);
                if u < acc {
                    return tok;
                }
            }
        }
        last.unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_parameters() {
        assert!(SamplingParams::new(-0.1, 1.0, 0, 0)
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        assert!(SamplingParams::new(1.0, 0.0, 0, 0)
            .unwrap_err()
            .to_string()
            .contains("top-p"));
        assert!(SamplingParams::new(1.0, 1.5, 0, 0)
            .unwrap_err()
            .to_string()
            .contains("top-p"));
        assert!(SamplingParams::new(1.0, 1.0, -1, 0)
            .unwrap_err()
            .to_string()
            .contains("top-k"));
    }

    #[test]
    fn top_k_and_top_p_truncate() {
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let p = SamplingParams::new(1.0, 1.0, 2, 0).unwrap();
        let d = sampling_probs(&logits, &p);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        // softmax(2, 1, 0, -1) = .644, .237, .087, .032: top-p 0.7 keeps the first two
        let p = SamplingParams::new(1.0, 0.7, 0, 0).unwrap();
        let d = sampling_probs(&logits, &p);
        assert_eq!(d.len(), 2);
        assert!((d.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
    }

    /// The walk the sampler is defined by: a draw over the whole sorted [`sampling_probs`].
    fn reference_draw(logits: &[f32], p: &SamplingParams, rng: &mut ChaCha8Rng) -> u32 {
        draw(&sampling_probs(logits, p), rng.random())
    }

    /// The lazily ranking sampler draws exactly what a full sort would, token for token, over
    /// temperatures, top-k and top-p, ties, −∞ logits and flat rows (whose draws land far past
    /// the first 64 ranks, so the ranking grows to 512, 4,096 and the whole row).
    #[test]
    fn lazy_ranking_draws_what_a_full_sort_draws() {
        let mut gen = ChaCha8Rng::seed_from_u64(7);
        let mut rows: Vec<Vec<f32>> = vec![vec![0.5], vec![1.0, 1.0], vec![0.0; 5000]];
        for n in [7usize, 100, 5000, 49_152] {
            // quantised values: many ties
            rows.push(
                (0..n)
                    .map(|_| (gen.random::<f32>() * 40.0).round() / 4.0 - 5.0)
                    .collect(),
            );
        }
        let mut with_inf = rows[4].clone();
        with_inf
            .iter_mut()
            .step_by(3)
            .for_each(|x| *x = f32::NEG_INFINITY);
        rows.push(with_inf);
        let mut far = 0;
        for (ri, logits) in rows.iter().enumerate() {
            for t in [0.3, 1.0, 2.0] {
                for top_p in [1.0, 0.9, 0.3] {
                    for top_k in [0, 1, 5, 64, 200] {
                        let seed = (ri * 1000 + top_k) as u64;
                        let p = SamplingParams::new(t, top_p, top_k as i64, seed).unwrap();
                        let mut s = Sampler::new(p);
                        let mut rng = ChaCha8Rng::seed_from_u64(seed);
                        for _ in 0..12 {
                            let (a, b) = (s.sample(logits), reference_draw(logits, &p, &mut rng));
                            assert_eq!(a, b, "row {ri}, T {t}, top-p {top_p}, top-k {top_k}");
                            let rank = sampling_probs(logits, &p).iter().position(|d| d.0 == a);
                            far += usize::from(rank.unwrap() >= 64);
                        }
                    }
                }
            }
        }
        assert!(far > 100, "only {far} draws past rank 64");
    }

    #[test]
    fn seeded_sampling_is_reproducible() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams::new(1.0, 0.9, 0, 42).unwrap();
        let a: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]));
    }
}
