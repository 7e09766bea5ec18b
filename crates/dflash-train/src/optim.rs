//! AdamW with explicit, saveable state (f32 master weights and moments), global-norm gradient
//! clipping. Weight decay applies to matrices only (not to norm weights). The moments may be
//! sharded over data-parallel ranks ([`AdamW::shard`], [`crate::shard`]).

use anyhow::Result;
use candle_core::{DType, Tensor, Var};
use dflash_model::ops::adamw::{adamw_step_copy, AdamStep};

pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Optimizer steps taken.
    pub step: usize,
    /// Per parameter `[2, n]`: the first moments, then the second, updated in place
    /// ([`dflash_model::ops::adamw`]); `[2, 0]` for a parameter another rank owns.
    state: Vec<Tensor>,
    /// With optimizer-state sharding: each parameter's owner rank, and this rank
    /// ([`crate::shard`]). `None`: this rank owns every parameter.
    shards: Option<Shards>,
}

/// Which rank owns each parameter (keeps its moments and updates it), and this rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shards {
    pub owners: Vec<usize>,
    pub rank: usize,
}

impl AdamW {
    pub fn new(
        params: &[(String, Var)],
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    ) -> Result<Self> {
        Ok(Self {
            beta1,
            beta2,
            eps,
            weight_decay,
            step: 0,
            state: params
                .iter()
                .map(|(_, p)| Tensor::zeros((2, p.elem_count()), p.dtype(), p.device()))
                .collect::<candle_core::Result<_>>()?,
            shards: None,
        })
    }

    /// Keep the moments of the parameters this rank owns only (`shards.owners[i]` for
    /// `params[i]`, [`crate::shard::owners`]): the others' are dropped and [`Self::update`]
    /// leaves those parameters alone (their owners update them; [`crate::shard::sync_weights`]
    /// brings them here).
    pub fn shard(&mut self, shards: Shards) -> Result<()> {
        if shards.owners.len() != self.state.len() {
            anyhow::bail!(
                "optimizer sharding: {} owners for {} parameters",
                shards.owners.len(),
                self.state.len()
            );
        }
        for (s, &o) in self.state.iter_mut().zip(&shards.owners) {
            if o != shards.rank {
                *s = Tensor::zeros((2, 0), s.dtype(), s.device())?;
            }
        }
        self.shards = Some(shards);
        Ok(())
    }

    /// Whether this rank keeps parameter `i`'s moments and updates it.
    pub fn owns(&self, i: usize) -> bool {
        self.shards.as_ref().is_none_or(|s| s.owners[i] == s.rank)
    }

    /// The sharding of the state over ranks ([`Self::shard`]; `None`: not sharded).
    pub fn shards(&self) -> Option<&Shards> {
        self.shards.as_ref()
    }

    /// Values of moments this rank holds (both moments of every parameter it owns).
    pub fn state_len(&self) -> usize {
        self.state.iter().map(|s| s.elem_count()).sum()
    }

    /// Parameter `i`'s moments `[2, n]` (empty for one another rank owns).
    pub fn state_of(&self, i: usize) -> &Tensor {
        &self.state[i]
    }

    /// The first (`which` 0) or second (1) moments, shaped as their parameters (views of the
    /// state: they follow later steps).
    fn moments(&self, params: &[(String, Var)], which: usize) -> Result<Vec<Tensor>> {
        if self.shards.is_some() {
            anyhow::bail!(
                "the moments are sharded over ranks: gather them (shard::gather_moments)"
            );
        }
        self.state
            .iter()
            .zip(params)
            .map(|(s, (_, p))| Ok(s.get(which)?.reshape(p.shape())?))
            .collect()
    }

    /// The first moments, shaped as their parameters.
    pub fn m(&self, params: &[(String, Var)]) -> Result<Vec<Tensor>> {
        self.moments(params, 0)
    }

    /// The second moments, shaped as their parameters.
    pub fn v(&self, params: &[(String, Var)]) -> Result<Vec<Tensor>> {
        self.moments(params, 1)
    }

