//! The host side of a forward ([`Target::prepare`]): token ids, RoPE rows, the attention
//! rule (one key interval per row, an additive mask, or each row's key runs) and, for hybrid
//! targets, each new row's parent, copied to the device once.

use std::ops::Range;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use dflash_core::visibility::Visibility;

use super::{Mixer, Target};
use crate::cache::kv_cache::KvCache;
use crate::cpu::row_attention::{self, KeyRuns};
use crate::layers::attention::{mask_tensor_cols, mask_tensors};
use crate::layers::gdn::GdnRowsInput;
use crate::layers::rope::RopeTables;
use crate::ops::interval_softmax::RowIntervals;

/// The parent of each new row for linear-attention layers: its nearest visible earlier new
/// row under the mask (causal: the previous row; tree: its parent node), `None` for a row
/// that sees no earlier new row.
pub(super) fn parents_from_mask(mask: &Visibility, cache_len: usize) -> Vec<Option<usize>> {
    (0..mask.rows)
        .map(|i| (0..i).rev().find(|&j| mask.get(i, cache_len + j)))
        .collect()
}

/// [`parents_from_mask`] of one sequence's rows given as key intervals over `[cache | new]`: a
/// row's nearest visible earlier new row is the one before it when its interval reaches it (an
/// interval has no gaps). Example: cache 0, intervals `[0..1, 1..2, 2..3, 2..4]` (two padding
/// rows, then a chain of two) → `[-, -, -, 2]`.
fn parents_from_intervals(rows: &[Range<usize>], cache_len: usize) -> Vec<Option<usize>> {
    (0..rows.len())
        .map(|r| (r > 0 && rows[r].contains(&(cache_len + r - 1))).then(|| r - 1))
        .collect()
}

/// A forward's inputs on the device ([`Target::prepare`]).
pub struct ForwardInputs {
    /// Token ids `[b · n]`.
    pub(super) ids: Tensor,
    pub(super) rope: RopeTables,
    /// The attention rule: one interval of keys per row where every row has one (the fused
    /// softmax), else the additive mask `[n, cache + n]` (one sequence) or
    /// `[b, 1, 1, n, cache + n]` in the compute dtype of the attention scores (f32; f64 for f64
    /// models). The fixed layout of one sequence has the additive mask `[n, cap]`, of several
    /// sequences their intervals over `cap` columns (the captured buffers).
    pub(super) mask: AttnMask,
    /// Each row's visible keys, for [`crate::cpu::row_attention`] (f32 CPU inference of one
    /// sequence with at most [`crate::cpu::row_attention::MAX_ROWS`] rows; else `None`).
    pub(super) runs: Option<KeyRuns>,
    /// The new rows as linear-attention layers read them: each row's parent and conv window
    /// (hybrid targets only).
    pub(super) gdn: Option<GdnRowsInput>,
    pub(super) b: usize,
    pub(super) n: usize,
    /// The cache length the mask was built for.
    pub(super) cache_len: usize,
    pub(super) layout: CacheLayout,
}

impl ForwardInputs {
    /// Rows per sequence.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Whether the attention reads each row's interval of keys (not an additive mask).
    pub fn has_intervals(&self) -> bool {
        matches!(self.mask, AttnMask::Intervals(_))
    }

