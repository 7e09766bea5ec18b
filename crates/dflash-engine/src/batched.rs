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

use anyhow::{bail, Result};

use candle_core::Tensor;
use dflash_core::loops::LoopDetector;
use dflash_core::sampling::{Sampler, SamplingParams};
use dflash_core::visibility::right_aligned_rows;
use dflash_model::cuda::graphed::GraphedBatch;
use dflash_model::ops::sample_rows::{draw_rows, rule_probs, Uniforms};
use dflash_model::{KvCache, Rows, Target};

use crate::decode::{check_request, one_sync_on};
use crate::Request;

/// The key interval of each row of a right-aligned sequence
/// ([`dflash_core::visibility::right_aligned_rows`]; the engine's prefills and steps are
/// always intervals).
fn intervals(
    held: usize,
    cache_len: usize,
    fresh: usize,
    new_len: usize,
) -> Result<Vec<std::ops::Range<usize>>> {
    right_aligned_rows(held, cache_len, fresh, new_len).ok_or_else(|| {
        anyhow::anyhow!("a right-aligned row of the batched engine is not one interval")
    })
}

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

/// Prompts prefilled in one forward: bounds the prefill's attention scores (`chunk · heads ·
/// P²`) and its host-built masks, whatever the number of slots.
const PREFILL_CHUNK: usize = 16;

struct Live {
    index: usize,
    sampler: Sampler,
    /// The last sampled token: not in the cache yet, the next step's input.
    next: u32,
    /// Rows of this sequence in the cache = the position of `next`.
    held: usize,
    new_tokens: Vec<u32>,
    loops: LoopDetector,
    /// `next` completed the response's first repeated window.
    looped: bool,
}

/// Why a sequence ended.
#[derive(Clone, Copy)]
enum End {
    Token,
    Loop,
    Length,
}

impl Live {
    fn new(index: usize, sampler: Sampler, first: u32, req: &Request) -> Self {
        let mut loops = LoopDetector::new(req.loop_window);
        let looped = loops.push(first);
        Live {
            index,
            sampler,
            next: first,
            held: req.prompt_ids.len(),
            new_tokens: vec![first],
            loops,
            looped,
        }
    }
    /// `tok` sampled: it becomes the next step's input.
    fn push(&mut self, tok: u32) {
        self.new_tokens.push(tok);
        self.next = tok;
        self.held += 1;
        self.looped = self.loops.push(tok);
    }
    fn finished(&self, req: &Request) -> Option<End> {
        if req.stop_ids.contains(&self.next) {
            Some(End::Token)
        } else if self.looped {
            Some(End::Loop)
        } else if self.new_tokens.len() >= req.max_new_tokens {
            Some(End::Length)
        } else {
            None
        }
    }
    fn output(self, end: End) -> BatchedOutput {
        BatchedOutput {
            new_tokens: self.new_tokens,
            stopped_by_token: matches!(end, End::Token),
            stopped_by_loop: matches!(end, End::Loop),
        }
    }
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
        bail!("batched decoding needs at least one slot");
    }
    if target.is_hybrid() {
        bail!("batched decoding needs an attention-only target: the linear-attention layers of this hybrid target keep one sequence's state (use a batch size of 1)");
    }
    let result = Run {
        target,
        requests,
        done: &mut done,
        queue: 0..requests.len(),
        graph: None,
    }
    .run(slots, opts);
    dflash_model::profile::print_report("batched decoding");
    result
}

/// How [`generate_batched`] runs its steps.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchedOptions {
    /// Replay every step from one CUDA graph ([`GraphedBatch`]): the batched cache gets a
    /// fixed capacity of twice the longest request (prompt + new tokens), rounded up to 64
    /// columns, so mind the memory (SmolLM2-135M in bf16: 23 KB per column and slot, 256 slots
    /// × 4,096 columns = 24 GB). On the CPU the same fixed-layout steps run eagerly.
    pub cuda_graphs: bool,
}

struct Run<'a, F> {
    target: &'a Target,
    requests: &'a [Request],
    done: &'a mut F,
    queue: std::ops::Range<usize>,
    graph: Option<GraphedBatch>,
}

/// Stop signal: `Err` carries real errors; `Ok(true)` means the caller asked to stop.
type Stopped = Result<bool>;

