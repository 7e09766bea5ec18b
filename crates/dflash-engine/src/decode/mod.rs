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
//!
//! **Proposers.** Each method is a type (module `proposers`): `Ar` (the anchor alone), `Chain`
//! (DFlash), `Selector` (DFlash2's chain), `Tree` (DDTree) and `Auto` (`--mode auto`'s policy,
//! choosing a budget each round). A proposer returns a `Proposal`: the tree and how the walk
//! judges it (`Judge`: the target's own token per row, a sampled chain or tree with its `q`s,
//! or a round on the device), so that the verify and the walk read the proposal, not the mode.
//! `Decoding` holds the loop's state (caches, context features, sampler, tokens, rounds, fixed-
//! shape forwards); a [`Session`] pairs it with its proposer, and the server's speculative
//! requests are sessions too. Example: `--mode dflash`, B = 4, T = 0, a drafter without a
//! selector → `Chain` stages the verify of `[x, x, x, x]`, keeps its drafts (a, b, c) on the
//! device and returns `Judge::Device`; the verify reads back `[a, b, c, a, b, z, ·]` (the drafts,
//! then the target's arg-max per row) and the walk commits [a, b, z].

use anyhow::{bail, Result};
use candle_core::Tensor;
use dflash_core::loops::LoopDetector;
use dflash_core::sampling::{Sampler, SamplingParams};
use dflash_core::stats::RoundOutcome;
use dflash_core::tree::DraftTree;
use dflash_model::cuda::graphed::GraphedForward;
use dflash_model::cuda::graphed_draft::GraphedDraft;
use dflash_model::models::draft_vocab::DraftHead;
use dflash_model::models::drafter::Drafter;
use dflash_model::{KvCache, Target};

use crate::graph_cache::GraphCache;
pub use crate::mode::Mode;

mod decoding;
mod proposal;
mod proposers;
mod session;
mod spec_batch;
mod verify;

use proposal::{Judge, Proposal};
pub use session::Session;
pub use spec_batch::{generate_spec_batched, SlotRound, SpecBatch};

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
/// or a stop token. Modes other than [`Mode::Ar`] need a drafter. With `graphs`, the
/// generation starts from the fixed-shape forwards kept there (with
/// [`DecodeOptions::cuda_graphs`]: the caches at a fixed capacity and their CUDA graphs) and
/// leaves its own for the next generation of the same target, drafter and mode
/// ([`crate::graph_cache`]); the tokens are the same with or without.
pub fn generate(
    target: &Target,
    drafter: Option<&Drafter>,
    mode: Mode,
    req: &Request,
    opts: DecodeOptions,
    mut graphs: Option<&mut GraphCache>,
) -> Result<Generation> {
    let mut session = Session::start(target, drafter, mode, req, opts, graphs.as_deref_mut())?;
    while session.round()?.is_some() {}
    Ok(session.finish(graphs))
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

/// The drafter's side of a generation: its cache, its fixed-shape block, its vocabulary head
/// and the context features it has not seen yet.
struct Drafting<'a> {
    drafter: &'a Drafter,
    cache: KvCache,
    /// The draft block's fixed-shape forward (`--cuda-graphs`).
    graph: Option<GraphedDraft>,
    /// The drafter's vocabulary head (its drafts' subset), once per decode.
    head: Option<DraftHead>,
    /// Context features committed since the drafter last ran, `[1, m, taps × hidden]`.
    ctx: Tensor,
}

/// The state of one generation between rounds: what every method's loop shares. How a round
/// proposes is its proposer's ([`proposers`]); what the walk needs travels in the proposal.
/// Between rounds the target cache holds the committed rows up to the anchor, which is not in
/// it: `cache.len() == start`. Example: a 20-token prompt → `start` 20, `new_tokens` [x];
/// a round that commits [a, b, z] → `start` 23, `new_tokens` [x, a, b, z], 23 cache rows.
struct Decoding<'a> {
    target: &'a Target,
    /// The drafter's side, when the mode drafts (block > 1).
    drafting: Option<Drafting<'a>>,
    req: Request,
    taps: Vec<usize>,
    sampler: Sampler,
    cache: KvCache,
    /// Fixed-shape verify forwards (`--cuda-graphs`).
    graphed: Option<GraphedForward>,
    /// Whether the fixed-shape forwards go back to a [`GraphCache`] at the end
    /// ([`Decoding::take_kept`] gathers them), and whether they came from one.
    keep: bool,
    reused: bool,
    /// Rows of a round's block and of every verify (a tree's budget plus its root): the
    /// shape of the fixed-shape forwards.
    block: usize,
    rows: usize,
    /// The acceptance at T > 0 (`--mode auto`: the exact match, its trees are greedy).
    acceptance: Acceptance,
    /// Whether rounds stay on the device where they can (`DFLASH_DISABLED_KERNELS=one-sync`: no).
    one_sync: bool,
    /// Whether the verify is this generation's own forward, which a chain's round on the
    /// device stages before its draft; not in a speculative batch, whose one verify is every
    /// slot's ([`SpecBatch`]): its draws still happen on the device.
    own_verify: bool,
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
