//! Reference values as the scripts under `tests/reference/` wrote them, and the error metrics
//! they are compared with.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};

/// A safetensors file of reference tensors, on the CPU.
pub fn load_ref(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON file.
pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

/// A JSON array of token ids.
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
