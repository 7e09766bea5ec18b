//! The scheduler: one thread owns the models and decodes every request, a round or a step at
//! a time, and sends each request's tokens to its handler as they are committed.
//!
//! - A request alone, with a drafter, decodes speculatively (a [`Session`] of the server's
//!   mode, `auto` by default: each round the budget that pays on this machine, an AR step
//!   where none does).
//! - Several requests decode in one continuously scheduled batch ([`Running`]): requests join
//!   between steps (prefilled into free slots) and leave when they end or their client goes
//!   away; when a request arrives while another decodes alone, that one moves into the batch.
//!   An AR batch ([`Batch`]) takes one token per slot and step. A speculative batch
//!   (`--batch-speculation`, [`SpecBatch`]) verifies every slot's drafted chain in one forward
//!   each round, or takes an AR step for all where drafting does not pay at this many slots
//!   (`--mode auto`). The AR batch is the default: on the CPU a verify's rows cost about what
//!   as many AR rows cost, and on a GPU the bundled SmolLM2 drafter is not right often enough
//!   on chat for a draft forward and a verify to beat the AR batch's step.
//! - `--max-batch 1` decodes one request at a time; the others wait in the queue.
//!
//! Every path is lossless: at T = 0 a response is AR's tokens whatever else is in the batch
//! (tests/serve.rs checks concurrency 1, 4 and 16 against `generate --mode ar`,
//! tests/serve_spec_batch.rs the speculative batch).
//!
//! Example, `--max-batch 4`, requests A then B while A decodes: A starts alone (prefill, then
//! speculative rounds, each sending 1 … B tokens); B arrives → A's cache moves into slot 0, B is
//! prefilled into slot 1, and each step sends one token to each; A ends → B goes on alone in
//! the batch.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use dflash_engine::batched::Batch;
use dflash_engine::decode::check_request;
use dflash_engine::{DecodeOptions, Mode, Request, Session, SpecBatch};
use dflash_model::models::drafter::Drafter;
use dflash_model::Target;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::{Metrics, Outcome};
use crate::running::{Progress, Running};

/// The models and how they decode.
pub struct Engine {
    pub target: Target,
    pub drafter: Option<Drafter>,
    /// The mode of a request decoding alone (its block from the drafter).
    pub mode: Mode,
    /// Slots of the batch.
    pub max_batch: usize,
    /// Whether several requests decode in a speculative batch (each round their drafted
    /// chains verified in one forward, or an AR step for all, [`SpecBatch`]) rather than as AR
    /// ([`Batch`]). Needs a drafter and an attention-only target.
    pub batch_speculation: bool,
    pub opts: DecodeOptions,
}

/// A request for the scheduler.
pub struct Job {
    pub req: Request,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

/// What the scheduler tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Tokens committed since the last event.
    Tokens(Vec<u32>),
    Done(Finished),
    Failed(String),
}

/// How a request ended.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finished {
    /// A stop token or a loop window ("stop"), else the length ("length").
    pub by_token: bool,
    pub spec: SpecStats,
}

/// The `speculative_decoding` object of a response: its rounds (target forwards after the
/// prefill), τ = tokens they committed per round, the drafted and accepted tokens, and per
/// draft position the share of drafting rounds that accepted it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SpecStats {
    pub tau: f64,
    pub rounds: usize,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    pub acceptance_per_position: Vec<f64>,
    #[serde(skip)]
    committed: usize,
    #[serde(skip)]
    drafting_rounds: usize,
    #[serde(skip)]
    accepted_at: Vec<usize>,
}

impl SpecStats {
    fn round(&mut self, drafted: usize, accepted: usize, committed: usize) {
        self.rounds += 1;
        self.committed += committed;
        if drafted > 0 {
            self.drafting_rounds += 1;
            self.drafted_tokens += drafted;
            self.accepted_tokens += accepted;
            if self.accepted_at.len() < accepted {
                self.accepted_at.resize(accepted, 0);
            }
            for a in &mut self.accepted_at[..accepted] {
                *a += 1;
            }
        }
    }