    /// The kind of attention rule these inputs carry (a captured forward replays only inputs
    /// of its own kind).
    pub fn mask_kind(&self) -> &'static str {
        self.mask.kind()
    }

    /// Each new row's linear-attention parent (hybrid targets; `None` otherwise).
    pub fn linear_parents(&self) -> Option<&[Option<usize>]> {
        self.gdn.as_ref().map(|g| g.parents.as_slice())
    }

    /// Write `ids` (`[k]` u32, on the inputs' device) over the token ids of rows `from ..
    /// from + k` of one sequence, in place: tokens that never visited the host (a chain's
    /// drafts, the drafter's arg-max). Example: tokens [x, 0, 0, 0] prepared, then
    /// `set_ids(1, [a, b, c])` → the forward reads [x, a, b, c].
    pub fn set_ids(&mut self, from: usize, ids: &Tensor) -> Result<()> {
        let k = ids.dims1()?;
        if self.b != 1 || from + k > self.n {
            bail!(
                "set_ids: {k} ids from row {from} of {} sequence(s) of {} rows",
                self.b,
                self.n
            );
        }
        self.ids
            .slice_set(&ids.to_dtype(self.ids.dtype())?, 0, from)?;
        Ok(())
    }

    /// Copy these fixed-layout inputs into `dst`'s device buffers, in place (the buffers a
    /// captured forward reads): same row count and capacity, another cache length.
    /// Example: the AR step at cache 40 captured; `prepare(.., 41, Some(cap)).write_into(&mut
    /// captured)` makes a replay compute the step at cache 41.
    pub fn write_into(&self, dst: &mut ForwardInputs) -> Result<()> {
        let (CacheLayout::Fixed { index: si, cap: sc }, CacheLayout::Fixed { index: di, cap: dc }) =
            (&self.layout, &dst.layout)
        else {
            bail!("write_into: both inputs must have the fixed layout");
        };
        if sc != dc || self.n != dst.n || self.b != dst.b {
            bail!(
                "write_into: {} rows at capacity {sc} into buffers of {} rows at capacity {dc}",
                self.n,
                dst.n
            );
        }
        for (src, d) in [
            (&self.ids, &dst.ids),
            (&self.rope.cos, &dst.rope.cos),
            (&self.rope.sin, &dst.rope.sin),
            (si, di),
        ] {
            d.slice_set(src, 0, 0)?;
        }
        match (&self.mask, &mut dst.mask) {
            (AttnMask::Additive(s), AttnMask::Additive(d)) => d.slice_set(s, 0, 0)?,
            (AttnMask::Intervals(s), AttnMask::Intervals(d)) => s.write_into(d)?,
            (
                AttnMask::Tree {
                    additive: sa,
                    iv: si,
                },
                AttnMask::Tree {
                    additive: da,
                    iv: di,
                },
            ) => {
                da.slice_set(sa, 0, 0)?;
                si.write_into(di)?;
            }
            (s, d) => bail!("write_into: {} into {}", s.kind(), d.kind()),
        }
        match (&self.gdn, &mut dst.gdn) {
            (Some(src), Some(d)) => src.write_into(d)?,
            (None, None) => {}
            _ => bail!("write_into: inputs of another target"),
        }
        // the rows' key runs are the host's (the CPU's attention reads them, no graph does)
        dst.runs.clone_from(&self.runs);
        dst.cache_len = self.cache_len;
        Ok(())
    }
}

/// A forward's attention rule on the device ([`ForwardInputs`]).
#[derive(Debug, Clone)]
pub(super) enum AttnMask {
    Additive(Tensor),
    Intervals(RowIntervals),
    /// A tree's verify of one sequence on a CUDA device in bf16: each row's interval and window
    /// for the tree kernel ([`crate::ops::interval_attention::fused_tree`]) where it serves,
    /// the additive mask elsewhere (the same rows).
    Tree {
        additive: Tensor,
        iv: RowIntervals,
    },
}

impl AttnMask {
    /// The variant's name, for messages and for matching a captured forward's.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            AttnMask::Additive(_) => "an additive mask",
            AttnMask::Intervals(_) => "key intervals",
            AttnMask::Tree { .. } => "a tree's windows",
        }
    }
}

/// Which keys each query row of a forward sees: the mask, and each row's key runs where
/// [`crate::cpu::row_attention`] runs the attention.
#[derive(Clone, Copy)]
pub(super) struct Keys<'a> {
    pub(super) mask: &'a AttnMask,
    pub(super) runs: Option<&'a KeyRuns>,
}

