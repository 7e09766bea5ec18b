//! DFlash2's grouped dynamic causal convolution (z-lab `dflash==0.1.0`,
//! `GroupedDynamicCausalConv`): two depthwise convolutions around one sublayer (attention or
//! MLP) of a drafter layer, inside its residual branch.
//!
//! For the normed sublayer input `n` (`[rows, H]`), one projection gives every row its dynamic
//! taps: `D = kernel_projection(n)` viewed as `[rows, 2, K, G]` (G = H / group; output column
//! `s·K·G + o·G + g`). With `conv(x, s)[t, h] = Σ_{o<K} (base[s, o, h] + D[t, s, o, h / group]) ·
//! x[t − o, h]`, the sublayer runs on `conv(n, 0)` and its output `z` becomes `conv(z, 1)`.
//! Taps reach back inside the row's own block only (`x[t − o] = 0` before the block's first
//! row): the anchor row sees itself, the next row the anchor and itself, and so on. The
//! context features never pass through a conv, and nothing carries between blocks, so the one
//! drafter forward runs it the same way for one inference block and for many training blocks.
//! Example: K = 2, a block of rows (a, m1, m2) → `conv(x)[m1] = (b0 + D[m1, 0]) · x[m1] + (b1 +
//! D[m1, 1]) · x[a]`, `conv(x)[a] = (b0 + D[a, 0]) · x[a]`.
//!
//! # Shapes
//! - `base_kernel`: `[2, K, H]`; `kernel_projection.weight`: `[2·K·G, H]`;
//! - rows: `[1, blocks · block, H]`, blocks side by side.

use anyhow::{bail, Result};
use candle_core::{Module, Tensor};

use crate::io::weights::TensorStore;
use crate::layers::linear::Linear;
use crate::layers::mlp::load_linear;

#[derive(Debug, Clone)]
pub struct DynamicConv {
    base_kernel: Tensor,
    kernel_projection: Linear,
    kernel: usize,
    group: usize,
}

/// The dynamic taps of one [`DynamicConv::prepare`]: the pre-sublayer conv's (used there, kept
/// for a written backward) and the post-sublayer conv's, kept for [`DynamicConv::finish`]; each
/// `[blocks, block, K, G]`.
pub struct Taps {
    pub pre: Tensor,
    pub post: Tensor,
}

impl DynamicConv {
    pub fn load(
        store: &TensorStore,
        prefix: &str,
        hidden: usize,
        kernel: usize,
        group: usize,
    ) -> Result<Self> {
        if !hidden.is_multiple_of(group) {
            bail!("{prefix}: conv group {group} does not divide hidden {hidden}");
        }
        let g = hidden / group;
        Ok(Self {
            base_kernel: store.get(&format!("{prefix}.base_kernel"), &[2, kernel, hidden])?,
            kernel_projection: load_linear(
                store,
                &format!("{prefix}.kernel_projection"),
                2 * kernel * g,
                hidden,
                false,
            )?,
            kernel,
            group,
        })
    }

    /// The pre-sublayer conv of the normed input `n` `[1, rows, H]` (rows in blocks of
    /// `block`), and the taps (the post-sublayer conv's for [`DynamicConv::finish`]).
    pub fn prepare(&self, n: &Tensor, block: usize) -> Result<(Tensor, Taps)> {
        let (_, rows, h) = n.dims3()?;
        if block == 0 || !rows.is_multiple_of(block) {
            bail!("dynamic conv: {rows} rows are not whole blocks of {block}");
        }
        let g = h / self.group;
        let taps =
            self.kernel_projection
                .forward(n)?
                .reshape((rows / block, block, 2, self.kernel, g))?;
        let pre = taps.narrow(2, 0, 1)?.squeeze(2)?;
        let post = taps.narrow(2, 1, 1)?.squeeze(2)?;
        Ok((self.convolve(n, &pre, 0)?, Taps { pre, post }))
    }

