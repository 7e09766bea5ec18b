//! Batched decoding: many independent AR generations, one target forward per step over a
//! batched cache `[slots, hkv, len, d]` (data regeneration, where throughput matters and no
//! drafter is involved).
//!
//! Every slot holds one sequence, right-aligned: its rows are the last columns of its cache
//! row, and each forward shows it only those ([`dflash_core::visibility::right_aligned`], given
//! to the forward as each row's key interval: `right_aligned_rows`), at its own positions. Each sequence therefore computes exactly what [`crate::generate`] in
//! [`crate::Mode::Ar`] computes for it alone (on the CPU bit for bit: its steps attend each
//! sequence's keys alone and its prompts are prefilled one at a time; on a GPU up to float
//! summation order) and samples with its
//! own seeded [`Sampler`] by AR's path for its rule (`draw_step`), so the tokens are the same
//! (at T > 0 up to a draw within rounding of a boundary between two tokens).
//!
//! Scheduling is continuous: whenever 1/8 of the slots are free (at the start: all), the next
//! prompts are prefilled, shortest first, up to 16 per forward in a left-padded batch of their
//! own (on the CPU one per forward), and their K/V rows are copied into the free slots, ending at the cache's current last
//! column (the cache grows at the front when a prompt is longer than it). Columns no live
//! sequence holds are dropped from the front once they are half the cache.
//!
//! Example, 2 slots, requests A (prompt 3 tokens), B (prompt 2), C (prompt 4): the first fill
//! prefills [_ B B] and [A A A] (B left-padded), the cache grows to 3 columns, B is copied to
//! columns 1..3 of slot 0 and A to 0..3 of slot 1; a step adds column 3 to both; B stops →
//! C is prefilled alone: the cache (4 columns) is long enough, C goes to columns 0..4 of
//! slot 0, and A keeps columns 0..4 of slot 1.

use std::time::Instant;

use anyhow::Result;

use dflash_model::Target;

use crate::decode::check_request;
use crate::Request;

mod batch;
pub use batch::{Batch, Live, Stepped};

/// What the caller wants after a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Return now; live sequences are abandoned (e.g. a time limit).
    Stop,
}

/// One finished request of a batched run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchedOutput {
    pub new_tokens: Vec<u32>,
    pub stopped_by_token: bool,
    /// Ended at its first repeated window ([`Request::loop_window`]).
    pub stopped_by_loop: bool,
}

/// Decode `requests` with up to `slots` of them in each target forward, calling
/// `done(i, result)` as request `i` finishes (in finishing order; a request the target cannot
/// take, e.g. too long for its context, gets its error); `done` returning [`Flow::Stop`] ends
/// the run at once. Attention-only targets: the linear-attention state of a hybrid target is
/// one sequence's.
pub fn generate_batched(
    target: &Target,
    requests: &[Request],
    slots: usize,
    opts: BatchedOptions,
    mut done: impl FnMut(usize, Result<BatchedOutput>) -> Result<Flow>,
) -> Result<()> {
    if slots == 0 {
        anyhow::bail!("batched decoding needs at least one slot");
    }
    let n_slots = slots.min(requests.len()).max(1);
    let cap = opts.cuda_graphs.then(|| {
        let longest = requests
            .iter()
            .filter(|r| check_request(target, r).is_ok())
            .map(|r| r.prompt_ids.len() + r.max_new_tokens)
            .max()
            .unwrap_or(1);
        (2 * longest).div_ceil(64) * 64
    });
    let mut batch = Batch::new(target, n_slots, cap)?;
    if let (Some(p), false) = (opts.prefill_prompts, target.device.is_cpu()) {
        batch.set_prefill_chunk(p);
    }
    if requests.is_empty() {
        return Ok(());
    }
    let result = Run {
        target,
        requests,
        done: &mut done,
        queue: (0..requests.len()).collect(),
        batch,
        admit_until: opts.admit_until,
    }
    .run();
    dflash_model::profile::print_report("batched decoding");
    result
}