/// Where a forward writes its new rows' K/V and which cache columns it attends over.
#[derive(Debug, Clone)]
pub enum CacheLayout {
    /// After the committed rows, into a cache that grows as needed; attention over
    /// `[cache | new]`, the mask's `cache + n` columns.
    Append,
    /// The same rows (`cache .. cache + n`, of every sequence), written through a device index
    /// into a cache of exactly `cap` rows ([`KvCache::reserve_exact`]); attention over all `cap`
    /// rows, the mask (`[n, cap]`, or each row's interval) hiding the columns past the new
    /// rows. Every shape is fixed by `n` and `cap`,
    /// so a captured forward can be replayed at any cache length (CUDA graphs).
    /// Example: cache 37, n 16, cap 64 → rows 37..53 written, mask columns 53..64 hidden.
    Fixed {
        /// `[b, hkv, n, head_dim]` u32: the row of each new K/V element.
        index: Tensor,
        cap: usize,
    },
}

impl Target {
    /// The host side of a forward: token ids, RoPE rows and the attention rule copied to the
    /// device (and, for hybrid targets, each new row's parent). Everything after it
    /// ([`Target::forward_prepared`]) runs on device tensors, which is what a CUDA graph can
    /// capture. `tokens`, `positions` and `masks` as [`Target::forward_batch`], `cache_len`
    /// the cache's length.
    ///
    /// `cap`: `None` appends the new rows to a growing cache ([`CacheLayout::Append`]);
    /// `Some(cap)` is the fixed layout ([`CacheLayout::Fixed`]): each sequence's `n` new rows
    /// at cache rows `cache_len ..` of a cache of exactly `cap` rows, attention over all of
    /// them with the columns past the visibility hidden (one sequence: the additive mask
    /// `[n, cap]`; several: their intervals over `cap` columns).
    /// Examples: one AR step on a 512-row cache, `cap` `None`: ids `[t]`, RoPE rows of
    /// position 512, mask `[1, 513]` all visible; the same step with `cap` 1024: mask
    /// `[1, 1024]` with columns 0..=512 visible, index rows all 512.
    pub fn prepare(
        &self,
        tokens: &[u32],
        positions: &[usize],
        masks: &[Visibility],
        cache_len: usize,
        cap: Option<usize>,
    ) -> Result<ForwardInputs> {
        self.prepare_with(tokens, positions, masks, cache_len, cap, false)
    }

    /// [`Target::prepare`] of one sequence in the fixed layout (`cap` rows) with each row's
    /// interval of keys instead of the additive mask `[n, cap]` when every row sees one
    /// interval (AR steps and chain verifies: the interval attention reads only those rows,
    /// whatever `cap`); a tree's verify takes the tree kernel's windows beside the additive mask
    /// on a CUDA device in bf16, the additive mask elsewhere ([`ForwardInputs::has_intervals`]
    /// and [`ForwardInputs::mask_kind`] say which).
    /// Example: cache 40, a 16-row chain, cap 1,024 → rows see keys 0..41 … 0..56, no mask.
    pub fn prepare_fixed_intervals(
        &self,
        tokens: &[u32],
        positions: &[usize],
        mask: &Visibility,
        cache_len: usize,
        cap: usize,
    ) -> Result<ForwardInputs> {
        self.prepare_with(
            tokens,
            positions,
            std::slice::from_ref(mask),
            cache_len,
            Some(cap),
            true,
        )
    }

