//! Softmax over the last dimension, the one op the target and the drafter run in training and
//! decoding: candle-nn's fused kernel forward (one launch) and a closed-form backward
//! ([`crate::ops::with_grad`]).
//!
//! candle-nn's fused softmax has no backward. The softmax the drafter composed before
//! (max, subtract, exp, sum, divide) costs five launches forward and about twenty full-size
//! passes backward over the attention scores — the largest tensors of a training step —
//! including the gradient of the max, which is exactly zero (softmax is shift-invariant).
//! Here the backward is `dx = y ⊙ (g − Σ_last g ⊙ y)`: two full-size passes and a reduction.
//!
//! Example: x = [0, ln 3] → y = [0.25, 0.75]; for g = [1, 0]: Σ g ⊙ y = 0.25, so
//! dx = [0.25 · 0.75, 0.75 · (0 − 0.25)] = [0.1875, −0.1875].

use candle_core::{Result, Tensor, D};

use crate::ops::with_grad::with_grad;

/// Softmax over the last dimension, differentiable (see the module doc).
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let y = candle_nn::ops::softmax_last_dim(&x.detach())?;
    with_grad(&x, y, "softmax", |y, g| {
        let s = (g * y)?.sum_keepdim(D::Minus1)?;
        y * g.broadcast_sub(&s)?
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// The composed softmax this op replaces: the reference for values and gradients.
    fn composed(x: &Tensor) -> Result<Tensor> {
        let max = x.max_keepdim(D::Minus1)?;
        let e = x.broadcast_sub(&max)?.exp()?;
        let s = e.sum_keepdim(D::Minus1)?;
        e.broadcast_div(&s)
    }

    #[test]
    fn the_docs_example() {
        let x = Var::new(&[0f64, 3f64.ln()], &Device::Cpu).unwrap();
        let y = softmax_last(x.as_tensor()).unwrap();
        let v = y.to_vec1::<f64>().unwrap();
        assert!((v[0] - 0.25).abs() < 1e-12 && (v[1] - 0.75).abs() < 1e-12);
        let g = Tensor::new(&[1f64, 0.0], &Device::Cpu).unwrap();
        let grads = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = grads.get(x.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        assert!((dx[0] - 0.1875).abs() < 1e-12 && (dx[1] + 0.1875).abs() < 1e-12);
    }

    #[test]
    fn values_and_gradients_equal_the_composed_softmax() {
        for dtype in [DType::F64, DType::F32] {
            // scores with a masked (−∞) key in some rows, as attention has
            let n = 3 * 5 * 7;
            let mut v: Vec<f64> = (0..n)
                .map(|i| ((i * 37 % 101) as f64 / 101.0 - 0.5) * 6.0)
                .collect();
            for r in 0..(n / 7) {
                if r % 3 == 0 {
                    v[r * 7 + 6] = f64::NEG_INFINITY;
                }
            }
            let x0 = Tensor::from_vec(v, (3, 5, 7), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            // an upstream gradient that is not constant along the softmax axis
            let w = Tensor::arange(0f64, n as f64, &Device::Cpu)
                .unwrap()
                .reshape((3, 5, 7))
                .unwrap()
                .sin()
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let run = |f: fn(&Tensor) -> Result<Tensor>| {
                let x = Var::from_tensor(&x0).unwrap();
                let y = f(x.as_tensor()).unwrap();
                let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let flat = |t: &Tensor| crate::ops::compare::values_f64(t).unwrap();
                (flat(&y), flat(g.get(x.as_tensor()).unwrap()))
            };
            let (y_new, dx_new) = run(softmax_last);
            let (y_ref, dx_ref) = run(composed);
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
            for (a, b) in y_new.iter().zip(&y_ref).chain(dx_new.iter().zip(&dx_ref)) {
                assert!((a - b).abs() <= tol, "{dtype:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn no_graph_without_variables() {
        let x = Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu).unwrap();
        let y = softmax_last(&x).unwrap();
        assert!(!y.track_op());
        let s: f32 = y.sum_all().unwrap().to_scalar().unwrap();
        assert!((s - 1.0).abs() < 1e-6);
    }
}
