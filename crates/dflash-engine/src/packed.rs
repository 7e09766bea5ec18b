//! Packed batch decoding: many independent AR generations share one target cache and one
//! forward per step (data regeneration, where throughput matters and no drafter is involved).
//!
//! The target forward has no batch axis; instead the rows of all live sequences are packed
//! into one cache and every forward gets the packed visibility rule
//! ([`dflash_core::visibility::packed`]): a row sees only the rows of its own sequence, at its
//! own positions. Each sequence therefore computes exactly what [`crate::generate`] in
//! [`crate::Mode::Ar`] computes for it alone (up to float summation order), and samples with
//! its own seeded [`Sampler`], so at T = 0 the tokens are the same.
//!
//! Scheduling is continuous: `slots` sequences are live at a time; when one finishes (stop
//! token or `max_new_tokens`), the next request is prefilled into the freed slot, and the
//! cache drops the rows of finished sequences once they are half of it.
//!
//! Example, slots = 2, requests A (prompt 3 tokens), B (prompt 2), C (prompt 4):
//! prefill A → cache owners [A A A]; prefill B → [A A A B B]; step: rows [a1, b1] at
//! positions [3, 2] → owners [A A A B B A B]; B stops → C is prefilled in its place.

use anyhow::{bail, Result};
use dflash_core::sampling::Sampler;
use dflash_core::visibility::packed;
use dflash_model::{Rows, Target};

use crate::decode::check_request;
use crate::Request;

/// What the caller wants after a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Return now; live sequences are abandoned (e.g. a time limit).
    Stop,
}

/// One finished request of a packed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedOutput {
    pub new_tokens: Vec<u32>,
    pub stopped_by_token: bool,
}

struct Live {
    index: usize,
    sampler: Sampler,
    /// The last sampled token: not in the cache yet, the next step's input.
    next: u32,
    /// Its position.
    pos: usize,
    new_tokens: Vec<u32>,
    /// Cache rows this sequence owns.
    rows: usize,
}

impl Live {
    fn finished(&self, req: &Request) -> Option<bool> {
        if req.stop_ids.contains(&self.next) {
            Some(true)
        } else if self.new_tokens.len() >= req.max_new_tokens {
            Some(false)
        } else {
            None
        }
    }
}

/// Decode `requests` with up to `slots` of them packed into each target forward, calling
/// `done(i, result)` as request `i` finishes (in finishing order; a request the target cannot
/// take, e.g. too long for its context, gets its error); `done` returning [`Flow::Stop`] ends
/// the run at once. Attention-only targets: the
/// linear-attention state of a hybrid target is one sequence's.
pub fn generate_packed(
    target: &Target,
    requests: &[Request],
    slots: usize,
    mut done: impl FnMut(usize, Result<PackedOutput>) -> Result<Flow>,
) -> Result<()> {
    if slots == 0 {
        bail!("packed decoding needs at least one slot");
    }
    if target.is_hybrid() {
        bail!("packed decoding needs an attention-only target: the linear-attention layers of this hybrid target keep one sequence's state (use a batch size of 1)");
    }
    let mut ph = dflash_model::profile::Phases::new(&target.device);
    let result = run(target, requests, slots, &mut done, &mut ph);
    if ph.enabled() {
        eprintln!("packed decoding, time per phase:\n{}", ph.report());
    }
    result
}

fn run(
    target: &Target,
    requests: &[Request],
    slots: usize,
    done: &mut impl FnMut(usize, Result<PackedOutput>) -> Result<Flow>,
    ph: &mut dflash_model::profile::Phases,
) -> Result<()> {
    let mut cache = target.new_cache();
    // owner[r]: the request whose sequence cache row r belongs to
    let mut owner: Vec<usize> = Vec::new();
    let mut dead_rows = 0usize;
    let mut live: Vec<Live> = Vec::new();
    let mut queue = 0..requests.len();
    loop {
        // 1. fill free slots: prefill each new prompt alone (its rows see only themselves)
        while live.len() < slots {
            let Some(i) = queue.next() else { break };
            let req = &requests[i];
            if let Err(e) = check_request(target, req) {
                if done(i, Err(e))? == Flow::Stop {
                    return Ok(());
                }
                continue;
            }
            let n = req.prompt_ids.len();
            let positions: Vec<usize> = (0..n).collect();
            let out = target.forward(
                &req.prompt_ids,
                &positions,
                &packed(&owner, &vec![i; n]),
                &mut cache,
                &[],
                &Rows::Last,
            )?;
            owner.extend(std::iter::repeat_n(i, n));
            let mut sampler = Sampler::new(req.sampling);
            let first = sampler.sample(&out.logits.unwrap().get(0)?.to_vec1::<f32>()?);
            ph.mark("prefill");
            let l = Live {
                index: i,
                sampler,
                next: first,
                pos: n,
                new_tokens: vec![first],
                rows: n,
            };
            match l.finished(req) {
                Some(stopped) => {
                    dead_rows += l.rows;
                    let out = PackedOutput {
                        new_tokens: l.new_tokens,
                        stopped_by_token: stopped,
                    };
                    if done(i, Ok(out))? == Flow::Stop {
                        return Ok(());
                    }
                }
                None => live.push(l),
            }
        }
        if live.is_empty() {
            return Ok(());
        }
        // 2. one step: every live sequence feeds its last token at its own position
        let tokens: Vec<u32> = live.iter().map(|l| l.next).collect();
        let positions: Vec<usize> = live.iter().map(|l| l.pos).collect();
        let ids: Vec<usize> = live.iter().map(|l| l.index).collect();
        let mask = packed(&owner, &ids);
        ph.mark("step mask");
        let out = target.forward(&tokens, &positions, &mask, &mut cache, &[], &Rows::All)?;
        owner.extend_from_slice(&ids);
        ph.mark("step forward");
        let logits = out.logits.unwrap().to_vec2::<f32>()?;
        ph.mark("logits to host");
        // 3. sample, retire the finished sequences
        let mut still = Vec::with_capacity(live.len());
        for (mut l, row) in live.into_iter().zip(&logits) {
            let t = l.sampler.sample(row);
            l.new_tokens.push(t);
            l.next = t;
            l.pos += 1;
            l.rows += 1;
            match l.finished(&requests[l.index]) {
                Some(stopped) => {
                    dead_rows += l.rows;
                    let out = PackedOutput {
                        new_tokens: l.new_tokens,
                        stopped_by_token: stopped,
                    };
                    if done(l.index, Ok(out))? == Flow::Stop {
                        return Ok(());
                    }
                }
                None => still.push(l),
            }
        }
        live = still;
        ph.mark("sample");
        // 4. drop finished sequences' rows once they are half the cache
        if dead_rows > 0 && 2 * dead_rows >= owner.len() {
            let alive: std::collections::HashSet<usize> = live.iter().map(|l| l.index).collect();
            let keep: Vec<usize> = (0..owner.len())
                .filter(|&r| alive.contains(&owner[r]))
                .collect();
            if keep.is_empty() {
                cache = target.new_cache();
            } else {
                cache.keep_rows(&keep)?;
            }
            owner = keep.iter().map(|&r| owner[r]).collect();
            dead_rows = 0;
            ph.mark("compact");
        }
    }
}