    fn close(mut self) -> Self {
        self.tau = match self.rounds {
            0 => 0.0,
            r => self.committed as f64 / r as f64,
        };
        let d = self.drafting_rounds.max(1) as f64;
        self.acceptance_per_position = self.accepted_at.iter().map(|&a| a as f64 / d).collect();
        self
    }
}

/// A request being decoded.
struct Active {
    job: Job,
    sent: usize,
    last: Instant,
    spec: SpecStats,
}

/// Run the scheduler until `jobs` closes and every request in flight has ended.
pub fn run(engine: Engine, jobs: Receiver<Job>, metrics: Arc<Metrics>, queued: Arc<AtomicUsize>) {
    let batchable = engine.max_batch > 1;
    let mut s = Sched {
        e: &engine,
        batch: None,
        solo: None,
        active: HashMap::new(),
        waiting: VecDeque::new(),
        next_id: 0,
        metrics,
        queued,
        batchable,
    };
    let mut open = true;
    loop {
        if open {
            open = s.receive(&jobs);
        }
        if !open && s.active.is_empty() && s.waiting.is_empty() {
            return;
        }
        s.drop_gone();
        s.admit();
        s.advance();
        s.metrics.queue(s.active.len(), s.waiting.len());
    }
}

struct Sched<'e> {
    e: &'e Engine,
    batch: Option<Running<'e>>,
    solo: Option<(usize, Session<'e>)>,
    active: HashMap<usize, Active>,
    waiting: VecDeque<(usize, Job)>,
    next_id: usize,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
    batchable: bool,
}

