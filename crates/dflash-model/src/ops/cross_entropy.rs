//! Cross-entropy of rows of logits against labels, fused: one pass over the vocabulary per row
//! forward (max, arg-max, log-sum-exp, the label's logit), one backward
//! (`dx = g · (softmax(x) − onehot(label))`), in f32 for f32 and bf16 logits (f64 for f64,
//! the finite-difference tests' dtype).
//!
//! The drafter's loss runs over `anchors × (B − 1)` rows of the full vocabulary (512 anchors of
//! SmolLM2: 7,680 × 49,152 logits): composed of log-softmax, gather and their backwards, that
//! is a dozen full-size passes; here it is one read forward and one read and write backward.
//! Example: logits [0, ln 3], label 1 → loss = ln 4 − ln 3 ≈ 0.2877, arg-max 1; for g = 1 the
//! gradient is [0.25, 0.75 − 1] = [0.25, −0.25].

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use crate::ops::kernel_io::cpu_slice;
use crate::ops::with_grad::with_grad;

/// Per-row losses `[n]` (f32; f64 for f64 logits; differentiable in `logits` `[n, v]`) and
/// the rows' arg-max.
pub fn cross_entropy_rows(logits: &Tensor, labels: &[u32]) -> Result<(Tensor, Vec<u32>)> {
    let ce = Rows::new(logits, labels)?;
    let (loss, argmax) = (ce.loss()?, ce.argmax()?);
    let loss = with_grad(logits, loss, "cross-entropy", move |_, g| ce.dlogits(g))?;
    Ok((loss, argmax))
}

/// [`cross_entropy_rows`] of the logits `x · Wᵀ` (`x` `[n, h]`, the frozen LM head `W`
/// `[v, h]`) as one graph node: the logits are made without a graph and returned as they are
/// (`[n, v]`, `x`'s dtype), and the backward goes straight to `dx = dlogits · W`. The logits
/// are never a node of the graph, so none of their `n × v` gradients is accumulated by
/// autograd (at the Qwen3-8B training shape, five passes over 2.3 GB). The values equal
/// the LM head's `matmul_t` then [`cross_entropy_rows`], bit for bit.
pub fn linear_cross_entropy_rows(
    x: &Tensor,
    w: &Tensor,
    labels: &[u32],
) -> Result<(Tensor, Vec<u32>, Tensor)> {
    if w.track_op() {
        candle_core::bail!("linear cross-entropy: the LM head must be frozen");
    }
    let (w, xd) = (w.detach(), x.detach());
    let (_, h) = xd.dims2()?;
    if w.dims2()?.1 != h {
        candle_core::bail!(
            "linear cross-entropy: rows of {h} against an LM head of shape {:?}",
            w.dims()
        );
    }
    let logits = xd.matmul(&w.t()?)?;
    let ce = Rows::new(&logits, labels)?;
    let (loss, argmax) = (ce.loss()?, ce.argmax()?);
    let loss = with_grad(x, loss, "lm-head cross-entropy", move |_, g| {
        ce.dlogits(g)?.matmul(&w)
    })?;
    Ok((loss, argmax, logits))
}

/// Logits rows and their labels after the fused forward: `stats` `[n, 3]` = loss, arg-max,
/// log-sum-exp per row.
struct Rows {
    x: Tensor,
    lab: Tensor,
    stats: Tensor,
}

impl Rows {
    fn new(logits: &Tensor, labels: &[u32]) -> Result<Self> {
        let (n, v) = logits.dims2()?;
        if labels.len() != n {
            candle_core::bail!("cross-entropy: {} labels for {n} rows", labels.len());
        }
        if let Some(&bad) = labels.iter().find(|&&y| y as usize >= v) {
            candle_core::bail!("cross-entropy: label {bad} is outside the vocabulary of {v}");
        }
        let x = logits.detach().contiguous()?;
        let lab = Tensor::from_vec(labels.to_vec(), n, x.device())?;
        let stats = x.apply_op2_no_bwd(&lab, &CeFwd)?;
        Ok(Self { x, lab, stats })
    }

    fn argmax(&self) -> Result<Vec<u32>> {
        Ok(self
            .stats
            .narrow(1, 1, 1)?
            .squeeze(1)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .into_iter()
            .map(|a| a as u32)
            .collect())
    }

    fn loss(&self) -> Result<Tensor> {
        self.stats.narrow(1, 0, 1)?.squeeze(1)?.contiguous()
    }

    /// `g · (softmax(x) − onehot(label))` for the per-row upstream gradient `g` `[n]`.
    fn dlogits(&self, g: &Tensor) -> Result<Tensor> {
        let aux = Tensor::cat(
            &[&self.stats, &g.to_dtype(self.stats.dtype())?.unsqueeze(1)?],
            1,
        )?;
        self.x
            .apply_op3_no_bwd(&self.lab, &aux.contiguous()?, &CeBwd)
    }
}

struct CeFwd;
struct CeBwd;

