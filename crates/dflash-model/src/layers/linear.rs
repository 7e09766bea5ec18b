//! `x · Wᵀ` for every projection and the LM head, with CPU kernels for inference.
//!
//! Decoding on a CPU multiplies a handful of rows by each weight matrix: 1 row per AR step,
//! 16 per DFlash verify, 9 or 33 per DDTree verify. Reading the weights from memory is then
//! most of the cost, and it can be nearly the same for 16 rows as for 1 if each weight is read
//! once and used for every input row. candle's general matmul packs the weights on every call
//! and costs 1.5–3× more than that (docs/BENCHMARKS.md).
//!
//! [`Linear`] therefore multiplies an f32 CPU input that nothing differentiates (inference)
//! by a copy of its weights re-laid as panels ([`crate::cpu::panels`], AVX-512 or AVX2 + FMA +
//! F16C), made when the layer is built: the CPU inference of an f32 model holds its projection
//! weights twice, while a GGUF weight streamed from its quantized blocks is held once, as the
//! panels. A CPU with AVX2 + FMA but without the panels' ISA (no F16C) takes [`matmul_t`]'s
//! direct path for at most [`FEW_ROWS`] rows (tiles of 4 input rows × 2 weight rows over the
//! `[out, in]` layout); any other case (GPU, bf16, training with gradients, a CPU with no vector kernel) is
//! candle's matmul, unchanged.
//!
//! Example: SmolLM2's `up_proj` `W` `[1536, 576]` and 16 verify rows `x` `[16, 576]`: on an
//! AVX-512 CPU, 96 panels of 16 columns, each computed for the 16 rows at once; the result is
//! `[16, 1536]`, equal to candle's matmul within f32 rounding (the sums run in another order).

use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device, Module, Result, Tensor};

use crate::cpu::panels::{Panels, SyncPtr};
use crate::cpu::quant::QuantBlocks;

/// The most rows [`matmul_t`]'s AVX2 path takes; more rows are candle's matmul (compute-bound).
pub const FEW_ROWS: usize = 32;

/// A projection `y = x · Wᵀ (+ b)`, `W` `[out, in]` as in the safetensors (`{name}.weight`).
/// Clones share the panels.
#[derive(Debug, Clone)]
pub struct Linear {
    /// The weight `[out, in]`; `None` where the panels stream it from quantized blocks (the
    /// weight is then held once, as the panels, and [`Linear::weight`] dequantizes it from them).
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    /// The weight as panels, when [`packable`].
    panels: Option<Arc<Panels>>,
}

