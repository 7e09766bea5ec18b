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

/// The gradient `analytic` of `loss` at element `flat` of `var` against a central finite
/// difference (step 1e-6, f64): relative error below 1e-5, and not a zero gradient (which would
/// test nothing). `var` is restored afterwards.
pub fn assert_finite_difference(
    var: &candle_core::Var,
    flat: usize,
    analytic: f64,
    loss: &dyn Fn() -> f64,
    name: &str,
) {
    let orig = var
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let eps = 1e-6;
    let set = |delta: f64| {
        let mut v = orig.clone();
        v[flat] += delta;
        var.set(&Tensor::from_vec(v, var.shape(), var.device()).unwrap())
            .unwrap();
    };
    set(eps);
    let up = loss();
    set(-eps);
    let down = loss();
    set(0.0);
    let numeric = (up - down) / (2.0 * eps);
    let err = (analytic - numeric).abs() / numeric.abs().max(analytic.abs()).max(1e-8);
    assert!(
        err < 1e-5,
        "{name}[{flat}]: autograd {analytic:e} vs finite difference {numeric:e} (rel err {err:e})"
    );
    assert!(
        analytic.abs() > 1e-9,
        "{name}[{flat}]: a zero gradient tests nothing"
    );
}
