//! Target forwards replayed from CUDA graphs: the decoding loop's verify forward (AR: 1 row;
//! DFlash: B rows; DDTree: budget + 1 rows) has one shape per row count once the cache has a
//! fixed capacity ([`CacheLayout::Fixed`](crate::models::target::CacheLayout)), so each row count is
//! captured once and replayed every round after, with the round's inputs (ids, RoPE rows,
//! mask, cache rows) copied into the captured buffers first. A replay launches the forward's
//! several hundred kernels with one call and none of the host work between them
//! (`docs/BENCHMARKS.md`, a decode step beside PyTorch).
//!
//! Per row count `n`, the first call runs the forward eagerly with candle's param cache on
//! (so that its layout uploads are on the device), then captures the same forward; every later
//! call writes its inputs in place and replays. On the CPU there are no graphs: every call runs
//! the fixed-layout forward on the same buffers, so the bookkeeping is tested without a GPU.
//!
//! Hybrid targets: the Gated DeltaNet layers read their committed state from buffers updated
//! in place and their rows' parents and conv windows from the inputs' buffers; before a replay
//! the host settles the last forward's rows (as the forward itself would), and after it
//! installs the graph's per-row states as the pending rows, with this round's parents.
//!
//! A forward runs in two halves, [`GraphedForward::stage`] (its inputs built and uploaded on the
//! host) and [`GraphedForward::run`] (the device's work), so that a round staged before its draft
//! runs on the draft's tokens where the drafter left them.
//!
//! Example: prompt 40 tokens, 64 new, cap 105 → call 1 (n = 1, cache 40) captures; call 2
//! (cache 41) writes ids/RoPE/mask/index for row 41 into the buffers and replays. Shorter
//! forwards are padded to one shape (`pad_to`), so a DFlash loop captures one graph, not one
//! per tail length.

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use dflash_core::visibility::Visibility;

use crate::cuda::launch_profile::{warm_capture, Captured};
use crate::layers::gdn::GdnRows;
use crate::models::target::{ForwardInputs, Rows, Target, TargetOutput};
use crate::KvCache;

/// At most this many row counts get a graph; others run eagerly (a decoding loop pads its
/// verifies to one row count: one graph).
const MAX_GRAPHS: usize = 8;

struct Slot {
    inputs: ForwardInputs,
    taps: Vec<usize>,
    /// The linear-attention layers' pending rows after the capture (the graph's buffers),
    /// pending again after every replay.
    linear: Vec<Option<GdnRows>>,
    /// `None` on the CPU: the forward runs eagerly on `inputs`.
    graph: Option<(Captured, TargetOutput)>,
}

/// A forward's inputs built and uploaded ([`GraphedForward::stage`]), run later by
/// [`GraphedForward::run`] on a cache of the same length.
pub struct Staged {
    inputs: ForwardInputs,
    /// The rows to keep (the rest is padding).
    real: usize,
    cache_len: usize,
}

/// Fixed-shape target forwards of one sequence over a cache of `cap` rows ([`GraphedForward::new`]).
pub struct GraphedForward {
    cap: usize,
    /// Forwards of fewer rows are padded to this many (one graph for a chain's tail rounds).
    pad_to: usize,
    slots: HashMap<usize, Slot>,
    /// Forwards run eagerly for want of a slot (row counts past [`MAX_GRAPHS`], or a mask
    /// of another kind than the captured one).
    pub eager_calls: usize,
    /// Attention over each row's interval of keys (chains: [`Target::prepare_fixed_intervals`],
    /// padding that continues the chain) instead of the additive mask over `cap` columns.
    intervals: bool,
}

