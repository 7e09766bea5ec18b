//! The open batch: slots of AR sequences over one batched cache, that requests join (a
//! prefill, or a sequence decoded elsewhere so far: [`Batch::adopt`]) and leave (finished, or
//! [`Batch::cancel`]) between steps. [`super::generate_batched`] runs a fixed request list
//! through it; the server admits requests as they arrive.

use anyhow::Result;

use candle_core::Tensor;
use dflash_core::loops::LoopDetector;
use dflash_core::sampling::{Sampler, SamplingParams};
use dflash_core::visibility::right_aligned_rows;
use dflash_model::cuda::graphed::GraphedBatch;
use dflash_model::ops::sample_rows::{draw_rows, rule_probs, Uniforms};
use dflash_model::{KvCache, Rows, Target};

use super::BatchedOutput;
use crate::decode::one_sync_on;
use crate::Request;

/// Prompts prefilled in one forward on a GPU: bounds the prefill's attention scores
/// (`chunk · heads · P²`) and its host-built masks, whatever the number of slots. On the CPU
/// each prompt is prefilled alone: a left-padded prefill's matmuls sum over the batch's
/// columns, so its rows would differ in their last bits from the prompt's own prefill, and
/// integer products requantize those bits into other tokens. A hybrid target's prompts
/// prefilled together run their linear-attention layers one sequence at a time from each one's
/// first real row (`GdnRowsInput::slot_chains`), so left padding never enters a state.
const PREFILL_CHUNK: usize = 16;

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

/// One sequence in a slot.
pub struct Live {
    /// The caller's name for it.
    pub index: usize,
    sampler: Sampler,
    /// The last sampled token: not in the cache yet, the next step's input.
    next: u32,
    /// Rows of this sequence in the cache = the position of `next`.
    held: usize,
    new_tokens: Vec<u32>,
    loops: LoopDetector,
    /// `next` completed the response's first repeated window.
    looped: bool,
    stop_ids: Vec<u32>,
    max_new_tokens: usize,
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
            stop_ids: req.stop_ids.clone(),
            max_new_tokens: req.max_new_tokens,
        }
    }

    /// A sequence decoded elsewhere so far (a speculative session): `held` rows in its cache,
    /// `new_tokens` sampled (the last one not in the cache), its sampler and loop detector as
    /// they are. Example: prompt 20 tokens, 7 new tokens → held 26, next = new_tokens[6].
    pub(crate) fn resume(
        index: usize,
        req: &Request,
        sampler: Sampler,
        new_tokens: Vec<u32>,
        loops: LoopDetector,
        looped: bool,
    ) -> Self {
        let next = *new_tokens
            .last()
            .expect("a session has sampled its first token");
        Live {
            index,
            sampler,
            next,
            held: req.prompt_ids.len() + new_tokens.len() - 1,
            new_tokens,
            loops,
            looped,
            stop_ids: req.stop_ids.clone(),
            max_new_tokens: req.max_new_tokens,
        }
    }

    /// `tok` sampled: it becomes the next step's input.
    fn push(&mut self, tok: u32) {
        self.new_tokens.push(tok);
        self.next = tok;
        self.held += 1;
        self.looped = self.loops.push(tok);
    }

    fn finished(&self) -> Option<BatchedOutput> {
        let (token, looped) = (self.stop_ids.contains(&self.next), self.looped);
        (token || looped || self.new_tokens.len() >= self.max_new_tokens).then(|| BatchedOutput {
            new_tokens: self.new_tokens.clone(),
            stopped_by_token: token,
            stopped_by_loop: looped && !token,
        })
    }
}

/// A token a slot's sequence sampled, and its output when that ended it.
#[derive(Debug, Clone)]
pub struct Stepped {
    pub index: usize,
    pub token: u32,
    pub done: Option<BatchedOutput>,
}