fn fwd_rows<T: WithDType, S: WithDType>(x: &[T], labels: &[u32], v: usize) -> Vec<S> {
    let mut out = Vec::with_capacity(labels.len() * 3);
    for (row, &y) in x.chunks(v).zip(labels) {
        let (mut m, mut am) = (f64::NEG_INFINITY, 0usize);
        for (j, t) in row.iter().enumerate() {
            let t = t.to_f64();
            if t > m {
                (m, am) = (t, j);
            }
        }
        let lse = m + row.iter().map(|t| (t.to_f64() - m).exp()).sum::<f64>().ln();
        out.extend([lse - row[y as usize].to_f64(), am as f64, lse].map(S::from_f64));
    }
    out
}

fn bwd_rows<T: WithDType, S: WithDType>(x: &[T], labels: &[u32], aux: &[S], v: usize) -> Vec<T> {
    let mut dx = Vec::with_capacity(x.len());
    for (i, row) in x.chunks(v).enumerate() {
        let (lse, g) = (aux[4 * i + 2].to_f64(), aux[4 * i + 3].to_f64());
        let y = labels[i] as usize;
        dx.extend(row.iter().enumerate().map(|(j, t)| {
            let p = (t.to_f64() - lse).exp();
            T::from_f64(g * (p - if j == y { 1.0 } else { 0.0 }))
        }));
    }
    dx
}

impl CustomOp2 for CeFwd {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = lx.shape().dims2()?;
        let labels = cpu_slice::<u32>(y, ly, "cross-entropy")?;
        let out = match x.dtype() {
            DType::F32 => CpuStorage::F32(fwd_rows(
                cpu_slice::<f32>(x, lx, "cross-entropy")?,
                labels,
                v,
            )),
            DType::F64 => CpuStorage::F64(fwd_rows(
                cpu_slice::<f64>(x, lx, "cross-entropy")?,
                labels,
                v,
            )),
            DType::BF16 => CpuStorage::F32(fwd_rows(
                cpu_slice::<half::bf16>(x, lx, "cross-entropy")?,
                labels,
                v,
            )),
            other => candle_core::bail!("cross-entropy: {other:?} logits are not supported"),
        };
        Ok((out, Shape::from((n, 3))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        let (n, v) = lx.shape().dims2()?;
        let dev = x.device().clone();
        let labels = view::<u32>(y, ly, "labels")?;
        let out = alloc::<f32>(&dev, n * 3)?;
        let vi = v as i32;
        let cfg = rows(n, 256);
        match x.dtype() {
            DType::F32 => {
                let xv = view::<f32>(x, lx, "logits")?;
                launch!(dev, "ce_fwd", DType::F32, cfg, xv, labels, out, vi);
            }
            DType::BF16 => {
                let xv = view::<half::bf16>(x, lx, "logits")?;
                launch!(dev, "ce_fwd", DType::BF16, cfg, xv, labels, out, vi);
            }
            other => candle_core::bail!("cross-entropy: no CUDA kernel for {other:?} logits"),
        }
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((n, 3)),
        ))
    }
}

