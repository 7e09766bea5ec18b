//! The decoding loop: AR (block 1), DFlash chains (block B) and DDTree trees are one loop.
//!
//! A round proposes a [`DraftTree`] (AR: the root alone; DFlash: the chain of the drafter's
//! argmax tokens; DDTree: the best-first tree under a node budget), verifies it in ONE target
//! forward with the ancestor-only mask (for a chain that is the causal mask), walks it with
//! the target's own samples, commits the accepted path and the bonus, and compacts the
//! target cache to the committed rows (for a chain: a truncation).
//!
//! The chain case, step by step:
//! Each round, with the anchor `x` (the last committed token, not yet in the target cache)
//! at position `s`:
//! 1. draft: the drafter sees the committed context features (positions `< s`) and the block
//!    `[x, mask × (B-1)]`, and proposes `d1 … d(B-1)` (argmax of rows 1 … B-1);
//! 2. verify: ONE target forward over `[x, d1 … d(B-1)]` at positions `s … s+B-1` (causal
//!    over the committed cache), with taps;
//! 3. accept: walk k = 1, 2, …: the target samples its own token `t_k` at row k-1 (given
//!    the committed prefix and d1 … d(k-1)); while `t_k == d_k`, accept `d_k`; the first
//!    `t_k` that differs (or `t_B` after a full accept) is the bonus;
//! 4. commit `d1 … d_a` and the bonus; truncate the target cache to the rows of `x, d1 … d_a`
//!    (the bonus is the next anchor); the next context features are the taps of those rows.
//!
//! Example: prompt of 20 tokens, first token x at 20, B = 4, drafts (a, b, c), target samples
//! (a, b, z, ·) → accepted 2, bonus z, committed [a, b, z], cache truncated to 23 rows
//! (positions 0..=22: prompt, x, a, b), next anchor z at position 23, τ_round 3.
//!
//! **Why this is lossless.** At T = 0 every committed token is the target's argmax given
//! exactly the committed prefix before it: `d_k` is committed only if it equals the target's
//! token `t_k` at that prefix, and the bonus *is* `t_k`, so the output equals AR token for
//! token. At T > 0 a chain by default draws its drafts from the drafter's distribution `q` and
//! keeps `d_k` with probability min(1, p(d_k)/q(d_k)), the bonus drawn from the residual
//! max(0, p − q) (speculative sampling, [`dflash_core::acceptance`]): each committed token is
//! distributed as the target's own sample. A DDTree at T > 0 draws its tokens without
//! replacement from the drafter's distributions and walks each node's children by recursive
//! rejection sampling ([`dflash_core::sampled_tree`]). With [`Acceptance::ExactMatch`] the
//! drafts are greedy (a tree of the top-K) and kept while they equal the target's own sample:
//! also exact, but it accepts less at T ≈ 1.
//!
//! **A round on the device.** A chain of a drafter without a selector, greedy or sampled (any
//! temperature, top-k and top-p: [`dflash_model::ops::sample_rows::rule_probs`]), keeps its
//! round on the device: the drafts (the drafter's
//! arg-max, or under the residual rule its draws) become the verify's token ids there, and the
//! verify reads back in one transfer the drafts and either the target's token per row (its
//! arg-max at T = 0, its draw under the exact match) or each draft's verdict and bonus and the
//! last row's draw. At T > 0 such a round draws its uniform numbers up front (`3n + 1` for n
//! drafts under the residual rule, `n + 1` under the exact match): the same distribution as
//! the host's walk, another use of the seeded stream (AR at T > 0 draws its one number per
//! token as before, on the device, walking the vocabulary in token order; batched decoding
//! draws the same way). A DDTree under the exact match draws the target's token at every
//! verify row on the device too (one index per row leaves it); under the residual rule its
//! sampled tree is drawn and walked there ([`dflash_model::ops::sampled_tree`]): K values per
//! depth (the shape) and a few draws per depth leave the device after the draft, the path and
//! the bonus after the verify.
//!
//! **DFlash2 drafters** propose through their candidate selector ([`dflash_core::selector`]):
//! the chain is the selector's greedy walk at T = 0 and its sampled walk at T > 0 (the
//! rejection rule then judges each draft against the selector's `q` over its candidates, as
//! z-lab's `_rejection_sample` does); a DDTree at T = 0 is built best-first from the
//! selector's candidates ranked after each node's own token; a DDTree at T > 0 draws from the
//! draft logits as for a DFlash drafter.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Tensor;
use dflash_core::loops::LoopDetector;
use dflash_core::sampled_tree::{place_draws, sampled_shape};
use dflash_core::sampling::{Sampler, SamplingParams};
use dflash_core::selector;
use dflash_core::stats::RoundOutcome;
use dflash_core::tree::DraftTree;
use dflash_model::cuda::graphed::{GraphedForward, Staged};
use dflash_model::cuda::graphed_draft::GraphedDraft;