    fn prepare_with(
        &self,
        tokens: &[u32],
        positions: &[usize],
        masks: &[Visibility],
        cache_len: usize,
        cap: Option<usize>,
        fixed_intervals: bool,
    ) -> Result<ForwardInputs> {
        let b = masks.len();
        let n = rows_per_sequence(tokens, positions, b)?;
        check_capacity(n, cache_len, cap)?;
        if let Some(mask) = masks
            .iter()
            .find(|m| m.rows != n || m.cols != cache_len + n)
        {
            bail!(
                "mask is {}x{}, expected {}x{} (new rows x [cache {} | new {}])",
                mask.rows,
                mask.cols,
                n,
                cache_len + n,
                cache_len,
                n
            );
        }
        if b > 1 && self.is_hybrid() {
            bail!("a batch of {b} sequences needs an attention-only target: the linear-attention layers of this hybrid target keep one sequence's state");
        }
        let (ids, rope, layout) = self.prepare_rows(tokens, positions, b, n, cache_len, cap)?;
        let gdn = match self.gdn_kernel() {
            Some(k) => Some(GdnRowsInput::new(
                &parents_from_mask(&masks[0], cache_len),
                k,
                &self.device,
            )?),
            None => None,
        };
        let mask = self.attention_rule(masks, n, cap, fixed_intervals)?;
        // f32 CPU inference of a few rows: each row over its own keys (bit-identical rows
        // whatever the other rows, e.g. a tree's verify row and the AR step of the same tokens)
        // (several sequences one after the other: each gets the bits it gets alone)
        let runs = (masks.len() == b
            && cap.is_none()
            && row_attention::serves(&self.device, self.dtype, b, n))
        .then(|| KeyRuns::from_masks(masks));
        Ok(ForwardInputs {
            ids,
            rope,
            mask,
            runs,
            gdn,
            b,
            n,
            cache_len,
            layout,
        })
    }

    /// How the attention of a forward of `masks` (one per sequence, `n` rows each) reads its
    /// keys, chosen once per forward: one interval of keys per row where every row has one
    /// (the fused interval softmax), the tree kernel's windows beside the additive mask for a
    /// tree's verify on a CUDA device in bf16, else the additive mask; over `cap` columns in
    /// the fixed layout (`fixed_intervals`: a chain's captured forward, which keeps intervals).
    fn attention_rule(
        &self,
        masks: &[Visibility],
        n: usize,
        cap: Option<usize>,
        fixed_intervals: bool,
    ) -> Result<AttnMask> {
        let b = masks.len();
        // in the attention scores' dtype: no cast per layer (−1 kernel per layer)
        let cd = crate::layers::norm::compute_dtype(self.dtype);
        // one sequence's rows that are not one interval each (a tree's verify), or every
        // forward of a fixed layout without intervals (a captured tree's verify keeps one kind
        // of mask whatever the tree's shape): the tree kernel's windows where it can run (a CUDA
        // device, bf16, not switched off) and every row fits its window, beside the additive mask
        let tree_mask = |one: &Visibility, cols: usize| -> Result<AttnMask> {
            let additive = mask_tensor_cols(one, cols, cd, &self.device)?;
            let kernel = self.device.is_cuda()
                && self.dtype == candle_core::DType::BF16
                && crate::ops::interval_attention::tree_switched_on();
            let windows = match kernel {
                true => RowIntervals::tree_widened(one, cols, &self.device)?,
                false => None,
            };
            Ok(match windows {
                Some(iv) => AttnMask::Tree { additive, iv },
                None => AttnMask::Additive(additive),
            })
        };
        // one interval of keys per row over `cols`, or `None`; one sequence's 65–128 rows per
        // K/V head carry empty windows, for the tree kernel's 8 warps (`eight_warps`)
        let intervals = |cols: usize| -> Result<Option<RowIntervals>> {
            let one_each = |m: &Visibility| (0..m.rows).all(|r| m.row_interval(r).is_some());
            Ok(match masks {
                [one] if self.eight_warps(b, n) && one_each(one) => {
                    RowIntervals::tree_widened(one, cols, &self.device)?
                }
                _ => RowIntervals::widened(masks, cols, &self.device)?,
            })
        };
        Ok(match (cap, masks) {
            (Some(cols), [one]) => match fixed_intervals {
                true => match intervals(cols)? {
                    Some(iv) => AttnMask::Intervals(iv),
                    None => tree_mask(one, cols)?,
                },
                false => tree_mask(one, cols)?,
            },
            // several sequences (batched decoding): one interval per row, over all `cols`
            (Some(cols), _) => match intervals(cols)? {
                Some(iv) => AttnMask::Intervals(iv),
                None => bail!("a batched fixed-shape forward needs one interval of keys per row"),
            },
            (None, _) => match (intervals(masks.first().map_or(0, |m| m.cols))?, masks) {
                (Some(iv), _) => AttnMask::Intervals(iv),
                (None, [one]) => tree_mask(one, one.cols)?,
                (None, _) => AttnMask::Additive(mask_tensors(masks, cd, &self.device)?),
            },
        })
    }

