//! Rotary position embedding, transformers' half-split (NeoX) layout, at arbitrary
//! per-row positions (trees put siblings at the same position).
//!
//! `inv_freq[i] = theta^(-2i/d)`; a row at position `p` rotates pair `(x[i], x[i + d/2])` by
//! angle `p * inv_freq[i]`. llama-architecture GGUFs store Q/K permuted for the interleaved
//! layout; [`crate::io::gguf`] undoes that at load, so this one layout serves every family.

use candle_core::{DType, Device, Result, Tensor, D};

use crate::ops::with_grad::with_grad;

/// The most values a CPU rotation runs on one thread ([`RopeTables::apply`]): a 64-row verify
/// of 12 heads of 64 is 49,152; a prefill is larger and keeps candle's parallel kernel.
const SERIAL_MAX: usize = 1 << 16;

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
    /// Through candle-nn's fused kernel (one launch) when every feature rotates and the dtype
    /// has one, with a closed-form backward where `x` carries a graph (the drafter in
    /// training): RoPE is a rotation, so `dx` is `g` rotated back, `rope(g, cos, −sin)`.
    /// Example: d = 2, angle 90° (cos 0, sin 1): x = [1, 0] → [0, 1]; g = [0, 1] → dx = [1, 0].
    /// Partial RoPE on a GPU: one kernel ([`crate::ops::rope_partial`]). Otherwise (partial
    /// RoPE elsewhere, f64) [`RopeTables::apply_composed`].
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        if 2 * self.cos.dim(D::Minus1)? != x.dim(D::Minus1)? {
            if let Some(y) = crate::ops::rope_partial::rope_partial(x, self)? {
                return Ok(y);
            }
            return self.apply_composed(x);
        }
        if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return self.apply_composed(x);
        }
        let x = x.contiguous()?;
        if x.device().is_cpu()
            && x.dtype() == DType::F32
            && !x.track_op()
            && x.elem_count() <= SERIAL_MAX
        {
            return self.apply_serial(&x);
        }
        let y = candle_nn::rotary_emb::rope(&x.detach(), &self.cos, &self.sin)?;
        let (cos, sin) = (self.cos.clone(), self.sin.clone());
        with_grad(&x, y, "rope", move |_y, g| {
            candle_nn::rotary_emb::rope(&g.contiguous()?, &cos, &sin.neg()?)
        })
    }

    /// The tables that rotate back: [`RopeTables::apply`] of them is `apply`'s backward (`−sin`;
    /// features past a partial RoPE's rotated ones pass through, as forward).
    /// Example: d = 2, angle 90°: g = [0, 1] → [1, 0].
    pub fn inverse(&self) -> Result<RopeTables> {
        Ok(RopeTables {
            cos: self.cos.clone(),
            sin: self.sin.neg()?,
        })
    }

    /// candle-nn's CPU kernel on one thread, the same products and sums in the same order (the
    /// same bits): for the few rows of a verify or a draft block, where candle's kernel hands
    /// each head to rayon and waking its threads costs more than the rotation itself. `x` f32,
    /// contiguous, on the CPU.
    fn apply_serial(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, t, d) = x.dims4()?;
        let half = d / 2;
        let batched = self.cos.rank() == 3;
        let want = if batched { b * t * half } else { t * half };
        let table = |c: &Tensor| -> Result<Vec<f32>> {
            let v = c.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            if v.len() != want {
                candle_core::bail!(
                    "rope: a table of {} values for {b}×{t} rows of {half}",
                    v.len()
                );
            }
            Ok(v)
        };
        let (cos, sin) = (table(&self.cos)?, table(&self.sin)?);
        let src = x.flatten_all()?.to_vec1::<f32>()?;
        let mut dst = vec![0f32; src.len()];
        for bh in 0..b * h {
            let base = if batched { (bh / h) * t * half } else { 0 };
            for i_t in 0..t {
                let off = (bh * t + i_t) * d;
                for i_d in 0..half {
                    let (i1, i2) = (off + i_d, off + i_d + half);
                    let cs = base + i_t * half + i_d;
                    dst[i1] = src[i1] * cos[cs] - src[i2] * sin[cs];
                    dst[i2] = src[i1] * sin[cs] + src[i2] * cos[cs];
                }
            }
        }
        Tensor::from_vec(dst, (b, h, t, d), x.device())
    }

    /// [`RopeTables::apply`] from differentiable elementwise ops (any dtype, partial RoPE).
    pub fn apply_composed(&self, x: &Tensor) -> Result<Tensor> {
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

    /// The tables of rows `start .. start + len` (of each sequence, for batched tables
    /// `[b, n, half]`; copied, since the rope kernels read contiguous tables).
    pub fn narrow(&self, start: usize, len: usize) -> Result<RopeTables> {
        let d = self.cos.rank() - 2;
        let rows = |t: &Tensor| match d {
            0 => t.narrow(0, start, len),
            _ => t.narrow(d, start, len)?.contiguous(),
        };
        Ok(RopeTables {
            cos: rows(&self.cos)?,
            sin: rows(&self.sin)?,
        })
    }

    /// Tables of `b · n` rows (sequence-major) as batched tables `[b, n, half]`: each
    /// sequence's rows at their own positions.
    pub fn reshape_rows(&self, b: usize, n: usize) -> Result<RopeTables> {
        let half = self.cos.dim(D::Minus1)?;
        Ok(RopeTables {
            cos: self.cos.reshape((b, n, half))?,
            sin: self.sin.reshape((b, n, half))?,
        })
    }
}

