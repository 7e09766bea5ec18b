//! The drafter's fingerprint of its target: the target identity hash and tap statistics on
//! fixed canary prompts, computed by the trainer with the same engine, device and dtype it
//! trained with. The doctor recomputes it: a different linear-attention kernel, dtype or
//! loading path that changes the hidden states shows up here.

use anyhow::Result;
use candle_core::{DType, D};
use dflash_model::io::loader::{identity_hash, LoadedTarget};
use dflash_model::Rows;
use serde::{Deserialize, Serialize};

pub const CANARY_PROMPTS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Question: what is 12 times 7? Answer:",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TapStats {
    pub tap: usize,
    pub mean: f64,
    pub std: f64,
    /// The first values of the last row of the first canary prompt.
    pub head: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub target_hash: String,
    pub dtype: String,
    pub device: String,
    pub canary_prompts: Vec<String>,
    pub taps: Vec<TapStats>,
}

pub fn fingerprint(lt: &LoadedTarget, taps: &[usize]) -> Result<Fingerprint> {
    let t = &lt.target;
    let mut per_tap: Vec<Vec<f32>> = vec![Vec::new(); taps.len()];
    let mut heads = vec![Vec::new(); taps.len()];
    for (pi, p) in CANARY_PROMPTS.iter().enumerate() {
        let ids = lt.tokenizer.encode(p, false)?;
        let mut cache = t.new_cache();
        let out = t.forward_causal(&ids, &mut cache, taps, &Rows::None)?;
        for (i, h) in out.taps.iter().enumerate() {
            let h = h.to_dtype(DType::F32)?;
            per_tap[i].extend(h.flatten_all()?.to_vec1::<f32>()?);
            if pi == 0 {
                heads[i] = h
                    .get(ids.len() - 1)?
                    .narrow(D::Minus1, 0, 8)?
                    .to_vec1::<f32>()?;
            }
        }
    }
    let stats = taps
        .iter()
        .zip(per_tap)
        .zip(heads)
        .map(|((&tap, v), head)| {
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
            TapStats {
                tap,
                mean,
                std: var.sqrt(),
                head,
            }
        })
        .collect();
    Ok(Fingerprint {
        target_hash: identity_hash(&lt.source)?,
        dtype: format!("{:?}", t.dtype).to_lowercase(),
        device: if t.device.is_cpu() {
            "cpu".into()
        } else {
            "cuda".into()
        },
        canary_prompts: CANARY_PROMPTS.iter().map(|s| s.to_string()).collect(),
        taps: stats,
    })
}
