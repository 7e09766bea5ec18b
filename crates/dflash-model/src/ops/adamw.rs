//! The AdamW step in place: the moments (`m`, `v`) from the gradient, then the weights from the
//! moments. Composed of tensor ops the step is a dozen full-size passes that allocate; on the
//! CPU it is two element-wise passes, on a GPU one kernel (`adamw_fused_*`) that reads the
//! gradient, moments and weights once and writes the moments and weights in place, and, when
//! asked, the weights' bf16 compute copy (about 26 bytes per parameter from a bf16 gradient,
//! 28 with the copy, against 34 + 6 for the two passes and a cast).
//!
//! The arithmetic is that of the composed form it replaces, operation for operation in f32
//! (f64 for f64 weights, the gradient checks' dtype), each scalar product rounded as
//! `x · mul + add` (how a tensor times a scalar computes): with a clip scale `s`,
//! `g ← g·s + 0` first (the clipped gradient, without a pass of its own), then
//! `m ← m·β1 + g·(1 − β1)`, `v ← v·β2 + g²·(1 − β2)`,
//! `w ← w·decay − lr · (m·(1/c1)) / (sqrt(v·(1/c2)) + ε)` with `c_i = 1 − β_i^t` and
//! `decay = 1 − lr·wd` (1 for vectors). The CUDA kernel (`adamw_fused_*` in
//! `src/ops/adamw.cu`) rounds every operation the same way (no fused multiply-add), so the GPU
//! and its CPU twin agree bit for bit; its bf16 copy rounds as a cast does. Example: w = 1, g = 0.5,
//! m = v = 0, β = (0.9, 0.999), t = 1, lr = 0.1, no decay → m = 0.05, v = 0.00025,
//! w = 1 − 0.1 · 0.5 / (0.5 + ε) ≈ 0.9.

use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor, WithDType};

use crate::ops::kernel_io::cpu_slice;

/// One step's scalars.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub beta1: f64,
    pub beta2: f64,
    /// 1 / (1 − β1^t), 1 / (1 − β2^t).
    pub inv_c1: f64,
    pub inv_c2: f64,
    pub eps: f64,
    /// `1 − lr · weight_decay` for matrices, 1 for vectors.
    pub decay: f64,
    pub lr: f64,
    /// The global-norm clip's factor the gradient is multiplied by first, `None` when the
    /// norm was under the limit (the gradient as given). Example: norm 2.6, limit 1.3 →
    /// `Some(0.5)` (up to the clip's ε).
    pub grad_scale: Option<f64>,
}

impl AdamStep {
    /// Step `t` (1-based) of AdamW with these betas: the bias corrections `1 / (1 − β^t)`
    /// computed here, once. Example: t = 1, β1 = 0.9 → `inv_c1` = 10.
    pub fn at(
        t: i32,
        (beta1, beta2): (f64, f64),
        eps: f64,
        lr: f64,
        decay: f64,
        grad_scale: Option<f64>,
    ) -> Self {
        Self {
            beta1,
            beta2,
            inv_c1: 1.0 / (1.0 - beta1.powi(t)),
            inv_c2: 1.0 / (1.0 - beta2.powi(t)),
            eps,
            decay,
            lr,
            grad_scale,
        }
    }
}

/// One parameter's step: `state` `[2, n]` (the first moments, then the second) and `w` (n
/// values, contiguous) updated in place from the gradient `g`: of `w`'s dtype, or bf16 for f32
/// weights (the gradient of a bf16 compute copy, widened in the kernel as a cast would).
pub fn adamw_step(w: &Tensor, state: &Tensor, g: &Tensor, s: AdamStep) -> Result<()> {
    adamw_step_copy(w, state, g, s, None).map(|_| ())
}