impl GraphedForward {
    /// Give `cache` exactly `cap` rows and start with no graphs. `cap` bounds every later
    /// forward's last row, padding included (a generation's `prompt + max_new_tokens` plus
    /// one verify). Forwards of fewer than `pad_to` rows are padded to `pad_to` rows
    /// ([`dflash_core::visibility::pad_rows`]: the padding sees only the cache and itself, no
    /// real row sees it) and their padding dropped, so a decoding loop whose verify is at
    /// most `pad_to` rows (a chain of B, a tree of budget + 1) needs a single graph.
    /// Example: B = 16, the last round has room for 5 rows → 16 rows replayed, 5 kept.
    pub fn new(cache: &mut KvCache, cap: usize, pad_to: usize) -> Result<Self> {
        cache.reserve_exact(cap)?;
        Ok(Self {
            cap,
            pad_to,
            slots: HashMap::new(),
            eager_calls: 0,
            intervals: false,
        })
    }

    /// Forwards of chains (AR steps, chain verifies): each row's interval of keys instead of
    /// the additive mask, so that the attention reads only the rows it sees, whatever the
    /// capacity; shorter forwards are padded by continuing the chain
    /// ([`dflash_core::visibility::pad_rows_causal`]). A forward whose rows do not each see one
    /// interval runs eagerly. Example: AR at cache 300 of a 1,024-row cache → keys 0..301.
    pub fn chains(mut self) -> Self {
        self.intervals = true;
        self
    }

    /// [`Target::forward`] with all logits rows (the same shapes), through the fixed layout
    /// and, on a GPU, a graph per row count. The returned tensors are the graph's output buffers: read them
    /// before the next call (the next replay overwrites them).
    pub fn forward(
        &mut self,
        target: &Target,
        tokens: &[u32],
        positions: &[usize],
        mask: &Visibility,
        cache: &mut KvCache,
        taps: &[usize],
    ) -> Result<TargetOutput> {
        let staged = self.stage(target, tokens, positions, mask, cache.len())?;
        self.run(target, staged, None, cache, taps)
    }

    /// The host's half of a forward on a cache of `cache_len` rows: the padded rows' inputs
    /// built and uploaded. Staged before a draft whose tokens the forward reads on the device,
    /// the uploads (which wait for the device's queue) do not wait for that draft.
    pub fn stage(
        &self,
        target: &Target,
        tokens: &[u32],
        positions: &[usize],
        mask: &Visibility,
        cache_len: usize,
    ) -> Result<Staged> {
        let real = tokens.len();
        if real == 0 || mask.rows != real || mask.cols != cache_len + real {
            bail!(
                "a forward of {real} tokens on a {cache_len}-row cache needs a {real}x{} mask (got {}x{})",
                cache_len + real,
                mask.rows,
                mask.cols
            );
        }
        if real < self.pad_to {
            // the padding repeats the first row's token and position; its outputs are dropped
            let pad = self.pad_to - real;
            let tokens: Vec<u32> = tokens
                .iter()
                .copied()
                .chain(std::iter::repeat_n(tokens[0], pad))
                .collect();
            let positions: Vec<usize> = positions
                .iter()
                .copied()
                .chain(std::iter::repeat_n(positions[0], pad))
                .collect();
            let mask = if self.intervals {
                dflash_core::visibility::pad_rows_causal(mask, cache_len, self.pad_to)
            } else {
                dflash_core::visibility::pad_rows(mask, cache_len, self.pad_to)
            };
            let mut staged = self.stage(target, &tokens, &positions, &mask, cache_len)?;
            staged.real = real;
            return Ok(staged);
        }
        let inputs = if self.intervals {
            target.prepare_fixed_intervals(tokens, positions, mask, cache_len, self.cap)?
        } else {
            target.prepare(
                tokens,
                positions,
                std::slice::from_ref(mask),
                cache_len,
                Some(self.cap),
            )?
        };
        Ok(Staged {
            inputs,
            real,
            cache_len,
        })
    }

