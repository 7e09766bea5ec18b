//! The product `x · Wᵀ (+ b)`: on the panels where they apply, else [`matmul_t`] (the few
//! rows' direct path, the one-row GPU kernel, training's written backward, or candle's matmul).

use candle_core::{DType, Device, Module, Result, Tensor};

use super::few_rows::{few_rows_matmul, few_rows_path};
use super::Linear;
use crate::cpu::panels::Panels;

impl Linear {
    /// The weight's format as the products read it: the panels' ([`Panels::format`]) or
    /// "tensor" (candle's matmul or [`matmul_t`]).
    pub fn format(&self) -> &'static str {
        self.panels.as_ref().map_or("tensor", |p| p.format())
    }

    /// The panels when `x` may use them: f32 on the CPU, not differentiated, and a kernel ISA
    /// selected ([`crate::cpu::Isa`]).
    fn panels_for(&self, x: &Tensor) -> Option<&Panels> {
        let x_ok = matches!(x.device(), Device::Cpu)
            && x.dtype() == DType::F32
            && !x.track_op()
            && Panels::supported();
        self.panels.as_deref().filter(|_| x_ok)
    }
}

impl Linear {
    /// [`Module::forward`] widened to f32, the values rounded to `x`'s dtype first (what
    /// `forward(x)?.to_dtype(F32)` gives): one kernel for one bf16 row on a GPU
    /// ([`crate::ops::gemv::gemv_widened`]: the Gated DeltaNet in-projection of an AR step).
    pub fn forward_f32(&self, x: &Tensor) -> Result<Tensor> {
        if let (Some(w), None, Some(&k)) = (&self.weight, &self.bias, x.dims().last()) {
            let one_row = k > 0 && x.elem_count() == k;
            if one_row && x.dtype() == DType::BF16 && crate::ops::gemv::serves(x, w) {
                return crate::ops::gemv::gemv_widened(x, w);
            }
        }
        self.forward(x)?.to_dtype(DType::F32)
    }
}

/// The `DFLASH_PROFILE` phase of a product by its panels' format.
fn product_phase(format: &str) -> tracing::Span {
    match format {
        "f32" => tracing::info_span!(target: "phase", "proj f32"),
        "bf16" => tracing::info_span!(target: "phase", "proj bf16"),
        "Q4_1" => tracing::info_span!(target: "phase", "proj Q4_1"),
        "Q8_0" => tracing::info_span!(target: "phase", "proj Q8_0"),
        "Q4_K" => tracing::info_span!(target: "phase", "proj Q4_K"),
        "Q6_K" => tracing::info_span!(target: "phase", "proj Q6_K"),
        "Q4_1 q8" => tracing::info_span!(target: "phase", "proj Q4_1 q8"),
        "Q8_0 q8" => tracing::info_span!(target: "phase", "proj Q8_0 q8"),
        _ => tracing::info_span!(target: "phase", "proj tensor"),
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match self.panels_for(x) {
            Some(p) => {
                let _p = product_phase(p.format()).entered();
                panels_matmul(x, p)?
            }
            // a tracked, non-f32 or GPU input beside quantized panels: the dequantized weight
            None => match &self.weight {
                Some(w) => matmul_t(x, w)?,
                None => matmul_t(
                    x,
                    &self.weight()?.to_device(x.device())?.to_dtype(x.dtype())?,
                )?,
            },
        };
        match &self.bias {
            None => Ok(y),
            Some(b) => y.broadcast_add(b),
        }
    }
}

/// `x` `[..., k]` · panels of `W` `[n, k]` → `[..., n]`.
fn panels_matmul(x: &Tensor, p: &Panels) -> Result<Tensor> {
    let dims = x.dims();
    let (k, lead) = match dims.split_last() {
        Some((&k, lead)) => (k, lead),
        None => candle_core::bail!("Linear: a scalar input"),
    };
    if k != p.in_features() {
        candle_core::bail!(
            "Linear: input width {k} vs weight [{}, {}]",
            p.out_features(),
            p.in_features()
        );
    }
    let rows: usize = lead.iter().product();
    let mut out_shape = lead.to_vec();
    out_shape.push(p.out_features());
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let candle_core::Storage::Cpu(xc) = &*xs else {
        candle_core::bail!("Linear: a CPU input expected")
    };
    let xv = crate::ops::kernel_io::cpu_slice::<f32>(xc, xl, "Linear input")?;
    Tensor::from_vec(p.matmul(xv, rows), out_shape, &Device::Cpu)
}

/// `x · Wᵀ` for `x` `[..., in]` and `W` `[out, in]` → `[..., out]`.
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let (k, lead) = match dims.split_last() {
        Some((&k, lead)) => (k, lead),
        None => candle_core::bail!("matmul_t: a scalar input"),
    };
    let rows: usize = lead.iter().product();
    let mut out_shape = lead.to_vec();
    out_shape.push(w.dim(0)?);
    if few_rows_path(x, w, rows) {
        return few_rows_matmul(x, w, rows, k)?.reshape(out_shape);
    }
    if rows == 1 && crate::ops::gemv::serves(x, w) {
        return crate::ops::gemv::gemv(x, w)?.reshape(out_shape);
    }
    if !x.device().is_cpu() && (x.track_op() || w.track_op()) && w.rank() == 2 {
        return tracked_matmul_t(x, w, rows, k, out_shape);
    }
    // candle's matmul, the way candle_nn's Linear calls it
    if x.is_contiguous() && dims.len() > 2 {
        x.reshape((rows, k))?.matmul(&w.t()?)?.reshape(out_shape)
    } else {
        x.broadcast_matmul(&w.t()?)
    }
}

/// `x · Wᵀ` in training on a GPU: one graph node with a written backward, `dx = g · W` and
/// `dW = gᵀ · x`, both straight into their tensors' layouts. candle's autograd of the composed
/// form (reshape, transpose, matmul, reshape) adds each of those nodes' gradients into a fresh
/// zero tensor and takes `dW` through a strided transpose: at the Qwen3-8B shape these adds
/// were a quarter of the drafter's backward (`docs/BENCHMARKS.md`, the step's kernel profile).
/// The same products as candle's; CPU training keeps candle's graph (its summation order).
pub(crate) fn tracked_matmul_t(
    x: &Tensor,
    w: &Tensor,
    rows: usize,
    k: usize,
    out_shape: Vec<usize>,
) -> Result<Tensor> {
    let n = w.dim(0)?;
    let (x2, wd, x_shape) = (
        x.detach().reshape((rows, k))?,
        w.detach(),
        x.shape().clone(),
    );
    let y = x2.matmul(&wd.t()?)?.reshape(out_shape)?;
    let dx = move |g: &Tensor| g.reshape((rows, n))?.matmul(&wd)?.reshape(&x_shape);
    let dw = move |g: &Tensor| g.reshape((rows, n))?.t()?.matmul(&x2);
    use crate::ops::with_grad::{with_grad, with_grad2};
    // a frozen operand (the shared LM head, the taps) gets no gradient: no product for it
    match (x.track_op(), w.track_op()) {
        (true, true) => with_grad2(x, w, y, "linear", move |_, _, _, g| {
            let g = g.detach();
            Ok((dx(&g)?, dw(&g)?))
        }),
        (true, false) => with_grad(x, y, "linear", move |_, g| dx(&g.detach())),
        _ => with_grad(w, y, "linear", move |_, g| dw(&g.detach())),
    }
}