/// [`adamw_step`], and on a GPU with f32 weights also `copy` (bf16, `w`'s element count,
/// contiguous: the weights' compute copy) written with the new weights in the same kernel, as
/// a cast would round them. Returns whether `copy` was written (false on the CPU, where the
/// caller casts). Example: the trainer's bf16 compute copies on a GPU, refreshed without a pass
/// of their own.
pub fn adamw_step_copy(
    w: &Tensor,
    state: &Tensor,
    g: &Tensor,
    s: AdamStep,
    copy: Option<&Tensor>,
) -> Result<bool> {
    let n = w.elem_count();
    if state.dims() != [2, n] || g.elem_count() != n {
        candle_core::bail!(
            "adamw: state {:?} and gradient {:?} for a parameter of {n} values",
            state.dims(),
            g.dims()
        );
    }
    let g = if g.dtype() == DType::BF16 && w.dtype() == DType::F32 {
        g.contiguous()?
    } else {
        g.to_dtype(w.dtype())?.contiguous()?
    };
    if let Some(c) = copy {
        if c.dtype() != DType::BF16 || c.elem_count() != n || !c.is_contiguous() {
            candle_core::bail!(
                "adamw: the compute copy must be contiguous bf16 of {n} values, got {:?} {:?}",
                c.dtype(),
                c.dims()
            );
        }
    }
    if w.device().is_cuda() && w.dtype() == DType::F32 {
        w.inplace_op2(
            &g.flatten_all()?,
            &Fused {
                s,
                state: state.clone(),
                copy: copy.cloned(),
            },
        )?;
        return Ok(copy.is_some());
    }
    state.inplace_op2(&g.flatten_all()?, &Moments(s))?;
    w.inplace_op2(state, &Apply(s))?;
    Ok(false)
}

struct Moments(AdamStep);
struct Apply(AdamStep);

/// The GPU's one pass: `w` (this op's destination) and the moments `state` and `copy` (held by
/// the op, written through their device pointers: tensors no other op reads meanwhile) from the
/// gradient.
struct Fused {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    s: AdamStep,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    state: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    copy: Option<Tensor>,
}

impl InplaceOp2 for Fused {
    fn name(&self) -> &'static str {
        "adamw-fused"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("adamw: the one-pass step is the GPU's (the CPU runs two passes)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        w: &mut candle_core::CudaStorage,
        l1: &Layout,
        g: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        use crate::cuda::ptx::{by_float, elementwise, launch, view, with_held};
        use candle_core::backend::BackendStorage;
        contiguous(l1, "weights")?;
        let s = &self.s;
        let dev = w.device().clone();
        let n = l1.shape().elem_count() as u64;
        let wv = view::<f32>(w, l1, "weights")?;
        let f = |x: f64| x as f32;
        let (b1, omb1, b2, omb2) = (f(s.beta1), f(1.0 - s.beta1), f(s.beta2), f(1.0 - s.beta2));
        let (scaled, gs) = (
            s.grad_scale.is_some() as u32,
            f(s.grad_scale.unwrap_or(1.0)),
        );
        let (ic1, ic2, eps, decay, lr) = (f(s.inv_c1), f(s.inv_c2), f(s.eps), f(s.decay), f(s.lr));
        let cfg = elementwise(n);
        let copy = self.copy.as_ref();
        with_held::<f32, _>(&self.state, "adamw moments", |mv| {
            by_float!(g.dtype(), "adamw gradient", |T, dt| {
                let gv = view::<T>(g, l2, "gradient")?;
                // one launch; `$copy` the compute copy, or (`has` 0) the moments' pointer standing
                // in, never written
                macro_rules! fused {
                    ($copy:expr, $has:expr) => {{
                        let has: u32 = $has;
                        launch!(
                            dev,
                            "adamw_fused",
                            dt,
                            cfg,
                            wv,
                            mv,
                            gv,
                            n,
                            b1,
                            omb1,
                            b2,
                            omb2,
                            scaled,
                            gs,
                            ic1,
                            ic2,
                            eps,
                            decay,
                            lr,
                            $copy,
                            has
                        );
                    }};
                }
                match copy {
                    Some(c) => with_held::<half::bf16, _>(c, "compute copy", |cv| {
                        fused!(cv, 1);
                        Ok(())
                    })?,
                    None => fused!(mv, 0),
                }
            });
            Ok(())
        })
    }
}

/// `x · mul + add`, as a tensor times a scalar rounds it.
fn aff<T: num_like::Float>(x: T, mul: T, add: T) -> T {
    x * mul + add
}

mod num_like {
    /// The float operations the CPU twin needs, for f32 and f64.
    pub trait Float:
        Copy
        + std::ops::Mul<Output = Self>
        + std::ops::Add<Output = Self>
        + std::ops::Sub<Output = Self>
        + std::ops::Div<Output = Self>
    {
        fn of(x: f64) -> Self;
        fn sqrt(self) -> Self;
    }
    impl Float for f32 {
        fn of(x: f64) -> Self {
            x as f32
        }
        fn sqrt(self) -> Self {
            f32::sqrt(self)
        }
    }
    impl Float for f64 {
        fn of(x: f64) -> Self {
            x
        }
        fn sqrt(self) -> Self {
            f64::sqrt(self)
        }
    }
}