#[cfg(test)]
mod grad_tests {
    use super::*;
    use candle_core::Var;

    /// The one-thread rotation gives candle-nn's kernel's bits, for 1, 5 and 16 rows at tree
    /// positions, with per-sequence (batched) tables too.
    #[test]
    fn serial_rotation_equals_candles_kernel() {
        let r = Rope::new(64, 10_000.0);
        for (b, t) in [(1, 1), (1, 5), (1, 16), (2, 5)] {
            let pos: Vec<usize> = (0..b * t).map(|i| 100 + (i * 7) % 13).collect();
            let mut tab = r.tables(&pos, DType::F32, &Device::Cpu).unwrap();
            if b > 1 {
                tab.cos = tab.cos.reshape((b, t, 32)).unwrap();
                tab.sin = tab.sin.reshape((b, t, 32)).unwrap();
            }
            let x = Tensor::randn(0f32, 1.0, (b, 3, t, 64), &Device::Cpu).unwrap();
            let ours = tab.apply(&x).unwrap();
            let theirs = candle_nn::rotary_emb::rope(&x, &tab.cos, &tab.sin).unwrap();
            let bits = |t: &Tensor| crate::ops::compare::bits_f32(t).unwrap();
            assert_eq!(bits(&ours), bits(&theirs), "b {b}, t {t}");
        }
    }

    fn flat(t: &Tensor) -> Vec<f64> {
        crate::ops::compare::values_f64(t).unwrap()
    }

    #[test]
    fn the_docs_example() {
        let t = RopeTables {
            cos: Tensor::new(&[[0f32]], &Device::Cpu).unwrap(),
            sin: Tensor::new(&[[1f32]], &Device::Cpu).unwrap(),
        };
        let x = Var::new(&[[[[1f32, 0.0]]]], &Device::Cpu).unwrap();
        let y = t.apply(x.as_tensor()).unwrap();
        assert_eq!(flat(&y), vec![0.0, 1.0]);
        let g = Tensor::new(&[[[[0f32, 1.0]]]], &Device::Cpu).unwrap();
        let grads = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(flat(grads.get(x.as_tensor()).unwrap()), vec![1.0, 0.0]);
    }

    #[test]
    fn fused_values_and_gradients_equal_the_composed_rotation() {
        let dev = Device::Cpu;
        let t = Rope::new(8, 10000.0)
            .tables(&[0, 3, 3, 7, 40], DType::F32, &dev)
            .unwrap();
        let x0 = Tensor::arange(0f32, 2.0 * 3.0 * 5.0 * 8.0, &dev)
            .unwrap()
            .reshape((2, 3, 5, 8))
            .unwrap()
            .sin()
            .unwrap();
        let up = x0.cos().unwrap();
        let run = |fused: bool| {
            let x = Var::from_tensor(&x0).unwrap();
            let y = if fused {
                t.apply(x.as_tensor())
            } else {
                t.apply_composed(x.as_tensor())
            }
            .unwrap();
            let g = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
            (flat(&y), flat(g.get(x.as_tensor()).unwrap()))
        };
        let (a, b) = (run(true), run(false));
        for (u, v) in a.0.iter().zip(&b.0).chain(a.1.iter().zip(&b.1)) {
            assert!((u - v).abs() < 1e-6, "{u} vs {v}");
        }
    }
}