use crate::graph_cache::{self, GraphCache, Kept};
use dflash_model::models::draft_vocab::DraftHead;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_model::models::target::ForwardInputs;
use dflash_model::ops::sample_rows::{draw_rows, judge_rows, rule_probs, Uniforms};
use dflash_model::ops::sampled_tree::{draw_distinct, walk_sampled_tree};
use dflash_model::ops::top_k::top_k_rows;
use dflash_model::{KvCache, Rows, Target, TargetOutput};

pub use crate::mode::Mode;

mod propose;
mod session;
mod verify;

pub use session::Session;

/// A round's drafts drawn from the drafter's distributions, with what the walk judges them by.
enum Sampled {
    /// A chain: the distribution of each draft.
    Chain(Vec<Vec<f32>>),
    /// A tree with its per-depth distributions.
    Tree(dflash_core::sampled_tree::SampledTree),
    /// A tree drawn where the logits are: each depth's draft distribution (`[depths, vocab]`,
    /// there) and the round's uniform numbers (the draws', then the walk's from `from`).
    TreeOnDevice { q: Tensor, u: Uniforms, from: usize },
}

/// A chain round kept on the device: its drafts (`[n]` u32, the verify's ids) and how the
/// verify's rows decide them.
struct DeviceRound {
    drafts: Tensor,
    judged_by: OnDevice,
    /// The verify's inputs, uploaded before the draft ran (an upload waits for the device's
    /// queue: after the draft, it would wait for the draft).
    staged: StagedVerify,
}

/// How a round on the device decides its drafts from the verify's rows.
enum OnDevice {
    /// T = 0: the target's arg-max of every row.
    Argmax,
    /// The exact match at T > 0: the target's own draw at every row (`n + 1` uniform numbers,
    /// one per row); the walk keeps a draft while it equals the draw of the row before it.
    Draws(Uniforms),
    /// The residual rule: the drafter's distributions `[n, vocab]` the drafts were drawn
    /// from, with the round's uniform numbers (`3n + 1`: the drafts' draws, then the
    /// verdicts', then the bonuses', then the last row's draw).
    Judge(Tensor, Uniforms),
}

/// A verify's inputs built and uploaded ahead of its forward.
enum StagedVerify {
    Graphed(Staged),
    Eager(ForwardInputs),
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_ids: Vec<u32>,
    /// End the response at its first repeated window of this many tokens
    /// ([`dflash_core::loops`]; 0: never). Example: 3 and new tokens `a b c d a b c …` → the
    /// generation stops after the second `c`.
    pub loop_window: usize,
}

/// What one generation did: the new tokens and every round.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Generation {
    pub new_tokens: Vec<u32>,
    pub rounds: Vec<RoundOutcome>,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    pub stopped_by_token: bool,
    /// Ended at its first repeated window ([`Request::loop_window`]).
    pub stopped_by_loop: bool,
    /// `--mode auto`'s choices: the budgets, predicted against accepted drafts, the round-cost
    /// model it measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto: Option<dflash_core::auto::AutoStats>,
}

/// `--disable-kernels prompt-vocab`: a drafter's vocabulary subset without the prompt's tokens
/// (the reference of `bench/draft_vocab_prompt.sh`).
fn prompt_tokens_off() -> bool {
    dflash_core::runtime::off(dflash_core::runtime::Kernel::PromptVocab)
}

/// Whether rounds read the device once (`--disable-kernels one-sync`: the host's path, for A/B
/// measurements).
pub(crate) fn one_sync_on() -> bool {
    !dflash_core::runtime::off(dflash_core::runtime::Kernel::OneSync)
}

/// Why a generation cannot start.
pub fn check_request(target: &Target, req: &Request) -> Result<()> {
    if req.prompt_ids.is_empty() {
        bail!("the prompt is empty");
    }
    let ctx = target.config.max_position_embeddings;
    if req.prompt_ids.len() + req.max_new_tokens > ctx {
        bail!(
            "prompt ({} tokens) + max_new_tokens ({}) exceeds the target's context length ({ctx})",
            req.prompt_ids.len(),
            req.max_new_tokens
        );
    }
    if req.max_new_tokens == 0 {
        bail!("max_new_tokens must be >= 1");
    }
    Ok(())
}

