//! A drafter forward's host side: the rows' positions and RoPE rows, a mask per distinct layer
//! rule (training's parts or fused intervals, inference's whole mask), and the last layer's
//! rows; then [`Drafter::layers_forward`].

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use dflash_core::visibility::{draft_inference, draft_training_parts, DraftRule, Visibility};

use super::{tape, DraftLayout, Drafter, KvWrite, LastRows, LayerMask};
use crate::cache::kv_cache::KvCache;
use crate::cpu::row_attention::{self, KeyRuns};
use crate::layers::attention::mask_tensor;
use crate::layers::rope::RopeTables;
use crate::ops::block_attention::context_windows;
use crate::ops::train_attention::{self, TrainIntervals};

/// Row × key cells per training attention window (`window_bounds`) on a GPU. Each window costs
/// a fixed number of kernel launches; each cell past a row's own context is wasted work. On a
/// GPU launches cost more than wasted cells, so windows are large (`docs/BENCHMARKS.md`, the
/// training step at the Qwen3-8B shape).
const WINDOW_CELLS_GPU: usize = 1 << 22;
/// The same on the CPU, where launches cost nothing and wasted cells cost FLOPs.
const WINDOW_CELLS_CPU: usize = 1 << 20;

/// [`WINDOW_CELLS_GPU`] or [`WINDOW_CELLS_CPU`] for `device`, or the runtime configuration's
/// `tuning.window_cells` (`DFLASH_WINDOW_CELLS`, for measuring the trade-off).
fn window_cells(device: &Device) -> usize {
    let set = dflash_core::runtime::current().tuning.window_cells;
    set.unwrap_or(if device.is_cpu() {
        WINDOW_CELLS_CPU
    } else {
        WINDOW_CELLS_GPU
    })
}

/// A mask per distinct layer rule.
type RuleMasks = Vec<(DraftRule, LayerMask)>;
/// Each distinct layer rule's visibility (inference: for the last layer's rows).
type RuleVisibilities = Vec<(DraftRule, Visibility)>;