/// Slots of AR sequences decoded together, one target forward per step.
pub struct Batch<'t> {
    target: &'t Target,
    cache: KvCache,
    slot: Vec<Option<Live>>,
    graph: Option<GraphedBatch>,
    /// Prompts prefilled in one forward ([`Batch::prefill_chunk`]).
    prefill_chunk: usize,
}

impl<'t> Batch<'t> {
    /// `slots` empty slots; with `graph_cap` every step replays one CUDA graph over caches of
    /// that many columns ([`GraphedBatch`]). A hybrid target's slots each keep their sequence's
    /// linear-attention states ([`dflash_model::layers::gdn::GdnSlots`]).
    pub fn new(target: &'t Target, slots: usize, graph_cap: Option<usize>) -> Result<Self> {
        if slots == 0 {
            anyhow::bail!("batched decoding needs at least one slot");
        }
        if graph_cap.is_some() && target.is_hybrid() && target.device.is_cuda() {
            // capturing a step warms it up first and rolls the cache back, which slot states
            // (they keep no rows) cannot do
            anyhow::bail!("CUDA graphs of batched decoding take attention-only targets: run this hybrid target without --cuda-graphs");
        }
        let mut cache = target.new_batched_cache(slots, 64)?;
        let graph = match graph_cap {
            Some(cap) => Some(GraphedBatch::new(&mut cache, cap)?),
            None => None,
        };
        let slot = (0..slots).map(|_| None).collect();
        Ok(Batch {
            target,
            cache,
            slot,
            graph,
            prefill_chunk: match target.device.is_cpu() {
                true => 1,
                false => PREFILL_CHUNK,
            },
        })
    }

    /// The empty slots.
    pub fn free(&self) -> Vec<usize> {
        (0..self.slot.len())
            .filter(|&s| self.slot[s].is_none())
            .collect()
    }

    pub fn live(&self) -> usize {
        self.slot.iter().flatten().count()
    }

    pub fn slots(&self) -> usize {
        self.slot.len()
    }

    /// Prompts prefilled in one forward: [`PREFILL_CHUNK`] on a GPU, one on the CPU.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Prefill `chunk` prompts per forward (the tests run the GPU's left-padded prefills on the
    /// CPU with it).
    pub fn set_prefill_chunk(&mut self, chunk: usize) {
        self.prefill_chunk = chunk.max(1);
    }

    /// Prefill `reqs` (caller's index, request; at most [`Batch::free`]'s count, checked by
    /// [`crate::decode::check_request`]) into free slots, shortest first; each one's first
    /// token, and its output where that token ended it (the slot is then free again).
    pub fn admit(&mut self, reqs: &[(usize, &Request)]) -> Result<Vec<Stepped>> {
        let mut reqs = reqs.to_vec();
        // prompts of similar lengths share a prefill forward: less left padding
        reqs.sort_by_key(|(_, r)| r.prompt_ids.len());
        let mut out = Vec::new();
        for part in reqs.chunks(self.prefill_chunk()) {
            let (fresh, live) = self.prefill(part)?;
            for (j, l) in live.into_iter().enumerate() {
                out.push(self.place(&fresh, j, l)?);
            }
        }
        Ok(out)
    }

    /// Take over a sequence decoded elsewhere: `live` with its rows as sequence 0 of `cache`
    /// (the last `held` columns).
    pub fn adopt(&mut self, cache: &KvCache, live: Live) -> Result<()> {
        anyhow::ensure!(
            cache.len() >= live.held,
            "the adopted cache lacks the sequence's rows"
        );
        let s = self.place(cache, 0, live)?;
        anyhow::ensure!(s.done.is_none(), "an adopted sequence had already ended");
        Ok(())
    }

