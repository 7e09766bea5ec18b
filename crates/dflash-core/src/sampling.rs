//! Sampling parameters and the seeded sampler.
//!
//! The rule follows z-lab's `_sampling_probs`: temperature 0 is greedy (first maximal index);
//! otherwise scores = logits / T, keep the top-k scores (k = 0: all), softmax, then keep the
//! smallest prefix of the descending probabilities whose mass reaches top-p (a token is kept
//! while the mass before it is < top-p), renormalise and draw. The RNG is ChaCha8 seeded by
//! `seed`, so a run is reproducible on every platform.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

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

impl SamplingParams {
    /// Checks the parameters as a user gives them: temperature >= 0, top-p in (0, 1], top-k >= 0.
    pub fn new(temperature: f64, top_p: f64, top_k: i64, seed: u64) -> Result<Self, CoreError> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(CoreError::Sampling(format!(
                "temperature must be >= 0, got {temperature}"
            )));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(CoreError::Sampling(format!(
                "top-p must be in (0, 1], got {top_p}"
            )));
        }
        if top_k < 0 {
            return Err(CoreError::Sampling(format!(
                "top-k must be >= 0, got {top_k}"
            )));
        }
        Ok(Self {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k: top_k as usize,
            seed,
        })
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

/// The sampling distribution as (token, probability) pairs with non-zero mass, in
/// descending probability order.
pub fn sampling_probs(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
    let t = p.temperature;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    if p.top_k > 0 && p.top_k < idx.len() {
        idx.truncate(p.top_k);
    }
    let max = logits[idx[0] as usize] / t;
    let mut probs: Vec<f32> = idx
        .iter()
        .map(|&i| (logits[i as usize] / t - max).exp())
        .collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= sum);
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

    /// The target's own next token given these logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let dist = sampling_probs(logits, &self.params);
        let u: f32 = self.rng.random();
        let mut acc = 0.0;
        for &(tok, q) in &dist {
            acc += q;
            if u < acc {
                return tok;
            }
        }
        dist.last().map(|d| d.0).unwrap_or(0)
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