impl Linear {
    /// A projection; on an AVX-512 or AVX2 CPU an f32 weight that nothing differentiates is re-laid as
    /// panels here, at load time (≈ 0.2 s for SmolLM2's 135 M weights on 2 cores), not in the
    /// first forward. (Reading the values cannot fail for a CPU tensor; if it did, the layer
    /// would keep candle's matmul, slower and equal.)
    /// With `DFLASH_CPU_QUANT=q8` the panels multiply 8-bit rows ([`Panels::pack`]).
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::packed(weight, bias, crate::cpu::q8::enabled())
    }

    /// [`Linear::new`] with exact f32 products whatever `DFLASH_CPU_QUANT` says (an LM head:
    /// its arg-max decides the tokens).
    pub fn new_exact(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::packed(weight, bias, false)
    }

    fn packed(weight: Tensor, bias: Option<Tensor>, integer: bool) -> Self {
        let panels = packable(&weight)
            .then(|| {
                let (n, k) = weight.dims2().ok()?;
                let values: Vec<f32> = weight.flatten_all().ok()?.to_vec1().ok()?;
                Some(Arc::new(match integer {
                    true => Panels::pack(&values, n, k),
                    false => Panels::pack_f32(&values, n, k),
                }))
            })
            .flatten();
        Self {
            weight: Some(weight),
            bias,
            panels,
        }
    }

    /// A projection from a weight's quantized blocks (a GGUF's, on the CPU): where the CPU
    /// runs the panels' kernels, the panels stream the blocks and `weight` is never called
    /// (the weight is held once, at about the GGUF's size); elsewhere [`Linear::new`] of
    /// `weight()`, its dequantization.
    /// With `DFLASH_CPU_QUANT=q8` the panels multiply 8-bit rows ([`Panels::pack_quantized`]).
    pub fn from_blocks(
        q: &QuantBlocks,
        bias: Option<Tensor>,
        weight: impl FnOnce() -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<Self> {
        Self::from_blocks_with(q, bias, weight, crate::cpu::q8::enabled())
    }

    /// [`Linear::from_blocks`] with exact products whatever `DFLASH_CPU_QUANT` says (an LM
    /// head).
    pub fn from_blocks_exact(
        q: &QuantBlocks,
        bias: Option<Tensor>,
        weight: impl FnOnce() -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<Self> {
        Self::from_blocks_with(q, bias, weight, false)
    }

    /// An LM head from its quantized blocks: [`Linear::from_blocks_exact`], but with
    /// `DFLASH_CPU_QUANT=q8` a Q8_0 (Q4_0, Q5_0) head multiplies 8-bit rows and recomputes
    /// exactly the columns that could be a row's arg-max ([`crate::cpu::screen`]): the same
    /// tokens at T = 0 as the exact products, the other logits within the screen's bound.
    pub fn from_blocks_head(
        q: &QuantBlocks,
        bias: Option<Tensor>,
        weight: impl FnOnce() -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<Self> {
        if crate::cpu::q8::enabled() && Panels::supported() {
            if let Some(p) = Panels::pack_screened(q) {
                return Ok(Self {
                    weight: None,
                    bias,
                    panels: Some(Arc::new(p)),
                });
            }
        }
        Self::from_blocks_exact(q, bias, weight)
    }

    fn from_blocks_with(
        q: &QuantBlocks,
        bias: Option<Tensor>,
        weight: impl FnOnce() -> anyhow::Result<Tensor>,
        integer: bool,
    ) -> anyhow::Result<Self> {
        Ok(if Panels::supported() {
            let panels = match integer {
                true => Panels::pack_integer(q),
                false => Panels::pack_exact(q),
            };
            Self {
                weight: None,
                bias,
                panels: Some(Arc::new(panels)),
            }
        } else {
            Self::packed(weight()?, bias, false)
        })
    }

    /// Bytes a product reads from the weight: the panels' stream where there are panels,
    /// else the weight tensor's size.
    pub fn weight_bytes_read(&self) -> usize {
        match (&self.panels, &self.weight) {
            (Some(p), _) => p.stream_bytes(),
            (None, Some(w)) => w.elem_count() * w.dtype().size_in_bytes(),
            (None, None) => 0,
        }
    }

    /// Bytes the layer holds for its weight: the tensor's (where held) and the panels'.
    pub fn weight_bytes_held(&self) -> usize {
        let dense = self
            .weight
            .as_ref()
            .map_or(0, |w| w.elem_count() * w.dtype().size_in_bytes());
        dense + self.panels.as_ref().map_or(0, |p| p.resident_bytes())
    }

    /// The panels, where the layer has them (the quantized LM head's serve the tied
    /// embedding's rows).
    pub fn panels(&self) -> Option<&Arc<Panels>> {
        self.panels.as_ref()
    }

    /// The layer over output rows `ids` only (a drafter's vocabulary head): row `j` of its
    /// weight is row `ids[j]` of this one's, the same values, so its outputs are the same bits.
    /// A quantized layer's rows are dequantized from the panels (not the whole weight).
    pub fn select_rows(&self, ids: &[u32]) -> Result<Linear> {
        let bias = match &self.bias {
            Some(b) => Some(b.index_select(&Tensor::new(ids, b.device())?, 0)?),
            None => None,
        };
        // the rows multiply as this layer's do (integer or exact products)
        let integer = self.panels.as_ref().is_some_and(|p| p.is_integer());
        match (&self.weight, &self.panels) {
            (Some(w), _) => {
                let idx = Tensor::new(ids, w.device())?;
                let rows = w.index_select(&idx, 0)?.contiguous()?;
                Ok(Linear::packed(rows, bias, integer))
            }
            (None, Some(p)) => {
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= p.out_features()) {
                    candle_core::bail!("Linear::select_rows: row {id} of {}", p.out_features());
                }
                if let Some(sel) = p.select_rows(ids) {
                    // the same Q8_0 blocks (the head's own values), at their size
                    return Ok(Linear {
                        weight: None,
                        bias,
                        panels: Some(Arc::new(sel)),
                    });
                }
                let k = p.in_features();
                let mut w = vec![0f32; ids.len() * k];
                for (row, &id) in w.chunks_mut(k.max(1)).zip(ids) {
                    p.row_into(id as usize, row);
                }
                Ok(Linear::packed(
                    Tensor::from_vec(w, (ids.len(), k), &Device::Cpu)?,
                    bias,
                    integer,
                ))
            }
            (None, None) => candle_core::bail!("Linear: neither a weight nor panels"),
        }
    }

    /// The held weight tensor `[out, in]`, with or without a bias (`None` where only panels
    /// hold it).
    pub fn held_weight(&self) -> Option<&Tensor> {
        self.weight.as_ref()
    }

    /// The bias, where the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The layer on the same weight and bias without their graph. Panels are kept: only
    /// weights that carry no graph have them (a trainer's never do), so they are never stale.
    pub fn detached(&self) -> Linear {
        Linear {
            weight: self.weight.as_ref().map(Tensor::detach),
            bias: self.bias.as_ref().map(Tensor::detach),
            panels: self.panels.clone(),
        }
    }

    /// Whether the CPU panels stream this weight from quantized blocks.
    pub fn is_quantized(&self) -> bool {
        self.panels.as_ref().is_some_and(|p| p.is_quantized())
    }

    /// The held weight tensor when the layer is exactly `x · Wᵀ` (no bias; not panels only):
    /// what a fused consumer of the product needs ([`crate::ops::cross_entropy::linear_cross_entropy_rows`]).
    pub fn plain_weight(&self) -> Option<&Tensor> {
        match (&self.weight, &self.bias) {
            (Some(w), None) => Some(w),
            _ => None,
        }
    }

    /// Projections of one input stacked into one, on a GPU: their weights (and biases)
    /// concatenated along the output, and each part again as a view of the stacked weight (the
    /// weight is held once). One product then reads every part's weight in one GEMM instead
    /// of one launch (and cuBLAS's split-K reduction) each. `None` unless every part holds a
    /// plain weight on a CUDA device (no panels), of one dtype and input width, every part with
    /// a bias or none. Example: Qwen3-8B's q, k and v (`[4096, 4096]`, `[1024, 4096]` twice) →
    /// `[6144, 4096]`, and q = its rows 0..4096.
    pub fn stack(parts: &[&Linear]) -> Result<Option<(Linear, Vec<Linear>)>> {
        let weights: Option<Vec<&Tensor>> = parts
            .iter()
            .map(|p| p.weight.as_ref().filter(|_| p.panels.is_none()))
            .collect();
        let Some(weights) = weights else {
            return Ok(None);
        };
        let Some(first) = weights.first() else {
            return Ok(None);
        };
        let width = first.dim(1)?;
        let same = weights.iter().all(|w| {
            w.device().is_cuda()
                && w.rank() == 2
                && w.dtype() == first.dtype()
                && w.dim(1).ok() == Some(width)
                && !w.track_op()
        });
        let biased = parts.iter().filter(|p| p.bias.is_some()).count();
        if !same || (biased != 0 && biased != parts.len()) {
            return Ok(None);
        }
        let w = Tensor::cat(&weights, 0)?;
        let b = if biased > 0 {
            let bs: Vec<&Tensor> = parts.iter().filter_map(|p| p.bias.as_ref()).collect();
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        let mut views = Vec::with_capacity(parts.len());
        let mut at = 0;
        for part in &weights {
            let rows = part.dim(0)?;
            views.push(Linear {
                weight: Some(w.narrow(0, at, rows)?),
                bias: b.as_ref().map(|b| b.narrow(0, at, rows)).transpose()?,
                panels: None,
            });
            at += rows;
        }
        let stacked = Linear {
            weight: Some(w),
            bias: b,
            panels: None,
        };
        Ok(Some((stacked, views)))
    }

    /// The weight `[out, in]`: the tensor, or where the layer holds only quantized panels
    /// their dequantization, made on each call (the loader's values, bit for bit).
    pub fn weight(&self) -> Result<Tensor> {
        match (&self.weight, &self.panels) {
            (Some(w), _) => Ok(w.clone()),
            (None, Some(p)) => {
                Tensor::from_vec(p.dense(), (p.out_features(), p.in_features()), &Device::Cpu)
            }
            (None, None) => candle_core::bail!("Linear: neither a weight nor panels"),
        }
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

/// A weight the panels take: a 2-D f32 CPU tensor that nothing differentiates, on a CPU that
/// runs the panels' kernels ([`Panels::supported`]).
fn packable(w: &Tensor) -> bool {
    matches!(w.device(), Device::Cpu)
        && w.dtype() == DType::F32
        && w.rank() == 2
        && !w.track_op()
        && Panels::supported()
}

impl Linear {
    /// The weight's format as the products read it: the panels' ([`Panels::format`]) or
    /// "tensor" (candle's matmul or [`matmul_t`]).
    pub fn format(&self) -> &'static str {
        self.panels.as_ref().map_or("tensor", |p| p.format())
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

fn few_rows_path(x: &Tensor, w: &Tensor, rows: usize) -> bool {
    matches!(x.device(), Device::Cpu)
        && rows <= FEW_ROWS
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && w.rank() == 2
        && w.is_contiguous()
        && !x.track_op()
        && !w.track_op()
        && avx2_fma()
}

/// Whether this CPU has AVX2 and FMA (the direct path of [`matmul_t`]), detected once.
fn avx2_fma() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

fn few_rows_matmul(x: &Tensor, w: &Tensor, rows: usize, k: usize) -> Result<Tensor> {
    let n = w.dim(0)?;
    if w.dim(1)? != k {
        candle_core::bail!("matmul_t: input width {k} vs weight {:?}", w.dims());
    }
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (candle_core::Storage::Cpu(xc), candle_core::Storage::Cpu(wc)) = (&*xs, &*ws) else {
        candle_core::bail!("matmul_t: CPU tensors expected")
    };
    let xv = crate::ops::kernel_io::cpu_slice::<f32>(xc, xl, "matmul_t input")?;
    let wv = crate::ops::kernel_io::cpu_slice::<f32>(wc, wl, "matmul_t weight")?;
    let mut y = vec![0f32; rows * n];
    if !avx2_fma() {
        candle_core::bail!("matmul_t: this CPU lacks AVX2+FMA")
    }
    few_rows_into(xv, wv, rows, k, n, &mut y);
    Tensor::from_vec(y, (rows, n), &Device::Cpu)
}

/// `y[rows, n] = x[rows, k] · w[n, k]ᵀ`, weight rows split over [`crate::cpu::helpers`].
fn few_rows_into(x: &[f32], w: &[f32], rows: usize, k: usize, n: usize, y: &mut [f32]) {
    // chunks of weight rows, a multiple of 4 so that every chunk but the last is made of whole
    // tiles, on the calling thread and crate::cpu::helpers (as Panels::matmul)
    let chunk = 16;
    let out = SyncPtr(y.as_mut_ptr());
    let run = |range: std::ops::Range<usize>| {
        // writes go through the raw pointer, never a `&mut` over all of y: each chunk writes
        // only the columns j0..j1 of y, disjoint from the other chunks'; y outlives the call
        let y = out.ptr();
        let (j0, j1) = (range.start * chunk, (range.end * chunk).min(n));
        // SAFETY: callers checked avx2_fma(); y holds rows × n values
        #[cfg(target_arch = "x86_64")]
        unsafe {
            avx2::columns(x, w, rows, k, n, j0, j1, y)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (x, w, k, j0, j1, y);
    };
    if rows * n * k < crate::cpu::panels::INLINE_FMAS {
        run(0..n.div_ceil(chunk));
    } else {
        crate::cpu::helpers::for_each_chunk(n.div_ceil(chunk), &|c| run(c..c + 1));
    }
}

/// The tiling of columns `j0..j1` shared by the kernels: tiles of 4 input rows × `J` weight
/// rows, the leftover input rows one at a time, then the leftover weight rows one at a time.
/// `tile(r, c, i, j)` computes `y[i..i+r, j..j+c]`. Example: 6 rows, columns 0..9, `J = 4`:
/// (4, 4, 0, 0), (1, 4, 4, 0), (1, 4, 5, 0), then the same at column 4, then (4, 1, 0, 8),
/// (1, 1, 4, 8), (1, 1, 5, 8).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn tiles<const J: usize>(
    rows: usize,
    j0: usize,
    j1: usize,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let mut j = j0;
    while j < j1 {
        let c = if j + J <= j1 { J } else { 1 };
        let mut i = 0;
        while i < rows {
            let r = if i + 4 <= rows { 4 } else { 1 };
            tile(r, c, i, j);
            i += r;
        }
        j += c;
    }
}

/// `pub unsafe fn columns(x, w, rows, k, n, j0, j1, y)` of a kernel module: columns `j0..j1`
/// of `y` (all rows) in the tiles of [`tiles`] with `$j` weight rows, each computed by the
/// module's `tile::<R, J>` (compiled for `$feature`).
#[cfg(target_arch = "x86_64")]
macro_rules! columns_over_tiles {
    ($j:literal, $feature:literal) => {
        #[target_feature(enable = $feature)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn columns(
            x: &[f32],
            w: &[f32],
            rows: usize,
            k: usize,
            n: usize,
            j0: usize,
            j1: usize,
            y: *mut f32,
        ) {
            super::tiles::<$j>(rows, j0, j1, |r, c, i, j| match (r, c) {
                (4, $j) => tile::<4, $j>(x, w, k, n, i, j, y),
                (4, _) => tile::<4, 1>(x, w, k, n, i, j, y),
                (_, $j) => tile::<1, $j>(x, w, k, n, i, j, y),
                _ => tile::<1, 1>(x, w, k, n, i, j, y),
            });
        }
    };
}
#[cfg(target_arch = "x86_64")]
use columns_over_tiles;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    super::columns_over_tiles!(2, "avx2,fma");

    /// `y[i0..i0+R, j0..j0+J]`: R input rows against J weight rows, 8 lanes at a time, the
    /// tail of `k` (k mod 8) in scalar.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const J: usize>(
        x: &[f32],
        w: &[f32],
        k: usize,
        n: usize,
        i0: usize,
        j0: usize,
        y: *mut f32,
    ) {
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); J]; R];
        let k8 = k - k % 8;
        let mut kk = 0;
        while kk < k8 {
            let mut wv = [_mm256_setzero_ps(); J];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(wp.add((j0 + c) * k + kk));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(xp.add((i0 + r) * k + kk));
                for c in 0..J {
                    a[c] = _mm256_fmadd_ps(xv, wv[c], a[c]);
                }
            }
            kk += 8;
        }
        for (r, a) in acc.iter().enumerate() {
            for c in 0..J {
                let mut s = hsum(a[c]);
                for t in k8..k {
                    s += x[(i0 + r) * k + t] * w[(j0 + c) * k + t];
                }
                *y.add((i0 + r) * n + j0 + c) = s;
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stacking needs plain weights on a GPU: on the CPU (panels, or f32 tensors) nothing is
    /// stacked and the layers keep their own weights.
    #[test]
    fn stacking_is_for_gpu_weights_only() {
        let w = |o: usize| Tensor::ones((o, 8), DType::F32, &Device::Cpu).unwrap();
        let (a, b) = (Linear::new(w(4), None), Linear::new(w(2), None));
        assert!(Linear::stack(&[&a, &b]).unwrap().is_none());
        assert!(Linear::stack(&[]).unwrap().is_none());
    }

    fn reference(x: &Tensor, w: &Tensor) -> Tensor {
        let k = w.dim(1).unwrap();
        let lead = x.dims()[..x.rank() - 1].to_vec();
        let rows: usize = lead.iter().product();
        let y = x
            .reshape((rows, k))
            .unwrap()
            .matmul(&w.t().unwrap())
            .unwrap();
        let mut shape = lead;
        shape.push(w.dim(0).unwrap());
        y.reshape(shape).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        crate::ops::compare::max_abs(a, b).unwrap()
    }

    /// `matmul_t`'s AVX2 path and `Linear` (the panels on an AVX-512 or AVX2 CPU) = candle's matmul:
    /// rows 1..=33 (tiles of 4, the rest single rows; 33 is over the AVX2 path's limit), weight
    /// rows not a multiple of 2 or 16 (leftover columns), widths not a multiple of 8 (the tails).
    #[test]
    fn few_rows_equal_candles_matmul() {
        let dev = Device::Cpu;
        for &(n, k) in &[(37usize, 21usize), (64, 576), (5, 8)] {
            let w = Tensor::randn(0f32, 1., (n, k), &dev).unwrap();
            for rows in [1usize, 2, 3, 4, 5, 7, 16, 32, 33] {
                let x = Tensor::randn(0f32, 1., (1, rows, k), &dev).unwrap();
                let direct = rows <= FEW_ROWS && avx2_fma();
                assert_eq!(few_rows_path(&x, &w, rows), direct);
                let want = reference(&x, &w);
                let got = matmul_t(&x, &w).unwrap();
                assert_eq!(got.dims(), &[1, rows, n]);
                let tol = 1e-4 * (k as f32).sqrt();
                assert!(max_diff(&got, &want) < tol, "n {n} k {k} rows {rows}");
                // Linear: the panels where the CPU runs them, else the same as matmul_t
                let got = Linear::new(w.clone(), None).forward(&x).unwrap();
                assert_eq!(got.dims(), &[1, rows, n]);
                let err = max_diff(&got, &want);
                assert!(err < tol, "Linear n {n} k {k} rows {rows}: {err}");
            }
        }
    }

    /// Gradients still flow: a tracked input takes candle's matmul.
    #[test]
    fn tracked_inputs_take_candles_matmul() {
        let dev = Device::Cpu;
        let w = candle_core::Var::randn(0f32, 1., (6, 8), &dev).unwrap();
        let x = Tensor::randn(0f32, 1., (2, 8), &dev).unwrap();
        assert!(!few_rows_path(&x, w.as_tensor(), 2));
        let g = matmul_t(&x, w.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let dw = g.get(w.as_tensor()).unwrap();
        // d/dW of Σ x·Wᵀ = column sums of x, for every weight row
        let want = x.sum_keepdim(0).unwrap().broadcast_as((6, 8)).unwrap();
        let err = (dw - want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(err.to_scalar::<f32>().unwrap() < 1e-5);
    }

    /// A layer that streams quantized panels holds no f32 weight, and still gives it: `weight()`
    /// (dequantized from the panels), `select_rows` (its Q8_0 blocks, the same bits as the full
    /// layer's columns)
    /// and a tracked input's forward (candle's matmul of the dequantized weight).
    #[test]
    fn a_quantized_layer_holds_its_weight_once() {
        use crate::cpu::quant::{QuantKind, Q8_0_BYTES};
        let (n, k) = (20usize, 64usize);
        let bytes: Vec<u8> = (0..n * k / 32 * Q8_0_BYTES)
            .map(|i| match i % Q8_0_BYTES {
                0 => 0x00,
                1 => 0x2c, // d = 0.0625
                j => (j * 37 + i / Q8_0_BYTES) as u8,
            })
            .collect();
        let q = QuantBlocks::new(QuantKind::Q8_0, n, k, bytes).unwrap();
        let values: Vec<f32> = (0..n * k).map(|i| q.value(i / k, i % k)).collect();
        let dense = Tensor::from_vec(values.clone(), (n, k), &Device::Cpu).unwrap();
        let l = Linear::from_blocks(&q, None, || Ok(dense.clone())).unwrap();
        if !Panels::supported() {
            return; // no panels on this CPU: the dense layer
        }
        assert!(l.is_quantized() && l.weight.is_none());
        let w: Vec<f32> = l
            .weight()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(w
            .iter()
            .zip(&values)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        let x = Tensor::randn(0f32, 1., (3, k), &Device::Cpu).unwrap();
        let full: Vec<Vec<f32>> = l.forward(&x).unwrap().to_vec2().unwrap();
        let ids = [7u32, 0, 19];
        let sel = l.select_rows(&ids).unwrap();
        // the rows keep their Q8_0 blocks: one panel of 16 columns, 32 + 32 × 16 bytes per block
        assert!(sel.is_quantized() && sel.weight_bytes_held() == k / 32 * (32 + 32 * 16));
        let part: Vec<Vec<f32>> = sel.forward(&x).unwrap().to_vec2().unwrap();
        for (fr, pr) in full.iter().zip(&part) {
            for (j, &id) in ids.iter().enumerate() {
                assert_eq!(fr[id as usize].to_bits(), pr[j].to_bits());
            }
        }
        assert!(l.select_rows(&[20]).is_err());
        let v = candle_core::Var::from_tensor(&x).unwrap();
        let tracked = l.forward(v.as_tensor()).unwrap();
        assert!(max_diff(&tracked, &reference(&x, &dense)) < 1e-4);
    }

    /// A non-contiguous input (a narrow of the middle columns) is made contiguous first.
    #[test]
    fn strided_input() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (9, 16), &dev).unwrap();
        let big = Tensor::randn(0f32, 1., (3, 20), &dev).unwrap();
        let x = big.narrow(1, 2, 16).unwrap();
        let err = (matmul_t(&x, &w).unwrap() - reference(&x.contiguous().unwrap(), &w))
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(err.to_scalar::<f32>().unwrap() < 1e-4);
    }

    /// The GPU's training path (one node, written backward) gives candle's autograd's
    /// gradients, for a 3-d input and both inputs tracked (run here on the CPU).
    #[test]
    fn tracked_path_has_candles_gradients() {
        let dev = Device::Cpu;
        let var = |t: Tensor| candle_core::Var::from_tensor(&t).unwrap();
        let x = var(Tensor::randn(0f32, 1., (2, 5, 7), &dev).unwrap());
        let w = var(Tensor::randn(0f32, 1., (3, 7), &dev).unwrap());
        let up = Tensor::randn(0f32, 1., (2, 5, 3), &dev).unwrap();
        let grads = |y: Tensor| {
            let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
            (
                g.get(x.as_tensor()).unwrap().clone(),
                g.get(w.as_tensor()).unwrap().clone(),
            )
        };
        let ours = tracked_matmul_t(x.as_tensor(), w.as_tensor(), 10, 7, vec![2, 5, 3]).unwrap();
        let want = x
            .as_tensor()
            .broadcast_matmul(&w.as_tensor().t().unwrap())
            .unwrap();
        assert!(max_diff(&ours, &want) < 1e-5);
        let (a, b) = (grads(ours), grads(want));
        assert_eq!(a.0.dims(), &[2, 5, 7]);
        assert!(max_diff(&a.0, &b.0) < 1e-5 && max_diff(&a.1, &b.1) < 1e-5);
        // one operand frozen: the other's gradient alone
        let frozen = w.as_tensor().detach();
        let y = tracked_matmul_t(x.as_tensor(), &frozen, 10, 7, vec![2, 5, 3]).unwrap();
        let g = (y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(max_diff(g.get(x.as_tensor()).unwrap(), &b.0) < 1e-5);
        let y = tracked_matmul_t(&x.as_tensor().detach(), w.as_tensor(), 10, 7, vec![2, 5, 3]);
        let g = (y.unwrap() * &up)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(max_diff(g.get(w.as_tensor()).unwrap(), &b.1) < 1e-5);
    }
}
