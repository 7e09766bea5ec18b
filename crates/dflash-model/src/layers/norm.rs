//! RMSNorm: `w · (x · rsqrt(mean(x²) + eps))`, reduced in f32.
//!
//! [`RmsNorm::forward`] is the one op the target and the drafter run, in training and
//! decoding alike: candle-nn's fused kernel forward (one launch instead of nine on a GPU) and,
//! where the input carries a graph (the drafter in training), a closed-form backward
//! ([`crate::ops::with_grad`]): with `r = rsqrt(mean(x²) + eps)`, `n = x · r`, `u = g · w`:
//! `dw = Σ_rows g · n`, `dx = r · (u − n · mean(u · n))`.
//! Example: x = [3, 4], w = [1, 1], eps = 0: r = 1/√12.5, n = [0.849, 1.131]; for g = [1, 0]:
//! mean(u · n) = 0.424, dx = r · ([1, 0] − n · 0.424) = [0.181, −0.136], dw = [0.849, 0].
//! The fused kernel multiplies by the weight before the final cast (bf16: one rounding fewer
//! than transformers, which casts first); [`RmsNorm::forward_composed`] is transformers'
//! order, kept for zero-centred weights, f64 (gradient checks) and as the tests' reference.

use candle_core::{DType, Result, Tensor, D};

use crate::ops::with_grad::with_grad2;

/// The most values a CPU normalisation runs on one thread ([`RmsNorm::forward`]).
const SERIAL_MAX: usize = 1 << 16;

/// candle-nn's CPU RMSNorm on one thread, the same sums and divisions in the same order (the
/// same bits): candle hands more than 32 rows to rayon (a drafter block's q/k norms: 16 rows ×
/// heads), and waking its threads beside the panels' spinning helpers costs more than the
/// normalisation. `x` `[.., d]` f32, contiguous, on the CPU; `w` `[d]`.
fn rms_norm_serial(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let alpha = w.flatten_all()?.to_vec1::<f32>()?;
    if alpha.len() != d {
        candle_core::bail!("rms_norm: a weight of {} for rows of {d}", alpha.len());
    }
    let src = x.flatten_all()?.to_vec1::<f32>()?;
    let mut dst = vec![0f32; src.len()];
    for (s, o) in src.chunks(d.max(1)).zip(dst.chunks_mut(d.max(1))) {
        let sum2 = s.iter().map(|&v| v * v).sum::<f32>();
        let m = (sum2 / d as f32 + eps).sqrt();
        for ((o, s), a) in o.iter_mut().zip(s).zip(&alpha) {
            *o = *s / m * *a
        }
    }
    Tensor::from_vec(dst, x.shape(), x.device())
}

/// Reductions run in f32, or f64 for f64 models (gradient checks).
pub fn compute_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
    /// Zero-centred weights (qwen3_5): `norm(x) · (1 + w)`, multiplied in f32 before the cast;
    /// the weight then kept in f32 (f64 stays f64), the kernels' operand as it is.
    pub one_plus: bool,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            eps,
            one_plus: false,
        }
    }
    pub fn zero_centred(weight: Tensor, eps: f64) -> Result<Self> {
        let weight = match weight.dtype() {
            DType::F64 => weight,
            _ => weight.to_dtype(DType::F32)?,
        };
        Ok(Self {
            weight,
            eps,
            one_plus: true,
        })
    }

    /// The normalisation (see the module doc): fused for f32/bf16/f16 with plain weights, with
    /// a backward when `x` or the weight carries a graph; zero-centred weights one kernel on a
    /// GPU ([`crate::ops::add_norm::zero_centred_norm`]); otherwise
    /// [`RmsNorm::forward_composed`].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = crate::ops::add_norm::zero_centred_norm(x, self)? {
            return Ok(y);
        }
        if self.one_plus || !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return self.forward_composed(x);
        }
        let x = x.contiguous()?;
        let w = self.weight.to_dtype(x.dtype())?;
        if x.device().is_cpu()
            && x.dtype() == DType::F32
            && !x.track_op()
            && !w.track_op()
            && x.elem_count() <= SERIAL_MAX
        {
            return rms_norm_serial(&x, &w, self.eps as f32);
        }
        let y = candle_nn::ops::rms_norm(&x.detach(), &w.detach(), self.eps as f32)?;
        let eps = self.eps;
        with_grad2(&x, &w, y, "rms_norm", move |x, w, _y, g| {
            plain_grad(x, w, g, eps)
        })
    }

    /// `(dx, dw)` of [`RmsNorm::forward`] at `x` for the upstream gradient `g` (the module
    /// doc's closed form; the drafter's taped backward): `dx` in x's dtype, `dw` in the
    /// weight's. Zero-centred weights are refused (no drafter has them).
    pub fn grads(&self, x: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.one_plus {
            candle_core::bail!("RmsNorm::grads: zero-centred weights have no written backward");
        }
        let w = self.weight.detach().to_dtype(x.dtype())?;
        let (dx, dw) = plain_grad(&x.detach().contiguous()?, &w, &g.detach(), self.eps)?;
        Ok((dx, dw.to_dtype(self.weight.dtype())?))
    }

    /// transformers' order of operations from differentiable ops (see the module doc).
    pub fn forward_composed(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let cd = compute_dtype(dtype);
        let xf = x.to_dtype(cd)?;
        let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = xf.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        if self.one_plus {
            normed
                .broadcast_mul(&(self.weight.to_dtype(cd)? + 1.0)?)?
                .to_dtype(dtype)
        } else {
            normed
                .to_dtype(dtype)?
                .broadcast_mul(&self.weight.to_dtype(dtype)?)
        }
    }
}

