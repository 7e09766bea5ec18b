//! The scheduler's batch, of either kind: AR slots ([`Batch`]: one token per slot and step) or
//! speculative slots ([`SpecBatch`]: each round every slot's drafted chain verified in one
//! forward, or an AR step for all where drafting does not pay at this load). The scheduler sees
//! one interface: requests join, advance a step or round at a time, and leave.

use anyhow::Result;
use dflash_engine::batched::{Batch, Stepped};
use dflash_engine::{Generation, Request, Session, SlotRound, SpecBatch};

/// What a request did in a step, a round or its prefill.
#[derive(Debug)]
pub struct Progress {
    pub index: usize,
    /// The tokens committed now.
    pub tokens: Vec<u32>,
    /// Drafted and accepted tokens of the round (0 for an AR step or a prefill).
    pub drafted: usize,
    pub accepted: usize,
    /// The whole response and whether a stop token (or loop) ended it, when it ended.
    pub done: Option<(Vec<u32>, bool)>,
}

impl From<Stepped> for Progress {
    fn from(s: Stepped) -> Self {
        Progress {
            index: s.index,
            tokens: vec![s.token],
            drafted: 0,
            accepted: 0,
            done: s
                .done
                .map(|o| (o.new_tokens, o.stopped_by_token || o.stopped_by_loop)),
        }
    }
}

impl From<SlotRound> for Progress {
    fn from(r: SlotRound) -> Self {
        Progress {
            index: r.index,
            tokens: r.tokens,
            drafted: r.round.drafted,
            accepted: r.round.accepted,
            done: r.done.map(ended),
        }
    }
}

/// A generation's tokens and whether a stop token (or a loop) ended it.
fn ended(g: Generation) -> (Vec<u32>, bool) {
    let by_token = g.stopped_by_token || g.stopped_by_loop;
    (g.new_tokens, by_token)
}

/// Requests that could not start, with why.
pub type Failed = Vec<(usize, anyhow::Error)>;

/// The running batch.
pub enum Running<'e> {
    Ar(Batch<'e>),
    Spec(SpecBatch<'e>),
}

impl<'e> Running<'e> {
    pub fn live(&self) -> usize {
        match self {
            Running::Ar(b) => b.live(),
            Running::Spec(b) => b.live(),
        }
    }

    pub fn slots(&self) -> usize {
        match self {
            Running::Ar(b) => b.slots(),
            Running::Spec(b) => b.slots(),
        }
    }

    pub fn free(&self) -> usize {
        self.slots() - self.live()
    }

    pub fn resize(&mut self, slots: usize) -> Result<()> {
        match self {
            Running::Ar(b) => b.resize(slots),
            Running::Spec(b) => b.resize(slots),
        }
    }

    /// Prompts one prefill forward takes: the AR batch's ([`Batch::prefill_chunk`]: one on
    /// the CPU, up to 16 on a GPU); the speculative batch prefills one request at a time.
    pub fn prefill_chunk(&self) -> usize {
        match self {
            Running::Ar(b) => b.prefill_chunk(),
            Running::Spec(_) => 1,
        }
    }

    pub fn cancel(&mut self, index: usize) -> bool {
        match self {
            Running::Ar(b) => b.cancel(index),
            Running::Spec(b) => b.cancel(index),
        }
    }

    /// Prefill `reqs` into free slots: each one's first tokens (its response where they ended
    /// it). A request the speculative batch cannot prefill fails alone (its index and error).
    pub fn admit(&mut self, reqs: &[(usize, &Request)]) -> Result<(Vec<Progress>, Failed)> {
        match self {
            Running::Ar(b) => Ok((
                b.admit(reqs)?.into_iter().map(Progress::from).collect(),
                Vec::new(),
            )),
            Running::Spec(b) => {
                let (mut out, mut failed) = (Vec::new(), Vec::new());
                for &(i, r) in reqs {
                    match b.admit(i, r) {
                        Ok((first, done)) => out.push(Progress {
                            index: i,
                            tokens: vec![first],
                            drafted: 0,
                            accepted: 0,
                            done: done.map(ended),
                        }),
                        Err(e) => failed.push((i, e)),
                    }
                }
                Ok((out, failed))
            }
        }
    }

    /// Take over a request that decoded alone so far.
    pub fn adopt(&mut self, index: usize, session: Session<'e>) -> Result<()> {
        match self {
            Running::Ar(b) => {
                let (cache, live) = session.into_live(index)?;
                b.adopt(&cache, live)
            }
            Running::Spec(b) => b.adopt(index, session),
        }
    }

    /// One step (AR) or round (speculative) of every live slot.
    pub fn advance(&mut self) -> Result<Vec<Progress>> {
        Ok(match self {
            Running::Ar(b) => b.step()?.into_iter().map(Progress::from).collect(),
            Running::Spec(b) => b.round()?.into_iter().map(Progress::from).collect(),
        })
    }
}
