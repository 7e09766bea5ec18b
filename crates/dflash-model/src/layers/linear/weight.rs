//! What a layer holds of its weight: its sizes, panels and bias, a layer over some of its
//! rows, projections stacked into one, the weight as a tensor.

use std::sync::Arc;

use candle_core::{Device, Result, Tensor};

use super::Linear;
use crate::cpu::panels::Panels;

impl Linear {
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
}