    /// Restore the moments (a resumed run), one pair per parameter.
    pub fn set_moments(&mut self, m: &[Tensor], v: &[Tensor]) -> Result<()> {
        if m.len() != self.state.len() || v.len() != self.state.len() {
            anyhow::bail!(
                "optimizer state: {} and {} moments for {} parameters",
                m.len(),
                v.len(),
                self.state.len()
            );
        }
        let owned: Vec<bool> = (0..self.state.len()).map(|i| self.owns(i)).collect();
        for (((s, m), v), mine) in self.state.iter_mut().zip(m).zip(v).zip(owned) {
            if !mine {
                continue;
            }
            let st = Tensor::stack(&[m.flatten_all()?, v.flatten_all()?], 0)?
                .to_dtype(s.dtype())?
                .to_device(s.device())?;
            if st.dims() != s.dims() {
                anyhow::bail!(
                    "optimizer state: moments of shape {:?} for a parameter of {} values",
                    m.dims(),
                    s.dim(1)?
                );
            }
            *s = st;
        }
        Ok(())
    }

    /// One AdamW step of every parameter at `lr`, in place (weight decay on matrices only),
    /// the gradients multiplied by `grad_scale` first when it is `Some` (the clip's factor,
    /// [`clip_scale`]: applied inside the update, not as a pass of its own).
    pub fn update(
        &mut self,
        params: &[(String, Var)],
        grads: &[Tensor],
        lr: f64,
        grad_scale: Option<f64>,
    ) -> Result<()> {
        self.update_with_copies(params, grads, lr, grad_scale, &[])
            .map(|_| ())
    }

    /// [`Self::update`], each parameter's compute copy (`copies[i]` for `params[i]`, bf16; none
    /// when `copies` is empty) written with the new weights by the same kernel where the device
    /// does that (a GPU). Returns whether every copy was written (false on the CPU: the caller
    /// casts them).
    pub fn update_with_copies(
        &mut self,
        params: &[(String, Var)],
        grads: &[Tensor],
        lr: f64,
        grad_scale: Option<f64>,
        copies: &[Var],
    ) -> Result<bool> {
        if !copies.is_empty() && copies.len() != params.len() {
            anyhow::bail!(
                "optimizer: {} compute copies for {} parameters",
                copies.len(),
                params.len()
            );
        }
        self.step += 1;
        let t = self.step as i32;
        let (b1, b2) = (self.beta1, self.beta2);
        let mut written = !copies.is_empty();
        for (i, ((s, (_, p)), g)) in self.state.iter().zip(params).zip(grads).enumerate() {
            if !self.owns(i) {
                // another rank's: updated there, its compute copy refreshed after the sync
                written = false;
                continue;
            }
            let decay = if p.rank() >= 2 {
                1.0 - lr * self.weight_decay
            } else {
                1.0
            };
            let step = AdamStep::at(t, (b1, b2), self.eps, lr, decay, grad_scale);
            let copy = copies
                .get(i)
                .map(|c| c.as_tensor())
                .filter(|c| c.dtype() == candle_core::DType::BF16);
            written &= adamw_step_copy(p.as_tensor(), s, g, step, copy)?;
        }
        Ok(written)
    }
}

/// Scale `grads` so their global L2 norm is at most `max_norm` (0: no clipping). Returns the
/// norm before clipping.
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let (norm, scale) = clip_scale(grads, max_norm)?;
    if let Some(s) = scale {
        for g in grads.iter_mut() {
            *g = (&*g * s)?;
        }
    }
    Ok(norm)
}