impl CustomOp3 for CeBwd {
    fn name(&self) -> &'static str {
        "cross-entropy-bwd"
    }
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
        a: &CpuStorage,
        la: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = lx.shape().dims2()?;
        let labels = cpu_slice::<u32>(y, ly, "cross-entropy")?;
        let out = match x.dtype() {
            DType::F32 => CpuStorage::F32(bwd_rows(
                cpu_slice::<f32>(x, lx, "cross-entropy")?,
                labels,
                cpu_slice::<f32>(a, la, "cross-entropy")?,
                v,
            )),
            DType::F64 => CpuStorage::F64(bwd_rows(
                cpu_slice::<f64>(x, lx, "cross-entropy")?,
                labels,
                cpu_slice::<f64>(a, la, "cross-entropy")?,
                v,
            )),
            DType::BF16 => CpuStorage::BF16(bwd_rows(
                cpu_slice::<half::bf16>(x, lx, "cross-entropy")?,
                labels,
                cpu_slice::<f32>(a, la, "cross-entropy")?,
                v,
            )),
            other => candle_core::bail!("cross-entropy: {other:?} logits are not supported"),
        };
        Ok((out, Shape::from((n, v))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        a: &candle_core::CudaStorage,
        la: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        let (n, v) = lx.shape().dims2()?;
        let dev = x.device().clone();
        let labels = view::<u32>(y, ly, "labels")?;
        let aux = view::<f32>(a, la, "statistics")?;
        let vi = v as i32;
        let cfg = rows(n, 256);
        let out = match x.dtype() {
            DType::F32 => {
                let xv = view::<f32>(x, lx, "logits")?;
                let dx = alloc::<f32>(&dev, n * v)?;
                launch!(dev, "ce_bwd", DType::F32, cfg, xv, labels, aux, dx, vi);
                candle_core::CudaStorage::wrap_cuda_slice(dx, dev)
            }
            DType::BF16 => {
                let xv = view::<half::bf16>(x, lx, "logits")?;
                let dx = alloc::<half::bf16>(&dev, n * v)?;
                launch!(dev, "ce_bwd", DType::BF16, cfg, xv, labels, aux, dx, vi);
                candle_core::CudaStorage::wrap_cuda_slice(dx, dev)
            }
            other => candle_core::bail!("cross-entropy: no CUDA kernel for {other:?} logits"),
        };
        Ok((out, Shape::from((n, v))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    #[test]
    fn the_docs_example() {
        let x = Var::new(&[[0f64, 3f64.ln()]], &Device::Cpu).unwrap();
        let (loss, am) = cross_entropy_rows(x.as_tensor(), &[1]).unwrap();
        assert_eq!(am, vec![1]);
        let l = loss.to_vec1::<f64>().unwrap()[0];
        assert!((l - (4f64.ln() - 3f64.ln())).abs() < 1e-12);
        let g = loss.sum_all().unwrap().backward().unwrap();
        let dx = g.get(x.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
        assert!((dx[0][0] - 0.25).abs() < 1e-6 && (dx[0][1] + 0.25).abs() < 1e-6);
    }

    /// The LM head and the loss as one node equal the LM head's matmul then the loss, for the
    /// losses, the logits and the gradient of the rows, bit for bit; a tracked head is refused.
    #[test]
    fn linear_cross_entropy_equals_the_head_then_the_loss() {
        let dev = Device::Cpu;
        let (n, h, v) = (6, 8, 29);
        let f = |len: usize, s: f32| -> Vec<f32> {
            (0..len).map(|i| ((i as f32 + s) * 0.37).sin()).collect()
        };
        let x0 = Tensor::from_vec(f(n * h, 1.0), (n, h), &dev).unwrap();
        let w = Tensor::from_vec(f(v * h, 2.0), (v, h), &dev).unwrap();
        let labels: Vec<u32> = (0..n as u32).map(|i| (i * 5 + 2) % v as u32).collect();
        let wt = Tensor::from_vec(f(n, 3.0), n, &dev).unwrap();
        let run = |fused: bool| {
            let x = Var::from_tensor(&x0).unwrap();
            let (loss, am, logits) = if fused {
                linear_cross_entropy_rows(x.as_tensor(), &w, &labels).unwrap()
            } else {
                let l = crate::layers::linear::matmul_t(x.as_tensor(), &w).unwrap();
                let (loss, am) = cross_entropy_rows(&l, &labels).unwrap();
                (loss, am, l)
            };
            let g = (&loss * &wt)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let dx = g.get(x.as_tensor()).unwrap().clone();
            (loss, am, logits, dx)
        };
        let (a, b) = (run(true), run(false));
        assert_eq!(a.1, b.1);
        for (name, p, q) in [
            ("loss", &a.0, &b.0),
            ("logits", &a.2, &b.2),
            ("dx", &a.3, &b.3),
        ] {
            let e = crate::ops::compare::max_abs(p, q).unwrap();
            assert_eq!(e, 0.0, "{name}: max diff {e}");
        }
        let tracked = Var::from_tensor(&w).unwrap();
        let e = linear_cross_entropy_rows(&x0, tracked.as_tensor(), &labels).unwrap_err();
        assert!(e.to_string().contains("must be frozen"), "{e}");
    }

    #[test]
    fn equals_log_softmax_and_gather_with_gradients() {
        let (n, v) = (5, 37);
        let vals: Vec<f32> = (0..n * v)
            .map(|i| ((i * 7919 % 113) as f32 / 113.0 - 0.5) * 9.0)
            .collect();
        let labels: Vec<u32> = (0..n as u32).map(|i| (i * 11 + 3) % v as u32).collect();
        let w: Vec<f32> = (0..n).map(|i| 0.3 + i as f32).collect();
        let base = Tensor::from_vec(vals, (n, v), &Device::Cpu).unwrap();
        let wt = Tensor::from_vec(w, n, &Device::Cpu).unwrap();
        // the composed reference
        let x1 = Var::from_tensor(&base).unwrap();
        let lab = Tensor::from_vec(labels.clone(), (n, 1), &Device::Cpu).unwrap();
        let want = candle_nn::ops::log_softmax(x1.as_tensor(), D::Minus1)
            .unwrap()
            .gather(&lab, 1)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .neg()
            .unwrap();
        let g1 = (&want * &wt)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let want_am: Vec<u32> = base.argmax(D::Minus1).unwrap().to_vec1().unwrap();
        // fused
        let x2 = Var::from_tensor(&base).unwrap();
        let (got, am) = cross_entropy_rows(x2.as_tensor(), &labels).unwrap();
        let g2 = (&got * &wt).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(am, want_am);
        assert!(crate::ops::compare::max_abs(&want, &got).unwrap() < 1e-5);
        let e = crate::ops::compare::max_abs(
            g1.get(x1.as_tensor()).unwrap(),
            g2.get(x2.as_tensor()).unwrap(),
        )
        .unwrap();
        assert!(e < 1e-5, "gradient differs by {e}");
        // a label outside the vocabulary is refused by name
        let err = cross_entropy_rows(&base, &[0, 0, 0, 0, v as u32]).unwrap_err();
        assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    }
}