    /// [`Target::prepare`] from each row's key interval instead of dense visibility matrices
    /// (`rows[s][r]`: sequence `s`, row `r`, over `[cache | new]`, or the `cap` columns of the
    /// fixed layout): the batched engine's prefills and steps, whose dense masks would cost the
    /// host `b · n · (cache + n)` cells. Example: two sequences of one AR step on a 40-column
    /// batched cache holding 12 and 30 rows → `[[28..41], [10..41]]`. A hybrid target's
    /// linear-attention layers take one sequence's rows (each row's parent: the row before it
    /// where its interval reaches it), one row per sequence (a batched step,
    /// [`GdnRowsInput::slots`]) or each sequence's chain after its padding (a batched prefill,
    /// [`GdnRowsInput::slot_chains`]).
    pub fn prepare_intervals(
        &self,
        tokens: &[u32],
        positions: &[usize],
        rows: &[Vec<Range<usize>>],
        cache_len: usize,
        cap: Option<usize>,
    ) -> Result<ForwardInputs> {
        let b = rows.len();
        let n = rows_per_sequence(tokens, positions, b)?;
        check_capacity(n, cache_len, cap)?;
        if let Some(r) = rows.iter().find(|r| r.len() != n) {
            bail!("{} key intervals for a sequence of {n} new rows", r.len());
        }
        let cols = cap.unwrap_or(cache_len + n);
        // new row r of a sequence is column cache_len + r (in either layout)
        let parents = |s: usize| parents_from_intervals(&rows[s], cache_len);
        let gdn = match self.gdn_kernel() {
            None => None,
            Some(k) if n == 1 => Some(GdnRowsInput::slots(b, k, &self.device)?),
            Some(k) if b == 1 => Some(GdnRowsInput::new(&parents(0), k, &self.device)?),
            // several sequences of several rows (a batched prefill): each a chain from its
            // last row without a parent, the rows before it padding
            Some(k) => {
                let starts = (0..b)
                    .map(|s| parents(s).iter().rposition(|p| p.is_none()).unwrap_or(0))
                    .collect();
                Some(GdnRowsInput::slot_chains(starts, n, k, &self.device)?)
            }
        };
        let iv = RowIntervals::from_rows(&rows.concat(), b, n, cols, &self.device)?;
        let (ids, rope, layout) = self.prepare_rows(tokens, positions, b, n, cache_len, cap)?;
        // f32 CPU inference of a few rows: each row over its own keys, as the sequence alone
        // (the interval matmuls sum over every column of the batch, so their bits depend on it)
        let runs = row_attention::serves(&self.device, self.dtype, b, n)
            .then(|| KeyRuns::from_intervals(rows, cols));
        Ok(ForwardInputs {
            ids,
            rope,
            mask: AttnMask::Intervals(iv),
            runs,
            gdn,
            b,
            n,
            cache_len,
            layout,
        })
    }

