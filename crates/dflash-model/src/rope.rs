//! Rotary position embedding, transformers' half-split (NeoX) layout, at arbitrary
//! per-row positions (trees put siblings at the same position).
//!
//! `inv_freq[i] = theta^(-2i/d)`; a row at position `p` rotates pair `(x[i], x[i + d/2])` by
//! angle `p * inv_freq[i]`. llama-architecture GGUFs store Q/K permuted for the interleaved
//! layout; [`crate::gguf`] undoes that at load, so this one layout serves every family.

use candle_core::{DType, Device, Result, Tensor, D};

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

/// cos/sin tables for a list of positions: each `[n, head_dim / 2]`, or `[b, n, head_dim / 2]`
/// for a batch of `b` sequences of `n` rows each.
#[derive(Debug, Clone)]
pub struct RopeTables {
    pub cos: Tensor,
    pub sin: Tensor,
}

impl Rope {
    /// RoPE over the first `rotary_dim` features of each head (`rotary_dim` = head_dim unless
    /// partial).
    pub fn new(rotary_dim: usize, theta: f64) -> Self {
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64)) as f32)
            .collect();
        Self { inv_freq }
    }

    pub fn tables(&self, positions: &[usize], dtype: DType, device: &Device) -> Result<RopeTables> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = (p as f32) * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let n = positions.len();
        Ok(RopeTables {
            cos: Tensor::from_vec(cos, (n, half), device)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, (n, half), device)?.to_dtype(dtype)?,
        })
    }
}

impl RopeTables {
    /// Rotate `x` of shape `[b, heads, n, head_dim]` (row j at the table's position j). With
    /// partial RoPE (tables narrower than head_dim / 2) only the first `2 · table width`
    /// features rotate and the rest pass through, as transformers' qwen3_5 does.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.dim(D::Minus1)?;
        let half = self.cos.dim(D::Minus1)?;
        let rot = 2 * half;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        // batched tables [b, n, half] broadcast over the heads of [b, heads, n, half]
        let (cos, sin) = if self.cos.rank() == 3 {
            (&self.cos.unsqueeze(1)?, &self.sin.unsqueeze(1)?)
        } else {
            (&self.cos, &self.sin)
        };
        let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
        let b = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
        if rot == d {
            Tensor::cat(&[a, b], D::Minus1)
        } else {
            Tensor::cat(&[a, b, x.narrow(D::Minus1, rot, d - rot)?], D::Minus1)
        }
    }

    /// [`RopeTables::apply`] through candle-nn's fused kernel (no backward: the frozen
    /// target), when every feature rotates; partial RoPE takes [`RopeTables::apply`].
    pub fn apply_frozen(&self, x: &Tensor) -> Result<Tensor> {
        if 2 * self.cos.dim(D::Minus1)? != x.dim(D::Minus1)? {
            return self.apply(x);
        }
        candle_nn::rotary_emb::rope(&x.contiguous()?, &self.cos, &self.sin)
    }

    /// The tables of rows `start .. start + len`.
    pub fn narrow(&self, start: usize, len: usize) -> Result<RopeTables> {
        Ok(RopeTables {
            cos: self.cos.narrow(0, start, len)?,
            sin: self.sin.narrow(0, start, len)?,
        })
    }
}
