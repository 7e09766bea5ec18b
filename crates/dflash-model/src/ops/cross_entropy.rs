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
    let (n, v) = logits.dims2()?;
    if labels.len() != n {
        candle_core::bail!("cross-entropy: {} labels for {n} rows", labels.len());
    }
    if let Some(&bad) = labels.iter().find(|&&y| y as usize >= v) {
        candle_core::bail!("cross-entropy: label {bad} is outside the vocabulary of {v}");
    }
    let x = logits.detach().contiguous()?;
    let lab = Tensor::from_vec(labels.to_vec(), n, x.device())?;
    let stats = x.apply_op2_no_bwd(&lab, &CeFwd)?; // [n, 3]: loss, arg-max, lse
    let argmax: Vec<u32> = stats
        .narrow(1, 1, 1)?
        .squeeze(1)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|a| a as u32)
        .collect();
    let loss = stats.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?;
    let loss = with_grad(logits, loss, "cross-entropy", move |_, g| {
        let aux = Tensor::cat(&[&stats, &g.to_dtype(stats.dtype())?.unsqueeze(1)?], 1)?;
        x.apply_op3_no_bwd(&lab, &aux.contiguous()?, &CeBwd)
    })?;
    Ok((loss, argmax))
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