    /// Lay the batch out over `slots` slots (at least the live sequences, which keep their
    /// order): their rows are copied into a new cache of that many sequences. A step computes
    /// a row for every slot, live or not, so an open batch (the server's) follows its live
    /// count. Example: 16 slots, 3 live in slots 2, 7, 9 → `resize(4)`: they move to slots
    /// 0, 1, 2 and a step computes 4 rows instead of 16. Not with a CUDA graph (its shapes are
    /// fixed).
    pub fn resize(&mut self, slots: usize) -> Result<()> {
        let live = self.live();
        anyhow::ensure!(
            self.graph.is_none(),
            "a batch replayed from a CUDA graph has fixed slots"
        );
        anyhow::ensure!(
            slots >= live.max(1),
            "{slots} slots cannot hold {live} live sequences"
        );
        if slots == self.slot.len() {
            return Ok(());
        }
        let len = self.cache.len();
        let mut cache = self.target.new_batched_cache(slots, 64)?;
        if len > 0 {
            cache.grow_front(len)?;
        }
        let mut slot: Vec<Option<Live>> = Vec::with_capacity(slots);
        for (old, l) in self.slot.iter_mut().enumerate() {
            if let Some(l) = l.take() {
                let (k, n) = (slot.len(), l.held);
                cache.copy_sequence(k, len - n, &self.cache, old, len - n, n)?;
                slot.push(Some(l));
            }
        }
        slot.resize_with(slots, || None);
        self.cache = cache;
        self.slot = slot;
        Ok(())
    }

    /// Free the slot of the caller's `index` (a client that went away); whether it was live.
    pub fn cancel(&mut self, index: usize) -> bool {
        match self
            .slot
            .iter_mut()
            .find(|s| s.as_ref().is_some_and(|l| l.index == index))
        {
            Some(s) => {
                *s = None;
                true
            }
            None => false,
        }
    }