    /// The post-sublayer conv of the sublayer's output `z` `[1, rows, H]`.
    pub fn finish(&self, z: &Tensor, taps: &Taps) -> Result<Tensor> {
        self.convolve(z, &taps.post, 1)
    }

    /// The conv on the same weights without their graph (a taped training forward).
    pub fn detached(&self) -> DynamicConv {
        DynamicConv {
            base_kernel: self.base_kernel.detach(),
            kernel_projection: self.kernel_projection.detached(),
            ..self.clone()
        }
    }

    /// Tap `o` of `conv(·, s)` over `x3` `[blocks, block, H]`: `x` shifted down `o` rows inside
    /// each block (zeros before its first row), the base tap `base[s, o]` `[H]` and the dynamic
    /// tap `D[·, o]` spread over its group's channels `[blocks, block, H]`.
    fn tap(
        &self,
        x3: &Tensor,
        d: &Tensor,
        base: &Tensor,
        s: usize,
        o: usize,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (blocks, block, h) = x3.dims3()?;
        let g = d.dim(3)?;
        let shifted = if o == 0 {
            x3.clone()
        } else {
            let zeros = Tensor::zeros((blocks, o, h), x3.dtype(), x3.device())?;
            Tensor::cat(&[&zeros, &x3.narrow(1, 0, block - o)?], 1)?
        };
        let base = base.narrow(0, s, 1)?.narrow(1, o, 1)?.reshape(h)?;
        let dyn_o = d
            .narrow(2, o, 1)?
            .reshape((blocks, block, g, 1))?
            .broadcast_as((blocks, block, g, self.group))?
            .reshape((blocks, block, h))?;
        Ok((shifted, base, dyn_o))
    }

    /// The base kernel `[2, K, H]` and the taps' projection (the keys of their gradients).
    pub fn weights(&self) -> (&Tensor, &Linear) {
        (&self.base_kernel, &self.kernel_projection)
    }

    /// The backward of `conv(x, s)` with taps `d` for the upstream `g` (`[1, rows, H]`), on
    /// values without a graph: `(dx, d base[s] [K, H], dd [blocks, block, K, G])`. With
    /// `c_o = base[s, o] + D[·, o]` and `x_o` = x shifted down o rows inside each block:
    /// `dx[t] = Σ_o c_o[t + o] · g[t + o]` (rows past the block's end add nothing),
    /// `d base[s, o] = Σ_t x_o[t] · g[t]`, `dD[t, o, gi] = Σ_{h ∈ group gi} x_o[t, h] · g[t, h]`.
    /// Example: K = 2, one block (a, m): dx[a] = c_0[a] g[a] + c_1[m] g[m], dx[m] = c_0[m] g[m].
    pub fn convolve_grads(
        &self,
        x: &Tensor,
        d: &Tensor,
        s: usize,
        g: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (_, rows, h) = x.dims3()?;
        let (blocks, block, k, gn) = d.dims4()?;
        let (x3, g3) = (
            x.detach().reshape((blocks, block, h))?,
            g.detach().reshape((blocks, block, h))?,
        );
        let (d, base_kernel) = (d.detach(), self.base_kernel.detach());
        let mut dx = g3.zeros_like()?;
        let mut d_base = Vec::with_capacity(k);
        let mut dd = Vec::with_capacity(k);
        for o in 0..self.kernel {
            if o >= block {
                d_base.push(Tensor::zeros(h, x.dtype(), x.device())?);
                dd.push(Tensor::zeros(
                    (blocks, block, 1, gn),
                    x.dtype(),
                    x.device(),
                )?);
                continue;
            }
            let (shifted, base, dyn_o) = self.tap(&x3, &d, &base_kernel, s, o)?;
            let xg = (&shifted * &g3)?;
            d_base.push(xg.reshape((blocks * block, h))?.sum(0)?);
            dd.push(
                xg.reshape((blocks, block, gn, self.group))?
                    .sum(3)?
                    .reshape((blocks, block, 1, gn))?,
            );
            // c_o · g, moved up o rows: row t of dx takes row t + o of the block
            let cg = (g3.broadcast_mul(&base)? + (dyn_o * &g3)?)?;
            let up = if o == 0 {
                cg
            } else {
                let zeros = Tensor::zeros((blocks, o, h), x.dtype(), x.device())?;
                Tensor::cat(&[&cg.narrow(1, o, block - o)?, &zeros], 1)?
            };
            dx = (dx + up)?;
        }
        Ok((
            dx.reshape((1, rows, h))?,
            Tensor::stack(&d_base, 0)?,
            Tensor::cat(&dd, 2)?,
        ))
    }