/// Row `r` of `[n, vocab]` logits as a host vector.
fn row(logits: &Tensor, r: usize) -> Result<Vec<f32>> {
    Ok(logits.get(r)?.to_vec1::<f32>()?)
}

/// Keep the committed cache rows `0 .. cache_len` and the tree rows `kept` (indices into the
/// rows appended by the last verify, in path order). A chain's kept rows are a prefix, which
/// is a plain truncation. Example: cache 40, tree path rows [0, 2, 5] → rows 0..40, 40, 42, 45.
pub fn compact_cache(cache: &mut KvCache, cache_len: usize, kept: &[usize]) -> Result<()> {
    if kept.iter().enumerate().all(|(i, &r)| i == r) {
        cache.truncate(cache_len + kept.len())?;
    } else {
        let rows: Vec<usize> = (0..cache_len)
            .chain(kept.iter().map(|&r| cache_len + r))
            .collect();
        cache.keep_rows(&rows)?;
    }
    Ok(())
}

/// How the loop runs: its target forwards, and which acceptance rule a chain uses at T > 0
/// (both rules are lossless; the output distribution is the target's either way).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Verify forwards through [`GraphedForward`]: the cache gets a fixed capacity of
    /// `prompt + max_new_tokens` rows plus one verify's and each verify row count is captured into a CUDA graph
    /// once and replayed after; and the draft block through [`GraphedDraft`] (the drafter's
    /// cache at a fixed capacity, one graph for every round after the first). On the CPU: the
    /// same fixed-shape forwards, no graphs.
    pub cuda_graphs: bool,
    pub acceptance: Acceptance,
    /// The host's path for every round: a chain's drafts read back after the draft, and at
    /// T > 0 the rows' logits sampled on the host, instead of the round on the device (one
    /// read per round, [`dflash_model::ops::sample_rows`]); the environment's
    /// `DFLASH_DISABLED_KERNELS=one-sync` sets this too. At T = 0 the tokens are the same either way; at
    /// T > 0 the distribution is (the seed draws other tokens).
    pub drafts_to_host: bool,
}

/// How drafts are accepted at T > 0 (at T = 0 both are the exact match of argmaxes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Acceptance {
    /// Speculative sampling: a chain's drafts drawn from the drafter's distribution, kept with
    /// probability min(1, p/q), the bonus from the residual ([`dflash_core::acceptance`]), as
    /// z-lab's `dflash_generate`; a DDTree's tokens drawn without replacement and walked by
    /// recursive rejection sampling ([`dflash_core::sampled_tree`]).
    #[default]
    Residual,
    /// Greedy drafts (a DDTree of the top-K), kept while they equal the target's own sample.
    ExactMatch,
}

impl std::fmt::Display for Acceptance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Acceptance::Residual => "residual",
            Acceptance::ExactMatch => "exact-match",
        })
    }
}

impl std::str::FromStr for Acceptance {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "residual" => Ok(Acceptance::Residual),
            "exact-match" => Ok(Acceptance::ExactMatch),
            x => Err(format!(
                "unknown acceptance rule '{x}': residual or exact-match"
            )),
        }
    }
}

/// Generate: prefill, then rounds of propose → verify → walk → commit until `max_new_tokens`
/// or a stop token. Modes other than [`Mode::Ar`] need a drafter.
pub fn generate(
    target: &Target,
    drafter: Option<&Drafter>,
    mode: Mode,
    req: &Request,
    opts: DecodeOptions,
) -> Result<Generation> {
    session::run_generation(target, drafter, mode, req, opts, None)
}

/// [`generate`] keeping its fixed-shape forwards (with [`DecodeOptions::cuda_graphs`]: the
/// caches at a fixed capacity and their CUDA graphs) in `graphs` for the next generation of
/// the same target, drafter and mode, and starting from the ones kept there
/// ([`crate::graph_cache`]). The tokens are [`generate`]'s.
pub fn generate_with(
    target: &Target,
    drafter: Option<&Drafter>,
    mode: Mode,
    req: &Request,
    opts: DecodeOptions,
    graphs: &mut GraphCache,
) -> Result<Generation> {
    session::run_generation(target, drafter, mode, req, opts, Some(graphs))
}

/// Rows of every verify forward of `mode` (shorter ones are padded): the block, or a tree's
/// budget plus its root (a tree's rows outnumber its depths).
fn verify_rows(mode: Mode) -> usize {
    match mode {
        Mode::Tree { budget, .. } => budget + 1,
        Mode::Auto { max_budget, .. } => max_budget + 1,
        _ => mode.block(),
    }
}