    /// The device's half: the staged forward (rows `1 ..= k` reading `drafts` when given) on
    /// `cache`, replayed from its graph once captured. With drafts the replay is not waited
    /// for: the caller's read of the outputs is the round's one host synchronization.
    pub fn run(
        &mut self,
        target: &Target,
        staged: Staged,
        drafts: Option<&Tensor>,
        cache: &mut KvCache,
        taps: &[usize],
    ) -> Result<TargetOutput> {
        let Staged {
            inputs: mut fresh,
            real,
            cache_len,
        } = staged;
        if cache.len() != cache_len {
            bail!(
                "a forward staged on a {cache_len}-row cache runs on one of {} rows",
                cache.len()
            );
        }
        if let Some(d) = drafts {
            fresh.set_ids(1, d)?;
        }
        let rows = fresh.rows();
        let out = self.run_rows(target, fresh, drafts.is_some(), cache, taps)?;
        if real == rows {
            return Ok(out);
        }
        cache.drop_padding(cache_len + real)?;
        Ok(TargetOutput {
            logits: out.logits.map(|l| l.narrow(0, 0, real)).transpose()?,
            taps: out
                .taps
                .iter()
                .map(|t| t.narrow(0, 0, real))
                .collect::<candle_core::Result<_>>()?,
        })
    }

    /// `fresh` (every row real or padding) through its slot: captured on first use, replayed
    /// after; eager when it cannot be.
    fn run_rows(
        &mut self,
        target: &Target,
        fresh: ForwardInputs,
        no_wait: bool,
        cache: &mut KvCache,
        taps: &[usize],
    ) -> Result<TargetOutput> {
        let cache_len = cache.len();
        let n = fresh.rows();
        if self.intervals && !fresh.has_intervals() {
            // not a chain: the captured forward reads intervals
            self.eager_calls += 1;
            return target
                .forward_prepared(&fresh, cache, taps, &Rows::All)?
                .one_sequence();
        }
        if let Some(slot) = self.slots.get(&n) {
            if slot.inputs.mask_kind() != fresh.mask_kind() {
                // e.g. a tree that does not fit the captured tree kernel's windows
                self.eager_calls += 1;
                return target
                    .forward_prepared(&fresh, cache, taps, &Rows::All)?
                    .one_sequence();
            }
        }
        if let Some(slot) = self.slots.get_mut(&n) {
            if slot.taps != taps {
                bail!(
                    "fixed-shape forward of {n} rows captured with taps {:?}, called with {taps:?}",
                    slot.taps
                );
            }
            fresh.write_into(&mut slot.inputs)?;
            return match &slot.graph {
                Some((graph, out)) => {
                    // what the captured forward does on the host before its kernels: the
                    // linear-attention layers settle the last forward's rows (in place)
                    cache.settle_linear()?;
                    graph.replay()?;
                    // wait here, so that the caller's clock charges the forward to the verify
                    // (the first read of the logits would wait anyway)
                    if !no_wait {
                        target.embedding_table().device().synchronize()?;
                    }
                    // and after them: its rows become the cache's (pending for the
                    // linear-attention layers, with this round's parents)
                    cache.commit(n);
                    if let Some(parents) = fresh.linear_parents() {
                        cache.set_linear_rows(&slot.linear, parents)?;
                    }
                    out.clone().one_sequence()
                }
                None => target
                    .forward_prepared(&slot.inputs, cache, taps, &Rows::All)?
                    .one_sequence(),
            };
        }
        if self.slots.len() >= MAX_GRAPHS {
            self.eager_calls += 1;
            return target
                .forward_prepared(&fresh, cache, taps, &Rows::All)?
                .one_sequence();
        }
        let dev = target.embedding_table().device().clone();
        let (out, graph) = match dev {
            Device::Cuda(_) => {
                // the capture's launch recomputes this round, same rows
                let (graph, out) = warm_capture(&dev, cache, cache_len, |c| {
                    target.forward_prepared(&fresh, c, taps, &Rows::All)
                })?;
                (out.clone(), Some((graph, out)))
            }
            _ => (
                target.forward_prepared(&fresh, cache, taps, &Rows::All)?,
                None,
            ),
        };
        self.slots.insert(
            n,
            Slot {
                inputs: fresh,
                taps: taps.to_vec(),
                linear: cache.linear_rows(),
                graph,
            },
        );
        out.one_sequence()
    }