/// The backward of a plain-weight norm: the fused kernels on a GPU
/// ([`crate::ops::rms_norm_grad`]), the composed form elsewhere (CPU training).
fn plain_grad(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    if x.device().is_cuda() && crate::ops::rms_norm_grad::serves(x.dtype()) {
        crate::ops::rms_norm_grad::rms_norm_grad(x, w, &g.to_dtype(x.dtype())?, eps)
    } else {
        composed_grad(x, w, g, eps)
    }
}

/// The closed-form gradients `(dx, dw)` of the RMSNorm (module doc), reduced in f32.
/// The RMSNorm backward composed of candle ops in f32 (the CPU's, and the reference of the
/// fused kernels in [`crate::ops::rms_norm_grad`]).
pub(crate) fn composed_grad(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let cd = compute_dtype(x.dtype());
    let (xf, gf, wf) = (x.to_dtype(cd)?, grad.to_dtype(cd)?, w.to_dtype(cd)?);
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let n = xf.broadcast_mul(&r)?;
    let h = x.dim(D::Minus1)?;
    let dw = (&gf * &n)?
        .reshape(((), h))?
        .sum(0)?
        .reshape(w.shape())?
        .to_dtype(w.dtype())?;
    let u = gf.broadcast_mul(&wf)?;
    let m = (&u * &n)?.mean_keepdim(D::Minus1)?;
    let dx = (u - n.broadcast_mul(&m)?)?
        .broadcast_mul(&r)?
        .to_dtype(x.dtype())?;
    Ok((dx, dw))
}

#[cfg(test)]
mod tests {
    /// The one-thread normalisation gives candle-nn's kernel's bits, below and above the 32 rows
    /// where candle goes parallel.
    #[test]
    fn serial_norm_equals_candles_kernel() {
        use candle_core::Device;
        for rows in [1usize, 5, 40, 144] {
            let x = Tensor::randn(0f32, 1.0, (rows, 64), &Device::Cpu).unwrap();
            let w = Tensor::randn(1f32, 0.1, 64, &Device::Cpu).unwrap();
            let ours = super::RmsNorm::new(w.clone(), 1e-6).forward(&x).unwrap();
            let theirs = candle_nn::ops::rms_norm(&x, &w, 1e-6).unwrap();
            let bits = |t: &Tensor| crate::ops::compare::bits_f32(t).unwrap();
            assert_eq!(bits(&ours), bits(&theirs), "{rows} rows");
        }
    }

    use super::*;
    use candle_core::{Device, Var};

    fn flat(t: &Tensor) -> Vec<f64> {
        crate::ops::compare::values_f64(t).unwrap()
    }

    #[test]
    fn the_docs_example() {
        let x = Var::new(&[[3f32, 4.0]], &Device::Cpu).unwrap();
        let w = Var::new(&[1f32, 1.0], &Device::Cpu).unwrap();
        let norm = RmsNorm::new(w.as_tensor().clone(), 0.0);
        let y = norm.forward(x.as_tensor()).unwrap();
        let g = Tensor::new(&[[1f32, 0.0]], &Device::Cpu).unwrap();
        let grads = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = flat(grads.get(x.as_tensor()).unwrap());
        let dw = flat(grads.get(w.as_tensor()).unwrap());
        let r = 1.0 / 12.5f64.sqrt();
        let n = [3.0 * r, 4.0 * r];
        let m = n[0] / 2.0;
        let want_dx = [r * (1.0 - n[0] * m), r * (0.0 - n[1] * m)];
        assert!((dx[0] - want_dx[0]).abs() < 1e-6 && (dx[1] - want_dx[1]).abs() < 1e-6);
        assert!((dx[0] - 0.181).abs() < 1e-3 && (dx[1] + 0.136).abs() < 1e-3);
        assert!((dw[0] - n[0]).abs() < 1e-6 && dw[1].abs() < 1e-9);
    }

    #[test]
    fn fused_values_and_gradients_equal_the_composed_norm() {
        // [2, 3, 8] inputs with a non-constant upstream gradient, weights away from 1
        let dev = Device::Cpu;
        let x0 = Tensor::arange(0f32, 48.0, &dev)
            .unwrap()
            .reshape((2, 3, 8))
            .unwrap()
            .sin()
            .unwrap();
        let w0 = (Tensor::arange(0f32, 8.0, &dev).unwrap().cos().unwrap() + 1.5).unwrap();
        let up = Tensor::arange(0f32, 48.0, &dev)
            .unwrap()
            .reshape((2, 3, 8))
            .unwrap()
            .cos()
            .unwrap();
        let run = |fused: bool| {
            let x = Var::from_tensor(&x0).unwrap();
            let w = Var::from_tensor(&w0).unwrap();
            let norm = RmsNorm::new(w.as_tensor().clone(), 1e-6);
            let y = if fused {
                norm.forward(x.as_tensor())
            } else {
                norm.forward_composed(x.as_tensor())
            }
            .unwrap();
            let g = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
            (
                flat(&y),
                flat(g.get(x.as_tensor()).unwrap()),
                flat(g.get(w.as_tensor()).unwrap()),
            )
        };
        let (a, b) = (run(true), run(false));
        for (u, v) in
            a.0.iter()
                .zip(&b.0)
                .chain(a.1.iter().zip(&b.1))
                .chain(a.2.iter().zip(&b.2))
        {
            assert!((u - v).abs() < 1e-5, "{u} vs {v}");
        }
    }
}