    /// `conv(x, s)` with dynamic taps `d` `[blocks, block, K, G]`.
    fn convolve(&self, x: &Tensor, d: &Tensor, s: usize) -> Result<Tensor> {
        let (_, rows, h) = x.dims3()?;
        let (blocks, block, _, _) = d.dims4()?;
        let x3 = x.reshape((blocks, block, h))?;
        let mut y: Option<Tensor> = None;
        for o in 0..self.kernel.min(block) {
            let (shifted, base, dyn_o) = self.tap(&x3, d, &self.base_kernel, s, o)?;
            // z-lab's order: the base term, then the dynamic term, each added on its own
            let term = (shifted.broadcast_mul(&base)? + (dyn_o * &shifted)?)?;
            y = Some(match y {
                Some(acc) => (acc + term)?,
                None => term,
            });
        }
        Ok(y.expect("kernel >= 1").reshape((1, rows, h))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use std::collections::HashMap;

    /// The conv written out element by element (the formula in the module doc) against the
    /// tensor implementation, two blocks of three rows, K = 2, groups of 2.
    #[test]
    fn conv_is_the_formula_written_out() {
        let (h, k, gs, block, blocks) = (4usize, 2usize, 2usize, 3usize, 2usize);
        let g = h / gs;
        let dev = Device::Cpu;
        let val = |n: usize, f: f32| -> Vec<f32> {
            (0..n).map(|i| (i as f32 * 0.37 + f).sin()).collect()
        };
        let base = val(2 * k * h, 0.1);
        let proj = val(2 * k * g * h, 0.7);
        let x = val(blocks * block * h, 1.3);
        let mut w = HashMap::new();
        w.insert(
            "c.base_kernel".to_string(),
            Tensor::from_vec(base.clone(), (2, k, h), &dev).unwrap(),
        );
        w.insert(
            "c.kernel_projection.weight".to_string(),
            Tensor::from_vec(proj.clone(), (2 * k * g, h), &dev).unwrap(),
        );
        let store = TensorStore::new(w, DType::F32, dev.clone());
        let conv = DynamicConv::load(&store, "c", h, k, gs).unwrap();
        let xt = Tensor::from_vec(x.clone(), (1, blocks * block, h), &dev).unwrap();
        let (pre, taps) = conv.prepare(&xt, block).unwrap();
        let out = conv.finish(&xt, &taps).unwrap();
        // D[t, c] = Σ_j proj[c, j] x[t, j]
        let dyn_ = |t: usize, s: usize, o: usize, gi: usize| -> f32 {
            let c = s * k * g + o * g + gi;
            (0..h).map(|j| proj[c * h + j] * x[t * h + j]).sum()
        };
        for (s, got) in [(0usize, &pre), (1, &out)] {
            let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for t in 0..blocks * block {
                for c in 0..h {
                    let mut want = 0.0f32;
                    for o in 0..k {
                        if t % block >= o {
                            let coef = base[s * k * h + o * h + c] + dyn_(t, s, o, c / gs);
                            want += coef * x[(t - o) * h + c];
                        }
                    }
                    let e = (got[t * h + c] - want).abs();
                    assert!(
                        e < 1e-5,
                        "s {s} row {t} channel {c}: {} vs {want}",
                        got[t * h + c]
                    );
                }
            }
        }
    }
}