    /// Row counts that have a slot (captured graphs on a GPU), ascending.
    pub fn captured_rows(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.slots.keys().copied().collect();
        v.sort();
        v
    }
}

/// One-row steps of `b` sequences side by side (batched decoding: data regeneration) over a
/// batched cache of exactly `cap` columns, replayed from one CUDA graph. Each step's inputs —
/// ids, RoPE rows, the fixed layout's write index (column `cache_len` of every sequence) and
/// each sequence's interval of keys — are written into the captured buffers, so the step's
/// shapes never change; the fused interval attention
/// ([`crate::ops::interval_attention`]) reads only each sequence's rows, whatever `cap`. The
/// caller keeps `cache.len() < cap` (dropping columns from the front in place,
/// [`KvCache::drop_front`]) and grows or moves the cache only in place.
///
/// Example: 256 sequences, cap 4,096: step 1 at cache length 700 captures; step 2 at 701
/// writes 256 ids, RoPE rows, intervals and the index of column 701 and replays.
pub struct GraphedBatch {
    cap: usize,
    slot: Option<(ForwardInputs, Option<(Captured, TargetOutput)>)>,
}

impl GraphedBatch {
    /// Give the batched `cache` exactly `cap` columns.
    pub fn new(cache: &mut KvCache, cap: usize) -> Result<Self> {
        cache.reserve_exact(cap)?;
        Ok(Self { cap, slot: None })
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// [`Target::forward_batch_intervals`] of one row per sequence (`rows[s]`: sequence `s`'s
    /// one key interval over `[cache | new]`) → logits `[b, vocab]`, the graph's output buffer:
    /// read it before the next call. On the CPU the fixed-layout step runs eagerly on the same
    /// buffers.
    pub fn step(
        &mut self,
        target: &Target,
        tokens: &[u32],
        positions: &[usize],
        rows: &[Vec<std::ops::Range<usize>>],
        cache: &mut KvCache,
    ) -> Result<candle_core::Tensor> {
        let cache_len = cache.len();
        if tokens.len() != rows.len() {
            bail!(
                "a batched step has one token per sequence ({} tokens, {} key intervals)",
                tokens.len(),
                rows.len()
            );
        }
        // the captured step reads and writes the buffers it was captured with
        if cache.capacity()? != self.cap {
            bail!(
                "the batched cache holds {} columns, not the {} of its captured step: it was reallocated (grow it in place)",
                cache.capacity()?,
                self.cap
            );
        }
        let fresh = target.prepare_intervals(tokens, positions, rows, cache_len, Some(self.cap))?;
        let logits = |o: &TargetOutput| -> Result<candle_core::Tensor> {
            Ok(o.logits
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("the step returned no logits"))?
                .squeeze(1)?)
        };
        if let Some((inputs, graph)) = &mut self.slot {
            fresh.write_into(inputs)?;
            return match graph {
                Some((g, out)) => {
                    g.replay()?;
                    cache.commit(1);
                    logits(out)
                }
                None => logits(&target.forward_prepared(inputs, cache, &[], &Rows::All)?),
            };
        }
        let dev = target.embedding_table().device().clone();
        let (out, graph) = match dev {
            Device::Cuda(_) => {
                let (graph, out) = warm_capture(&dev, cache, cache_len, |c| {
                    target.forward_prepared(&fresh, c, &[], &Rows::All)
                })?;
                (out.clone(), Some((graph, out)))
            }
            _ => (
                target.forward_prepared(&fresh, cache, &[], &Rows::All)?,
                None,
            ),
        };
        self.slot = Some((fresh, graph));
        logits(&out)
    }
}