impl<F: FnMut(usize, Result<BatchedOutput>) -> Result<Flow>> Run<'_, F> {
    /// The next `n` requests the target can take (refused ones are reported on the way).
    fn take(&mut self, n: usize) -> Result<Option<Vec<usize>>> {
        let mut out = Vec::new();
        while out.len() < n {
            let Some(i) = self.queue.next() else { break };
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

    /// Prefill `idx` together (left-padded, right-aligned) into a fresh batched cache; the
    /// sequences with their first token sampled.
    fn prefill(&mut self, idx: &[usize]) -> Result<(KvCache, Vec<Live>)> {
        let _p = tracing::info_span!(target: "phase", "prefill").entered();
        let p = idx
            .iter()
            .map(|&i| self.requests[i].prompt_ids.len())
            .max()
            .unwrap_or(0);
        let (mut tokens, mut positions, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        for &i in idx {
            let ids = &self.requests[i].prompt_ids;
            let pad = p - ids.len();
            tokens.extend(std::iter::repeat_n(ids[0], pad).chain(ids.iter().copied()));
            positions.extend(std::iter::repeat_n(0, pad).chain(0..ids.len()));
            rows.push(intervals(0, 0, ids.len(), p)?);
        }
        let mut cache = self.target.new_cache();
        let out = self.target.forward_batch_intervals(
            &tokens,
            &positions,
            &rows,
            &mut cache,
            &[],
            &Rows::Last,
        )?;
        let logits = out.logits.unwrap().squeeze(1)?.to_vec2::<f32>()?;
        let live = idx
            .iter()
            .zip(&logits)
            .map(|(&i, row)| {
                let req = &self.requests[i];
                let mut sampler = Sampler::new(req.sampling);
                let first = sampler.sample(row);
                Live::new(i, sampler, first, req)
            })
            .collect();
        Ok((cache, live))
    }

    /// Report `l` if it is finished; `Some(l)` back when it goes on.
    fn settle(&mut self, l: Live) -> Result<(Option<Live>, bool)> {
        match l.finished(&self.requests[l.index]) {
            Some(end) => {
                let i = l.index;
                let stop = (self.done)(i, Ok(l.output(end)))? == Flow::Stop;
                Ok((None, stop))
            }
            None => Ok((Some(l), false)),
        }
    }

    fn run(mut self, slots: usize, opts: BatchedOptions) -> Result<()> {
        let n_slots = slots.min(self.requests.len());
        if n_slots == 0 {
            return Ok(());
        }
        let mut cache = self.target.new_batched_cache(n_slots, 64)?;
        if opts.cuda_graphs {
            let longest = self
                .requests
                .iter()
                .filter(|r| check_request(self.target, r).is_ok())
                .map(|r| r.prompt_ids.len() + r.max_new_tokens)
                .max()
                .unwrap_or(1);
            self.graph = Some(GraphedBatch::new(
                &mut cache,
                (2 * longest).div_ceil(64) * 64,
            )?);
        }
        let mut slot: Vec<Option<Live>> = (0..n_slots).map(|_| None).collect();
        loop {
            // 1. refill once 1/8 of the slots (at the start: all of them) are free
            let free: Vec<usize> = (0..n_slots).filter(|&s| slot[s].is_none()).collect();
            if !free.is_empty()
                && free.len() * 8 >= n_slots
                && self.refill(&mut cache, &mut slot, &free)?
            {
                return Ok(());
            }
            if slot.iter().all(|s| s.is_none()) {
                if self.queue.is_empty() {
                    return Ok(());
                }
                continue;
            }
            // 2. one step
            if self.step(&mut cache, &mut slot)? {
                return Ok(());
            }
            // 3. drop the columns no live sequence holds once they are half the cache
            let held = slot.iter().flatten().map(|l| l.held).max().unwrap_or(0);
            if cache.len() >= 64 && cache.len() >= 2 * held {
                let _p = tracing::info_span!(target: "phase", "compact").entered();
                cache.drop_front(cache.len() - held)?;
            }
        }
    }

    /// Prefill the next requests into the `free` slots, [`PREFILL_CHUNK`] prompts per forward,
    /// shortest first (a forward pads its prompts to its longest). `Ok(true)`: stop.
    fn refill(
        &mut self,
        cache: &mut KvCache,
        slot: &mut [Option<Live>],
        free: &[usize],
    ) -> Stopped {
        let Some(mut idx) = self.take(free.len())? else {
            return Ok(true);
        };
        // prompts of similar lengths share a prefill forward: less left padding
        idx.sort_by_key(|&i| self.requests[i].prompt_ids.len());
        let mut free = free.iter();
        // on the CPU each prompt is prefilled alone: a left-padded prefill's matmuls sum over
        // the batch's columns, so its rows would differ in their last bits from the prompt's
        // own prefill, and integer products requantize those bits into other tokens
        let chunk = match self.target.device.is_cpu() {
            true => 1,
            false => PREFILL_CHUNK,
        };
        for chunk in idx.chunks(chunk) {
            let (fresh, live) = self.prefill(chunk)?;
            let _p = tracing::info_span!(target: "phase", "refill").entered();
            // the chunk's rows end at its last column; the batch's end at the cache's
            if cache.len() < fresh.len() {
                cache.grow_front(fresh.len() - cache.len())?;
            }
            let t = cache.len();
            for (j, l) in live.into_iter().enumerate() {
                let s = *free.next().expect("no more requests than free slots");
                let n = l.held;
                cache.copy_sequence(s, t - n, &fresh, j, fresh.len() - n, n)?;
                let (l, stop) = self.settle(l)?;
                if stop {
                    return Ok(true);
                }
                slot[s] = l;
            }
        }
        Ok(false)
    }

    /// One forward: every slot feeds one token (a free slot a dummy that sees only itself).
    /// `Ok(true)`: stop.
    fn step(&mut self, cache: &mut KvCache, slot: &mut [Option<Live>]) -> Stopped {
        if let Some(g) = &self.graph {
            // the captured step writes column `t` of buffers of `cap` columns
            if cache.len() + 1 > g.cap() {
                let held = slot.iter().flatten().map(|l| l.held).max().unwrap_or(0);
                cache.drop_front(cache.len() - held)?;
            }
        }
        let t = cache.len();
        let phase = tracing::info_span!(target: "phase", "step mask").entered();
        let (mut tokens, mut positions, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        for s in slot.iter() {
            let (tok, held) = s.as_ref().map_or((0, 0), |l| (l.next, l.held));
            tokens.push(tok);
            positions.push(held);
            rows.push(intervals(held, t, 1, 1)?);
        }
        drop(phase);
        let phase = tracing::info_span!(target: "phase", "step forward").entered();
        let logits = match &mut self.graph {
            Some(g) => g.step(self.target, &tokens, &positions, &rows, cache)?,
            None => {
                let out = self.target.forward_batch_intervals(
                    &tokens,
                    &positions,
                    &rows,
                    cache,
                    &[],
                    &Rows::Last,
                )?;
                out.logits.unwrap().squeeze(1)? // [slots, vocab]
            }
        };
        drop(phase);
        let phase = tracing::info_span!(target: "phase", "sample").entered();
        let next = draw_step(&logits, slot)?;
        drop(phase);
        for (s, tok) in slot.iter_mut().zip(next) {
            if let Some(mut l) = s.take() {
                l.push(tok);
                let (l, stop) = self.settle(l)?;
                if stop {
                    return Ok(true);
                }
                *s = l;
            }
        }
        Ok(false)
    }
}

/// Each slot's next token from its row of `logits` (`[slots, vocab]`), by the path AR takes
/// for the slot's rule: the arg-max at T = 0; at T > 0 a draw where the logits are (one
/// uniform number of the slot's stream, the probabilities of [`rule_probs`] walked by
/// [`draw_rows`]), the slots of one rule drawn together; with `DFLASH_DISABLED_KERNELS=one-sync` the host's
/// [`Sampler::sample`] on the row. Only tokens leave the device on the default path; free
/// slots get 0. Example: 256 slots at T = 1 → one `[256, vocab]` draw on the device and 256
/// tokens read back, instead of 256 rows of logits.
fn draw_step(logits: &Tensor, slot: &mut [Option<Live>]) -> Result<Vec<u32>> {
    let mut next = vec![0u32; slot.len()];
    let (mut greedy, mut host) = (Vec::new(), Vec::new());
    // the slots drawn on the device, by rule (one rule in a regeneration run)
    let mut rules: Vec<(SamplingParams, Vec<usize>)> = Vec::new();
    let one_sync = one_sync_on();
    for (i, l) in slot.iter().enumerate() {
        let Some(l) = l else { continue };
        let p = l.sampler.params;
        if p.is_greedy() {
            greedy.push(i);
        } else if one_sync {
            let rule = SamplingParams { seed: 0, ..p };
            match rules.iter_mut().find(|(r, _)| *r == rule) {
                Some((_, idx)) => idx.push(i),
                None => rules.push((rule, vec![i])),
            }
        } else {
            host.push(i);
        }
    }
    if !greedy.is_empty() {
        // argmax on the device (the host's first-max rule): one token per slot comes back
        let best = dflash_model::ops::argmax::argmax_rows(logits)?;
        for i in greedy {
            next[i] = best[i];
        }
    }
    for (p, idx) in rules {
        let rows = match idx.len() == slot.len() {
            true => logits.clone(),
            false => {
                let at: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
                logits.index_select(&Tensor::new(at, logits.device())?, 0)?
            }
        };
        let u: Vec<f32> = idx
            .iter()
            .map(|&i| slot[i].as_mut().map_or(0.0, |l| l.sampler.uniforms(1)[0]))
            .collect();
        let probs = rule_probs(&rows, p.temperature, p.top_k, p.top_p)?;
        let drawn = draw_rows(&probs, &Uniforms::new(&u, logits.device())?, 0)?;
        for (&i, tok) in idx.iter().zip(drawn.to_vec1::<u32>()?) {
            next[i] = tok;
        }
    }
    if !host.is_empty() {
        let rows = logits.to_vec2::<f32>()?;
        for i in host {
            if let Some(l) = slot[i].as_mut() {
                next[i] = l.sampler.sample(&rows[i]);
            }
        }
    }
    Ok(next)
}