/// `--mode auto`'s state: the policy, and this round's choice.
struct AutoRound {
    policy: dflash_core::auto::AutoPolicy,
    /// Whether this round drafted, its budget and the drafter's raw expectation for it.
    drafted: bool,
    budget: usize,
    expected: f64,
}

/// The state of one generation between rounds.
struct Decoding<'a> {
    target: &'a Target,
    /// The drafter, when the mode drafts (block > 1).
    drafter: Option<&'a Drafter>,
    mode: Mode,
    req: Request,
    taps: Vec<usize>,
    sampler: Sampler,
    cache: KvCache,
    /// Fixed-shape verify forwards (`--cuda-graphs`).
    graphed: Option<GraphedForward>,
    /// The drafter's cache and its vocabulary head (once per decode).
    draft_cache: Option<KvCache>,
    /// The draft block's fixed-shape forward (`--cuda-graphs`).
    draft_graph: Option<GraphedDraft>,
    /// Whether the fixed-shape forwards go back to a [`GraphCache`] at the end
    /// ([`Decoding::kept`] gathers them), and whether they came from one.
    keep: bool,
    reused: bool,
    head: Option<DraftHead>,
    /// Context features committed since the drafter last ran, `[1, m, taps × hidden]`.
    ctx: Option<Tensor>,
    /// The chain's acceptance at T > 0.
    acceptance: Acceptance,
    /// The drafter's distribution of each draft of this round, dense over the vocabulary, when
    /// the drafts were sampled (speculative sampling).
    /// The round's drafts when they were drawn from the drafter's distributions (T > 0 with
    /// the residual rule): the walk judges them against those distributions.
    sampled: Option<Sampled>,
    /// The round kept on the device ([`Decoding::round_on_device`]) between its draft and its
    /// verify.
    device_round: Option<DeviceRound>,
    /// What the verify of such a round read back: its drafts, then (T = 0) the target's token
    /// per row or (T > 0) each draft's verdict and bonus and the last row's draw.
    read_back: Option<Vec<u32>>,
    /// Whether rounds stay on the device where they can (`DFLASH_DISABLED_KERNELS=one-sync`: no).
    one_sync: bool,
    /// `--mode auto`'s policy and this round's choice.
    auto: Option<AutoRound>,
    /// Whether the drafter ran this round (it then took the context features in `ctx`; a round
    /// without a draft adds its rows to them).
    drafted: bool,
    /// Position of the anchor: the last committed token, not yet in the target cache.
    start: usize,
    new_tokens: Vec<u32>,
    rounds: Vec<RoundOutcome>,
    /// The generation ended: a stop token, or its first repeated window (`looped`).
    stopped: bool,
    looped: bool,
    loops: LoopDetector,
    prefill_secs: f64,
}

