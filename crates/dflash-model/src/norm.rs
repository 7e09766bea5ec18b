//! RMSNorm as transformers computes it: in f32, `w * (x * rsqrt(mean(x²) + eps))`, cast back.
//! Built from differentiable ops (candle-nn's fused `rms_norm` has no backward), so the
//! drafter trains through the same code it decodes with. The frozen target may take the fused
//! kernel instead ([`RmsNorm::forward_frozen`]: one launch instead of nine on a GPU).

use candle_core::{DType, Result, Tensor, D};

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
    /// Zero-centred weights (qwen3_5): `norm(x) · (1 + w)`, multiplied in f32 before the cast.
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
    pub fn zero_centred(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            eps,
            one_plus: true,
        }
    }

    /// The same normalisation through candle-nn's fused kernel, which has no backward: for
    /// weights nothing trains (the target). It multiplies by the weight before the final cast
    /// (bf16: one rounding fewer than transformers; f32: the same up to summation order).
    /// Zero-centred weights and f64 take [`RmsNorm::forward`].
    pub fn forward_frozen(&self, x: &Tensor) -> Result<Tensor> {
        if self.one_plus || !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return self.forward(x);
        }
        candle_nn::ops::rms_norm(
            &x.contiguous()?,
            &self.weight.to_dtype(x.dtype())?,
            self.eps as f32,
        )
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
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