/// How [`generate_batched`] runs its steps.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchedOptions {
    /// Replay every step from one CUDA graph ([`dflash_model::cuda::graphed::GraphedBatch`]):
    /// the batched cache gets a fixed capacity of twice the longest request (prompt + new
    /// tokens), rounded up to 64 columns, so mind the memory (SmolLM2-135M in bf16: 23 KB per
    /// column and slot, 256 slots × 4,096 columns = 24 GB). On the CPU the same fixed-layout
    /// steps run eagerly.
    pub cuda_graphs: bool,
    /// Prefill no request after this instant (a time limit): the sequences in the slots go
    /// on, so that the caller, stopping at the next one that finishes, keeps it, and a fill of
    /// many long prompts does not run far past the limit (the first prefill always runs).
    /// Example: 32 free slots, prompts of 3,000 tokens, a limit of 10 s → the prompts
    /// prefilled by then decode, the next to finish ends the run.
    pub admit_until: Option<std::time::Instant>,
    /// Prompts prefilled in one forward on a GPU (`None`: [`Batch::prefill_chunk`]'s 16; the
    /// CPU always prefills one at a time). Example: 256 prompts of 256 tokens at 64 → four
    /// prefill forwards of 16,384 rows.
    pub prefill_prompts: Option<usize>,
}

struct Run<'a, 't, F> {
    target: &'a Target,
    requests: &'a [Request],
    done: &'a mut F,
    queue: std::collections::VecDeque<usize>,
    batch: Batch<'t>,
    admit_until: Option<std::time::Instant>,
}

/// Stop signal: `Err` carries real errors; `Ok(true)` means the caller asked to stop.
type Stopped = Result<bool>;

impl<F: FnMut(usize, Result<BatchedOutput>) -> Result<Flow>> Run<'_, '_, F> {
    /// The next `n` requests the target can take (refused ones are reported on the way).
    fn take(&mut self, n: usize) -> Result<Option<Vec<usize>>> {
        let mut out = Vec::new();
        while out.len() < n {
            let Some(i) = self.queue.pop_front() else {
                break;
            };
            match check_request(self.target, &self.requests[i]) {
                Ok(()) => out.push(i),
                Err(e) => {
                    if (self.done)(i, Err(e))? == Flow::Stop {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(Some(out))
    }

    /// Report the sequences that ended. `Ok(true)`: stop.
    fn report(&mut self, stepped: Vec<Stepped>) -> Stopped {
        for s in stepped {
            if let Some(out) = s.done {
                if (self.done)(s.index, Ok(out))? == Flow::Stop {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    fn run(mut self) -> Result<()> {
        let n_slots = self.batch.slots();
        let mut admitted_any = false;
        loop {
            let open = !admitted_any || self.admit_until.is_none_or(|t| Instant::now() < t);
            // 1. refill once 1/8 of the slots (at the start: all of them) are free
            let free = self.batch.free().len();
            if open && free > 0 && free * 8 >= n_slots {
                let Some(idx) = self.take(free)? else {
                    return Ok(());
                };
                if self.fill(idx, &mut admitted_any)? {
                    return Ok(());
                }
            }
            if self.batch.live() == 0 {
                if self.queue.is_empty() || !open {
                    return Ok(());
                }
                continue;
            }
            // 2. one step
            let stepped = self.batch.step()?;
            if self.report(stepped)? {
                return Ok(());
            }
        }
    }

    /// Prefill `idx` (shortest first: a forward pads its prompts to its longest), one
    /// prefill forward's worth at a time; past [`BatchedOptions::admit_until`] the rest go
    /// back to the queue. `Ok(true)`: stop.
    fn fill(&mut self, mut idx: Vec<usize>, admitted_any: &mut bool) -> Stopped {
        idx.sort_by_key(|&i| self.requests[i].prompt_ids.len());
        let chunk = self.batch.prefill_chunk();
        let mut parts = idx.chunks(chunk);
        while let Some(part) = parts.next() {
            if *admitted_any && self.admit_until.is_some_and(|t| Instant::now() >= t) {
                for &i in parts.flat_map(|p| p.iter()).rev().chain(part.iter().rev()) {
                    self.queue.push_front(i);
                }
                return Ok(false);
            }
            let reqs: Vec<(usize, &Request)> =
                part.iter().map(|&i| (i, &self.requests[i])).collect();
            let stepped = self.batch.admit(&reqs)?;
            *admitted_any = true;
            if self.report(stepped)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}