impl Drafter {
    /// The one drafter forward. `ctx_taps`: `[1, m, L*h]` concatenated taps of the new
    /// context rows; `block_emb`: `[1, nb, h]`. Returns the normed block hidden states
    /// `[1, nb, h]`.
    pub fn forward(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        layout: DraftLayout<'_>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        Ok(self
            .forward_inner(ctx_taps, block_emb, layout, cache, None, None)?
            .0)
    }

    /// [`Self::forward`] (no cache) keeping what the taped backward reads in `rec`; also
    /// returns the RoPE rows of the context then the block rows.
    pub(super) fn forward_recorded(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        layout: DraftLayout<'_>,
        rec: &mut tape::Recorder,
    ) -> Result<(Tensor, RopeTables)> {
        self.forward_inner(ctx_taps, block_emb, layout, None, Some(rec), None)
    }

    /// `out_rows`: the block rows to return (all of them when `None`); at inference the last
    /// layer runs on them alone where it can ([`LastRows`]).
    pub(super) fn forward_inner(
        &self,
        ctx_taps: &Tensor,
        block_emb: &Tensor,
        layout: DraftLayout<'_>,
        cache: Option<&mut KvCache>,
        rec: Option<&mut tape::Recorder>,
        out_rows: Option<std::ops::Range<usize>>,
    ) -> Result<(Tensor, RopeTables)> {
        let m = ctx_taps.dim(1)?;
        let nb = block_emb.dim(1)?;
        let cache_len = cache.as_ref().map(|c| c.len()).unwrap_or(0);
        let ctx_positions = context_positions(layout, cache_len, cache.is_some(), m, nb)?;
        let block_positions = layout.block_positions();
        let dtype = block_emb.dtype();
        let device = block_emb.device();
        let mut all_pos = ctx_positions.clone();
        all_pos.extend_from_slice(&block_positions);
        let rope_kv = self.rope.tables(&all_pos, dtype, device)?;
        let (masks, visible) = self.layer_masks(layout, m, dtype, device)?;
        let last = self.last_rows(layout, out_rows.clone(), &visible, dtype, device)?;
        let write = match cache {
            Some(c) => KvWrite::Append(c),
            None => KvWrite::None,
        };
        let out = self.layers_forward(
            ctx_taps,
            block_emb,
            layout.block(),
            &rope_kv,
            &masks,
            write,
            rec,
            last.as_ref(),
        )?;
        // the rows asked for, whether the last layer ran on them alone or on the whole block
        let out = match (out_rows, &last) {
            (Some(r), None) => out.narrow(1, r.start, r.len())?,
            _ => out,
        };
        Ok((out, rope_kv))
    }

    /// A mask per distinct layer rule, and (inference) each rule's visibility.
    fn layer_masks(
        &self,
        layout: DraftLayout<'_>,
        m: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(RuleMasks, RuleVisibilities)> {
        // masks per distinct rule, from the shared visibility rule: training uses the two
        // visible parts (context, own block), inference the whole [cache | block] mask
        let mut masks: Vec<(DraftRule, LayerMask)> = Vec::new();
        // inference: each rule's visibility, for the last layer's rows ([`LastRows`])
        let mut visible: Vec<(DraftRule, Visibility)> = Vec::new();
        for l in &self.layers {
            if !masks.iter().any(|(r, _)| *r == l.rule) {
                let lm = match layout {
                    DraftLayout::Training {
                        segs,
                        anchors,
                        block,
                    } => {
                        let (c, o) = draft_training_parts(l.rule, segs, anchors, block);
                        if train_attention::takes(device, dtype, l.self_attn.head_dim) {
                            // the fused kernels: each row's two intervals, no windows
                            LayerMask::Fused(TrainIntervals::new(&c, &o, block, m, device)?)
                        } else {
                            // windows: the blocks of one sequence, window_cells(device) at a
                            // time, score only the context keys their rows may see
                            let group: Vec<usize> =
                                anchors.iter().map(|&a| segs.segment_of(a)).collect();
                            let context = context_windows(
                                &c,
                                &o,
                                block,
                                &group,
                                window_cells(device),
                                m,
                                device,
                            )?;
                            LayerMask::Parts { context, block }
                        }
                    }
                    DraftLayout::Inference { anchor, block } => {
                        let v = draft_inference(l.rule, anchor, block);
                        let runs = row_attention::serves(device, dtype, 1, block)
                            .then(|| KeyRuns::new(&v));
                        let lm = LayerMask::Dense(mask_tensor(&v, dtype, device)?, runs);
                        visible.push((l.rule, v));
                        lm
                    }
                };
                masks.push((l.rule, lm));
            }
        }
        Ok((masks, visible))
    }

    /// For fewer output rows than the block's ([`LastRows`]): the last layer's own mask for them
    /// (a conv mixes the block's rows, so a DFlash2 layer keeps them all).
    fn last_rows(
        &self,
        layout: DraftLayout<'_>,
        out_rows: Option<std::ops::Range<usize>>,
        visible: &[(DraftRule, Visibility)],
        dtype: DType,
        device: &Device,
    ) -> Result<Option<LastRows>> {
        Ok(match (layout, out_rows, self.layers.last()) {
            (DraftLayout::Inference { block, .. }, Some(r), Some(l))
                if r.end <= block
                    && r != (0..block)
                    && !dflash_core::runtime::off(dflash_core::runtime::Kernel::DraftLastRows)
                    && l.attention_conv.is_none()
                    && l.mlp_conv.is_none() =>
            {
                let whole = &visible.iter().find(|(rule, _)| *rule == l.rule).unwrap().1;
                let v = whole.select_rows(r.clone());
                let runs =
                    row_attention::serves(device, dtype, 1, r.len()).then(|| KeyRuns::new(&v));
                Some(LastRows {
                    mask: LayerMask::Dense(mask_tensor(&v, dtype, device)?, runs),
                    rows: r,
                })
            }
            _ => None,
        })
    }
}

/// The positions of a forward's `m` new context rows: `cache_len .. anchor` at inference (a
/// cache, then a block of `nb` rows at the anchor), each sequence's own in training (no cache);
/// an error where the rows do not fit the layout.
fn context_positions(
    layout: DraftLayout<'_>,
    cache_len: usize,
    cached: bool,
    m: usize,
    nb: usize,
) -> Result<Vec<usize>> {
    Ok(match layout {
        DraftLayout::Inference { anchor, block } => {
            if cache_len + m != anchor || nb != block {
                bail!(
                    "draft inference: cache {cache_len} + context {m} rows must end at the anchor {anchor}, block {nb} must be {block}"
                );
            }
            (cache_len..anchor).collect()
        }
        DraftLayout::Training {
            segs,
            anchors,
            block,
        } => {
            if cached || m != segs.len() || nb != anchors.len() * block {
                bail!(
                    "draft training: no cache, {} context rows and {} block rows expected",
                    segs.len(),
                    anchors.len() * block
                );
            }
            segs.positions()
        }
    })
}
