//! The chain decoding loop: AR (block 1) and DFlash (block B) are the same loop.
//!
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
//! **Why this is lossless.** Every committed token is a sample of the target's own rule
//! (greedy, or temperature/top-k/top-p) given exactly the committed prefix before it: `d_k` is
//! committed only if it equals the target's sample `t_k` at that prefix, and the bonus *is*
//! `t_k`. Rows after the first mismatch are never sampled, so each committed token consumes
//! one fresh draw, just as AR does; the drafts only decide how many of those draws one
//! target forward yields. At T = 0 the output therefore equals AR token for token; at T > 0
//! its distribution equals AR's (greedy drafts + exact match is rejection sampling with a
//! one-hot q: accept with prob min(1, p(d)/1) = p(d) — the probability that t_k = d_k).

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Tensor;
use dflash_core::sampling::{Sampler, SamplingParams};
use dflash_core::stats::RoundOutcome;
use dflash_core::visibility::causal;
use dflash_model::drafter::Drafter;
use dflash_model::{Rows, Target};

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_ids: Vec<u32>,
}

/// What one generation did: the new tokens and every round.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Generation {
    pub new_tokens: Vec<u32>,
    pub rounds: Vec<RoundOutcome>,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    pub stopped_by_token: bool,
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

/// Generate with the chain loop. `drafter = None` or `block_size = 1` is plain AR.
pub fn generate(target: &Target, drafter: Option<&Drafter>, block_size: usize, req: &Request) -> Result<Generation> {
    check_request(target, req)?;
    if block_size == 0 {
        bail!("block size must be >= 1");
    }
    let drafter = drafter.filter(|_| block_size > 1);
    if let Some(d) = drafter {
        if block_size > d.block_size {
            tracing::warn!("block size {block_size} is larger than the drafter's trained block {}", d.block_size);
        }
    }
    let taps: Vec<usize> = drafter.map(|d| d.target_layer_ids.clone()).unwrap_or_default();
    let mut sampler = Sampler::new(req.sampling);
    let n = req.prompt_ids.len();
    let max_len = n + req.max_new_tokens;

    // prefill: the whole prompt, causal, taps of every prompt row
    let t0 = Instant::now();
    let mut cache = target.new_cache();
    let positions: Vec<usize> = (0..n).collect();
    let out = target.forward(&req.prompt_ids, &positions, &causal(0, n), &mut cache, &taps, &Rows::Last)?;
    let first = sampler.sample(&row(out.logits.as_ref().unwrap(), 0)?);
    let mut ctx = if drafter.is_some() { Some(Target::concat_taps(&out.taps)?.unsqueeze(0)?) } else { None };
    let prefill_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut new_tokens = vec![first];
    let mut rounds = Vec::new();
    let mut draft_cache = drafter.map(|d| d.new_cache());
    let mut start = n; // position of the anchor
    let mut stopped = req.stop_ids.contains(&first);
    while start + 1 < max_len && !stopped {
        let anchor = *new_tokens.last().unwrap();
        let verify_size = block_size.min(max_len - start);
        // 1. draft
        let td = Instant::now();
        let drafts: Vec<u32> = match (drafter, verify_size > 1) {
            (Some(d), true) => {
                let logits = d.draft(
                    target,
                    draft_cache.as_mut().unwrap(),
                    ctx.as_ref().unwrap(),
                    anchor,
                    start,
                    verify_size,
                )?;
                Drafter::argmax_rows(&logits)?
            }
            _ => Vec::new(),
        };
        let draft_secs = td.elapsed().as_secs_f64();
        // 2. verify
        let tv = Instant::now();
        let mut block = vec![anchor];
        block.extend_from_slice(&drafts);
        let pos: Vec<usize> = (start..start + block.len()).collect();
        let out = target.forward(&block, &pos, &causal(cache.len(), block.len()), &mut cache, &taps, &Rows::All)?;
        let logits = out.logits.unwrap();
        let verify_secs = tv.elapsed().as_secs_f64();
        // 3. accept: the target's own sample at each row, until the first mismatch
        let to = Instant::now();
        let mut accepted = 0;
        let bonus = loop {
            let t = sampler.sample(&row(&logits, accepted)?);
            if accepted < drafts.len() && drafts[accepted] == t {
                accepted += 1;
            } else {
                break t;
            }
        };
        // 4. commit, cut at max_new_tokens and at the first stop token
        let mut produced_tokens: Vec<u32> = drafts[..accepted].to_vec();
        produced_tokens.push(bonus);
        let mut produced = produced_tokens.len().min(max_len - start - 1);
        if let Some(i) = produced_tokens[..produced].iter().position(|t| req.stop_ids.contains(t)) {
            produced = i + 1;
            stopped = true;
        }
        new_tokens.extend_from_slice(&produced_tokens[..produced]);
        start += produced;
        cache.truncate(start);
        if drafter.is_some() && verify_size > 1 {
            ctx = Some(Target::concat_taps(&out.taps)?.narrow(0, 0, produced)?.unsqueeze(0)?);
        }
        rounds.push(RoundOutcome {
            drafted: drafts.len(),
            accepted,
            tau_round: produced,
            bonus: (produced == accepted + 1).then_some(bonus),
            draft_secs,
            verify_secs,
            other_secs: to.elapsed().as_secs_f64(),
            tree_size: None,
        });
    }
    Ok(Generation {
        new_tokens,
        rounds,
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
        stopped_by_token: stopped,
    })
}