impl<'e> Sched<'e> {
    /// Take the requests that arrived (waiting for one when idle); false once the channel
    /// closed (the server is shutting down).
    fn receive(&mut self, jobs: &Receiver<Job>) -> bool {
        if self.active.is_empty() && self.waiting.is_empty() {
            match jobs.recv() {
                Ok(j) => self.enqueue(j),
                Err(_) => return false,
            }
        }
        loop {
            match jobs.try_recv() {
                Ok(j) => self.enqueue(j),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    fn enqueue(&mut self, j: Job) {
        self.waiting.push_back((self.next_id, j));
        self.next_id += 1;
    }

    /// Leave the queue or the batch: `id` waited or decoded for a client that went away.
    fn drop_gone(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|(_, j)| !j.events.is_closed());
        for _ in self.waiting.len()..before {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.request(Outcome::Abort);
        }
        let gone: Vec<usize> = (self.active.iter())
            .filter(|(_, a)| a.job.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.active.remove(&id);
            self.metrics.request(Outcome::Abort);
            if self.solo.as_ref().is_some_and(|(s, _)| *s == id) {
                self.solo = None;
            } else if let Some(b) = self.batch.as_mut() {
                b.cancel(id);
            }
        }
    }

    /// Start the waiting requests the slots can take.
    fn admit(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        let live = self.batch.as_ref().map_or(0, |b| b.live());
        let alone = self.solo.is_none() && live == 0;
        if !self.batchable || (alone && self.waiting.len() == 1 && self.e.mode.block() > 1) {
            if self.solo.is_none() && live == 0 {
                let (id, job) = self.waiting.pop_front().expect("a waiting request");
                self.start_solo(id, job);
            }
            return;
        }
        // the slots follow the live count: a step computes a row for every slot
        let want = (live + self.solo.is_some() as usize + self.waiting.len()).min(self.e.max_batch);
        let laid_out = match self.batch.as_mut() {
            None => self.new_batch(want.max(1)).map(|b| self.batch = Some(b)),
            Some(b) if b.slots() < want => b.resize(want),
            Some(_) => Ok(()),
        };
        if let Err(e) = laid_out {
            return self.fail_waiting(&e.to_string());
        }
        if let Some((id, session)) = self.solo.take() {
            self.move_into_batch(id, session);
        }
        let free = self.batch.as_ref().map_or(0, |b| b.free());
        let n = free.min(self.waiting.len());
        let jobs: Vec<(usize, Job)> = self.waiting.drain(..n).collect();
        let mut reqs = Vec::new();
        for (id, job) in jobs {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            if let Err(e) = check_request(&self.e.target, &job.req) {
                let _ = job.events.send(Event::Failed(e.to_string()));
                self.metrics.request(Outcome::Abort);
                continue;
            }
            self.metrics.prompt(job.req.prompt_ids.len());
            self.active.insert(id, Active::new(job));
            reqs.push(id);
        }
        self.prefill(reqs);
    }

    /// Prefill admitted requests (their ids in `active`) into the batch: shortest first, a prefill
    /// forward's worth at a time, each part's first tokens sent before the next part's prefill
    /// (with 16 prompts prefilled one by one on the CPU, the k-th waits for k prefills, not
    /// for all 16). A part that fails to prefill fails its requests alone.
    fn prefill(&mut self, mut reqs: Vec<usize>) {
        reqs.sort_by_key(|id| self.active[id].job.req.prompt_ids.len());
        let chunk = self.batch.as_ref().map_or(1, |b| b.prefill_chunk());
        for ids in reqs.chunks(chunk) {
            let part: Vec<(usize, &Request)> = ids
                .iter()
                .map(|&id| (id, &self.active[&id].job.req))
                .collect();
            let admitted = self.batch.as_mut().expect("a batch").admit(&part);
            match admitted {
                Ok((progress, failed)) => {
                    self.deliver(progress, true);
                    for (id, e) in failed {
                        self.fail(id, &format!("prefill failed: {e}"));
                    }
                }
                Err(e) => {
                    for &id in ids {
                        self.fail(id, &format!("prefill failed: {e}"));
                    }
                }
            }
        }
    }

    /// A batch of `slots` slots of the engine's kind.
    fn new_batch(&self, slots: usize) -> anyhow::Result<Running<'e>> {
        let e = self.e;
        match (e.batch_speculation, e.drafter.as_ref()) {
            (true, Some(d)) => SpecBatch::new(&e.target, Some(d), e.mode, slots).map(Running::Spec),
            _ => Batch::new(&e.target, slots, None).map(Running::Ar),
        }
    }

    fn start_solo(&mut self, id: usize, job: Job) {
        self.queued.fetch_sub(1, Ordering::SeqCst);
        let drafter = self.e.drafter.as_ref();
        let mode = match drafter {
            Some(_) => self.e.mode,
            None => Mode::Ar,
        };
        match Session::start(&self.e.target, drafter, mode, &job.req, self.e.opts, None) {
            Ok(session) => {
                self.metrics.prompt(job.req.prompt_ids.len());
                self.active.insert(id, Active::new(job));
                self.solo = Some((id, session));
                self.send_solo();
            }
            Err(e) => {
                let _ = job.events.send(Event::Failed(e.to_string()));
                self.metrics.request(Outcome::Abort);
            }
        }
    }

    fn move_into_batch(&mut self, id: usize, session: Session<'e>) {
        if session.done() {
            return self.finish_solo(id, session);
        }
        let moved = self.batch.as_mut().expect("a batch").adopt(id, session);
        if let Err(e) = moved {
            self.fail(id, &format!("moving into the batch failed: {e}"));
        }
    }

    /// One round of the request alone, or one step of the batch.
    fn advance(&mut self) {
        if let Some((id, session)) = self.solo.as_mut() {
            let id = *id;
            match session.round() {
                Ok(Some(r)) => {
                    let (d, a, c) = (r.drafted, r.accepted, r.tau_round);
                    self.metrics.draft(d, a);
                    if let Some(act) = self.active.get_mut(&id) {
                        act.spec.round(d, a, c);
                    }
                    self.send_solo();
                }
                Ok(None) => self.send_solo(),
                Err(e) => {
                    self.solo = None;
                    self.fail(id, &format!("decoding failed: {e}"));
                }
            }
            return;
        }
        let Some(b) = self.batch.as_mut() else { return };
        if b.live() == 0 {
            return;
        }
        match b.advance() {
            Ok(progress) => {
                self.metrics
                    .batch_round(progress.iter().any(|p| p.drafted > 0));
                self.deliver(progress, false);
                self.shrink();
            }
            Err(e) => {
                // the batch's state is unknown: every request in it fails
                self.batch = None;
                let ids: Vec<usize> = self.active.keys().copied().collect();
                for id in ids {
                    self.fail(id, &format!("decoding failed: {e}"));
                }
            }
        }
    }

    /// Halve the batch's slots once half of them are free (its live sequences copied: halving
    /// keeps the copies at a constant share of the steps).
    fn shrink(&mut self) {
        let Some(b) = self.batch.as_mut() else { return };
        let live = b.live().max(1);
        if 2 * live <= b.slots() {
            if let Err(e) = b.resize(live) {
                tracing::warn!("the batch keeps its slots: {e:#}");
            }
        }
    }

    /// Send the solo session's new tokens; end it when it is done.
    fn send_solo(&mut self) {
        let Some((id, session)) = self.solo.as_ref() else {
            return;
        };
        let id = *id;
        let (tokens, done) = (session.new_tokens().to_vec(), session.done());
        self.send(id, &tokens);
        if done {
            let (_, session) = self.solo.take().expect("the solo session");
            self.finish_solo(id, session);
        }
    }

    fn finish_solo(&mut self, id: usize, session: Session<'e>) {
        let g = session.finish(None);
        self.send(id, &g.new_tokens);
        self.finish(id, g.stopped_by_token || g.stopped_by_loop);
    }

    /// Tokens of batch slots (`first`: from their prefill).
    fn deliver(&mut self, progress: Vec<Progress>, first: bool) {
        for p in progress {
            if let (Some(a), false) = (self.active.get_mut(&p.index), first) {
                a.spec.round(p.drafted, p.accepted, p.tokens.len());
                self.metrics.draft(p.drafted, p.accepted);
            }
            match p.done {
                Some((all, by_token)) => {
                    self.send(p.index, &all);
                    self.finish(p.index, by_token);
                }
                None => self.push(p.index, p.tokens),
            }
        }
    }

    /// Send the tokens of `all` (the response so far) the client has not had.
    fn send(&mut self, id: usize, all: &[u32]) {
        let sent = self.active.get(&id).map_or(usize::MAX, |a| a.sent);
        if all.len() > sent {
            self.push(id, all[sent..].to_vec());
        }
    }

    /// Send `new` tokens to the client of `id`.
    fn push(&mut self, id: usize, new: Vec<u32>) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        let now = Instant::now();
        let first = a.sent == 0;
        let since = match first {
            true => a.job.arrived,
            false => a.last,
        };
        self.metrics
            .tokens(new.len(), (now - since).as_secs_f64(), first);
        a.sent += new.len();
        a.last = now;
        let _ = a.job.events.send(Event::Tokens(new));
    }

    fn finish(&mut self, id: usize, by_token: bool) {
        let Some(a) = self.active.remove(&id) else {
            return;
        };
        // the gauges before the client can see its end
        self.metrics.queue(self.active.len(), self.waiting.len());
        self.metrics.request(match by_token {
            true => Outcome::Stop,
            false => Outcome::Length,
        });
        let _ = a.job.events.send(Event::Done(Finished {
            by_token,
            spec: a.spec.close(),
        }));
    }

    fn fail(&mut self, id: usize, why: &str) {
        if let Some(a) = self.active.remove(&id) {
            tracing::error!("request {id}: {why}");
            self.metrics.queue(self.active.len(), self.waiting.len());
            self.metrics.request(Outcome::Abort);
            let _ = a.job.events.send(Event::Failed(why.to_string()));
        }
    }

    fn fail_waiting(&mut self, why: &str) {
        for (_, job) in self.waiting.drain(..) {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.request(Outcome::Abort);
            let _ = job.events.send(Event::Failed(why.to_string()));
        }
    }
}

impl Active {
    fn new(job: Job) -> Self {
        Active {
            last: job.arrived,
            job,
            sent: 0,
            spec: SpecStats::default(),
        }
    }
}