    /// Prefill `part` together (left-padded, right-aligned) into a fresh batched cache; the
    /// sequences with their first token sampled.
    fn prefill(&self, part: &[(usize, &Request)]) -> Result<(KvCache, Vec<Live>)> {
        let _p = tracing::info_span!(target: "phase", "prefill").entered();
        let p = part
            .iter()
            .map(|(_, r)| r.prompt_ids.len())
            .max()
            .unwrap_or(0);
        let (mut tokens, mut positions, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        for (_, r) in part {
            let ids = &r.prompt_ids;
            let pad = p - ids.len();
            tokens.extend(std::iter::repeat_n(ids[0], pad).chain(ids.iter().copied()));
            positions.extend(std::iter::repeat_n(0, pad).chain(0..ids.len()));
            rows.push(intervals(0, 0, ids.len(), p)?);
        }
        // a hybrid target's prompts prefilled together keep their linear-attention states in
        // a batched cache's slots (each from its first real row on: left padding never enters
        // them); alone, in a sequence's own cache
        let mut cache = match (self.target.is_hybrid(), part.len()) {
            (true, b) if b > 1 => self.target.new_batched_cache(b, p)?,
            _ => self.target.new_cache(),
        };
        let out = self.target.forward_batch_intervals(
            &tokens,
            &positions,
            &rows,
            &mut cache,
            &[],
            &Rows::Last,
        )?;
        // a hybrid target's sequence joins a slot with its linear-attention state committed
        cache.settle_linear()?;
        let logits = out.logits.unwrap().squeeze(1)?.to_vec2::<f32>()?;
        let live = part
            .iter()
            .zip(&logits)
            .map(|((i, req), row)| {
                let mut sampler = Sampler::new(req.sampling);
                let first = sampler.sample(row);
                Live::new(*i, sampler, first, req)
            })
            .collect();
        Ok((cache, live))
    }

    /// Copy sequence `j` of `fresh` (its rows end at `fresh`'s last column) into a free slot,
    /// ending at this cache's last column (grown at the front when `fresh` is longer).
    fn place(&mut self, fresh: &KvCache, j: usize, l: Live) -> Result<Stepped> {
        let _p = tracing::info_span!(target: "phase", "refill").entered();
        let stepped = Stepped {
            index: l.index,
            token: l.next,
            done: l.finished(),
        };
        if stepped.done.is_some() {
            return Ok(stepped);
        }
        let s = self
            .slot
            .iter()
            .position(|s| s.is_none())
            .ok_or_else(|| anyhow::anyhow!("no free slot for a new sequence"))?;
        if self.cache.len() < l.held {
            self.cache.grow_front(l.held - self.cache.len())?;
        }
        let (t, n) = (self.cache.len(), l.held);
        self.cache
            .copy_sequence(s, t - n, fresh, j, fresh.len() - n, n)?;
        self.slot[s] = Some(l);
        Ok(stepped)
    }

    /// One forward: every slot feeds one token (a free slot a dummy that sees only itself);
    /// each live sequence's new token, and its output where that ended it (its slot is free
    /// after). Columns no live sequence holds are dropped from the front once they are half
    /// the cache.
    pub fn step(&mut self) -> Result<Vec<Stepped>> {
        if let Some(g) = &self.graph {
            // the captured step writes column `t` of buffers of `cap` columns
            if self.cache.len() + 1 > g.cap() {
                let held = self
                    .slot
                    .iter()
                    .flatten()
                    .map(|l| l.held)
                    .max()
                    .unwrap_or(0);
                self.cache.drop_front(self.cache.len() - held)?;
            }
        }
        let t = self.cache.len();
        let phase = tracing::info_span!(target: "phase", "step mask").entered();
        let (mut tokens, mut positions, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        for s in self.slot.iter() {
            let (tok, held) = s.as_ref().map_or((0, 0), |l| (l.next, l.held));
            tokens.push(tok);
            positions.push(held);
            rows.push(intervals(held, t, 1, 1)?);
        }
        drop(phase);
        let phase = tracing::info_span!(target: "phase", "step forward").entered();
        let logits = match &mut self.graph {
            Some(g) => g.step(self.target, &tokens, &positions, &rows, &mut self.cache)?,
            None => {
                let out = self.target.forward_batch_intervals(
                    &tokens,
                    &positions,
                    &rows,
                    &mut self.cache,
                    &[],
                    &Rows::Last,
                )?;
                out.logits.unwrap().squeeze(1)? // [slots, vocab]
            }
        };
        drop(phase);
        let phase = tracing::info_span!(target: "phase", "sample").entered();
        let next = draw_step(&logits, &mut self.slot)?;
        drop(phase);
        let mut out = Vec::new();
        for (s, tok) in self.slot.iter_mut().zip(next) {
            let Some(l) = s.as_mut() else { continue };
            l.push(tok);
            let done = l.finished();
            out.push(Stepped {
                index: l.index,
                token: tok,
                done: done.clone(),
            });
            if done.is_some() {
                *s = None;
            }
        }
        self.compact()?;
        Ok(out)
    }

    fn compact(&mut self) -> Result<()> {
        let held = self
            .slot
            .iter()
            .flatten()
            .map(|l| l.held)
            .max()
            .unwrap_or(0);
        if self.cache.len() >= 64 && self.cache.len() >= 2 * held {
            let _p = tracing::info_span!(target: "phase", "compact").entered();
            self.cache.drop_front(self.cache.len() - held)?;
        }
        Ok(())
    }
}

/// Each slot's next token from its row of `logits` (`[slots, vocab]`), by the path AR takes
/// for the slot's rule: the arg-max at T = 0; at T > 0 a draw where the logits are (one
/// uniform number of the slot's stream, the probabilities of [`rule_probs`] walked by
/// [`draw_rows`]), the slots of one rule drawn together; with `--disable-kernels one-sync` the
/// host's [`Sampler::sample`] on the row. Only tokens leave the device on the default path;
/// free slots get 0. Example: 256 slots at T = 1 → one `[256, vocab]` draw on the device and
/// 256 tokens read back, instead of 256 rows of logits.
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
