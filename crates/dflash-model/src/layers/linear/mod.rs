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

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::cpu::panels::Panels;
use crate::cpu::quant::QuantBlocks;

mod few_rows;
mod forward;
#[cfg(test)]
mod tests;
mod weight;

pub use forward::matmul_t;

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