/// The global L2 norm of `grads` and the factor that brings it to `max_norm` when it is
/// over (`None` when it is not, or `max_norm` is 0): `max_norm / (norm + 1e-6)`.
/// Example: norms 3 and 4 (global 5), limit 1 → `(5.0, Some(≈ 0.2))`.
/// The squares are summed on the device in f32 (f64 for f64 gradients; on a GPU by
/// [`dflash_model::ops::sq_sum`], on the CPU row by row), and read back once for all tensors (one
/// synchronisation per step, not one per tensor).
pub fn clip_scale(grads: &[Tensor], max_norm: f64) -> Result<(f64, Option<f64>)> {
    if grads.is_empty() {
        return Ok((0.0, None));
    }
    let per_tensor = grads
        .iter()
        .map(|g| {
            if !g.device().is_cpu() && matches!(g.dtype(), DType::F32 | DType::BF16) {
                // on a GPU each value is read once, bf16 widened in registers
                return dflash_model::ops::sq_sum::sq_sum(g)?.to_dtype(DType::F64);
            }
            let wide = if g.dtype() == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let g = g.to_dtype(wide)?;
            let rows = if g.rank() >= 2 {
                g.flatten_to(g.rank() - 2)?.sqr()?.sum(1)?
            } else {
                g.sqr()?
            };
            rows.flatten_all()?.sum_all()?.to_dtype(DType::F64)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let sq: Vec<f64> = Tensor::stack(&per_tensor, 0)?
        .to_device(&candle_core::Device::Cpu)?
        .to_vec1()?;
    let norm = sq.iter().sum::<f64>().sqrt();
    let scale = (max_norm > 0.0 && norm > max_norm).then(|| max_norm / (norm + 1e-6));
    Ok((norm, scale))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The global norm over a matrix, a 3-D tensor and a vector (3-4-5 and 12: norm 13), and
    /// the clipped gradients' norm.
    #[test]
    fn global_norm_and_clipping() {
        let dev = Device::Cpu;
        let mut grads = vec![
            Tensor::new(&[[3f32, 0.0], [0.0, 4.0]], &dev).unwrap(),
            Tensor::new(&[[[12f32]]], &dev).unwrap(),
            Tensor::new(&[0f32, 0.0, 0.0], &dev).unwrap(),
        ];
        let n = clip_grad_norm(&mut grads, 0.0).unwrap();
        assert!((n - 13.0).abs() < 1e-6, "{n}");
        let n = clip_grad_norm(&mut grads, 1.3).unwrap();
        assert!((n - 13.0).abs() < 1e-6, "{n}");
        let after = clip_grad_norm(&mut grads, 0.0).unwrap();
        assert!((after - 1.3).abs() < 1e-5, "{after}");
        // f64 gradients keep f64 precision (in f32, 1 + 1e-8 rounds to 1)
        let mut g64 = vec![Tensor::new(&[1.0f64, 1e-4], &dev).unwrap()];
        let n = clip_grad_norm(&mut g64, 0.0).unwrap();
        assert!((n - (1.0f64 + 1e-8).sqrt()).abs() < 1e-14, "{n}");
        assert!(n > 1.0);
        assert!(clip_grad_norm(&mut [], 1.0).unwrap() == 0.0);
    }

    /// An update with the clip's factor applied inside it equals the update of gradients
    /// clipped first, bit for bit (weights and moments), and an unclipped step takes no factor.
    #[test]
    fn the_clip_factor_inside_the_update_equals_clipping_first() {
        let dev = Device::Cpu;
        let w0: Vec<f32> = (0..60).map(|i| (i as f32 * 0.3).sin()).collect();
        let g0: Vec<f32> = (0..60).map(|i| (i as f32 * 0.7).cos() * 4.0).collect();
        let run = |inside: bool| {
            let p = Var::from_tensor(
                &Tensor::new(w0.as_slice(), &dev)
                    .unwrap()
                    .reshape((6, 10))
                    .unwrap(),
            )
            .unwrap();
            let params = vec![("w".to_string(), p.clone())];
            let mut opt = AdamW::new(&params, 0.9, 0.95, 1e-8, 0.01).unwrap();
            let mut grads = vec![Tensor::new(g0.as_slice(), &dev)
                .unwrap()
                .reshape((6, 10))
                .unwrap()];
            if inside {
                let (n, scale) = clip_scale(&grads, 1.0).unwrap();
                assert!(n > 1.0 && scale.is_some());
                opt.update(&params, &grads, 1e-2, scale).unwrap();
                assert_eq!(clip_scale(&grads, 1e3).unwrap().1, None);
            } else {
                clip_grad_norm(&mut grads, 1.0).unwrap();
                opt.update(&params, &grads, 1e-2, None).unwrap();
            }
            let bits = |t: &Tensor| dflash_model::ops::compare::bits_f32(t).unwrap();
            (
                bits(p.as_tensor()),
                bits(&opt.m(&params).unwrap()[0]),
                bits(&opt.v(&params).unwrap()[0]),
            )
        };
        assert_eq!(run(true), run(false));
    }
}