fn moments_cpu<T: num_like::Float + WithDType>(
    mv: &mut [T],
    l: &Layout,
    g: &[T],
    s: &AdamStep,
) -> Result<()> {
    let n = g.len();
    let o = l.start_offset();
    let mv = &mut mv[o..o + 2 * n];
    let (m, v) = mv.split_at_mut(n);
    let (b1, omb1) = (T::of(s.beta1), T::of(1.0 - s.beta1));
    let (b2, omb2) = (T::of(s.beta2), T::of(1.0 - s.beta2));
    let zero = T::of(0.0);
    let scale = s.grad_scale.map(T::of);
    for i in 0..n {
        let gi = match scale {
            Some(c) => aff(g[i], c, zero),
            None => g[i],
        };
        m[i] = aff(m[i], b1, zero) + aff(gi, omb1, zero);
        v[i] = aff(v[i], b2, zero) + aff(gi * gi, omb2, zero);
    }
    Ok(())
}

fn apply_cpu<T: num_like::Float + WithDType>(
    w: &mut [T],
    l: &Layout,
    mv: &[T],
    s: &AdamStep,
) -> Result<()> {
    let n = l.shape().elem_count();
    let o = l.start_offset();
    let w = &mut w[o..o + n];
    let zero = T::of(0.0);
    let (ic1, ic2) = (T::of(s.inv_c1), T::of(s.inv_c2));
    let (eps, decay, lr, one) = (T::of(s.eps), T::of(s.decay), T::of(s.lr), T::of(1.0));
    for i in 0..n {
        let mhat = aff(mv[i], ic1, zero);
        let vhat = aff(mv[n + i], ic2, zero);
        let upd = mhat / aff(vhat.sqrt(), one, eps);
        w[i] = aff(w[i], decay, zero) - aff(upd, lr, zero);
    }
    Ok(())
}

fn contiguous(l: &Layout, what: &str) -> Result<()> {
    if !l.is_contiguous() {
        candle_core::bail!("adamw: the {what} must be contiguous");
    }
    Ok(())
}

impl InplaceOp2 for Moments {
    fn name(&self) -> &'static str {
        "adamw-moments"
    }

    fn cpu_fwd(&self, mv: &mut CpuStorage, l1: &Layout, g: &CpuStorage, l2: &Layout) -> Result<()> {
        contiguous(l1, "moments")?;
        match mv {
            CpuStorage::F32(x) if matches!(g, CpuStorage::BF16(_)) => {
                let g = crate::ops::kernel_io::f32_values(g, l2, "gradient")?;
                moments_cpu(x, l1, &g, &self.0)
            }
            CpuStorage::F32(x) => moments_cpu(x, l1, cpu_slice::<f32>(g, l2, "gradient")?, &self.0),
            CpuStorage::F64(x) => moments_cpu(x, l1, cpu_slice::<f64>(g, l2, "gradient")?, &self.0),
            _ => candle_core::bail!("adamw: moments must be f32 or f64"),
        }
    }
}