impl<'a> Decoding<'a> {
    /// Check the request, prefill the whole prompt (causal, taps of every prompt row) and
    /// sample the first token: the first round's anchor.
    fn prefill(
        target: &'a Target,
        drafter: Option<&'a Drafter>,
        mode: Mode,
        req: &Request,
        opts: DecodeOptions,
        kept: Option<Kept>,
        keep: bool,
    ) -> Result<Self> {
        check_request(target, req)?;
        let block_size = mode.block();
        if block_size == 0 {
            bail!("block size must be >= 1");
        }
        if let Mode::Tree { budget: 0, .. } = mode {
            bail!("the tree budget must be >= 1");
        }
        let drafter = match (drafter, block_size > 1) {
            (Some(d), true) => Some(d),
            (None, true) => bail!("{} needs a drafter", mode.name()),
            _ => None,
        };
        if let Some(d) = drafter {
            if block_size > d.block_size {
                tracing::warn!(
                    "block size {block_size} is larger than the drafter's trained block {}",
                    d.block_size
                );
            }
        }
        let taps: Vec<usize> = drafter
            .map(|d| d.target_layer_ids.clone())
            .unwrap_or_default();
        let mut sampler = Sampler::new(req.sampling);
        let max_len = req.prompt_ids.len() + req.max_new_tokens;

        let rows = verify_rows(mode);
        // the draft block as one graph: a round's context rows (at most a block) padded to a
        // block, then the block, after at most max_len rows
        let (cap, draft_cap) = (max_len + rows, max_len + 2 * block_size);
        let (cap, draft_cap) = if keep {
            (graph_cache::rounded(cap), graph_cache::rounded(draft_cap))
        } else {
            (cap, draft_cap)
        };
        let owner = graph_cache::owner(target, drafter);
        let kept = match kept {
            Some(k) if keep => k.take_for(owner, rows, block_size, cap, draft_cap)?,
            _ => None,
        };
        let reused = kept.is_some();
        let (mut cache, kept_graphed, kept_draft, kept_head) = match kept {
            Some(k) => (k.cache, Some(k.graphed), k.draft, k.head),
            None => (target.new_cache(), None, None, None),
        };

        let t0 = Instant::now();
        let out = target.forward_causal(&req.prompt_ids, &mut cache, &taps, &Rows::Last)?;
        let first = sampler.sample(&row(out.logits.as_ref().unwrap(), 0)?);
        let ctx = match drafter {
            Some(_) => Some(Target::concat_taps(&out.taps)?.unsqueeze(0)?),
            None => None,
        };
        let graphed = match (opts.cuda_graphs, kept_graphed) {
            (true, Some(g)) => Some(g),
            // chains (AR, DFlash) attend over each row's interval of keys; trees need the mask
            (true, None) => {
                let g = GraphedForward::new(&mut cache, cap, rows)?;
                Some(match mode {
                    Mode::Tree { .. } | Mode::Auto { .. } => g,
                    _ => g.chains(),
                })
            }
            _ => None,
        };
        let (mut draft_cache, draft_graph) = match kept_draft {
            Some((c, g)) => (Some(c), Some(g)),
            None => (drafter.map(|d| d.new_cache()), None),
        };
        let draft_graph = match (opts.cuda_graphs, drafter, draft_cache.as_mut(), draft_graph) {
            (true, _, _, Some(g)) => Some(g),
            (true, Some(_), Some(c), None) => Some(GraphedDraft::new(c, draft_cap, block_size)?),
            _ => None,
        };
        let prefill_secs = t0.elapsed().as_secs_f64();
        let mut loops = LoopDetector::new(req.loop_window);
        let looped = loops.push(first);
        // the kept head is the one the kept draft graph reads; a head built for this generation
        // alone also drafts the prompt's tokens (`DraftVocab::with_tokens`), one kept for later
        // generations (their graphs read its rows) the subset alone
        let head = match (kept_head, drafter.and_then(|d| d.draft_vocab.as_ref())) {
            (Some(h), _) => Some(h),
            (None, Some(v)) if keep || prompt_tokens_off() => Some(DraftHead::new(target, v)?),
            (None, Some(v)) => Some(DraftHead::new(target, &v.with_tokens(&req.prompt_ids))?),
            (None, None) => None,
        };
        Ok(Self {
            target,
            drafter,
            mode,
            req: req.clone(),
            taps,
            sampler,
            cache,
            graphed,
            draft_cache,
            draft_graph,
            keep,
            reused,
            head,
            ctx,
            // auto drafts greedy trees, which the exact match walks at T > 0
            acceptance: match mode {
                Mode::Auto { .. } => Acceptance::ExactMatch,
                _ => opts.acceptance,
            },
            sampled: None,
            device_round: None,
            read_back: None,
            one_sync: !opts.drafts_to_host && one_sync_on(),
            auto: match mode {
                Mode::Auto { max_budget, .. } => Some(AutoRound {
                    policy: dflash_core::auto::AutoPolicy::new(max_budget),
                    drafted: false,
                    budget: 0,
                    expected: 0.0,
                }),
                _ => None,
            },
            drafted: false,
            start: req.prompt_ids.len(),
            stopped: req.stop_ids.contains(&first) || looped,
            looped,
            loops,
            new_tokens: vec![first],
            rounds: Vec::new(),
            prefill_secs,
        })
    }

    /// The fixed-shape forwards for the next generation ([`GraphCache`]), when they are kept:
    /// the target's cache and verify graphs, and the drafter's cache and draft graph.
    fn take_kept(&mut self) -> Option<Kept> {
        if !self.keep {
            return None;
        }
        let graphed = self.graphed.take()?;
        let draft = match (self.draft_cache.take(), self.draft_graph.take()) {
            (Some(c), Some(g)) => Some((c, g)),
            _ => None,
        };
        Some(Kept {
            owner: graph_cache::owner(self.target, self.drafter),
            rows: verify_rows(self.mode),
            block: self.mode.block(),
            cache: std::mem::replace(&mut self.cache, KvCache::new(0)),
            graphed,
            draft,
            head: self.head.take(),
        })
    }

    /// The next round's depth (rows of its block, cut at the length cap), or `None` when the
    /// generation is done.
    fn next_depth(&self) -> Option<usize> {
        let max_len = self.req.prompt_ids.len() + self.req.max_new_tokens;
        (self.start + 1 < max_len && !self.stopped)
            .then(|| self.mode.block().min(max_len - self.start))
    }
}