    /// What both kinds of inputs share: the token ids, each row's RoPE rows (`[b, n, half]`
    /// for several sequences) and where the new K/V go.
    fn prepare_rows(
        &self,
        tokens: &[u32],
        positions: &[usize],
        b: usize,
        n: usize,
        cache_len: usize,
        cap: Option<usize>,
    ) -> Result<(Tensor, RopeTables, CacheLayout)> {
        let max_pos = positions.iter().copied().max().unwrap_or(0);
        if max_pos >= self.config.max_position_embeddings {
            bail!(
                "position {max_pos} exceeds the context length ({})",
                self.config.max_position_embeddings
            );
        }
        self.check_tokens(tokens)?;
        let ids = Tensor::from_vec(tokens.to_vec(), tokens.len(), &self.device)?;
        let mut rope = self.rope.tables(positions, self.dtype, &self.device)?;
        if b > 1 {
            // [b·n, half] → [b, n, half]: each sequence's rows at their own positions
            let half = rope.cos.dim(1)?;
            rope.cos = rope.cos.reshape((b, n, half))?;
            rope.sin = rope.sin.reshape((b, n, half))?;
        }
        let layout = match cap {
            None => CacheLayout::Append,
            Some(cap) => CacheLayout::Fixed {
                index: self.fixed_index(n, &vec![cache_len; b])?,
                cap,
            },
        };
        Ok((ids, rope, layout))
    }

    /// The conv kernel size of the linear-attention layers (`None` for an attention-only
    /// target).
    fn gdn_kernel(&self) -> Option<usize> {
        self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::GatedDeltaNet(g) => Some(g.dims.kernel),
            Mixer::Attention(_) => None,
        })
    }

    /// Whether one sequence's `n` rows, each seeing one interval of keys, go to the tree
    /// kernel's 8 warps with empty windows
    /// ([`crate::ops::interval_attention::eight_warp_rows`]): in bf16 on CUDA, the tree kernel
    /// switched on.
    fn eight_warps(&self, b: usize, n: usize) -> bool {
        b == 1
            && self.device.is_cuda()
            && self.dtype == candle_core::DType::BF16
            && crate::ops::interval_attention::eight_warp_rows(
                self.config.num_attention_heads,
                self.config.num_kv_heads(),
                self.config.head_dim(),
                n,
            )
            && crate::ops::interval_attention::tree_switched_on()
    }

    /// The fixed layout's write index `[b, hkv, n, head_dim]`: the cache row of each new K/V
    /// element (sequence s's rows `firsts[s] ..`; the same for every sequence but in a slotted
    /// cache, [`Target::forward_slots`]).
    pub(super) fn fixed_index(&self, n: usize, firsts: &[usize]) -> Result<Tensor> {
        let (hkv, d) = self
            .layers
            .iter()
            .find_map(|l| match &l.mixer {
                Mixer::Attention(a) => Some((a.kv_heads, a.head_dim)),
                Mixer::GatedDeltaNet(_) => None,
            })
            .context("the target has no attention layer")?;
        Ok(KvCache::slot_index((hkv, n, d), firsts, &self.device)?)
    }
}

/// The new rows per sequence of a forward of `tokens` (`b` sequences, sequence-major), checked:
/// one position per token, the same count per sequence. Example: 6 tokens, 2 sequences → 3.
fn rows_per_sequence(tokens: &[u32], positions: &[usize], b: usize) -> Result<usize> {
    if b == 0
        || tokens.is_empty()
        || !tokens.len().is_multiple_of(b)
        || positions.len() != tokens.len()
    {
        bail!(
            "forward needs one position per token and the same number of tokens per sequence (got {} tokens, {} positions, {b} sequences)",
            tokens.len(),
            positions.len()
        );
    }
    Ok(tokens.len() / b)
}

/// A fixed-layout forward's `n` rows after `cache_len` fit its capacity.
fn check_capacity(n: usize, cache_len: usize, cap: Option<usize>) -> Result<()> {
    match cap {
        Some(cap) if cache_len + n > cap => bail!(
            "a fixed-shape forward of {n} rows on a {cache_len}-row cache needs more than its capacity of {cap} rows"
        ),
        _ => Ok(()),
    }
}