impl InplaceOp2 for Apply {
    fn name(&self) -> &'static str {
        "adamw-apply"
    }

    fn cpu_fwd(&self, w: &mut CpuStorage, l1: &Layout, mv: &CpuStorage, l2: &Layout) -> Result<()> {
        contiguous(l1, "weights")?;
        match w {
            CpuStorage::F32(x) => apply_cpu(x, l1, cpu_slice::<f32>(mv, l2, "moments")?, &self.0),
            CpuStorage::F64(x) => apply_cpu(x, l1, cpu_slice::<f64>(mv, l2, "moments")?, &self.0),
            _ => candle_core::bail!("adamw: weights must be f32 or f64"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The module's example, and the composed form (tensor ops) it replaces, bit for bit over
    /// three steps with weight decay, the second one clipped.
    #[test]
    fn equals_the_composed_form_bit_for_bit() {
        let dev = Device::Cpu;
        let w = Tensor::new(&[1f32], &dev).unwrap();
        let st = Tensor::zeros((2, 1), DType::F32, &dev).unwrap();
        let g = Tensor::new(&[0.5f32], &dev).unwrap();
        let s = AdamStep {
            beta1: 0.9,
            beta2: 0.999,
            inv_c1: 1.0 / 0.1,
            inv_c2: 1.0 / (1.0 - 0.999),
            eps: 1e-8,
            decay: 1.0,
            lr: 0.1,
            grad_scale: None,
        };
        adamw_step(&w, &st, &g, s).unwrap();
        let m = st.to_vec2::<f32>().unwrap();
        assert!((m[0][0] - 0.05).abs() < 1e-7 && (m[1][0] - 0.00025).abs() < 1e-9);
        assert!((w.to_vec1::<f32>().unwrap()[0] - 0.9).abs() < 1e-6);

        let n = 1000;
        let init: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin()).collect();
        let w = Tensor::new(init.as_slice(), &dev)
            .unwrap()
            .reshape((10, 100))
            .unwrap();
        let st = Tensor::zeros((2, n), DType::F32, &dev).unwrap();
        let (mut cw, mut cm, mut cv) = (
            w.copy().unwrap(),
            Tensor::zeros((10, 100), DType::F32, &dev).unwrap(),
            Tensor::zeros((10, 100), DType::F32, &dev).unwrap(),
        );
        let (b1, b2, eps, lr, wd) = (0.9f64, 0.95f64, 1e-8f64, 3e-3f64, 0.01f64);
        for t in 1..=3i32 {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * 7 + t as usize) as f32 * 0.11).cos())
                .collect();
            let g_raw = Tensor::new(g.as_slice(), &dev)
                .unwrap()
                .reshape((10, 100))
                .unwrap();
            let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
            let decay = 1.0 - lr * wd;
            // step 2 is clipped: the composed form scales the gradient first
            let grad_scale = (t == 2).then_some(0.37);
            let g = match grad_scale {
                Some(c) => (&g_raw * c).unwrap(),
                None => g_raw.clone(),
            };
            // the composed form
            cm = ((&cm * b1).unwrap() + (&g * (1.0 - b1)).unwrap()).unwrap();
            cv = ((&cv * b2).unwrap() + (g.sqr().unwrap() * (1.0 - b2)).unwrap()).unwrap();
            let upd = ((&cm / c1).unwrap() / ((&cv / c2).unwrap().sqrt().unwrap() + eps).unwrap())
                .unwrap();
            cw = ((&cw * decay).unwrap() - (upd * lr).unwrap()).unwrap();
            let s = AdamStep {
                beta1: b1,
                beta2: b2,
                inv_c1: 1.0 / c1,
                inv_c2: 1.0 / c2,
                eps,
                decay,
                lr,
                grad_scale,
            };
            adamw_step(&w, &st, &g_raw, s).unwrap();
        }
        let bits = |t: &Tensor| crate::ops::compare::bits_f32(t).unwrap();
        assert_eq!(bits(&w), bits(&cw));
        assert_eq!(bits(&st.get(0).unwrap()), bits(&cm));
        assert_eq!(bits(&st.get(1).unwrap()), bits(&cv));
    }

    /// bf16 gradients of f32 weights (read by the moments kernel as they are) give the same bits
    /// as the same gradients cast to f32 first, clipped and not.
    #[test]
    fn bf16_gradients_equal_their_f32_casts() {
        let dev = Device::Cpu;
        let run = |bf16: bool| {
            let w = Tensor::new(&[0.3f32, -1.2, 2.5, 0.0, 7.0, -0.01], &dev).unwrap();
            let st = Tensor::zeros((2, 6), DType::F32, &dev).unwrap();
            for t in 1..=2i32 {
                let g = Tensor::new(&[0.1f32 * t as f32, -3.0, 0.7, 1e-3, -0.0, 2.2], &dev)
                    .unwrap()
                    .to_dtype(DType::BF16)
                    .unwrap();
                let g = if bf16 {
                    g
                } else {
                    g.to_dtype(DType::F32).unwrap()
                };
                let s = AdamStep::at(t, (0.9, 0.95), 1e-8, 1e-2, 0.999, (t == 2).then_some(0.41));
                adamw_step(&w, &st, &g, s).unwrap();
            }
            let bits = |t: &Tensor| crate::ops::compare::bits_f32(t).unwrap();
            (bits(&w), bits(&st))
        };
        assert_eq!(run(true), run(false));
    }

    #[test]
    fn mismatched_state_is_refused() {
        let dev = Device::Cpu;
        let w = Tensor::zeros(4, DType::F32, &dev).unwrap();
        let st = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        let s = AdamStep {
            beta1: 0.9,
            beta2: 0.9,
            inv_c1: 1.0,
            inv_c2: 1.0,
            eps: 1e-8,
            decay: 1.0,
            lr: 0.1,
            grad_scale: None,
        };
        assert!(adamw_step(&w, &st, &w, s).is_err());
    }
}
