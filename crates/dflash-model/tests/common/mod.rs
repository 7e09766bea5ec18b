#![allow(dead_code)]
//! Shared helpers for the parity tests: fixture paths, reference tensors, error metrics.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn load_ref(path: &std::path::Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// max |a - b| / max |b| (`dflash_model::ops::compare`)
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    dflash_model::ops::compare::rel_err(a, b).unwrap()
}
/// max |a - b| (`dflash_model::ops::compare`)
pub fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    dflash_model::ops::compare::max_abs(a, b).unwrap()
}

/// A cached asset, or a panic that says how to fetch it.
pub fn asset(rel: &str, fetch: &str) -> PathBuf {
    let home = dflash_model::io::loader::dflash_home();
    let p = home.join(rel);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-assets.sh {fetch}",
        p.display()
    );
    p
}

/// Greedy continuation with the KV cache, the same way the reference does it.
pub fn greedy(t: &dflash_model::Target, prompt: &[u32], steps: usize) -> Vec<u32> {
    use dflash_core::visibility::causal;
    let mut cache = t.new_cache();
    let mut new = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..steps {
        let start = cache.len();
        let pos: Vec<usize> = (start..start + new.len()).collect();
        let o = t
            .forward(
                &new,
                &pos,
                &causal(start, new.len()),
                &mut cache,
                &[],
                &dflash_model::Rows::Last,
            )
            .unwrap();
        let l: Vec<f32> = o.logits.unwrap().squeeze(0).unwrap().to_vec1().unwrap();
        let next = dflash_core::sampling::argmax(&l);
        out.push(next);
        new = vec![next];
    }
    out
}
