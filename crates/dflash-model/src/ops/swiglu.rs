//! The MLP's gate, up and SwiGLU in training as one graph node: `a = silu(x · W_gᵀ) · (x · W_uᵀ)`
//! with the backward written out, `(dg, du)` from [`crate::ops::silu_mul::grads`], then
//! `dx = dg · W_g + du · W_u`, `dW_g = dgᵀ · x`, `dW_u = duᵀ · x`.
//!
//! As three nodes (two training linears and the SwiGLU) the autograd zero-fills a gradient
//! buffer for the gate's and the up's outputs and adds into it, and adds the two gradients of
//! `x` into a third: at the Qwen3-8B training shape (8,192 block rows, intermediate 12,288) two
//! buffers of 201 MB per layer (`dflash-rs bench train --graph-census`). Here `g` and `u` are
//! kept as the forward made them and their gradients never enter the graph.
//!
//! Used on a GPU when `x` and both weights carry a graph (the drafter in training); elsewhere
//! the MLP composes the three ops as before. The products are candle's, in the same order as
//! the composed form's; the CPU runs the same code (its test compares with candle's autograd).
//! Example: x `[1, 8192, 4096]`, W_g and W_u `[12288, 4096]` → a `[1, 8192, 12288]`; the
//! backward returns dx `[1, 8192, 4096]` and two `[12288, 4096]` weight gradients.

use candle_core::{DType, Result, Tensor};

use crate::ops::silu_mul;
use crate::ops::with_grad::with_grad3;

/// Whether the MLP takes the one-node form: a CUDA device, f32 or bf16 throughout, `x` and both
/// weights tracked; `DFLASH_SWIGLU_NODE=0` keeps the three nodes.
pub fn serves(x: &Tensor, wg: &Tensor, wu: &Tensor) -> bool {
    let off = crate::ops::switched_off!("DFLASH_SWIGLU_NODE");
    x.device().is_cuda()
        && !off
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && wg.dtype() == x.dtype()
        && wu.dtype() == x.dtype()
        && x.track_op()
        && wg.track_op()
        && wu.track_op()
}

/// `silu(x · W_gᵀ) · (x · W_uᵀ)` as one node (`x` `[..., k]`, weights `[inter, k]`) →
/// `[..., inter]`, on any device (the routing is [`serves`]).
pub fn gated(x: &Tensor, wg: &Tensor, wu: &Tensor) -> Result<Tensor> {
    let k = x.dim(candle_core::D::Minus1)?;
    let inter = wg.dim(0)?;
    if wg.dims() != [inter, k] || wu.dims() != [inter, k] {
        candle_core::bail!(
            "swiglu: x {:?} with gate {:?} and up {:?} weights",
            x.dims(),
            wg.dims(),
            wu.dims()
        );
    }
    let rows = x.elem_count() / k.max(1);
    let x_shape = x.shape().clone();
    let mut out_shape = x.dims().to_vec();
    if let Some(d) = out_shape.last_mut() {
        *d = inter;
    }
    let x2 = x.detach().reshape((rows, k))?;
    let (wgd, wud) = (wg.detach(), wu.detach());
    let g = x2.matmul(&wgd.t()?)?;
    let u = x2.matmul(&wud.t()?)?;
    let a = silu_mul::fused(&g, &u)?.reshape(out_shape)?;
    with_grad3(x, wg, wu, a, "swiglu", move |grad| {
        let da = grad.detach().reshape((rows, inter))?;
        let (dg, du) = silu_mul::grads(&g, &u, &da)?;
        let dx = (dg.matmul(&wgd)? + du.matmul(&wud)?)?.reshape(&x_shape)?;
        Ok((dx, dg.t()?.matmul(&x2)?, du.t()?.matmul(&x2)?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn fill(shape: &[usize], seed: u64, amp: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let x = ((i as u64 + 1) * 2654435761 + seed * 40503) % 10007;
                (x as f32 / 10007.0 * 2.0 - 1.0) * amp
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The node's value and its gradients for x, W_g and W_u equal candle's autograd through
    /// the composed form (two products, silu, a product) at f32, under a loss that weights
    /// every output differently.
    #[test]
    fn one_node_equals_the_composed_autograd() {
        let (x0, wg0, wu0) = (
            fill(&[1, 13, 24], 1, 1.0),
            fill(&[40, 24], 2, 0.3),
            fill(&[40, 24], 3, 0.3),
        );
        let up = fill(&[1, 13, 40], 4, 1.0);
        let run = |node: bool| {
            let (x, wg, wu) = (
                Var::from_tensor(&x0).unwrap(),
                Var::from_tensor(&wg0).unwrap(),
                Var::from_tensor(&wu0).unwrap(),
            );
            let a = if node {
                gated(x.as_tensor(), wg.as_tensor(), wu.as_tensor()).unwrap()
            } else {
                let g = x.as_tensor().broadcast_matmul(&wg.t().unwrap()).unwrap();
                let u = x.as_tensor().broadcast_matmul(&wu.t().unwrap()).unwrap();
                (g.silu().unwrap() * u).unwrap()
            };
            let gr = (&a * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let get = |v: &Var| gr.get(v.as_tensor()).unwrap().clone();
            (a, get(&x), get(&wg), get(&wu))
        };
        let (want, got) = (run(false), run(true));
        for (name, a, b) in [
            ("a", &want.0, &got.0),
            ("dx", &want.1, &got.1),
            ("dW_g", &want.2, &got.2),
            ("dW_u", &want.3, &got.3),
        ] {
            assert_eq!(a.dims(), b.dims(), "{name}");
            let e = crate::ops::compare::max_abs(a, b).unwrap();
            assert!(e < 1e-5, "{name}: max diff {e}");
        }
    }

    #[test]
    fn mismatched_weights_are_refused() {
        let x = fill(&[1, 3, 8], 1, 1.0);
        let err = gated(&x, &fill(&[5, 8], 2, 1.0), &fill(&[5, 7], 3, 1.0)).unwrap_err();
        assert!(err.to_string().contains("swiglu"), "{err}");
    }
}
